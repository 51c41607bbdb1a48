"""Property tests: random small networks, every solver, random budgets (hypothesis, fixed seed).

A network is drawn as a ``NetSpec`` (chains of linear stages, residual stages, two-arm branches
joined by a concat; random widths, dropout, BatchNorm), built as an ``nn.Module``, captured and
priced once, then solved by every registered solver at one drawn budget between a third of its
predicted eager peak and all of it. Whenever a solver returns a plan: the planned module trains
bitwise like the model, the measured peak is within the budget, and the prediction is within 10%
of the measurement. When it refuses, the least feasible budget it states is above the budget.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import planner
from planner.planning import budget_bytes_from_gb, price
from planner.solvers.costgraph import Schedule
from planner.solvers.registry import SOLVERS, get_solver
from planner.solvers.simulate import simulate
from tests.helpers import assert_same_step
from tests.models_zoo import LayerSpec, NetSpec, spec_model

layer_specs = st.builds(
    LayerSpec,
    kind=st.sampled_from(["linear", "residual", "branch"]),
    width=st.integers(4, 48),
    dropout=st.booleans(),
    norm=st.booleans(),
)
net_specs = st.builds(
    NetSpec,
    d_in=st.integers(2, 32),
    batch=st.integers(8, 128),
    layers=st.lists(layer_specs, min_size=1, max_size=5).map(tuple),
    seed=st.integers(0, 2**16),
)


def solver_names() -> list[str]:
    get_solver("none")  # loads every solver module
    return sorted(SOLVERS)


def plans(spec: NetSpec, fraction: float):
    """The model, its input, and each solver's plan at ``fraction`` of the predicted eager peak.

    A solver that refuses must state a least feasible budget above the budget it was given.
    """
    model, x = spec_model(spec)
    priced = price(model, x, device="cpu")  # the roofline, as estimate's default on the CPU
    graph = priced.graph
    budget_bytes = int(fraction * simulate(graph, Schedule()).peak_bytes)
    out = {}
    for name in solver_names():
        try:
            schedule = get_solver(name)(graph, budget_bytes)
        except planner.InfeasibleBudgetError as e:
            assert e.min_bytes > budget_bytes, name
            continue
        out[name] = priced.build(schedule, budget_bytes)
        assert out[name].predicted_peak_bytes <= budget_bytes, name
    return model, x, out


# Each example captures, prices and rewrites a network and runs real steps (about a second per
# solver), so examples are few and shrinking is off: a failure prints the drawn spec as it is.
EXAMPLES = settings(
    derandomize=True,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
budget_fractions = st.floats(0.33, 1.0)


@pytest.mark.slow
@settings(EXAMPLES, max_examples=15)
@given(spec=net_specs, fraction=budget_fractions)
def test_every_solver_trains_bitwise_like_the_model(spec, fraction):
    model, x, by_solver = plans(spec, fraction)
    assert "none" in by_solver or fraction < 1.0
    for p in by_solver.values():
        assert_same_step(model, p.module, x)


@pytest.mark.slow
@settings(EXAMPLES, max_examples=7)
@given(spec=net_specs, fraction=budget_fractions)
def test_every_solver_fits_the_budget_as_measured_and_predicts_within_10_percent(spec, fraction):
    _, x, by_solver = plans(spec, fraction)
    for name, p in by_solver.items():
        measured = planner.measure(p.module, x).peak_bytes
        assert measured <= p.budget_bytes, (name, measured, p.predicted_peak_bytes)
        assert p.predicted_peak_bytes == pytest.approx(measured, rel=0.10), name


@settings(max_examples=500, derandomize=True)
@given(n_bytes=st.integers(1, 10**13))
def test_a_budget_in_bytes_survives_the_gigabyte_conversion(n_bytes):
    assert budget_bytes_from_gb(n_bytes / 1e9) == n_bytes
