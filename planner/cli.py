"""The command line: ``python -m planner plan|compare|fit-batch|solvers``.

python -m planner plan benchmarks.models:gpt_ref_small_example --budget 80% --out plan.json
python -m planner plan mymodels:ResNet --input-shape 32,3,224,224 --budget 2GB --form graph
python -m planner plan transformers:LlamaForCausalLM --hf-config '{"num_hidden_layers": 2}' \
    --input-shape 2,128 --budget 60%
python -m planner compare benchmarks.models:unet_example --budgets 0.5GB,1GB --measure
python -m planner fit-batch benchmarks.plan_7b:llama_for_batch --budget 80GB --device h100

The flags are read in ``planner/cli_flags.py``, the user's model built in
``planner/cli_model.py``, the commands run in ``planner/cli_commands.py``; this module holds the
parser and ``main``. torch and planner's other modules are imported inside the commands, not at
import, so that ``--help`` and usage errors answer at once (no import cycle hides behind them).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from planner.cli_commands import cmd_compare, cmd_fit_batch, cmd_plan, cmd_solvers
from planner.cli_flags import MIB, UsageError, one_line

DESCRIPTION = """\
Plan activation checkpointing for a PyTorch model so one training step (forward, loss, backward)
fits a memory budget, or compare every solver across budgets.

MODEL is MODULE:FACTORY, e.g. benchmarks.models:gpt_ref_small_example or path/to/file.py:build.
FACTORY is called (with --factory-kwargs) and returns either a model, whose example input is
then built from --input-shape/--input-dtype, or a (model, example_input) tuple. A Hugging Face
model class takes its config from --hf-config (JSON text, a config.json, or a directory holding
one), e.g. transformers:LlamaForCausalLM --hf-config '{"num_hidden_layers": 2}'; its example
input is token ids of --input-shape (batch,length) as input_ids and labels.

Plans are made in place by default (--form inplace): the saved plan wraps the model's own
modules, planner.apply_plan(model, "plan.json"). --form graph makes a torch.fx GraphModule plan
instead (p.module: readable, exportable; every solver applies).

A budget is the peak memory of one step above what is allocated before it (parameters and
optimizer state are not counted), written with a unit (2GB, 1.5GiB, 512MiB, 300MB) or as a
percentage of the predicted peak without checkpointing (50%).

The loss of the step is the model output's .loss when it has one, else the sum of its floating
outputs; --loss MODULE:FUNCTION names a function of the output that returns the loss instead.
"""


EPILOG = """\
examples:
  python -m planner plan benchmarks.models:gpt_ref_small_example --budget 80% --out plan.json
  python -m planner plan mymodels.py:Net --input-shape 32,3,64,64 --budget 1GB --solver dp
  python -m planner plan transformers:LlamaForCausalLM --input-shape 2,128 --budget 60% \
      --hf-config '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "vocab_size": 1000, "use_cache": false}'
  python -m planner compare benchmarks.models:gpt_ref_small_example --budgets 60%,30% --measure
  python -m planner compare benchmarks.models:gpt_ref_small_example --form graph
  python -m planner fit-batch benchmarks.models:gpt_ref_small_for_batch --budget 20MB
  python -m planner solvers

In a training script, apply a saved plan without solving again:
  planner.apply_plan(model, "plan.json")   # in place (the default form): train model as before
  p = planner.apply_plan(model, "plan.json", example_input)   # --form graph: train p.module

Exit status: 0 done; 2 for arguments that cannot be read, a model that cannot be built, or a
model or budget planner cannot plan (one line says why and what to change).
"""


FIT_BATCH_DESCRIPTION = """\
For each micro-batch size (1, 2, 4, ... until even the least-memory plan no longer fits, or
--batch-sizes), find the fastest checkpoint plan whose step fits --budget and predict its peak,
step time and samples/s; print the table and the winner.

MODEL is MODULE:FACTORY where FACTORY(batch_size) (plus --factory-kwargs) returns a
(model, example_input) tuple whose input has that batch size, e.g.
benchmarks.models:gpt_ref_small_for_batch or benchmarks.plan_7b:llama_for_batch. The model of
the first call is planned; the later calls only supply inputs.

