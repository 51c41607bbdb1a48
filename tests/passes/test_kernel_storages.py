"""Losses whose real kernel returns a scalar on an input-sized storage (kernel_storages.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import planner
from planner.passes.kernel_storages import real_storage_bytes

ATEN = torch.ops.aten
ROWS, COLS = 64, 32


def loss_calls():
    x, t, p = torch.randn(ROWS, COLS), torch.randn(ROWS, COLS), torch.rand(ROWS, COLS)
    return {
        "mse": (ATEN.mse_loss.default, (x, t)),
        "smooth_l1": (ATEN.smooth_l1_loss.default, (x, t)),
        "bce": (ATEN.binary_cross_entropy.default, (p, p)),
        "soft_margin": (ATEN.soft_margin_loss.default, (x, t)),
        "l1": (ATEN.l1_loss.default, (x, t)),
        "huber": (ATEN.huber_loss.default, (x, t)),
        "kl": (ATEN.kl_div.default, (x, t)),
        "bce_logits": (ATEN.binary_cross_entropy_with_logits.default, (x, p)),
    }


@pytest.mark.parametrize("name", list(loss_calls()))
@pytest.mark.parametrize("reduction", [0, 1, 2])  # none, mean, sum
def test_the_storage_priced_is_the_storage_the_cpu_kernel_returns(name, reduction):
    func, args = loss_calls()[name]
    out = func(*args, reduction=reduction)
    priced = real_storage_bytes(func, args, {"reduction": reduction})
    fake_bytes = out.numel() * out.element_size()  # what a fresh storage for it would take
    assert out.untyped_storage().nbytes() == (fake_bytes if priced is None else priced)
    shrinks = name in ("mse", "smooth_l1", "bce", "soft_margin") and reduction != 0
    assert (priced is not None) == shrinks


def test_a_step_with_mse_loss_is_priced_with_the_storage_its_loss_holds():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)]
    model = nn.Sequential(*blocks)
    batch = {"input": torch.randn(512, 64), "target": torch.randn(512, 64)}

    def loss_fn(output, batch):
        return nn.functional.mse_loss(output, batch["target"])

    eager = planner.measure(model, batch, loss_fn).peak_bytes
    unchecked = planner.plan(model, batch, 1.0, loss_fn=loss_fn, solver="none")
    assert unchecked.predicted_peak_bytes == eager
    budget_bytes = 0.7 * eager
    p = planner.plan(model, batch, budget_bytes / 1e9, loss_fn=loss_fn)
    p.apply(model)
    try:
        measured = planner.measure(model, batch, loss_fn).peak_bytes
    finally:
        planner.remove(model)
    assert measured <= p.predicted_peak_bytes <= budget_bytes
