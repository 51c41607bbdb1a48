"""The commands of ``python -m planner``: plan, compare, fit-batch, solvers. Each reads its
flags (``planner/cli_flags.py``), builds the user's model (``planner/cli_model.py``), calls the
API with the options every model command shares (:func:`plan_options`) and prints the result.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.cli_flags import (
    MIB,
    UsageError,
    anchor_names,
    check_solvers,
    fsdp_config,
    parse_budget,
    parse_budgets,
    placement,
    profile_name,
    solver_options,
)
from planner.cli_model import build_example, load_callable, make_model, to_device

if TYPE_CHECKING:  # imported where used: --help must not wait for torch
    from planner.planning import PlanOptions


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """``planner.plan``'s options (a ``PlanOptions``) from the flags every model command shares,
    one flag per field, so that plan, compare and fit-batch hand the API the same options."""
    import torch

    from planner.planning import PlanOptions

    fraction = args.max_recompute_flops
    return PlanOptions(
        form=args.form,
        loss_fn=load_callable(args.loss, "--loss") if args.loss else None,
        device=profile_name(args.device),
        fsdp=fsdp_config(args.fsdp),
        calibration=args.calibration,
        objective=args.objective,
        max_recompute_flops_fraction=None if fraction is None else fraction / 100,
        compiled=args.compiled,
        autocast={"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast],
    )


def _console() -> Any:
    from rich.console import Console

    # Piped output (CI logs, tests) gets a wide, plain table instead of 80 wrapped columns.
    if sys.stdout.isatty():
        return Console()
    return Console(width=max(shutil.get_terminal_size((140, 24)).columns, 140), color_system=None)


def cmd_plan(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    kind, value = parse_budget(args.budget)
    check_solvers(args.form, [args.solver])
    if args.show_code and args.form != "graph":
        raise UsageError(
            "--show-code prints a graph plan's GraphModule; add --form graph (an in-place "
            "plan wraps the model's own modules, whose code does not change)"
        )
    opts = solver_options(args, [args.solver])
    placement(args.device)  # a device that is neither fails before the model is built
    options = plan_options(args).checked([args.solver])
    loss_fn = options.loss_fn
    model, example_input = build_example(args)
    with tqdm(total=4, desc="capture", unit="step", delay=0.5, disable=args.quiet) as bar:

        def on_step(step: str) -> None:
            if step != "capture":
                bar.update()
            bar.set_description(step if step != "solve" else f"solve ({args.solver})")

        priced = options.price(model, example_input, on_step)
        budget_bytes = (
            round(value * priced.eager_peak_bytes) if kind == "fraction" else round(value)
        )
        p = priced.plan(budget_bytes, args.solver, on_step=on_step, **options.solving, **opts)
        bar.update()
    out = _console()
    out.print(p.summary(verbose=args.verbose), highlight=False, markup=False)
    out.print(f"solved in {p.solve_time_s:.2f} s", highlight=False)
    if args.measure:
        from planner.comparison import measure_plan
        from planner.measurement import measure

        eager = measure(model, example_input, loss_fn)
        after = measure_plan(p, model, example_input, loss_fn)
        out.print(
            f"measured peak: {eager.peak_bytes / MIB:,.1f} MiB eager -> "
            f"{after.peak_bytes / MIB:,.1f} MiB planned; step time {eager.step_time_s:.3f} s -> "
            f"{after.step_time_s:.3f} s",
            highlight=False,
        )
    if args.show_code:
        out.print(p.module.code, highlight=False, markup=False)
    if args.timeline:
        from planner.plots import plot_timeline

        plot_timeline(p).savefig(args.timeline, dpi=120)
        out.print(f"wrote {args.timeline}", highlight=False)
    if args.out:
        p.save(args.out)
        out.print(
            f"wrote {args.out}; {how_to_apply(p.form, args.out)}", highlight=False, markup=False
        )
    return 0


def how_to_apply(form: str, path: str) -> str:
    """The line that tells a user how to use a saved plan of ``form`` in a training script."""
    if form == "graph":
        return (
            f"in the training script: p = planner.apply_plan(model, {path!r}, example_input), "
            f"then train p.module in the model's place"
        )
    return (
        f"in the training script: planner.apply_plan(model, {path!r}) wraps the model's own "
        f"modules in place; train model as before"
    )


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
        check_solvers(args.form, solvers)
    names = solvers or solver_names(args.form)
    opts = solver_options(args, names)
    placement(args.device)  # a device that is neither fails before the model is built
    options = plan_options(args)
    options.checked(names)  # before the model is built
    anchors = anchor_names(args.anchors, args.form)
    model, example_input = build_example(args)
    c = compare(
        model,
        example_input,
        budgets_gb=budgets_gb,
        solvers=solvers,
        measure=args.measure,
        budget_fractions=fractions,
        solver_opts=opts,
        progress=not args.quiet,
        anchors=anchors,
        **options.keywords(),
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


def cmd_fit_batch(args: argparse.Namespace) -> int:
    import torch

    from planner.batch_search import fit_batch

    kind, value = parse_budget(args.budget)
    if kind == "fraction":
        raise UsageError("fit-batch needs an absolute --budget, e.g. 80GB or 512MiB, not a %")
    check_solvers(args.form, [args.solver])
    opts = solver_options(args, [args.solver])
    sizes = None
    if args.batch_sizes:
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        except ValueError:
            raise UsageError(
                f"cannot read --batch-sizes {args.batch_sizes!r}; e.g. 1,2,4,8"
            ) from None
    place = placement(args.device)
    options = plan_options(args)
    load_callable(args.model)  # a name that cannot be imported fails before anything runs

    def call(batch_size: int) -> tuple[torch.nn.Module, Any]:
        made = make_model(args, batch_size)
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
            else (model.to(place), to_device(example_input, place))
        )

    model, _ = call(sizes[0] if sizes else 1)
    fit = fit_batch(
        model,
        lambda batch_size: call(batch_size)[1],
        value / 1e9,
        batch_sizes=sizes,
        solver=args.solver,
        **options.keywords(),
        **opts,
    )
    out = _console()
    out.print(fit)
    if args.plot:
        fit.plot().savefig(args.plot, dpi=120)
        out.print(f"wrote {args.plot}", highlight=False)
    if args.out:
        fit.plan.save(args.out)
        out.print(
            f"wrote the plan for batch {fit.best_batch_size} to {args.out}; "
            f"{how_to_apply(fit.plan.form, args.out)}",
            highlight=False,
            markup=False,
        )
    return 0


def cmd_solvers(args: argparse.Namespace) -> int:
    import textwrap

    from planner.comparison import solver_names
    from planner.inplace_form import SPAN_SOLVERS
    from planner.solvers.registry import SOLVERS

    width = max(shutil.get_terminal_size((100, 24)).columns, 60)
    for name in solver_names() + ["auto"] * ("auto" in SOLVERS):
        forms = "in place or graph" if name in SPAN_SOLVERS else "graph form only"
        text = f"{solver_description(SOLVERS[name])} [{forms}]"
        print(textwrap.fill(text, width, initial_indent=f"{name:11s} ", subsequent_indent=" " * 12))
    return 0


def solver_description(fn: Any) -> str:
    """The first paragraph of a solver's docstring (its module's when it has none), whole:
    a description cut at a line end stops mid-sentence."""
    import inspect
    import re

    doc = inspect.getdoc(fn) or inspect.getdoc(sys.modules.get(fn.__module__)) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    # a module docstring opens with the solver's own name: "``auto``: run the solvers..."
    first = re.sub(r"^``\w+``:\s*", "", first)
    return first.replace("``", "")[:1].upper() + first.replace("``", "")[1:]
