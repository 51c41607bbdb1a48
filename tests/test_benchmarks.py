from benchmarks.vs_anchors import Row, report, verdicts

MIB = 2**20


def row(name: str, peak_mib: float, flops_pct: float, method: str = "tracker") -> Row:
    return Row(name, int(peak_mib * MIB), 0, 1.0, 0.0, method, recompute_flops_pct=flops_pct)


def test_verdicts_compare_planner_with_each_anchor_at_its_peak():
    anchors = [row("eager", 750, 0.0), row("every block", 107, 32.6), row("SAC", 404, 0.0)]
    ours = [row("planner at every block", 105, 25.4), row("planner at SAC", 386, 1.6)]
    lines = verdicts(anchors, ours)
    assert lines[0].startswith("- every block: planner +25.4% at 105.0 MiB vs +32.6%")
    assert lines[0].endswith("at or below")
    assert lines[1].endswith("**above**")  # fewer bytes, but more recomputation
    # Over the anchor's peak is never "at or below", whatever the FLOPs.
    assert verdicts(anchors[:2], [row("p", 108, 0.0)])[0].endswith("**above**")
    refused = Row("p", 0, 0, 0.0, 1.0, "-", note="InfeasibleBudgetError: ...")
    assert "refused" in verdicts(anchors[:2], [refused])[0]


def test_report_adds_the_verdicts_only_with_planner_rows():
    anchors = [row("eager", 750, 0.0), row("every block", 107, 32.6)]
    assert "Planner against" not in report(anchors, 1.0, "t")
    text = report([*anchors, row("planner", 100, 20.0)], 1.0, "t", n_anchors=2)
    assert "- every block: planner +20.0% at 100.0 MiB" in text
