"""benchmarks/gpu_check.py where there is no GPU: the command refuses with status 2 and one line
saying it needs a CUDA device (writing nothing), and its report's formatting (pure functions)
turns canned rows into the tables and verdicts the GPU run writes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check as gc

MIB = 2**20


def test_without_cuda_it_exits_2_saying_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.md"
    with pytest.raises(SystemExit) as exit_info:
        gc.main(["--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err
    assert not out.exists()


def point(
    budget_mib: float, predicted_mib: float, measured_mib: float, **kw
) -> gc.ConformancePoint:
    return gc.ConformancePoint(
        kw.pop("model", "gpt"),
        kw.pop("form", "inplace"),
        kw.pop("objective", "time"),
        int(budget_mib * MIB),
        int(predicted_mib * MIB),
        int(measured_mib * MIB),
        kw.pop("predicted_s", 0.010),
        kw.pop("measured_s", 0.010),
        "dp",
        3,
        **kw,
    )


def test_conformance_table_and_verdicts():
    ok = point(10, 9.0, 9.0, predicted_s=0.0105)  # +5% step time: within 10%
    close = point(20, 18.09, 18.0, form="graph")  # +0.5% peak
    refused = gc.ConformancePoint("cnn", "graph", "flops", 1000, note="InfeasibleBudgetError: x")
    table = gc.conformance_table([ok, close, refused])
    rows = table.splitlines()
    assert len(rows) == 5 and rows[0].startswith("| model | form | objective |")
    assert (
        "| gpt | inplace | time | 10.00 | 9.00 | 9.00 | yes | +0.00% | 10.50 | 10.00 | +5.0% |"
        in rows[2]
    )
    assert "+0.50%" in rows[3]
    assert rows[4].startswith("| cnn | graph | flops |") and "InfeasibleBudgetError: x" in rows[4]
    lines = gc.conformance_verdicts([ok, close, refused])
    assert lines[0] == "- 2 points measured, 1 refused or failed"
    assert lines[1] == "- measured <= budget: 2 of 2: met"
    assert lines[2].startswith("- worst peak error +0.50% (gpt, graph, time, budget 20.00 MiB)")
    assert lines[2].endswith(": met (<= 1%)")
    assert lines[3].startswith("- worst step-time error +5.0%") and lines[3].endswith(
        "met (<= 10%)"
    )

    over = point(10, 9.0, 10.5)  # measured over the budget, and 14% under-predicted
    slow = point(10, 9.0, 9.0, measured_s=0.020)  # predicted half the measured step
    lines = gc.conformance_verdicts([ok, over, slow])
    assert lines[1] == (
        "- measured <= budget: 2 of 3: **missed** (gpt, inplace, time, budget 10.00 MiB)"
    )
    assert "-14.29%" in lines[2] and lines[2].endswith("**missed** (<= 1%)")
    assert "-50.0%" in lines[3] and lines[3].endswith("**missed** (<= 10%)")
    assert gc.conformance_verdicts([refused]) == ["- no point measured (1 refused or failed)"]


def test_rates_and_offload_tables_and_the_report():
    rates = [
        gc.RateCheck("matmul, bf16, 8192^3", "TFLOP/s", 593.4e12, 650.0e12),
        gc.RateCheck("device -> host, pinned", "GB/s", 38.4e9, 50.0e9),
    ]
    table = gc.rates_table(rates, "h100")
    assert table.splitlines()[0] == "| rate | profile `h100` | measured | measured / profile |"
    assert "| matmul, bf16, 8192^3 | 593.4 TFLOP/s | 650.0 TFLOP/s | 1.10 |" in table
    assert "| device -> host, pinned | 38.4 GB/s | 50.0 GB/s | 1.30 |" in table

    checks = [
        gc.OffloadCheck("no regions", 0, (), 0, 100 * MIB, 100 * MIB, 0.100, 0.100),
        gc.OffloadCheck(
            "every self_attn, offload",
            2,
            ("layers.0.self_attn", "layers.1.self_attn"),
            40 * MIB,
            60 * MIB,
            61 * MIB,
            0.110,
            0.100,
            "solver manual",
        ),
    ]
    table = gc.offload_table(checks)
    assert (
        "| no regions | 0 | none | 0.00 | 100.00 | 100.00 | +0.00% | 100.0 | 100.0 | +0.0% |"
        in table
    )
    assert "| layers.0.self_attn, layers.1.self_attn | 40.00 | 60.00 | 61.00 | -1.64% |" in table
    assert "| 110.0 | 100.0 | +10.0% | solver manual |" in table

    text = gc.render("t", ["Device: x"], [("Rates", "a table"), ("Offload", "b\n")])
    assert text == "# t\n\nDevice: x\n\n## Rates\n\na table\n\n## Offload\n\nb\n"
