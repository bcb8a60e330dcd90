"""The baselines as their sources define them: Sia's two variants (`sia`, the paper's; `sia-artifact`, the Crius
artifact's), Gavel's throughput matrix, the study conventions every policy keeps (the GPU-count rule, Sia's
own round, the plan search's charge) and the jobs a policy can never admit, counted in the report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni_core.scheduler import POLICIES, Cluster, GroupSpec, Job, ThroughputTable, make_policy, simulate
from omni_core.scheduler.policies import pollux
from omni_core.scheduler.policies.base import View
from omni_core.scheduler.policies.gavel import Gavel
from omni_core.scheduler.policies.sia import Sia
from omni_core.scheduler.policies.sia_artifact import SiaArtifact
from omni_core.scheduler.report import format_table, summary
from omni_core.scheduler.study import load_study
from tests.helpers.oracles import TableOracle, linear


def cluster(**groups: tuple[int, int]) -> Cluster:
    return Cluster({t: GroupSpec(t, nodes, per) for t, (nodes, per) in groups.items()})


def view(c: Cluster, table: ThroughputTable, jobs, current=None, now=0.0, restart_s=0.0) -> View:
    return View(now, jobs, current or {}, {j.id: 1e9 for j in jobs}, table, c, restart_s=restart_s)


def test_the_oracle_prices_replicas_of_a_unit_without_sharding_them():
    from omni_core.common.catalog import GpuCatalog
    from omni_core.estimator.oracle import CellOracle, ReplicaPlan

    oracle = CellOracle(GpuCatalog(), {"a100": 4})
    plain = oracle.replicated("moe__10B", 512, "a100", 16)
    assert oracle.throughput("moe__10B", 512, "a100", 16) > 0  # the searched plans shard it
    assert plain is not None and plain.samples_per_s == 0.0 and plain.mem_share > 1  # replicas do not fit
    small = oracle.replicated("bert__760M", 128, "a100", 4)
    assert small is not None and small.samples_per_s > 0 and small.peak_mem_bytes < plain.peak_mem_bytes
    assert oracle.replicated("bert__760M", 128, "a100", 8, ReplicaPlan((8, 1))) is None  # TP across nodes: no such plan
    assert oracle.replicated("bert__760M", 128, "a100", 6, ReplicaPlan((4, 1))) is None  # not whole replicas


# --- Sia, the paper's ---------------------------------------------------------------------------------------

# "Wide" needs two GPUs per replica on type a (TP 2 beats PP 2 there) and fits nowhere on type b. Its own plan
# scales to 19 samples/s on two replicas and collapses to 20 on four, which Sia cannot know before it runs there.
WIDE = TableOracle(
    {("Wide", "a", n): (12.0 * n, None) for n in (1, 2, 4, 8)} | {("Wide", "b", n): (1.0 * n, None) for n in (1, 2)},
    units={("Wide", "a", 2, (2, 1)): 10.0, ("Wide", "a", 2, (1, 2)): 8.0, ("Wide", "a", 4, (2, 1)): 19.0,
           ("Wide", "a", 8, (2, 1)): 20.0, ("Wide", "a", 4, (1, 4)): 9.0},
)  # fmt: skip


def test_pollux_fit_recovers_a_known_model_and_holds_what_nothing_informs():
    truth = pollux.PerfParams(0.01, 0.002, 0.05, 0.004, 0.02, 0.002, 1.0)
    configs = [(1, 1, b) for b in (1, 2, 4, 8, 16, 32)] + [(1, 2, 16), (1, 4, 8), (2, 8, 4), (4, 16, 2)]
    observed = []
    for nodes, r, b in configs:
        accum = truth.alpha_c + truth.beta_c * b
        net = pollux.network_seconds(np.array(truth), np.array(nodes), np.array(r))
        observed.append(pollux.Observation(nodes, r, b, accum, accum + float(net)))
    fitted = pollux.fit(observed)
    nodes, r = np.array([1, 1, 2, 4]), np.array([2, 4, 8, 16])
    want = pollux.samples_per_s(truth, 32, 32, nodes, r)
    assert pollux.samples_per_s(fitted, 32, 32, nodes, r) == pytest.approx(want, rel=0.05)
    # one replica only: no network term can be learned, so replicas scale the compute alone (Pollux's prior)
    alone = pollux.fit(observed[:6])
    assert alone.alpha_r == alone.beta_r == pollux.TINY and alone.gamma >= 1.0
    assert pollux.samples_per_s(alone, 32, 32, np.array([1]), np.array([2]))[0] == pytest.approx(
        32 / (alone.alpha_c + alone.beta_c * 16), rel=1e-3
    )


def test_sia_scales_replicas_of_a_fixed_unit_on_a_model_it_fits_to_what_it_measured():
    c = cluster(a=(2, 4), b=(1, 2))
    table = ThroughputTable(WIDE, c.capacity(), 8)
    job = Job("w", "Wide", 8, 100, 0.0)
    sia = Sia()
    assert sia.units(table, job) == [(2, 1), None]  # the smallest unit that fits, the faster shape of that size
    now = sia.constants.profile_s
    # profiled on idle GPUs since its arrival: its unit alone, one replica on type a; never half a unit
    assert np.isnan(sia.estimate(view(c, table, [job], now=now), job)[0]).tolist() == [True, False, True, True]
    assert sia.decide(view(c, table, [job], now=now)) == {"w": ("a", 2)}
    assert np.isnan(sia.estimate(view(c, table, [job], now=now), job)[1]).all()  # no unit fits on b
    sia.start_s(job, ("a", 2), 0.0)
    # one replica seen: up to two (the doubling assumption), not yet four
    ran = view(c, table, [job], current={"w": ("a", 2)}, now=now + 600)
    assert sia.estimate(ran, job)[0].tolist() == pytest.approx([np.nan, 10.0, 20.0, np.nan], nan_ok=True, rel=1e-3)
    assert sia.decide(ran) == {"w": ("a", 4)}
    sia.start_s(job, ("a", 4), 0.0)
    # two replicas seen: Pollux's model fitted to the profile (one unit at batch 1..8, 10 samples/s), the run on
    # one replica and the two-replica step (local batch 4: 0.4 s of compute, 8 / 19 s in all); four replicas
    # span both nodes
    measured = [pollux.Observation(1, 1, b, b / 10, b / 10) for b in (1, 2, 4, 8, 8)]  # profile, then one replica
    fitted = pollux.fit([*measured, pollux.Observation(1, 2, 4, 0.4, 8 / 19)])
    want = pollux.samples_per_s(fitted, 8, 8, np.array([1, 1, 2]), np.array([1, 2, 4]))
    learned = sia.estimate(view(c, table, [job], current={"w": ("a", 4)}, now=now + 1200), job)[0]
    assert learned[1:].tolist() == pytest.approx(want.tolist(), rel=1e-6)
    assert learned[3] > 1.2 * 20.0  # its extrapolation, not the estimator's exact 20


def test_sia_gives_a_job_that_declares_its_gpus_at_most_that_many_and_at_first_one_unit():
    c = cluster(a=(2, 4))
    table = ThroughputTable(TableOracle(linear("M", {"a": 1.0}, eff=0.95)), c.capacity(), 8)
    declared, free = Job("declared", "M", 8, 100, 0.0, num_gpus=6), Job("free", "M", 8, 100, 0.0)
    sia = Sia()
    for job in (declared, free):
        first = sia.estimate(view(c, table, [job], now=60.0), job)[0]
        assert np.isfinite(first).tolist() == [True, False, False, False]  # its unit alone before it has run
        sia.start_s(job, ("a", 1), 0.0)
    ran = {job.id: sia.estimate(view(c, table, [job], current={job.id: ("a", 1)}, now=600.0), job)[0]
           for job in (declared, free)}  # fmt: skip
    assert np.isfinite(ran["declared"]).tolist() == [True, True, True, False]  # up to 6: 4, not 8
    assert np.isfinite(ran["free"]).tolist() == [True, True, False, False]  # 2x the most it ran on


def test_sia_profiles_on_real_gpus_and_never_moves_a_job_that_is_restoring():
    oracle = TableOracle({("M", "a", 1): (1.0, 1.0), ("M", "a", 2): (1.1, 1.1)})
    c = cluster(a=(1, 2))
    table = ThroughputTable(oracle, c.capacity(), 2)
    one, two, new = Job("one", "M", 8, 100, 0.0), Job("two", "M", 8, 100, 0.0), Job("new", "M", 8, 100, 5e4)
    sia = Sia()
    assert sia.decide(view(c, table, [one, two], now=0.0)) == {}  # arrived now: profiling in the coming minute
    assert sia.decide(view(c, table, [one, two], now=60.0)) == {"one": ("a", 1), "two": ("a", 1)}  # one unit each
    for job in (one, two):
        sia.start_s(job, ("a", 1), 0.0)
    # the cluster was full when "new" arrived: its profile holds one GPU back for the coming minute
    full = {"one": ("a", 1), "two": ("a", 1)}
    held = sia.decide(view(c, table, [one, two, new], current=full, now=1e5))
    assert sum(n for _, n in held.values()) == 1 and "new" not in held
    assert sia._profiled["new"] == 1e5 + 20  # profiled by the next decision, where the program may give it GPUs
    late = Job("late", "M", 8, 100, 1e5)
    for job in (one, two):
        sia.start_s(job, ("a", 1), 0.0)  # restoring for Sia's 30 s: they keep their GPUs, and no profile takes them
    busy = view(c, table, [one, two, late], current=full, now=1e5 + 20)
    assert sia.decide(busy) == full and "late" not in sia._profiled


def test_sia_variants_constants_are_their_sources():
    paper, artifact = Sia().constants, SiaArtifact().constants
    assert (Sia.round_s, paper.p, paper.lambda_no_alloc, paper.goodput_clip) == (60.0, -0.5, 1.1, 3000.0)
    assert (paper.profile_s, paper.scale_up, paper.restart_s, Sia.every_round) == (20.0, 2, 30.0, True)
    assert (artifact.p, artifact.goodput_clip, artifact.admit_gain, artifact.max_moves) == (0.5, 3000.0, 1e3, 3)
    assert (artifact.restart_s, artifact.mem_margin, artifact.xla_preallocation) == (600.0, 1.2, 0.8)
    assert (artifact.max_gpus, SiaArtifact.every_round, SiaArtifact.round_s) == (16, False, None)
    # a restart costs Sia its own simulator's 30 s restore, whatever the study charges; the Crius artifact's Sia
    # pays the study's (0 s there); both the unpruned plan search on a config new to the job
    job = Job("j", "M", 8, 100, 0.0)
    assert Sia().start_s(job, ("a", 4), 0.0) == 30.0 + 600.0
    assert SiaArtifact().start_s(job, ("a", 4), 0.0) == 600.0
    real = Sia().without_search_costs()  # real mode: the launch's own restore, nothing profiled or charged
    assert real.start_s(job, ("a", 4), 5.0) == 5.0 and real.constants.profile_s == 0.0


# --- Sia, the Crius artifact's --------------------------------------------------------------------------------


def test_sia_artifact_checks_memory_as_the_artifact_and_scales_one_gpu_linearly():
    # one GPU needs 70% of the memory: the estimator fits it, the artifact's x1.2 against 80% does not; two
    # GPUs need 60% (0.72 <= 0.8). One GPU refused, so the artifact's model takes the largest feasible count's
    # samples/s over twice that count (8 / 16 per GPU) and scales it linearly.
    rates = {("M", "a", 1): (2.0, 2.0), ("M", "a", 2): (3.0, 3.0), ("M", "a", 4): (5.0, 5.0), ("M", "a", 8): (8.0, 8.0)}
    shares = {("M", "a", 1): 0.7, ("M", "a", 2): 0.6, ("M", "a", 4): 0.5, ("M", "a", 8): 0.4}
    table = ThroughputTable(TableOracle(rates, shares=shares), {"a": 8}, 8)
    est = SiaArtifact().estimate(table, Job("j", "M", 8, 100, 0.0))
    assert est[0].tolist() == pytest.approx([np.nan, 1.0, 2.0, 4.0], nan_ok=True)


def test_sia_artifact_is_event_driven_and_never_preempts_an_admitted_job():
    oracle = TableOracle({**linear("Slow", {"a": 1.0}), **linear("Fast", {"a": 10.0})})
    c = cluster(a=(1, 4))
    table = ThroughputTable(oracle, c.capacity(), 4)
    old, new = Job("old", "Slow", 8, 100, 0.0), Job("new", "Fast", 8, 100, 10.0)
    sia = SiaArtifact()
    first = sia.decide(view(c, table, [old]))
    assert first == {"old": ("a", 4)}  # its utility grows with the count, and the admission gain is the job's
    sia.start_s(old, ("a", 4), 0.0)
    assert sia.decide(view(c, table, [old, new], current=first, now=300.0)) == first  # full: the new one waits
    assert sia.decide(view(c, table, [old, new], current=first, now=600.0)) == first  # no event: no try
    assert sia.decide(view(c, table, [new], now=900.0)) == {"new": ("a", 4)}  # a departure: pending retried


def test_sia_artifact_moves_a_job_to_its_new_type_at_the_count_it_had():
    # R is 4x faster on b, where S holds one GPU. The program admitting R gives it both b GPUs and moves S to
    # two GPUs of a; applied as the artifact applies it, S changes type only, keeping its one GPU.
    oracle = TableOracle({**linear("R", {"a": 1.0, "b": 4.0}, counts=(1, 2)),
                          **linear("S", {"a": 1.0, "b": 1.0}, counts=(1, 2))})  # fmt: skip
    c = cluster(a=(1, 2), b=(1, 2))
    table = ThroughputTable(oracle, c.capacity(), 2)
    s, r = Job("s", "S", 8, 100, 0.0), Job("r", "R", 8, 100, 1.0)
    sia = SiaArtifact()
    assert sia.decide(view(c, table, [s]))["s"][1] == 2  # alone: two GPUs (its utility grows with the count)
    sia._held["s"], sia._solved["s"] = ("b", 1), (1, 0)  # as if an earlier program had given it one GPU of b
    assert sia.decide(view(c, table, [s, r], current={"s": ("b", 1)}, now=300.0)) == {"s": ("a", 1), "r": ("b", 2)}


# --- Gavel, every policy's conventions, the report ------------------------------------------------------------


def test_gavel_decides_with_replicated_data_parallelism_at_the_users_count():
    # the best plan runs "Big" on its user's one GPU, plain data parallelism does not: Gavel never admits it
    oracle = TableOracle({("Big", "a", 1): (2.0, None), ("Big", "a", 2): (3.8, 3.0)})
    table = ThroughputTable(oracle, {"a": 8}, 8)
    assert not Gavel().admits(Job("one", "Big", 8, 100, 0.0, num_gpus=1), table)
    assert Gavel().admits(Job("two", "Big", 8, 100, 0.0, num_gpus=2), table)
    assert Gavel._rates(table, Job("two", "Big", 8, 100, 0.0, num_gpus=2))[1].tolist() == [3.0]  # not 3.8


def test_a_job_no_configuration_fits_is_never_admitted_and_the_report_counts_it():
    # "Huge" runs only with a plan the baselines do not have (a sharded one: best plan, no replica fits)
    oracle = TableOracle({**linear("M", {"a": 1.0}), **{("Huge", "a", n): (float(n), None) for n in (1, 2, 4, 8)}})
    jobs = [
        Job("m", "M", 8, 300, 0.0, gpu_type="a", num_gpus=2),
        Job("huge", "Huge", 8, 300, 0.0, gpu_type="a", num_gpus=2),
    ]
    plans = {}
    for policy in ("crius", "sia", "sia-artifact", "gavel"):
        c = cluster(a=(2, 4))
        plans[policy] = simulate(jobs, c, make_policy(policy), ThroughputTable(oracle, c.capacity(), 8), rounds=50)
    assert plans["crius"].metrics.never_admitted == 0 and plans["crius"].metrics.jobs_finished == 2
    for policy in ("sia", "sia-artifact", "gavel"):
        m = plans[policy].metrics
        assert (m.never_admitted, m.jobs_finished, m.unmodelled) == (1, 1, 0)
        assert summary(m)["never_admitted"] == 1 and summary(m)["p95_jct_s"] == m.p95_jct_s
    assert "never adm" in format_table(plans) and "p95 JCT h" in format_table(plans)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_gpu_count_rule_applies_to_every_policy(policy):
    oracle = TableOracle(linear("M", {"a": 2.0, "b": 1.0}, eff=0.95))
    jobs = [Job(f"j{i}", "M", 8, 3000, float(i * 60), gpu_type="a", num_gpus=1 + i % 2) for i in range(12)]
    jobs.append(Job("wide", "M", 8, 3000, 0.0, gpu_type="a", num_gpus=4))  # asks for more than the rule allows
    c = cluster(a=(2, 4), b=(2, 4))
    plan = simulate(jobs, c, make_policy(policy), ThroughputTable(oracle, c.capacity(), 2), rounds=400)
    assert max(s.num_gpus for s in plan.segments) <= 2
    requested = policy in ("fcfs", "gavel")  # they take the user's count, which the rule refuses
    assert plan.metrics.never_admitted == int(requested) and plan.metrics.jobs_finished == 13 - int(requested)


def test_sia_decides_every_minute_inside_a_round_and_a_round_it_cannot_keep_is_refused():
    oracle = TableOracle(linear("M", {"a": 1.0}))
    job = Job("j", "M", 8, 10**5, 0.0)
    c = cluster(a=(1, 4))
    plan = simulate([job], c, make_policy("sia"), ThroughputTable(oracle, c.capacity(), 4), round_s=300, rounds=4,
                    fixed_horizon=True)  # fmt: skip
    assert plan.metrics.decisions == 4 * 5  # every minute
    with pytest.raises(ValueError, match=r"schedule.round_s=100 is not a multiple of sia's own 60 s round"):
        simulate([job], cluster(a=(1, 4)), make_policy("sia"), ThroughputTable(oracle, c.capacity(), 4), round_s=100)


def test_study_conventions_reach_every_policy(tmp_path: Path):
    path = tmp_path / "study.yaml"
    path.write_text(f"""\
