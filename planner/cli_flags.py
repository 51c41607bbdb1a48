"""The command line's flags read into values: budgets, shapes, the device, --fsdp,
--solver-opts, --anchors and the solvers, each checked before the model is built.

A flag that cannot be read is a :class:`UsageError` (exit status 2) whose one line says what to
write instead. torch and planner's heavier modules are imported inside the functions, so that
usage errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: --help must not wait for torch
    from planner.fsdp import FSDPConfig

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


def one_line(error: BaseException) -> str:
    """``Type: first line of the message``, for a message that stays on one line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


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


def factory_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--factory-kwargs as the keywords FACTORY is called with."""
    try:
        kwargs = json.loads(args.factory_kwargs) if args.factory_kwargs else {}
    except json.JSONDecodeError as e:
        raise UsageError(
            f"--factory-kwargs must be a JSON object, e.g. '{{\"batch\": 2}}': {e}"
        ) from None
    if not isinstance(kwargs, dict):
        raise UsageError("--factory-kwargs must be a JSON object, e.g. '{\"batch\": 2}'")
    return kwargs
