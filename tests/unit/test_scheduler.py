"""Scheduler: cluster placement, trace readers, policies on hand-made clusters with known best answers,
simulator conservation and determinism, and `omni simulate` (tracking to MLflow:
tests/flows/test_scheduler_flows.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omni_core.recipe import RecipeError
from omni_core.recipe.schedule_sections import ClusterConfig, NodeGroup
from omni_core.scheduler import POLICIES, Cluster, GroupSpec, Job, ThroughputTable, make_policy, simulate
from omni_core.scheduler.policies.base import View
from omni_core.scheduler.policies.crius import CRIUS_SEARCH_S
from omni_core.scheduler.policies.gavel import Gavel
from omni_core.scheduler.report import format_table, summary
from omni_core.scheduler.study import load_study, replicate, scale_jobs, scaled
from omni_core.scheduler.traces import RawJob, detect_format, load_trace, map_raw_jobs, read_crius, read_raw
from tests.helpers.oracles import TableOracle, linear
from tests.helpers.recipes import write_recipe


def cluster(**groups: tuple[int, int]) -> Cluster:
    return Cluster({t: GroupSpec(t, nodes, per) for t, (nodes, per) in groups.items()})


def view(c: Cluster, oracle, jobs, current=None, remaining=None, now=0.0, restart_s=0.0) -> View:
    table = ThroughputTable(oracle, c.capacity(), 8)
    return View(now, jobs, current or {}, remaining or {j.id: 1e9 for j in jobs}, table, c, restart_s=restart_s)


def decide(policy: str, c: Cluster, oracle, jobs, current=None, remaining=None, now=0.0) -> dict:
    return make_policy(policy).decide(view(c, oracle, jobs, current, remaining, now))


# --- cluster ------------------------------------------------------------------------------------------------

def test_placement_packs_into_fewest_nodes_and_repacks_fragmented_groups():
    c = cluster(a=(4, 4))
    assert c.place("small", "a", 2) == (0, 0)
    assert c.place("fill", "a", 2) == (0, 0)  # best fit: the partly used node, not a fresh one
    assert set(c.place("big", "a", 8)) == {1, 2}  # whole free nodes
    assert c.place("odd", "a", 1) == (3,)
    assert c.place("too-big", "a", 8) is None  # one whole node is left: 4 GPUs free but not 8 in two nodes
    assert c.fragmentation() == pytest.approx(1.0)  # every free GPU sits on a partly used node
    c.check()
    c.release("small")
    moved, left = c.apply({"fill": ("a", 2), "big": ("a", 8), "odd": ("a", 1), "new": ("a", 4)}, migrate=True)
    assert not left and moved  # node 0 and 3 each had 2 and 3 free: "new" needs a whole node, so jobs moved
    c.check()
    assert sorted(len(nodes) for _, nodes in c.placements.values()) == [1, 2, 4, 8]


@pytest.mark.parametrize("migrate", [False, True])
def test_departures_fragment_a_group_and_only_migration_undoes_it(migrate):
    c = cluster(a=(2, 2))
    for job in "abcd":
        c.place(job, "a", 1)  # a, b on node 0; c, d on node 1
    c.release("b")
    c.release("d")
    moved, left = c.apply({"a": ("a", 1), "c": ("a", 1), "z": ("a", 2)}, migrate=migrate)
    if migrate:
        assert not left and len(moved) == 1 and len(set(c.placements["z"][1])) == 1
    else:
        assert left == {"z"} and not moved and set(c.placements) == {"a", "c"}
    c.check()


def test_conservation_check_catches_double_booking():
    c = cluster(a=(1, 2))
    c.place("x", "a", 2)
    c.free["a"][0] = 1  # corrupt: a GPU both used and free
    with pytest.raises(AssertionError, match="double-booked"):
        c.check()


def test_cluster_from_recipe_config_rejects_odd_node_sizes():
    cfg = ClusterConfig(node_groups=[NodeGroup(gpu_type="a100", nodes=2, gpus_per_node=4, interconnect="ib")])
    assert Cluster.from_config(cfg).total_gpus == 8
    with pytest.raises(ValueError, match="power of two"):
        Cluster.from_config(ClusterConfig(node_groups=[NodeGroup(gpu_type="x", nodes=1, gpus_per_node=3)]))


# --- policies: known best answers ----------------------------------------------------------------------------

def test_gavel_max_min_shares_equalise_normalised_throughput_and_rounds_take_turns():
    # A is 4x faster on the fast GPU, B 1.2x. Normalised by each job's throughput with its time split equally
    # over both types (2.5 and 1.1), half of each GPU type each gives both 1.0: the max-min optimum (A alone on
    # the fast GPU gives B only 0.91). Time slicing realises the shares: the jobs swap GPUs every round.
    oracle = TableOracle({**linear("A", {"fast": 4.0, "slow": 1.0}), **linear("B", {"fast": 1.2, "slow": 1.0})})
    jobs = [Job(j, j.upper(), 8, 100, 0, gpu_type="fast", num_gpus=1) for j in ("b", "a")]
    c = cluster(fast=(1, 1), slow=(1, 1))
    gavel = Gavel()
    first = gavel.decide(view(c, oracle, jobs))
    shares = {job: np.round(share, 6).tolist() for job, share in gavel._share.items()}
    assert shares == {"a": [0.5, 0.5], "b": [0.5, 0.5]}
    assert sorted(first.values()) == [("fast", 1), ("slow", 1)]
    second = gavel.decide(view(c, oracle, jobs, current=first, now=300.0))
    assert second == {j: ("slow" if t == "fast" else "fast", n) for j, (t, n) in first.items()}


def test_fcfs_takes_the_user_request_in_arrival_order_and_never_preempts():
    oracle = TableOracle(linear("M", {"a": 1.0, "b": 3.0}))
    jobs = [Job("1", "M", 8, 100, 0, gpu_type="a", num_gpus=2), Job("2", "M", 8, 100, 1, gpu_type="a", num_gpus=4),
            Job("3", "M", 8, 100, 2, gpu_type="a", num_gpus=2)]
    # job 2 does not fit next to job 1 (4 GPUs of type a in all); job 3 does: no head-of-line blocking
    assert decide("fcfs", cluster(a=(2, 2), b=(2, 2)), oracle, jobs) == {"1": ("a", 2), "3": ("a", 2)}
    busy = cluster(a=(2, 2), b=(2, 2))
    busy.place("2", "a", 4)
    assert decide("fcfs", busy, oracle, jobs, current={"2": ("a", 4)}) == {"2": ("a", 4)}


def test_crius_grows_a_lone_job_while_it_gains_and_uses_memory_hungry_plans():
    # Big fits one GPU only with a non-DP plan; more GPUs help until 4 (8 is slower: communication).
    rates = {("Big", "a", 1): (2.0, None), ("Big", "a", 2): (3.8, 3.0), ("Big", "a", 4): (7.0, 6.0),
             ("Big", "a", 8): (6.5, 6.0)}
    c = cluster(a=(2, 4))
    job = [Job("j", "Big", 8, 100, 0, num_gpus=1)]
    assert decide("crius", c, TableOracle(rates), job) == {"j": ("a", 4)}
    # Gavel keeps the user's one GPU, where data parallelism does not fit: the job cannot start
    assert decide("gavel", c, TableOracle(rates), job) == {}


def test_crius_maximises_cluster_samples_per_second_across_gpu_types():
    # X gains 5 samples/s on the fast GPU, Y 1.5: the fast GPU goes to X (10 + 0.5 samples/s, not 2 + 5),
    # though Y gains the larger share of its own best rate there (the Crius artifact's gains are samples/s)
    oracle = TableOracle({("X", "fast", 1): (10.0, 10.0), ("X", "slow", 1): (5.0, 5.0),
                          ("Y", "fast", 1): (2.0, 2.0), ("Y", "slow", 1): (0.5, 0.5)})  # fmt: skip
    jobs = [Job("y", "Y", 8, 100, 0), Job("x", "X", 8, 100, 0)]
    assert decide("crius", cluster(fast=(1, 1), slow=(1, 1)), oracle, jobs) == {"x": ("fast", 1), "y": ("slow", 1)}


def test_crius_shrinks_a_running_job_so_a_waiting_one_can_start():
    oracle = TableOracle(linear("M", {"a": 1.0}, eff=0.8))
    jobs = [Job("old", "M", 8, 100, 0), Job("new", "M", 8, 100, 1)]
    alloc = decide("crius", cluster(a=(1, 4)), oracle, jobs, current={"old": ("a", 4)})
    assert alloc == {"old": ("a", 2), "new": ("a", 2)}


def test_crius_admits_a_waiting_job_once_its_wait_outweighs_the_shrink_loss():
    # Linear jobs: halving the running one loses as much as the waiting one gains, and the restart makes the
    # shrink a net loss, so at arrival the waiting job waits; its response ratio (1 + waited / run) then
    # grows until the shrink pays, after about the loss over its value times its run (here about an hour).
    oracle = TableOracle(linear("M", {"a": 1.0}, counts=(1, 2, 4)))
    jobs = [Job("old", "M", 1, 10**6, 0), Job("new", "M", 1, 3600, 100.0)]
    c = cluster(a=(1, 4))
    remaining = {"old": 1e6, "new": 3600.0}
    at = {now: make_policy("crius").decide(view(c, oracle, jobs, {"old": ("a", 4)}, remaining, now, restart_s=60.0))
          for now in (100.0, 100.0 + 2 * 3600)}
    assert at[100.0] == {"old": ("a", 4)}
    assert at[100.0 + 2 * 3600] == {"old": ("a", 2), "new": ("a", 2)}


# --- simulator --------------------------------------------------------------------------------------------------

def test_single_job_finishes_at_the_predicted_time():
    oracle = TableOracle(linear("M", {"a": 2.0}))
    c = cluster(a=(1, 1))
    job = Job("j", "M", global_batch=4, iterations=1000, arrival_s=0.0)  # 4,000 samples at 2/s: 2,000 s
    plan = simulate([job], c, make_policy("crius"), ThroughputTable(oracle, c.capacity(), 8), round_s=300,
                    rounds=100, restart_s=60)
    finish = 2000.0 + 60 + CRIUS_SEARCH_S[0]  # restore and the plan search on one GPU before it trains
    assert plan.jobs[0].finish_s == pytest.approx(finish)
    assert plan.metrics.jobs_finished == 1 and plan.metrics.mean_jct_s == pytest.approx(finish)
    assert plan.metrics.rounds == 7 and plan.segments[0].plan == "dp1"


def test_fixed_horizon_and_the_busy_round_average():
    oracle = TableOracle(linear("M", {"a": 2.0}))
    c = cluster(a=(1, 1))
    job = Job("j", "M", global_batch=4, iterations=1000, arrival_s=0.0)
    table = ThroughputTable(oracle, c.capacity(), 8)
    plan = simulate([job], c, make_policy("crius"), table, round_s=300, rounds=20, fixed_horizon=True,
                    busy_min_throughput=1.0)
    m = plan.metrics
    assert m.rounds == 20 and m.jobs_finished == 1  # the idle rounds after the job ends still count
    tput = np.array(plan.series["throughput"])
    assert m.mean_throughput == pytest.approx(tput.mean())
    assert m.busy_throughput == pytest.approx(tput[tput > 1.0].mean()) and m.busy_throughput > 2 * m.mean_throughput
    row = summary(m)
    assert {"mean_throughput", "busy_throughput", "mean_jct_h", "mean_queueing_h"} <= set(row)
    table_text = format_table({"crius": plan})
    assert "busy tput/s" in table_text and "tput/s" in table_text.replace("busy tput/s", "")


def toy_jobs(n: int, seed: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    return [Job(f"j{i}", str(rng.choice(["M", "N"])), 8, int(rng.integers(50, 3000)), float(rng.integers(0, 20000)),
                gpu_type=str(rng.choice(["a", "b"])), num_gpus=int(rng.choice([1, 2, 4]))) for i in range(n)]


TOY = TableOracle({**linear("M", {"a": 2.0, "b": 1.0}, eff=0.9), **linear("N", {"a": 1.0, "b": 0.9}, eff=0.95)})


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_conservation_every_job_accounted_and_no_gpu_double_booked(policy):
    jobs = toy_jobs(60, seed=1) + [Job("ghost", "Unknown", 8, 10, 5.0)]
    c = cluster(a=(2, 4), b=(4, 2))
    plan = simulate(jobs, c, make_policy(policy), ThroughputTable(TOY, c.capacity(), 8), round_s=300, rounds=400)
    m = plan.metrics
    assert m.unmodelled == 1 and m.jobs == 61
    assert m.jobs_finished + sum(r.finish_s is None for r in plan.jobs) == m.jobs
    assert m.jobs_finished == 60  # enough rounds for everything modelled
    for gpu_type, capacity in c.capacity().items():  # at no instant more GPUs of a type in use than exist
        edges = sorted([(s.start_s, s.num_gpus) for s in plan.segments if s.gpu_type == gpu_type]
                       + [(s.end_s, -s.num_gpus) for s in plan.segments if s.gpu_type == gpu_type],
                       key=lambda e: (e[0], e[1]))
        assert max(np.cumsum([d for _, d in edges]), default=0) <= capacity
    assert c.placements == {}
    assert m.decisions > 0


def test_simulation_is_deterministic():
    def run():
        c = cluster(a=(2, 4), b=(4, 2))
        p = simulate(toy_jobs(40, seed=3), c, make_policy("crius"), ThroughputTable(TOY, c.capacity(), 8), rounds=200)
        timings = {"wall_s", "cpu_s", "p50_decision_s", "p95_decision_s", "max_decision_s"}
        return p.model_dump(exclude={"metrics": timings})

    assert run() == run()


def test_crius_beats_fcfs_when_users_ask_for_the_wrong_gpus():
    jobs = [Job(f"j{i}", "M", 8, 2000, float(i * 100), gpu_type="b", num_gpus=4) for i in range(20)]
    results = {}
    for policy in ("crius", "fcfs"):
        c = cluster(a=(2, 4), b=(1, 4))
        results[policy] = simulate(jobs, c, make_policy(policy), ThroughputTable(TOY, c.capacity(), 8), rounds=300).metrics
    assert results["crius"].mean_jct_s < results["fcfs"].mean_jct_s
    assert results["crius"].mean_utilisation > results["fcfs"].mean_utilisation


# --- traces -------------------------------------------------------------------------------------------------------

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
CRIUS_HEADER = "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,gpu_type\n"


def test_malformed_rows_are_reported_with_file_and_line(tmp_path: Path):
    crius = tmp_path / "crius.csv"
    crius.write_text(CRIUS_HEADER + "ok,10,100,M,500,8,2,a\n"
                     "missing,20,,M,500,8,2,a\n"            # line 3: no iterations
                     "unknown,30,100,M,500,8,2,tpu\n"       # line 4: GPU type not in the cluster
                     "neg,-5,100,M,500,8,2,a\n")            # line 5: negative arrival
    trace = read_crius(crius, {"a", "b"})
    assert [j.id for j in trace.jobs] == ["ok"] and trace.rows == 4
    assert [(i.line, i.message.split()[0]) for i in trace.issues] == [(3, "missing"), (4, "unknown"), (5, "submission_time=-5")]
    assert str(trace.issues[0]).startswith(f"{crius}:3: ")

    itp = tmp_path / "itp.csv"
    itp.write_text("job_id,submission_time,duration,num_gpu\nx,0,100,1\ny,5,-3,1\nz,9,100,two\n")
    raw, issues, rows = read_raw(itp, "itp")
    assert rows == 3 and [r.id for r in raw] == ["x"]
    assert [(i.line, i.message) for i in issues] == [(3, "duration=-3 is negative"), (4, "num_gpu='two' is not a number")]

    philly = tmp_path / "philly.csv"
    philly.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09 07:01:55,66.0,1,66.0,c\n"
                      "yesterday,66.0,1,66.0,c\n")
    assert detect_format(philly) == "philly"
    raw, issues, _ = read_raw(philly, "philly")
    assert len(raw) == 1 and issues[0].line == 3 and "timestamp" in issues[0].message


def test_raw_trace_mapping_is_seeded_and_keeps_the_raw_duration():
    oracle = TableOracle({**{(m, t, n): (float(n), float(n)) for m in ("moe__2.4B", "bert__1.3B")
                             for t in ("a", "b") for n in (1, 2, 4, 8)}})
    table = ThroughputTable(oracle, {"a": 8, "b": 8}, 8)
    raw = [RawJob(f"r{i}", 100.0 * i + 50, 1000.0, 1 + i % 3) for i in range(200)]
    first, again = map_raw_jobs(raw, table, seed=7, keep=0.5), map_raw_jobs(raw, table, seed=7, keep=0.5)
    assert first == again and 60 < len(first) < 140
    assert first != map_raw_jobs(raw, table, seed=8, keep=0.5)
    assert first[0].arrival_s == 0.0
    for job in first:
        if table.modelled(job):
            rate = table.rate(job, (job.gpu_type, job.num_gpus))
            assert job.samples / rate == pytest.approx(1000.0, rel=0.01 + job.global_batch / (rate * 1000))
            assert job.num_gpus in (1, 2, 4)


def test_a_trace_gpu_type_maps_to_the_clusters_and_the_crius_study_runs_the_40gb_a100(tmp_path: Path):
    from omni_core.common.catalog import GpuCatalog
    from omni_core.recipe import load_located

    crius = tmp_path / "crius.csv"
    crius.write_text(CRIUS_HEADER + "x,10,100,M,500,8,2,A100\ny,20,100,M,500,8,2,a\n")
    trace = read_crius(crius, {"a100-40gb", "a"}, {"a100": "a100-40gb"})
    assert [j.gpu_type for j in trace.jobs] == ["a100-40gb", "a"] and not trace.issues
    assert "unknown GPU type 'a100'" in read_crius(crius, {"a100-40gb", "a"}).issues[0].message  # unmapped
    table = ThroughputTable(TOY, {"a100-40gb": 8, "a": 8}, 8)
    with pytest.raises(ValueError, match=r"trace_gpu_types maps onto \['a100-80gb'\]"):
        load_trace(crius, table, gpu_type_names={"a100": "a100-80gb"})
    itp = tmp_path / "itp.csv"
    itp.write_text("job_id,submission_time,duration,num_gpu\nx,0,100,1\n")
    with pytest.raises(ValueError, match="the itp trace names no GPU types"):
        load_trace(itp, table, gpu_type_names={"a100": "a100-40gb"})
    # the Crius artifact's A100 is 40 GB (resources/hardware_specs.py): the study runs the catalogue's 40 GB part
    recipe, _ = load_located(Path(__file__).resolve().parents[2] / "recipes" / "crius_study.yaml")
    assert recipe.schedule.trace_gpu_types == {"a100": "a100-40gb"}
    a100 = [g.gpu_type for g in recipe.cluster.node_groups if g.gpu_type.startswith("a100")]
    assert a100 == ["a100-40gb"] and 39 < GpuCatalog()["a100-40gb"].mem_gb * 1e9 / 2**30 < 40  # 39.59 GiB usable
    # a mapping onto a type the cluster lacks is refused when the recipe is read, naming the field
    from omni_core.recipe.loader import RecipeError, override_recipe

    with pytest.raises(RecipeError, match=r"schedule.trace_gpu_types maps onto \['h900'\]"):
        override_recipe(recipe, ["schedule.trace_gpu_types={a100: h900}"])


def test_load_trace_reads_the_real_crius_trace():
    path = TRACES / "crius" / "simulate_trace_philly.csv"  # its first 200 jobs (tests/data/README.md)
    table = ThroughputTable(TOY, {"a100": 320, "v100": 320, "a40": 320, "a10": 320}, 32)
    trace = load_trace(path, table)
    assert trace.format == "crius" and trace.rows == 200 and len(trace.jobs) == 200 and not trace.issues
    assert trace.jobs[0].arrival_s == 0.0


# --- CLI ----------------------------------------------------------------------------------------------------------

def test_omni_simulate_cli(tmp_path: Path, capsys):
    from flows.cli import main

    recipe = write_recipe(tmp_path / "sim.yaml", {
        "experiment.name": "sim-test",
        "cluster.node_groups": [{"gpu_type": "a100", "nodes": 2, "gpus_per_node": 4},
                                {"gpu_type": "a10", "nodes": 2, "gpus_per_node": 2}],
        "jobs": [{"name": "a", "model": "bert__760M", "global_batch": 128, "iterations": 300, "gpu_type": "a10",
                  "num_gpus": 2},
                 {"name": "b", "model": "moe__690M", "global_batch": 128, "iterations": 300, "arrival_s": 400,
                  "gpu_type": "a100", "num_gpus": 4},
                 {"name": "c", "model": "no_such__1B", "global_batch": 128, "iterations": 10}],
        "schedule.policies": ["crius", "fcfs"], "schedule.max_rounds": 50,
    }, tmp_path)  # fmt: skip
    assert main(["simulate", str(recipe), "--no-track", "--json", "--out", str(tmp_path / "out")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"crius", "fcfs"}
    for metrics in result.values():
        assert metrics["jobs_finished"] == 2 and metrics["unmodelled"] == 1
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {
        "schedule_crius.json", "schedule_fcfs.json", "throughput.png", "utilisation.png", "gantt_crius.png", "summary.txt"}
    assert main(["simulate", str(recipe), "--no-track", "--trace", str(tmp_path / "missing.csv")]) == 2


# --- studies: recipe options, trace paths, scaling -------------------------------------------------------------

def study_recipe(folder: Path, schedule: str, name: str = "study.yaml") -> Path:
    """A study written as YAML text, not built: these tests read the loader's own work on a file, a value out of
    bounds named at its line and a trace path resolved against the file that wrote it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"""\
experiment: {{name: study-test, output_dir: {folder}}}
cluster: {{node_groups: [{{gpu_type: a, nodes: 1, gpus_per_node: 4}}, {{gpu_type: b, nodes: 2, gpus_per_node: 2}}]}}
jobs: [{{name: j, model: M, global_batch: 8, iterations: 100, arrival_s: 50}}]
schedule: {schedule}
""")
    return path


