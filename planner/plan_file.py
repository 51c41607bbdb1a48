"""The saved-plan format: ``plan.save(path)`` writes it, ``planner.apply_plan`` reads it.

One format for both forms: JSON with a format tag and version, the form, the solver, its note,
the budget, the regions (their cost-graph node names, depth and kind; in place also what
applying needs), the predictions (every field of ``plans.Predictions``, by its name) and the
form's own part (its target's fields: a fingerprint of the captured graph for a graph plan,
the module tree and parameter shapes for an in-place one), with a checksum over all of it.
Applying refuses, with a ``PlanFileError``, any file that is not valid JSON, is from another
format version, was edited, or does not fit the model (the form's check): a plan never
silently yields a different module. Files saved before the form was recorded are graph plans.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, get_type_hints

import torch

from planner import plans
from planner.passes.file_format import check_header
from planner.passes.regions import parse_place
from planner.plans import Plan, Region
from planner.solvers.errors import PlanFileError

FORMAT = "planner-plan"
VERSION = 1
FIX = "Save the plan again with plan.save(path), or plan anew with planner.plan(...)."


def graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """A hash of the captured graph's structure and shapes: same model and shapes, same hash."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = (
            (tuple(val.shape), str(val.dtype))
            if isinstance(val, torch.Tensor)
            else type(val).__name__
        )
        inputs = [n.name for n in node.all_input_nodes]
        h.update(repr((node.op, node.name, str(node.target), inputs, shape)).encode())
    return h.hexdigest()


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _region_json(region: Region, form: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": region.name,
        "nodes": list(region.nodes),
        "depth": region.depth,
        "kind": region.kind,
        "saved_nodes": list(region.saved_nodes),
        "preserve_rng_state": region.preserve_rng_state,
    }
    if form == "inplace":  # under the keys in-place files have always had
        entry |= {
            "module": region.path,
            "keeps": [list(k) for k in region.keeps],
            "ops": list(region.ops),
            "state_buffers": list(region.state_buffers),
        }
    return entry


def save_plan(plan: Plan, path: str | Path, part: Mapping[str, Any]) -> None:
    """Write ``plan`` to ``path``; ``part``: its target's own fields, as JSON values."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "form": plan.form,
        "torch_version": torch.__version__,
        "solver": plan.solver,
        "notes": plan.notes,
        "budget_bytes": plan.budget_bytes,
        "regions": [_region_json(r, plan.form) for r in plan.regions],
        "predictions": asdict(plan.predictions),
        **part,
    }
    body["checksum"] = _checksum(body)
    Path(path).write_text(json.dumps(body, indent=1) + "\n")


def read_plan_body(path: str | Path) -> dict[str, Any]:
    """Read a plan file and check its format, version and checksum (any form of plan)."""
    try:
        body = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanFileError(f"no plan file at {path}") from None
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror}. {FIX}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFileError(f"{path} is not valid JSON (truncated or corrupt?): {e}. {FIX}") from e
    check_header(body, FORMAT, VERSION, PlanFileError, where=str(path), kind="plan file", fix=FIX)
    checksum = body.pop("checksum", None)
    if checksum != _checksum(body):
        raise PlanFileError(
            f"{path} was modified after it was saved (its checksum does not match). {FIX}"
        )
    body.setdefault("form", "graph")  # saved before the form was recorded: graph plans only
    return body


def read_regions(body: Mapping[str, Any]) -> tuple[Region, ...]:
    """The regions of a checked body (KeyError, TypeError or ValueError when malformed); an
    in-place plan's each at the place its name names."""
    in_place = body.get("form") == "inplace"
    return tuple(
        Region(
            name=(name := str(r["name"] if "name" in r else r["module"])),
            nodes=tuple(str(n) for n in r["nodes"]),
            depth=int(r["depth"]),
            kind=str(r["kind"]),
            saved_nodes=tuple(str(n) for n in r["saved_nodes"]),
            keeps=tuple((str(op), int(k)) for op, k in r.get("keeps", ())),
            ops=tuple(str(op) for op in r.get("ops", ())),
            state_buffers=tuple(str(b) for b in r.get("state_buffers", ())),
            # files saved before it was recorded: every region preserved, as then
            preserve_rng_state=bool(r.get("preserve_rng_state", True)),
            place=parse_place(name) if in_place else None,
        )
        for r in body["regions"]
    )


def read_predictions(data: Mapping[str, Any]) -> plans.Predictions:
    """``plans.Predictions`` from its fields by name, each converted to its declared type; a
    field the file lacks takes its default (files saved before it existed)."""
    cls = plans.Predictions  # looked up now: the type a plan of this planner holds
    types = get_type_hints(cls)
    return cls(**{f.name: types[f.name](data[f.name]) for f in fields(cls) if f.name in data})


def malformed(path: str | Path, error: Exception) -> PlanFileError:
    return PlanFileError(f"{path} is missing or has a malformed field ({error!r}). {FIX}")
