"""An applied in-place plan guards itself (issue 21): it knows the shape it was planned for and
warns once, with numbers, on a larger one; ``planner.verify`` measures a step against the
prediction. The shape and prediction survive ``p.save`` / ``planner.apply_plan``.

Tiny Hugging Face Llama (4 layers, width 64, grouped-query attention, batch 4 x 64 with one
padded row) planned in place at half its eager peak.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch

import planner
from planner.guard import PlannedShape, guard_of
from planner.plan_file import _checksum
from planner.solvers.errors import PlanFileError, PlannerError
from tests.planner.test_inplace_compile import applied, planned, tokens


def test_the_plan_records_its_shape_and_what_its_peak_is_made_of():
    model, p = planned()
    shape = p.planned_shape
    assert shape.shape == (4, 64) and shape.batch_size == 4 and shape.row_numel == 64
    assert shape.predicted_peak_bytes == p.predicted_peak_bytes
    # parameter gradients: every float parameter once (the embedding is tied to the head)
    params = {id(t): t for t in model.parameters()}.values()
    assert shape.fixed_bytes == sum(t.numel() * t.element_size() for t in params)
    assert 0 < shape.attention_share < 0.5
    assert shape.predicted_peak_at((4, 64)) == p.predicted_peak_bytes


def test_a_larger_batch_warns_once_with_both_shapes_and_the_scaled_peak():
    """Batch 8 on a batch-4 plan (issue 21: 1.94x the budget, no warning): one
    OverShapeWarning naming (4, 64), (8, 64) and the predicted peak at batch 8 (twice the
    planned peak: batch alone doubles), which the measured peak does not exceed."""
    model, _, p = applied()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the planned shape and smaller ones: silent
        for batch in (tokens(), tokens(batch=2), tokens(length=32)):
            model(**batch)
        with torch.no_grad():  # no activations kept for backward: any shape, silent
            model(**tokens(batch=8))
        model.eval()
        model(**tokens(batch=8))
        model.train()
    at_8 = 2 * p.predicted_peak_bytes
    with pytest.warns(planner.OverShapeWarning) as caught:
        v = planner.verify(model, tokens(batch=8))
    over = [w for w in caught if issubclass(w.category, planner.OverShapeWarning)]
    assert len(over) == 1
    text = str(over[0].message)
    assert "(4, 64) (batch 4, 64 per row)" in text and "(8, 64) (batch 8, 64 per row)" in text
    assert f"about {at_8:,} bytes" in text and f"budget of {p.budget_bytes:,} bytes" in text
    assert "an estimate" in text  # the approximation is named
    assert v.predicted_peak_bytes == at_8 and v.shape == (8, 64) and v.planned_shape == (4, 64)
    assert p.budget_bytes < v.measured_peak_bytes <= at_8  # over budget, as the warning said
    with warnings.catch_warnings():
        warnings.simplefilter("error", planner.OverShapeWarning)  # once per applied model
        planner.verify(model, tokens(batch=8))


def test_longer_rows_warn_and_scale_attention_quadratically():
    model, _, p = applied()
    shape = p.planned_shape
    share = shape.attention_share
    expected = round(p.predicted_peak_bytes * 2 * ((1 - share) + share * 2))
    assert shape.predicted_peak_at((4, 128)) == expected
    # a shorter batch of longer rows: same tokens, more attention
    assert shape.exceeded_by((2, 128)) and not shape.exceeded_by((4, 32))
    with pytest.warns(planner.OverShapeWarning, match=r"called with \(2, 128\)"):
        model(**tokens(length=128, batch=2))


def test_verify_at_the_planned_shape_is_the_prediction():
    model, _, p = applied()
    measured = planner.measure(model, tokens()).peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = planner.verify(model, tokens())
    assert dataclasses.is_dataclass(v) and v.method == "tracker"
    assert v.measured_peak_bytes == measured
    assert v.predicted_peak_bytes == p.predicted_peak_bytes
    assert v.ratio == measured / p.predicted_peak_bytes
    assert v.ok and abs(v.ratio - 1) <= 0.01
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.ratio = 0.0


def test_verify_warns_when_the_measurement_exceeds_the_prediction():
    """A guard whose prediction is 10% below the truth: verify reports it and warns."""
    model, _, p = applied()
    guard = guard_of(model)
    low = round(p.predicted_peak_bytes / 1.1)
    guard.shape = dataclasses.replace(guard.shape, predicted_peak_bytes=low)
    with pytest.warns(planner.PredictionExceededWarning, match=r"is 1\d\.\d% above the predicted"):
        v = planner.verify(model, tokens())
    assert v.predicted_peak_bytes == low and not v.ok
    assert v.ratio == pytest.approx(1.1, rel=0.01)


def test_verify_needs_an_applied_plan():
    model, _, _ = applied()
    planner.remove(model)
    assert guard_of(model) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the guard went with the plan
        model(**tokens(batch=8))
    with pytest.raises(PlannerError, match="needs a model with an applied in-place plan"):
        planner.verify(model, tokens())


def test_a_deep_copy_keeps_its_own_guard():
    model, _, p = applied()
    twin = copy.deepcopy(model)
    assert guard_of(twin) is not guard_of(model)
    assert guard_of(twin).shape == p.planned_shape
    with pytest.warns(planner.OverShapeWarning):
        twin(**tokens(batch=8))
    assert not guard_of(model).warned


def test_shape_and_prediction_survive_save_and_apply_plan(tmp_path):
    model, p = planned()
    path = tmp_path / "plan.json"
    p.save(path)
    fresh = planner.apply_plan(copy.deepcopy(model), path)
    assert guard_of(fresh).shape == p.planned_shape
    assert guard_of(fresh).budget_bytes == p.budget_bytes
    v = planner.verify(fresh, tokens())
    assert v.predicted_peak_bytes == p.predicted_peak_bytes and v.ok
    with pytest.warns(planner.OverShapeWarning, match=f"about {2 * p.predicted_peak_bytes:,}"):
        fresh(**tokens(batch=8))


def _rewrite(path, edit) -> None:
    body = json.loads(path.read_text())
    body.pop("checksum")
    edit(body)
    body["checksum"] = _checksum(body)
    path.write_text(json.dumps(body))


def test_files_from_before_shapes_load_and_bad_shapes_are_refused(tmp_path):
    model, p = planned()
    old = tmp_path / "old.json"
    p.save(old)
    _rewrite(old, lambda body: body.pop("planned_shape"))
    fresh = planner.apply_plan(copy.deepcopy(model), old)  # still loads and applies
    assert guard_of(fresh) is None
    with pytest.raises(PlannerError, match="save the plan again"):
        planner.verify(fresh, tokens())

    bad = tmp_path / "bad.json"
    p.save(bad)
    _rewrite(bad, lambda body: body["planned_shape"].pop("fixed_bytes"))
    with pytest.raises(PlanFileError, match="missing or has a malformed field"):
        planner.apply_plan(copy.deepcopy(model), bad)


def test_planned_shape_scaling_is_exact_arithmetic():
    shape = PlannedShape((4, 64), predicted_peak_bytes=1000, fixed_bytes=200, attention_share=0.25)
    assert shape.predicted_peak_at((8, 64)) == 2000  # growing: the whole peak scales
    assert shape.predicted_peak_at((4, 128)) == round(1000 * 2 * (0.75 + 0.25 * 2))
    assert shape.predicted_peak_at((2, 64)) == 200 + 800 // 2  # shrinking: gradients stay
    assert shape.exceeded_by((5, 64)) and shape.exceeded_by((4, 65))
    assert not shape.exceeded_by((4, 64)) and not shape.exceeded_by((1, 64))
