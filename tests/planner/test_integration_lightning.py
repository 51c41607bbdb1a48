"""``planner.integrations.lightning.PlanCallback`` with a tiny LightningModule (issue 24).

A LightningModule holding a tiny Llama (4 layers, hidden 64, GQA, CPU, float32) trains 3 steps
with the callback and without it from the same seed: every step's gradients are bitwise equal,
the plan is at 50% of the predicted eager peak, and the logged metrics carry the predicted and
the measured peak.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import planner
from tests.planner.tiny_llama import BATCH, SEQ, Rows, batch, llama

L = pytest.importorskip("lightning")  # before the callback's module, which imports it

from planner.integrations.lightning import PlanCallback  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 3


class CausalLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Grads(L.Callback):
    """Every optimizer step's gradients, as the optimizer is about to see them."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.steps.append(
            {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        )


def fit(module: CausalLM, tmp_path, *callbacks: Any, **extra: Any) -> tuple[Any, Grads]:
    grads = Grads()
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, grads], default_root_dir=str(tmp_path), **extra,
    )  # fmt: skip
    L.seed_everything(0)
    loader = torch.utils.data.DataLoader(Rows(BATCH * STEPS), batch_size=BATCH, shuffle=True)
    trainer.fit(module, loader)
    return trainer, grads


def test_lightning_plans_on_first_batch_at_half_eager(tmp_path):
    _, ref = fit(CausalLM(), tmp_path / "ref")
    module = CausalLM()
    cb = PlanCallback(mem_budget_gb="50%", largest_shape=(BATCH, SEQ), module="model", device="cpu")
    trainer, got = fit(module, tmp_path / "plan", cb)

    plan = cb.plan
    assert planner.applied_plan(module.model) is plan and len(plan.regions) > 0
    assert plan.budget_bytes == round(0.5 * plan.baseline_peak_bytes)
    assert len(got.steps) == len(ref.steps) == STEPS
    for step, (a, b) in enumerate(zip(got.steps, ref.steps)):
        assert a.keys() == b.keys() and a
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name} differs"

    assert [h["step"] for h in cb.history] == list(range(STEPS))
    for h in cb.history:
        assert h["planner/predicted_peak_bytes"] == plan.predicted_peak_bytes
        measured = h["planner/measured_peak_bytes"]
        assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, h
        assert measured <= plan.budget_bytes, h
    logged = trainer.callback_metrics
    assert logged["planner/predicted_peak_bytes"].item() == plan.predicted_peak_bytes
    assert (
        logged["planner/measured_peak_bytes"].item()
        == cb.history[-1]["planner/measured_peak_bytes"]
    )


def test_lightning_bf16_mixed_plans_the_first_batch_under_autocast(tmp_path):
    """precision="bf16-mixed": training_step runs under torch.autocast, the batch-start hook
    that plans does not; the plan is priced under bf16 autocast all the same."""
    _, ref = fit(CausalLM(), tmp_path / "ref", precision="bf16-mixed")
    module = CausalLM()
    cb = PlanCallback(mem_budget_gb="50%", largest_shape=(BATCH, SEQ), module="model", device="cpu")
    _, got = fit(module, tmp_path / "plan", cb, precision="bf16-mixed")
    plan = cb.plan
    assert plan.precision == "parameters float32; autocast cpu bfloat16" and plan.regions
    for step, (a, b) in enumerate(zip(got.steps, ref.steps, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name} differs"
    assert len(cb.history) == STEPS
    for h in cb.history:
        measured = h["planner/measured_peak_bytes"]
        assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, h
        assert measured <= plan.budget_bytes, h


def test_lightning_applies_a_saved_plan_in_setup(tmp_path):
    module = CausalLM()
    p = planner.plan(module.model, batch(), 1.0, "none", form="inplace", device="cpu")
    p = planner.plan(
        module.model, batch(), p.predicted_peak_bytes / 2e9, form="inplace", device="cpu"
    )
    path = tmp_path / "plan.json"
    p.save(path)
    cb = PlanCallback(path, module="model")
    trainer, _ = fit(module, tmp_path / "fit", cb)
    assert planner.applied_plan(module.model) is cb.plan  # applied in setup
    # each region's module wrapped (a span of a module's own forward: that module)
    assert {r.place.path for r in cb.plan.module_regions} == {
        path for path, m in module.model.named_modules() if "forward" in m.__dict__
    }
    assert [h["planner/predicted_peak_bytes"] for h in cb.history] == [p.predicted_peak_bytes] * 3
    for h in cb.history:
        assert h["planner/measured_peak_bytes"] <= p.budget_bytes, h
    with pytest.raises(ValueError, match="no such submodule"):
        PlanCallback(path, module="nope").setup(trainer, module, "fit")