def test_a_recipe_trace_path_resolves_against_the_recipe_file(tmp_path: Path, monkeypatch):
    trace = tmp_path / "study" / "traces" / "t.csv"
    trace.parent.mkdir(parents=True)
    trace.write_text(CRIUS_HEADER + "x,10,100,M,500,8,2,a\ny,40,100,M,900,8,1,b\n")
    parent = study_recipe(tmp_path / "study", "{trace: traces/t.csv, trace_format: crius}", "parent.yaml")
    child = tmp_path / "elsewhere" / "child.yaml"
    child.parent.mkdir()
    child.write_text(f"extends: {Path('..') / 'study' / 'parent.yaml'}\nexperiment: {{name: child}}\n")
    monkeypatch.chdir(tmp_path / "elsewhere")  # neither recipe's folder
    for recipe in (parent, child):  # the child inherits the path, written in the parent's folder
        study = load_study(recipe, oracle=TOY)
        assert study.source == str(trace) and [j.id for j in study.jobs] == ["x", "y"]
    # a path given on the command line is the user's, relative to where they are
    assert load_study(parent, ["schedule.trace=../study/traces/t.csv"], oracle=TOY).source == "../study/traces/t.csv"
    (tmp_path / "study" / "traces" / "t.csv").unlink()
    with pytest.raises(RecipeError) as error:
        load_study(parent, oracle=TOY)
    assert f"{parent}:" in str(error.value) and "schedule.trace: no such file" in str(error.value)


