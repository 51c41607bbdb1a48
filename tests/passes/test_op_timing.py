"""Timing the graph's own ops on the device (passes/op_timing.py) and its use by estimate."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.models import gpt_ref_small_example
from planner.devices import profile_of_model
from planner.passes import cpu_timing, cuda_timing, op_timing, overhead_fits, timing_runs
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.passes.op_call import op_call, real_arguments
from planner.passes.op_timing import time_calls
from planner.passes.overhead_fits import CheckpointOverhead, call_overhead_s, host_floor_s
from planner.passes.step import StepTime
from tests.helpers import fake_calibration, readings_in_pairs


def test_identical_blocks_get_identical_measured_times():
    model, example = gpt_ref_small_example()
    c = capture(model, example)
    graph = estimate(c.module, c.args, c.kwargs, time_ops=True, rates=profile_of_model(c.module))
    assert graph.meta["timing"].startswith("ops timed alone + ")
    assert all(n.fwd_time_s is not None and n.bwd_time_s is not None for n in graph.nodes)
    assert all(n.fwd_time_s >= 0 and n.bwd_time_s >= 0 for n in graph.nodes)
    assert graph.step_time_s == sum(n.fwd_time_s + n.bwd_time_s for n in graph.nodes)

    def block(k: int) -> list[tuple]:
        inside = [n for n in graph.nodes if n.module_path.startswith(f"blocks.{k}")]
        return [(n.op, n.fwd_time_s, n.bwd_time_s) for n in inside]

    # Same ops on the same shapes: timed once, one price for both blocks.
    assert block(0) and block(0) == block(1)
    roofline = estimate(c.module, c.args, c.kwargs, rates=profile_of_model(c.module))
    assert roofline.meta["timing"] == "roofline"
    assert all(n.fwd_time_s is None for n in roofline.nodes)


def test_calls_are_timed_on_real_tensors_and_failures_left_to_the_roofline():
    """Each call runs on real tensors of its recorded shapes (not the fake ones it was recorded
    on), and a call that fails on them is left out of the result. What the figure comes to is
    the machine's: a benchmark's, not asserted here."""
    a = torch.randn(64, 64)
    ran_on: list[tuple] = []

    def mm_op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ran_on.append((type(x), type(y), x.device.type, tuple(x.shape), tuple(y.shape)))
        return torch.mm(x, y)

    mm = dataclasses.replace(op_call(torch.ops.aten.mm.default, (a, a), {}), op=mm_op)
    bad = op_call(torch.ops.aten.mm.default, (a, torch.randn(32, 32)), {})
    times = time_calls([mm, bad, mm], torch.device("cpu"))
    assert set(times) == {mm.key}  # the shape mismatch cannot run: not timed
    assert isinstance(times[mm.key], float) and times[mm.key] >= 0
    assert ran_on and set(ran_on) == {(torch.Tensor, torch.Tensor, "cpu", (64, 64), (64, 64))}
    assert call_overhead_s(torch.device("cpu")) >= 0


def test_cpu_calls_are_timed_on_data_evicted_from_the_caches(monkeypatch):
    """A memory-bound call whose data fit in the L2 cache runs back to back far faster than in
    a step, where its inputs were written ops before: on the CPU each round of timed runs
    follows one eviction of the caches, and each timed run follows a run on a second set of
    arguments (code warm, data cold). The order of those events is what is asserted; what
    the eviction is worth in seconds is a benchmark's (benchmarks/cold_timing.py)."""
    events: list[str] = []
    ticks = iter(range(1000))
    monkeypatch.setattr(cpu_timing, "_evict_caches", lambda: events.append("evict"))
    monkeypatch.setattr(cpu_timing, "clock", lambda device: lambda: float(next(ticks)))
    monkeypatch.setattr(cpu_timing, "minor_faults", lambda: 0)
    monkeypatch.setattr(cpu_timing, "_clock_cost_s", lambda: 0.0)
    x = torch.randn(32, 1024)
    add = op_call(torch.ops.aten.add.Tensor, (x, x), {})
    neg = op_call(torch.ops.aten.neg.default, (x,), {})

    def recorded(call, name: str):  # noqa: ANN001, ANN202
        def op(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            mine = name in runs and args[0] is runs[name].args[0]
            events.append(name if mine else name + " other")
            return call.op(*args, **kwargs)

        return dataclasses.replace(call, op=op)

    runs = {}
    for call, name in ((add, "add"), (neg, "neg")):
        r = cpu_timing.ColdRuns.prepared(recorded(call, name))
        assert r is not None and r.other is not None  # a fast call: warmed on other arguments
        runs[name] = r
    events.clear()  # the warm-ups
    times = cpu_timing.cold_cpu_times([runs["add"], runs["neg"]], repeats=3)
    round_ = ["evict", "add other", "add", "neg other", "neg"]
    assert events == round_ * 3
    assert times == [1.0, 1.0]  # each timed run read two ticks of the fake clock apart


def test_on_cuda_each_timed_stretch_waits_for_its_kernels(monkeypatch):
    """A kernel launch returns before the kernel has run: on CUDA the clock that ends each
    timed stretch is read only after the device is synchronised. The order of those events is
    what is asserted, on a fake clock and a fake synchronisation (no device needed); what the
    kernels take is measured in tests/cuda/test_timing.py."""
    events: list[str] = []
    ticks = iter(range(1000))

    def now() -> float:
        events.append("clock")
        return float(next(ticks))

    monkeypatch.setattr(cuda_timing, "clock", lambda device: now)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    seconds = cuda_timing.stretch_s(lambda: events.append("run"), torch.device("cuda"), 3)
    # each run a second on the fake clock: a slow call, timed SLOW_REPEATS stretches of one run
    assert events == ["clock", "run", "sync", "clock"] * timing_runs.SLOW_REPEATS
    assert seconds == 1.0


def test_a_slow_call_is_timed_without_a_second_run(monkeypatch):
    """A call whose warm-up outlasts SLOW_CALL_S is timed on its own previous run's warmth:
    no run on other arguments before each timed one."""
    monkeypatch.setattr(timing_runs, "SLOW_CALL_S", -1.0)
    x = torch.randn(8, 8)
    r = cpu_timing.ColdRuns.prepared(op_call(torch.ops.aten.neg.default, (x,), {}))
    assert r is not None and r.other is None


def _timed_with(monkeypatch, runs: list[tuple[float, int]]) -> float:
    """A call's cold timing when its runs take these (seconds, pages faulted), by a fake clock
    and fault count, a fresh page priced 2 us."""
    now = readings_in_pairs(s for s, _ in runs)  # the second of each pair ends a run
    monkeypatch.setattr(cpu_timing, "clock", lambda device: now)
    monkeypatch.setattr(cpu_timing, "minor_faults", readings_in_pairs(f for _, f in runs))
    monkeypatch.setattr(cpu_timing, "fault_cost_s", lambda: 2e-6)
    monkeypatch.setattr(cpu_timing, "_clock_cost_s", lambda: 0.0)
    call = op_call(torch.ops.aten.neg.default, (torch.randn(8),), {})
    return op_timing.time_call(call, torch.device("cpu"), repeats=len(runs))


def test_page_faults_are_taken_off_only_where_every_run_faulted(monkeypatch):
    """glibc maps an output of 32 MiB or more afresh on every run unless a free heap chunk fits
    it: where every run faulted, the pages' price is taken off (the call on reused memory);
    where some run faulted nothing (its first runs faulted while glibc's threshold rose), the
    median of those runs counts as it was."""
    always = _timed_with(monkeypatch, [(10e-3, 1000)] * 5)
    assert always == pytest.approx(10e-3 - 1000 * 2e-6)
    first_two = _timed_with(monkeypatch, [(10e-3, 1000)] * 2 + [(9.5e-3, 0)] * 3)
    assert first_two == pytest.approx(9.5e-3)


def test_a_cpu_call_costs_its_median_cold_run_not_its_fastest(monkeypatch):
    """A step runs each call once, at whatever speed that run gets: on a shared CPU single
    runs spread widely, and the fastest priced GPT-ref's step 18% under its time."""
    runs = [(3e-3, 0), (1e-3, 0), (5e-3, 0), (2e-3, 0), (4e-3, 0)]
    assert _timed_with(monkeypatch, runs) == pytest.approx(3e-3)


def _runs_on(monkeypatch, slow_call_s: float) -> list[int]:
    """The storages a timed neg call ran on, in order, with SLOW_CALL_S at ``slow_call_s``."""
    ran_on: list[int] = []

    def neg(x: torch.Tensor) -> torch.Tensor:
        ran_on.append(x.data_ptr())
        return torch.neg(x)

    call = dataclasses.replace(op_call(torch.ops.aten.neg.default, (torch.randn(8),), {}), op=neg)
    monkeypatch.setattr(timing_runs, "SLOW_CALL_S", slow_call_s)
    op_timing.time_call(call, torch.device("cpu"), repeats=5)
    return ran_on


def test_each_cold_run_follows_a_run_on_other_arguments_unless_the_call_is_slow(monkeypatch):
    """The run on a second set of arguments warms the code as a step does; a call slower than
    SLOW_CALL_S does without it (its own last run warmed the code), which halves what a large
    batch's calls take to time, and is timed SLOW_REPEATS times."""
    fast = _runs_on(monkeypatch, slow_call_s=60.0)
    own, other = fast[0], fast[1]
    assert own != other
    # the warm-up, a run on the other arguments, then five of (other, own)
    assert fast == [own, other] + [other, own] * 5
    slow = _runs_on(monkeypatch, slow_call_s=-1.0)  # every call counts as slow
    assert len(set(slow)) == 1
    assert len(slow) == 1 + timing_runs.SLOW_REPEATS


def test_the_eviction_covers_the_largest_cache_sysfs_reports(monkeypatch, tmp_path):
    sizes = {"index0": "32K", "index2": "1024K", "index3": "32768K"}
    for index, size in sizes.items():
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    paths = [str(tmp_path / index / "size") for index in sizes]
    monkeypatch.setattr(cpu_timing.glob, "glob", lambda _: paths)
    assert cpu_timing._last_level_cache_bytes() == 32 << 20
    (tmp_path / "index3" / "size").write_text("1G\n")
    assert cpu_timing._last_level_cache_bytes() == 1 << 30
    monkeypatch.setattr(cpu_timing.glob, "glob", lambda _: [])  # no sysfs: the default
    assert cpu_timing._last_level_cache_bytes() == cpu_timing.DEFAULT_CACHE_BYTES


def test_masks_are_timed_as_runs_not_random_bits():
    """Masks in models come in runs (causal, padding) that a kernel's branches predict; random
    bits priced GPT-ref's causal masked_fill at 2.7 times its time in the step."""
    scores, mask = torch.randn(4, 6), torch.zeros(4, 6, dtype=torch.bool)
    call = op_call(torch.ops.aten.masked_fill.Scalar, (scores, mask, 0.0), {})
    args, _ = real_arguments(call, torch.device("cpu"))
    assert args[1].flatten().tolist() == [False] * 12 + [True] * 12


def test_select_backward_is_timed_once_whatever_its_position():
    """A scan's backward takes select_backward at every position: one timing serves them all,
    and the call timed writes a valid position."""
    grad = torch.randn(4, 8)
    sb = torch.ops.aten.select_backward.default
    calls = [op_call(sb, (grad, [4, 16, 8], 1, i), {}) for i in (0, 5, 15, -1)]
    assert len({c.key for c in calls}) == 1
    other = op_call(sb, (grad, [4, 17, 8], 1, 5), {})  # another shape: timed apart
    assert other.key != calls[0].key
    times = time_calls([*calls, other], torch.device("cpu"))
    assert set(times) == {calls[0].key, other.key}


# What the fake timer of the fitting test gives: each distinct call 1 to 9 us alone (by its
# place among the step's calls' texts), and a selective region's bookkeeping per call.
STAND_IN = CheckpointOverhead(region_s=40e-6, per_saving_node_s=3e-6, per_selective_call_s=2e-6)


def _fixed_timer(calls, device):  # noqa: ANN001, ANN202
    texts = sorted({c.key_text for c in calls})
    times = {text: (k % 9 + 1) * 1e-6 for k, text in enumerate(texts)}
    return fake_calibration(times, call_overhead_s=5e-6, checkpoint=STAND_IN)


def _timed(c, step_time: StepTime):
    """``c`` priced by its ops' fixed fake times, fitted to ``step_time``."""
    rates = profile_of_model(c.module)
    return estimate(
        c.module,
        c.args,
        c.kwargs,
        rates=rates,
        time_ops=True,
        timer=_fixed_timer,
        step_time=step_time,
    )


def test_node_times_are_fitted_to_the_measured_step():
    model, example = gpt_ref_small_example()
    c = capture(model, example)
    # A slow step: the difference is spread over the calls, so every node gets slower.
    slow = _timed(c, StepTime(1.0, 2.0))
    # The measured forward runs the loss too; the graph form charges the loss step to the last
    # node's backward (outside every region: never recomputed), so the nodes' forwards take
    # the rest of the second.
    fwd_s = sum(n.fwd_time_s for n in slow.nodes)
    assert fwd_s + sum(n.bwd_time_s for n in slow.nodes) == pytest.approx(3.0)
    assert 0.95 < fwd_s < 1.0
    assert "per call" in slow.meta["timing"]
    assert slow.recompute_scale == 1.0  # no checkpointed step measured: the forward's time
    # Checkpointed whole, the step took half its nodes' forward longer than its overhead:
    # recomputing the forward costs half of it.
    overhead_s = slow.checkpoint_overhead_s(0, len(slow.nodes))
    halved = _timed(c, StepTime(1.0, 2.0, 3.0 + 0.5 * fwd_s + overhead_s))
    assert halved.recompute_scale == pytest.approx(0.5)
    assert halved.node_recompute_time_s(3) == pytest.approx(0.5 * halved.node_time_s(3))
    # Under a selective policy the same step took 1 ms longer per aten call its forward made.
    calls = sum(n.fwd_calls for n in slow.nodes)
    assert calls > 0
    checkpointed_s = 3.0 + 0.5 * fwd_s + overhead_s
    selective = _timed(c, StepTime(1.0, 2.0, checkpointed_s, checkpointed_s + calls * 1e-3))
    assert selective.selective_call_overhead_s == pytest.approx(1e-3)
    assert halved.selective_call_overhead_s == STAND_IN.per_selective_call_s  # the stand-in's
    # A step faster than its ops timed alone: they are scaled down alike.
    fast = _timed(c, StepTime(1e-6, 2e-6))
    fast_s = sum(n.fwd_time_s + n.bwd_time_s for n in fast.nodes)
    assert fast_s == pytest.approx(3e-6)
    assert sum(n.fwd_time_s for n in fast.nodes) < 1e-6  # the loss's share in backward
    ratios = {n.fwd_time_s / t.fwd_time_s for n, t in zip(fast.nodes, slow.nodes) if n.fwd_time_s}
    assert len(ratios) > 1  # not one factor on the fitted times: scaled from the alone times
    assert "ops x 0.00" in fast.meta["timing"]


def test_on_the_device_each_region_adds_its_measured_overhead_to_the_step(monkeypatch, tmp_path):
    from planner import calibration
    from planner.planning import price

    # priced from its calls alone, whatever the load: no step is small enough to be timed whole,
    # and a calibration of its own holds no step timed whole by an earlier test
    monkeypatch.setattr(calibration, "SMALL_STEP_S", 0.0)
    # the overhead pinned: fitted on a loaded machine, a figure can meet its floor of 0.0 (the
    # fit itself: test_the_checkpoint_overhead_fit_recovers_the_overhead_of_its_steps)
    pinned_overhead = CheckpointOverhead(
        region_s=40e-6, per_saving_node_s=3e-6, per_selective_call_s=1e-6
    )
    monkeypatch.setattr(calibration, "measure_checkpoint_overhead", lambda device: pinned_overhead)
    model, example = gpt_ref_small_example()
    pinned = tmp_path / "calibration.json"
    priced = price(model, example, calibration=pinned)  # model on the CPU: timed on this device
    graph = priced.graph
    assert graph.meta["timing"].startswith("ops timed alone + ")
    assert "calibration: cpu" in graph.meta["timing"]
    held = calibration.Calibration.load(pinned)  # the calibration price() used
    assert held.checkpoint == pinned_overhead
    assert graph.region_overhead_s == held.checkpoint.region_s
    assert graph.saving_node_overhead_s == held.checkpoint.per_saving_node_s > 0
    assert graph.selective_call_overhead_s == held.checkpoint.per_selective_call_s
    p = priced.plan(10**9, "uniform")
    assert p.regions
    per_region = [
        graph.region_overhead_s
        + sum(n.saves_for_backward for n in graph.nodes[r.start : r.stop])
        * graph.saving_node_overhead_s
        for r in p.schedule.regions
    ]
    assert p.predicted_step_time_s == pytest.approx(
        graph.step_time_s + p.predicted_recompute_time_s + sum(per_region)
    )


def test_the_checkpoint_overhead_fit_recovers_the_overhead_of_its_steps(monkeypatch):
    """The fit's arithmetic on steps timed by a fake: 16 regions of 1 and of 8 layers (2 and 16
    saving nodes, as many aten calls), each checkpointed step taking the plain step, one more
    forward and 40 us per region + 3 us per saving node, a selective one 1 us more per call."""
    region_s, per_saving_s, per_call_s, regions = 40e-6, 3e-6, 1e-6, 16
    steps_s = []
    for layers, plain_s, forward_s in ((1, 0.010, 0.004), (8, 0.030, 0.012)):
        checkpoint_s = plain_s + forward_s + regions * (region_s + 2 * layers * per_saving_s)
        selective_s = checkpoint_s + regions * 2 * layers * per_call_s
        steps_s += [plain_s, forward_s, checkpoint_s, selective_s]  # the order the fit times
    times = iter(steps_s)
    monkeypatch.setattr(overhead_fits, "host_apart", lambda device: False)  # no offload variant
    monkeypatch.setattr(overhead_fits, "_best_step_s", lambda step, repeats, device: next(times))
    fitted = overhead_fits.measure_checkpoint_overhead(torch.device("cpu"), regions=regions)
    assert next(times, None) is None  # every step timed once
    assert fitted.region_s == pytest.approx(region_s)
    assert fitted.per_saving_node_s == pytest.approx(per_saving_s)
    assert fitted.per_selective_call_s == pytest.approx(per_call_s)
    assert fitted.offload_region_s == fitted.per_offloaded_storage_s == 0.0


def test_where_the_host_is_apart_the_fit_prices_each_offloaded_storage(monkeypatch):
    """On a device apart from the host (CUDA) the fit also steps the chains offloaded: each
    offloaded step taking the plain step and 50 us per region + 7 us per storage sent (one per
    layer), read off steps timed by a fake (what the figures come to on a GPU is measured in
    tests/cuda/test_timing.py)."""
    offload_region_s, per_storage_s, regions = 50e-6, 7e-6, 16
    steps_s = []
    for layers, plain_s in ((1, 0.010), (8, 0.030)):
        offload_s = plain_s + regions * (offload_region_s + layers * per_storage_s)
        # plain, forward, checkpointed, selective (no bookkeeping of their own), offloaded
        steps_s += [plain_s, 0.004, plain_s + 0.004, plain_s + 0.004, offload_s]
    times = iter(steps_s)
    monkeypatch.setattr(overhead_fits, "host_apart", lambda device: True)
    monkeypatch.setattr(overhead_fits, "_best_step_s", lambda step, repeats, device: next(times))
    fitted = overhead_fits.measure_checkpoint_overhead(torch.device("cpu"), regions=regions)
    assert next(times, None) is None  # every step timed once, the offloaded ones too
    assert fitted.offload_region_s == pytest.approx(offload_region_s)
    assert fitted.per_offloaded_storage_s == pytest.approx(per_storage_s)
    checkpoint_s = (fitted.region_s, fitted.per_saving_node_s, fitted.per_selective_call_s)
    assert checkpoint_s == pytest.approx((0.0, 0.0, 0.0), abs=1e-12)  # none in the fake's steps


@given(
    st.lists(st.floats(1e-7, 1e-2), min_size=1, max_size=40),
    st.floats(0.0, 2.0),
)
def test_the_host_floor_makes_the_calls_add_up_to_the_step(alone_s, stretch):
    total_s = sum(alone_s) * (1 + stretch)
    floor_s = host_floor_s(alone_s, total_s)
    assert sum(max(a, floor_s) for a in alone_s) == pytest.approx(total_s, rel=1e-9)
    assert host_floor_s(alone_s, 0.5 * sum(alone_s)) == 0.0  # already slower: no floor
    assert host_floor_s([], total_s) == 0.0  # no calls to spread the time over


def test_on_an_accelerator_each_call_takes_at_least_the_hosts_time():
    """Where the host's work overlaps the kernels (CUDA), a node costs the sum over its calls of
    the longer of the call's own time and the host's time per call; on the CPU the two add.
    Calls timed at 1, 2, 3... us and a host at 5 us per call tell them apart."""
    model, example = gpt_ref_small_example()
    c = capture(model, example)
    host_s = 5e-6

    seen = []

    def priced(overlaps: bool, step_time: StepTime | None = None):
        def timer(calls, device):  # noqa: ANN001
            seen[:] = calls
            texts = sorted({x.key_text for x in calls})
            times = {t: (k % 9 + 1) * 1e-6 for k, t in enumerate(texts)}
            # a calibration of an accelerator (host_overlaps) or of a CPU
            device = "cuda:test" if overlaps else "cpu:test"
            return fake_calibration(times, device=device, call_overhead_s=host_s)

        rates = profile_of_model(c.module)
        graph = estimate(
            c.module, c.args, c.kwargs, rates=rates, time_ops=True, timer=timer, step_time=step_time
        )
        return graph, sum(n.fwd_time_s + n.bwd_time_s for n in graph.nodes)

    overlapped, overlapped_s = priced(True)
    calls = len(seen)
    _, added_s = priced(False)
    # every call costs between the host's 5 us and its own 9 us at most, against 6-14 us added
    assert calls * host_s <= overlapped_s <= calls * 9e-6
    assert added_s >= calls * (host_s + 1e-6) and added_s > overlapped_s
    assert "at least 5.0 us per call" in overlapped.meta["timing"]
    # Fitted to a measured step: the floor that makes each phase add up to it.
    fitted, fitted_s = priced(True, StepTime(0.25, 0.5))
    assert fitted_s == pytest.approx(0.75)
    assert "at least" in fitted.meta["timing"]
