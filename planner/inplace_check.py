"""Whether a model is the one an in-place plan was made for (``planner.apply_plan``'s check).

A plan file names regions by module path; applied to another model they would wrap other code,
or nothing. :func:`check_fits` compares the model with what the plan recorded of the one it was
made for (its class, module tree, parameter shapes: :func:`module_tree`,
:func:`parameter_shapes`) and each region's place with the model's modules, and raises a
``PlanFileError`` naming the first difference and the fix.
"""

from __future__ import annotations

import torch

from planner.passes.parent_spans import node_labels, trace_parent
from planner.passes.regions import RunPlace, SpanPlace, place_of
from planner.plans import Region
from planner.solvers.errors import PlanFileError


def module_tree(model: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """(path, class name) of every module of ``model``, in ``named_modules`` order."""
    return tuple((path, type(m).__name__) for path, m in model.named_modules())


def parameter_shapes(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of ``model``."""
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def check_fits(
    model: torch.nn.Module,
    model_class: str,
    tree: tuple[tuple[str, str], ...],
    regions: tuple[Region, ...],
    source: str,
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = (),
    traced_forwards: tuple[str, ...] = (),
) -> None:
    """PlanFileError naming the first way ``model`` differs from the one ``source`` was made
    for: its class, a region's module path or class (a span's nodes), a module that runs its
    traced forward (``traced_forwards``), any module of the tree, then the first parameter
    whose shape differs (``shapes``; empty: not checked)."""
    fix = "Plan this model with planner.plan(..., form='inplace') and save that plan."
    if type(model).__name__ != model_class:
        raise PlanFileError(
            f"{source} was made for a {model_class}, this model is a {type(model).__name__}. {fix}"
        )
    types = dict(tree)
    for r in regions:
        place = place_of(r)
        path = place.path
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise PlanFileError(
                f"{source} checkpoints module {path!r}, which this model does not have. {fix}"
            ) from None
        if type(module).__name__ != types.get(path):
            raise PlanFileError(
                f"{source} checkpoints {path!r} as a {types.get(path)}, in this model it is "
                f"a {type(module).__name__}. {fix}"
            )
        if isinstance(place, RunPlace) and not (
            isinstance(module, torch.nn.Sequential) and place.stop <= len(module)
        ):
            raise PlanFileError(
                f"{source} checkpoints children {place.start} to {place.stop - 1} of "
                f"{path!r} as one call, which needs an nn.Sequential of at least "
                f"{place.stop} children. {fix}"
            )
        if isinstance(place, SpanPlace):
            _check_span(module, place, source, fix)
    for path in traced_forwards:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise PlanFileError(
                f"{source} runs the traced forward of module {path!r}, which this model does "
                f"not have. {fix}"
            ) from None
        _check_span(module, SpanPlace(path, "", ""), source, fix)
    ours = module_tree(model)
    for (path, kind), (their_path, their_kind) in zip(tree, ours):
        if (path, kind) != (their_path, their_kind):
            raise PlanFileError(
                f"{source}'s module tree differs from this model's: {path!r} ({kind}) there, "
                f"{their_path!r} ({their_kind}) here. {fix}"
            )
    if len(tree) != len(ours):
        raise PlanFileError(
            f"{source}'s module tree has {len(tree)} modules, this model {len(ours)}. {fix}"
        )
    if shapes:
        _check_shapes(model, shapes, source, fix)


def _check_span(module: torch.nn.Module, span: SpanPlace, source: str, fix: str) -> None:
    """PlanFileError unless ``module``'s forward traces (``passes/parent_spans.py``) to a graph
    in which the span's first node is no later than its last."""
    path, first, last = span.path, span.first, span.last
    try:
        order = node_labels(trace_parent(module))
    except Exception as e:  # noqa: BLE001 - whatever fx raises
        raise PlanFileError(
            f"{source} runs {path!r}'s own forward as torch.fx traces it, which fx cannot "
            f"trace here ({type(e).__name__}: {e}). {fix}"
        ) from None
    if not first:  # a traced forward without a span of its own
        return
    for node in (first, last):
        if node not in order:
            raise PlanFileError(
                f"{source} checkpoints {path!r}'s forward from node {first!r} to {last!r}; its "
                f"traced forward has no node {node!r}. {fix}"
            )
    if order.index(first) > order.index(last):
        raise PlanFileError(
            f"{source} checkpoints {path!r}'s forward from node {first!r} to {last!r}, which "
            f"comes before it. {fix}"
        )


def _check_shapes(
    model: torch.nn.Module, shapes: tuple[tuple[str, tuple[int, ...]], ...], source: str, fix: str
) -> None:
    # The same module tree at another width prices other bytes: the plan would not hold.
    ours = dict(parameter_shapes(model))
    for name, shape in shapes:
        here = ours.pop(name, None)
        if here != shape:
            this = "does not have it" if here is None else f"has {list(here)}"
            raise PlanFileError(
                f"{source} was made for parameter {name!r} of shape {list(shape)}, this model "
                f"{this}. {fix}"
            )
    if ours:
        name = next(iter(ours))
        raise PlanFileError(f"{source} was made for a model without parameter {name!r}. {fix}")
