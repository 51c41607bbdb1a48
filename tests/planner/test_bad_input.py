"""Bad input gets a planner exception that names the problem and the fix, never a raw trace.

Saved-plan basics (truncated, hand-edited, unknown version, another model, other shapes) are in
test_plan_file.py; this file adds the corrupt and odd files it does not cover.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re

import pytest
import torch

import planner
from planner.solvers.errors import size_text
from tests import models_zoo as zoo
from tests.helpers import assert_same_step

# --- capture ----------------------------------------------------------------------------------


def test_data_dependent_control_flow_names_the_line_and_the_fix():
    model = zoo.DataDependentNet()
    with pytest.raises(planner.CaptureError) as info:
        planner.plan(model, torch.randn(4, 16), mem_budget_gb=1.0, solver="uniform", form="graph")
    text = str(info.value)
    _, first = inspect.getsourcelines(zoo.DataDependentNet.forward)
    line = first + next(
        i
        for i, src in enumerate(inspect.getsourcelines(zoo.DataDependentNet.forward)[0])
        if "if y.sum() > 0" in src
    )
    assert f"models_zoo.py:{line}" in text
    assert "if y.sum() > 0" in text
    assert "data-dependent" in text
    assert "torch.cond" in text or "torch.where" in text  # the way out


def test_example_input_of_the_wrong_type_is_refused():
    model, _ = zoo.mha_example()
    with pytest.raises(planner.PlannerError, match="example_input") as info:
        planner.plan(model, 3, mem_budget_gb=1.0, solver="uniform", form="graph")
    assert "tensor" in str(info.value) and "int" in str(info.value)


def test_example_input_of_strings_is_refused():
    model, _ = zoo.mha_example()
    with pytest.raises(planner.PlannerError, match="example_input") as info:
        planner.plan(model, ["a", "b"], mem_budget_gb=1.0, solver="uniform", form="graph")
    assert "str" in str(info.value)


def test_example_input_of_the_wrong_shape_names_the_shapes():
    model, _ = zoo.mha_example()  # expects (batch, seq, 32)
    with pytest.raises(planner.PlannerError, match="example_input") as info:
        planner.plan(
            model, torch.randn(2, 32, 7), mem_budget_gb=1.0, solver="uniform", form="graph"
        )
    assert "[2, 32, 7]" in str(info.value) or "(2, 32, 7)" in str(info.value)


def test_model_without_trainable_parameters_is_refused():
    with pytest.raises(planner.UnsupportedModelError, match="requires_grad") as info:
        planner.plan(
            zoo.FrozenNet(), torch.randn(4, 16), mem_budget_gb=1.0, solver="uniform", form="graph"
        )
    assert "FrozenNet" in str(info.value)


# --- budgets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 0.0, -1, -0.5, math.nan, -math.inf, True, "1.5 GB"])
def test_invalid_budget_is_refused_before_any_capture(budget):
    # A model that cannot be captured: the budget must be checked first, so the user sees the
    # budget problem, not a capture problem.
    with pytest.raises(planner.InvalidBudgetError) as info:
        planner.plan(zoo.DataDependentNet(), torch.randn(4, 16), mem_budget_gb=budget, form="graph")
    text = str(info.value)
    assert repr(budget) in text  # names the value it got
    assert "positive" in text and "mem_budget_gb=" in text  # and what to pass instead


def test_budget_below_the_least_feasible_states_it_in_bytes_and_mib():
    model, x = zoo.inplace_example()
    with pytest.raises(planner.InfeasibleBudgetError) as info:
        planner.plan(model, x, mem_budget_gb=1e-9, solver="uniform", form="graph")  # one byte
    e = info.value
    assert e.budget_bytes == 1
    assert 0 < e.min_bytes < planner.measure(model, x).peak_bytes * 2
    assert "budget of 1 bytes (1e-09 GB)" in str(e)  # not "0.0 MiB (0.000 GB)"
    assert f"least feasible budget is {size_text(e.min_bytes)}" in str(e)
    assert "least feasible budget" in str(e) and "mem_budget_gb" in str(e)


def test_the_budget_the_error_suggests_is_accepted():
    model, x = zoo.inplace_example()
    with pytest.raises(planner.InfeasibleBudgetError) as info:
        planner.plan(model, x, mem_budget_gb=1e-9, solver="uniform", form="graph")
    suggested = re.search(r"mem_budget_gb to at least ([0-9.e+-]+)", str(info.value)).group(1)
    p = planner.plan(
        model, x, mem_budget_gb=float(suggested.rstrip(".")), solver="uniform", form="graph"
    )
    assert p.predicted_peak_bytes <= p.budget_bytes


# --- saved plans --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, example_input = zoo.inplace_example()
    p = planner.plan(model, example_input, mem_budget_gb=1.0, solver="uniform", form="graph")
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    p.save(path)
    return model, example_input, path


def test_binary_garbage_is_refused(saved, tmp_path):
    model, example_input, _ = saved
    bad = tmp_path / "garbage.json"
    bad.write_bytes(bytes(range(256)))
    with pytest.raises(planner.PlanFileError, match="not valid JSON") as info:
        planner.apply_plan(model, bad, example_input)
    assert "plan.save" in str(info.value)  # the fix


def test_empty_file_is_refused(saved, tmp_path):
    model, example_input, _ = saved
    bad = tmp_path / "empty.json"
    bad.write_text("")
    with pytest.raises(planner.PlanFileError, match="not valid JSON"):
        planner.apply_plan(model, bad, example_input)


def test_missing_file_is_refused(saved, tmp_path):
    model, example_input, _ = saved
    with pytest.raises(planner.PlanFileError, match="no plan file"):
        planner.apply_plan(model, tmp_path / "nowhere.json", example_input)


def test_a_directory_is_refused(saved, tmp_path):
    model, example_input, _ = saved
    with pytest.raises(planner.PlanFileError, match=str(tmp_path)):
        planner.apply_plan(model, tmp_path, example_input)


def test_json_that_is_a_list_is_refused(saved, tmp_path):
    model, example_input, _ = saved
    bad = tmp_path / "list.json"
    bad.write_text("[1, 2, 3]")
    with pytest.raises(planner.PlanFileError, match="not a planner plan file"):
        planner.apply_plan(model, bad, example_input)


def _resealed(path, tmp_path, edit):
    """The file edited and its checksum recomputed: a plan from a planner that disagrees."""
    body = json.loads(path.read_text())
    del body["checksum"]
    edit(body)
    body["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    out = tmp_path / "resealed.json"
    out.write_text(json.dumps(body))
    return out


def test_region_naming_nodes_the_graph_lacks_is_refused(saved, tmp_path):
    model, example_input, path = saved
    bad = _resealed(path, tmp_path, lambda b: b["regions"][0]["nodes"].append("no_such_node"))
    with pytest.raises(planner.PlanFileError, match="contiguous run") as info:
        planner.apply_plan(model, bad, example_input)
    assert "planner.plan" in str(info.value)


def test_region_with_a_missing_field_is_refused(saved, tmp_path):
    model, example_input, path = saved
    bad = _resealed(path, tmp_path, lambda b: b["regions"][0].pop("depth"))
    with pytest.raises(planner.PlanFileError, match="malformed field"):
        planner.apply_plan(model, bad, example_input)


def test_plan_applied_to_a_model_of_another_architecture_is_refused(saved):
    _, _, path = saved
    other, other_input = zoo.tagged_example()  # same input shape, other layers
    with pytest.raises(planner.PlanFileError, match="another model"):
        planner.apply_plan(other, path, other_input)


def test_saved_plan_still_applies_to_its_own_model(saved):
    model, example_input, path = saved
    again = planner.apply_plan(model, path, example_input)
    assert again.regions
    assert_same_step(model, again.module, example_input)


# --- solver limits --------------------------------------------------------------------------------


def test_ilp_hitting_its_time_limit_falls_back_and_says_so():
    model, x = zoo.mha_example()
    eager_bytes = planner.measure(model, x).peak_bytes
    p = planner.plan(
        model,
        x,
        mem_budget_gb=0.7 * eager_bytes / 1e9,
        solver="ilp",
        milp_time_limit_s=1e-3,
        form="graph",
    )
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert p.solver == "dp"  # the fallback answered, and the plan says which solver did
    note = p.schedule.note.lower()
    assert "dp" in note and ("time limit" in note or "no solution in" in note)
    assert p.schedule.note in p.summary(verbose=True)  # solver internals: the verbose view
    assert "solver 'dp'" in p.summary()
    assert_same_step(model, p.module, x)


class NeverEnds(torch.nn.Module):
    """A forward whose tracing never finishes (as a model stuck in a loop would)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while True:
            x = x * 1.0


def test_pricing_that_never_ends_stops_at_the_time_limit_naming_the_module():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), NeverEnds())
    with pytest.raises(planner.PlannerError, match=r"past the time limit, in '1'"):
        planner.plan(model, torch.randn(2, 4), 1.0, time_limit_s=0.5)