--device says whose time to predict: cpu (default) or cuda runs the model there and times its
own ops on it; a profile name (h100, a100-80gb, a100-40gb) predicts for that GPU without one,
by its roofline (build the model on the meta device in FACTORY to plan a large one on a laptop).
Every figure printed is a prediction.
"""


def _model_arguments(sub: argparse.ArgumentParser, example_flags: bool = True) -> None:
    """MODEL and what every model command takes; ``example_flags``: the input-shape flags, for
    commands whose FACTORY may return a model alone (not fit-batch's)."""
    sub.add_argument("model", metavar="MODEL", help="MODULE:FACTORY, see above")
    if example_flags:
        group = sub.add_argument_group("example input (when FACTORY returns only a model)")
        group.add_argument(
            "--input-shape",
            action="append",
            metavar="SHAPE",
            help="shape of one input tensor, e.g. 8,3,32,32; repeat for several positional inputs",
        )
        group.add_argument(
            "--input-dtype",
            action="append",
            metavar="DTYPE",
            help="torch dtype of the inputs (default float32); one for all, or one per "
            "--input-shape",
        )
        group.add_argument(
            "--input-high",
            type=int,
            default=2,
            metavar="N",
            help="integer inputs (token ids) are drawn from [0, N); default 2",
        )
    sub.add_argument(
        "--factory-kwargs",
        metavar="JSON",
        help="keyword arguments for FACTORY as a JSON object, e.g. '{\"batch\": 2}'",
    )
    sub.add_argument(
        "--loss",
        metavar="MODULE:FUNCTION",
        help="the loss of one training step: FUNCTION(model output) -> scalar tensor (default: "
        "the output's .loss, else the sum of its floating outputs)",
    )
    if example_flags:
        sub.add_argument(
            "--hf-config",
            metavar="PATH_OR_JSON",
            help="build MODEL, a Hugging Face model class, from this config: JSON text, a "
            "config.json, or a directory holding one; the example input is token ids of "
            "--input-shape BATCH,LENGTH (input_ids and labels)",
        )
    sub.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda or cuda:N: run the model there and time its ops; h100, "
        "a100-80gb or a100-40gb: predict for that GPU by its profile",
    )
    sub.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _planning_arguments(sub: argparse.ArgumentParser, solvers_flag: str = "--solver") -> None:
    """What ``planner.plan`` takes besides the model: the same flags on every model command."""
    group = sub.add_argument_group("planning (as planner.plan's arguments)")
    group.add_argument(
        "--form",
        choices=("inplace", "graph"),
        default="inplace",
        help="inplace (default): the plan wraps the model's own modules, "
        "planner.apply_plan(model, PLAN.json); graph: a GraphModule plan, p.module",
    )
    if solvers_flag == "--solver":
        group.add_argument(
            "--solver",
            default="auto",
            help="which solver chooses the regions (default auto); list them: python -m planner "
            "solvers",
        )
    else:
        group.add_argument(
            "--solvers",
            help="comma-separated solver names (default: all but auto that suit --form)",
        )
    group.add_argument(
        "--objective",
        choices=("time", "flops"),
        default="time",
        help="what to minimise within the budget: predicted step time (default) or recomputed "
        "FLOPs (the same plan on any machine)",
    )
    group.add_argument(
        "--max-recompute-flops",
        type=float,
        metavar="PERCENT",
        help="recompute at most this percentage of the step's FLOPs (0.5: half a percent), "
        "the fastest such plan",
    )
    group.add_argument(
        "--compiled",
        action="store_true",
        help="the model will run under torch.compile: plan without nested regions, within the "
        "budget less a stated margin (in place only)",
    )
    group.add_argument(
        "--autocast",
        choices=("bf16", "fp16"),
        help="price the step under torch.autocast in this dtype, as you train (default: off)",
    )
    group.add_argument(
        "--fsdp",
        metavar="N_OR_JSON",
        help="plan one rank of FSDP2 sharding over N ranks (the input is that rank's "
        "micro-batch), or a JSON object of planner.FSDPConfig's fields (in place only)",
    )
    group.add_argument(
        "--calibration",
        metavar="PATH",
        help="price time from this calibration file and add the calls it lacks (a path that "
        "does not exist receives this device's); default: the on-disk cache",
    )
    group.add_argument(
        "--solver-opts",
        metavar="JSON",
        help="the solver's options as a JSON object, e.g. '{\"time_limit_s\": 10}' (compare: "
        'solver name -> options, e.g. \'{"ilp": {"time_limit_s": 5}}\')',
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m planner",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def model_command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help,
            description=description + "\n\n" + DESCRIPTION.split("\n\n", 1)[1],
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _model_arguments(sub)
        return sub

    plan = model_command(
        "plan",
        help="choose checkpoint regions for one budget; print them, save the plan",
        description="Choose checkpoint regions so one training step fits --budget, print the "
        "regions and the predicted memory and recompute cost, and save the plan.",
    )
    plan.add_argument(
        "--budget", required=True, help="memory budget of one step: 2GB, 1.5GiB, 512MiB or 50%%"
    )
    _planning_arguments(plan)
    plan.add_argument("--out", metavar="PLAN.json", help="save the plan here (for apply_plan)")
    plan.add_argument("--measure", action="store_true", help="also run and measure a real step")
    plan.add_argument("--timeline", metavar="PNG", help="save the predicted memory timeline")
    plan.add_argument(
        "--show-code", action="store_true", help="print the rewritten module's code (--form graph)"
    )
    plan.add_argument(
        "-v", "--verbose", action="store_true", help="also print what the solver reported"
    )
    plan.set_defaults(run=cmd_plan)

    cmp = model_command(
        "compare",
        help="every solver at several budgets, as a table (and a Pareto plot)",
        description="Run every solver (or --solvers) at every budget on one pricing of the "
        "model and print a table: predicted (and with --measure, measured) peak, recompute "
        "FLOPs, solve time, and the least feasible budget where a solver cannot fit.",
    )
    cmp.add_argument(
        "--budgets",
        help="comma-separated budgets, e.g. 0.5GB,1GB or 60%%,30%% (default 80%%,60%%,40%%,20%%)",
    )
    _planning_arguments(cmp, "--solvers")
    cmp.add_argument(
        "--measure", action="store_true", help="run each plan for real: measured peak, step time"
    )
    cmp.add_argument(
        "--anchors",
        help="comma-separated rows of what you would do by hand: every-block (checkpoint every "
        "repeated block), hf (Hugging Face's own checkpointing, in place); 'none' for neither "
        "(default: those the model has)",
    )
    cmp.add_argument("--markdown", metavar="MD", help="also write the table as markdown here")
    cmp.add_argument("--plot", metavar="PNG", help="save the memory/recompute Pareto plot here")
    cmp.set_defaults(run=cmd_compare)

    fit = commands.add_parser(
        "fit-batch",
        help="the micro-batch size that trains fastest under a memory cap (predicted)",
        description=FIT_BATCH_DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_arguments(fit, example_flags=False)
    fit.add_argument("--budget", required=True, help="the cap on one step's peak: 80GB, 512MiB")
    fit.add_argument("--batch-sizes", metavar="B,B,...", help="sizes to try (default 1, 2, 4, ...)")
    _planning_arguments(fit)
    fit.add_argument("--plot", metavar="PNG", help="save samples/s and peak against batch size")
    fit.add_argument("--out", metavar="PLAN.json", help="save the winner's plan here")
    fit.set_defaults(run=cmd_fit_batch)

    solvers = commands.add_parser("solvers", help="list the solvers and what each does")
    solvers.set_defaults(run=cmd_solvers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from planner.solvers.errors import PlannerError

    try:
        return args.run(args)
    except UsageError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except ValueError as e:
        # The API's check of an argument (an option, a solver's keyword): what and how to fix.
        print(f"planner: error: {one_line(e)}", file=sys.stderr)
        return 2
    except PlannerError as e:
        # Planner errors say what went wrong and how to fix it; a traceback adds nothing.
        # One line, whatever the message holds, so that logs and scripts read it whole.
        text = " ".join(str(e).split())
        least = getattr(e, "min_bytes", None)
        if least is not None:
            text += f" On the command line: --budget {math.ceil(least / MIB * 10) / 10}MiB"
        print(f"planner: {type(e).__name__}: {text}", file=sys.stderr)
        return 2
    return 0
