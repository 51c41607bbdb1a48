"""Estimate: price every node of a captured training step, on fake tensors.

In: a GraphModule (from ``passes/capture.py``), its example args/kwargs, and optionally the loss
function. Out: a :class:`planner.solvers.costgraph.CostGraph` whose ``nodes`` are the graph's
call_function / call_method / call_module nodes in graph order, named as in the graph.

How: the step (forward, loss per ``passes/step.training_loss``, backward) runs ONCE under
``FakeTensorMode``, so no real memory is allocated and no real arithmetic is done, which is what
lets a 7B-parameter shape be priced on a laptop. Underneath the fake mode a dispatch-mode tracker
sees every aten operation and every storage it creates; a weakref finalizer on each storage says
when it dies. The forward runs node by node (an fx Interpreter) and the backward is attributed to
forward nodes through pre-hooks on the autograd nodes each forward node created. That yields,
per node: the storages it allocates (views allocate nothing), who reads them, which of them
autograd saves for backward (``saved_tensors_hooks``), the working memory it needs beyond that
(forward and backward), the gradient buffers and parameter gradients its backward creates and
when each dies, FLOPs (``torch.utils.flop_counter`` formulas) and bytes moved (for the roofline
time, with device rates from ``planner.devices``). Tags: ``attention`` (S x S outputs, fused
attention), ``skip`` (values read far apart), ``random``, ``inplace``, ``batchnorm``, ``view``.

Sizes are those of the device and dtypes the step really runs with: CPU, CUDA or meta tensors
(a model built on the meta device is priced without allocating it), under the caller's
``torch.autocast`` and ``sdpa_kernel`` contexts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._pytree import tree_flatten_spec
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.flop_counter import flop_registry

from planner.devices import DeviceProfile, profile_of
from planner.passes.nodes import module_path, written_arguments
from planner.passes.op_timing import DeviceTiming, OpCall, Timer, measure_timing, op_call
from planner.passes.step import (
    StepTime,
    amp_backward,
    amp_forward,
    autocast_dtypes,
    data_dependent_error,
    data_dependent_errors,
    join_input,
    loss_on_fake_tensors,
    split_input,
    training_loss,
)
from planner.solvers.costgraph import CostGraph, GradBuffer, Node, Tensor

COMPUTE_OPS = ("call_function", "call_method", "call_module")
# A value whose first and last consumers lie this many non-view nodes apart is a "skip".
SKIP_GAP_NODES = 3
_MATMULS = {"matmul", "bmm", "baddbmm", "mm", "einsum"}
_SDPA_BACKENDS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "flash",
    torch.ops.aten._scaled_dot_product_flash_attention.default: "flash",
    torch.ops.aten._scaled_dot_product_efficient_attention.default: "efficient",
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: "cudnn",
    torch.ops.aten._safe_softmax.default: "math",
}


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
_GROUPED_MM = _GROUPED_MM.default if _GROUPED_MM is not None else None


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


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The fx nodes that become CostGraph nodes, in graph order (the 1:1 name map)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op in COMPUTE_OPS and not (n.op == "call_module" and n.target == "_guards_fn")
    ]


@dataclass(eq=False)
class _Storage:
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


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


class _Tracker(TorchDispatchMode):
    """Sees every aten op under the fake mode: new storages, frees, FLOPs, bytes moved."""

    def __init__(self, record_calls: bool = False) -> None:
        super().__init__()
        self.record_calls = record_calls
        # (phase, node) -> [(the call, or None if it cannot be rebuilt, FLOPs, bytes moved)]
        self.calls: dict[tuple[str, int], list[tuple[OpCall | None, int, int]]] = defaultdict(list)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.by_key: dict[int, _Storage] = {}
        self.node = -1
        self.phase = "fwd"
        self.flops: dict[tuple[str, int], int] = defaultdict(int)
        self.moved_bytes: dict[tuple[str, int], int] = defaultdict(int)
        self.call_counts: dict[tuple[str, int], int] = defaultdict(int)
        self.random_nodes: set[int] = set()
        self.sdpa_backends: set[str] = set()
        self.allocated: dict[tuple[str, int], list[_Storage]] = defaultdict(list)
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
        self.died_at: dict[int, int] = {}  # id(storage record) -> node it outlived in forward
        self.casts: set[int] = set()  # id(storage record) of the copies autocast cached

    def _is_weight(self, t: Any) -> bool:
        """A parameter: what autocast caches the casts of (leaves that require grad)."""
        rec = self.lookup(t) if _is_tensor(t) else None
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
        if func is _GROUPED_MM and _grouped_mm_off_meta(*args, **kwargs):
            out = _grouped_mm_out(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if self.autocast and func is torch.ops.aten._to_copy.default and self._is_weight(args[0]):
            self.cast_cache.append(out)
        where = (self.phase, self.node)
        packet = func._overloadpacket
        formula = _FLOP_FORMULAS.get(packet) or flop_registry.get(packet)
        flops = 0 if formula is None else int(formula(*args, **kwargs, out_val=out))
        self.flops[where] += flops
        self.call_counts[where] += 1
        if func in _SDPA_BACKENDS and self.phase == "fwd":
            self.sdpa_backends.add(_SDPA_BACKENDS[func])
        if torch.Tag.nondeterministic_seeded in func.tags and self.phase == "fwd":
            self.random_nodes.add(self.node)
        if self.phase == "fwd" and self.node >= 0:
            self.note_writes(func, args, kwargs)
        # One flatten of the arguments serves the traffic and the recorded call.
        flat = tree_flatten((args, kwargs)) if self.record_calls or not func.is_view else None
        outs = [t for t in tree_leaves(out) if _is_tensor(t)]
        moved = 0
        if not func.is_view:
            # Roofline traffic: every input read once, every output written once.
            ins = [t for t in flat[0] if _is_tensor(t)]  # type: ignore[index]
            moved = sum(t.numel() * t.element_size() for t in (*ins, *outs))
            self.moved_bytes[where] += moved
        if self.record_calls:
            self.calls[where].append((op_call(func, args, kwargs, flat), flops, moved))
        for t in outs:
            self.track(t)
        return out

    def note_writes(self, func, args: tuple, kwargs: dict) -> None:
        """Record the storages ``func`` writes in place (``passes/nodes.written_arguments``)."""

        def value_of(k: int, name: str) -> Any:
            return args[k] if k < len(args) else kwargs.get(name)

        for value in written_arguments(func._schema, value_of):
            for t in tree_leaves(value):
                if not _is_tensor(t) or (rec := self.lookup(t)) is None:
                    continue
                if rec.node >= 0:
                    rec.written_by.add(self.node)
                elif rec.phase == "ext":
                    self.state_written[self.node][id(rec)] = rec.nbytes

    def track(self, t: torch.Tensor) -> _Storage | None:
        st = t.untyped_storage()
        rec = self.by_key.get(st._cdata)
        if rec is not None:
            return rec
        rec = _Storage(nbytes=st.nbytes(), node=self.node, phase=self.phase)
        self.by_key[st._cdata] = rec
        self.allocated[(self.phase, self.node)].append(rec)
        self.live_bytes += rec.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(st, self._free, st._cdata, rec)
        return rec

    def register_external(self, t: Any) -> None:
        """Parameters, buffers and inputs: the baseline, never counted as step memory."""
        if _is_tensor(t):
            st = t.untyped_storage()
            self.by_key.setdefault(st._cdata, _Storage(nbytes=st.nbytes(), node=-1, phase="ext"))

    def _free(self, key: int, rec: _Storage) -> None:
        rec.alive = False
        rec.freed_at = self.node if self.phase == "bwd" else None
        self.live_bytes -= rec.nbytes
        if self.by_key.get(key) is rec:
            del self.by_key[key]

    def lookup(self, t: torch.Tensor) -> _Storage | None:
        return self.by_key.get(t.untyped_storage()._cdata)


@dataclass
class _Segment:
    """Memory seen while one node's forward or backward ran."""

    start_bytes: int = 0
    peak_above_start_bytes: int = 0