@pytest.mark.parametrize("field, value", [("iteration_scale", 0.5), ("arrival_compression", 0),
                                          ("busy_min_throughput", -1), ("fixed_horizon", "'yes'")])
def test_study_options_out_of_bounds_name_the_file_and_field(tmp_path: Path, field, value):
    path = study_recipe(tmp_path, f"{{{field}: {value}}}")
    with pytest.raises(RecipeError, match=f"{path}:\\d+: schedule.{field}: "):
        load_study(path, oracle=TOY)


def test_study_conventions_scale_iterations_and_arrivals_and_scaled_studies_grow_together(tmp_path: Path):
    path = study_recipe(tmp_path, "{iteration_scale: 5, arrival_compression: 10, fixed_horizon: true, max_rounds: 7}")
    study = load_study(path, oracle=TOY)
    assert [(j.iterations, j.arrival_s) for j in study.jobs] == [(20, 5.0)]
    assert study.run("crius").metrics.rounds == 7  # the fixed horizon, though the job ends in the first round
    assert scale_jobs(study.jobs, iteration_scale=1000)[0].iterations == 1  # never zero
    big = scaled(study, 4)
    assert big.table.capacity.tolist() == [16, 16] and [j.id for j in big.jobs] == ["j", "j#1", "j#2", "j#3"]
    assert replicate(study.jobs, 1) == study.jobs
