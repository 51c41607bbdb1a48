"""An applied in-place plan guards its own memory promise at run time.

- **The planned shape.** A plan knows the input it was priced for (``PlannedShape``: the shape of
  the example input's largest tensor, e.g. ``input_ids`` of batch x tokens). ``p.apply(model)``
  and ``planner.apply_plan(model, path)`` put a forward pre-hook on the model that warns once
  (``OverShapeWarning``) when a call's largest input tensor has a larger batch (its first
  dimension) or more elements per row (tokens, pixels) than planned: memory grows with the
  shape, so such a training call (grad enabled, ``model.training``) may exceed the budget. The
  warning gives both shapes and the predicted peak scaled to the new shape
  (``PlannedShape.predicted_peak_at``, an approximation it names).
  While dynamo traces a whole-model ``torch.compile`` the hook does nothing (a warning there
  would break the graph); per-block compile keeps it.
- **``planner.verify(model, batch)``** runs a real training step of the applied model through
  ``planner.measure`` (the one measurement path: on CUDA the caching allocator's statistics, on
  CPU the live-storage tracker, the profiler's allocation events for a compiled model) and
  returns a ``Verification``: measured and predicted peak bytes and their ratio. It warns
  (``PredictionExceededWarning``) when the measurement exceeds the prediction by more than 1%.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from planner.passes.step import LossFn, split_input
from planner.solvers.costgraph import CostGraph
from planner.solvers.errors import PlannerError, size_text

# measured above predicted by more than this share warns (timing noise does not move bytes, but
# the caching allocator rounds each block up to 512 bytes)
VERIFY_TOLERANCE = 0.01


class OverShapeWarning(UserWarning):
    """A call of an applied plan's model with a larger input than the plan was made for."""


class PredictionExceededWarning(UserWarning):
    """``planner.verify`` measured a peak more than 1% above the plan's prediction."""


@dataclass(frozen=True)
class PlannedShape:
    """The input a plan was priced for, and what its peak is made of, to scale it to others.

    ``shape``: the example input's largest tensor (``input_ids``: batch x tokens); its first
    dimension is the batch, the rest a row. ``fixed_bytes``: parameter gradients, the part of the
    peak no input shape changes. ``attention_share``: of the rest, the share priced as attention
    (nodes tagged ``attention``: their outputs grow with the square of the row length).
    """

    shape: tuple[int, ...]
    predicted_peak_bytes: int
    fixed_bytes: int
    attention_share: float

    @property
    def batch_size(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return _row_numel(self.shape)

    def exceeded_by(self, shape: tuple[int, ...]) -> bool:
        """Whether an input of ``shape`` is larger than planned: more rows or longer ones."""
        batch = shape[0] if shape else 1
        return batch > self.batch_size or _row_numel(shape) > self.row_numel

    def predicted_peak_at(self, shape: tuple[int, ...]) -> int:
        """The peak scaled to an input of ``shape`` (``APPROXIMATION``): activations in proportion
        to batch x row, their attention share once more by the row's growth (quadratic in the
        length). Growing, the whole peak scales, parameter gradients too though they do not grow:
        measured on tiny Llama and GPT-2 at twice the batch, holding them fixed fell 8-13% short
        (what the peak holds besides activations grows too). Shrinking, the gradients stay."""
        batch = shape[0] if shape else 1
        batch_ratio = batch / self.batch_size
        row_ratio = _row_numel(shape) / max(1, self.row_numel)
        share = self.attention_share
        scale = batch_ratio * row_ratio * ((1 - share) + share * row_ratio)
        if scale >= 1:
            return round(self.predicted_peak_bytes * scale)
        return round(self.fixed_bytes + (self.predicted_peak_bytes - self.fixed_bytes) * scale)

    APPROXIMATION = (
        "an estimate: the planned peak scaled by batch x row length, its attention share "
        "({share:.0%}) by the row length once more; not re-simulated"
    )


def _row_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def input_shape(example_input: Any) -> tuple[int, ...] | None:
    """The shape of the input's largest tensor (the first of equal ones), or None without any."""
    args, kwargs = split_input(example_input)
    return _largest_shape((args, kwargs))


def _largest_shape(tree: Any) -> tuple[int, ...] | None:
    best: torch.Tensor | None = None
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and (best is None or t.numel() > best.numel()):
            best = t
    return None if best is None else tuple(best.shape)


def planned_shape(example_input: Any, graph: CostGraph, peak_bytes: int) -> PlannedShape | None:
    """What a plan records of its example input (None when it has no tensor)."""
    shape = input_shape(example_input)
    if shape is None:
        return None
    produced = [0] * len(graph.nodes)
    for t in graph.tensors:
        if 0 <= t.producer < len(produced):
            produced[t.producer] += t.size_bytes
    total = sum(produced)
    attention = sum(b for n, b in zip(graph.nodes, produced) if "attention" in n.tags)
    return PlannedShape(
        shape=shape,
        predicted_peak_bytes=peak_bytes,
        fixed_bytes=min(peak_bytes, sum(n.param_grad_bytes for n in graph.nodes)),
        attention_share=attention / total if total else 0.0,
    )


# --------------------------------------------------------------------------- the hook


class ShapeGuard:
    """A forward pre-hook on the applied model's root: warns once on a larger input than
    planned. Found again (``guard_of``, ``remove_guard``) by its type among the model's hooks,
    so a deep copy of the model carries a working guard of its own."""

    def __init__(self, shape: PlannedShape, budget_bytes: int) -> None:
        self.shape = shape
        self.budget_bytes = budget_bytes
        self.warned = False

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling() or self.warned:
            return None
        if not (torch.is_grad_enabled() and module.training):
            return None  # evaluation and generation keep no activations for backward
        shape = _largest_shape((args, kwargs))
        if shape is None or not self.shape.exceeded_by(shape):
            return None
        self.warned = True
        warnings.warn(over_shape_message(self.shape, shape, self.budget_bytes), OverShapeWarning, 3)
        return None


def over_shape_message(planned: PlannedShape, shape: tuple[int, ...], budget_bytes: int) -> str:
    at_bytes = planned.predicted_peak_at(shape)
    how = PlannedShape.APPROXIMATION.format(share=planned.attention_share)
    return (
        f"planner: this model's plan was made for an input of shape {planned.shape} (batch "
        f"{planned.batch_size}, {planned.row_numel} per row), it was called with {shape} (batch "
        f"{shape[0] if shape else 1}, {_row_numel(shape)} per row). Predicted peak at this shape "
        f"about {at_bytes:,} bytes ({size_text(at_bytes)}) against "
        f"{planned.predicted_peak_bytes:,} bytes planned and a budget of {budget_bytes:,} bytes "
        f"({how}). Plan at the largest shape "
        f"you train, or measure it with planner.verify(model, batch). This warning is given once."
    )


def install_guard(model: torch.nn.Module, shape: PlannedShape | None, budget_bytes: int) -> None:
    remove_guard(model)
    if shape is not None:
        model.register_forward_pre_hook(ShapeGuard(shape, budget_bytes), with_kwargs=True)


def guard_of(model: torch.nn.Module) -> ShapeGuard | None:
    """The guard an applied plan put on ``model`` (or on the module a compiled one wraps)."""
    model = getattr(model, "_orig_mod", model)
    for hook in model._forward_pre_hooks.values():
        if isinstance(hook, ShapeGuard):
            return hook
    return None


def remove_guard(model: torch.nn.Module) -> None:
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, ShapeGuard):
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class Verification:
    """One measured training step of an applied plan against its prediction (bytes above the
    step's starting baseline, DESIGN.md). ``predicted_peak_bytes`` is at this batch's shape:
    the plan's own prediction at the planned shape, scaled (``PlannedShape.predicted_peak_at``)
    at another."""

    measured_peak_bytes: int
    predicted_peak_bytes: int
    ratio: float  # measured / predicted
    shape: tuple[int, ...]
    planned_shape: tuple[int, ...]
    method: str  # how planner.measure saw memory: "cuda", "tracker" or "profiler"

    @property
    def ok(self) -> bool:
        """Measured within 1% above the prediction (or below it)."""
        return self.ratio <= 1 + VERIFY_TOLERANCE


