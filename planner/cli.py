"""The command line: ``python -m planner plan|compare|fit-batch|solvers``.

python -m planner plan benchmarks.models:gpt_ref_small_example --budget 50% --out plan.json
python -m planner plan mymodels:ResNet --input-shape 32,3,224,224 --budget 2GB
python -m planner compare benchmarks.models:unet_example --budgets 0.5GB,1GB --measure
python -m planner fit-batch benchmarks.plan_7b:llama_for_batch --budget 80GB --device h100

torch and planner's modules are imported inside the commands, not here, so that ``--help`` and
usage errors answer at once (no import cycle hides behind them).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

UNITS = {
    "b": 1,
    "kb": 10**3,
    "kib": 2**10,
    "mb": 10**6,
    "mib": 2**20,
    "gb": 10**9,
    "gib": 2**30,
    "tb": 10**12,
    "tib": 2**40,
}
MIB = 2**20

DESCRIPTION = """\
Plan activation checkpointing for a PyTorch model so one training step (forward, loss, backward)
fits a memory budget, or compare every solver across budgets.

MODEL is MODULE:FACTORY, e.g. benchmarks.models:gpt_ref_small_example or path/to/file.py:build.
FACTORY is called (with --factory-kwargs) and returns either a model, whose example input is
then built from --input-shape/--input-dtype, or a (model, example_input) tuple.

A budget is the peak memory of one step above what is allocated before it (parameters and
optimizer state are not counted), written with a unit (2GB, 1.5GiB, 512MiB, 300MB) or as a
percentage of the predicted peak without checkpointing (50%).

The loss of the step is the model output's .loss when it has one, else the sum of its floating
outputs; --loss MODULE:FUNCTION names a function of the output that returns the loss instead.
"""

EPILOG = """\
examples:
  python -m planner plan benchmarks.models:gpt_ref_small_example --budget 50% --out plan.json
  python -m planner plan mymodels.py:Net --input-shape 32,3,64,64 --budget 1GB --solver dp
  python -m planner compare benchmarks.models:gpt_ref_small_example --budgets 60%,30% --measure
  python -m planner fit-batch benchmarks.models:gpt_ref_small_for_batch --budget 20MB
  python -m planner solvers

In a training script, re-apply a saved plan without solving again:
  p = planner.apply_plan(model, "plan.json", example_input); train p.module

Exit status: 0 done; 2 for arguments that cannot be read, or a model or budget planner cannot
plan (the message says why and what to change).
"""


class UsageError(Exception):
    """A command-line argument that cannot be understood (exit status 2)."""


def parse_budget(text: str) -> tuple[str, float]:
    """'2GB' -> ('bytes', 2e9); '512MiB' -> ('bytes', 536870912); '50%' -> ('fraction', 0.5)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*", text)
    if match is None:
        raise UsageError(f"cannot read the budget {text!r}; write e.g. 2GB, 1.5GiB, 512MiB or 50%")
    value, unit = float(match.group(1)), match.group(2).lower()
    if value <= 0:
        raise UsageError(f"a budget must be positive, got {text!r}")
    if unit == "%":
        return "fraction", value / 100
    if unit not in UNITS:
        raise UsageError(
            f"the budget {text!r} needs a unit: one of GB, GiB, MB, MiB, KB, KiB, B "
            f"(GB = 10^9 bytes, GiB = 2^30 bytes), or a percentage like 50%"
        )
    return "bytes", value * UNITS[unit]


def parse_budgets(text: str) -> tuple[str, list[float]]:
    """A comma-separated list of budgets, all absolute or all percentages."""
    parsed = [parse_budget(part) for part in text.split(",") if part.strip()]
    if not parsed:
        raise UsageError("--budgets needs at least one budget, e.g. --budgets 0.5GB,1GB")
    kinds = {kind for kind, _ in parsed}
    if len(kinds) > 1:
        raise UsageError(f"mix of absolute budgets and percentages in {text!r}; use one kind")
    return kinds.pop(), [value for _, value in parsed]


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in re.split(r"[,x ]+", text.strip()) if s)
    except ValueError:
        shape = ()
    if not shape or min(shape) <= 0:
        raise UsageError(f"cannot read the input shape {text!r}; write e.g. 8,3,32,32")
    return shape


