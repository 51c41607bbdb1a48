"""The data every solver sees: a priced training step, and the schedule a solver returns.

Pure data, no torch. ``passes/estimate.py`` builds a :class:`CostGraph` from a captured
GraphModule; solvers read it and return a :class:`Schedule`; ``solvers/simulate.py`` replays a
Schedule over the CostGraph to predict the step's peak memory and its recomputation cost.

Memory is modelled per *storage* (:class:`Tensor`), not per node: views allocate nothing and keep
their base storage alive, one node may allocate several storages (an output plus, say, a dropout
mask it saves), and one storage may be saved for backward by several nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

RegionKind = Literal["recompute", "selective", "offload"]
# What a solver minimises beside fitting the budget: the step's predicted time, or its
# recomputed FLOPs (graph_for_objective).
Objective = Literal["time", "flops"]
OBJECTIVES: tuple[Objective, ...] = ("time", "flops")
# Under the "flops" objective a schedule's predicted time only breaks ties between equal FLOPs
# (a kept softmax beats a kept copy when neither has FLOPs). Its weight makes the recomputation
# of every node this many times over, each in a selective region of its own, worth less than
# one FLOP (FLOPs are whole numbers). A fixed weight (1e-3) let a tiny model's measured
# checkpoint overheads outweigh its FLOPs: GPT-ref-small at SAC's peak recomputed 0 or 4 MFLOPs
# as the machine's load moved the calibrated selective-call cost.
FLOPS_TIE_RECOMPUTES = 4


@dataclass(frozen=True)
class Node:
    """One operation of the forward pass, in execution (topological) order.

    ``inputs`` are indices of nodes whose outputs this node reads (data edges of the DAG).
    FLOPs follow ``torch.utils.flop_counter`` (0 for pointwise ops); ``*_bytes_accessed``
    is what the op reads and writes, for the roofline runtime estimate.
    ``param_grad_bytes`` are parameter gradients first allocated by this node's backward;
    they live until the end of the step. ``state_bytes`` are model buffers the node writes in
    forward (BatchNorm running statistics): a region around it keeps a copy of their pre-step
    values for its recomputation, and makes one more while recomputing (passes/rewrite.py).
    ``state_saved_bytes``: the part of ``state_bytes`` the node's forward also saves for
    backward (BatchNorm's running statistics, which ``native_batch_norm_backward`` takes).
    ``bwd_temp_bytes`` is the node's backward peak above what it allocates to keep (gradients,
    parameter gradients); negative when the backward frees something before its last such
    allocation (a linear's saved input, before its bias gradient is summed).
    ``saves_for_backward``: its forward saves something for backward (an activation, a
    parameter or an input); when no node says so, ``Tensor.saved_by`` stands in.
    ``draws_random``: its forward dispatches an op that draws from the RNG (one tagged
    ``torch.Tag.nondeterministic_seeded``: dropout in training, ``rand*``, ``bernoulli``...).
    Only a checkpoint over such a node needs its RNG state back on recomputation
    (``preserve_rng_state``), so only it stashes one (``CostGraph.region_stash_bytes``,
    simulate's Rule 12).
    """

    name: str
    op: str = ""
    inputs: tuple[int, ...] = ()
    module_path: str = ""
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes_accessed: int = 0
    bwd_bytes_accessed: int = 0
    fwd_temp_bytes: int = 0
    bwd_temp_bytes: int = 0
    param_grad_bytes: int = 0
    tags: frozenset[str] = frozenset()
    state_bytes: int = 0
    state_saved_bytes: int = 0
    saves_for_backward: bool = False
    fwd_calls: int = 1  # aten ops its forward dispatches (each seen by a selective policy)
    draws_random: bool = False
    # Measured runtimes of the node's forward / backward on the device (passes/op_timing.py);
    # None: priced by the roofline.
    fwd_time_s: float | None = None
    bwd_time_s: float | None = None


@dataclass(frozen=True)
class Tensor:
    """One storage allocated during the forward pass.

    ``producer`` allocates it; ``users`` read it in forward (view-resolved); ``saved_by`` are
    the nodes whose backward needs it, so autograd keeps it alive until the earliest of those
    (in forward order) has run its backward. ``grad_bytes`` is the size of its gradient buffer
    in backward (0 when it does not require grad). ``is_output`` marks graph outputs, which
    live until backward starts. ``held_to_end`` marks storages something outside autograd keeps
    to the end of the step (autocast's cache of low-precision weight copies); recomputation
    reuses them instead of allocating them again. ``written_by`` are the nodes that write it in
    place in forward (``relu_``, ``x += y``): no region boundary may lie between its producer
    and such a writer (see ``planner.solvers.cuts.forbidden_cuts``). ``after_last_save``: its
    producer allocates it after its own last save for backward (a linear's output: autograd
    saves the inputs before the matmul runs), so a recomputation that stops early at that node
    never allocates it. ``freed_after``: in eager code Python, not the last reader, frees a
    storage (``att`` in ``att = drop(softmax(att))`` lives until ``drop`` returns): the node
    whose forward it outlives without reading it (-1: none, it dies after its last reader).
    """

    name: str
    size_bytes: int
    producer: int
    users: tuple[int, ...] = ()
    saved_by: tuple[int, ...] = ()
    grad_bytes: int = 0
    is_output: bool = False
    held_to_end: bool = False
    written_by: tuple[int, ...] = ()
    after_last_save: bool = False
    freed_after: int = -1


@dataclass(frozen=True)
class GradBuffer:
    """A buffer that node ``alloc_node``'s backward creates and node ``free_node``'s frees.

    Gradients of activations (whole, or partial ones before accumulation, or a buffer that
    several inputs' gradients are views of). Backward visits nodes in reverse order whatever
    the schedule, so these lifetimes are the same for every schedule.
    """

    size_bytes: int
    alloc_node: int
    free_node: int


@dataclass(frozen=True)
class BufferChange:
    """Bytes something outside autograd allocates (``delta_bytes`` > 0) or frees (< 0) at a
    fixed point of the step, whatever the schedule: FSDP2's all-gathered parameters, its
    all-gather and reduce-scatter buffers and sharded gradients (``planner/fsdp.py``).

    ``after``: ("fwd", i) once node i's forward is done (i = -1: as the step starts);
    ("bwd", i) once node i's backward is done (i = len(nodes): as backward starts, once the
    forward's outputs are released), so before any recomputation of a region ending at node
    i - 1. Changes at one point apply in the order given.
    """

    after: tuple[str, int]
    delta_bytes: int
    what: str = ""


@dataclass(frozen=True)
class CostGraph:
    """A priced forward+backward step. ``nodes`` in execution order; ``tensors`` any order.

    ``grad_buffers``: when given (the estimator observes them), the gradient buffers of
    backward exactly; when None, each storage's gradient is ``Tensor.grad_bytes``, allocated at
    the backward of its last forward user and freed at its producer's.
    """

    nodes: tuple[Node, ...]
    tensors: tuple[Tensor, ...]
    # Device rates for the roofline runtime estimate (calibrated or defaults).
    flops_per_s: float = 1e11
    bytes_per_s: float = 1e10
    # Host<->device transfer rate that offload regions are charged at.
    offload_bytes_per_s: float = 1e10
    # The fraction of an offload region's own compute that its transfers can hide behind (a
    # copy stream beside the compute stream; 0: transfers are fully exposed). See simulate's
    # Rule 7.
    offload_overlap: float = 0.0
    # Whether offloading frees device memory (a GPU's host link). On a CPU host memory is the
    # device's: solvers then never offload (simulate's Rule 7 would credit bytes still there).
    host_link: bool = False
    grad_buffers: tuple[GradBuffer, ...] | None = None
    # What a checkpoint region adds to a step's time beyond recomputing its nodes
    # (region_overhead_time_s; measured on the device by passes/op_timing.py, 0 for roofline
    # prices): once per region, per node in it that saves for backward, per aten call
    # (Node.fwd_calls) of a selective region (its policy's dispatch mode sees each one). An
    # offload region's own: once per region, per storage it sends to host and fetches back
    # (offloaded_storages; its pack, copies, events and unpack -- not per saving node: one
    # node can save several storages, and GPT's blocks sent 34 storages from 26 saving nodes).
    region_overhead_s: float = 0.0
    saving_node_overhead_s: float = 0.0
    selective_call_overhead_s: float = 0.0
    offload_region_overhead_s: float = 0.0
    offloaded_storage_overhead_s: float = 0.0
    # A node's recomputation over its forward time (node_recompute_time_s): fitted on the device
    # to a step checkpointed whole (passes/estimate.py); 1 for roofline prices.
    recompute_scale: float = 1.0
    # Module-granular plans (applied in place to the user's own modules): the only node
    # intervals [start, stop) a region may cover, each the ops of one call of one submodule.
    # None: any interval of allowed cuts.
    region_spans: frozenset[tuple[int, int]] | None = None
    # Buffers held outside autograd at fixed points of the step (FSDP2's, per rank); the
    # budget's baseline is what is allocated before the step, so these count.
    buffer_changes: tuple[BufferChange, ...] = ()
    # What a checkpoint region's call stashes to restore on recomputation, in device bytes
    # (torch.utils.checkpoint's preserve_rng_state: the CPU generator's state, 5056 bytes on
    # the CPU; on CUDA the device RNG states are CPU tensors, so 0), when the region needs it:
    # only regions over a node that draws random numbers (region_stash_bytes). See simulate's
    # Rule 12.
    region_state_bytes: int = 0
    meta: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def node_time_s(self, i: int, backward: bool = False) -> float:
        """Runtime of node ``i``'s forward (or backward): measured when the node carries a
        measurement, else the roofline max(FLOPs / FLOP rate, bytes moved / bandwidth)."""
        n = self.nodes[i]
        measured = n.bwd_time_s if backward else n.fwd_time_s
        if measured is not None:
            return measured
        flops = n.bwd_flops if backward else n.fwd_flops
        moved = n.bwd_bytes_accessed if backward else n.fwd_bytes_accessed
        return max(flops / self.flops_per_s, moved / self.bytes_per_s)

    def node_recompute_time_s(self, i: int) -> float:
        """Runtime of node ``i``'s forward run again by a checkpoint's recomputation."""
        return self.node_time_s(i) * self.recompute_scale

    def region_overhead_time_s(self, region: Region) -> float:
        """Seconds ``region``'s checkpoint bookkeeping adds to the step (see the fields above)."""
        return self.checkpoint_overhead_s(region.start, region.stop, region.kind)

    def checkpoint_overhead_s(self, start: int, stop: int, kind: str = "recompute") -> float:
        """What a region of ``kind`` over nodes [start, stop) adds beyond its recomputation (an
        offload region: beyond its exposed copies)."""
        if kind == "offload":
            sent = self.offloaded_storages(start, stop)
            return self.offload_region_overhead_s + sent * self.offloaded_storage_overhead_s
        saving, calls = self._overhead_prefix
        saves = saving[stop] - saving[start]
        overhead_s = self.region_overhead_s + saves * self.saving_node_overhead_s
        if kind == "selective":
            overhead_s += (calls[stop] - calls[start]) * self.selective_call_overhead_s
        return overhead_s

    def offloaded_storages(self, start: int, stop: int) -> int:
        """See simulate's Rule 7: the storages an offload region over nodes [start, stop) sends
        to host, each once: made inside it and saved by a node inside it."""
        first_savers = self._first_savers
        return sum(s < stop for i in range(start, stop) for s in first_savers[i])

    def preserves_rng_state(self, start: int, stop: int) -> bool:
        """Whether a checkpoint over nodes [start, stop) runs with ``preserve_rng_state``: a
        node in it, at any depth, draws random numbers (``Node.draws_random``), so its
        recomputation must replay the same draws. The one fact both application paths
        (``passes/rewrite.py``, ``planner/inplace.py``) and every price (simulate's Rule 12)
        follow."""
        prefix = self._random_prefix
        return prefix[stop] > prefix[start]

    def region_stash_bytes(self, start: int, stop: int) -> int:
        """See simulate's Rule 12: the device bytes a checkpoint call over nodes [start, stop)
        stashes (and its recomputation copies once more): ``region_state_bytes`` when it
        preserves its RNG state (:meth:`preserves_rng_state`), else 0."""
        if not self.region_state_bytes or not self.preserves_rng_state(start, stop):
            return 0
        return self.region_state_bytes

    @cached_property
    def _random_prefix(self) -> tuple[int, ...]:
        prefix = [0]
        for n in self.nodes:
            prefix.append(prefix[-1] + n.draws_random)
        return tuple(prefix)

    @cached_property
    def _overhead_prefix(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Prefix counts of the nodes that save for backward and of their forward calls."""
        saving, calls = [0], [0]
        for n in self.nodes:
            saving.append(saving[-1] + n.saves_for_backward)
            calls.append(calls[-1] + n.fwd_calls)
        return tuple(saving), tuple(calls)

    @cached_property
    def _first_savers(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the first node that saves each storage it makes (savers run at or
        after the producer, so a region from the producer on holds that saver iff it holds the
        first)."""
        by_producer: list[list[int]] = [[] for _ in self.nodes]
        for t in self.tensors:
            if t.saved_by and 0 <= t.producer < len(self.nodes):
                by_producer[t.producer].append(min(t.saved_by))
        return tuple(tuple(savers) for savers in by_producer)

    @cached_property
    def step_time_s(self) -> float:
        """Runtime estimate of one forward+backward step without recomputation."""
        return sum(
            self.node_time_s(i) + self.node_time_s(i, backward=True) for i in range(len(self.nodes))
        )

    @property
    def fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def step_flops(self) -> int:
        """FLOPs of one forward+backward step without recomputation."""
        return sum(n.fwd_flops + n.bwd_flops for n in self.nodes)


@dataclass(frozen=True)
class Region:
    """Nodes ``start <= i < stop`` run under one checkpoint.

    ``depth`` 0 is outermost; a region of depth d+1 lies inside one of depth d.
    ``kind``: 'recompute' drops everything the region saves and recomputes it in backward;
    'selective' keeps the outputs of the nodes in ``saved_nodes`` and recomputes the rest;
    'offload' keeps what it saves in host memory instead of on the device.
    """

    start: int
    stop: int
    depth: int = 0
    kind: RegionKind = "recompute"
    saved_nodes: frozenset[int] = frozenset()

    def __contains__(self, i: int) -> bool:
        return self.start <= i < self.stop

    def covers(self, other: Region) -> bool:
        return self.start <= other.start and other.stop <= self.stop and self != other


@dataclass(frozen=True)
class Schedule:
    """A solver's answer: checkpoint regions (a laminar family of intervals)."""

    regions: tuple[Region, ...] = ()
    solver: str = "none"
    # Optimality gap reported by exact solvers (0.0 proven optimal; None unknown).
    gap: float | None = None
    note: str = ""


def check_objective(objective: str) -> None:
    """ValueError naming the objectives for one that is not among them."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def graph_for_objective(graph: CostGraph, objective: Objective) -> CostGraph:
    """The graph a solver sees so that minimising its recomputation time minimises
    ``objective``: ``graph`` itself for ``"time"``; for ``"flops"``, the recomputed FLOPs, the
    predicted time breaking ties only (:func:`weighted_graph` at :func:`flops_tie_weight`; an
    offload region's exposed transfers keep their weight 1). Memory is unchanged, so plans fit
    the same budgets; predict a plan's time on ``graph``, not on this."""
    check_objective(objective)
    if objective == "time":
        return graph
    return weighted_graph(graph, flops_weight=1.0, time_weight=flops_tie_weight(graph))


def flops_tie_weight(graph: CostGraph) -> float:
    """The weight of the predicted time beside the FLOPs' time under the "flops" objective: the
    time of FLOPS_TIE_RECOMPUTES recomputations of every node, each in a selective region of
    its own, weighs less than one FLOP at the graph's rate."""
    n = len(graph.nodes)
    whole_s = sum(graph.node_recompute_time_s(i) for i in range(n))
    whole_s += n * graph.region_overhead_s + graph.checkpoint_overhead_s(0, n, "selective")
    bound_s = FLOPS_TIE_RECOMPUTES * whole_s * graph.flops_per_s
    return 0.5 / bound_s if bound_s > 0 else 1.0


def weighted_graph(graph: CostGraph, flops_weight: float, time_weight: float = 1.0) -> CostGraph:
    """``graph`` with every node's forward re-timed so that a solver minimising recomputation
    time minimises ``time_weight`` x the predicted recomputation time (checkpointing's own
    overhead included) + ``flops_weight`` x the recomputed FLOPs' time at ``graph.flops_per_s``.
    Memory is unchanged."""
    nodes = tuple(
        replace(
            n,
            fwd_time_s=flops_weight * n.fwd_flops / graph.flops_per_s
            + time_weight * graph.node_recompute_time_s(i),
        )
        for i, n in enumerate(graph.nodes)
    )
    return replace(
        graph,
        nodes=nodes,
        recompute_scale=1.0,
        region_overhead_s=time_weight * graph.region_overhead_s,
        saving_node_overhead_s=time_weight * graph.saving_node_overhead_s,
        selective_call_overhead_s=time_weight * graph.selective_call_overhead_s,
        offload_region_overhead_s=time_weight * graph.offload_region_overhead_s,
        offloaded_storage_overhead_s=time_weight * graph.offloaded_storage_overhead_s,
    )
