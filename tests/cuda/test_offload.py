"""Offload regions on CUDA (passes/offload.py, simulate's Rule 7): what a region saves goes to
pinned host memory on a side stream, overlapping the compute, and each storage comes back when
the backward that needs it unpacks it. The gradients equal the model's own within tolerance
(dropout included), the measured peak is the predicted one within 1%, and the copies out run on
another stream than the compute, while a compute kernel does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import planner
from planner.inplace_form import build_inplace_plan, price_inplace
from planner.passes import offload
from planner.solvers.costgraph import Region, Schedule
from tests.cuda.common import assert_close_step_copy, gpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def offload_plan(model: nn.Module, example_input, paths: tuple[str, ...]):
    """An in-place plan offloading the modules at ``paths`` (top level, nothing else)."""
    eg = price_inplace(model, example_input)
    spans = {path: span for span, path in eg.spans.items()}
    regions = tuple(Region(*spans[path], 0, "offload") for path in paths)
    return build_inplace_plan(model, eg, Schedule(regions, "manual"), 10**12)


def check_offload_block(device: torch.device, monkeypatch) -> None:
    model, x = gpt(device)
    reference = copy.deepcopy(model)
    p = offload_plan(model, x, ("blocks.1",))
    assert [m.kind for m in p.module_regions] == ["offload"]
    assert p.simulation.offload_bytes > 0
    calls: list[offload._Call] = []
    pack = offload._Call.pack

    def spy(call: offload._Call, t: torch.Tensor):
        if call not in calls:
            calls.append(call)
        return pack(call, t)

    monkeypatch.setattr(offload._Call, "pack", spy)
    p.apply(model)
    for seed in (0, 1):
        assert_close_step_copy(reference, model, x, seed)
    sent = [s for c in calls for s in c.sent]
    if device.type == "cuda":
        assert sent, "the block's activations go to host"
        for call in calls:
            if call.sent:
                assert call.stream is not None and call.stream != torch.cuda.current_stream()
        assert all(s.host.is_pinned() and s.host.device.type == "cpu" for s in sent)
    else:
        assert not sent  # on the CPU the host is the device: nothing is copied
    measured = planner.measure(model, x).peak_bytes
    if device.type == "cuda":
        error = p.predicted_peak_bytes / measured - 1
        assert abs(error) <= 0.01, (p.predicted_peak_bytes, measured)
    else:  # nothing left the device: the step's peak is the unplanned one
        planner.remove(model)
        assert measured == planner.measure(model, x).peak_bytes


def test_offloaded_block_gradients_prediction_and_side_stream(monkeypatch):
    check_offload_block(CUDA, monkeypatch)


class Wide(nn.Module):
    """Six 4096-wide linears: each saves a 64 MiB input, a copy long enough to overlap."""

    def __init__(self, width: int = 4096, depth: int = 6) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).relu())


def test_copies_run_beside_the_compute_on_another_stream():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = Wide().to(CUDA)
    x = torch.randn(4096, 4096, device=CUDA)
    reference = copy.deepcopy(model)
    p = offload_plan(model, x, ("body",))
    p.apply(model)
    assert_close_step_copy(reference, model, x)  # also warms the pinned-memory cache
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(x).sum().backward()
        torch.cuda.synchronize()
    events = [
        e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA
    ]
    copies = {
        "DtoH": [e for e in events if "Memcpy DtoH" in e.name()],
        "HtoD": [e for e in events if "Memcpy HtoD" in e.name()],
    }
    kernels = [e for e in events if not e.name().startswith(("Memcpy", "Memset"))]
    assert kernels and all(copies.values()), {k: len(v) for k, v in copies.items()}
    compute_streams = {e.device_resource_id() for e in kernels}
    out = copies["DtoH"]
    assert not {e.device_resource_id() for e in out} & compute_streams
    overlapping = [
        c
        for c in out
        if any(c.start_ns() < k.end_ns() and k.start_ns() < c.end_ns() for k in kernels)
    ]
    assert overlapping, "no copy to host ran while a compute kernel did"
