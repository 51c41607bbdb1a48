"""A device's calibration (planner/calibration.py): measured once, reused by every later plan in
the process and from disk, pinned with ``plan(..., calibration=...)``, one for all ranks.

Counts come from ``calibration_counts.MEASUREMENTS`` (calls timed, overhead fits made); every test
keeps its calibrations under ``tmp_path`` through ``PLANNER_CACHE_DIR``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import planner
from benchmarks.models import GPT, GPTConfig, gpt_example
from planner import batch_sweep, calibration, pricing_cache
from planner.calibration import Calibration, CalibrationError
from planner.calibration_counts import MEASUREMENTS
from planner.devices import profile_of_model
from planner.fsdp import per_rank
from planner.passes import device_calibration, fresh_memory
from planner.passes.eager import eager_graph
from planner.passes.op_call import TensorSpec, op_call
from planner.passes.overhead_fits import CheckpointOverhead
from planner.solvers.costgraph import Schedule
from planner.solvers.simulate import simulate
from tests.helpers import each_with

CFG = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=32, vocab_size=64, dropout=0.0)
BUDGET_GB = 3e-4  # between the least (0.23 MB) and eager peak (0.37 MB) at batch 2


def _example(batch: int = 2):
    return gpt_example(CFG, batch=batch, seed=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh process (no calibration held, no pricing kept) with its cache under tmp_path."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLANNER_CACHE", raising=False)
    _fresh_process()
    yield tmp_path / "cache"
    _fresh_process()


def _fresh_process() -> None:
    calibration.forget()
    pricing_cache._PRICED.clear()


def _fingerprint(p) -> tuple:
    """What must agree between two plans for them to be the same plan."""
    return (
        tuple((r.name, r.kind, r.depth, r.saved_nodes) for r in p.regions),
        p.predicted_peak_bytes,
        p.predicted_step_time_s,
    )


def test_a_second_plan_measures_nothing_new(cache):
    model, x = _example()
    before = dict(MEASUREMENTS)
    first = planner.plan(model, x, BUDGET_GB, form="inplace")
    timed = MEASUREMENTS["ops"] - before.get("ops", 0)
    assert timed > 0 and MEASUREMENTS["overheads"] == before.get("overheads", 0) + 1
    counts = dict(MEASUREMENTS)
    # another budget, another objective: the same pricing, nothing timed
    planner.plan(model, x, 2 * BUDGET_GB, form="inplace")
    planner.plan(model, x, BUDGET_GB, form="inplace", objective="flops")
    assert dict(MEASUREMENTS) == counts
    # priced again from scratch (the trace), the process's calibration still has every call
    pricing_cache._PRICED.clear()
    again = planner.plan(model, x, BUDGET_GB, form="inplace")
    assert dict(MEASUREMENTS) == counts
    assert _fingerprint(again) == _fingerprint(first)
    assert "this process's" in again.graph.meta["timing"]
    # another batch size: only the calls on new shapes are timed, fewer than the first time
    planner.plan(model, _example(batch=3)[1], 1.5 * BUDGET_GB, form="inplace")
    assert 0 < MEASUREMENTS["ops"] - counts["ops"] < timed
    assert MEASUREMENTS["overheads"] == counts["overheads"]


def test_graph_form_prices_from_the_same_calibration(cache):
    model, x = _example()
    planner.plan(model, x, BUDGET_GB, form="inplace")
    counts = dict(MEASUREMENTS)
    p = planner.plan(model, x, BUDGET_GB, form="graph")
    # the graph form's captured ops are mostly the eager ones: few new calls, no new fit
    assert MEASUREMENTS["overheads"] == counts["overheads"]
    assert MEASUREMENTS["ops"] - counts["ops"] < counts["ops"]
    assert p.graph.meta["timing"].startswith("ops timed alone")


def test_on_disk_round_trip(cache):
    model, x = _example()
    before = MEASUREMENTS["ops"]
    first = planner.plan(model, x, BUDGET_GB, form="inplace")
    files = list(cache.glob("calibration-*.json"))
    assert len(files) == 1
    held = calibration._PROCESS[next(iter(calibration._PROCESS))]
    loaded = Calibration.load(files[0])
    assert loaded == held and len(loaded.op_times_s) == MEASUREMENTS["ops"] - before
    assert loaded.device == device_calibration.device_name(torch.device("cpu"))
    assert loaded.torch_version == torch.__version__ and loaded.dtype == "float32"
    # what a block mapped afresh costs is measured once and kept (0 without a fault count)
    assert (loaded.fresh_mapping_s_per_byte > 0) == (fresh_memory.resource is not None)
    # a new process (nothing held): read from disk, nothing measured, the same plan
    _fresh_process()
    counts = dict(MEASUREMENTS)
    second = planner.plan(model, x, BUDGET_GB, form="inplace")
    assert dict(MEASUREMENTS) == counts
    assert "read from" in second.graph.meta["timing"]
    assert _fingerprint(second) == _fingerprint(first)


def test_the_first_figure_written_wins(cache):
    """Two processes that timed the same call keep the file's figure: both price alike."""
    model, x = _example()
    planner.plan(model, x, BUDGET_GB, form="inplace")
    (path,) = cache.glob("calibration-*.json")
    on_disk = Calibration.load(path)
    text = next(iter(on_disk.op_times_s))
    ours = dataclasses.replace(on_disk, op_times_s={text: 123.0, "new call": 1.0})
    merged = calibration._merged(ours, on_disk)
    assert merged.op_times_s[text] == on_disk.op_times_s[text]
    assert merged.op_times_s["new call"] == 1.0


