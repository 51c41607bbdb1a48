"""Facts about a captured graph's ops that more than one pass reads, each written once.

- :func:`module_path`: the module a graph node ran in (estimate's ``Node.module_path``, the
  rewrite's region names).
- :func:`written_arguments`: what an aten op writes in place (the estimator's in-place and
  buffer tracking at dispatch, the rewrite's refusal of unsafe in-place writes on fx nodes).
- :func:`written_nodes`, :func:`storage_bases`: what an fx node writes in place and whose
  storage each node's output shares (the rewrite's refusals, a parent's traced forward in
  ``passes/parent_spans.py``).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

# The fx node kinds that run code: what a region holds.
CALL_OPS = ("call_function", "call_method", "call_module")

# Arguments native_batch_norm (and instance_norm, which calls it) updates in training mode
# although its schema does not mark them (a!); the flag that says whether it is training.
RUNNING_STATS = ("running_mean", "running_var")
TRAINING_FLAGS = ("training", "use_input_stats")


def module_path(node: fx.Node) -> str | None:
    """Dotted path of the deepest module a node ran in ('' = the root), None when unknown."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        if not isinstance(path, str):
            return None
        # dynamo style paths: "L['self'].blocks[0].attn" -> "blocks.0.attn"
        path = re.sub(r"^L\['self'\]\.?", "", path)
        return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).strip(".")
    if node.op == "call_module":
        return str(node.target)
    return None


def written_arguments(
    schema: torch.FunctionSchema, value_of: Callable[[int, str], Any]
) -> list[Any]:
    """The values of the arguments an op writes in place.

    Those its schema marks ``Tensor(a!)`` (``relu_``, ``add_``, ``out=``...), and the running
    statistics of a batch norm unless its training flag is False. ``value_of(position, name)``
    returns an argument's value as the caller sees it (a tensor at dispatch, an fx node in a
    graph).
    """
    arguments = schema.arguments
    written = []
    for k, a in enumerate(arguments):
        write = a.alias_info is not None and a.alias_info.is_write
        if not write and a.name in RUNNING_STATS:
            # looked up only here: the estimator calls this for every op of the forward
            training = next(
                (value_of(j, b.name) for j, b in enumerate(arguments) if b.name in TRAINING_FLAGS),
                True,
            )
            write = training is not False
        if write:
            written.append(value_of(k, a.name))
    return written


# --------------------------------------------------------------------------- aliasing, writes

_VIEW_NAMES = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "expand",
    "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "narrow", "select", "split",
    "chunk", "unbind", "as_strided", "detach", "diagonal", "movedim", "swapaxes", "contiguous",
    "__getitem__", "getitem", "real", "imag", "view_as_real", "view_as_complex", "alias",
}  # fmt: skip
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.setitem,
}  # fmt: skip


def target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", str(t))


def _arg_value(node: fx.Node, i: int, name: str) -> Any:
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _first_node(val: Any) -> fx.Node | None:
    nodes = _nodes_in(val)
    return nodes[0] if nodes else None


def _nodes_in(val: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(val, out.append)
    return out


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The node whose storage ``node``'s output may alias (views, in-place results)."""
    if node.op not in CALL_OPS:
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        sets = [r.alias_info.before_set for r in t._schema.returns if r.alias_info is not None]
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and any(a.alias_info.before_set & s for s in sets):
                return _first_node(_arg_value(node, i, a.name))
        return None
    name = target_name(node)
    if node.op == "call_module":
        return None
    if (
        name in _VIEW_NAMES
        or t in _INPLACE_OPERATORS
        or (name.endswith("_") and not name.startswith("_"))
    ):
        return _first_node(node.args[:1])
    return None


def written_nodes(node: fx.Node, modules: dict[str, nn.Module]) -> list[fx.Node]:
    """Nodes whose storage ``node`` writes in place: aten ops by ``nodes.written_arguments``;
    in symbolic_trace graphs, ``inplace=True`` modules and calls, ``x.add_(...)``, ``x += y``."""
    if node.op not in CALL_OPS:
        return []
    t = node.target
    if isinstance(t, torch._ops.OpOverload):

        def value_of(i: int, name: str) -> Any:
            return _arg_value(node, i, name)

        return [w for value in written_arguments(t._schema, value_of) for w in _nodes_in(value)]
    if node.op == "call_module":
        mod = modules.get(str(t))
        return _nodes_in(node.args[:1]) if getattr(mod, "inplace", False) is True else []
    name = target_name(node)
    if (
        t in _INPLACE_OPERATORS
        or node.kwargs.get("inplace") is True
        or (name.endswith("_") and not name.startswith("_"))
    ):
        return _nodes_in(node.args[:1])
    return []


def storage_bases(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    base: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        src = _alias_source(n)
        base[n] = base.get(src, src) if src is not None else n
    return base
