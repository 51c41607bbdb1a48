"""A prediction added to the plan type reaches the plan file, the summary and compare's table
with no other change: they read ``plans.Predictions`` field by field, units from the names.

The test adds one the way a contributor would: a Predictions with one more field and its line
in ``Predictions.of``, which both forms' plans are filled from (here a subclass, so the real
type stays as it is). Old plan files, saved before fields were added, load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

import planner
from planner import inplace_form, plans, priced
from planner.plan_file import _checksum
from planner.report import format_bytes


def saved_for_backward_bytes(graph) -> int:
    return sum(t.size_bytes for t in graph.tensors if t.saved_by)


@dataclass(frozen=True)
class WithSaved(plans.Predictions):
    saved_for_backward_bytes: int = 0  # what the step keeps for backward without checkpointing

    @classmethod
    def of(cls, graph, simulation, baseline_peak_bytes):
        fields = super().of(graph, simulation, baseline_peak_bytes)
        return replace(fields, saved_for_backward_bytes=saved_for_backward_bytes(graph))


@pytest.fixture
def extended(monkeypatch):
    """The plan type, one field more, where the pipeline and the plan file look it up."""
    monkeypatch.setattr(plans, "Predictions", WithSaved)
    monkeypatch.setattr(priced, "Predictions", WithSaved)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)))


X = torch.randn(16, 32)


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_a_new_prediction_reaches_file_summary_and_compare(extended, form, tmp_path):
    model = _model()
    p = planner.plan(model, X, 1.0, form=form, device="cpu")
    expected = saved_for_backward_bytes(p.graph)
    assert expected > 0 and p.predictions.saved_for_backward_bytes == expected

    path = tmp_path / "plan.json"
    p.save(path)
    assert json.loads(path.read_text())["predictions"]["saved_for_backward_bytes"] == expected
    if form == "inplace":
        again = inplace_form.load_inplace(path)
    else:
        again = planner.apply_plan(model, path, X)
    assert untimed(again.predictions) == untimed(p.predictions)

    assert f"saved for backward {format_bytes(expected)}" in p.summary()

    c = planner.compare(model, X, budgets_gb=[1.0], solvers=["none"], form=form, device="cpu")
    assert c.rows[0].other_predictions == (("saved_for_backward_bytes", expected),)
    text = str(c)
    assert "saved for backward" in text and format_bytes(expected) in text
    frame = c.to_pandas()
    assert list(frame["predicted_saved_for_backward_bytes"]) == [expected]


def untimed(predictions: plans.Predictions) -> plans.Predictions:
    """Without the times: a graph plan applied from a file is priced anew, on the model's own
    device (the plan was priced for the "cpu" profile)."""
    return replace(predictions, recompute_time_s=0.0, step_time_s=0.0)


def _as_saved_before(path, tmp_path, edit) -> str:
    """``path``'s plan as an earlier planner wrote it (``edit`` takes the new keys out)."""
    body = json.loads(path.read_text())
    del body["checksum"]
    edit(body)
    body["checksum"] = _checksum(body)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(body))
    return str(old)


def test_plan_files_saved_before_the_one_format_still_apply(tmp_path):
    model = _model()
    p = planner.plan(model, X, 1.0, device="cpu", solver="dp")
    p.save(tmp_path / "inplace.json")

    def inplace_before(body):  # no notes, no times, regions named by "module" only
        del body["notes"]
        for key in ("recompute_time_s", "step_time_s"):
            del body["predictions"][key]
        for r in body["regions"]:
            del r["name"]

    old = _as_saved_before(tmp_path / "inplace.json", tmp_path, inplace_before)
    again = inplace_form.load_inplace(old)
    assert again.regions == p.regions and again.form == "inplace"
    assert again.predicted_peak_bytes == p.predicted_peak_bytes
    assert again.predicted_step_time_s == 0.0  # not recorded then
    assert planner.apply_plan(_model(), old) is not None

    g = planner.plan(model, X, 1.0, device="cpu", form="graph", solver="uniform")
    g.save(tmp_path / "graph.json")

    def graph_before(body):  # no form, no notes, three predictions
        del body["form"], body["notes"]
        for key in ("step_flops", "recompute_time_s", "step_time_s"):
            del body["predictions"][key]
        for r in body["regions"]:
            assert not r.get("keeps") and "module" not in r  # a graph plan's regions as ever

    old = _as_saved_before(tmp_path / "graph.json", tmp_path, graph_before)
    again = planner.apply_plan(model, old, X)
    assert again.regions == g.regions and again.module.code == g.module.code
    assert untimed(again.predictions) == untimed(g.predictions)


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_plans_of_one_pricing_simulate_the_step_without_checkpointing_once(form, monkeypatch):
    """``baseline_peak_bytes`` is the pricing's cached ``eager_peak_bytes``: building a plan
    does not simulate the no-checkpoint step again."""
    from planner.planning import PlanOptions

    uncheckpointed = []
    real = priced.simulate

    def counting(graph, schedule, *args, **kwargs):
        if not schedule.regions:
            uncheckpointed.append(graph)
        return real(graph, schedule, *args, **kwargs)

    monkeypatch.setattr(priced, "simulate", counting)
    pricing = PlanOptions(form=form, device="cpu").checked().price(_model(), X)
    built = [pricing.plan(budget, "dp") for budget in (10**9, pricing.eager_peak_bytes)]
    assert len(uncheckpointed) == 1
    assert all(p.baseline_peak_bytes == pricing.eager_peak_bytes for p in built)
    assert pricing.eager_peak_bytes == real(pricing.graph, priced.Schedule()).peak_bytes
