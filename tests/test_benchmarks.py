from dataclasses import replace

from benchmarks.vs_anchors import SAC, Row, compile_row_name, inplace_verdicts, report, verdicts

MIB = 2**20


def row(
    name: str, peak_mib: float, flops_pct: float, method: str = "tracker", step_s: float = 1.0
) -> Row:
    return Row(name, int(peak_mib * MIB), 0, step_s, 0.0, method, recompute_flops_pct=flops_pct)


def test_verdicts_compare_planner_with_each_anchor_at_its_peak():
    anchors = [row("eager", 750, 0.0), row("every block", 107, 32.6), row("SAC", 404, 0.0)]
    ours = [row("planner at every block", 105, 25.4), row("planner at SAC", 386, 1.6)]
    lines = verdicts(anchors, ours)
    assert lines[0].startswith("- every block: planner +25.4% at 105.0 MiB vs +32.6%")
    assert "at or below; step time 1.000 s vs 1.000 s (+0.0%; 5% faster: **missed**)" in lines[0]
    assert "**above**;" in lines[1]  # fewer bytes, but more recomputation
    # Over the anchor's peak is never "at or below", whatever the FLOPs.
    assert "**above**;" in verdicts(anchors[:2], [row("p", 108, 0.0)])[0]
    # 5% faster at or below the anchor's peak meets the time target; 4% does not.
    fast = verdicts(anchors[:2], [row("p", 100, 30.0, step_s=0.95)])[0]
    assert fast.endswith("(-5.0%; 5% faster: met)")
    assert verdicts(anchors[:2], [row("p", 100, 30.0, step_s=0.96)])[0].endswith("**missed**)")
    refused = Row("p", 0, 0, 0.0, 1.0, "-", note="InfeasibleBudgetError: ...")
    assert "refused" in verdicts(anchors[:2], [refused])[0]


def test_report_adds_the_verdicts_only_with_planner_rows():
    anchors = [row("eager", 750, 0.0), row("every block", 107, 32.6)]
    assert "Planner against" not in report(anchors, 1.0, "t")
    text = report([*anchors, row("planner", 100, 20.0, step_s=0.5)], 1.0, "t", n_anchors=2)
    assert "- every block: planner +20.0% at 100.0 MiB" in text
    ranked = text.split("Ranked by measured step time:")[1].split("\n")
    assert ranked[2].startswith("1. planner: 0.500 s, 100.0 MiB, +20.0% FLOPs")


def test_inplace_verdicts_hold_each_row_to_the_issue_targets():
    compile_half = compile_row_name("inductor", 0.5)
    anchors = [row("eager", 750, 0.0), row(SAC, 404, 0.0), row(compile_half, 377, 0.8)]
    anchors[1] = replace(anchors[1], step_time_s=1.2)
    at_sac = replace(row("in place at SAC", 400, 0.4), step_time_s=1.1)
    at_compile = row("in place at compile", 370, 0.9)
    at_half = replace(row("in place at 50%", 370, 5.0), predicted_bytes=int(371 * MIB))
    at_eager = replace(row("in place at eager", 750, 0.0, step_s=1.009), regions=0)
    # rows in inplace_targets' order: SAC (time, flops, time within +0.5 points of FLOPs),
    # compile (time, flops), 50%, eager
    ours = [at_sac, at_sac, at_sac, at_compile, at_compile, at_half, at_eager]
    lines = inplace_verdicts(anchors, ours, "inductor")
    assert lines[0].startswith(f"- at {SAC}'s peak (least time):") and lines[0].endswith(": met")
    assert lines[1].startswith(f"- at {SAC}'s peak (least flops):")
    assert lines[2].startswith(f"- at {SAC}'s peak (least time, recompute FLOPs <= 0.5%):")
    assert lines[3].endswith("**missed** (FLOPs)")  # +0.9% > compile's +0.8%
    assert "+0.27% off measured" in lines[5] and lines[5].endswith(": met")
    assert "0 regions" in lines[6] and "+0.9%; 1% allowed" in lines[6] and lines[6].endswith("met")
    slower = replace(at_eager, step_time_s=1.02, regions=1)
    assert inplace_verdicts(anchors, [*ours[:6], slower], "inductor")[6].endswith(
        "**missed** (no regions, overhead)"
    )
    # SAC's step time is a target too, and so is its peak
    slow = replace(at_sac, step_time_s=1.3, peak_bytes=int(405 * MIB))
    assert inplace_verdicts(anchors, [slow], "inductor")[0].endswith("**missed** (peak, time)")
    refused = Row("p", 0, 0, 0.0, 1.0, "-", note="InfeasibleBudgetError: ...")
    assert "refused" in inplace_verdicts(anchors, [refused], "inductor")[0]
    text = report([*anchors, at_sac, at_half], 1.0, "t", 3, n_inplace=2, inplace_lines=lines)
    assert "Planner against" not in text  # no graph rows: no per-anchor verdicts
    assert "planner in place against the issue's targets:" in text
    assert "| in place at 50% | 370.00 | 371.00 |" in text  # measured, then predicted
    assert "| in place at SAC | 400.00 | — |" in text


def test_conformance_reports_a_least_feasible_probe_cut_short_instead_of_crashing(monkeypatch):
    """The sweep's least-feasible probe (auto at 1 B) cut short states no least budget
    (``min_bytes`` None: T5 in place once): the form gets one point saying the least is
    unknown, with the solver's words, and no grid; the report lists it among the misses."""
    import benchmarks.conformance as conformance
    from planner.solvers.errors import InfeasibleBudgetError

    def cut_short(graph, budget_bytes, *args, **kwargs):
        raise InfeasibleBudgetError(budget_bytes, None, "(solver 'auto': dp cut short)")

    monkeypatch.setattr(conformance, "solve", cut_short)
    points = conformance.sweep_model(
        "cnn", forms=("inplace",), objectives=("time",), n_budgets=2, memtracker=False
    )
    assert len(points) == 1
    (point,) = points
    assert point.failure.startswith(conformance.LEAST_UNKNOWN + ": InfeasibleBudgetError")
    assert "no solver finished in time" in point.failure and not point.conforms
    text = conformance.report(points, "cmd", 1.0, "env")
    assert "1 misses" in text and conformance.LEAST_UNKNOWN in text
