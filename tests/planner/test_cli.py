"""``python -m planner``: budgets and shapes parsed, plans written, tables printed, errors named.

Two runs go through a real subprocess (plan and compare, as a user types them); the rest call
``planner.cli.main`` in-process, which is the same code without the interpreter start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import planner
from benchmarks.models import gpt_ref_small_example
from planner.cli import UsageError, main, parse_budget, parse_budgets, parse_shape
from planner.report import format_bytes

ROOT = Path(__file__).resolve().parents[2]
GPT = "benchmarks.models:gpt_ref_small_example"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # tiny model
    return subprocess.run(
        [sys.executable, "-m", "planner", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GB", ("bytes", 2e9)),
        ("1.5GiB", ("bytes", 1.5 * 2**30)),
        ("512MiB", ("bytes", 512 * 2**20)),
        ("300 MB", ("bytes", 300e6)),
        ("64KiB", ("bytes", 65536)),
        ("50%", ("fraction", 0.5)),
        ("1e9B", ("bytes", 1e9)),
    ],
)
def test_budgets_read_decimal_and_binary_units_and_percentages(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["2", "2 parsecs", "-1GB", "0MiB", "GB", ""])
def test_budgets_without_a_known_unit_or_positive_value_are_refused(text):
    with pytest.raises(UsageError):
        parse_budget(text)


def test_budget_lists_are_one_kind():
    assert parse_budgets("0.5GB, 1GB") == ("bytes", [5e8, 1e9])
    assert parse_budgets("60%,30%") == ("fraction", [0.6, 0.3])
    with pytest.raises(UsageError, match="mix"):
        parse_budgets("1GB,50%")


def test_shapes():
    assert parse_shape("8,3,32,32") == (8, 3, 32, 32)
    assert parse_shape("8x256") == (8, 256)
    with pytest.raises(UsageError):
        parse_shape("8,-1")


def test_plan_subprocess_writes_a_plan_that_applies(tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli("plan", GPT, "--budget", "95%", "--solver", "uniform", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "ckpt_blocks_0" in result.stdout and "ckpt_blocks_1" in result.stdout
    assert f"wrote {out}" in result.stdout
    body = json.loads(out.read_text())
    assert body["solver"] == "uniform"
    assert [r["name"] for r in body["regions"]] == ["ckpt_blocks_0", "ckpt_blocks_1"]
    assert body["predictions"]["peak_bytes"] <= body["budget_bytes"]
    # 95% of the predicted eager peak, as the summary's first line says
    baseline = body["predictions"]["baseline_peak_bytes"]
    assert body["budget_bytes"] == round(0.95 * baseline)
    model, example_input = gpt_ref_small_example()
    applied = planner.apply_plan(model, out, example_input)
    assert applied.predicted_peak_bytes == body["predictions"]["peak_bytes"]


def test_compare_subprocess_prints_the_table_and_writes_markdown(tmp_path):
    md = tmp_path / "table.md"
    result = run_cli(
        "compare", GPT, "--budgets", "1GB,1KB", "--solvers", "none,uniform", "--markdown", str(md)
    )
    assert result.returncode == 0, result.stderr
    lines = md.read_text().strip().splitlines()
    assert lines[2].startswith("| solver | budget | feasible |")
    rows = lines[4:]
    assert [r.split(" | ")[0:2] for r in rows] == [
        ["| none", "953.7 MiB"],
        ["| uniform", "953.7 MiB"],
        ["| none", "0.001 MiB"],
        ["| uniform", "0.001 MiB"],
    ]
    assert "| yes |" in rows[0] and "no: least" in rows[2] and "no: least" in rows[3]
    for solver in ("none", "uniform"):
        assert solver in result.stdout
    assert "no: least" in result.stdout and "predicted peak" in result.stdout


def test_help_explains_models_budgets_and_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for needle in ("MODULE:FACTORY", "--input-shape", "GiB", "plan", "compare", "apply_plan"):
        assert needle in text
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    assert "--budget" in text and "--solver" in text and "--out" in text


def test_a_model_factory_in_a_file_with_shapes_from_flags(tmp_path, capsys):
    source = tmp_path / "tiny.py"
    source.write_text(
        "import torch\n"
        "def build(width=8):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.GELU(),\n"
        "                               torch.nn.Linear(width, 2))\n"
    )
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            f"{source}:build",
            "--factory-kwargs",
            '{"width": 16}',
            "--input-shape",
            "3,4",
            "--budget",
            "1GB",
            "--solver",
            "none",
            "--out",
            str(out),
            "-q",
        ]
    )
    assert code == 0
    assert "0 checkpoint regions" in capsys.readouterr().out
    assert json.loads(out.read_text())["budget_bytes"] == 10**9


def test_plan_minimises_flops_when_asked(tmp_path, capsys):
    source = tmp_path / "tiny.py"
    source.write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64),\n"
        "                               torch.nn.GELU()) for _ in range(4)])\n"
    )
    argv = ["plan", f"{source}:build", "--input-shape", "256,64", "--budget", "80%", "-q", "-v"]
    assert main([*argv, "--objective", "flops"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table wraps the solver's note
    assert "minimised recomputed FLOPs" in out and "0 checkpoint regions" not in out
    assert main(argv) == 0
    assert "minimised recomputed FLOPs" not in " ".join(capsys.readouterr().out.split())
    assert main([*argv, "--max-recompute-flops", "0.5"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "within 0.50% of the step's FLOPs recomputed" in out


def test_a_model_without_example_input_needs_a_shape(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "benchmarks.models:MLPNet", "--budget", "1GB", "--solver", "none", "-q"])
    assert info.value.code == 2
    assert "--input-shape" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", GPT, "--budget", "2"], "needs a unit"),
        (["plan", GPT, "--budget", "1GB", "--solver", "nope"], "unknown solver 'nope'"),
        (["plan", "benchmarks.models", "--budget", "1GB", "--solver", "none"], "MODULE:FACTORY"),
        (
            ["plan", "no_such_module:f", "--budget", "1GB", "--solver", "none"],
            "cannot import 'no_such_module'",
        ),
        (
            ["plan", "benchmarks.models:nope", "--budget", "1GB", "--solver", "none"],
            "no attribute 'nope'",
        ),
        (["compare", GPT, "--solvers", "none,nope"], "unknown solver(s) nope"),
    ],
)
def test_usage_errors_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_infeasible_budget_exits_2_naming_the_least_feasible_one(capsys):
    code = main(["plan", GPT, "--budget", "1KiB", "--solver", "uniform", "-q"])
    assert code == 2
    err = capsys.readouterr().err
    assert "InfeasibleBudgetError" in err and "least feasible budget" in err
    assert "on the command line: --budget" in err
    assert "Traceback" not in err


# --- the same pipeline, checks and errors as planner.plan -----------------------------------------

COMPLEX_NET = """\
import torch


