# Set-up is one idempotent target: a .venv with the exact torch pin first (a CPU wheel where one lies on
# disk; TORCH_SPEC overrides it, e.g. for a CUDA build), then every other package from the lock file.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: install run test test-fast clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: install
	$(BIN)/omni run recipes/quickstart.yaml $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The unit tier only (tests/unit: pure CPU, seconds), for the edit loop; `make test` runs every tier.
test-fast: install
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

clean:
	rm -rf runs mlflow.db mlartifacts .pytest_cache