class BackwardSegments:
    """Memory of each forward node's backward: entered from autograd pre-hooks, in order."""

    def __init__(self, tracker: _Tracker) -> None:
        self.tracker = tracker
        self.by_node: dict[int, _Segment] = {}
        self.start_bytes = 0

    def enter(self, i: int) -> None:
        tr = self.tracker
        if i == tr.node and tr.phase == "bwd" and i in self.by_node:
            return  # another autograd node of the same forward node: one working set
        self.close()
        tr.node = i
        self.by_node.setdefault(i, _Segment(start_bytes=tr.live_bytes))
        self.start_bytes = tr.live_bytes
        tr.peak_bytes = tr.live_bytes

    def close(self) -> None:
        seg = self.by_node.get(self.tracker.node)
        if seg is not None:
            above = self.tracker.peak_bytes - self.start_bytes
            seg.peak_above_start_bytes = max(seg.peak_above_start_bytes, above)


class _Step(fx.Interpreter):
    """Runs the forward node by node, recording storages, users, saves and autograd nodes."""

    def __init__(
        self,
        gm: fx.GraphModule,
        tracker: _Tracker,
        index: dict[fx.Node, int],
        fake_mode: FakeTensorMode,
    ):
        super().__init__(gm)
        # fx.Interpreter frees a value after its last user, so one with no user (an unused
        # select export leaves behind) stayed in its env to the end, holding the storage it
        # views; the GraphModule's own code frees it at once (fx codegen), as here.
        for node in gm.graph.nodes:
            if not node.users and node.op != "output":
                self.user_to_last_uses.setdefault(node, []).append(node)
        self.tracker = tracker
        self.fake_mode = fake_mode
        self.constants: dict[str, torch.Tensor] = {}
        self.index = index
        self.fwd: dict[int, _Segment] = {}
        self.grad_fn_node: dict[Any, int] = {}
        self.views: set[int] = set()
        self.shapes: dict[int, list[tuple[int, ...]]] = {}
        self.in_node = False  # a graph node's forward is running (not the loss step)

    def fetch_attr(self, target: str) -> Any:
        # Tensor constants that are neither parameters nor buffers (export's lifted constants,
        # plain tensor attributes): faked on first use, part of the baseline like parameters.
        value = super().fetch_attr(target)
        if _is_tensor(value) and not isinstance(value, FakeTensor):
            if target not in self.constants:
                self.constants[target] = self.fake_mode.from_tensor(value, static_shapes=True)
                self.tracker.register_external(self.constants[target])
            value = self.constants[target]
        return value

    def run_node(self, n: fx.Node) -> Any:
        i = self.index.get(n)
        if i is None:
            return super().run_node(n)
        tr = self.tracker
        read: set[int] = set()
        for value in tree_leaves([self.env[a] for a in n.all_input_nodes]):
            if _is_tensor(value) and (rec := tr.lookup(value)) is not None:
                read.add(id(rec))
                if rec.node >= 0:
                    rec.users.add(i)
        tr.node, tr.phase = i, "fwd"
        seg = _Segment(start_bytes=tr.live_bytes)
        tr.peak_bytes = tr.live_bytes
        self.in_node = True
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            out = super().run_node(n)
        self.in_node = False
        seg.peak_above_start_bytes = tr.peak_bytes - seg.start_bytes
        self.fwd[i] = seg
        outs = [t for t in tree_leaves(out) if _is_tensor(t)]
        self.shapes[i] = [tuple(t.shape) for t in outs]
        if outs and all(id(tr.lookup(t)) in read for t in outs):
            self.views.add(i)
        self.claim_grad_fns(out, i)
        return out

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        tr = self.tracker
        rec = tr.lookup(t)
        if rec is not None and rec.node >= 0:
            rec.saved_by.add(tr.node)
        elif rec is not None and rec.phase == "ext":
            tr.state_saved[tr.node].add(id(rec))
        if self.in_node:
            # Checkpoint's recomputation stops at the last save; what the node allocates after
            # it (a linear saves its inputs, then computes) is never made again.
            tr.allocated_at_last_save[tr.node] = len(tr.allocated[("fwd", tr.node)])
        # detach: the saved copy must not point back at its grad_fn (a reference cycle would
        # keep storages alive past the moment autograd really frees them).
        return t.detach()

    def claim_grad_fns(self, out: Any, i: int) -> None:
        """Map autograd nodes created by forward node ``i`` to ``i`` (walk back to known ones)."""
        for t in tree_leaves(out):
            if _is_tensor(t) and (rec := self.tracker.lookup(t)) is not None:
                rec.requires_grad |= t.requires_grad and t.is_floating_point()
        stack = [t.grad_fn for t in tree_leaves(out) if _is_tensor(t) and t.grad_fn is not None]
        while stack:
            g = stack.pop()
            if g in self.grad_fn_node or type(g).__name__ == "AccumulateGrad":
                continue
            self.grad_fn_node[g] = i
            g.register_prehook(self._backward_hook(i))
            stack.extend(f for f, _ in g.next_functions if f is not None)

    def _backward_hook(self, i: int) -> Callable:
        def hook(grad_outputs):
            self.on_backward_node(i)

        return hook

    on_backward_node: Callable[[int], None]


