"""The saved-plan format: ``plan.save(path)`` writes it, ``planner.apply_plan`` reads it.

The file is JSON: a format tag and version, a fingerprint of the captured graph (node names,
targets, edges, output shapes and dtypes), the solver, the regions by fx node names and kinds,
the budget and the predictions, and a checksum over all of it. Applying a plan
(``planning.apply_plan``) re-captures the model and refuses, with a ``PlanFileError``, any file
that is not valid JSON, is from another format version, was edited, or does not fit the captured
graph: a plan never silently yields a different module.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from planner.passes.rewrite import NamedRegion
from planner.solvers.errors import PlanFileError

if TYPE_CHECKING:
    from planner.planning import Plan

FORMAT = "planner-plan"
VERSION = 1


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


def save_plan(plan: Plan, path: str | Path) -> None:
    body = {
        "format": FORMAT,
        "version": VERSION,
        "torch_version": torch.__version__,
        "fingerprint": plan.fingerprint,
        "solver": plan.solver,
        "budget_bytes": plan.budget_bytes,
        "regions": [
            {
                "name": r.name,
                "nodes": list(r.nodes),
                "depth": r.depth,
                "kind": r.kind,
                "saved_nodes": list(r.saved_nodes),
            }
            for r in plan.regions
        ],
        "predictions": {
            "peak_bytes": plan.predicted_peak_bytes,
            "baseline_peak_bytes": plan.baseline_peak_bytes,
            "recompute_flops": plan.predicted_recompute_flops,
        },
    }
    body["checksum"] = _checksum(body)
    Path(path).write_text(json.dumps(body, indent=1) + "\n")


def read_plan_body(path: str | Path) -> dict[str, Any]:
    """Read a plan file and check its format, version and checksum (any form of plan)."""
    fix = "Save the plan again with plan.save(path), or plan anew with planner.plan(...)."
    try:
        body = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanFileError(f"no plan file at {path}") from None
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror}. {fix}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFileError(f"{path} is not valid JSON (truncated or corrupt?): {e}. {fix}") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise PlanFileError(f"{path} is not a planner plan file. {fix}")
    if body.get("version") != VERSION:
        raise PlanFileError(
            f"{path} has plan format version {body.get('version')!r}; this planner reads "
            f"version {VERSION}. {fix}"
        )
    checksum = body.pop("checksum", None)
    if checksum != _checksum(body):
        raise PlanFileError(
            f"{path} was modified after it was saved (its checksum does not match). {fix}"
        )
    return body


def load_plan_file(path: str | Path) -> dict[str, Any]:
    """Read and check a graph plan file's form (not yet its fit to a model)."""
    fix = "Save the plan again with plan.save(path), or plan anew with planner.plan(...)."
    body = read_plan_body(path)
    if body.get("form", "graph") != "graph":
        raise PlanFileError(
            f"{path} holds an in-place plan: apply it with planner.apply_plan(model, path) "
            f"(no example input), or plan with form='graph' for a GraphModule."
        )
    try:
        regions = [
            NamedRegion(
                name=str(r["name"]),
                nodes=tuple(str(n) for n in r["nodes"]),
                depth=int(r["depth"]),
                kind=str(r["kind"]),
                saved_nodes=tuple(str(n) for n in r["saved_nodes"]),
            )
            for r in body["regions"]
        ]
        body["regions"] = regions
        int(body["budget_bytes"]), str(body["solver"]), str(body["fingerprint"])
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFileError(f"{path} is missing or has a malformed field ({e!r}). {fix}") from e
    return body
