"""The command line: ``python -m planner plan|compare|fit-batch|solvers``.

python -m planner plan benchmarks.models:gpt_ref_small_example --budget 80% --out plan.json
python -m planner plan mymodels:ResNet --input-shape 32,3,224,224 --budget 2GB --form graph
python -m planner plan transformers:LlamaForCausalLM --hf-config '{"num_hidden_layers": 2}' \
    --input-shape 2,128 --budget 60%
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: --help must not wait for torch
    from planner.fsdp import FSDPConfig
    from planner.planning import PlanOptions

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
        try:
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:  # the user's file: any error in it is theirs to fix
            raise UsageError(f"cannot load {module_name}: {_one_line(e)}") from e
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            named = e.name is None or module_name == e.name or module_name.startswith(e.name + ".")
            if not named:  # the module is there, but something it imports is not
                raise UsageError(
                    f"importing {module_name!r} needs {e.name!r}, which is not installed "
                    f"({_one_line(e)})"
                ) from e
            raise UsageError(
                f"cannot import {module_name!r} ({e}); run from the directory that holds it, "
                f"or give a file path like path/to/{module_name.replace('.', '/')}.py:{attr}"
            ) from e
        except Exception as e:
            raise UsageError(f"cannot import {module_name!r}: {_one_line(e)}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec} is not callable; {what} must name a function or a class")
    return obj


def _one_line(error: BaseException) -> str:
    """``Type: first line of the message``, for a message that stays on one line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def is_hf_class(obj: Any) -> bool:
    """A Hugging Face model class: built from a config (``config_class`` or ``from_config``)."""
    return isinstance(obj, type) and (hasattr(obj, "config_class") or hasattr(obj, "from_config"))