def _sdpa_kernel(backend: str | None) -> contextlib.AbstractContextManager:
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    if backend not in names:
        raise ValueError(f"sdpa_backend must be one of {sorted(names)} or None, got {backend!r}")
    return sdpa_kernel([names[backend]])


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _flatten_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return tree_flatten_spec((list(args), kwargs), info.in_spec)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    flat = list(args)
    for name in names[len(args) :]:
        flat.append(kwargs[name.lstrip("*")])
    return flat


def _to_fake(mode: FakeTensorMode, x: Any) -> Any:
    if _is_tensor(x):
        return mode.from_tensor(x, static_shapes=True)
    return x


def _module_type(n: fx.Node) -> str:
    """Class name of the module that issued ``n`` (BatchNorm's counter update is its node too)."""
    if n.op == "call_module":
        return type(n.graph.owning_module.get_submodule(str(n.target))).__name__
    stack = n.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][1])
    return ""


def _op_name(n: fx.Node) -> str:
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def estimate(
    gm: fx.GraphModule,
    args: tuple,
    kwargs: dict | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    sdpa_backend: str | None = None,
    rates: DeviceProfile | tuple[float, float] | None = None,
    time_ops: bool = False,
    step_time: StepTime | None = None,
    batch: Any = None,
    timer: Timer | None = None,
) -> CostGraph:
    """Price one forward+loss+backward step of ``gm`` on fake tensors (see module docstring).

    ``sdpa_backend``: the ``F.scaled_dot_product_attention`` kernel to price ("math", "flash",
    "efficient", "cudnn"); None prices the one the dispatcher picks for these inputs, the
    kernel the real step will use on the same device. ``graph.meta["sdpa_backend"]`` says which.
    ``rates``: the device to price time for, a ``planner.devices.DeviceProfile`` (or a
    (FLOP/s, bytes/s) pair); None prices the model's own device (``devices.profile_of``).
    ``time_ops``: also run each distinct aten call of the step once on the model's (real) device
    and price nodes by those timings (``passes/op_timing.py``), the roofline only for calls that
    cannot run on random tensors; ``Node.fwd_time_s`` / ``bwd_time_s`` then hold them.
    ``step_time``: with ``time_ops``, the real step of ``gm`` measured on the device
    (``planner.measurement.time_step``); node times are fitted to add up to it.
    ``batch``: the whole example input, for a ``loss_fn(output, batch)`` (it may hold labels
    that ``args``/``kwargs``, what ``gm`` takes, leave out; None: ``args``/``kwargs``).
    ``timer``: with ``time_ops``, where the calls' times come from (``op_timing.Timer``: a
    device's calibration, which times only the calls it lacks); None times them in this process
    (``op_timing.measure_timing``).
    """
    kwargs = kwargs or {}
    nodes = compute_nodes(gm)
    index = {n: i for i, n in enumerate(nodes)}
    last = len(nodes) - 1

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = {k: _to_fake(mode, v) for k, v in gm.named_parameters(remove_duplicate=False)}
    state.update({k: _to_fake(mode, v) for k, v in gm.named_buffers(remove_duplicate=False)})
    flat = [_to_fake(mode, x) for x in _flatten_inputs(gm, args, kwargs)]
    if batch is None:
        batch = dict(kwargs) if kwargs else tuple(args)
    batch_args, batch_kwargs = split_input(batch)
    fake_batch = join_input(
        batch,
        tuple(_to_fake(mode, a) for a in batch_args),
        {k: _to_fake(mode, v) for k, v in batch_kwargs.items()},
    )

    device = _device_of(gm, flat)
    if time_ops and device.type == "meta":
        raise ValueError(
            "time_ops needs the model and input on a real device (cpu or cuda), not meta; "
            "price a meta model by a device profile (rates=...) instead"
        )
    tracker = _Tracker(record_calls=time_ops)
    for t in [*state.values(), *flat, *tree_leaves(fake_batch)]:
        tracker.register_external(t)
    step = _Step(gm, tracker, index, mode)
    segments = BackwardSegments(tracker)
    bwd = segments.by_node
    on_backward_node, close_backward_segment = segments.enter, segments.close
    step.on_backward_node = on_backward_node

    with (
        torch.nn.utils.stateless._reparametrize_module(gm, state),
        _sdpa_kernel(sdpa_backend),
        mode,
        tracker,
        contextlib.ExitStack() as forward,
    ):
        forward.enter_context(amp_forward())  # to the loss (passes/step.py)
        try:
            out = step.run(*flat, enable_io_processing=False)
        except data_dependent_errors() as e:
            node = nodes[tracker.node] if 0 <= tracker.node < len(nodes) else None
            where = None if node is None else module_path(node)
            kind = None if node is None else _module_type(node).rsplit(".", 1)[-1] or None
            raise data_dependent_error("" if where is None else where, kind, e) from e
        except Exception as e:
            if sdpa_backend is None:
                raise
            raise ValueError(
                f"the graph does not run with sdpa_backend={sdpa_backend!r}: torch.export "
                "specialised it to the memory layout of the attention kernel it was captured "
                "with. Capture and estimate inside the same torch.nn.attention.sdpa_kernel(...) "
                "context you train with instead."
            ) from e
        for t in tree_leaves(out):
            if _is_tensor(t) and (rec := tracker.lookup(t)) is not None:
                rec.is_output = True
        out = gm.graph.process_outputs(out)
        # The loss step is not a graph node: charge it to the last node, forward and backward.
        tracker.node, tracker.phase = last, "fwd"
        loss_seg = _Segment(start_bytes=tracker.live_bytes)
        tracker.peak_bytes = tracker.live_bytes
        with torch.autograd.graph.saved_tensors_hooks(step._pack, _unpack):
            with loss_on_fake_tensors():
                loss = training_loss(out, loss_fn, fake_batch, warn=True)
        loss_seg.peak_above_start_bytes = tracker.peak_bytes - loss_seg.start_bytes
        if (loss_rec := tracker.lookup(loss)) is not None and loss_rec.node >= 0:
            loss_rec.held_to_end = True  # the caller holds the loss through backward
        step.claim_grad_fns(loss, last)
        del out
        tracker.release_casts(last)
        forward.close()
        tracker.phase = "bwd"
        on_backward_node(last)
        with amp_backward():
            loss.backward()
        close_backward_segment()
        del loss

    seq_lens = {d for x in flat if _is_tensor(x) for d in tuple(x.shape)[1:] if d > 1}
    if rates is None:
        rates = profile_of(device)
    elif not isinstance(rates, DeviceProfile):
        flops_per_s, bytes_per_s = rates
        rates = DeviceProfile("custom", flops_per_s, bytes_per_s, bytes_per_s)
    graph = _build(nodes, step, tracker, bwd, loss_seg, seq_lens, rates, sdpa_backend)
    graph = dataclasses.replace(graph, **device_fields(device, rates))
    if not time_ops:
        return graph
    return with_measured_times(graph, tracker, device, rates, step_time, timer)


