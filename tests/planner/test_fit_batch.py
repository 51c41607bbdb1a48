"""planner.fit_batch: the batch-size sweep, its edges, and peaks against the cap (measured)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import planner
from benchmarks.models import GPT, GPT_REF_SMALL
from planner.batch_search import BatchFit
from planner.devices import device_profile
from planner.inplace_form import price_inplace
from planner.planning import price
from planner.solvers.dp_search import solve_dp


def gpt_small():
    torch.manual_seed(0)
    return GPT(GPT_REF_SMALL)


def make_input(batch_size: int):
    g = torch.Generator().manual_seed(batch_size)
    shape = (batch_size, GPT_REF_SMALL.seq_len)
    idx = torch.randint(0, GPT_REF_SMALL.vocab_size, shape, generator=g)
    return idx, torch.randint(0, GPT_REF_SMALL.vocab_size, shape, generator=g)


def test_sweep_doubles_stops_at_first_misfit_and_every_peak_fits_measured():
    model = gpt_small()
    cap_bytes = planner.measure(model, make_input(4)).peak_bytes  # eager at batch 4
    fit = planner.fit_batch(model, make_input, cap_bytes / 1e9, device="cpu")

    sizes = [r.batch_size for r in fit.rows]
    assert sizes == [2**k for k in range(len(sizes))]
    # Doubling stops at the first batch size no plan fits; every smaller one fits.
    assert not fit.rows[-1].fits and all(r.fits for r in fit.rows[:-1])
    assert fit.rows[-1].least_bytes > fit.cap_bytes
    assert len(fit.rows) >= 4  # checkpointing lets the batch grow beyond eager's 4
    assert fit.rows[3].batch_size == 8 and fit.rows[3].eager_peak_bytes > fit.cap_bytes
    for r in fit.rows[:-1]:
        p = fit.plans[r.batch_size]
        assert r.predicted_peak_bytes == p.predicted_peak_bytes <= fit.cap_bytes
        assert r.samples_per_s == pytest.approx(r.batch_size / p.predicted_step_time_s)
        measured = planner.measure(p.apply(gpt_small()), make_input(r.batch_size))
        assert measured.peak_bytes <= fit.cap_bytes, (r.batch_size, measured.peak_bytes)
    most = max(r.samples_per_s for r in fit.rows if r.fits)
    near = [r.batch_size for r in fit.rows if r.fits and r.samples_per_s >= 0.95 * most]
    assert fit.best_batch_size == max(near) and fit.plan is fit.plans[max(near)]


def test_cap_below_every_plan_at_batch_1_says_no_batch_size_fits():
    model = gpt_small()
    priced = price_inplace(model, make_input(1), device=device_profile("cpu"))
    with pytest.raises(planner.InfeasibleBudgetError) as info:
        solve_dp(priced.graph, 1000)
    least_bytes = info.value.min_bytes
    with pytest.raises(planner.InfeasibleBudgetError) as info:
        planner.fit_batch(model, make_input, 1e-6, device="cpu")
    message = str(info.value)
    assert "No batch size fits" in message and "batch size 1" in message
    assert info.value.min_bytes == least_bytes
    assert f"{least_bytes / 1e9:.3f} GB" in message


def test_a_solver_out_of_time_is_not_called_a_least(monkeypatch):
    """A solve cut short before it knew the least (InfeasibleBudgetError with no min_bytes)
    is a row that says so, and, at the smallest batch, an error that says so; neither names a
    least it does not know (the row read "over the FLOPs cap", the error "at least 0 GB")."""
    import planner.priced

    def cut_short(graph, budget_bytes, *args, **kwargs):
        raise planner.InfeasibleBudgetError(budget_bytes, None, "(cut short)")

    monkeypatch.setattr(planner.priced, "solve", cut_short)
    with pytest.raises(planner.InfeasibleBudgetError) as info:
        planner.fit_batch(gpt_small(), make_input, 1e-6, device="cpu")
    assert info.value.min_bytes is None
    assert "ran out of time" in str(info.value) and "0.000 GB" not in str(info.value)
    monkeypatch.undo()
    fit = planner.fit_batch(gpt_small(), make_input, 1e3, batch_sizes=[1], device="cpu")
    row = planner.batch_search.BatchRow(2, False, *[None] * 6, 1, 1.0, 1.0, cut_short=True)
    table = str(dataclasses.replace(fit, rows=(*fit.rows, row)))
    assert "solver out of time" in table and "over the FLOPs cap" not in table


@pytest.fixture(scope="module")
def huge_cap_fit() -> BatchFit:
    """A cap no batch size reaches, on a device profile asked for: priced once for two tests."""
    return planner.fit_batch(gpt_small(), make_input, 100, batch_sizes=[4, 1, 2], device="h100")


def test_huge_cap_no_checkpointing_wins_at_every_batch(huge_cap_fit):
    fit = huge_cap_fit
    assert [r.batch_size for r in fit.rows] == [1, 2, 4]
    for r in fit.rows:
        assert r.fits and r.solver == "none" and r.regions == 0
        assert r.predicted_peak_bytes == r.eager_peak_bytes
        assert r.predicted_step_time_s == r.eager_step_time_s
    assert fit.plan.regions == ()


def test_table_dataframe_and_plot(huge_cap_fit):
    fit = huge_cap_fit
    assert isinstance(fit, BatchFit) and "h100" in fit.device
    text = str(fit)
    assert "samples/s" in text and f"best: batch {fit.best_batch_size}" in text
    frame = fit.to_pandas()
    assert list(frame["batch_size"]) == [1, 2, 4]
    assert list(frame["samples_per_s"]) == [r.samples_per_s for r in fit.rows]
    fig = fit.plot()
    speed, memory = fig.axes
    assert speed.get_xlabel() == "micro-batch size"
    cap_line = [ln for ln in memory.lines if ln.get_label() == "cap"]
    assert cap_line and cap_line[0].get_ydata()[0] == fit.cap_bytes / 2**30


def test_bad_batch_sizes_are_refused():
    with pytest.raises(ValueError, match="batch_sizes must be positive integers"):
        planner.fit_batch(gpt_small(), make_input, 1, batch_sizes=[0, 2], device="cpu")


def test_the_graph_form_sweeps_the_captured_graph():
    model = gpt_small()
    fit = planner.fit_batch(model, make_input, 100, batch_sizes=[1, 2], device="cpu", form="graph")
    for r in fit.rows:
        assert r.eager_peak_bytes == price(model, make_input(r.batch_size)).eager_peak_bytes
    assert isinstance(fit.plan.module, torch.fx.GraphModule)
    # the classic strategies plan in place too, over the model's own blocks
    inplace = planner.fit_batch(model, make_input, 100, solver="greedy", batch_sizes=[1])
    assert inplace.plan.form == "inplace" and inplace.plan.solver == "greedy"
    with pytest.raises(ValueError, match="form must be one of"):
        planner.fit_batch(model, make_input, 100, device="cpu", form="module")


def test_fit_batch_takes_plans_options_in_both_forms():
    model = gpt_small()
    eager_2 = planner.plan(model, make_input(2), 100, solver="none", device="h100")
    cap_gb = 0.75 * eager_2.baseline_peak_bytes / 1e9  # batch 2 must recompute FLOPs
    options = dict(device="h100", objective="flops")
    for form in ("inplace", "graph"):
        fit = planner.fit_batch(model, make_input, cap_gb, batch_sizes=[2], form=form, **options)
        api = planner.plan(model, make_input(2), cap_gb, form=form, **options)
        assert fit.plan.form == api.form == form
        assert [r.name for r in fit.plan.regions] == [r.name for r in api.regions]
        assert fit.plan.predicted_recompute_flops == api.predicted_recompute_flops > 0
        assert fit.plan.predicted_peak_bytes == api.predicted_peak_bytes <= fit.cap_bytes
        assert "objective='flops'" in fit.plan.schedule.note


def test_fit_batch_keeps_to_a_flops_cap():
    model = gpt_small()
    eager_2 = planner.plan(model, make_input(2), 100, solver="none", device="h100")
    cap_gb = 0.75 * eager_2.baseline_peak_bytes / 1e9  # at 80% a plan recomputing no FLOPs fits
    least = planner.plan(model, make_input(2), cap_gb, device="h100", objective="flops")
    least_fraction = least.predicted_recompute_flops / least.step_flops
    assert least_fraction > 0
    options = dict(device="h100", objective="flops", batch_sizes=[1, 2])
    # batch 1 fits without recomputing; batch 2 only by recomputing more than the cap allows
    fit = planner.fit_batch(
        model, make_input, cap_gb, max_recompute_flops_fraction=least_fraction / 2, **options
    )
    one, two = fit.rows
    assert one.fits and one.regions == 0 and fit.best_batch_size == 1
    assert not two.fits and two.least_bytes is None and "over the FLOPs cap" in str(fit)
    # at the cap, batch 2 fits with the least-FLOPs plan
    fit = planner.fit_batch(
        model, make_input, cap_gb, max_recompute_flops_fraction=least_fraction, **options
    )
    assert fit.rows[1].fits
    assert fit.plans[2].predicted_recompute_flops == least.predicted_recompute_flops
    # no batch size within the cap: plan's own error
    with pytest.raises(planner.RecomputeCapError, match="max_recompute_flops_fraction"):
        planner.fit_batch(
            model,
            make_input,
            cap_gb,
            batch_sizes=[2],
            device="h100",
            max_recompute_flops_fraction=least_fraction / 2,
        )
    with pytest.raises(ValueError, match="in place"):
        planner.fit_batch(model, make_input, 1, form="graph", fsdp=planner.FSDPConfig(2))
    with pytest.raises(ValueError, match="objective"):
        planner.fit_batch(model, make_input, 1, objective="memory")
