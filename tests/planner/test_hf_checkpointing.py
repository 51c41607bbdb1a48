"""Hugging Face's own gradient checkpointing beside an in-place plan (issue 24).

- planning a model with it on warns, plans as if it were off (regions, the eager baseline of the
  model without it) and leaves the flags as they were;
- applying turns it off with a warning, so only the plan's regions checkpoint;
- enabling it on an applied model (``gradient_checkpointing_enable()``,
  ``activation_checkpointing_enable()``, ``TrainingArguments(gradient_checkpointing=True)``)
  raises ``CheckpointingConflictError`` and leaves the plan as it was;
- the model says a plan is on: ``is_gradient_checkpointing`` True while applied, False after
  ``planner.remove``; ``planner.applied_plan(model)``; disabling suspends, enabling restores.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import planner
from tests.planner.tiny_llama import BATCH, Rows, batch, llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def hf_checkpointing(model: torch.nn.Module) -> bool:
    """``is_activation_checkpointing`` (transformers 5) or ``is_gradient_checkpointing``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(type(model), "is_activation_checkpointing"):
            assert model.is_activation_checkpointing == model.is_gradient_checkpointing
            return model.is_activation_checkpointing
        return model.is_gradient_checkpointing


def layer_flags(model: torch.nn.Module) -> list[bool]:
    return [bool(getattr(layer, "gradient_checkpointing", False)) for layer in model.model.layers]


def wrapped(model: torch.nn.Module) -> set[str]:
    return {path for path, m in model.named_modules() if "forward" in m.__dict__}


class CheckpointCalls:
    """Counts torch.utils.checkpoint's non-reentrant calls (Hugging Face's and the plan's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = torch.utils.checkpoint._checkpoint_without_reentrant_generator

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(
            torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", counting
        )


@pytest.fixture(scope="module")
def half() -> tuple[Any, int, list[str]]:
    """A plan at half the eager peak of the tiny Llama with HF checkpointing on, the eager peak
    predicted for the model without it, and what planning warned."""
    eager = planner.plan(llama(), batch(), 1.0, "none", form="inplace", device="cpu")
    model = llama()
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = planner.plan(
            model, batch(), eager.predicted_peak_bytes / 2e9, form="inplace", device="cpu"
        )
    assert layer_flags(model) == [True] * 4 and hf_checkpointing(model)  # put back
    said = [str(w.message) for w in caught if str(w.message).startswith("planner")]
    return p, eager.predicted_peak_bytes, said


def test_planning_with_hf_checkpointing_on_plans_as_without_it(half):
    p, eager_bytes, said = half
    assert len(said) == 1 and "has Hugging Face gradient checkpointing on" in said[0]
    assert "planned as if it were off" in said[0]
    assert p.baseline_peak_bytes == eager_bytes
    assert len(p.regions) > 0 and p.solver != "none"
    assert p.predicted_peak_bytes <= eager_bytes / 2


def test_apply_turns_hf_checkpointing_off_and_only_the_plan_checkpoints(half, monkeypatch):
    p = half[0]
    model, ref = llama(), llama()
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="turned off Hugging Face gradient checkpointing"):
        p.apply(model)
    assert layer_flags(model) == [False] * 4
    calls = CheckpointCalls(monkeypatch)
    x = batch()
    torch.manual_seed(0)  # the same dropout masks for both
    model(**x).loss.backward()
    assert calls.count == len(p.regions)  # not a checkpoint per layer on top
    torch.manual_seed(0)
    ref(**x).loss.backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_the_model_reports_an_applied_plan(half, tmp_path):
    p = half[0]
    model = llama()
    assert not hf_checkpointing(model) and planner.applied_plan(model) is None
    p.apply(model)
    assert hf_checkpointing(model) and planner.applied_plan(model) is p
    assert layer_flags(model) == [False] * 4  # no layer checkpoints by Hugging Face's flag
    twin = copy.deepcopy(model)
    assert hf_checkpointing(twin) and planner.applied_plan(twin) is not None
    planner.remove(model)
    assert not hf_checkpointing(model) and planner.applied_plan(model) is None
    assert wrapped(model) == set()
    assert not {"gradient_checkpointing_enable", "gradient_checkpointing"} & set(model.__dict__)
    planner.remove(twin)
    assert not hf_checkpointing(twin)

    p.save(tmp_path / "plan.json")
    path_plan = planner.apply_plan(model, tmp_path / "plan.json")
    assert planner.applied_plan(model) is not None and hf_checkpointing(model)
    assert path_plan is model


@pytest.mark.parametrize(
    "method", ["gradient_checkpointing_enable", "activation_checkpointing_enable"]
)
def test_enabling_hf_checkpointing_on_an_applied_model_raises(half, method):
    p = half[0]
    model = p.apply(llama())
    if not hasattr(model, method):
        pytest.skip(f"this transformers has no {method}")
    before = wrapped(model)
    with pytest.raises(planner.CheckpointingConflictError, match="planner.remove"):
        getattr(model, method)()
    assert layer_flags(model) == [False] * 4 and wrapped(model) == before
    assert planner.applied_plan(model) is p


def test_training_arguments_gradient_checkpointing_on_an_applied_model_raises(half, tmp_path):
    p = half[0]
    model = p.apply(llama())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH,
        report_to=[], use_cpu=True, save_strategy="no", gradient_checkpointing=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(BATCH))
    with pytest.raises(planner.CheckpointingConflictError, match="gradient_checkpointing=False"):
        trainer.train()
    assert layer_flags(model) == [False] * 4 and planner.applied_plan(model) is p


def test_disabling_suspends_the_plan_and_enabling_restores_it(half):
    p = half[0]
    model = p.apply(llama())
    regions = wrapped(model)
    with pytest.warns(UserWarning, match="suspended the applied plan"):
        model.gradient_checkpointing_disable()
    assert wrapped(model) == set() and not hf_checkpointing(model)
    assert planner.applied_plan(model) is None
    model.gradient_checkpointing_enable()  # as trl does after generating
    assert wrapped(model) == regions and hf_checkpointing(model)
    assert layer_flags(model) == [False] * 4 and planner.applied_plan(model) is p
    planner.remove(model)
    model.gradient_checkpointing_enable()  # no plan: Hugging Face's own, as before
    assert layer_flags(model) == [True] * 4 and wrapped(model) == set()


def test_remove_turns_hf_checkpointing_back_on_as_it_was(half, monkeypatch):
    """Applying turned Hugging Face's flags off; removing the plan turns them on again, and the
    model trains with Hugging Face's checkpointing of every layer as before the plan."""
    p = half[0]
    model, ref = llama(), llama()
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="planner.remove\\(model\\) turns it back on"):
        p.apply(model)
    assert layer_flags(model) == [False] * 4
    planner.remove(model)
    assert layer_flags(model) == [True] * 4 and hf_checkpointing(model)
    assert wrapped(model) == set() and planner.applied_plan(model) is None
    calls = CheckpointCalls(monkeypatch)
    x = batch()
    torch.manual_seed(0)
    model(**x).loss.backward()
    assert calls.count == 4  # one per layer: Hugging Face's own checkpointing again
    torch.manual_seed(0)
    ref(**x).loss.backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), name
    # a model whose flags were off stays off
    other = p.apply(llama())
    planner.remove(other)
    assert layer_flags(other) == [False] * 4 and not hf_checkpointing(other)


