"""Timing on CUDA: a step's ops are timed on the device with identical blocks sharing one price,
and the device's profile comes from the table by name (planner/devices.py). What only the
device's clock can show (kernels waited for, the host's overheads, recomputation's cost) is
measured by ``python -m benchmarks.cuda_timing``."""

from __future__ import annotations

import pytest
import torch

from planner.devices import PROFILES, device_rates, profile_of, profile_of_model
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from tests.cuda.common import gpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


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


def test_the_devices_profile_comes_from_the_table_or_is_measured():
    profile = profile_of(CUDA)
    name = torch.cuda.get_device_name(CUDA).lower()
    known = [key for key in PROFILES if key.partition("-")[0] in name]
    if known:
        assert profile in [PROFILES[k] for k in known]
    assert profile.host_link and profile.offload_overlap > 0
    flops_per_s, bytes_per_s = device_rates(CUDA)
    assert flops_per_s == profile.flops_per_s and bytes_per_s == profile.bytes_per_s