def load_callable(spec: str, what: str = "MODEL") -> Any:
    """'package.module:attr' or 'path/to/file.py:attr' -> the attribute (dots walk into it).

    ``what`` names the argument in errors: MODEL (MODULE:FACTORY) or --loss (MODULE:FUNCTION).
    """
    form = "MODULE:FACTORY" if what == "MODEL" else "MODULE:FUNCTION"
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        example = "benchmarks.models:gpt_ref_small_example" if what == "MODEL" else "losses:ce"
        raise UsageError(f"{what} must be {form}, e.g. {example}; got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"no such file {module_name!r}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
        sys.path.insert(0, str(path.resolve().parent))
        loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise UsageError(
                f"cannot import {module_name!r} ({e}); run from the directory that holds it, "
                f"or give a file path like path/to/{module_name.replace('.', '/')}.py:{attr}"
            ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec} is not callable; {what} must name a function or a class")
    return obj


def build_example(args: argparse.Namespace) -> tuple[Any, Any]:
    """Call the factory; build the example input from the shape flags when it returns a model."""
    import torch

    factory = load_callable(args.model)
    made = factory(**_factory_kwargs(args))
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, example_input = made
        if args.input_shape:
            raise UsageError(f"{args.model} returns its own example input; drop --input-shape")
    elif isinstance(made, torch.nn.Module):
        model = made
        if not args.input_shape:
            raise UsageError(
                f"{args.model} returns a model without an example input; give its shape, "
                f"e.g. --input-shape 8,3,32,32 (repeat the flag for several inputs)"
            )
        example_input = make_inputs(args.input_shape, args.input_dtype, args.input_high)
    else:
        raise UsageError(
            f"{args.model} returned {type(made).__name__}; FACTORY must return an nn.Module or "
            f"a (model, example_input) tuple"
        )
    device = torch.device(args.device)
    model = model.to(device)
    example_input = _to(example_input, device)
    return model, example_input


def make_inputs(shapes: Sequence[str], dtypes: Sequence[str] | None, int_high: int) -> Any:
    """Random example tensors: floats from a normal distribution, integers in [0, int_high)."""
    import torch

    dtypes = list(dtypes or ["float32"])
    if len(dtypes) == 1:
        dtypes *= len(shapes)
    if len(dtypes) != len(shapes):
        raise UsageError("give one --input-dtype, or one per --input-shape")
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for shape_text, dtype_name in zip(shapes, dtypes):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"unknown dtype {dtype_name!r}; e.g. float32, bfloat16, int64")
        shape = parse_shape(shape_text)
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            tensors.append(torch.randint(0, int_high, shape, generator=generator, dtype=dtype))
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _to(example_input: Any, device: Any) -> Any:
    import torch

    if isinstance(example_input, torch.Tensor):
        return example_input.to(device)
    if isinstance(example_input, dict):
        return {k: _to(v, device) for k, v in example_input.items()}
    if isinstance(example_input, (tuple, list)):
        return type(example_input)(_to(v, device) for v in example_input)
    return example_input


def _console() -> Any:
    from rich.console import Console

    # Piped output (CI logs, tests) gets a wide, plain table instead of 80 wrapped columns.
    if sys.stdout.isatty():
        return Console()
    return Console(width=max(shutil.get_terminal_size((140, 24)).columns, 140), color_system=None)


