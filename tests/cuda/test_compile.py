"""An in-place plan under torch.compile per block on CUDA (inductor), in torchtitan's order:
plan -> apply -> compile each block. The compiled model's loss and gradients equal the
untouched eager model's within inductor's tolerance (fused kernels reorder float sums), for two
steps (the second runs the cached code), and its measured peak (the profiler's allocation
events: the allocator-statistics path runs a dispatch mode, under which dynamo runs eager)
stays within the budget."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import planner
from tests.cuda.common import GPT_SMALL, assert_close_step_copy, gpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def check_compile_per_block(device: torch.device, backend: str) -> None:
    torch._dynamo.reset()
    # Dropout off: inductor draws its own random numbers (unless fallback_random), so its masks
    # are not eager's by design; the plan's RNG handling is tested uncompiled.
    model, x = gpt(device, replace(GPT_SMALL, dropout=0.0))
    eager_bytes = planner.measure(model, x).peak_bytes
    p = planner.plan(model, x, eager_bytes / 2 / 1e9, form="inplace")
    assert p.regions
    reference = copy.deepcopy(model)
    p.apply(model)
    for block in model.blocks:
        block.compile(backend=backend)  # in place: module paths and state_dict keys kept
    for seed in (0, 1):
        assert_close_step_copy(reference, model, x, seed, rtol=1e-3, atol=1e-5)
    assert list(model.state_dict()) == list(reference.state_dict())
    measured = planner.measure(model, x, method="profiler")
    torch._dynamo.reset()
    assert measured.peak_bytes <= p.budget_bytes, (measured.peak_bytes, p.budget_bytes)


def test_compile_per_block_inductor():
    check_compile_per_block(CUDA, "inductor")