def device_fields(device: torch.device, rates: DeviceProfile) -> dict[str, Any]:
    """The CostGraph fields that depend on the device and its profile.

    ``region_state_bytes`` (simulate's Rule 12): ``preserve_rng_state`` stashes
    ``torch.get_rng_state()``, a CPU tensor, device memory only on the CPU; CUDA's generator
    states are CPU tensors too, so 0 there (and on meta, which plans for an accelerator).
    Offloading (Rule 7) as the profile says: its host link, and how far transfers overlap."""
    stash = torch.get_rng_state().untyped_storage().nbytes() if device.type == "cpu" else 0
    return {
        "region_state_bytes": stash,
        "host_link": rates.host_link and device.type != "cpu",
        "offload_overlap": rates.offload_overlap,
    }


def with_measured_times(
    graph: CostGraph,
    tracker: _Tracker,
    device: torch.device,
    rates: DeviceProfile,
    step_time: StepTime | None,
    timer: Timer | None = None,
) -> CostGraph:
    """``graph`` with node times from its aten calls timed on ``device`` (the tracker recorded
    them: ``record_calls``) and the checkpoint overhead measured there, both from ``timer``
    (``op_timing.Timer``; None: ``op_timing.measure_timing``)."""
    calls = [call for recorded in tracker.calls.values() for call, _, _ in recorded if call]
    timing = (timer or measure_timing)(calls, device)
    if step_time is None:
        step_time = timing.step_time
    times, how = _measured_times(tracker, timing, rates, step_time)
    if timing.source:
        how += f"; calibration: {timing.source}"
    nodes = tuple(
        dataclasses.replace(
            n, fwd_time_s=times.get(("fwd", i), 0.0), bwd_time_s=times.get(("bwd", i), 0.0)
        )
        for i, n in enumerate(graph.nodes)
    )
    overhead = timing.checkpoint
    graph = dataclasses.replace(
        graph,
        nodes=nodes,
        region_overhead_s=overhead.region_s,
        saving_node_overhead_s=overhead.per_saving_node_s,
        selective_call_overhead_s=overhead.per_selective_call_s,
    )
    if step_time is not None and step_time.checkpointed_s is not None:
        # The step checkpointed whole recomputes the forward (to its last save): what that
        # takes beyond the plain step and the region's overhead, over the nodes' forward times.
        # Recomputation runs in backward, on storages backward just freed and hot caches, and
        # is often cheaper than the first forward.
        forward_s = sum(graph.node_time_s(i) for i in range(len(nodes)))
        extra_s = step_time.checkpointed_s - step_time.step_s
        extra_s -= graph.checkpoint_overhead_s(0, len(nodes))
        scale = min(2.0, max(0.25, extra_s / max(forward_s, 1e-12)))
        graph = dataclasses.replace(graph, recompute_scale=scale)
        how += f"; recomputation x {scale:.2f} of forward (a step checkpointed whole)"
    if step_time is not None and None not in (step_time.checkpointed_s, step_time.selective_s):
        # The same, under a selective policy that recomputes every op: the policy's dispatch,
        # per aten call, in forward and in the recomputation. Per call, not per node: a node
        # that dispatches several ops (a matmul's views and bmm) costs the policy as many times.
        calls = sum(n.fwd_calls for n in nodes)
        per_call_s = max(0.0, (step_time.selective_s - step_time.checkpointed_s) / max(calls, 1))
        graph = dataclasses.replace(graph, selective_call_overhead_s=per_call_s)
        how += f"; selective policy + {per_call_s * 1e6:.1f} us per call"
    return dataclasses.replace(graph, meta={**graph.meta, "timing": how})


