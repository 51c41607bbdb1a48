"""What a user does by hand, as rows beside the planner's: ``compare(..., anchors=...)``.

- ``every-block``: ``torch.utils.checkpoint`` on every one of the model's repeated blocks (a
  ModuleList's layers, a Sequential's children: ``solvers/blocks.py``), the plan of solver
  ``uniform`` with ``k=1``, applied and measured as any plan is.
- ``hf``: Hugging Face's own ``activation_checkpointing_enable()`` (before 5.x
  ``gradient_checkpointing_enable()``): one region per module it flags (each decoder layer).
  Priced as those regions on the same CostGraph; measured by turning Hugging Face's
  checkpointing itself on for the step (and off again after), so the measured row is what
  Hugging Face runs, not the planner's wrapping of it.

Each anchor is a fixed schedule: its predicted peak does not depend on the budget, so at a
budget below it the row does not fit and names that peak as its least budget.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from planner.hf_checkpointing import hf_flags_on, is_hf_model
from planner.priced import Priced
from planner.solvers.costgraph import Region, Schedule
from planner.solvers.errors import PlannerError, UnsupportedModelError
from planner.solvers.registry import get_solver

ANCHORS = ("every-block", "hf")
_ENABLE = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
_DISABLE = ("activation_checkpointing_disable", "gradient_checkpointing_disable")


@dataclass(frozen=True)
class Anchor:
    """One anchor's schedule on a priced model; ``hf``: measured with Hugging Face's own
    checkpointing on, rather than the plan applied."""

    name: str
    schedule: Schedule
    hf: bool = False


def check_anchors(anchors: Sequence[str], form: str) -> None:
    """ValueError for an unknown anchor name, or ``hf`` asked of a graph-form compare."""
    unknown = [a for a in anchors if a not in ANCHORS]
    if unknown:
        raise ValueError(
            f"unknown anchor(s) {', '.join(map(repr, unknown))}; anchors are "
            f"{', '.join(map(repr, ANCHORS))}"
        )
    if "hf" in anchors and form != "inplace":
        raise ValueError(
            "the 'hf' anchor is Hugging Face's checkpointing of the model's own layers, an "
            "in-place plan: compare it with form='inplace'"
        )


def default_anchors(model: torch.nn.Module, form: str) -> tuple[str, ...]:
    """``every-block`` always; ``hf`` in place for a Hugging Face model that supports it."""
    if form == "inplace" and _hf_supported(model):
        return ANCHORS
    return ("every-block",)


def _hf_supported(model: torch.nn.Module) -> bool:
    return is_hf_model(model) and bool(getattr(model, "supports_gradient_checkpointing", False))


def anchor(name: str, priced: Priced, model: torch.nn.Module) -> Anchor:
    """The schedule of anchor ``name`` on ``priced`` (PlannerError where the model has none:
    no repeated blocks, or no Hugging Face checkpointing)."""
    if name == "every-block":
        schedule = get_solver("uniform")(priced.graph, math.inf, k=1)
        return Anchor(name, Schedule(schedule.regions, name, note="every block checkpointed"))
    if not _hf_supported(model):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no Hugging Face gradient checkpointing "
            f"(supports_gradient_checkpointing); leave 'hf' out of anchors"
        )
    paths = hf_layers(model)
    by_path = {path: span for span, path in priced.eager.spans.items()}  # type: ignore[attr-defined]
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise UnsupportedModelError(
            f"Hugging Face checkpoints {missing[0]!r}, which is no region a plan can price "
            f"({priced.eager.refused.get(missing[0], 'not called once per step')})"  # type: ignore[attr-defined]
        )
    regions = tuple(Region(*by_path[p]) for p in paths)
    return Anchor("hf", Schedule(regions, "hf", note=f"{len(regions)} layers"), hf=True)


def hf_layers(model: torch.nn.Module) -> list[str]:
    """The modules Hugging Face's own enable checkpoints: its flags turned on, read, turned
    off again. A flag on a model class (``LlamaModel``) or on a module holding flagged ones
    (an encoder that, before 5.x, checkpointed its layers itself) marks no region of its own:
    the innermost flagged modules are the regions."""
    with hf_enabled(model):
        flagged = hf_flags_on(model)
    paths = [
        p
        for p in flagged
        if not is_hf_model(model.get_submodule(p))
        and not any(q.startswith(f"{p}.") for q in flagged)
    ]
    if not paths:
        raise UnsupportedModelError(
            f"Hugging Face's checkpointing flags no layer of {type(model).__name__}"
        )
    return paths


class hf_enabled:
    """Hugging Face's own checkpointing on ``model`` for a ``with`` block, off after (left on
    where the user had it on)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.was_on = False

    def _call(self, names: tuple[str, ...], **kw: Any) -> None:
        for name in names:
            if hasattr(type(self.model), name):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the 5.x deprecation of the old names
                    getattr(self.model, name)(**kw)
                return
        raise PlannerError(f"{type(self.model).__name__} has no {names[0]}()")

    def __enter__(self) -> torch.nn.Module:
        self.was_on = bool(hf_flags_on(self.model))
        if not self.was_on:
            self._call(_ENABLE)
        return self.model

    def __exit__(self, *exc: Any) -> None:
        if not self.was_on:
            self._call(_DISABLE)
