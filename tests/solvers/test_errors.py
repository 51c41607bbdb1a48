"""The errors' messages: sizes printed so that a reader can act on them."""

from __future__ import annotations

from planner.solvers.errors import InfeasibleBudgetError, size_text


def test_sizes_read_in_the_unit_they_fill_and_in_decimal_gb():
    assert size_text(520) == "520 bytes (5.2e-07 GB)"
    assert size_text(1060) == "1.035 KiB (1.06e-06 GB)"
    assert size_text(2_372_000) == "2.262 MiB (0.00237 GB)"
    assert size_text(24e9) == "22.35 GiB (24 GB)"


def test_a_tiny_budget_and_its_minimum_read_apart():
    text = str(InfeasibleBudgetError(2_372_000, 2_412_500))
    assert "budget of 2.262 MiB (0.00237 GB)" in text
    assert "least feasible budget is 2.301 MiB (0.00241 GB)" in text
    assert "mem_budget_gb to at least 0.0024125" in text
    assert "0.000 GB" not in str(InfeasibleBudgetError(500, 1060))
