"""The closed-form prices dp and ilp read: per-node and per-storage numbers (:class:`Prices`,
built once per graph by :func:`prices`) and the pieces of ``simulate``'s rules that a solver
prices a region with without replaying it, each headed by the rule it is (the rules are
numbered in ``solvers/simulate.py``, whose replay uses the same pieces).

Byte counts in a :class:`Prices` are in grid units of ``unit_bytes`` bytes each, rounded up so
that the rounded model never under-counts: fields ending in ``_units`` are such units, those
ending in ``_bytes`` bytes, those ending in ``_s`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from planner.solvers.costgraph import CostGraph, Region
from planner.solvers.cuts import region_bounds
from planner.solvers.op_classes import is_matmul, out_bytes, worth_keeping


@dataclass(frozen=True)
class Prices:
    """Per-node and per-tensor numbers dp's programme and ilp's rows read, in grid units of
    ``unit_bytes`` (fields ending ``_bytes``: bytes), computed once per graph."""

    n: int
    unit_bytes: int
    size_units: tuple[int, ...]
    producer: tuple[int, ...]
    needers: tuple[tuple[int, ...], ...]  # sorted forward readers and savers after the producer
    savers: tuple[tuple[int, ...], ...]
    is_output: tuple[bool, ...]
    produced: tuple[tuple[int, ...], ...]
    saves: tuple[frozenset[int], ...]  # tensors each node saves for backward
    time_s: tuple[float, ...]  # each node's recomputation (CostGraph.node_recompute_time_s)
    prefix_time_s: tuple[float, ...]
    fwd_temp_units: tuple[int, ...]
    bwd_temp_units: tuple[int, ...]
    # gradient + parameter-gradient bytes at node i's backward
    grad_at_bwd_units: tuple[int, ...]
    # the same once node i's backward is done (index n: none done)
    grad_after_units: tuple[int, ...]
    # bytes held to the end of the step, alive at node i's forward
    held_fwd_units: tuple[int, ...]
    keepable: tuple[bool, ...]  # outputs a selective region would keep (solvers/selective.py)
    matmul: tuple[bool, ...]  # every matmul's, attention scores too (SAC's "save matmuls")
    bounds: tuple[int, ...]  # cuts a region boundary may use (solvers/cuts.py region_bounds)
    # grad_at_bwd_units and grad_after_units in bytes, for differences
    grad_at_bytes: tuple[int, ...]
    grad_after_bytes: tuple[int, ...]
    # seconds a region of this kind over [start, stop) adds beyond its recomputation
    overhead_s: Callable[[int, int, str], float]
    # See simulate's Rule 5: the nodes whose saves a recomputation counts (None: it runs to the
    # region's end), and the storages a node allocates after its last save.
    rule5_saves: tuple[bool, ...] | None
    after_last_save: tuple[bool, ...]
    size_bytes: tuple[int, ...]  # storage sizes in bytes, for offload transfer times
    fwd_prefix_s: tuple[float, ...]  # forward time, for offload overlap (Rule 7)
    offload_bytes_per_s: float
    offload_overlap: float
    # Units each checkpoint call that preserves its RNG state stashes (simulate's Rule 12: a
    # region over a node that draws random numbers, :meth:`stash_of`), priced as held from the
    # region's start to its backward's end, plus fork_rng's copy at each forward event of its
    # recomputation; nested calls' stashes in the first forward are not carried to the root,
    # and a recomputation's nested stashes are held past it: not exact there.
    stash_units: int = 0
    # whether a region over [start, stop) preserves its RNG state (CostGraph's)
    preserves: Callable[[int, int], bool] = lambda start, stop: True
    random: tuple[bool, ...] = ()  # per node: it draws random numbers

    def stash_of(self, start: int, stop: int) -> int:
        """Units a checkpoint over nodes [start, stop) stashes: ``stash`` when it preserves its
        RNG state (a node in it draws random numbers), else 0."""
        return self.stash_units if self.stash_units and self.preserves(start, stop) else 0

    def grad_rel(self, at: int, b: int) -> int:
        """Units of gradient bytes at node ``at``'s backward above those once ``b``'s is done.
        The difference is rounded, not the two ends: equal blocks get equal numbers."""
        return -(-(self.grad_at_bytes[at] - self.grad_after_bytes[b]) // self.unit_bytes)

    def grad_after_rel(self, j: int, b: int) -> int:
        """Units of gradient bytes once ``j``'s backward is done above those after ``b``'s."""
        return -(-(self.grad_after_bytes[j] - self.grad_after_bytes[b]) // self.unit_bytes)


def prices(graph: CostGraph, unit_bytes: int = 1) -> Prices:
    """``graph``'s :class:`Prices` on a grid of ``unit_bytes`` bytes."""
    n = len(graph.nodes)
    produced: list[list[int]] = [[] for _ in range(n)]
    saves: list[set[int]] = [set() for _ in range(n)]
    # Storages held to the end of the step (autocast's weight copies) are alive from their
    # producer on and never recomputed: a function of position, like the gradient buffers.
    held_from = [0] * n
    for t_i, t in enumerate(graph.tensors):
        if t.held_to_end:
            held_from[t.producer] += t.size_bytes
            continue
        produced[t.producer].append(t_i)
        for s in t.saved_by:
            saves[s].add(t_i)
    held_prefix, total = [], 0
    for b in held_from:
        total += b
        held_prefix.append(total)
    # Gradient buffers follow reverse node order whatever the schedule, so they are a
    # function of position only (simulate's own bookkeeping).
    alloc, free = gradient_bytes(graph)
    grad_at, grad_after = [0] * n, [0] * (n + 1)
    live = 0
    for i in range(n - 1, -1, -1):
        live += alloc[i]
        grad_at[i] = live
        live -= free[i]
        grad_after[i] = live
    out = out_bytes(graph)
    times = [graph.node_recompute_time_s(i) for i in range(n)]
    prefix, fwd_prefix = [0.0], [0.0]
    for i, t_s in enumerate(times):
        prefix.append(prefix[-1] + t_s)
        fwd_prefix.append(fwd_prefix[-1] + graph.node_time_s(i))

    def units(x: int) -> int:  # round up: the rounded model never under-counts
        return -(-x // unit_bytes)

    return Prices(
        n=n,
        unit_bytes=unit_bytes,
        size_units=tuple(units(t.size_bytes) for t in graph.tensors),
        producer=tuple(t.producer for t in graph.tensors),
        needers=tuple(
            tuple(sorted({u for u in (*t.users, *t.saved_by) if u > t.producer}))
            for t in graph.tensors
        ),
        savers=tuple(tuple(t.saved_by) for t in graph.tensors),
        is_output=tuple(t.is_output for t in graph.tensors),
        produced=tuple(tuple(p) for p in produced),
        saves=tuple(frozenset(s) for s in saves),
        time_s=tuple(times),
        prefix_time_s=tuple(prefix),
        fwd_temp_units=tuple(units(nd.fwd_temp_bytes) for nd in graph.nodes),
        bwd_temp_units=tuple(units(nd.bwd_temp_bytes) for nd in graph.nodes),
        grad_at_bwd_units=tuple(units(g + total) for g in grad_at),
        grad_after_units=tuple(units(g + total) for g in grad_after),
        held_fwd_units=tuple(units(h) for h in held_prefix),
        keepable=tuple(worth_keeping(graph, i, out) for i in range(n)),
        matmul=tuple(is_matmul(graph, i) for i in range(n)),
        bounds=tuple(region_bounds(graph)),
        grad_at_bytes=tuple(g + total for g in grad_at),
        grad_after_bytes=tuple(g + total for g in grad_after),
        overhead_s=graph.checkpoint_overhead_s,
        rule5_saves=rule5_saves(graph),
        after_last_save=tuple(t.after_last_save for t in graph.tensors),
        size_bytes=tuple(t.size_bytes for t in graph.tensors),
        fwd_prefix_s=tuple(fwd_prefix),
        offload_bytes_per_s=graph.offload_bytes_per_s,
        offload_overlap=graph.offload_overlap,
        stash_units=units(graph.region_state_bytes),
        preserves=graph.preserves_rng_state,
        random=tuple(nd.draws_random for nd in graph.nodes),
    )


# See Rule 4.
def gradient_bytes(graph: CostGraph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes node i's backward allocates before its peak, and frees after it.

    Backward visits nodes in reverse order whatever the schedule, so gradient buffers depend on
    position only: ``alloc[i]`` (activation gradients it creates plus its parameter gradients)
    is added before node i's backward event, ``free[i]`` removed after it. From
    ``graph.grad_buffers`` when the estimator observed them; else one gradient of
    ``Tensor.grad_bytes`` per storage, created at its last forward user's backward and freed at
    its producer's. Solvers that price backward themselves should use this, not re-derive it.
    """
    n = len(graph.nodes)
    alloc = [nd.param_grad_bytes for nd in graph.nodes]
    free = [0] * n
    if graph.grad_buffers is not None:
        for b in graph.grad_buffers:
            alloc[b.alloc_node] += b.size_bytes
            free[b.free_node] += b.size_bytes
    else:
        for t in graph.tensors:
            if t.grad_bytes and t.users:
                alloc[max(t.users)] += t.grad_bytes
                free[t.producer] += t.grad_bytes
    return tuple(alloc), tuple(free)


# See Rule 7.
def offload_fetch_bytes(graph: CostGraph, start: int, stop: int) -> dict[int, int]:
    """See Rule 7: the bytes each node's backward brings back from host when nodes [start,
    stop) form a top-level offload region with nothing nested in it -- every storage made
    inside the region, once for each node inside it that saves it. Their sum is what the
    region sends (``Simulation.offloaded``): the closed form a solver prices the region with."""
    fetched: dict[int, int] = {}
    for t in graph.tensors:
        if start <= t.producer < stop:
            for s in set(t.saved_by):
                if start <= s < stop:
                    fetched[s] = fetched.get(s, 0) + t.size_bytes
    return fetched


# See Rule 7.
def offload_time_s(graph: CostGraph, start: int, stop: int, offloaded_bytes: float) -> float:
    """See Rule 7: the step time an offload region over nodes [start, stop) that sends
    ``offloaded_bytes`` to host and back adds, once its copies out hide behind up to
    ``graph.offload_overlap`` of its own forward compute."""
    fwd_s = sum(graph.node_time_s(i) for i in range(start, stop))
    return exposed_transfer_s(
        offloaded_bytes, fwd_s, graph.offload_bytes_per_s, graph.offload_overlap
    )


# See Rule 7.
def exposed_transfer_s(
    offloaded_bytes: float, fwd_s: float, bytes_per_s: float, overlap: float
) -> float:
    """See Rule 7: the exposed time of ``offloaded_bytes`` sent to host at ``bytes_per_s``
    during ``fwd_s`` of compute, ``overlap`` of it hidden, and brought back as each storage's
    backward needs it (nothing ahead of that, so the copy back is all exposed)."""
    each_way_s = offloaded_bytes / bytes_per_s
    return max(0.0, each_way_s - overlap * fwd_s) + each_way_s


# See Rule 5.
def rule5_saves(graph: CostGraph) -> tuple[bool, ...] | None:
    """See Rule 5: which nodes' forwards save something for backward, the saves a
    recomputation counts to know where it stops; None when the graph does not say (hand-built
    graphs), which are then recomputed to each region's end (never under-counting)."""
    saves = tuple(nd.saves_for_backward for nd in graph.nodes)
    return saves if any(saves) else None


# See Rule 4.
def trigger_node(saves: Sequence[bool], start: int, stop: int) -> int:
    """See Rule 4: the node in [start, stop) whose backward first unpacks what a region over
    it saved, so recomputes it: its last node that saves for backward, nested regions' nodes
    included (``start - 1`` when none does: nothing unpacks, the backward of every node runs as
    if the region were not there)."""
    for i in range(stop - 1, start - 1, -1):
        if saves[i]:
            return i
    return start - 1


# See Rule 2.
def frame_node(saves: Sequence[bool] | None, start: int, stop: int) -> int:
    """See Rule 2: the node in [start, stop) whose backward releases the first-forward frame
    of a region over it (its arguments): its first node that saves for backward, nested
    regions' nodes included; ``start - 1`` when none does (no frame outlives its forward).
    Graphs without save flags (``saves`` None): ``start``, the region's last backward."""
    if saves is None:
        return start
    for i in range(start, stop):
        if saves[i]:
            return i
    return start - 1


# See Rule 5.
def stop_node(graph: CostGraph, region: Region, children: list[Region]) -> tuple[int, bool]:
    """See Rule 5: where ``region``'s recomputation stops, given the regions nested one level
    inside it (``children``): (its last node, whether that node stops part-way, after its last
    save). The last save is either a node of the region's own whose forward saves anything for
    backward, or a nested checkpoint's arguments, which its parent saves as the nested region
    begins (so the recomputation stops before that nested region runs; nested regions before it
    run whole). (-1, False) when nothing saves."""
    owner = {i: r for r in children for i in range(r.start, r.stop)}
    last: tuple[int, bool] = (-1, False)
    for i in range(region.start, region.stop):
        inner = owner.get(i)
        if inner is not None and inner.kind != "offload":
            if i == inner.start:
                last = (i - 1, False)  # stops as the nested region saves its inputs
        elif graph.nodes[i].saves_for_backward:
            # an offload region (not a checkpoint) reached is replayed whole
            last = (i, True) if inner is None else (inner.stop - 1, False)
    return last


# See Rules 1 and 4: what region_peak reads.
class RegionPrices(Protocol):
    """Per-storage and per-node numbers (bytes, or a solver's rounded units) that
    :func:`region_peak` reads; :func:`prices` builds them."""

    size_units: Sequence[int]
    producer: Sequence[int]
    produced: Sequence[Sequence[int]]  # storages each node allocates (held_to_end ones aside)
    needers: Sequence[Sequence[int]]  # sorted forward readers and savers after the producer
    savers: Sequence[Sequence[int]]
    fwd_temp_units: Sequence[int]
    bwd_temp_units: Sequence[int]
    grad_at_bwd_units: Sequence[int]  # gradient bytes at node i's backward (Rule 4)
    # the same once node i's backward is done (index n: none done)
    grad_after_units: Sequence[int]
    after_last_save: Sequence[bool]  # per storage: allocated after its producer's last save


# See Rules 1, 2, 4, 5 and 6 (and 12's recompute_extra).
def region_peak(
    p: RegionPrices,
    start: int,
    stop: int,
    keep: Collection[int] = (),
    reached: int | None = None,
    recompute_extra: int = 0,
    trigger: int | None = None,
    frame: tuple[int, int | None] | None = None,
) -> int:
    """Peak of region [start, stop)'s recomputation and backward, with nothing nested in it and
    recomputed to its end, above what the rest of the step keeps meanwhile (gradient buffers
    included): Rules 1, 2 and 4 in closed form, what a DP or an ILP prices a region at.

    Nodes in ``keep`` (a selective region's) are priced by Rule 6: they are not recomputed and
    read nothing; their cached outputs are alive as the recomputation starts, and a kept node
    before ``reached`` (where Rule 5 stops the recomputation; None: the region's end) hands its
    outputs back, which then live as recomputed ones (to their last recomputed reader, or from
    the backward of their first saver in the region on); the others stay to the region's end.
    ``recompute_extra``: bytes held while the recomputation runs, not in backward (Rule 12's
    fork_rng copy). ``trigger``: the node whose backward recomputes the region (Rule 4,
    :func:`trigger_node`): the backward of the nodes after it runs first, at their own
    gradients with only the kept nodes' cache alive, and the recomputation, at the gradients
    left once they are done, stops after the trigger's last save (Rule 5). None (graphs
    without save flags): its last node, recomputed whole; a trigger before ``start`` (nothing
    saves): nothing recomputes. ``frame``: (f, q), Rule 2: the region's frame dies at the
    backward of node f (:func:`frame_node`), so the backward of the nodes before it runs
    without the q bytes the caller adds for the frame (the arguments only it keeps, Rule 12's
    stash); q None: those events are left out, for the caller to price."""
    reached = stop if reached is None else reached
    partial = trigger is not None  # Rule 5: the trigger stops after its last save
    trigger = stop - 1 if trigger is None else trigger
    recomputed = min(stop, trigger + 1)
    inside = [t for i in range(start, stop) for t in p.produced[i]]
    saved_in = {t: [s for s in p.savers[t] if start <= s < stop] for t in inside}
    # the last recomputed reader; kept nodes do not run again
    last_in = {
        t: max([p.producer[t], *[u for u in p.needers[t] if u < stop and u not in keep]])
        for t in inside
    }
    held_whole = {t for i in keep if start <= i < stop and i >= reached for t in p.produced[i]}
    fwd_peak = live = sum(p.size_units[t] for i in keep if start <= i < stop for t in p.produced[i])
    ends: dict[int, int] = {}
    for i in range(start, recomputed):  # what a reader past the stop reads stays (Rule 5)
        made = [t for t in p.produced[i] if not (partial and i == trigger and p.after_last_save[t])]
        if i not in keep:
            for t in made:
                live += p.size_units[t]
            fwd_peak = max(fwd_peak, live + p.fwd_temp_units[i])
        for t in made:
            if not saved_in[t] and t not in held_whole:  # else it stays for the backward
                ends[last_in[t]] = ends.get(last_in[t], 0) + p.size_units[t]
        live -= ends.pop(i, 0)
    # At node i's backward the region holds what something at or before i saves (Rule 1).
    from_node = [0] * (stop - start)
    for t in inside:
        if t in held_whole:
            from_node[0] += p.size_units[t]
        elif saved_in[t]:
            from_node[min(saved_in[t]) - start] += p.size_units[t]
    cached = sum(p.size_units[t] for i in keep if start <= i < stop for t in p.produced[i])
    f, q = frame if frame is not None else (start, 0)
    bwd_peak, held = 0, 0
    for i in range(start, stop):
        held += from_node[i - start]
        # Rule 4: a node after the trigger runs its backward before the recomputation
        alive = held if i <= trigger else cached
        event = p.grad_at_bwd_units[i] + p.bwd_temp_units[i] + alive
        if i < f:  # Rule 2: after the frame has died
            if q is None:
                continue
            event -= q
        bwd_peak = max(bwd_peak, event)
    if recomputed <= start:  # nothing saves, so nothing unpacks and nothing recomputes
        return bwd_peak
    return max(bwd_peak, p.grad_after_units[trigger + 1] + fwd_peak + recompute_extra)