def verify(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    warmup: int | None = None,
) -> Verification:
    """Run one real training step of an applied model on ``batch`` and compare its measured peak
    with the plan's prediction; warns (``PredictionExceededWarning``) when the measurement is
    more than 1% above it.

    ``model``: a model an in-place plan was applied to (``p.apply``, ``planner.apply_plan``),
    or ``torch.compile`` of one. ``batch`` and ``loss_fn`` as ``planner.measure`` takes them.
    ``warmup``: untracked steps first (default: none for an eager model, one for a compiled one,
    so that compiling does not land in the measured step). Parameter gradients, buffers and the
    RNG state are given back as they were (``planner.measure``).
    """
    from planner.measurement import _is_compiled, measure

    guard = guard_of(model)
    if guard is None:
        raise PlannerError(
            f"planner.verify needs a model with an applied in-place plan; this "
            f"{type(model).__name__} has none. Apply one with p.apply(model) or "
            f"planner.apply_plan(model, path) (a plan file saved before plans recorded their "
            f"shape: save the plan again)."
        )
    shape = input_shape(batch)
    if shape is None:
        raise PlannerError("planner.verify needs a batch with at least one tensor")
    if warmup is None:
        warmup = 1 if _is_compiled(model) else 0
    measured = measure(model, batch, loss_fn, warmup=warmup)
    predicted = guard.shape.predicted_peak_at(shape)
    ratio = measured.peak_bytes / predicted if predicted else float("inf")
    result = Verification(
        measured_peak_bytes=measured.peak_bytes,
        predicted_peak_bytes=predicted,
        ratio=ratio,
        shape=shape,
        planned_shape=guard.shape.shape,
        method=measured.method,
    )
    if not result.ok:
        planned = guard.shape.shape
        at = "" if shape == planned else f" (scaled from the planned shape {planned})"
        warnings.warn(
            f"planner.verify: the measured peak, {measured.peak_bytes:,} bytes, is "
            f"{ratio - 1:.1%} above the predicted {predicted:,} bytes{at} for a batch of shape "
            f"{shape} ({measured.method}). The plan may not keep its budget of "
            f"{guard.budget_bytes:,} bytes: plan again with a lower mem_budget_gb, and please "
            f"report the model.",
            PredictionExceededWarning,
            stacklevel=2,
        )
    return result
