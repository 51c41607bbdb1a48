"""Spans of modules' own forwards as candidate regions (``passes/parent_spans.py``): which
modules may offer them (:func:`traceable_parents`), how many each offers within
``MAX_PARENT_SPANS`` (:func:`span_cuts`), and the eager step's candidates with them
(:func:`with_parent_spans`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from planner.passes.candidates import EagerGraph
from planner.passes.eager_tracker import OpTracker, recording_calls
from planner.passes.parent_spans import (
    MAX_SPAN_CUTS,
    NodeOps,
    forward_arity,
    in_order,
    spans_of,
    trace_parent,
    writes_in_place,
)
from planner.passes.regions import SpanPlace
from planner.passes.step import amp_forward
from planner.passes.trace import fake_step
from planner.solvers.cuts import forbidden_cuts


@dataclass(frozen=True)
class Parent:
    """A module whose own forward may hold spans: its traced forward, its call's op interval
    and arguments (``OpTracker.tensor_args``)."""

    gm: fx.GraphModule
    span: tuple[int, int]
    call: tuple[int, tuple[str, ...], list[tuple[Any, ...]]]


def traceable_parents(
    model: torch.nn.Module, calls: dict[str, list[tuple[int, int, bool]]], tracker: OpTracker
) -> tuple[dict[str, Parent], dict[str, str]]:
    """(path -> :class:`Parent`, ``path(..)`` -> why not) of the modules with children and ops
    of their own whose forward may hold spans (``passes/parent_spans.py``): called once per
    step, with grad, passing a tensor to each parameter of its forward (the traced forward
    runs only such calls), traced by fx with its children as leaves, writing no tensor in
    place (a recomputation would read the written value). nn.Sequential's own forward runs
    nothing of its own (its runs are ``candidates._sequential_runs``)."""
    parents: dict[str, Parent] = {}
    why: dict[str, str] = {}
    for path, module in model.named_modules():
        made = calls.get(path, [])
        if len(made) != 1 or next(module.children(), None) is None:
            continue
        start, stop, grad = made[0]
        if not grad or not any(tracker.records[i].module_path == path for i in range(start, stop)):
            continue
        try:
            arity, (call,) = forward_arity(module), tracker.tensor_args[path]
            if call is None or len(call[2]) != arity:
                raise ValueError("it is not called with one tensor for each forward parameter")
            gm = trace_parent(module)
            if (node := writes_in_place(gm)) is not None:
                raise ValueError(f"its node {node} writes a tensor in place")
        except Exception as e:  # noqa: BLE001 - fx's errors are many; a parent offers no spans
            why[SpanPlace(path, "", "").name] = f"no spans of its own forward: {e}"[:300]
            continue
        parents[path] = Parent(gm, (start, stop), call)
    return parents, why


def _parent_node_ops(
    model: torch.nn.Module,
    example_input: Any,
    tracker: OpTracker,
    parents: dict[str, Parent],
    why: dict[str, str],
) -> tuple[dict[str, dict[str, tuple[int, int]]], set[str]]:
    """(parent path -> fx node name -> [start, stop): the priced step's ops each call node of
    the parent's traced forward runs; the parents whose traced forward drops some storage at
    another op than their own forward does).

    Each parent is called alone, under no_grad on fake tensors shaped as its priced call's
    arguments, twice: its own forward, then its traced forward (``parent_spans.NodeOps``).
    Only parents whose two runs dispatch the priced call's ops (names, overloads, output
    shapes) offer spans; the others are noted in ``why``. fx's code drops each value at its
    last use, a module's own code may hold it longer (the U-Net's list of skips)."""
    if not parents:
        return {}, set()
    other = OpTracker(attention=tracker.attention)
    fs = fake_step(model, example_input, other)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    held_otherwise: set[str] = set()

    def key(start: int) -> list[tuple[Any, ...]]:
        return [(r.name, r.op, tuple(r.shapes)) for r in other.records[start:]]

    def deaths(start: int) -> list[int | None]:
        """When Python dropped each storage the run allocated, by op, from its start."""
        return [
            None if (d := other.died_at.get(id(rec))) is None else d - start
            for i in range(start, len(other.records))
            for rec in other.allocated.get(("fwd", i), [])
        ]

    with recording_calls(model, other), fs.running(), torch.no_grad():
        for path, parent in parents.items():
            module = model.get_submodule(path)
            n_args, names, metas = parent.call
            values = [torch.empty_strided(*m[:2], dtype=m[2], device=m[3]) for m in metas]
            args, kwargs = values[:n_args], dict(zip(names, values[n_args:], strict=True))
            runs = []
            try:
                for traced in (False, True):
                    other.counts.clear()
                    start, other.recording = len(other.records), True
                    with amp_forward():
                        if traced:  # its ops named as the module's, as a call of it names them
                            run = NodeOps(module, parent.gm, lambda: len(other.records))
                            other.path_stack.append(path)
                            try:
                                run.run(*in_order(module, args, kwargs))
                            finally:
                                other.path_stack.pop()
                                run.env.clear()  # its output, as a call's, dies now
                        else:
                            module(*args, **kwargs)
                    other.claim_pending()
                    other.recording = False
                    runs.append((start, key(start), deaths(start)))
            except Exception as e:  # noqa: BLE001 - this parent offers no spans
                why[SpanPlace(path, "", "").name] = f"no spans of its own forward: {e!r:.200}"
                continue
            finally:
                other.recording = False
            priced = [(r.name, r.op, tuple(r.shapes)) for r in tracker.records[slice(*parent.span)]]
            if not runs[0][1] == runs[1][1] == priced:
                why[SpanPlace(path, "", "").name] = "its traced forward runs other ops than its own"
                continue
            shift = parent.span[0] - runs[1][0]
            out[path] = {n: (a + shift, b + shift) for n, (a, b) in run.ops.items()}
            if runs[0][2] != runs[1][2]:
                held_otherwise.add(path)
    return out, held_otherwise


# At most this many spans of parents' own forwards in all (dp's time grows fast with candidates:
# a Llama-7B shape of 4 layers offered 483 more, past dp's 60 s limit), outer parents first.
MAX_PARENT_SPANS = 128


def span_cuts(
    model: torch.nn.Module,
    example_input: Any,
    tracker: OpTracker,
    parents: dict[str, Parent],
    refused: dict[str, str],
) -> tuple[list[tuple[str, dict[str, tuple[int, int]], int]], set[str]]:
    """([(path, node ops, cuts)] of each parent to offer spans of, within MAX_PARENT_SPANS;
    those of them whose traced forward drops storages otherwise, ``_parent_node_ops``): level by
    level from the root, every parent of a level at the same most cuts (``spans_of``'s
    ``max_cuts``) the spans left allow, down to 2; the parents left out are noted in
    ``refused``. Node ops are found (a forward of each parent, twice) only for the levels some
    spans are left for: GPT-ref's root takes them all, and running its 36 blocks, attentions
    and MLPs too made a second plan 3.35 s instead of 2.50 s."""
    left = MAX_PARENT_SPANS
    levels: dict[int, list[str]] = defaultdict(list)
    for path in parents:
        levels[path.count(".") + bool(path)].append(path)
    offered, held_otherwise = [], set()
    for depth in sorted(levels):
        paths = levels[depth]
        share = left // len(paths)
        cuts = MAX_SPAN_CUTS
        while cuts >= 2 and cuts * (cuts + 1) // 2 > share:
            cuts -= 1
        if cuts < 2:
            for path in paths:
                refused[SpanPlace(path, "", "").name] = (
                    f"no spans of its own forward: the model's {MAX_PARENT_SPANS} are taken by "
                    f"outer modules"
                )
            continue
        level = {path: parents[path] for path in paths}
        ops, held = _parent_node_ops(model, example_input, tracker, level, refused)
        held_otherwise |= held
        for path, node_ops in ops.items():
            working = sum(b > a for a, b in node_ops.values())
            left -= min(cuts, working) * (min(cuts, working) + 1) // 2
            offered.append((path, node_ops, cuts))
    return offered, held_otherwise


def with_parent_spans(
    model: torch.nn.Module,
    eg: EagerGraph,
    parents: dict[str, Parent],
    offered: list[tuple[str, dict[str, tuple[int, int]], int]],
    written: dict[int, set[str | None]],
    refused: dict[str, str],
) -> EagerGraph:
    """``eg`` with the spans of each parent's own forward (``parent_spans.spans_of``) among its
    candidates, named ``path(first..last)``: those no in-place write crosses, that write only
    buffers of the children they call (BatchNorm statistics: an applied span recomputes on
    copies of them, ``planner/inplace.py``, Rule 9). A span some module call or run already is
    keeps that one's name."""
    forbidden = forbidden_cuts(eg.graph)
    places, state = dict(eg.places), dict(eg.state_buffers)
    for path, ops, cuts in offered:  # (span_cuts)
        parent = model.get_submodule(path)
        prefix = f"{path}." if path else ""
        for first, last, (start, stop), children in spans_of(parents[path].gm, ops, cuts):
            if (start, stop) in places or start in forbidden or stop in forbidden:
                continue
            names = set().union(*(written.get(i, ()) for i in range(start, stop)))
            owned = {
                f"{prefix}{child}.{b}"
                for child in children
                for b, _ in parent.get_submodule(child).named_buffers()
            }
            if not names <= owned:  # state of other modules (or none's: None)
                continue
            place = places[(start, stop)] = SpanPlace(path, first, last)
            if names:
                state[place.name] = tuple(sorted(n[len(prefix) :] for n in names))  # type: ignore[index]
    return replace(
        eg,
        graph=replace(eg.graph, region_spans=frozenset(places)),
        places=places,
        refused={**eg.refused, **refused},
        state_buffers=state,
    )
