"""End to end: plan() on small models, for every solver; the budget contract; errors."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import planner
from benchmarks.models import (
    GPTConfig,
    gpt_example,
    gpt_ref_small_example,
    residual_cnn_example,
)
from planner.comparison import solver_names
from tests.helpers import assert_same_step

EXAMPLES = {
    "gpt_small": gpt_ref_small_example,
    "resnet": lambda: residual_cnn_example(batch=8, size=16, channels=8, n_blocks=4),
}


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def example(request):
    model, example_input = EXAMPLES[request.param]()
    return model, example_input, planner.measure(model, example_input)


@pytest.mark.parametrize("solver", solver_names() + ["auto"])
def test_every_solver_trains_exactly_like_the_model(example, solver):
    model, example_input, eager = example
    p = planner.plan(
        model, example_input, mem_budget_gb=eager.peak_bytes / 1e9, solver=solver, form="graph"
    )
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert_same_step(model, p.module, example_input)
    model_params = {id(q) for q in model.parameters()}
    assert {id(q) for q in p.module.parameters()} == model_params


def test_checkpointing_every_block_lowers_the_measured_peak(example):
    model, example_input, eager = example
    p = planner.plan(
        model, example_input, mem_budget_gb=eager.peak_bytes / 1e9, solver="uniform", form="graph"
    )
    assert p.regions, "uniform must checkpoint something"
    assert all(r.name in p.module.code for r in p.regions)
    measured = planner.measure(p.module, example_input)
    assert measured.peak_bytes < eager.peak_bytes
    assert p.predicted_peak_bytes < p.baseline_peak_bytes


def test_prediction_tracks_measurement_within_15_percent(example):
    model, example_input, eager = example
    p = planner.plan(
        model, example_input, mem_budget_gb=eager.peak_bytes / 1e9, solver="none", form="graph"
    )
    assert p.predicted_peak_bytes == pytest.approx(eager.peak_bytes, rel=0.15)


def test_budget_below_every_schedule_states_the_least_feasible():
    model, example_input = gpt_ref_small_example()
    with pytest.raises(planner.InfeasibleBudgetError) as info:
        planner.plan(model, example_input, mem_budget_gb=1e-6, form="graph")
    assert info.value.min_bytes > 1e-6 * 1e9
    assert "least feasible budget" in str(info.value)
    # The least feasible budget it states is indeed feasible.
    p = planner.plan(model, example_input, mem_budget_gb=info.value.min_bytes / 1e9, form="graph")
    assert p.predicted_peak_bytes <= info.value.min_bytes


def test_the_least_feasible_budget_is_one_number_and_is_planned():
    """Issue 21: the least stated at 1 B, below itself and under either objective is the same,
    and a plan at it fits (roofline prices: the same on any machine under any load)."""
    from planner.planning import price_form

    model, example_input = gpt_ref_small_example()
    priced = price_form(model, example_input, "graph", device="cpu")

    def least(budget_bytes: int, objective: str) -> int:
        with pytest.raises(planner.InfeasibleBudgetError) as info:
            priced.plan(budget_bytes, objective=objective)
        return info.value.min_bytes

    least_bytes = least(1, "time")
    assert least(1, "flops") == least_bytes
    assert least(least_bytes // 2, "time") == least(least_bytes // 2, "flops") == least_bytes
    for objective in ("time", "flops"):
        p = priced.plan(least_bytes, objective=objective)
        assert p.budget_bytes == least_bytes
        assert p.predicted_peak_bytes <= least_bytes


@pytest.mark.parametrize("budget", [0, -1.0, math.nan, math.inf, "lots", None])
def test_invalid_budgets_are_refused(budget):
    model, example_input = gpt_ref_small_example()
    with pytest.raises(planner.InvalidBudgetError, match="mem_budget_gb"):
        planner.plan(model, example_input, mem_budget_gb=budget, form="graph")


def test_unknown_solver_lists_the_known_ones():
    model, example_input = gpt_ref_small_example()
    with pytest.raises(ValueError, match="uniform"):
        planner.plan(model, example_input, mem_budget_gb=1.0, solver="magic", form="graph")


def test_unknown_objective_is_refused_before_planning():
    model, example_input = gpt_ref_small_example()
    with pytest.raises(ValueError, match="objective must be one of"):
        planner.plan(model, example_input, mem_budget_gb=1.0, objective="memory", form="graph")


@pytest.mark.parametrize("form", ["graph", "inplace"])
def test_plan_checks_each_thing_once(form, monkeypatch):
    """Along plan(): the form's options checked once, the solver looked up once before the
    slow part and once by the solve that runs it, the step without checkpointing simulated
    once."""
    import planner.inplace_form
    import planner.planning
    import planner.priced
    import planner.solvers.registry

    counts: Counter[str] = Counter()

    def count(module, name, key=lambda *args: True):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            counts[name] += bool(key(*args))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    count(planner.planning, "check_form_options")
    for module in (planner.solvers.registry, planner.priced, planner.inplace_form):
        count(module, "get_solver", key=lambda name: name == "uniform")
    count(planner.priced, "simulate", key=lambda graph, schedule: not schedule.regions)
    model, example_input = gpt_ref_small_example()
    planner.plan(model, example_input, 1.0, "uniform", form=form, device="h100")
    assert counts == {"check_form_options": 1, "get_solver": 2, "simulate": 1}


@pytest.mark.parametrize("form", ["graph", "inplace"])
def test_flops_objective_recomputes_no_more_flops_and_says_so(form):
    model, example_input = gpt_ref_small_example()
    eager = planner.plan(model, example_input, 1.0, form=form, device="cpu").baseline_peak_bytes
    plans = {
        objective: planner.plan(
            model, example_input, 0.8 * eager / 1e9, form=form, device="cpu", objective=objective
        )
        for objective in ("time", "flops")
    }
    by_time, by_flops = plans["time"], plans["flops"]
    assert by_flops.predicted_peak_bytes <= 0.8 * eager
    assert by_flops.predicted_recompute_flops <= by_time.predicted_recompute_flops
    assert by_time.predicted_step_time_s <= by_flops.predicted_step_time_s
    assert "objective='flops'" in by_flops.summary(verbose=True)


def test_summary_names_regions_and_units():
    model, example_input = gpt_ref_small_example()
    p = planner.plan(model, example_input, mem_budget_gb=1.0, solver="uniform", form="graph")
    text = p.summary()
    assert "MiB" in text and "uniform" in text
    for region in p.regions:
        assert region.name in text


def test_planned_module_runs_like_the_model_under_no_grad():
    # The captured graph is specialised to the mode it was captured in (train: dropout on).
    model, example_input = gpt_ref_small_example()
    p = planner.plan(model, example_input, mem_budget_gb=1.0, solver="uniform", form="graph")
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(*example_input)
        torch.manual_seed(1)
        assert torch.equal(p.module(*example_input), expected)


def test_selective_regions_do_not_keep_the_attention_scores_alive():
    # A saved matmul decomposes into views of its inputs; caching those would keep the S x S
    # softmax of every block alive (measured 585 MiB at a 376 MiB budget on GPT-ref).
    model, example_input = gpt_example(
        GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=64, vocab_size=128), batch=4
    )
    eager = planner.measure(model, example_input)
    p = planner.plan(model, example_input, eager.peak_bytes / 1e9, solver="selective", form="graph")
    assert any(r.kind == "selective" and r.saved_nodes for r in p.regions)
    measured = planner.measure(p.module, example_input).peak_bytes
    assert measured <= p.predicted_peak_bytes <= p.budget_bytes
    assert p.predicted_peak_bytes == pytest.approx(measured, rel=0.10)