def test_cache_off_writes_nothing(cache, monkeypatch):
    monkeypatch.setenv("PLANNER_CACHE", "0")
    assert calibration.cache_dir() is None
    model, x = _example()
    before = MEASUREMENTS["ops"]
    planner.plan(model, x, BUDGET_GB, form="inplace")
    assert MEASUREMENTS["ops"] > before
    assert not cache.exists() or not any(cache.iterdir())
    # the process still keeps what it measured
    counts = dict(MEASUREMENTS)
    pricing_cache._PRICED.clear()
    planner.plan(model, x, BUDGET_GB, form="inplace")
    assert dict(MEASUREMENTS) == counts


def test_a_pinned_calibration_gives_the_same_plan(cache, tmp_path):
    model, x = _example()
    pinned_path = tmp_path / "pinned.json"
    first = planner.plan(model, x, BUDGET_GB, form="inplace", calibration=pinned_path)
    assert pinned_path.exists()  # created, with every call the plan needed
    pinned = Calibration.load(pinned_path)
    plans = []
    for _ in range(3):
        _fresh_process()
        counts = dict(MEASUREMENTS)
        plans.append(planner.plan(model, x, BUDGET_GB, form="inplace", calibration=pinned))
        assert dict(MEASUREMENTS) == counts  # it had every call: nothing timed
    assert {_fingerprint(p) for p in plans} == {_fingerprint(first)}
    # its figures are the ones priced with: a slower device gives a slower step
    slower = dataclasses.replace(
        pinned,
        op_times_s={k: None if v is None else 2 * v for k, v in pinned.op_times_s.items()},
        # a step small enough to be timed whole (calibration.SMALL_STEP_S) is priced from that
        step_times_s={
            k: tuple(None if t is None else 2 * t for t in v)
            for k, v in pinned.step_times_s.items()
        },
    )
    slow = planner.plan(model, x, BUDGET_GB, form="inplace", calibration=slower)
    assert slow.baseline_peak_bytes == first.baseline_peak_bytes
    eager_s = first.graph.step_time_s
    assert slow.graph.step_time_s > 1.5 * eager_s


