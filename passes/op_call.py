"""An aten call as a timing sees it: the op and its arguments, tensors reduced to shape, stride
and dtype (:class:`OpCall`, hashable: what a timing is cached and stored by), and the same call
rebuilt on real tensors of random values to be timed (:func:`real_arguments`).

``passes/trace.py`` records one per aten call of the step's fake run; ``passes/op_timing.py``
times them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class OpCall:
    """One aten call with its tensors reduced to :class:`TensorSpec` (hashable: the cache key)."""

    op: Any  # torch._ops.OpOverload
    leaves: tuple[Any, ...]
    spec: TreeSpec  # how to rebuild (args, kwargs) from the leaves

    @cached_property
    def key(self) -> tuple[str, str, tuple[Any, ...]]:
        """Calls with equal keys share one timing. Cached: a long unrolled graph asks for the
        keys of tens of thousands of calls, and a TreeSpec's text is slow to build."""
        if getattr(self.op, "is_view", False):
            # A view only writes metadata, so its integer arguments (select's index, a slice's
            # bounds) do not change its time: a scan unrolled over the sequence selects at every
            # position, and those calls share one timing instead of one each.
            tensors = tuple(x for x in self.leaves if isinstance(x, TensorSpec))
            return (str(self.op), "view", tensors)
        return (str(self.op), str(self.spec), self.leaves)

    @cached_property
    def key_text(self) -> str:
        """:attr:`key` as text, the same in every process: how a calibration stores the call."""
        return repr(self.key)


# Calls whose time does not depend on the position they write, and that position's argument:
# the backward of a scan unrolled over the sequence takes select_backward at every position
# (Mamba-128: 257 of the 536 distinct calls), timed once at position 0 instead of once each.
_POSITION_ARGUMENT = {torch.ops.aten.select_backward.default: 3}


def op_call(
    op: Any, args: tuple, kwargs: dict, flat: tuple[list[Any], TreeSpec] | None = None
) -> OpCall | None:
    """The call of ``op`` on these (fake) arguments; None when one cannot be rebuilt.

    ``flat``: ``tree_flatten((args, kwargs))`` when the caller has it already.
    """
    k = _POSITION_ARGUMENT.get(op)
    if k is not None and k < len(args) and isinstance(args[k], int):
        args, flat = (*args[:k], 0, *args[k + 1 :]), None
    leaves, spec = tree_flatten((args, kwargs)) if flat is None else flat
    out: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype))
        elif x is None or isinstance(
            x, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
        ):
            out.append(x)
        else:
            return None  # a generator, a symbolic size...: price it by the roofline
    return OpCall(op, tuple(out), spec)


def _real(x: Any, device: torch.device, generator: torch.Generator) -> Any:
    if not isinstance(x, TensorSpec):
        return x if not isinstance(x, torch.device) else device
    size = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride)) if all(x.shape) else 0
    if x.dtype.is_floating_point or x.dtype.is_complex:
        flat = _random_floats(size, generator).to(device=device, dtype=x.dtype)
    elif x.dtype == torch.bool:
        # Half False then half True: masks in models (causal, padding) come in long runs that
        # a kernel's branches predict; random bits priced GPT-ref's causal masked_fill at 2.7
        # times its time in the step.
        flat = torch.arange(size, device=device) >= size // 2
    else:
        flat = torch.zeros(size, dtype=x.dtype, device=device)  # valid indices, class 0
    return flat.as_strided(x.shape, x.stride)


# Random values beyond this many are the first ones repeated: a kernel's time does not depend
# on which values it reads, and drawing a large batch's inputs one normal at a time took
# longer than timing the calls themselves.
RANDOM_BLOCK = 1 << 16


def _random_floats(size: int, generator: torch.Generator) -> torch.Tensor:
    block = torch.randn(min(size, RANDOM_BLOCK), generator=generator)
    if size <= RANDOM_BLOCK:
        return block
    return block.repeat(-(-size // RANDOM_BLOCK))[:size]


def real_arguments(call: OpCall, device: torch.device) -> tuple[Any, Any]:
    """``call``'s arguments as real tensors on ``device``, random values (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    leaves = [_real(x, device, generator) for x in call.leaves]
    return tree_unflatten(leaves, call.spec)
