"""The fake-tensor tracker both estimators run the step under: one record per priced op.

``passes/estimate.py`` (a captured graph, one record per fx node) and ``passes/eager.py`` (the
model's own forward, one record per aten call) run the training step under ``FakeTensorMode``
with a :class:`Tracker` beneath it, both set up by :func:`fake_step`. The tracker sees every
aten operation and every storage it creates (a weakref finalizer on each storage says when it
dies), and keeps per op: FLOPs, bytes moved, in-place writes, what it reads
(:meth:`Tracker.enter_node`), its forward working set, output shapes and whether it only made
views (:meth:`Tracker.exit_node`, an :class:`OpRecord`), and which autograd nodes it created
(:meth:`Tracker.claim`), whose pre-hooks attribute the backward's memory to it
(:class:`BackwardSegments`). Saves for backward (:meth:`Tracker.saving`) are attributed to the
node whose backward unpacks them, the one way that holds in both forms: autograd saves an eager
op's inputs before the op reaches dispatch, where its record opens. The step's outputs live
until backward (:meth:`Tracker.mark_outputs`). ``passes/costing.py`` turns a tracker's records
into a CostGraph.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

from planner.passes.kernel_storages import real_storage_bytes
from planner.passes.nodes import written_arguments
from planner.passes.op_call import OpCall, op_call
from planner.passes.step import (
    amp_backward,
    autocast_dtypes,
    join_input,
    split_input,
    tensor_leaves,
)

_SDPA_BACKENDS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "flash",
    torch.ops.aten._scaled_dot_product_flash_attention.default: "flash",
    torch.ops.aten._scaled_dot_product_efficient_attention.default: "efficient",
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: "cudnn",
    torch.ops.aten._safe_softmax.default: "math",
}


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
_GROUPED_MM = _GROUPED_MM.default if _GROUPED_MM is not None else None

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator's smallest block, and its rounding


def allocated_bytes(
    t: torch.Tensor, cuda_blocks: bool = False, storage_bytes: int | None = None
) -> int:
    """The device memory ``t``'s storage takes: on CUDA (or priced for CUDA: ``cuda_blocks``)
    the caching allocator rounds every block up to a multiple of 512 bytes, elsewhere its
    bytes. ``storage_bytes``: the storage's size where the real kernel's differs from ``t``'s."""
    nbytes = t.untyped_storage().nbytes() if storage_bytes is None else storage_bytes
    if t.device.type != "cuda" and not cuda_blocks:
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def _grouped_mm_off_meta(mat_a: Any, mat_b: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether torch's fake kernel of ``aten._grouped_mm`` would refuse a call eager runs.

    The fake kernel checks the CUDA kernel's constraints (bfloat16 inputs), but the CPU kernel
    takes any floating dtype: a Mixtral or Qwen2-MoE in float32 runs eagerly on the CPU and
    died in pricing. Those calls are priced by :func:`_grouped_mm_out` instead."""
    return mat_a.dtype != torch.bfloat16 and mat_a.device.type in ("cpu", "meta")


def _grouped_mm_out(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` (shape rule of torch's meta kernel, contiguous as the
    CPU kernel returns it), without its bfloat16 check; called under the fake mode."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]  # type: ignore[union-attr]
    elif mat_a.dim() == 2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _grouped_mm_flop(
    mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    """2 x (multiply-adds) of a grouped matmul: each output element sums over the contraction
    dimension, which the groups (``offs``) partition when both operands are 2-D."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.size(0) * mat_a.size(1) * mat_b.size(1)
    return 2 * out_val.numel() * mat_a.size(-1)


# FLOP formulas torch.utils.flop_counter lacks (it counts 0 for an op without one).
_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {}
if _GROUPED_MM is not None:
    _FLOP_FORMULAS[torch.ops.aten._grouped_mm] = _grouped_mm_flop


@dataclass(eq=False)
class Storage:
    """One storage seen during the fake run (mutable scratch; identity-compared)."""

    nbytes: int
    node: int  # index of the node whose forward/backward allocated it; -1 outside any node
    phase: str  # "fwd" | "bwd"
    alive: bool = True
    requires_grad: bool = False
    users: set[int] = field(default_factory=set)
    saved_by: set[int] = field(default_factory=set)
    is_output: bool = False
    freed_at: int | None = None  # node whose backward was running when it died (None: forward)
    held_to_end: bool = False
    written_by: set[int] = field(default_factory=set)  # nodes writing it in place in forward


@dataclass(eq=False)
class Save:
    """One tensor autograd saved for backward (mutable scratch; identity-compared)."""

    storage: Storage | None  # None: a storage the tracker never saw
    node: int  # the node running when autograd saved it
    allocated: int | None  # storages that node's forward had allocated by then (None: outside it)
    owner: int | None = None  # the node whose backward unpacked it
    outside: bool = False  # saved by the loss step (``Tracker.outside_node``)


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


class RecordedCall(NamedTuple):
    """One aten call of the step as the estimator prices it: the call (None if it cannot be
    rebuilt), its FLOPs and roofline traffic, and the bytes of each storage it allocated."""

    call: OpCall | None
    flops: int
    moved_bytes: int
    allocated_bytes: tuple[int, ...]


class Tracker(TorchDispatchMode):
    """Sees every aten op under the fake mode: new storages, frees, FLOPs, bytes moved."""

    def __init__(self, record_calls: bool = False) -> None:
        super().__init__()
        self.record_calls = record_calls
        # (phase, node) -> its calls, in order
        self.calls: dict[tuple[str, int], list[RecordedCall]] = defaultdict(list)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.by_key: dict[int, Storage] = {}
        self.node = -1
        self.phase = "fwd"
        self.flops: dict[tuple[str, int], int] = defaultdict(int)
        self.moved_bytes: dict[tuple[str, int], int] = defaultdict(int)
        # (phase, node) -> the calls a selective checkpoint's policy is asked about when the
        # node runs in a region (Node.fwd_calls): not those torch lets through unasked
        # (SAC_IGNORED_OPS: detach, metadata queries), nor the graph form's loss step
        self.call_counts: dict[tuple[str, int], int] = defaultdict(int)
        self.random_nodes: set[int] = set()
        self.sdpa_backends: set[str] = set()
        self.allocated: dict[tuple[str, int], list[Storage]] = defaultdict(list)
        # Model buffers (node -1 storages) each node writes in forward: BatchNorm statistics.
        self.state_written: dict[int, dict[int, int]] = defaultdict(dict)
        # node -> id(record) of the model buffers its forward saves for backward (BatchNorm
        # saves its running statistics): a recomputation's copy of those lives to its backward
        self.state_saved: dict[int, set[int]] = defaultdict(set)
        # node -> how many storages its forward had allocated at its last save for backward
        self.allocated_at_last_save: dict[int, int] = {}
        # autocast's weight copies, held to the end of forward as autocast's cache holds them
        # (the cache may skip fake tensors, so the pricing run holds them here)
        self.cast_cache: list[torch.Tensor] = []
        self.autocast = bool(autocast_dtypes())
        # priced for a CUDA device from another one (a model on meta planned for an H100): its
        # storages rounded as the CUDA caching allocator rounds them
        self.cuda_blocks = False
        self.died_at: dict[int, int] = {}  # id(storage record) -> node it outlived in forward
        self.casts: set[int] = set()  # id(storage record) of the copies autocast cached
        self.records: list[OpRecord] = []
        self.grad_fn_node: dict[Any, int] = {}
        self.segments = BackwardSegments(self)
        self.saves: list[Save] = []
        self.internal = 0  # the tracker's own ops (detaching saves) are running: not the model's
        # ops run now are charged to ``node`` but are not its forward (the graph form's loss
        # step, which runs outside every region): their FLOPs, traffic and calls go to the
        # phase "loss" (``passes/costing.py`` adds it to the node's backward, which no region
        # recomputes), their saves do not move its last save, and what they keep for backward
        # is held whatever the schedule (``loss_storages``, ``loss_held``)
        self.outside_node = False
        self.loss_storages: list[Storage] = []  # the storages the loss step allocated
        # storages of the graph's nodes (its outputs) that only the loss step saves, and the
        # node whose backward unpacked them (the loss's backward is charged to it)
        self.loss_held: list[tuple[Storage, int]] = []
        self.fwd_segment: Segment | None = None  # the running node's (``enter_node``)

    def _is_weight(self, t: Any) -> bool:
        """A parameter: what autocast caches the casts of (leaves that require grad)."""
        rec = self.lookup(t) if is_tensor(t) else None
        return rec is not None and rec.phase == "ext" and t.requires_grad and t.is_leaf

    def release_casts(self, last_node: int) -> None:
        """The forward ends, and autocast's cache lets go of its copies. Autograd saved most of
        them, so they outlive this run; in a region, which saves nothing, the cache was what
        held them to here (``Tensor.freed_after``, simulate's Rule 1)."""
        for t in self.cast_cache:
            if (rec := self.lookup(t)) is not None:
                self.died_at.setdefault(id(rec), last_node)
                self.casts.add(id(rec))
        self.cast_cache.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.internal:  # the tracker's own detach of a save: no op the step runs
            return func(*args, **kwargs)
        if func is _GROUPED_MM and _grouped_mm_off_meta(*args, **kwargs):
            out = _grouped_mm_out(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if self.autocast and func is torch.ops.aten._to_copy.default and self._is_weight(args[0]):
            self.cast_cache.append(out)
        where = ("loss" if self.outside_node else self.phase, self.node)
        packet = func._overloadpacket
        formula = _FLOP_FORMULAS.get(packet) or flop_registry.get(packet)
        flops = 0 if formula is None else int(formula(*args, **kwargs, out_val=out))
        self.flops[where] += flops
        if func not in SAC_IGNORED_OPS:
            self.call_counts[where] += 1
        if func in _SDPA_BACKENDS and self.phase == "fwd":
            self.sdpa_backends.add(_SDPA_BACKENDS[func])
        if torch.Tag.nondeterministic_seeded in func.tags and self.phase == "fwd":
            self.random_nodes.add(self.node)
        if self.phase == "fwd" and self.node >= 0:
            self.note_writes(func, args, kwargs)
        # One flatten of the arguments serves the traffic and the recorded call.
        flat = tree_flatten((args, kwargs)) if self.record_calls or not func.is_view else None
        outs = [t for t in tree_leaves(out) if is_tensor(t)]
        moved = 0
        if not func.is_view:
            # Roofline traffic: every input read once, every output written once.
            ins = [t for t in flat[0] if is_tensor(t)]  # type: ignore[index]
            moved = sum(t.numel() * t.element_size() for t in (*ins, *outs))
            self.moved_bytes[where] += moved
        call = op_call(func, args, kwargs, flat) if self.record_calls else None
        allocated = []  # the storages this call allocates, for a recorded call's price
        storage_bytes = real_storage_bytes(func, args, kwargs)
        for t in outs:
            new = self.record_calls and self.lookup(t) is None
            rec = self.track(t, storage_bytes)
            if new and rec is not None:
                allocated.append(rec.nbytes)
        if self.record_calls:
            self.calls[where].append(RecordedCall(call, flops, moved, tuple(allocated)))
        if call is not None:
            self._note_call(call)
        return out

    def _note_call(self, call: OpCall) -> None:
        """Remember ``call`` in the working set it runs in (``Segment.calls``), with the bytes
        live above that segment's start once its outputs are allocated: the level a kernel's
        workspace stands on (``costing.with_workspaces``)."""
        if self.phase == "bwd":
            seg, start = self.segments.by_node.get(self.node), self.segments.start_bytes
        elif self.outside_node:  # the loss step joins its node's forward (estimate._charged_to)
            seg = self.records[self.node].fwd
            start = seg.start_bytes
        else:
            seg = self.fwd_segment if self.node >= 0 else None
            start = 0 if seg is None else seg.start_bytes
        if seg is not None:
            seg.calls.append((call, self.live_bytes - start))

    def note_writes(self, func, args: tuple, kwargs: dict) -> None:
        """Record the storages ``func`` writes in place (``passes/nodes.written_arguments``)."""

        def value_of(k: int, name: str) -> Any:
            return args[k] if k < len(args) else kwargs.get(name)

        for value in written_arguments(func._schema, value_of):
            for t in tree_leaves(value):
                if not is_tensor(t) or (rec := self.lookup(t)) is None:
                    continue
                if rec.node >= 0:
                    rec.written_by.add(self.node)
                elif rec.phase == "ext":
                    self.state_written[self.node][id(rec)] = rec.nbytes

    def track(self, t: torch.Tensor, storage_bytes: int | None = None) -> Storage | None:
        st = t.untyped_storage()
        rec = self.by_key.get(st._cdata)
        if rec is not None:
            return rec
        nbytes = allocated_bytes(t, self.cuda_blocks, storage_bytes)
        rec = Storage(nbytes=nbytes, node=self.node, phase=self.phase)
        self.by_key[st._cdata] = rec
        self.allocated[(self.phase, self.node)].append(rec)
        if self.outside_node:
            self.loss_storages.append(rec)
        self.live_bytes += rec.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(st, self._free, st._cdata, rec)
        return rec

    def register_external(self, t: Any) -> None:
        """Parameters, buffers and inputs: the baseline, never counted as step memory."""
        if is_tensor(t):
            st = t.untyped_storage()
            ext = Storage(nbytes=allocated_bytes(t, self.cuda_blocks), node=-1, phase="ext")
            self.by_key.setdefault(st._cdata, ext)

    def _free(self, key: int, rec: Storage) -> None:
        rec.alive = False
        rec.freed_at = self.node if self.phase == "bwd" else None
        self.live_bytes -= rec.nbytes
        if self.by_key.get(key) is rec:
            del self.by_key[key]

    def lookup(self, t: torch.Tensor) -> Storage | None:
        return self.by_key.get(t.untyped_storage()._cdata)

    def enter_node(self, i: int, inputs: Any) -> tuple[set[int], set[int], Segment]:
        """Node ``i``'s forward starts on ``inputs``: it uses the storages it reads, and its
        working set opens. Returns (ids of the storage records read, the nodes that made them,
        its forward segment)."""
        read: set[int] = set()
        producers: set[int] = set()
        for t in tree_leaves(inputs):
            if is_tensor(t) and (rec := self.lookup(t)) is not None:
                read.add(id(rec))
                if rec.node >= 0:
                    rec.users.add(i)
                    producers.add(rec.node)
        self.node, self.phase = i, "fwd"
        seg = self.fwd_segment = Segment(start_bytes=self.live_bytes)
        self.peak_bytes = self.live_bytes
        return read, producers, seg

    def exit_node(self, record: OpRecord, read: set[int], seg: Segment, out: Any) -> list:
        """The node's forward returned ``out``: its working set, output shapes, and whether it
        only made views of what it read. Returns its tensor outputs."""
        seg.peak_above_start_bytes = self.peak_bytes - seg.start_bytes
        record.fwd = seg
        outs = [t for t in tree_leaves(out) if is_tensor(t)]
        record.shapes = [tuple(t.shape) for t in outs]
        record.is_view = bool(outs) and all(id(self.lookup(t)) in read for t in outs)
        return outs

    def claim(self, outs: list, i: int) -> None:
        """Map the autograd nodes that made ``outs`` to forward node ``i`` (walking back to
        known ones): their pre-hooks open ``i``'s backward segment."""
        for t in outs:
            if (rec := self.lookup(t)) is not None:
                rec.requires_grad |= t.requires_grad and t.is_floating_point()
        stack = [t.grad_fn for t in outs if t.grad_fn is not None]
        while stack:
            g = stack.pop()
            if g in self.grad_fn_node or type(g).__name__ == "AccumulateGrad":
                continue
            self.grad_fn_node[g] = i
            g.register_prehook(functools.partial(_enter_backward, self.segments, i))
            stack.extend(f for f, _ in g.next_functions if f is not None)

    def mark_outputs(self, out: Any) -> None:
        """The step's forward returned ``out``: every tensor in it lives until the caller
        releases it before backward (``Tensor.is_output``), floating or not, as the real step
        holds the whole output (``planner/measurement.py``)."""
        for t in tensor_leaves(out):
            if (rec := self.lookup(t)) is not None:
                rec.is_output = True

    def backward(self, loss: torch.Tensor, last: int) -> None:
        """Run the step's backward from ``loss``, attributed to forward nodes from ``last`` down
        (``loss``' own autograd nodes belong to ``last``)."""
        if (rec := self.lookup(loss)) is not None and rec.node >= 0:
            rec.held_to_end = True  # the caller holds the loss through backward
        self.phase = "bwd"
        self.segments.enter(last)
        with amp_backward():
            loss.backward()
        self.segments.close()
        self._resolve_saves()

    def saving(self) -> AbstractContextManager:
        """Autograd's saves for backward seen by the tracker (run the forward and the loss
        under it): each is attributed when :meth:`backward` unpacks it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        node = self.node
        allocated = None if self.outside_node else len(self.allocated[("fwd", node)])
        self.saves.append(Save(self.lookup(t), node, allocated, outside=self.outside_node))
        self.internal += 1
        try:
            # detached: a saved copy pointing back at its grad_fn would form a reference cycle
            # and keep storages alive past the moment autograd really frees them
            return len(self.saves) - 1, t.detach()
        finally:
            self.internal -= 1

    def _unpack(self, packed: tuple[int, torch.Tensor]) -> torch.Tensor:
        k, t = packed
        save = self.saves[k]
        if save.owner is None and self.phase == "bwd":
            save.owner = self.node
        return t

    def _resolve_saves(self) -> None:
        """Each save belongs to the node whose backward unpacked it (never unpacked: the node
        running when it was saved). In eager code an op's inputs are saved before the op
        reaches dispatch, so while the previous op is still the running node; in a graph the
        node runs before autograd and both are the same node."""
        by_loss: list[tuple[Save, int]] = []  # the loss step's saves of the nodes' storages
        loss_step = set(map(id, self.loss_storages))
        for s in self.saves:
            owner = s.node if s.owner is None else s.owner
            if owner < 0:
                continue
            if s.outside and s.storage is not None and id(s.storage) not in loss_step:
                by_loss.append((s, owner))  # once the nodes' own saves are known
                continue
            # Inputs are saved before the op allocates anything, outputs after.
            self._note_save(s.storage, owner, s.allocated if owner == s.node else 0)
        for s, owner in by_loss:
            rec = s.storage
            assert rec is not None
            if rec.is_output and not rec.saved_by:
                # held by the loss step, outside every region, to its backward
                if all(rec is not held for held, _ in self.loss_held):
                    self.loss_held.append((rec, owner))
            else:  # a node's save keeps it too (or it is no output): saved as by that node
                self._note_save(rec, owner, s.allocated if owner == s.node else 0)

    def _note_save(self, rec: Storage | None, owner: int, allocated: int | None) -> None:
        """Autograd saved ``rec`` for node ``owner``'s backward. ``allocated``: the storages
        ``owner``'s forward had allocated by then (None: not during its forward)."""
        if rec is not None and rec.node >= 0:
            rec.saved_by.add(owner)
        elif rec is not None and rec.phase == "ext":
            self.state_saved[owner].add(id(rec))
        if allocated is not None:
            # Checkpoint's recomputation stops at the last save; what the node allocates after
            # it (a linear saves its inputs, then computes) is never made again.
            done = self.allocated_at_last_save.get(owner, 0)
            self.allocated_at_last_save[owner] = max(done, allocated)


@dataclass
class Segment:
    """Memory seen while one node's forward or backward ran."""

    start_bytes: int = 0
    peak_above_start_bytes: int = 0
    # each aten call it ran, with the bytes live above ``start_bytes`` once the call's outputs
    # were allocated (recorded only when the tracker records calls, to time them): where a
    # kernel's workspace, which no fake tensor shows, stands (``costing.with_workspaces``)
    calls: list[tuple[OpCall, int]] = field(default_factory=list)


@dataclass(eq=False)
class OpRecord:
    """One priced op: a graph node (``estimate``) or one aten call (``eager``).

    ``op``: the CostGraph node's ``op`` (a short name in a graph, the overload in eager code);
    ``inputs``: the records whose outputs it reads; ``module_type``: the class of the module
    that issued it, where known; ``fwd_calls``: the aten calls its forward dispatched.
    """

    name: str
    op: str
    module_path: str
    inputs: set[int]
    module_type: str = ""
    fwd: Segment = field(default_factory=Segment)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    is_view: bool = False
    fwd_calls: int = 1


def to_fake(mode: FakeTensorMode, x: Any) -> Any:
    if is_tensor(x):
        return mode.from_tensor(x, static_shapes=True)
    return x


def fake_state(mode: FakeTensorMode, module: torch.nn.Module) -> dict[str, Any]:
    """Fake copies of ``module``'s parameters and buffers, by name (tied ones under each name),
    to run it on with ``torch.nn.utils.stateless._reparametrize_module``."""
    state = {k: to_fake(mode, v) for k, v in module.named_parameters(remove_duplicate=False)}
    state.update({k: to_fake(mode, v) for k, v in module.named_buffers(remove_duplicate=False)})
    return state


@dataclass(eq=False)
class FakeStep:
    """What both estimators run a step on: one fake mode, ``module``'s parameters and buffers
    and the example input (``batch``) faked in it, the device the step runs on, and the tracker,
    which counts all of those as the baseline (:func:`fake_step`)."""

    module: torch.nn.Module
    mode: FakeTensorMode
    state: dict[str, Any]  # fake parameters and buffers, by name (``fake_state``)
    batch: Any  # the example input, faked, in its own shape
    device: torch.device
    tracker: Tracker

    def fake(self, x: Any) -> Any:
        """``x`` faked in this mode (memoised: the same fake tensor for the same tensor), and
        counted as the baseline: a further input, a constant."""
        x = to_fake(self.mode, x)
        self.tracker.register_external(x)
        return x

    @contextmanager
    def running(self) -> Iterator[None]:
        """Run ``module`` on its fake state, under the fake mode, with the tracker beneath."""
        with (
            torch.nn.utils.stateless._reparametrize_module(self.module, self.state),
            self.mode,
            self.tracker,
        ):
            yield


def step_device(module: torch.nn.Module, batch: Any) -> torch.device:
    """The device a step of ``module`` on ``batch`` runs on: its first tensor's."""
    args, kwargs = split_input(batch)
    tensors = [*module.parameters(), *module.buffers(), *tree_leaves((args, kwargs))]
    return next((t.device for t in tensors if is_tensor(t)), torch.device("cpu"))


def fake_step(module: torch.nn.Module, batch: Any, tracker: Tracker) -> FakeStep:
    """The :class:`FakeStep` of ``module`` on the example input ``batch`` (a tensor, a tuple
    or a dict of them), traced by ``tracker`` (which needs a real device to time the calls on
    if it records them)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = fake_state(mode, module)
    args, kwargs = split_input(batch)
    fake_args = tuple(to_fake(mode, a) for a in args)
    fake_batch = join_input(batch, fake_args, {k: to_fake(mode, v) for k, v in kwargs.items()})
    device = step_device(module, batch)
    if tracker.record_calls and device.type == "meta":
        raise ValueError(
            "time_ops needs the model and input on a real device (cpu or cuda), not meta; "
            "price a meta model by a device profile (rates=...) instead"
        )
    for t in [*state.values(), *tree_leaves(fake_batch)]:
        tracker.register_external(t)
    return FakeStep(module, mode, state, fake_batch, device, tracker)


class BackwardSegments:
    """Memory of each forward node's backward: entered from autograd pre-hooks, in order."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.by_node: dict[int, Segment] = {}
        self.start_bytes = 0

    def enter(self, i: int) -> None:
        tr = self.tracker
        if i == tr.node and tr.phase == "bwd" and i in self.by_node:
            return  # another autograd node of the same forward node: one working set
        self.close()
        tr.node = i
        self.by_node.setdefault(i, Segment(start_bytes=tr.live_bytes))
        self.start_bytes = tr.live_bytes
        tr.peak_bytes = tr.live_bytes

    def close(self) -> None:
        seg = self.by_node.get(self.tracker.node)
        if seg is not None:
            above = self.tracker.peak_bytes - self.start_bytes
            seg.peak_above_start_bytes = max(seg.peak_above_start_bytes, above)


def _enter_backward(segments: BackwardSegments, i: int, grad_outputs: Any) -> None:
    segments.enter(i)