def _measured_times(
    tracker: _Tracker, timing: DeviceTiming, rates: DeviceProfile, step_time: StepTime | None
) -> tuple[dict[tuple[str, int], float], str]:
    """Seconds per (phase, node): its aten calls timed alone on ``device`` (the roofline for
    those that cannot run alone), plus what the step spends per call around them, and how.

    With the real step's ``step_time`` (forward and backward measured on the device), that
    per-call share is fitted per phase so the phase adds up to its measured time: the model's
    own Python, autograd and dispatch, not a stand-in's. When the ops timed alone already take
    longer than the phase (they missed cache reuse the real step has), they are scaled down
    instead. Without it, the share of a stand-in chain (``op_timing.call_overhead_s``, in
    ``timing``).
    """
    measured = timing.op_times_s

    def alone(call: OpCall | None, flops: float, moved: float) -> float:
        seconds = None if call is None else measured.get(call.key_text)
        if seconds is None:
            return max(flops / rates.flops_per_s, moved / rates.bytes_per_s)
        return seconds

    alone_s: dict[tuple[str, int], float] = {
        where: sum(alone(*entry) for entry in recorded) for where, recorded in tracker.calls.items()
    }
    if step_time is None:
        overhead_s = timing.call_overhead_s
        how = f"ops timed alone + {overhead_s * 1e6:.1f} us per call (stand-in chain)"
        return {w: t + len(tracker.calls[w]) * overhead_s for w, t in alone_s.items()}, how
    times: dict[tuple[str, int], float] = {}
    how = []
    for phase, phase_s in (("fwd", step_time.forward_s), ("bwd", step_time.backward_s)):
        wheres = [w for w in alone_s if w[0] == phase]
        total_alone_s = sum(alone_s[w] for w in wheres)
        n_calls = sum(len(tracker.calls[w]) for w in wheres)
        if phase_s >= total_alone_s:
            per_call_s = (phase_s - total_alone_s) / max(n_calls, 1)
            times.update({w: alone_s[w] + len(tracker.calls[w]) * per_call_s for w in wheres})
            how.append(f"{phase} {phase_s * 1e3:.2f} ms: + {per_call_s * 1e6:.1f} us per call")
        else:
            scale = phase_s / total_alone_s
            times.update({w: alone_s[w] * scale for w in wheres})
            how.append(f"{phase} {phase_s * 1e3:.2f} ms: ops x {scale:.2f}")
    return times, "ops timed alone, fitted to the measured step (" + "; ".join(how) + ")"