def test_a_disable_while_applied_leaves_hf_checkpointing_off_after_remove(half):
    p = half[0]
    model = llama()
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p.apply(model)
        model.gradient_checkpointing_disable()  # the user's word: off
    planner.remove(model)
    assert layer_flags(model) == [False] * 4 and not hf_checkpointing(model)


def _planner_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("planner")]


def test_compare_and_fit_batch_in_the_graph_form_price_as_without_hf_checkpointing():
    """As planner.plan does: Hugging Face's checkpointing is paused while the model is
    captured and priced (it says so once per pricing), the flags put back afterwards."""
    x = batch(2, 32)
    plain = planner.compare(
        llama(layers=2), x, budget_fractions=[0.6], solvers=["dp"], form="graph", device="cpu"
    )
    model = llama(layers=2)
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = planner.compare(
            model, x, budget_fractions=[0.6], solvers=["dp"], form="graph", device="cpu"
        )
    said = _planner_warnings(caught)
    assert len(said) == 1 and "planned as if it were off" in said[0]
    assert c.eager_predicted_peak_bytes == plain.eager_predicted_peak_bytes
    assert [r.predicted_peak_bytes for r in c.rows] == [r.predicted_peak_bytes for r in plain.rows]
    assert layer_flags(model) == [True] * 2 and hf_checkpointing(model)
    cap_gb = plain.eager_predicted_peak_bytes / 1e9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = planner.fit_batch(
            model, lambda n: batch(n, 32), cap_gb, [2], form="graph", device="cpu", progress=False
        )
    said = _planner_warnings(caught)
    assert said and all("planned as if it were off" in s for s in said)
    assert fit.best.eager_peak_bytes == plain.eager_predicted_peak_bytes
    assert layer_flags(model) == [True] * 2
