"""``planner.step_budget_gb`` / ``device_fit``: a device's memory to the step budget and back."""

from __future__ import annotations

import pytest
import torch

import planner
from planner.device_budget import static_memory

GB = 10**9
N = 1000 * 1000 + 1000  # nn.Linear(1000, 1000): weight and bias


def linear(frozen: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 1000)
    if frozen:
        m.weight.requires_grad_(False)
    return m


def test_fp32_adamw_subtracts_parameters_and_two_moments():
    budget = planner.step_budget_gb(linear(), device_memory_gb=1)
    assert budget * GB == pytest.approx(GB - 4 * N - 2 * 4 * N, abs=1)


def test_dtypes_master_weights_frozen_parameters_sharding_and_reserve():
    bf16 = static_memory(linear(), param_dtype=torch.bfloat16, master_weights=True)
    assert (bf16.parameter_bytes, bf16.optimizer_state_bytes, bf16.master_weight_bytes) == (
        2 * N,
        2 * 2 * N,
        4 * N,
    )
    fp32_state = static_memory(linear(), param_dtype=torch.bfloat16, optimizer_dtype=torch.float32)
    assert fp32_state.optimizer_state_bytes == 2 * 4 * N
    # only trainable parameters (the bias: 1000) keep optimizer state
    frozen = static_memory(linear(frozen=True), optimizer="sgd_momentum")
    assert (frozen.parameter_bytes, frozen.optimizer_state_bytes) == (4 * N, 4 * 1000)
    sharded = static_memory(linear(), fsdp_world_size=4, reserve_gb=0.5)
    assert sharded.parameter_bytes == N  # 4 * N bytes over 4 ranks
    assert sharded.optimizer_state_bytes == 2 * N
    assert sharded.reserve_bytes == GB // 2
    assert sharded.total_bytes == N + 2 * N + GB // 2


def test_a_device_the_baseline_fills_is_infeasible_and_options_are_checked():
    with pytest.raises(planner.InvalidBudgetError, match="alone fill a 0.01 GB device"):
        planner.step_budget_gb(linear(), device_memory_gb=0.01)
    with pytest.raises(ValueError, match="'adamw'"):
        planner.step_budget_gb(linear(), 1, optimizer="adamx")


def test_plan_at_the_step_budget_fits_the_device():
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)]
    )
    x = torch.randn(512, 256)
    eager = planner.plan(model, x, 1.0, "none", form="inplace", device="cpu")
    # a device that holds the parameters, AdamW's moments and 75% of the eager step
    static = static_memory(model)
    device_gb = (static.total_bytes + 0.75 * eager.predicted_peak_bytes) / GB
    budget_gb = planner.step_budget_gb(model, device_gb)
    assert budget_gb * GB == pytest.approx(0.75 * eager.predicted_peak_bytes, abs=1)
    p = planner.plan(model, x, budget_gb, form="inplace", device="cpu")
    fit = planner.device_fit(p, model, device_gb)
    assert (
        fit.fits
        and fit.spare_bytes == round(device_gb * GB) - static.total_bytes - p.predicted_peak_bytes
    )
    assert str(fit).startswith(
        f"fits a {device_gb:g} GB device with {fit.spare_bytes / GB:.2f} GB to spare"
    )
    assert not planner.device_fit(eager, model, device_gb).fits
    assert "does not fit" in str(planner.device_fit(eager, model, device_gb))
    assert str(planner.device_fit(p, model, 80)).startswith("fits an 80 GB device with 79.")