def _build(
    nodes: list[fx.Node],
    step: _Step,
    tracker: _Tracker,
    bwd: dict[int, _Segment],
    loss_seg: _Segment,
    seq_lens: set[int],
    rates: DeviceProfile,
    sdpa_backend: str | None,
) -> CostGraph:
    index = {n: i for i, n in enumerate(nodes)}
    last = len(nodes) - 1
    tensors, produced_bytes, param_grad, grad_alloc, buffers = storage_records(
        tracker, [n.name for n in nodes], tracker.died_at
    )
    attention = _attention_nodes(nodes, index, step, seq_lens)
    skips = _skip_nodes(nodes, index, step)
    out_nodes: list[Node] = []
    for i, n in enumerate(nodes):
        seg = step.fwd.get(i, _Segment())
        fwd_above = seg.peak_above_start_bytes
        if i == last:
            loss_above = loss_seg.start_bytes - seg.start_bytes + loss_seg.peak_above_start_bytes
            fwd_above = max(fwd_above, loss_above)
        bseg = bwd.get(i, _Segment())
        name = _op_name(n)
        tags = node_tags(i, name, _module_type(n), attention, skips, tracker)
        if i in step.views and produced_bytes[i] == 0:
            tags.add("view")
        out_nodes.append(
            Node(
                name=n.name,
                op=name,
                inputs=tuple(sorted({index[a] for a in n.all_input_nodes if a in index})),
                module_path=module_path(n) or "",
                fwd_flops=tracker.flops.get(("fwd", i), 0),
                bwd_flops=tracker.flops.get(("bwd", i), 0),
                fwd_bytes_accessed=tracker.moved_bytes.get(("fwd", i), 0),
                bwd_bytes_accessed=tracker.moved_bytes.get(("bwd", i), 0),
                fwd_temp_bytes=max(0, fwd_above - produced_bytes[i]),
                bwd_temp_bytes=bseg.peak_above_start_bytes - grad_alloc[i] - param_grad[i],
                param_grad_bytes=param_grad[i],
                tags=frozenset(tags),
                state_bytes=sum(tracker.state_written.get(i, {}).values()),
                state_saved_bytes=_state_saved_bytes(tracker, i),
                saves_for_backward=i in tracker.allocated_at_last_save,
                fwd_calls=tracker.call_counts.get(("fwd", i), 0),
            )
        )
    # Which fused-attention kernel the prices assume: math materialises the S x S scores,
    # flash / memory-efficient keep only the output and a log-sum-exp per row.
    backends = ",".join(sorted(tracker.sdpa_backends)) or ("math" if sdpa_backend else None)
    return roofline_graph(out_nodes, tensors, buffers, rates, "fake tensors", backends)