def cmd_plan(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from planner.planning import price
    from planner.solvers.registry import get_solver

    kind, value = parse_budget(args.budget)
    try:
        get_solver(args.solver)
    except ValueError as e:
        raise UsageError(f"{e}; see python -m planner solvers") from None
    loss_fn = load_callable(args.loss, "--loss") if args.loss else None
    model, example_input = build_example(args)
    with tqdm(total=4, desc="capture", unit="step", delay=0.5, disable=args.quiet) as bar:

        def on_step(step: str) -> None:
            if step != "capture":
                bar.update()
            bar.set_description(step if step != "solve" else f"solve ({args.solver})")

        priced = price(model, example_input, loss_fn=loss_fn, on_step=on_step)
        budget_bytes = (
            round(value * priced.eager_peak_bytes) if kind == "fraction" else round(value)
        )
        p = priced.plan(
            budget_bytes,
            args.solver,
            objective=args.objective,
            max_recompute_flops_fraction=(
                None if args.max_recompute_flops is None else args.max_recompute_flops / 100
            ),
            on_step=on_step,
        )
        bar.update()
    out = _console()
    out.print(p.summary(verbose=args.verbose), highlight=False, markup=False)
    out.print(f"solved in {p.solve_time_s:.2f} s", highlight=False)
    if args.measure:
        from planner.measurement import measure

        eager = measure(model, example_input, loss_fn)
        after = measure(p.module, example_input, loss_fn)
        out.print(
            f"measured peak: {eager.peak_bytes / MIB:,.1f} MiB eager -> "
            f"{after.peak_bytes / MIB:,.1f} MiB planned; step time {eager.step_time_s:.3f} s -> "
            f"{after.step_time_s:.3f} s",
            highlight=False,
        )
    if args.show_code:
        out.print(p.module.code, highlight=False, markup=False)
    if args.out:
        p.save(args.out)
        out.print(
            f"wrote {args.out}; in training: p = planner.apply_plan(model, {str(args.out)!r}, "
            f"example_input) and train p.module",
            highlight=False,
            markup=False,
        )
    if args.timeline:
        from planner.plots import plot_timeline

        plot_timeline(p).savefig(args.timeline, dpi=120)
        out.print(f"wrote {args.timeline}", highlight=False)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from planner.comparison import compare, solver_names

    budgets_gb = fractions = None
    if args.budgets:
        kind, values = parse_budgets(args.budgets)
        if kind == "fraction":
            fractions = values
        else:
            budgets_gb = [v / 1e9 for v in values]
    solvers = [s.strip() for s in args.solvers.split(",") if s.strip()] if args.solvers else None
    if solvers is not None:
        unknown = sorted(set(solvers) - set(solver_names()) - {"auto"})
        if unknown:
            raise UsageError(
                f"unknown solver(s) {', '.join(unknown)}; known: {', '.join(solver_names())}"
            )
    loss_fn = load_callable(args.loss, "--loss") if args.loss else None
    model, example_input = build_example(args)
    c = compare(
        model,
        example_input,
        budgets_gb=budgets_gb,
        solvers=solvers,
        measure=args.measure,
        loss_fn=loss_fn,
        budget_fractions=fractions,
        progress=not args.quiet,
    )
    out = _console()
    out.print(c)
    if args.markdown:
        Path(args.markdown).write_text(c.to_markdown())
        out.print(f"wrote {args.markdown}", highlight=False)
    if args.plot:
        c.plot().savefig(args.plot, dpi=120)
        out.print(f"wrote {args.plot}", highlight=False)
    return 0


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


def cmd_fit_batch(args: argparse.Namespace) -> int:
    import torch

    from planner.batch_search import fit_batch
    from planner.devices import PROFILES

    kind, value = parse_budget(args.budget)
    if kind == "fraction":
        raise UsageError("fit-batch needs an absolute --budget, e.g. 80GB or 512MiB, not a %")
    factory = load_callable(args.model)
    kwargs = _factory_kwargs(args)
    sizes = None
    if args.batch_sizes:
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        except ValueError:
            raise UsageError(
                f"cannot read --batch-sizes {args.batch_sizes!r}; e.g. 1,2,4,8"
            ) from None
    profile = args.device.lower() if args.device.lower() in PROFILES else None
    place = None if profile else torch.device(args.device)

    def call(batch_size: int) -> tuple[torch.nn.Module, Any]:
        made = factory(batch_size, **kwargs)
        if not (
            isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)
        ):
            raise UsageError(
                f"{args.model}({batch_size}) returned {type(made).__name__}; for fit-batch, "
                f"FACTORY takes the batch size and returns a (model, example_input) tuple"
            )
        model, example_input = made
        return (
            (model, example_input)
            if place is None
            else (model.to(place), _to(example_input, place))
        )

    model, _ = call(sizes[0] if sizes else 1)
    loss_fn = load_callable(args.loss, "--loss") if args.loss else None
    fit = fit_batch(
        model,
        lambda batch_size: call(batch_size)[1],
        value / 1e9,
        batch_sizes=sizes,
        solver=args.solver,
        device=profile,
        loss_fn=loss_fn,
    )
    out = _console()
    out.print(fit)
    if args.plot:
        fit.plot().savefig(args.plot, dpi=120)
        out.print(f"wrote {args.plot}", highlight=False)
    if args.out:
        fit.plan.save(args.out)
        out.print(f"wrote the plan for batch {fit.best_batch_size} to {args.out}", highlight=False)
    return 0


