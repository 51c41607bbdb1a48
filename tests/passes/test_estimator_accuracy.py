"""The predicted peak stays within 10% of the measured one (the benchmark shows how much closer).

Small copies of every reference model, under no checkpointing, checkpoint-every-block and the
sqrt solver's plan; each plan is rewritten and measured for real (``planner.measure``). The
benchmark (``python -m benchmarks.estimator_accuracy``) covers every solver at three budgets.
"""

import pytest

from benchmarks.estimator_accuracy import SMALL_MODELS, accuracy_rows


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALL_MODELS))
def test_predicted_peak_within_10_percent_of_measured(name):
    rows, _ = accuracy_rows(name, SMALL_MODELS[name], solvers=["sqrt"], fractions=[0.5])
    measured = [r for r in rows if r.error is not None]
    assert {r.schedule for r in measured} >= {"none", "every-block"}
    for r in measured:
        assert abs(r.error) <= 0.10, (r.schedule, r.predicted_peak_bytes, r.measured_peak_bytes)
