"""Estimate: price every node of a captured training step, on fake tensors.

In: a GraphModule (from ``passes/capture.py``), its example args/kwargs, and optionally the loss
function. Out: a :class:`solvers.costgraph.CostGraph` whose ``nodes`` are the graph's
call_function / call_method / call_module nodes in graph order, named as in the graph.

How: the step (forward, loss per ``passes/step.training_loss``, backward) runs ONCE under
``FakeTensorMode``, so no real memory is allocated and no real arithmetic is done, which is what
lets a 7B-parameter shape be priced on a laptop. Underneath the fake mode a dispatch-mode tracker
sees every aten operation and every storage it creates; a weakref finalizer on each storage says
when it dies. The forward runs node by node (an fx Interpreter) and the backward is attributed to
forward nodes through pre-hooks on the autograd nodes each forward node created. That yields,
per node: the storages it allocates (views allocate nothing), who reads them, which of them
autograd saves for backward (``saved_tensors_hooks``), the working memory it needs beyond that
(forward and backward), the parameter gradients its backward creates, FLOPs
(``torch.utils.flop_counter`` formulas) and bytes moved.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._pytree import tree_flatten_spec
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from passes.step import training_loss
from solvers.costgraph import CostGraph, GradBuffer, Node, Tensor

COMPUTE_OPS = ("call_function", "call_method", "call_module")
# Forward nodes that leave no storage this long after their own use are "skip" producers.
SKIP_SPAN_NODES = 8


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


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


class _Tracker(TorchDispatchMode):
    """Sees every aten op under the fake mode: new storages, frees, FLOPs, bytes moved."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.by_key: dict[int, _Storage] = {}
        self.node = -1
        self.phase = "fwd"
        self.flops: dict[tuple[str, int], int] = defaultdict(int)
        self.moved_bytes: dict[tuple[str, int], int] = defaultdict(int)
        self.random_nodes: set[int] = set()
        self.allocated: dict[tuple[str, int], list[_Storage]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        where = (self.phase, self.node)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops[where] += int(formula(*args, **kwargs, out_val=out))
        if torch.Tag.nondeterministic_seeded in func.tags and self.phase == "fwd":
            self.random_nodes.add(self.node)
        if not func.is_view:
            # Roofline traffic: every input read once, every output written once.
            leaves = tree_leaves((args, kwargs, out))
            self.moved_bytes[where] += sum(
                t.numel() * t.element_size() for t in leaves if _is_tensor(t)
            )
        for t in tree_leaves(out):
            if _is_tensor(t):
                self.track(t)
        return out

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


class _Step(fx.Interpreter):
    """Runs the forward node by node, recording storages, users, saves and autograd nodes."""

    def __init__(self, gm: fx.GraphModule, tracker: _Tracker, index: dict[fx.Node, int]):
        super().__init__(gm)
        self.tracker = tracker
        self.index = index
        self.fwd: dict[int, _Segment] = {}
        self.grad_fn_node: dict[Any, int] = {}
        self.views: set[int] = set()

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
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            out = super().run_node(n)
        seg.peak_above_start_bytes = tr.peak_bytes - seg.start_bytes
        self.fwd[i] = seg
        outs = [t for t in tree_leaves(out) if _is_tensor(t)]
        if outs and all(id(tr.lookup(t)) in read for t in outs):
            self.views.add(i)
        self.claim_grad_fns(out, i)
        return out

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        rec = self.tracker.lookup(t)
        if rec is not None and rec.node >= 0:
            rec.saved_by.add(self.tracker.node)
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


def _module_path(n: fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return path if isinstance(path, str) else ""
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
) -> CostGraph:
    """Price one forward+loss+backward step of ``gm`` on fake tensors (see module docstring)."""
    kwargs = kwargs or {}
    nodes = compute_nodes(gm)
    index = {n: i for i, n in enumerate(nodes)}
    last = len(nodes) - 1

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = {k: _to_fake(mode, v) for k, v in gm.named_parameters(remove_duplicate=False)}
    state.update({k: _to_fake(mode, v) for k, v in gm.named_buffers(remove_duplicate=False)})
    flat = [_to_fake(mode, x) for x in _flatten_inputs(gm, args, kwargs)]

    tracker = _Tracker()
    for t in [*state.values(), *flat]:
        tracker.register_external(t)
    step = _Step(gm, tracker, index)
    bwd: dict[int, _Segment] = {}

    def on_backward_node(i: int) -> None:
        if i == tracker.node and tracker.phase == "bwd" and i in bwd:
            return  # another autograd node of the same forward node: one working set
        close_backward_segment()
        tracker.node = i
        bwd.setdefault(i, _Segment(start_bytes=tracker.live_bytes))
        segment_start[0] = tracker.live_bytes
        tracker.peak_bytes = tracker.live_bytes

    segment_start = [0]

    def close_backward_segment() -> None:
        seg = bwd.get(tracker.node)
        if seg is not None:
            above = tracker.peak_bytes - segment_start[0]
            seg.peak_above_start_bytes = max(seg.peak_above_start_bytes, above)

    step.on_backward_node = on_backward_node

    with torch.nn.utils.stateless._reparametrize_module(gm, state), mode, tracker:
        out = step.run(*flat, enable_io_processing=False)
        for t in tree_leaves(out):
            if _is_tensor(t) and (rec := tracker.lookup(t)) is not None:
                rec.is_output = True
        out = gm.graph.process_outputs(out)
        # The loss step is not a graph node: charge it to the last node, forward and backward.
        tracker.node, tracker.phase = last, "fwd"
        loss_seg = _Segment(start_bytes=tracker.live_bytes)
        tracker.peak_bytes = tracker.live_bytes
        with torch.autograd.graph.saved_tensors_hooks(step._pack, _unpack):
            loss = training_loss(out, loss_fn)
        loss_seg.peak_above_start_bytes = tracker.peak_bytes - loss_seg.start_bytes
        step.claim_grad_fns(loss, last)
        del out
        tracker.phase = "bwd"
        on_backward_node(last)
        loss.backward()
        close_backward_segment()
        del loss

    return _build(gm, nodes, step, tracker, bwd, loss_seg)


def _build(gm, nodes, step: _Step, tracker: _Tracker, bwd, loss_seg: _Segment) -> CostGraph:
    index = {n: i for i, n in enumerate(nodes)}
    last = len(nodes) - 1
    # Forward storages that outlived their node are the graph's tensors.
    tensors: list[Tensor] = []
    produced_bytes = [0] * len(nodes)
    first_grad_node: dict[int, int] = {}
    recs: list[_Storage] = []
    for i in range(len(nodes)):
        for rec in tracker.allocated.get(("fwd", i), []):
            survived = rec.alive or rec.users or rec.saved_by or rec.is_output
            if not survived:
                continue
            recs.append(rec)
    for t_i, rec in enumerate(recs):
        users = tuple(sorted(u for u in rec.users if u != rec.node))
        grad_bytes = rec.nbytes if rec.requires_grad else 0
        tensors.append(
            Tensor(
                name=f"{nodes[rec.node].name}:{t_i}",
                size_bytes=rec.nbytes,
                producer=rec.node,
                users=users,
                saved_by=tuple(sorted(rec.saved_by)),
                grad_bytes=grad_bytes,
                is_output=rec.is_output,
            )
        )
        produced_bytes[rec.node] += rec.nbytes
        if grad_bytes and users:
            first_grad_node[t_i] = max(users)
    # Backward storages: alive after the step -> parameter gradients; freed by a later node's
    # backward -> a gradient buffer; freed within their own node -> part of its working set.
    param_grad = [0] * len(nodes)
    grad_alloc = [0] * len(nodes)
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

    out_nodes: list[Node] = []
    for i, n in enumerate(nodes):
        seg = step.fwd.get(i, _Segment())
        fwd_above = seg.peak_above_start_bytes
        if i == last:
            loss_above = loss_seg.start_bytes - seg.start_bytes + loss_seg.peak_above_start_bytes
            fwd_above = max(fwd_above, loss_above)
        bseg = bwd.get(i, _Segment())
        tags = set()
        if i in tracker.random_nodes:
            tags.add("random")
        name = _op_name(n)
        if name.endswith("_") and not name.startswith("_"):
            tags.add("inplace")
        if "batch_norm" in name or "BatchNorm" in str(n.target):
            tags.add("batchnorm")
        if i in step.views and produced_bytes[i] == 0:
            tags.add("view")
        out_nodes.append(
            Node(
                name=n.name,
                op=name,
                inputs=tuple(sorted({index[a] for a in n.all_input_nodes if a in index})),
                module_path=_module_path(n),
                fwd_flops=tracker.flops.get(("fwd", i), 0),
                bwd_flops=tracker.flops.get(("bwd", i), 0),
                fwd_bytes_accessed=tracker.moved_bytes.get(("fwd", i), 0),
                bwd_bytes_accessed=tracker.moved_bytes.get(("bwd", i), 0),
                fwd_temp_bytes=max(0, fwd_above - produced_bytes[i]),
                bwd_temp_bytes=max(0, bseg.peak_above_start_bytes - grad_alloc[i] - param_grad[i]),
                param_grad_bytes=param_grad[i],
                tags=frozenset(tags),
            )
        )
    return CostGraph(
        nodes=tuple(out_nodes),
        tensors=tuple(tensors),
        grad_buffers=tuple(buffers),
        meta={"estimator": "fake"},
    )
