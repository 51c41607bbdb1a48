"""Saved plans: round trip, and every malformed or misapplied file refused."""

from __future__ import annotations

import json

import pytest

import planner
from benchmarks.models import GPT_REF_SMALL, gpt_example, gpt_ref_small_example
from tests.helpers import assert_same_step


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, example_input = gpt_ref_small_example()
    p = planner.plan(model, example_input, mem_budget_gb=1.0, solver="uniform", form="graph")
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    p.save(path)
    return model, example_input, p, path


def test_round_trip_gives_the_same_module_and_gradients(saved):
    model, example_input, p, path = saved
    again = planner.apply_plan(model, path, example_input)
    assert again.module.code == p.module.code
    assert again.regions == p.regions
    assert again.predicted_peak_bytes == p.predicted_peak_bytes
    assert_same_step(model, again.module, example_input)


def _rewrite(path, tmp_path, edit):
    body = json.loads(path.read_text())
    edit(body)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(body))
    return out


def test_truncated_file_is_refused(saved, tmp_path):
    model, example_input, _, path = saved
    bad = tmp_path / "truncated.json"
    bad.write_text(path.read_text()[:100])
    with pytest.raises(planner.PlanFileError, match="not valid JSON"):
        planner.apply_plan(model, bad, example_input)


def test_hand_edited_file_is_refused(saved, tmp_path):
    model, example_input, _, path = saved
    bad = _rewrite(path, tmp_path, lambda b: b["regions"][0]["nodes"].pop())
    with pytest.raises(planner.PlanFileError, match="modified"):
        planner.apply_plan(model, bad, example_input)


def test_unknown_version_is_refused(saved, tmp_path):
    model, example_input, _, path = saved
    bad = _rewrite(path, tmp_path, lambda b: b.update(version=99))
    with pytest.raises(planner.PlanFileError, match="version 99"):
        planner.apply_plan(model, bad, example_input)


def test_not_a_plan_file_is_refused(saved, tmp_path):
    model, example_input, _, _ = saved
    bad = tmp_path / "other.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(planner.PlanFileError, match="not a planner plan file"):
        planner.apply_plan(model, bad, example_input)


def test_plan_for_another_model_is_refused(saved):
    _, _, _, path = saved
    other, other_input = gpt_example(
        GPT_REF_SMALL.__class__(n_layer=3, d_model=64, n_head=2, seq_len=32, vocab_size=128),
        batch=2,
    )
    with pytest.raises(planner.PlanFileError, match="another model"):
        planner.apply_plan(other, path, other_input)


def test_plan_for_other_shapes_is_refused(saved):
    model, example_input, _, path = saved
    idx, targets = example_input
    with pytest.raises(planner.PlanFileError, match="other input shapes"):
        planner.apply_plan(model, path, (idx[:1], targets[:1]))
