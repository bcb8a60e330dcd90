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

.PHONY: install run test test-fast lint clean gpu-wheels

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

# The tiers run as two pytest streams at once (tests/run-streams), which keep both cores of a 2-core machine busy
# where one pytest leaves one idle most of the time; every tier is in one stream (tests/unit/test_suite_streams.py).
TEST_STREAMS := "unit or ranks" "integration or flows"

# tests/system-packages installs the system programs the integration tier needs (PostgreSQL, Slurm, MUNGE) where absent.
test: install
	tests/system-packages
	PYTHON=$(BIN)/python tests/run-streams $(TEST_STREAMS) -- $(PYTEST_ARGS)

# The unit tier only (tests/unit: pure CPU, seconds), for the edit loop; `make test` runs every tier.
test-fast: install
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

# ruff's lint and format and mypy over omni_core/ and flows/ (make test runs them too, in tests/unit/test_hygiene.py).
lint: install
	$(BIN)/ruff check omni_core flows
	$(BIN)/ruff format --check omni_core flows
	$(BIN)/mypy

# The wheels benchmarks/gpu_check.py needs on a GPU machine without network, into .gpu-wheels (README.md, "On a GPU").
gpu-wheels:
	benchmarks/gpu_wheels.sh

clean:
	rm -rf runs mlflow.db mlartifacts .pytest_cache
