"""The module a graph region runs as: :class:`CheckpointRegion`, what ``passes/rewrite.py``
puts in the place of each region's nodes.

It runs its body (a GraphModule of the region's nodes) under non-reentrant
``torch.utils.checkpoint.checkpoint``; a 'selective' region with an op-level policy that keeps
the outputs of the ops run through :func:`save_output` (the rewrite wraps the region's
``saved_nodes`` in it), an 'offload' region through ``passes/offload.py``. State the step writes
(BatchNorm running statistics) is recomputed on copies of its pre-step values, so the buffers
are updated once and the recomputed outputs are the same bits.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.passes.offload import offloaded_call

_save_state = threading.local()
_SAVE_ANNOTATION = "planner_save_output"


def save_output(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``op``; inside a selective region its outputs are kept for backward, not recomputed."""
    if torch.compiler.is_compiling():
        # Under torch.compile the policy runs later, while AOT autograd replays dynamo's graph
        # node by node; a counter set here at trace time is gone by then. An fx annotation is
        # recorded on the op's node, and the replay makes it the current meta again.
        with fx_traceback.annotate({_SAVE_ANNOTATION: True}):
            return op(*args, **kwargs)
    _save_state.depth = getattr(_save_state, "depth", 0) + 1
    try:
        return op(*args, **kwargs)
    finally:
        _save_state.depth -= 1


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # A saved op may decompose into views of its inputs (matmul expands and reshapes them);
    # caching those views would keep the inputs' storages, e.g. an S x S softmax, alive.
    if getattr(op, "is_view", False):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if getattr(_save_state, "depth", 0) or _annotated_save():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _annotated_save() -> bool:
    """True while torch.compile replays an op that ``save_output`` annotated."""
    return bool(fx_traceback.current_meta.get("custom", {}).get(_SAVE_ANNOTATION))


@contextlib.contextmanager
def outside_selective_checkpointing() -> Iterator[None]:
    """Without selective checkpointing's dispatch modes (on top of the stack while a selective
    region runs), which would count the ops run here as the region's and try to replay them;
    other modes (a memory tracker's) still see them."""
    popped = []
    sac_modes = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
    while (stack := _get_current_dispatch_mode_stack()) and isinstance(stack[-1], sac_modes):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


class CheckpointRegion(nn.Module):
    """Runs ``body`` (a GraphModule of the region's nodes) under one checkpoint, or, for an
    offload region, through ``offloaded_call`` (``passes/offload.py``, as the in-place form),
    which keeps the arguments (parameters among them) and the buffers and parameters of leaf
    modules ``body`` calls on the device.

    ``body`` is kept out of the module tree on purpose: it holds no parameters of its own, and
    leaf modules it calls (symbolic_trace graphs) are already registered in the parent, so
    ``state_dict()``, ``parameters()`` and ``.to()`` see the model exactly as before.

    ``state_inputs``: argument positions holding buffers the step writes (BatchNorm running
    statistics...); ``state_buffers``: such buffers of leaf modules called inside ``body``.
    ``preserve_rng_state``: checkpoint's own (``Region.preserve_rng_state``).
    """

    def __init__(
        self,
        body: fx.GraphModule,
        kind: str = "recompute",
        state_inputs: tuple[int, ...] = (),
        state_buffers: tuple[str, ...] = (),
        preserve_rng_state: bool = True,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        self.kind = kind
        self.state_inputs = state_inputs
        self.state_buffers = state_buffers
        self.preserve_rng_state = preserve_rng_state

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"

    def forward(self, *args: Any) -> Any:
        body = self.body
        if not torch.is_grad_enabled():
            return body(*args)
        if self.kind == "offload":
            # as the in-place form runs it: only what the body makes goes to host (Rule 7)
            return offloaded_call(body, body, *args)
        # body.forward, not body: checkpoint stops each recomputation early by raising through
        # the body, and GraphModule.__call__ extracts a traceback from every exception that
        # passes (file stats per frame): 0.05-0.1 ms per region and step on a CPU
        fn, args = (
            self._once(args) if self.state_inputs or self.state_buffers else (body.forward, args)
        )
        if self.kind == "selective":
            return checkpoint(
                fn,
                *args,
                use_reentrant=False,
                preserve_rng_state=self.preserve_rng_state,
                context_fn=functools.partial(
                    create_selective_checkpoint_contexts, _selective_policy
                ),
            )
        return checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state
        )

    def _once(self, args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The body, but every call after the first runs on copies of the pre-step state.

        State inputs are kept out of checkpoint's own arguments: checkpoint saves its
        arguments for backward, and the in-place update would then fail its version check.
        """
        body = self.body
        state = {i: args[i] for i in self.state_inputs}
        before_args = {i: a.detach().clone() for i, a in state.items()}
        before_bufs = {k: body.get_buffer(k).detach().clone() for k in self.state_buffers}
        rest = tuple(a for i, a in enumerate(args) if i not in state)
        # Only the count: the closure lives as long as the checkpoint, and holding ``args``
        # would keep every activation argument alive with it.
        n_args = len(args)
        calls = 0

        def merged(values: dict[int, Any], a: tuple[Any, ...]) -> tuple[Any, ...]:
            it = iter(a)
            return tuple(values[i] if i in values else next(it) for i in range(n_args))

        def run(*a: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return body.forward(*merged(state, a))
            # Bookkeeping copies, not ops of the region (simulate's Rule 9 counts them).
            with outside_selective_checkpointing():
                full = merged({i: v.clone() for i, v in before_args.items()}, a)
                fresh = {k: v.clone() for k, v in before_bufs.items()}
            if not before_bufs:
                return body.forward(*full)
            return torch.func.functional_call(body, fresh, full, strict=False)

        return run, rest
