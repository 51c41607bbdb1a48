"""Timing on CUDA: op timing waits for the kernels (passes/op_timing.py), the per-call and
per-region host overheads are measured there, a step's ops are timed on the device with identical
blocks sharing one price, recomputation costs measured time, and the device's profile comes from
the table by name (planner/devices.py)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.models import GPTConfig
from planner.devices import PROFILES, device_rates, profile_of, profile_of_model
from planner.measurement import measured_step_time
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.passes.op_call import op_call
from planner.passes.op_timing import time_calls
from planner.passes.overhead_fits import call_overhead_s, checkpoint_overhead, host_overlaps
from tests.cuda.common import gpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def test_op_times_wait_for_the_kernels():
    """A 4096^3 matmul does 64x the work of a 1024^3 one. Timed without synchronising both
    would take the launch time; synchronised, their times scale with the work."""
    small, large = (torch.randn(n, n, device=CUDA) for n in (1024, 4096))
    calls = [op_call(torch.ops.aten.mm.default, (a, a), {}) for a in (small, large)]
    times = time_calls(calls, CUDA)
    small_s, large_s = times[calls[0].key], times[calls[1].key]
    assert large_s > 16 * small_s, (small_s, large_s)
    assert 2 * 4096**3 / large_s < 2e15  # no device does float32 matmuls at 2 PFLOP/s


def test_host_overheads_are_measured_on_cuda():
    """On CUDA the host's work per call and per region bounds small steps (op_timing's
    docstring): each is measured there, and each is a host's figure, microseconds."""
    assert 1e-6 < call_overhead_s(CUDA) < 1e-3
    overhead = checkpoint_overhead(CUDA)
    assert 1e-6 < overhead.region_s < 1e-2
    assert 1e-6 < overhead.offload_region_s + overhead.per_offloaded_storage_s < 1e-2
    assert host_overlaps(CUDA) and not host_overlaps(torch.device("cpu"))


def test_identical_blocks_get_identical_measured_times_on_the_device():
    model, example = gpt(CUDA)
    c = capture(model, example)
    graph = estimate(c.module, c.args, c.kwargs, time_ops=True, rates=profile_of_model(c.module))
    assert all(n.fwd_time_s is not None and n.fwd_time_s >= 0 for n in graph.nodes)

    def block(k: int) -> list[tuple]:
        inside = [n for n in graph.nodes if n.module_path.startswith(f"blocks.{k}")]
        return [(n.op, n.fwd_time_s, n.bwd_time_s) for n in inside]

    assert block(0) and block(0) == block(1)
    assert graph.step_time_s > 0


def test_recomputing_the_whole_forward_costs_measured_time():
    # wide enough that the kernels, not the host, set the step's time
    cfg = GPTConfig(n_layer=4, d_model=1024, n_head=8, seq_len=512, vocab_size=1024)
    model, x = gpt(CUDA, cfg, batch=8)
    timed = measured_step_time(model, x)
    assert timed is not None and timed.forward_s > 0 and timed.backward_s > 0
    assert timed.checkpointed_s > timed.step_s
    assert timed.selective_s > timed.step_s


def test_the_devices_profile_comes_from_the_table_or_is_measured():
    profile = profile_of(CUDA)
    name = torch.cuda.get_device_name(CUDA).lower()
    known = [key for key in PROFILES if key.partition("-")[0] in name]
    if known:
        assert profile in [PROFILES[k] for k in known]
    assert profile.host_link and profile.offload_overlap > 0
    flops_per_s, bytes_per_s = device_rates(CUDA)
    assert flops_per_s == profile.flops_per_s and bytes_per_s == profile.bytes_per_s
