"""compare in place on the user's model: every strategy and the anchors side by side, run for
real; and dp never slower than the simple strategies at their own predicted peaks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import planner
from benchmarks.dominance import STRATEGIES, DominanceRow, dominance_rows, markdown
from planner.inplace_form import price_inplace
from tests import models_zoo as zoo


@pytest.fixture(scope="module")
def measured_llama():
    model, x = zoo.llama_example()
    c = planner.compare(model, x, budget_fractions=[0.9, 0.7, 0.5], measure=True, repeats=1)
    return model, x, c


@pytest.mark.slow
def test_compare_in_place_lists_every_strategy_and_the_anchors_measured(measured_llama):
    _, _, c = measured_llama
    solvers = list(dict.fromkeys(r.solver for r in c.rows))
    strategies = [s for s in solvers if s not in ("every-block", "hf")]
    assert len(strategies) >= 8 and {"uniform", "sqrt", "greedy", "revolve"} <= set(strategies)
    assert {"selective", "sac", "dp", "ilp", "none"} <= set(strategies)
    assert solvers[-2:] == ["every-block", "hf"]
    feasible = [r for r in c.rows if r.feasible]
    assert {r.solver for r in feasible} >= {"dp", "every-block", "hf", "sac", "selective"}
    for r in feasible:
        assert r.measured_peak_bytes <= r.budget_bytes, r
        assert r.measured_peak_bytes <= r.predicted_peak_bytes, r
        assert r.measured_step_time_s > 0 and r.step_time_ratio > 0
    # a fixed policy's row does not fit below its own peak, and says what does
    for r in c.rows:
        if r.solver in ("every-block", "hf", "uniform") and not r.feasible:
            assert r.least_feasible_bytes > r.budget_bytes


@pytest.mark.slow
def test_the_anchors_are_every_block_and_hugging_faces_own_layers(measured_llama):
    model, x, c = measured_llama
    budget = max(r.budget_bytes for r in c.rows)
    hf = c.plans[("hf", budget)]
    every = c.plans[("every-block", budget)]
    assert [r.name for r in hf.regions] == ["model.layers.0", "model.layers.1"]
    assert [r.name for r in every.regions] == [r.name for r in hf.regions]
    assert hf.predicted_peak_bytes == every.predicted_peak_bytes
    # measured with Hugging Face's own checkpointing, turned off again after
    assert not getattr(model.model.layers[0], "gradient_checkpointing", False)
    rows = {r.solver: r for r in c.rows if r.budget_bytes == budget}
    assert rows["hf"].measured_peak_bytes <= rows["hf"].predicted_peak_bytes
    # and the plan that dp makes within every-block's peak is no slower than it, predicted
    dp = planner.plan(model, x, every.predicted_peak_bytes / 1e9, solver="dp")
    assert dp.predicted_step_time_s <= every.predicted_step_time_s


@pytest.mark.parametrize("name", zoo.block_model_params())
def test_dp_is_never_slower_than_a_simple_strategy_at_its_peak(name):
    model, x = zoo.BLOCK_MODELS[name]()
    rows = dominance_rows(name, price_inplace(model, x).graph)
    assert [r.strategy for r in rows] == [s for s, _, _ in STRATEGIES]
    for r in rows:
        assert r.dp_peak_bytes <= r.peak_bytes, r
        assert r.dp_step_time_s <= r.step_time_s, r


@pytest.mark.slow
def test_the_hf_anchor_leaves_hugging_faces_checkpointing_as_the_user_had_it():
    from planner.hf_checkpointing import hf_flags_on

    model, x = zoo.llama_example()
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="planned as if it were off"):
        c = planner.compare(model, x, budget_fractions=[0.9], solvers=["none"], anchors=["hf"])
    (budget,) = {r.budget_bytes for r in c.rows}
    assert [r.name for r in c.plans[("hf", budget)].regions] == ["model.layers.0", "model.layers.1"]
    assert "model.layers.0" in hf_flags_on(model)  # still on, as the user had it
    model.gradient_checkpointing_disable()
    planner.compare(model, x, budget_fractions=[0.9], solvers=["none"], anchors=["hf"])
    assert hf_flags_on(model) == []  # turned on to read its layers, and off again


def test_a_dominance_row_holds_only_when_dp_is_no_higher_and_no_slower():
    r = DominanceRow("m", "s", 2**20, 0.01, 2**20, 0.008)
    assert r.holds
    assert not dataclasses.replace(r, dp_peak_bytes=2**20 + 1).holds
    assert not dataclasses.replace(r, dp_step_time_s=0.0101).holds
    assert "| m | s | 1.000 MiB | 10.00 ms | 8.00 ms | 20.0% |" in markdown([r])


def test_the_committed_dominance_table_covers_the_block_models_and_holds():
    body = json.loads((Path(__file__).parents[2] / "benchmarks/results/dominance.json").read_text())
    assert body["command"] == "python -m benchmarks.dominance"
    rows = [DominanceRow(**{k: v for k, v in r.items() if k != "holds"}) for r in body["rows"]]
    assert {r.model for r in rows} >= set(zoo.BLOCK_MODELS)
    assert {r.strategy for r in rows} == {s for s, _, _ in STRATEGIES}
    assert all(r.holds for r in rows)