experiment: {{name: conventions, output_dir: {tmp_path}}}
cluster: {{node_groups: [{{gpu_type: a, nodes: 2, gpus_per_node: 4}}]}}
jobs: [{{name: j, model: M, global_batch: 8, iterations: 100}}]
schedule: {{max_gpus_per_job: 2, search_charge: every_start, restart_s: 0, policies: [crius, sia-artifact]}}
""")
    study = load_study(path, oracle=TableOracle(linear("M", {"a": 1.0})))
    assert study.table.counts == (1, 2)
    for policy in ("crius", "sia-artifact"):
        segments = study.run(policy).segments
        assert max(s.num_gpus for s in segments) <= 2


def starts(policy: str, config: tuple[str, int], restart_s: float, every_start: bool = True) -> tuple[float, float]:
    """What the same job pays for its first and second start on `config` under `policy`."""
    p, job = make_policy(policy, search_every_start=every_start), Job("j", "M", 8, 100, 0.0)
    return p.start_s(job, config, restart_s), p.start_s(job, config, restart_s)


def test_each_policy_pays_for_a_start_what_its_source_charges():
    # the Crius artifact (scheduler.py _get_cluster_perf): the search at every start, 150 s a GPU up to 600 s
    # for a baseline, 10 s a GPU up to 40 s for Crius's pruned search; the study's restore on top
    assert starts("fcfs", ("a", 2), 0.0) == (300.0, 300.0)
    assert starts("crius", ("a", 2), 0.0) == (20.0, 20.0) and starts("crius", ("a", 16), 5.0) == (45.0, 45.0)
    assert starts("sia-artifact", ("a", 8), 0.0) == (600.0, 600.0)
    # Gavel: that search once per config (its paper's time slices resume a job with its plan; the artifact's
    # Gavel never preempts), and never a restore: its simulator charges none, whatever the study's restore
    assert starts("gavel", ("a", 2), 60.0) == (300.0, 0.0)
    assert starts("gavel", ("a", 4), 60.0) == (600.0, 0.0)
    # Sia's paper resumes a job with its plan: the search once per config, and its simulator's 30 s restore
    assert starts("sia", ("a", 2), 60.0) == (330.0, 30.0)
    # real mode: nothing searched, and the launch's own restore
    job = Job("j", "M", 8, 100, 0.0)
    assert Gavel().without_search_costs().start_s(job, ("a", 2), 5.0) == 5.0


def test_a_declared_gpu_count_caps_each_policy_as_its_source_does():
    """The trace's requested count: Gavel and FCFS run exactly it; Sia's paper stops a fixed-batch job there
    (cluster.py target_num_replicas); the Crius artifact lets Crius and its Sia take any count up to 16."""
    c = cluster(a=(2, 4))
    table = ThroughputTable(TableOracle(linear("M", {"a": 1.0})), c.capacity(), 8)
    job = Job("j", "M", 8, 10**6, 0.0, gpu_type="a", num_gpus=2)
    most = {}
    for policy in ("crius", "fcfs", "gavel", "sia", "sia-artifact"):
        plan = simulate([job], cluster(a=(2, 4)), make_policy(policy), table, round_s=300, rounds=6, restart_s=0.0,
                        fixed_horizon=True)  # fmt: skip
        most[policy] = max(s.num_gpus for s in plan.segments)
    assert most == {"crius": 8, "fcfs": 2, "gavel": 2, "sia": 2, "sia-artifact": 8}