class ComplexNet(torch.nn.Module):
    # Its output is complex: no floating tensor to sum, so a training step needs a loss.
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)
        )

    def forward(self, x):
        return torch.view_as_complex(self.fc(x).reshape(*x.shape[:-1], 4, 2))


def build():
    torch.manual_seed(0)
    return ComplexNet(), torch.randn(4, 8)


def frozen():
    model, x = build()
    return model.requires_grad_(False), x


def loss(out):
    return out.abs().sum()
"""


@pytest.fixture
def complex_net(tmp_path):
    source = tmp_path / "complex_net.py"
    source.write_text(COMPLEX_NET)
    return source


def test_a_frozen_model_exits_2_with_the_apis_error_and_no_traceback(complex_net, capsys):
    code = main(["plan", f"{complex_net}:frozen", "--budget", "1GB", "--solver", "none", "-q"])
    assert code == 2
    err = capsys.readouterr().err
    assert "UnsupportedModelError" in err and "requires grad" in err and "ComplexNet" in err
    assert "Traceback" not in err and "loss_fn" not in err
    # the same error, word for word, as the API raises
    namespace: dict = {}
    exec(COMPLEX_NET, namespace)
    with pytest.raises(planner.UnsupportedModelError) as info:
        planner.plan(*namespace["frozen"](), mem_budget_gb=1.0, solver="none", form="graph")
    assert str(info.value) in err


def test_a_model_that_needs_a_loss_says_so_and_plans_with_loss(complex_net, capsys, tmp_path):
    argv = ["plan", f"{complex_net}:build", "--budget", "1GB", "--solver", "uniform", "-q"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "UnsupportedModelError" in err and "--loss MODULE:FUNCTION" in err
    assert "complex64 tensor" in err and "Traceback" not in err

    out = tmp_path / "plan.json"
    assert main([*argv, "--loss", f"{complex_net}:loss", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    body = json.loads(out.read_text())
    # the plan the command line saved is the one the API makes with the same loss
    namespace: dict = {}
    exec(COMPLEX_NET, namespace)
    model, x = namespace["build"]()
    p = planner.plan(
        model, x, mem_budget_gb=1.0, solver="uniform", loss_fn=namespace["loss"], form="graph"
    )
    assert body["predictions"]["peak_bytes"] == p.predicted_peak_bytes
    assert [r["nodes"] for r in body["regions"]] == [list(r.nodes) for r in p.regions]
    assert f"predicted peak {format_bytes(p.predicted_peak_bytes)}" in printed
    # compare takes the same flag
    compare_argv = ["compare", f"{complex_net}:build", "--budgets", "1GB", "--solvers", "uniform"]
    assert main([*compare_argv, "-q"]) == 2
    assert "--loss MODULE:FUNCTION" in capsys.readouterr().err
    assert main([*compare_argv, "-q", "--loss", f"{complex_net}:loss"]) == 0
    assert format_bytes(p.predicted_peak_bytes) in capsys.readouterr().out


def test_loss_must_name_a_function(complex_net, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", f"{complex_net}:build", "--budget", "1GB", "--loss", "nolosshere"])
    assert info.value.code == 2
    assert "--loss must be MODULE:FUNCTION" in capsys.readouterr().err


def test_fit_batch_prints_the_sweep_and_saves_the_winner(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    argv = ["fit-batch", "benchmarks.models:gpt_ref_small_for_batch", "--budget", "100GB"]
    argv += ["--batch-sizes", "1,2", "--device", "h100", "--out", str(out_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "planner.fit_batch" in out and "device h100 (roofline)" in out
    assert "best: batch 2" in out  # nothing to recompute under 100 GB: the larger batch wins
    assert json.loads(out_path.read_text())["regions"] == []


def test_fit_batch_refuses_a_percentage_and_a_factory_without_input(tmp_path, capsys):
    argv = ["fit-batch", "benchmarks.models:gpt_ref_small_for_batch", "--budget", "50%"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "absolute --budget" in capsys.readouterr().err
    source = tmp_path / "only_model.py"
    source.write_text("import torch\ndef build(batch_size):\n    return torch.nn.Linear(2, 2)\n")
    with pytest.raises(SystemExit) as info:
        main(["fit-batch", f"{source}:build", "--budget", "1GB"])
    assert info.value.code == 2
    assert "FACTORY takes the batch size and returns a (model, example_input)" in (
        capsys.readouterr().err
    )
