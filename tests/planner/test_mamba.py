"""Hugging Face Mamba from a tiny config: its reference selective scan unrolls over the sequence
into a long graph (516 nodes at length 16, ~2,800 at 128). ``auto`` plans it within its time
limit, and the plan measures as predicted, within budget, with the same gradients.

``benchmarks/plan_speed.py`` times the same model at length 128, phase by phase.
"""

from __future__ import annotations

import pytest

import planner
from benchmarks.plan_speed import mamba_example
from planner.graph_form import price
from tests.helpers import assert_same_step

pytestmark = pytest.mark.slow
TIME_LIMIT_S = 5.0


def test_auto_plans_mamba_within_the_budget_as_measured():
    model, example = mamba_example(seq_len=16)
    eager_bytes = planner.measure(model, example).peak_bytes
    budget_bytes = int(0.75 * eager_bytes)
    priced = price(model, example)
    p = priced.plan(budget_bytes, time_limit_s=TIME_LIMIT_S)
    assert len(p.graph.nodes) > 400  # the scan is unrolled: a long graph, not a toy
    assert p.regions and p.predicted_peak_bytes <= budget_bytes
    measured = planner.measure(p.module, example).peak_bytes
    assert measured <= budget_bytes < eager_bytes
    assert measured == pytest.approx(p.predicted_peak_bytes, rel=0.01)
    assert_same_step(model, p.module, example)