def read_hf_config(text: str) -> dict[str, Any]:
    """--hf-config: JSON text, a JSON file, or a directory holding config.json."""
    source = text.strip()
    if not source.startswith("{"):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UsageError(
                f"--hf-config {text!r} is neither a JSON object nor a config file; give e.g. "
                f"--hf-config '{{\"num_hidden_layers\": 2}}' or path/to/config.json"
            )
        source = path.read_text()
    try:
        config = json.loads(source)
    except json.JSONDecodeError as e:
        raise UsageError(f"--hf-config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UsageError("--hf-config must be a JSON object of config fields")
    return config


def build_hf_model(cls: Any, spec: str, config_text: str) -> Any:
    """``cls(cls.config_class(**config))``, or ``cls.from_config`` (the Auto classes, whose
    config names its ``model_type``)."""
    fields = read_hf_config(config_text)
    try:
        if hasattr(cls, "config_class") and cls.config_class is not None:
            config = cls.config_class(**fields)
            return cls(config)
        from transformers import AutoConfig

        fields = dict(fields)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise UsageError(
                f'{spec} picks its model class from the config: give its "model_type" in '
                f'--hf-config, e.g. \'{{"model_type": "llama", "num_hidden_layers": 2}}\''
            )
        return cls.from_config(AutoConfig.for_model(model_type, **fields))
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot build {spec} from --hf-config: {_one_line(e)}") from e


def make_model(args: argparse.Namespace, *factory_args: Any) -> Any:
    """What MODEL names, built: a Hugging Face class from --hf-config, else FACTORY called with
    ``factory_args`` and --factory-kwargs. Its errors become one-line usage errors."""
    factory = load_callable(args.model)
    hf_config = getattr(args, "hf_config", None)
    if hf_config is not None:
        if not is_hf_class(factory):
            raise UsageError(
                f"--hf-config builds a Hugging Face model class (one with config_class or "
                f"from_config); {args.model} is not one"
            )
        return build_hf_model(factory, args.model, hf_config)
    if is_hf_class(factory) and not factory_args:
        raise UsageError(
            f"{args.model} is a Hugging Face model class, built from a config: give it with "
            f"--hf-config, e.g. --hf-config '{{\"num_hidden_layers\": 2}}' or "
            f"--hf-config path/to/config.json"
        )
    try:
        return factory(*factory_args, **_factory_kwargs(args))
    except UsageError:
        raise
    except Exception as e:  # the user's factory: say what it raised, in one line
        call = ", ".join([*map(repr, factory_args), *(f"{k}=..." for k in _factory_kwargs(args))])
        raise UsageError(f"{args.model}({call}) raised {_one_line(e)}") from e


def build_example(args: argparse.Namespace) -> tuple[Any, Any]:
    """Build the model; build the example input from the shape flags when it comes alone."""
    import torch

    made = make_model(args)
    if args.hf_config is not None:
        if not args.input_shape:
            raise UsageError(
                f"{args.model} needs the shape of its token ids: --input-shape BATCH,LENGTH, "
                f"e.g. --input-shape 2,128"
            )
        if len(args.input_shape) > 1:
            raise UsageError("--hf-config takes one --input-shape, BATCH,LENGTH of the token ids")
        vocab = getattr(made.config, "vocab_size", None) or args.input_high
        ids = make_inputs(args.input_shape, args.input_dtype or ["int64"], vocab)
        model, example_input = made.train(), {"input_ids": ids, "labels": ids}
    elif isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
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
    place = placement(args.device)
    if place is not None:
        model = model.to(place)
        example_input = _to(example_input, place)
    return model, example_input


def placement(device: str) -> Any:
    """--device: a torch device to run the model on (cpu, cuda, cuda:1), or None for a
    device profile (h100, ...), which predicts for that GPU wherever the model was built."""
    import torch

    from planner.devices import PROFILES

    if device.strip().lower() in PROFILES:
        return None
    try:
        return torch.device(device)
    except RuntimeError:
        raise UsageError(
            f"--device {device!r} is neither a torch device (cpu, cuda, cuda:1) nor a device "
            f"profile ({', '.join(PROFILES)})"
        ) from None


def profile_name(device: str) -> str | None:
    """The device profile --device names, or None where it names a torch device."""
    from planner.devices import PROFILES

    key = device.strip().lower()
    return key if key in PROFILES else None


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


def fsdp_config(text: str | None) -> FSDPConfig | None:
    """--fsdp as a ``planner.FSDPConfig``: a world size, or a JSON object of its fields."""
    from dataclasses import fields

    from planner.fsdp import FSDPConfig

    if text is None:
        return None
    fix = (
        "--fsdp takes the world size (8) or a JSON object of planner.FSDPConfig's fields, e.g. "
        '\'{"world_size": 8, "units": ["layers.0", "layers.1"]}\''
    )
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(f"{fix}; got {text!r}") from None
    if isinstance(body, int) and not isinstance(body, bool):
        body = {"world_size": body}
    if not isinstance(body, dict):
        raise UsageError(f"{fix}; got {text!r}")
    known = [f.name for f in fields(FSDPConfig)]
    unknown = sorted(set(body) - set(known))
    if unknown or "world_size" not in body:
        raise UsageError(f"{fix}; its fields are {', '.join(known)} (world_size required)")
    units = body.get("units")
    if units is not None and not isinstance(units, list):
        raise UsageError(f"{fix}; units is a list of module paths, got {units!r}")
    if units is not None:
        body["units"] = tuple(units)
    try:
        return FSDPConfig(**body)  # a bad value: its ValueError names the field and the fix
    except TypeError as e:
        raise UsageError(f"--fsdp: {e}") from None


def solver_options(args: argparse.Namespace, solvers: Sequence[str]) -> dict[str, Any]:
    """--solver-opts as a dict, checked against each solver's options before any work: the
    keywords of the one solver (plan, fit-batch), or solver name -> keywords (compare)."""
    from planner.solvers.registry import get_solver, make_options

    if not args.solver_opts:
        return {}
    try:
        opts = json.loads(args.solver_opts)
    except json.JSONDecodeError as e:
        raise UsageError(f"--solver-opts is not valid JSON: {e}") from None
    if not isinstance(opts, dict):
        raise UsageError("--solver-opts must be a JSON object, e.g. '{\"time_limit_s\": 10}'")
    per_solver = opts if args.command == "compare" else {solvers[0]: opts}
    for name, kw in per_solver.items():
        if name not in solvers or not isinstance(kw, dict):
            raise UsageError(
                f"compare's --solver-opts maps a compared solver's name to its options, e.g. "
                f'\'{{"ilp": {{"time_limit_s": 5}}}}\'; got {name!r}'
            )
        try:
            make_options(get_solver(name).options, kw, name)  # type: ignore[attr-defined]
        except (TypeError, ValueError) as e:
            raise UsageError(f"--solver-opts for {name}: {e}") from None
    return opts


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


def check_solvers(form: str, names: Sequence[str]) -> None:
    """Unknown solvers, and solvers the form cannot carry out, as usage errors."""
    from planner.comparison import solver_names
    from planner.inplace_form import SPAN_SOLVERS

    known = [*solver_names(), "auto"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(
            f"unknown solver{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(known)} (python -m planner solvers)"
        )
    graph_only = [n for n in names if form == "inplace" and n not in SPAN_SOLVERS]
    if graph_only:
        raise UsageError(
            f"{', '.join(graph_only)} place{'s' * (len(graph_only) == 1)} regions between "
            f"arbitrary graph nodes, which only a graph plan carries out; add --form graph, or "
            f"use {', '.join(s for s in SPAN_SOLVERS)} in place"
        )


def anchor_names(text: str | None, form: str) -> tuple[str, ...] | None:
    """--anchors as compare's ``anchors`` (None: its default); unknown names a usage error."""
    from planner.anchors import check_anchors

    if text is None:
        return None
    names = tuple(a.strip() for a in text.split(",") if a.strip() and a.strip() != "none")
    try:
        check_anchors(names, form)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return names


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
            else (model.to(place), _to(example_input, place))
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
        print(f"planner: error: {_one_line(e)}", file=sys.stderr)
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
