"""The tracker of an eager step (``passes/eager.py``): one record per aten op of the forward and
loss, and the module calls that ran them.

:class:`OpTracker` is ``passes/trace.py``'s tracker opening a record per aten op, named
``<module path>:<op>:<k>``; an op's grad_fn is attached after it returns from dispatch, so the
previous ops' outputs are claimed as the next op starts. :func:`recording_calls` wraps every
submodule's ``forward`` for a run (an instance attribute, removed afterwards), so a module call
is exactly the ops its forward ran; :func:`read_by_calls` charges a call's tensor arguments to
it as read.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

from planner.passes.attention_kernels import TargetAttention
from planner.passes.forward_wrapper import ForwardWrapper
from planner.passes.trace import OpRecord, Tracker, is_tensor
from planner.solvers.errors import PricingTimeLimitError


class OpTracker(Tracker):
    """The tracker, opening one record per aten op of the forward and loss."""

    def __init__(
        self, record_calls: bool = False, attention: TargetAttention | None = None
    ) -> None:
        super().__init__(record_calls)
        self.recording = False
        # the target device's attention kernels, where the plan is for another device than the
        # model's (``passes/attention_kernels.py``); every run of the model prices them alike
        self.attention = attention
        self.cuda_blocks = attention is not None and attention.target.kernels == "cuda"
        self.deadline = math.inf  # time.monotonic() past which tracing stops (eager_graph)
        self.path_stack: list[str] = []
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        # (node, its outputs as (weak reference, version when made)) whose grad_fns are unclaimed
        self.pending: list[tuple[int, list[tuple[weakref.ref, int]]]] = []
        self.failed_in: str | None = None  # the innermost module a failing forward ran
        # (start, stop, storage records) of each module call: the tensors it was passed
        self.call_args: list[tuple[int, int, list[Any]]] = []
        self.aliased_args: set[str] = set()  # modules called with one tensor in two arguments
        # module path -> per call, its arguments when they are all tensors (else None): how many
        # positional, the keywords, each tensor's (shape, stride, dtype, device). A parent's
        # spans run its traced forward, offered only for such calls
        # (``parent_candidates._parent_node_ops``)
        self.tensor_args: dict[str, list[Any]] = defaultdict(list)

    def _free(self, key: int, rec: Any) -> None:
        if self.recording and self.phase == "fwd":
            self.died_at[id(rec)] = self.node  # Python, not the last reader, freed it
        super()._free(key, rec)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.internal or not self.recording or self.phase != "fwd":
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func in SAC_IGNORED_OPS:  # metadata queries and detach: no op of the model's
            return func(*args, **(kwargs or {}))
        if time.monotonic() > self.deadline:
            raise PricingTimeLimitError(self.path_stack[-1] if self.path_stack else None)
        self.claim_pending()
        i = len(self.records)
        path = self.path_stack[-1] if self.path_stack else None
        # outside the model: the loss, its ops nodes of their own (``step:...``), which no
        # region holds (regions are module calls); the graph form, whose every node may be in
        # a region, charges them to its last node instead (``estimate._charged_to``)
        prefix = ("model" if path == "" else path) if path is not None else "step"
        short = func._overloadpacket.__name__
        name = f"{prefix}:{short}:{self.counts[(prefix, short)]}"
        self.counts[(prefix, short)] += 1
        record = OpRecord(name=name, op=str(func), module_path=path or "", inputs=set())
        self.records.append(record)
        read, producers, seg = self.enter_node(i, (args, kwargs))
        record.inputs = producers - {i}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        outs = self.exit_node(record, read, seg, out)
        # autograd attaches the grad_fn after dispatch returns: claimed as the next op starts
        self.pending.append((i, [(weakref.ref(t), t._version) for t in outs]))
        return out

    def claim_pending(self) -> None:
        """Map the grad_fns autograd attached to earlier ops' outputs to those ops.

        A view written in place since it was made is left to the op that wrote it: autograd
        may be rebasing its history right now, and its ``grad_fn`` read then replays the view
        under the lock autograd holds (DeepSeek-V3's ``key_states[..., :n].copy_(...)``
        deadlocked here). Ops dispatched while claiming are the tracker's own, not the model's."""
        pending, self.pending = self.pending, []
        self.internal += 1
        try:
            for i, refs in pending:
                alive = [(t, made) for ref, made in refs if (t := ref()) is not None]
                self.claim([t for t, made in alive if not _rebased_view(t, made)], i)
        finally:
            self.internal -= 1


def _rebased_view(t: torch.Tensor, version_made: int) -> bool:
    """Whether ``t`` is a view written in place since its op returned (its history rebased)."""
    return t._is_view() and t._version != version_made


class _CallRecorder(ForwardWrapper):
    def __init__(self, path: str, tracker: OpTracker, calls: dict) -> None:
        self.path, self.tracker, self.calls = path, tracker, calls

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        tracker = self.tracker
        start, grad = len(tracker.records), torch.is_grad_enabled()
        passed = [
            rec
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and (rec := tracker.lookup(t)) is not None
        ]
        ids = [id(t) for t in tree_leaves((args, kwargs)) if is_tensor(t)]
        if len(ids) != len(set(ids)):
            tracker.aliased_args.add(self.path)
        values = (*args, *kwargs.values())
        tracker.tensor_args[self.path].append(
            (len(args), tuple(kwargs), [tensor_meta(t) for t in values])
            if all(isinstance(t, torch.Tensor) for t in values)
            else None
        )
        tracker.path_stack.append(self.path)
        try:
            return self.run_original(module, *args, **kwargs)
        except Exception:
            if tracker.failed_in is None:  # the innermost module running when it failed
                tracker.failed_in = self.path
            raise
        finally:
            tracker.path_stack.pop()
            self.calls[self.path].append((start, len(tracker.records), grad))
            tracker.call_args.append((start, len(tracker.records), passed))


@contextmanager
def recording_calls(model: torch.nn.Module, tracker: OpTracker) -> Iterator[dict]:
    calls: dict[str, list[tuple[int, int, bool]]] = defaultdict(list)
    installed: list[tuple[_CallRecorder, torch.nn.Module]] = []
    try:
        for path, module in model.named_modules():
            recorder = _CallRecorder(path, tracker, calls)
            recorder.install(module)
            installed.append((recorder, module))
        with tracker.attention or nullcontext():  # the target's attention kernels, if another
            yield calls
    finally:
        for recorder, module in reversed(installed):
            recorder.uninstall(module)


def tensor_meta(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def read_by_calls(tracker: OpTracker) -> None:
    """A storage passed to a module call is read by it, whether or not an op inside reads it:
    checkpointing the call saves every tensor argument until its backward ends (simulate's
    Rule 2). Llama's decoder layers are passed ``position_ids`` that none of their ops read;
    without this a checkpointed layer measured 512 B over the prediction. The call's first
    node stands for the call (never later than the storage already lives: the caller passes
    it)."""
    for start, stop, passed in tracker.call_args:
        if start == stop:
            continue
        for rec in passed:
            if rec.node < 0 or rec.node >= start:
                continue
            if not any(start <= u < stop for u in (*rec.users, *rec.saved_by)):
                rec.users.add(start)
