"""The op-level policy of an in-place 'selective' region, eager and under torch.compile.

A selective region runs ``create_selective_checkpoint_contexts`` with a :class:`Policy`: each op
of its forward, by position, MUST_SAVE where the plan keeps that (overload, occurrence) and
PREFER_RECOMPUTE otherwise; an op other than the planned one (data-dependent control flow) makes
the rest of the call recompute everything, and the runner warns once (:class:`Planned`, which
``planner/inplace.py``'s region runner is).

AOT autograd's trace names some ops otherwise than eager dispatch (functional for in-place,
``view`` for ``_unsafe_view``, one ``native_dropout`` for eager CPU's four dropout ops):
:class:`TracedDecisions` is a region's plan translated to those names (:func:`traced_ops`), asked
by the same policy while torch.compile traces the region.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from torch.utils.checkpoint import CheckpointPolicy

from planner.plans import Region


class Planned(Protocol):
    """What a policy asks of a region's plan: the ``region`` (its planned ``ops``), the
    ``decisions`` for its positions, whether an op is the planned one at a position, and where
    a divergence is reported."""

    region: Region
    decisions: tuple[CheckpointPolicy, ...]

    def expects(self, i: int, func: Any) -> bool: ...

    def diverged(self, detail: str) -> None: ...


RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


class Policy:
    """One checkpoint call's selective policy: keep or recompute the op at each position of the
    forward, as planned for that position's (overload, occurrence).

    Positions, not (overload, occurrence) keys, at run time: a policy is asked about every op of
    the region, and a list index costs a fraction of building and hashing a key (measured: a
    policy keyed per call made a step 3.5% slower than torch's own list policy on a small
    GPT). The recomputation repeats the forward's decisions position by position (older torch
    asks the policy on both sides; torch >= 2.10 replays the forward's decisions itself), so
    both sides agree even after a divergence."""

    def __init__(self, wrapper: Planned) -> None:
        self.wrapper = wrapper
        self.seen = 0
        self.recomputed = 0
        self.diverged = False
        self.decisions: list[CheckpointPolicy] = []

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:
            i, self.recomputed = self.recomputed, self.recomputed + 1
            return self.decisions[i] if i < len(self.decisions) else RECOMPUTE
        i, self.seen = self.seen, self.seen + 1
        wrapper = self.wrapper
        if not self.diverged and not wrapper.expects(i, func):
            self.diverged = True
            planned = wrapper.region.ops
            wrapper.diverged(
                f"op {i} is {func}, the plan expected "
                + (planned[i] if i < len(planned) else "no more ops")
            )
        decision = RECOMPUTE if self.diverged else wrapper.decisions[i]
        self.decisions.append(decision)
        return decision


# Eager CPU dropout (training) dispatches these four; AOT autograd's trace one native_dropout.
_EAGER_DROPOUT = (
    "aten.empty_like.default",
    "aten.bernoulli_.float",
    "aten.div_.Scalar",
    "aten.mul.Tensor",
)
_NATIVE_DROPOUT = "aten.native_dropout.default"


def traced_name(op: str) -> str:
    """An op's name as AOT autograd's functionalized trace dispatches it."""
    parts = op.split(".")
    if len(parts) == 3:
        name = parts[1]
        if name == "_unsafe_view":
            name = "view"
        elif name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # functionalization: add_ -> add
        parts[1] = name
    return ".".join(parts)


def traced_ops(
    ops: tuple[str, ...], decisions: tuple[CheckpointPolicy, ...]
) -> tuple[tuple[str, ...], tuple[CheckpointPolicy, ...]]:
    """The planned sequence and decisions as AOT autograd's trace sees the region's ops."""
    names, kept = [], []
    i = 0
    while i < len(ops):
        if ops[i : i + len(_EAGER_DROPOUT)] == _EAGER_DROPOUT:
            step = len(_EAGER_DROPOUT)
            names.append(_NATIVE_DROPOUT)
            kept.append(decisions[i + step - 1])  # the dropout's output is the mul's
        else:
            step = 1
            names.append(traced_name(ops[i]))
            kept.append(decisions[i])
        i += step
    return tuple(names), tuple(kept)


class TracedDecisions:
    """A region's planned ops and decisions as AOT autograd's trace sees them (``Policy``
    asks it as it asks the eager wrapper); divergence warns through the wrapper, once."""

    def __init__(self, wrapper: Planned) -> None:
        ops, self.decisions = traced_ops(wrapper.region.ops, wrapper.decisions)
        self.region = replace(wrapper.region, ops=ops)
        self.diverged = wrapper.diverged

    def expects(self, i: int, func: Any) -> bool:
        return i < len(self.region.ops) and traced_name(str(func)) == self.region.ops[i]