def roofline_graph(
    nodes: list[Node],
    tensors: list[Tensor],
    buffers: list[GradBuffer],
    rates: DeviceProfile,
    estimator: str,
    sdpa_backend: str | None,
) -> CostGraph:
    """The CostGraph of priced nodes and storages, timed by ``rates``' roofline (until
    :func:`with_measured_times`), with what priced it in ``meta``."""
    meta = {
        "estimator": estimator,
        "device": rates.name,
        "rates": f"{rates.flops_per_s:.3g} FLOP/s, {rates.bytes_per_s:.3g} B/s",
        "timing": "roofline",
    }
    if sdpa_backend:
        meta["sdpa_backend"] = sdpa_backend
    return CostGraph(
        nodes=tuple(nodes),
        tensors=tuple(tensors),
        flops_per_s=rates.flops_per_s,
        bytes_per_s=rates.bytes_per_s,
        offload_bytes_per_s=rates.host_bytes_per_s,
        grad_buffers=tuple(buffers),
        meta=meta,
    )


def storage_records(
    tracker: _Tracker, names: list[str], died_at: dict[int, int] | None = None
) -> tuple[list[Tensor], list[int], list[int], list[int], list[GradBuffer]]:
    """The CostGraph's storages from a tracked step whose nodes are named ``names``.

    ``died_at``: id(storage record) -> node whose forward was running when it died, for
    ``Tensor.freed_after`` (eager code, where Python frees storages, not the last reader).

    Returns (tensors, bytes each node produces, parameter-gradient bytes and gradient-buffer
    bytes each node's backward allocates, gradient buffers).
    """
    # Forward storages that outlived their node are the graph's tensors.
    tensors: list[Tensor] = []
    produced_bytes = [0] * len(names)
    recs: list[_Storage] = []
    for i in range(len(names)):
        for rec in tracker.allocated.get(("fwd", i), []):
            survived = rec.alive or rec.users or rec.saved_by or rec.is_output or rec.held_to_end
            survived = survived or id(rec) in tracker.casts  # the cache held it
            if not survived:
                continue
            recs.append(rec)
    for t_i, rec in enumerate(recs):
        at_save = tracker.allocated_at_last_save.get(rec.node)
        after_last_save = (
            at_save is not None and tracker.allocated[("fwd", rec.node)].index(rec) >= at_save
        )
        users = tuple(sorted(u for u in rec.users if u != rec.node))
        grad_bytes = rec.nbytes if rec.requires_grad else 0
        died = (died_at or {}).get(id(rec), -1)
        tensors.append(
            Tensor(
                name=f"{names[rec.node]}:{t_i}",
                size_bytes=rec.nbytes,
                producer=rec.node,
                users=users,
                saved_by=tuple(sorted(rec.saved_by)),
                grad_bytes=grad_bytes,
                is_output=rec.is_output and not rec.held_to_end,
                held_to_end=rec.held_to_end or (rec.alive and not rec.is_output),
                written_by=tuple(sorted(w for w in rec.written_by if w != rec.node)),
                after_last_save=after_last_save,
                freed_after=died if died > max((rec.node, *users)) else -1,
            )
        )
        produced_bytes[rec.node] += rec.nbytes
    # Backward storages: alive after the step -> parameter gradients; freed by a later node's
    # backward -> a gradient buffer; freed within their own node -> part of its working set.
    param_grad = [0] * len(names)
    grad_alloc = [0] * len(names)
    buffers: list[GradBuffer] = []
    for (phase, i), allocated in tracker.allocated.items():
        if phase != "bwd" or i < 0:
            continue
        for r in allocated:
            if r.alive:
                param_grad[i] += r.nbytes
            elif r.freed_at is not None and r.freed_at < i:
                buffers.append(GradBuffer(r.nbytes, alloc_node=i, free_node=r.freed_at))
                grad_alloc[i] += r.nbytes
    return tensors, produced_bytes, param_grad, grad_alloc, buffers