def test_a_bad_calibration_is_a_clear_error(cache, tmp_path):
    model, x = _example()
    bad = tmp_path / "bad.json"
    files = [
        ("{not json", "not JSON"),
        (json.dumps({"format": "planner-plan", "version": 1}), "not a planner calibration"),
        (
            json.dumps({"format": "planner-calibration", "version": 99}),
            "version 99.*calibrate anew",
        ),
        (
            json.dumps({"format": "planner-calibration", "version": device_calibration.VERSION}),
            "malformed field",
        ),
    ]
    with pytest.MonkeyPatch.context() as patched:
        # a malformed file fails before the slow part: nothing is traced or timed for it
        patched.setattr(
            "planner.inplace_form.price_inplace", lambda *a, **k: pytest.fail("priced the step")
        )
        for text, error in files:
            bad.write_text(text)
            with pytest.raises(CalibrationError, match=error):
                planner.plan(model, x, BUDGET_GB, form="inplace", calibration=bad)
    # which device a calibration is for is checked against the model's, once it is priced
    other = dataclasses.replace(calibration.current(), device="cuda:NVIDIA H100")
    with pytest.raises(CalibrationError, match="pin a calibration made on this device"):
        planner.plan(model, x, BUDGET_GB, form="inplace", calibration=other)
    assert issubclass(CalibrationError, planner.PlannerError)


