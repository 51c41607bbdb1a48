"""No solver's plan beats dp's on both predicted peak and predicted step time.

dp minimises predicted step time within the budget, so at any budget where another solver
answers with both a lower predicted peak and a lower step time than dp, dp's claim would be
false. Checked on the models the tables and notebooks show (GPT-ref small, the tests' U-Net, and
notebook 02's GPT and U-Net) at the budgets the tables and plots use (``compare``'s default
fractions of the eager peak and the notebook's), every prediction by
``simulate``.
"""

from __future__ import annotations

import pytest

import planner
from benchmarks.models import GPTConfig, gpt_example, gpt_ref_small_example, unet_example
from planner.devices import profile_of_model
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.solvers.costgraph import Schedule
from planner.solvers.registry import SOLVERS, get_solver
from planner.solvers.simulate import simulate
from tests.models_zoo import small_unet_example

# compare()'s default budget fractions of the eager peak, and notebook 02's, and more between 0.6
# and 0.9: on CPU a checkpoint call over an op that draws random numbers stashes a 5056-byte RNG
# state (simulate's Rule 12); while every call did, that put the fractions below 0.6 out of every
# solver's reach on these tiny U-Nets (eager peaks under 1 MB).
FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
# Within these, a plan does not beat dp's: dp's space takes the two cuts around an op that
# allocates nothing as one (solvers/cuts.py region_bounds), BatchNorm's num_batches_tracked
# += 1 included, which ilp's may leave out of a region: its 8-byte buffer copies (simulate's
# Rule 9) and a nanosecond each (the notebook U-Net at 75%: ilp 685,564 B, dp 685,580 B,
# 1.3e-6 of the step time apart, once no region stashed an RNG state).
TIE_BYTES, TIE_TIME = 64, 1e-5


def notebook_gpt_example():
    """notebooks/02_compare_solvers.ipynb's GPT."""
    cfg = GPTConfig(n_layer=4, d_model=64, n_head=2, seq_len=64, vocab_size=256)
    return gpt_example(cfg, batch=4)


def notebook_unet_example():
    """notebooks/02_compare_solvers.ipynb's U-Net."""
    return unet_example(batch=2, size=32, channels=8)


def _graph(example):
    model, x = example()
    captured = capture(model, x)
    return estimate(
        captured.module, captured.args, captured.kwargs, rates=profile_of_model(captured.module)
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "example",
    [gpt_ref_small_example, small_unet_example, notebook_gpt_example, notebook_unet_example],
)
def test_no_solver_beats_dp_on_both_peak_and_step_time(example):
    graph = _graph(example)
    eager = simulate(graph, Schedule()).peak_bytes
    get_solver("none")  # loads every solver
    others = sorted(set(SOLVERS) - {"dp", "auto"})
    compared = 0
    for fraction in FRACTIONS:
        budget = int(fraction * eager)
        try:
            dp = simulate(graph, get_solver("dp")(graph, budget))
        except planner.InfeasibleBudgetError:
            continue
        assert dp.peak_bytes <= budget
        for name in others:
            opts = {"time_limit_s": 5.0} if name == "ilp" else {}
            try:
                sim = simulate(graph, get_solver(name)(graph, budget, **opts))
            except planner.InfeasibleBudgetError:
                continue
            compared += 1
            both = (
                sim.peak_bytes < dp.peak_bytes - TIE_BYTES
                and sim.step_time_s < dp.step_time_s * (1 - TIE_TIME)
            )
            assert not both, (
                f"{name} at {fraction:.0%} of eager: peak {sim.peak_bytes} < dp's "
                f"{dp.peak_bytes} and step time {sim.step_time_s:.4g} s < dp's "
                f"{dp.step_time_s:.4g} s"
            )
    assert compared >= 4  # the sweep compared plans, not only refusals
