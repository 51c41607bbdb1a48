"""Facts about a captured graph's ops that more than one pass reads, each written once.

- :func:`module_path`: the module a graph node ran in (estimate's ``Node.module_path``, the
  rewrite's region names).
- :func:`written_arguments`: what an aten op writes in place (the estimator's in-place and
  buffer tracking at dispatch, the rewrite's refusal of unsafe in-place writes on fx nodes).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

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