def _factory_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    try:
        kwargs = json.loads(args.factory_kwargs) if args.factory_kwargs else {}
    except json.JSONDecodeError as e:
        raise UsageError(
            f"--factory-kwargs must be a JSON object, e.g. '{{\"batch\": 2}}': {e}"
        ) from None
    if not isinstance(kwargs, dict):
        raise UsageError("--factory-kwargs must be a JSON object, e.g. '{\"batch\": 2}'")
    return kwargs


def cmd_solvers(args: argparse.Namespace) -> int:
    from planner.comparison import solver_names
    from planner.solvers.registry import SOLVERS

    for name in solver_names() + ["auto"] * ("auto" in SOLVERS):
        doc = (SOLVERS[name].__doc__ or "").strip().splitlines()
        print(f"{name:12s} {doc[0] if doc else ''}")
    return 0


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
        sub.add_argument("--device", default="cpu", help="device to plan on: cpu (default) or cuda")
    else:
        sub.add_argument(
            "--device",
            default="cpu",
            help="cpu (default) or cuda: run the model there and time its ops; h100, a100-80gb "
            "or a100-40gb: predict for that GPU by its profile",
        )
    sub.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


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
    plan.add_argument(
        "--solver",
        default="auto",
        help="which solver chooses the regions (default auto); list them: python -m planner "
        "solvers",
    )
    plan.add_argument(
        "--objective",
        choices=("time", "flops"),
        default="time",
        help="what to minimise within the budget: predicted step time (default) or recomputed "
        "FLOPs (the same plan on any machine)",
    )
    plan.add_argument(
        "--max-recompute-flops",
        type=float,
        metavar="PERCENT",
        help="recompute at most this percentage of the step's FLOPs (0.5: half a percent), "
        "the fastest such plan",
    )
    plan.add_argument("--out", metavar="PLAN.json", help="save the plan here (for apply_plan)")
    plan.add_argument("--measure", action="store_true", help="also run and measure a real step")
    plan.add_argument("--timeline", metavar="PNG", help="save the predicted memory timeline")
    plan.add_argument("--show-code", action="store_true", help="print the rewritten module's code")
    plan.add_argument(
        "-v", "--verbose", action="store_true", help="also print what the solver reported"
    )
    plan.set_defaults(run=cmd_plan)

    cmp = model_command(
        "compare",
        help="every solver at several budgets, as a table (and a Pareto plot)",
        description="Run every solver (or --solvers) at every budget on one capture of the "
        "model and print a table: predicted (and with --measure, measured) peak, recompute "
        "FLOPs, solve time, and the least feasible budget where a solver cannot fit.",
    )
    cmp.add_argument(
        "--budgets",
        help="comma-separated budgets, e.g. 0.5GB,1GB or 60%%,30%% (default 80%%,60%%,40%%,20%%)",
    )
    cmp.add_argument("--solvers", help="comma-separated solver names (default: all but auto)")
    cmp.add_argument(
        "--measure", action="store_true", help="run each plan for real: measured peak, step time"
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
    fit.add_argument("--solver", default="auto", help="solver per batch size (default auto)")
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
    except PlannerError as e:
        # Planner errors say what went wrong and how to fix it; a traceback adds nothing.
        print(f"planner: {type(e).__name__}: {e}", file=sys.stderr)
        least = getattr(e, "min_bytes", None)
        if least is not None:
            print(
                f"  on the command line: --budget {math.ceil(least / MIB * 10) / 10}MiB",
                file=sys.stderr,
            )
        return 2
    return 0
