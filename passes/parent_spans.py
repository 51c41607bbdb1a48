"""Parent spans: in-place regions over a stretch of one module's own forward, its own ops and
its children's calls together (the U-Net's ``cat``s and max-pools between its child calls).

In: a module whose ``forward`` takes tensors only and that ``torch.fx`` traces with every
submodule a leaf (:func:`trace_parent`). Out: the aten-op interval of the eager step each of its
call nodes ran (:class:`NodeOps`, run by ``passes/eager.py`` in its no-grad run), and the
candidate spans over them (:func:`spans_of`), each at a ``regions.SpanPlace``: the parent's path
and the labels of its first and last fx call nodes (:func:`node_labels`), named
``path(first..last)``.

Applied (``planner/inplace.py``), the parent's forward runs the traced graph as
``passes/rewrite.py`` rewrites it for the planned spans (each one ``CheckpointRegion``); its
call nodes reach the module's own children, so module regions nested in a span still run.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from planner.passes.nodes import CALL_OPS, written_nodes

# A parent's spans start and end at most this many places, every k-th node that runs ops (as
# candidates.MAX_RUN_CUTS for runs): dp's time grows fast with spans. unet_example()'s root, 19 such
# nodes: every node, 188 candidates, dp's least 19 s; every other (16), 90, 8.7 s, the same least;
# 8, 67, 3.0 s, 4.4% higher.
MAX_SPAN_CUTS = 16


def node_labels(gm: fx.GraphModule) -> list[str]:
    """What a span's place (``regions.SpanPlace``: ``(max_pool2d..down.0)`` at the root,
    ``blocks.0.mlp(fc..proj)``) calls each call node of ``gm``, in order: a child's call by the
    child's path (relative to the parent) where it is called once, any other node by its fx
    name."""
    order = call_nodes(gm)
    called = Counter(str(n.target) for n in order if n.op == "call_module")
    labels = [
        str(n.target) if n.op == "call_module" and called[str(n.target)] == 1 else n.name
        for n in order
    ]
    return labels if len(set(labels)) == len(labels) else [n.name for n in order]


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True  # the parent's own ops only: every child stays one call


def forward_arity(module: torch.nn.Module) -> int:
    """How many parameters ``module``'s forward takes; ValueError for ``*args``/``**kwargs``."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise ValueError("its forward takes *args or **kwargs")
    return len(params)


def in_order(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """A call's arguments in the order of ``module``'s forward parameters (its traced graph's
    placeholders)."""
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    return list(bound.arguments.values())[1:]


def trace_parent(module: torch.nn.Module) -> fx.GraphModule:
    """``module``'s own forward as an fx graph, every submodule one ``call_module`` node.

    Deterministic (the same class gives the same node names: the plan file names nodes). Raises
    what fx raises when it cannot trace it (control flow on values, ...)."""
    forward_arity(module)
    graph = _LeafTracer().trace(module)
    return fx.GraphModule(module, graph, class_name=type(module).__name__)


def call_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a region may hold, in order (as ``passes/rewrite.py`` orders them)."""
    return [n for n in gm.graph.nodes if n.op in CALL_OPS]


def writes_in_place(gm: fx.GraphModule) -> str | None:
    """The first call node of ``gm`` that writes a tensor in place, or None."""
    modules = dict(gm.named_modules())
    return next((n.name for n in call_nodes(gm) if written_nodes(n, modules)), None)


class NodeOps(fx.Interpreter):
    """Runs a traced parent graph on the live module (its attributes as they are when run: the
    fake state while pricing), noting ``count()`` (ops dispatched so far) before and after each
    call node in ``ops``: node name -> [start, stop)."""

    def __init__(self, module: torch.nn.Module, gm: fx.GraphModule, count: Callable[[], int]):
        super().__init__(module, graph=gm.graph)
        self.count = count
        self.ops: dict[str, tuple[int, int]] = {}

    def run_node(self, n: fx.Node) -> Any:
        start = self.count()
        out = super().run_node(n)
        if n.op in CALL_OPS:
            self.ops[n.name] = (start, self.count())
        return out


def spans_of(
    gm: fx.GraphModule, ops: dict[str, tuple[int, int]], max_cuts: int = MAX_SPAN_CUTS
) -> Iterator[tuple[str, str, tuple[int, int], list[str]]]:
    """(first node's label, last node's, op interval, child module targets called) of every
    candidate
    span of the parent traced as ``gm`` whose call nodes ran ops ``ops``: from a node that
    runs ops to a later one (or the same, unless it is a child's call, that child's region),
    not all of the parent (the parent's own region). Spans start and end at most ``max_cuts``
    places (every k-th node that runs ops)."""
    order, labels = call_nodes(gm), node_labels(gm)
    working = [k for k, n in enumerate(order) if ops[n.name][1] > ops[n.name][0]]
    stride = -(-len(working) // max_cuts)
    cuts = working[::stride]
    ends = sorted({*working[stride - 1 :: stride], working[-1]}) if working else []
    for a in cuts:
        for b in ends:
            if b < a or (a, b) == (working[0], working[-1]):
                continue
            if a == b and order[a].op == "call_module":
                continue
            nodes = order[a : b + 1]
            children = [str(n.target) for n in nodes if n.op == "call_module"]
            interval = (ops[order[a].name][0], ops[order[b].name][1])
            yield labels[a], labels[b], interval, children