def node_tags(
    i: int, op_name: str, module_type: str, attention: set[int], skips: set[int], tracker: _Tracker
) -> set[str]:
    """The tags of node ``i`` (short op name ``op_name``, issued by a ``module_type``) but
    ``view``, which depends on what the node produces."""
    tags = {tag for tag, nodes in (("attention", attention), ("skip", skips)) if i in nodes}
    if i in tracker.random_nodes:
        tags.add("random")
    if op_name.endswith("_") and not op_name.startswith("_"):
        tags.add("inplace")
    if "batch_norm" in op_name or "BatchNorm" in module_type:
        tags.add("batchnorm")
    return tags


def _attention_nodes(nodes, index, step: _Step, seq_lens: set[int]) -> set[int]:
    """Nodes whose outputs grow with the square of the sequence length.

    A fused attention op; a matmul whose output ends in (S, S) for an input's sequence length
    S (the scores); and every node after it that keeps an (S, S)-ended output computed from an
    attention node (scale, mask, softmax, dropout, casts), up to the matmul with V.
    """
    found: set[int] = set()
    for i, n in enumerate(nodes):
        name = _op_name(n)
        if "scaled_dot_product" in name or "attention" in name:
            found.add(i)
            continue
        square = any(
            len(s) >= 2 and s[-1] == s[-2] and s[-1] in seq_lens for s in step.shapes.get(i, [])
        )
        if not square:
            continue
        if name in _MATMULS or any(index.get(a) in found for a in n.all_input_nodes):
            found.add(i)
    return found


def _skip_nodes(nodes, index, step: _Step) -> set[int]:
    """Producers of values read by two consumers far apart (residual streams, U-Net links)."""
    found: set[int] = set()
    is_view = [i in step.views for i in range(len(nodes))]
    prefix = [0]
    for v in is_view:
        prefix.append(prefix[-1] + (not v))
    for i, n in enumerate(nodes):
        users = sorted(index[u] for u in n.users if u in index)
        if len(users) >= 2 and prefix[users[-1]] - prefix[users[0] + 1] >= SKIP_GAP_NODES:
            found.add(i)
    return found


def _device_of(gm: fx.GraphModule, flat: list[Any]) -> torch.device:
    for t in [*gm.parameters(), *gm.buffers(), *flat]:
        if _is_tensor(t):
            return t.device
    return torch.device("cpu")


def _state_saved_bytes(tracker: Any, i: int) -> int:
    """The bytes of the model buffers node ``i`` writes in forward and also saves for backward
    (see ``Node.state_saved_bytes``)."""
    written = tracker.state_written.get(i, {})
    return sum(n for k, n in written.items() if k in tracker.state_saved.get(i, ()))
