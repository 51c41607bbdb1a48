"""The user's own training stack (issue 24): a loss that reads the batch's labels, clear errors
for what planning on fake tensors cannot follow, plan files that refuse a model of other
shapes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.solvers.errors import UnsupportedModelError
from tests.helpers import assert_same_step_copy


class _Classifier(nn.Module):
    """Residual MLP blocks and a head: a forward that takes only the features."""

    def __init__(self, width: int = 32, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _classifier_batch(width: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    model = _Classifier(width)
    batch = {"x": torch.randn(64, width), "labels": torch.randint(0, 10, (64,))}
    return model, batch


def _cross_entropy(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(output, batch["labels"])


def _least_bytes(model, batch, form, loss_fn) -> int:
    with pytest.raises(planner.InfeasibleBudgetError) as e:
        planner.plan(model, batch, 1e-9, form=form, loss_fn=loss_fn, device="cpu")
    return e.value.min_bytes


# --------------------------------------------------------------------------- a step with labels


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_a_loss_of_output_and_batch_is_priced_measured_and_trains_alike(form):
    """loss_fn(output, batch) with the labels in the example input: the model gets what its
    forward takes, the loss the whole batch; priced on fake tensors, measured for real."""
    model, batch = _classifier_batch()
    reference = copy.deepcopy(model)
    eager_bytes = planner.measure(model, batch, _cross_entropy).peak_bytes
    least = _least_bytes(model, batch, form, _cross_entropy)
    assert least < eager_bytes
    for budget in (least + (eager_bytes - least) // 3, (least + eager_bytes) // 2):
        p = planner.plan(
            model, batch, budget / 1e9, form=form, loss_fn=_cross_entropy, device="cpu"
        )
        assert p.regions and p.baseline_peak_bytes == eager_bytes
        planned = p.apply(copy.deepcopy(model)) if form == "inplace" else p.module
        measured = planner.measure(planned, batch, _cross_entropy).peak_bytes
        assert measured <= p.predicted_peak_bytes <= budget
        if form == "inplace":  # priced on what eager runs: exact
            assert measured == p.predicted_peak_bytes
        else:  # the graph form prices the exported graph, on the safe side
            assert p.predicted_peak_bytes <= 1.01 * measured
        assert_same_step_copy(reference, planned, batch, loss_fn=_cross_entropy)


def test_a_tuple_batch_gives_the_model_the_features_and_the_loss_the_labels():
    model, batch = _classifier_batch()
    pair = (batch["x"], batch["labels"])

    def loss_fn(output, b):
        return F.cross_entropy(output, b[1])

    p = planner.plan(model, pair, 1.0, form="inplace", loss_fn=loss_fn, solver="none", device="cpu")
    assert p.baseline_peak_bytes == planner.measure(model, pair, loss_fn).peak_bytes


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_labels_held_from_outside_the_batch_say_how_to_pass_them(form):
    model, batch = _classifier_batch()
    labels = batch["labels"]
    with pytest.raises(UnsupportedModelError, match=r"Put the labels in the example input"):
        planner.plan(
            model,
            batch["x"],
            1.0,
            form=form,
            loss_fn=lambda out: F.cross_entropy(out, labels),
            device="cpu",
        )