# --- two ranks, gloo --------------------------------------------------------------------------


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        x = _example(batch=2)[1]  # each rank's micro-batch
        # every rank plans (each plan is a collective: rank 0's calibration is broadcast)
        planner.plan(model, x, BUDGET_GB, form="inplace")
        if rank == 1:
            # This rank's own calibration disagrees: every op three times slower. It must
            # still price, and plan, with rank 0's.
            key = next(iter(calibration._PROCESS))
            held = calibration._PROCESS[key]
            calibration._PROCESS[key] = dataclasses.replace(
                held, op_times_s={k: v and 3 * v for k, v in held.op_times_s.items()}
            )
        config = planner.FSDPConfig(world_size=world, backend="gloo")
        # 80% of the rank's unplanned peak (priced without timing: no collective)
        unplanned = per_rank(model, eager_graph(model, x, rates=profile_of_model(model)), config)
        budget_gb = 0.8 * simulate(unplanned.graph, Schedule()).peak_bytes / 1e9
        p = planner.plan(model, x, budget_gb, form="inplace", fsdp=config)
        mine = (_fingerprint(p), p.graph.meta["timing"])
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        torch.save(everyone, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_every_rank_holds_the_same_plan(tmp_path, monkeypatch):
    # no disk cache: rank 1 cannot read rank 0's file, only receive it
    monkeypatch.setenv("PLANNER_CACHE", "0")
    world = 2
    out = str(tmp_path / "plans")
    mp.spawn(_rank, args=(world, f"file://{tmp_path}/init", out), nprocs=world, join=True)
    for rank in range(world):
        everyone = torch.load(f"{out}.{rank}")
        (plan0, timing0), (plan1, timing1) = everyone
        assert plan0 == plan1
        assert plan0[0], "the budget should need checkpointing"
        assert "rank 0's, broadcast" in timing0 and "rank 0's, broadcast" in timing1


# --- the same plan every time ------------------------------------------------------------------


_CHILD_PLAN = """
import json, sys
import planner
from benchmarks.models import GPTConfig, gpt_example
cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=32, vocab_size=64, dropout=0.0)
model, x = gpt_example(cfg, batch=2, seed=0)
p = planner.plan(model, x, float(sys.argv[1]), form="inplace", max_recompute_flops_fraction=0.5)
print(json.dumps([[[r.name, r.kind, r.depth, list(r.saved_nodes)] for r in p.regions],
                  p.predicted_peak_bytes, p.predicted_step_time_s]))
"""


def _busy_loops(n: int) -> list:
    """``n`` processes spinning on the CPU: other jobs loading the machine while it plans."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_the_same_plan_three_times_and_in_two_processes_under_load(cache):
    """Given the device's calibration, planning is deterministic: three calls, a call that
    reads the calibration from disk, and another process sharing it give the identical plan
    (regions, predicted peak and step time to the last bit), with another job spinning on the
    CPU (the solvers' choices follow counted work, not the clock). The capped objective runs
    several solves sharing one time limit."""
    import json
    import os
    import subprocess
    import sys

    model, x = _example()
    first = planner.plan(model, x, BUDGET_GB, form="inplace", max_recompute_flops_fraction=0.5)
    assert first.regions, "the budget should need checkpointing"
    busy = _busy_loops(1)  # another job on the machine (on 2 cores: the other one)
    try:
        plans = [first]
        for k in range(2):
            pricing_cache._PRICED.clear()  # priced again from the trace, the calibration held
            if k == 1:
                calibration.forget()  # read from disk
            plans.append(
                planner.plan(model, x, BUDGET_GB, form="inplace", max_recompute_flops_fraction=0.5)
            )
        out = subprocess.run(
            [sys.executable, "-c", _CHILD_PLAN, str(BUDGET_GB)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        ).stdout
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert {_fingerprint(p) for p in plans} == {_fingerprint(first)}
    regions, peak, step_s = json.loads(out.strip().splitlines()[-1])
    child = (tuple((n, k, d, tuple(s)) for n, k, d, s in regions), peak, step_s)
    assert child == _fingerprint(first)


def test_a_batch_sweep_prices_larger_batches_from_smaller_ones(cache, monkeypatch):
    """In ``fit_batch`` (``calibration.batch_sweep``) a call whose counterpart at the smaller
    batch took at least SCALE_MIN_S is priced at the ratio of their sizes times that instead
    of being timed, then corrected by one factor per op (the median over its largest calls
    timed): every scaled figure is exactly that multiple of a timed one, times its op's
    factor."""
    seen: list[list] = []
    timed = calibration._time_missing

    def recording(cal, calls, device, *args):
        seen.append(list(calls))
        return timed(cal, calls, device, *args)

    pairings = []
    paired = batch_sweep.paired_calls

    def pairing(previous, calls):
        pairings.append(len(calls))
        return paired(previous, calls)

    monkeypatch.setattr(calibration, "_time_missing", recording)
    monkeypatch.setattr(batch_sweep, "paired_calls", pairing)
    monkeypatch.setattr(batch_sweep, "SCALE_MIN_S", 0.0)  # the tiny model's calls all scale
    model, _ = _example()
    fit = planner.fit_batch(model, lambda b: _example(b)[1], 1.0, batch_sizes=[2, 4], progress=0)
    assert [r.batch_size for r in fit.rows] == [2, 4]
    assert MEASUREMENTS["scaled"] > 0
    held = next(iter(calibration._PROCESS.values()))
    small, large = seen
    assert pairings == [len(large)]  # the larger batch's calls, paired once
    # what the calibration held when the larger batch was priced: the smaller one's calls
    before = dataclasses.replace(
        held, op_times_s={c.key_text: held.op_times_s[c.key_text] for c in small}
    )
    scaled = batch_sweep.scaled_times(before.op_times_s, paired(small, large))
    mm = [c for c in large if "aten.mm" in str(c.op) and c.key_text in scaled]
    assert mm, "the matmuls on the batch's rows should scale"
    factors: dict[str, dict[str, tuple[float, float]]] = {}  # op -> call -> (scaled, factor)
    for s, big in zip(small, large):
        if big.key_text in scaled:
            assert scaled[big.key_text] == 2 * held.op_times_s[s.key_text]
            factor = held.op_times_s[big.key_text] / scaled[big.key_text]
            factors.setdefault(str(big.op), {})[big.key_text] = (scaled[big.key_text], factor)
    for op, by_call in factors.items():
        # every call of the op scaled by one factor (the median over its largest calls' runs)
        op_factors = [f for _, f in by_call.values()]
        assert all(f == pytest.approx(op_factors[0], rel=1e-9) for f in op_factors), op
    # a weight's call (the same at both sizes) is the calibration's one figure, not scaled
    assert all(s.key_text not in scaled for s in small)


def test_a_sweep_times_again_a_call_priced_far_above_its_smaller_counterpart(cache, monkeypatch):
    """A burst of load while one batch size's calls are timed (GPT-ref's batch 2 was once
    priced at 3x batch 1, and fit_batch took batch 1, the slowest) must not price that size:
    a call timed at over RETIME_JUMP times its counterpart at the smaller batch, scaled by
    their sizes, is timed again, so per sample the predicted steps stay in line. Ops are
    timed by a fixed fake (time proportional to the elements read) whose first timing of each
    call at batch 4 is 3x: no timing noise, the same result every run."""
    monkeypatch.setattr(calibration, "SMALL_STEP_S", 0.0)  # no whole-step timing
    monkeypatch.setattr(calibration, "measure_call_overhead_s", lambda device: 0.0)
    monkeypatch.setattr(
        calibration, "measure_checkpoint_overhead", lambda device: CheckpointOverhead()
    )
    burst = {"on": False, "hit": set()}

    def fake_time_call(call, device, repeats=5):
        numel = sum(math.prod(x.shape) for x in call.leaves if isinstance(x, TensorSpec))
        seconds = 1e-6 + 1e-7 * numel
        if burst["on"] and call.key_text not in burst["hit"]:
            burst["hit"].add(call.key_text)
            return 3 * seconds
        return seconds

    monkeypatch.setattr(batch_sweep, "time_call", fake_time_call)
    monkeypatch.setattr(calibration, "time_each", each_with(fake_time_call))

    def make_input(batch: int):
        burst["on"] = batch == 4  # fit_batch makes each size's input just before pricing it
        return _example(batch)[1]

    model, _ = _example()
    fit = planner.fit_batch(model, make_input, 1.0, batch_sizes=[1, 2, 4], progress=False)
    assert burst["hit"], "the burst should have hit batch 4's new calls"
    steps_s = [r.eager_step_time_s for r in fit.rows]
    per_sample_s = [s / r.batch_size for s, r in zip(steps_s, fit.rows)]
    assert steps_s == sorted(steps_s)
    # the fake's time per element is fixed: per sample, a larger batch is no slower
    assert per_sample_s[2] <= 1.05 * per_sample_s[1], per_sample_s
    assert fit.best_batch_size == 4
    assert MEASUREMENTS["retimed"] > 0


def test_a_sweep_corrects_scaled_calls_per_op(monkeypatch):
    """Scaled figures are corrected by timing an op's largest calls, one run each, and applying
    the median of their ratios of timed to scaled figure to all the op's calls: a memory-bound
    op slows down per element once its tensors outgrow the caches, and one noisy run moves
    neither the op nor its own call. The fake timer prices a matmul 1.3x its FLOPs (its largest
    call 1.6x, as a burst of load would) and an add 3x its elements, against figures scaled at
    1x. No real kernel runs: shapes only (the meta device)."""
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta")

    shapes = [(8192, 256, 1024), (1024, 8192, 512), (8192, 128, 1024), (512, 128, 256)]
    matmuls = [op_call(mm, (meta(m, k), meta(k, n)), {}) for m, k, n in shapes]
    adds = [op_call(add, (meta(n), meta(n)), {}) for n in (1 << 20, 1 << 22)]

    def work(c) -> float:
        sizes = [x.shape for x in c.leaves if isinstance(x, TensorSpec)]
        if c.op == mm:
            (m, k), (_, n) = sizes
            return 1e-12 * m * k * n
        return 1e-9 * sizes[0][0]

    runs = []

    def fake_time_call(c, device, repeats=5):
        runs.append(repeats)
        if c.op == add:
            return 3.0 * work(c)
        return work(c) * (1.6 if c is matmuls[1] else 1.3)

    monkeypatch.setattr(batch_sweep, "time_call", fake_time_call)
    calls = [*matmuls, *adds]
    scaled = {c.key_text: work(c) for c in calls}
    MEASUREMENTS.clear()
    out = batch_sweep.per_op_corrected(scaled, calls, torch.device("cpu"))
    assert MEASUREMENTS["ops"] == batch_sweep.CORRECTION_CALLS + 2  # the 3 largest mm, both adds
    assert runs == [batch_sweep.CORRECTION_REPEATS] * len(runs)
    for c in calls:  # every matmul at 1.3x, the burst's 1.6x included; the adds at 3x
        factor = 3.0 if c.op == add else 1.3
        assert out[c.key_text] == pytest.approx(factor * work(c), rel=1e-12)
