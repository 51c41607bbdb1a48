"""planner.measure on CUDA: the peak is the caching allocator's ``max_memory_allocated`` above
the step's start (not what it reserves), exact where the bytes can be counted by hand (each
block rounded up to 512 bytes), independent of what the cache already holds, and in agreement
with the profiler's allocation events; the CUDA RNG stream is left as found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.models import mlp_example
from planner.measurement import measure
from planner.passes.step import call, training_loss
from tests.cuda.common import gpt, to_device

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
F32 = 4
BLOCK = 512  # the caching allocator's rounding of every allocation


def _block(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def allocator_peak_bytes(model: nn.Module, example_input) -> int:
    """The same step measured by hand from the allocator's statistics."""
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    base_bytes = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    training_loss(call(model, example_input)).backward()
    torch.cuda.synchronize()
    peak_bytes = torch.cuda.max_memory_allocated() - base_bytes
    for p in model.parameters():
        p.grad = None
    return peak_bytes


def test_peak_is_max_allocated_above_the_start_not_reserved():
    model, x = mlp_example(batch=1024, width=512, depth=4)
    model, x = model.to(CUDA), x.to(CUDA)
    m = measure(model, x)
    assert m.method == "cuda"
    assert m.peak_bytes == allocator_peak_bytes(model, x)
    assert 0 < m.saved_bytes < m.peak_bytes
    assert m.peak_event.startswith(("forward:", "loss:", "backward:"))
    # The step's peak lies within what the allocator reserved for it.
    assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_allocated() + m.peak_bytes

    # With the cache emptied the allocator reserves anew (cudaMalloc) during the step, and a
    # cache holding a 256 MiB free block reserves nothing new: what is allocated, and so the
    # peak, stays. Not to the byte: the allocator hands out a cached large block whole when
    # splitting it would leave 1 MiB or less, and counts it whole (its should_split rule), so
    # the cache's state can move the peak by such remainders, a few of this step's ~20 MiB.
    torch.cuda.empty_cache()
    cold = measure(model, x, warmup=0)
    assert cold.peak_bytes == pytest.approx(m.peak_bytes, rel=0.02)
    hog = torch.empty(256 * 2**20, dtype=torch.uint8, device=CUDA)
    del hog
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 256 * 2**20
    assert measure(model, x).peak_bytes == pytest.approx(m.peak_bytes, rel=0.02)


def test_linear_chain_bytes_are_exact_in_allocator_blocks():
    # tests/planner/test_measure.py's chain, each tensor a whole number of 512-byte blocks
    batch, d0, d1, d2, d3 = 64, 16, 32, 48, 8
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(d0, d1, bias=False), nn.Linear(d1, d2, bias=False), nn.Linear(d2, d3, bias=False)
    ).to(CUDA)
    x = torch.randn(batch, d0, device=CUDA)
    h1, h2 = batch * d1 * F32, batch * d2 * F32
    dh1, dh2 = h1, h2
    g2, g3 = d1 * d2 * F32, d2 * d3 * F32
    scalars = 2 * _block(F32)  # the loss and its seed gradient, one block each
    assert all(n % BLOCK == 0 for n in (h1, h2, g2, g3))

    m = measure(model, x)

    assert m.saved_bytes == h1 + h2
    assert m.peak_bytes == h1 + dh2 + dh1 + g3 + g2 + scalars
    assert m.peak_event.startswith("backward:")


def test_profiler_agrees_with_the_allocator_statistics():
    model, x = gpt(CUDA)
    by_stats = measure(model, x, method="cuda")
    profiled = measure(model, x, method="profiler")
    assert profiled.method == "profiler"
    assert profiled.peak_bytes == pytest.approx(by_stats.peak_bytes, rel=0.01)
    assert profiled.saved_bytes == pytest.approx(by_stats.saved_bytes, rel=0.01)


def test_step_times_are_synchronised_and_rng_left_as_found():
    model, x = gpt(CUDA)  # dropout 0.1: the step draws from the CUDA generator
    cuda_rng, cpu_rng = torch.cuda.get_rng_state(), torch.get_rng_state()
    m = measure(model, x, repeats=3)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    # A step timed without waiting for its kernels would take the host's launch time only:
    # the measured step is at least the kernels' time, which the profiler sees.
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        training_loss(call(model, to_device(x, CUDA))).backward()
        torch.cuda.synchronize()
    kernels_s = 1e-9 * sum(
        e.duration_ns()
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA
    )
    for p in model.parameters():
        p.grad = None
    assert kernels_s > 0
    assert m.step_time_s >= 0.9 * kernels_s, (m.step_time_s, kernels_s)
