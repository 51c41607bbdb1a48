"""``python -m planner``: budgets and shapes parsed, plans written, tables printed, errors named.

Two runs go through a real subprocess (plan and compare, as a user types them); the rest call
``planner.cli.main`` in-process, which is the same code without the interpreter start-up.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import planner
from benchmarks.models import gpt_ref_small_example
from planner.cli import main
from planner.cli_flags import UsageError, parse_budget, parse_budgets, parse_shape
from planner.report import format_bytes, format_ms
from tests.helpers import assert_same_step_copy

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
    argv = ["plan", GPT, "--budget", "95%", "--solver", "uniform", "--out", str(out)]
    result = run_cli(*argv, "--form", "graph")
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
        "compare",
        GPT,
        "--budgets",
        "1GB,1KB",
        "--solvers",
        "none,uniform",
        "--markdown",
        str(md),
        "--form",
        "graph",
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
    argv += ["--form", "graph"]  # a GELU alone can be a region: a 0.5% cap is reachable
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
        (["compare", GPT, "--solvers", "none,nope"], "unknown solver 'nope'"),
    ],
)
def test_usage_errors_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("form", ["graph", "inplace"])
def test_an_infeasible_budget_exits_2_naming_the_least_feasible_one(form, capsys):
    solver = "uniform" if form == "graph" else "auto"
    argv = ["plan", GPT, "--solver", solver, "-q", "--form", form, "--device", "h100"]
    assert main([*argv, "--budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "InfeasibleBudgetError" in err and "least feasible budget" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # the budget it suggests is one the same command plans within
    suggested = re.search(r"On the command line: --budget ([0-9.]+MiB)", err).group(1)
    assert main([*argv, "--budget", suggested]) == 0
    assert "predicted peak" in capsys.readouterr().out


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
    argv += ["--form", "graph"]
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
    compare_argv += ["--form", "graph"]
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


# --- in place by default, Hugging Face classes, one-line errors, options on every command ------


def flat(text: str) -> str:
    """``text`` with its whitespace (a wrapping console's line breaks) collapsed."""
    return " ".join(text.split())


def wrapped_modules(model) -> list[str]:
    # an applied in-place plan replaces a region module's forward by an instance attribute
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def test_plan_is_in_place_by_default_and_its_file_applies_to_the_model(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", GPT, "--budget", "85%", "--device", "h100", "--out", str(out), "-q"]
    assert main(argv) == 0
    printed = flat(capsys.readouterr().out)
    body = json.loads(out.read_text())
    assert body["form"] == "inplace"
    assert (
        f"wrote {out}; in the training script: planner.apply_plan(model, {str(out)!r}) wraps "
        f"the model's own modules in place; train model as before" in printed
    )
    assert "p.module" not in printed
    # the plan the API makes with no form= for the same budget and device
    model, x = gpt_ref_small_example()
    api = planner.plan(model, x, body["budget_bytes"] / 1e9, device="h100")
    assert api.form == "inplace" and api.regions
    assert [r["module"] for r in body["regions"]] == [r.name for r in api.regions]
    assert body["predictions"]["peak_bytes"] == api.predicted_peak_bytes <= body["budget_bytes"]
    assert f"predicted peak {format_bytes(api.predicted_peak_bytes)}" in printed
    # and the file applies in a training script, without an example input
    reference, _ = gpt_ref_small_example()
    assert planner.apply_plan(model, out) is model
    assert wrapped_modules(model) == [r.name for r in api.regions]
    assert_same_step_copy(reference, model, x)


def test_plan_in_place_measures_the_model_with_the_plan_applied_then_removed(capsys):
    argv = ["plan", GPT, "--budget", "85%", "--device", "h100", "--measure", "-q"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    eager_mib, planned_mib = map(
        float, re.search(r"measured peak: ([0-9.]+) MiB eager -> ([0-9.]+) MiB", printed).groups()
    )
    assert planned_mib < eager_mib
    model, x = gpt_ref_small_example()
    assert eager_mib == round(planner.measure(model, x).peak_bytes / 2**20, 1)


HF_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "use_cache": False,
}
LLAMA = "transformers:LlamaForCausalLM"


def test_a_hugging_face_class_plans_from_its_config(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(SystemExit) as info:
        main(["plan", LLAMA, "--budget", "1GB", "--input-shape", "2,32"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "is a Hugging Face model class" in err and "--hf-config" in err

    argv = ["plan", LLAMA, "--input-shape", "2,32", "--budget", "80%", "--device", "h100", "-q"]
    out_json, out_file = tmp_path / "from_json.json", tmp_path / "from_file.json"
    assert main([*argv, "--hf-config", json.dumps(HF_CONFIG), "--out", str(out_json)]) == 0
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    assert main([*argv, "--hf-config", str(tmp_path), "--out", str(out_file)]) == 0  # directory
    printed = capsys.readouterr().out
    assert "checkpoint regions" in printed and "…" not in printed  # module paths whole
    body = json.loads(out_json.read_text())
    assert body["model_class"] == "LlamaForCausalLM" and body["regions"]
    assert body["regions"] == json.loads(out_file.read_text())["regions"]
    # the same plan as the API's on the same class built from the same config
    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG)).train()
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (2, 32))
    p = planner.plan(
        model, {"input_ids": ids, "labels": ids}, body["budget_bytes"] / 1e9, device="h100"
    )
    assert body["predictions"]["peak_bytes"] == p.predicted_peak_bytes
    assert [r["module"] for r in body["regions"]] == [r.name for r in p.regions]
    module_paths = dict(model.named_modules())
    # regions are of the model's own modules (spans: of their own forwards)
    assert all(r.place.path in module_paths for r in p.regions)
    reference = copy.deepcopy(model)
    assert planner.apply_plan(model, out_json) is model
    assert {r.place.path for r in p.regions} <= set(wrapped_modules(model))
    assert_same_step_copy(reference, model, {"input_ids": ids, "labels": ids})


BROKEN = {
    "raises.py": "def build():\n    raise RuntimeError('boom')\n",
    "syntax.py": "def build(:\n    pass\n",
    "missing_dep.py": "import no_such_dependency_xyz\ndef build():\n    pass\n",
}


@pytest.mark.parametrize(
    "model, extra, message",
    [
        ("raises.py:build", [], "raises.py:build() raised RuntimeError: boom"),
        ("syntax.py:build", [], "cannot load"),
        ("missing_dep.py:build", [], "No module named 'no_such_dependency_xyz'"),
        ("torch.nn:Linear", [], "torch.nn:Linear() raised TypeError"),
        ("torch.nn:Linear", ["--hf-config", "{}"], "torch.nn:Linear is not one"),
        (LLAMA, ["--hf-config", '{"num_hidden_layers": "two"'], "--hf-config is not valid JSON"),
        (LLAMA, ["--hf-config", "no/such/config.json"], "neither a JSON object nor a config"),
        (
            "transformers:AutoModelForCausalLM",
            ["--hf-config", '{"num_hidden_layers": 2}'],
            '"model_type"',
        ),
        (f"{GPT}", ["--show-code"], "add --form graph"),
        (f"{GPT}", ["--solver-opts", '{"nope": 1}'], "--solver-opts for auto: "),
        (f"{GPT}", ["--solver-opts", "[1]"], "--solver-opts must be a JSON object"),
        (f"{GPT}", ["--device", "tpu9"], "--device 'tpu9' is neither a torch device"),
        (f"{GPT}", ["--fsdp", "two"], "--fsdp takes the world size (8) or a JSON object"),
        (f"{GPT}", ["--fsdp", '{"world": 2}'], "its fields are world_size, reshard_after"),
    ],
)
def test_bad_models_and_options_exit_2_with_one_line(model, extra, message, tmp_path, capsys):
    for name, source in BROKEN.items():
        (tmp_path / name).write_text(source)
    spec = str(tmp_path / model) if model.split(":")[0] in BROKEN else model
    argv = ["plan", spec, "--budget", "1GB", "--input-shape", "2,4", "-q", *extra]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_compare_is_in_place_by_default_and_takes_plans_options(tmp_path, capsys, monkeypatch):
    from planner.comparison import compare, solver_names

    md = tmp_path / "table.md"
    argv = ["compare", GPT, "--budgets", "100%,85%", "--device", "h100", "-q"]
    argv += ["--objective", "flops", "--markdown", str(md)]
    assert main([*argv, "--solver-opts", '{"ilp": {"time_limit_s": 20}}']) == 0
    printed = capsys.readouterr().out
    assert "planner.compare (in place)" in printed
    rows = [r.split(" | ") for r in md.read_text().strip().splitlines()[4:]]
    model, x = gpt_ref_small_example()
    api = compare(model, x, budget_fractions=[1.0, 0.85], device="h100", objective="flops")
    assert [r[0].removeprefix("| ") for r in rows] == [r.solver for r in api.ranked()]
    # every solver in place, and checkpointing every block beside them
    assert {r.solver for r in api.rows} == {*solver_names("inplace"), "every-block"}
    for cells, r in zip(rows, api.ranked()):
        assert cells[1] == format_bytes(r.budget_bytes)
        if r.feasible:
            assert cells[3] == format_bytes(r.predicted_peak_bytes)
            assert cells[5] == format_ms(r.added_time_s)
            assert cells[7] == f"+{r.recompute_flops_pct:.1f}%"
    # the FLOPs cap reaches compare() as plan's fraction; its errors exit 2 in one line
    seen: dict = {}

    def refuse(*args, **kwargs):
        seen.update(kwargs)
        raise planner.RecomputeCapError("no plan within the budget keeps to the cap")

    monkeypatch.setattr("planner.comparison.compare", refuse)
    assert main([*argv, "--max-recompute-flops", "0.5", "--form", "graph"]) == 2
    assert "planner: RecomputeCapError: no plan within" in capsys.readouterr().err
    assert seen["max_recompute_flops_fraction"] == 0.005 and seen["objective"] == "flops"
    assert seen["form"] == "graph" and seen["device"] == "h100"
    monkeypatch.undo()
    # options for a solver not compared, an unknown anchor, and Hugging Face's own
    # checkpointing of a graph are refused
    for bad, message in [
        (["--solvers", "dp", "--solver-opts", '{"greedy": {}}'], "maps a compared solver's name"),
        (["--anchors", "every-layer"], "unknown anchor(s) 'every-layer'"),
        (["--anchors", "hf", "--form", "graph"], "compare it with form='inplace'"),
    ]:
        with pytest.raises(SystemExit) as info:
            main([*argv, *bad])
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_fit_batch_takes_the_form_and_plans_options(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    argv = ["fit-batch", "benchmarks.models:gpt_ref_small_for_batch", "--budget", "100GB"]
    argv += ["--batch-sizes", "1", "--device", "h100", "--form", "graph", "--out", str(out_path)]
    assert main([*argv, "--objective", "flops", "--solver", "uniform", "-q"]) == 0
    printed = flat(capsys.readouterr().out)
    assert "best: batch 1" in printed
    assert "example_input), then train p.module in the model's place" in printed
    body = json.loads(out_path.read_text())
    assert body["solver"] == "uniform" and "module_tree" not in body  # a graph plan file
    # in place too: uniform checkpoints the model's own blocks
    inplace_path = tmp_path / "inplace.json"
    argv = ["fit-batch", "benchmarks.models:gpt_ref_small_for_batch", "--budget", "100GB"]
    argv += ["--batch-sizes", "1", "--device", "h100", "--out", str(inplace_path)]
    assert main([*argv, "--solver", "uniform", "-q"]) == 0
    assert "wraps the model's own modules in place" in flat(capsys.readouterr().out)
    body = json.loads(inplace_path.read_text())
    assert body["solver"] == "uniform" and "module_tree" in body
    assert [r["name"] for r in body["regions"]] == ["blocks.0", "blocks.1"]


def test_solvers_are_listed_whole_with_the_forms_they_apply_to(capsys):
    from planner.cli_commands import solver_description
    from planner.comparison import solver_names
    from planner.inplace_form import SPAN_SOLVERS
    from planner.solvers.registry import SOLVERS

    assert main(["solvers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    entries = " ".join(lines).split()
    text = " ".join(entries)
    for name in [*solver_names(), "auto"]:
        description = solver_description(SOLVERS[name])
        assert description.endswith(".") and len(description) > 20, name
        forms = "in place or graph" if name in SPAN_SOLVERS else "graph form only"
        assert f"{name} {description} [{forms}]" in text
    assert sum(1 for line in lines if not line.startswith(" ")) == len(solver_names()) + 1


def test_plan_for_compile_and_autocast_as_the_api_plans(capsys):
    """--compiled and --autocast are plan's compiled= and autocast=: the same plan, said in the
    summary; --compiled with --form graph exits 2 naming the fix."""
    budget = "99%"
    argv = ["plan", GPT, "--budget", budget, "--device", "h100", "--solver", "dp", "-q"]
    assert main([*argv, "--compiled", "--autocast", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "for torch.compile" in out and "bfloat16" in out
    model, example_input = gpt_ref_small_example()
    eager = planner.plan(model, example_input, 1e3, device="h100", autocast=torch.bfloat16)
    api = planner.plan(
        model,
        example_input,
        round(0.99 * eager.baseline_peak_bytes) / 1e9,
        "dp",
        device="h100",
        compiled=True,
        autocast=torch.bfloat16,
    )
    assert f"predicted peak {format_bytes(api.predicted_peak_bytes)}" in flat(out)
    assert main([*argv, "--compiled", "--form", "graph"]) == 2
    assert "compiled=True plans the in-place form" in capsys.readouterr().err


# --- every option of planner.plan, on every model command ------------------------------------

# One flag per PlanOptions field, and the value it must hand the API; a field added to
# PlanOptions without its flag here (and in the CLI) fails the test below.
OPTION_FLAGS: dict[str, tuple[list[str], object]] = {
    "form": (["--form", "graph"], "graph"),
    "loss_fn": (["--loss", "torch:sum"], torch.sum),
    "device": (["--device", "h100"], "h100"),
    "fsdp": (["--fsdp", '{"world_size": 4, "backend": "gloo"}'], "fsdp"),
    "calibration": (["--calibration", "cal.json"], "cal.json"),
    "objective": (["--objective", "flops"], "flops"),
    "max_recompute_flops_fraction": (["--max-recompute-flops", "0.5"], 0.005),
    "compiled": (["--compiled"], True),
    "autocast": (["--autocast", "bf16"], torch.bfloat16),
}
COMMANDS = {  # the command line of each model command, and the API function it calls
    "plan": (["plan", GPT, "--budget", "1GB"], "planner.planning.PlanOptions.price"),
    "compare": (["compare", GPT, "--budgets", "1GB"], "planner.comparison.compare"),
    "fit-batch": (
        ["fit-batch", "benchmarks.models:gpt_ref_small_for_batch", "--budget", "1GB"]
        + ["--batch-sizes", "1"],
        "planner.batch_search.fit_batch",
    ),
}


class _Reached(Exception):
    """Raised where a command hands its options to the API: what it handed on."""

    def __init__(self, options) -> None:
        super().__init__("reached the API")
        self.options = options


def test_every_plan_option_has_a_flag():
    import dataclasses

    from planner.planning import PlanOptions

    assert [f.name for f in dataclasses.fields(PlanOptions)] == list(OPTION_FLAGS)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("field", OPTION_FLAGS)
def test_each_model_command_hands_each_option_to_the_api(command, field, monkeypatch):
    """plan, compare and fit-batch take each of ``planner.plan``'s options as a flag and hand
    it on as that option, the others at their defaults (the API checks the values)."""
    import dataclasses

    from planner.devices import device_profile
    from planner.fsdp import FSDPConfig
    from planner.planning import PlanOptions

    argv, target = COMMANDS[command]
    flag, expected = OPTION_FLAGS[field]
    if expected == "fsdp":
        expected = FSDPConfig(world_size=4, backend="gloo")

    def reached(*args, **kwargs):
        raise _Reached(args[0] if target.endswith(".price") else PlanOptions.of(kwargs))

    monkeypatch.setattr(target, reached)
    with pytest.raises(_Reached) as info:
        main([*argv, "-q", *flag])
    options = info.value.options
    if options.device is not None:  # a name, or (plan's, once checked) its profile
        options = dataclasses.replace(options, device=device_profile(options.device))
        expected = device_profile(expected)
    assert getattr(options, field) == expected, (command, field)
    for other in dataclasses.fields(PlanOptions):
        if other.name != field:
            assert getattr(options, other.name) == other.default, (command, field, other.name)


def test_fsdp_and_a_pinned_calibration_plan_as_the_api_plans(tmp_path, capsys):
    """--fsdp and --calibration are plan's fsdp= and calibration=: the same plan; the
    calibration file, absent at first, receives the device's calibration."""
    from planner.fsdp import FSDPConfig

    calibration, out = tmp_path / "cal.json", tmp_path / "plan.json"
    argv = ["plan", GPT, "--budget", "90%", "--fsdp", "2", "-q", "--solver", "dp"]
    assert main([*argv, "--calibration", str(calibration), "--objective", "flops"]) == 0
    assert calibration.exists()
    assert main([*argv, "--calibration", str(calibration), "--out", str(out)]) == 0
    capsys.readouterr()
    body = json.loads(out.read_text())
    model, x = gpt_ref_small_example()
    api = planner.plan(
        model, x, body["budget_bytes"] / 1e9, "dp", fsdp=FSDPConfig(2), calibration=calibration
    )
    assert body["predictions"]["peak_bytes"] == api.predicted_peak_bytes
    assert [r["module"] for r in body["regions"]] == [r.name for r in api.regions]
    unsharded = planner.plan(model, x, body["budget_bytes"] / 1e9, "dp", calibration=calibration)
    assert unsharded.baseline_peak_bytes != api.baseline_peak_bytes  # the flag was not ignored


def test_compare_measures_the_anchors_it_is_asked_for(tmp_path, capsys):
    md = tmp_path / "table.md"
    argv = ["compare", "benchmarks.models:residual_cnn_example", "--budgets", "95%", "-q"]
    argv += ["--solvers", "uniform,dp", "--anchors", "every-block", "--measure"]
    argv += ["--factory-kwargs", '{"batch": 2, "size": 8, "channels": 4, "n_blocks": 3}']
    assert main([*argv, "--markdown", str(md)]) == 0
    rows = [r.split(" | ") for r in md.read_text().strip().splitlines()[4:]]
    assert sorted(r[0].removeprefix("| ") for r in rows) == ["dp", "every-block", "uniform"]
    header = md.read_text().strip().splitlines()[2].split(" | ")
    measured = header.index("measured peak")
    every = next(r for r in rows if r[0] == "| every-block")
    uniform = next(r for r in rows if r[0] == "| uniform")
    # every block is uniform's default plan, measured once and shown on both rows
    assert every[measured] == uniform[measured] != "-"
