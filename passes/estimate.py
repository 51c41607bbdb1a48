"""Estimate: price every node of a captured training step, on fake tensors.

In: a GraphModule (from ``passes/capture.py``), its example args/kwargs, and optionally the loss
function. Out: a :class:`planner.solvers.costgraph.CostGraph` whose ``nodes`` are the graph's
call_function / call_method / call_module nodes in graph order, named as in the graph.

How: the step (forward, loss per ``passes/step.training_loss``, backward) runs ONCE under
``FakeTensorMode``, so no real memory is allocated and no real arithmetic is done, which is what
lets a 7B-parameter shape be priced on a laptop, with the tracker of ``passes/trace.py`` beneath
it. The forward runs node by node (an fx Interpreter), one tracker record per graph node (the
loss step is charged to the last node, as a step outside every region: ``_charged_to``);
autograd saves and the backward are attributed to forward nodes as in the eager estimator
(``passes/trace.py``).
``passes/costing.py`` turns the records into the CostGraph (the same step as the eager
estimator's), timed by the device rates the caller passes.

Sizes are those of the device and dtypes the step really runs with: CPU, CUDA or meta tensors
(a model built on the meta device is priced without allocating it), under the caller's
``torch.autocast`` and ``sdpa_kernel`` contexts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._pytree import tree_flatten_spec

from planner.passes.costing import cost_graph, with_measured_times
from planner.passes.nodes import module_path
from planner.passes.op_timing import Timer
from planner.passes.step import (
    StepTime,
    amp_forward,
    data_dependent_error,
    data_dependent_errors,
    loss_on_fake_tensors,
    training_loss,
)
from planner.passes.trace import FakeStep, OpRecord, Tracker, fake_step, is_tensor
from planner.solvers.costgraph import CostGraph
from planner.solvers.rates import DeviceProfile

COMPUTE_OPS = ("call_function", "call_method", "call_module")


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The fx nodes that become CostGraph nodes, in graph order (the 1:1 name map)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op in COMPUTE_OPS and not (n.op == "call_module" and n.target == "_guards_fn")
    ]


class _Step(fx.Interpreter):
    """Runs the forward node by node under the tracker, one record per compute node."""

    def __init__(self, gm: fx.GraphModule, step: FakeStep, index: dict[fx.Node, int]):
        super().__init__(gm)
        # fx.Interpreter frees a value after its last user, so one with no user (an unused
        # select export leaves behind) stayed in its env to the end, holding the storage it
        # views; the GraphModule's own code frees it at once (fx codegen), as here.
        for node in gm.graph.nodes:
            if not node.users and node.op != "output":
                self.user_to_last_uses.setdefault(node, []).append(node)
        self.step = step
        self.tracker = step.tracker
        self.constants: dict[str, torch.Tensor] = {}
        self.index = index

    def fetch_attr(self, target: str) -> Any:
        # Tensor constants that are neither parameters nor buffers (export's lifted constants,
        # plain tensor attributes): faked on first use, part of the baseline like parameters.
        value = super().fetch_attr(target)
        if is_tensor(value) and not isinstance(value, FakeTensor):
            if target not in self.constants:
                self.constants[target] = self.step.fake(value)
            value = self.constants[target]
        return value

    def run_node(self, n: fx.Node) -> Any:
        i = self.index.get(n)
        if i is None:
            return super().run_node(n)
        tr = self.tracker
        read, _, seg = tr.enter_node(i, [self.env[a] for a in n.all_input_nodes])
        out = super().run_node(n)
        tr.claim(tr.exit_node(tr.records[i], read, seg, out), i)
        return out


@contextlib.contextmanager
def _charged_to(tracker: Tracker, last: int) -> Iterator[None]:
    """Run the loss step charged to node ``last``, as a step outside every region: its working
    set joins the node's forward peak; its FLOPs, traffic and calls go to the tracker's phase
    "loss", which ``passes/costing.py`` adds to the node's backward (in the step's totals,
    never in a region's recomputation or a selective policy's calls); what it saves for its
    backward, its own storages and the outputs it reads, is held whatever the schedule
    (``costing.loss_step_holds``), not dropped by a region that ends at ``last``. Its saves do
    not move the node's last save: recomputing the node runs no loss.

    Needed in this form only. Here the CostGraph's nodes are the GraphModule's compute nodes,
    one to one (``compute_nodes``: regions are named by them), and a graph solver may place a
    region over any run of nodes; the loss runs outside the GraphModule, so a node of its own
    would be one no region could checkpoint. The eager estimator records the loss's aten ops as
    nodes of their own (``step:...``): its regions are module calls, which never hold them.
    """
    tracker.node, tracker.phase, tracker.outside_node = last, "fwd", True
    tracker.peak_bytes = tracker.live_bytes
    try:
        yield
    finally:
        tracker.outside_node = False
    seg = tracker.records[last].fwd
    seg.peak_above_start_bytes = max(
        seg.peak_above_start_bytes, tracker.peak_bytes - seg.start_bytes
    )


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


def _flatten_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return tree_flatten_spec((list(args), kwargs), info.in_spec)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    flat = list(args)
    for name in names[len(args) :]:
        flat.append(kwargs[name.lstrip("*")])
    return flat


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
    rates: DeviceProfile | tuple[float, float],
    time_ops: bool = False,
    step_time: StepTime | None = None,
    batch: Any = None,
    timer: Timer | None = None,
) -> CostGraph:
    """Price one forward+loss+backward step of ``gm`` on fake tensors (see module docstring).

    ``sdpa_backend``: the ``F.scaled_dot_product_attention`` kernel to price ("math", "flash",
    "efficient", "cudnn"); None prices the one the dispatcher picks for these inputs, the
    kernel the real step will use on the same device. ``graph.meta["sdpa_backend"]`` says which.
    ``rates``: the device to price time for, a ``DeviceProfile`` (or a (FLOP/s, bytes/s) pair);
    the planner passes the model's own device's (``planner.devices.profile_of_model``).
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

    if batch is None:
        batch = dict(kwargs) if kwargs else tuple(args)
    fs = fake_step(gm, batch, Tracker(record_calls=time_ops))
    # what the graph takes, flattened to its placeholders (a part of the batch)
    flat = [fs.fake(x) for x in _flatten_inputs(gm, args, kwargs)]
    tracker, device, fake_batch = fs.tracker, fs.device, fs.batch
    tracker.records = [
        OpRecord(
            name=n.name,
            op=_op_name(n),
            module_path=module_path(n) or "",
            inputs={index[a] for a in n.all_input_nodes if a in index},
            module_type=_module_type(n),
        )
        for n in nodes
    ]
    step = _Step(gm, fs, index)

    with _sdpa_kernel(sdpa_backend), fs.running(), contextlib.ExitStack() as forward:
        forward.enter_context(amp_forward())  # to the loss (passes/step.py)
        forward.enter_context(tracker.saving())
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
        tracker.mark_outputs(out)
        out = gm.graph.process_outputs(out)
        with _charged_to(tracker, last), loss_on_fake_tensors():
            loss = training_loss(out, loss_fn, fake_batch, warn=True)
        tracker.claim([loss], last)  # and its backward
        del out
        tracker.release_casts(last)
        forward.close()
        tracker.backward(loss, last)
        del loss

    if not isinstance(rates, DeviceProfile):
        flops_per_s, bytes_per_s = rates
        rates = DeviceProfile("custom", flops_per_s, bytes_per_s, bytes_per_s)
    for i, record in enumerate(tracker.records):
        record.fwd_calls = tracker.call_counts.get(("fwd", i), 0)
    backend = "math" if sdpa_backend else None
    graph = cost_graph(tracker, flat, rates, device, "fake tensors", backend)
    if not time_ops:
        return graph
    return with_measured_times(graph, tracker, device, rates, step_time, timer)
