"""The one memory model: replay a Schedule over a CostGraph, forward then backward.

It follows what PyTorch does at run time with non-reentrant ``torch.utils.checkpoint``:

- forward: each storage is allocated by its producer and freed once no forward user is left and
  nothing holds it for backward. Outside any region, autograd holds a storage until the backward
  of the earliest node that saved it. Inside a region, saves are dropped, but the region's inputs
  stay alive until the region's backward ends (the checkpoint keeps its arguments). The
  arguments of a region nested in a recomputation are tensors the parent recovered: they live
  until the nested region's own recomputation ends, longer only if a node in it saves them.
- backward, in reverse node order: on reaching a region's last node the region's forward runs
  again (nested regions inside it stay checkpointed; the region outputs it recomputes live until
  that recomputation ends) and its backward follows; each node's
  backward allocates the gradients of the storages it read, its parameter gradients (kept to
  the end of the step) and a temporary working set, then frees the gradient of its own output
  and what it alone still held.
- selective regions keep the outputs of their ``saved_nodes`` and recompute only the rest;
  a kept output lives until the recomputation reaches its node, or (when backward reads it, or
  recomputation stops before it) until the region's backward ends;
  offload regions keep what they save in host memory and bring each storage back when the
  backward that needs it runs.
- storages ``held_to_end`` (autocast's weight copies) live from their first forward to the end
  of the step; recomputation reuses them.
- a recomputation stops early, as non-reentrant checkpoint does once every tensor the region
  saved is back: after the region's last node that saves for backward, before what that node
  allocates after its last save (``Tensor.after_last_save``), or, when the last save is a
  nested region's arguments, just before that nested region. Graphs without
  ``Node.saves_for_backward`` (hand-built) are recomputed to the region's end.
- a region whose nodes write model buffers (``Node.state_bytes``: BatchNorm statistics) keeps a
  copy of their pre-step values from its forward to the end of its backward, and makes one more
  for each recomputation (``passes/rewrite.py``).
- every region boundary must be a cut that in-place writes allow (``solvers/cuts.py``).

Peak is in bytes above the step's starting baseline (parameters and inputs are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import forbidden_cuts

ROOT = Region(0, 0, depth=-1)


@dataclass(frozen=True)
class Simulation:
    """What one replay of a schedule predicts.

    ``timeline`` holds (event, live bytes at that event's peak) in step order; events are
    'fwd:<node>', 'recompute:<node>' and 'bwd:<node>'.
    """

    peak_bytes: int
    peak_event: str
    recompute_flops: int
    recompute_time_s: float
    offload_bytes: int
    offload_time_s: float
    timeline: tuple[tuple[str, int], ...]
    # Forward + backward (CostGraph.step_time_s) + recompute + offload transfers, unoverlapped,
    # + each region's own bookkeeping (CostGraph.region_overhead_s).
    step_time_s: float = 0.0


class InvalidScheduleError(ValueError):
    """A schedule whose regions are not a laminar family of intervals inside the graph."""


def validate(graph: CostGraph, schedule: Schedule) -> None:
    n = len(graph.nodes)
    regions = sorted(schedule.regions, key=lambda r: (r.start, -r.stop))
    forbidden = forbidden_cuts(graph)
    for r in regions:
        if not 0 <= r.start < r.stop <= n:
            raise InvalidScheduleError(f"region {r} lies outside nodes 0..{n}")
        if graph.region_spans is not None and (r.start, r.stop) not in graph.region_spans:
            raise InvalidScheduleError(
                f"region {r} is not one of the graph's region spans (one module call each)"
            )
        for c in (r.start, r.stop):
            if c in forbidden:
                raise InvalidScheduleError(
                    f"region {r} has a boundary at cut {c}, before node {graph.nodes[c].name}: "
                    f"a storage produced before it is written in place at or after it"
                )
    for a_i, a in enumerate(regions):
        for b in regions[a_i + 1 :]:
            overlap = a.start < b.stop and b.start < a.stop
            if overlap and not (a.covers(b) or b.covers(a)):
                raise InvalidScheduleError(f"regions {a} and {b} overlap without nesting")
            if a == b:
                raise InvalidScheduleError(f"region {a} appears twice")


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


class _Replay:
    def __init__(self, graph: CostGraph, schedule: Schedule) -> None:
        validate(graph, schedule)
        self.g = graph
        self.regions = sorted(schedule.regions, key=lambda r: (r.start, -r.stop))
        self.produced: list[list[int]] = [[] for _ in graph.nodes]
        self.used: list[list[int]] = [[] for _ in graph.nodes]
        for t_i, t in enumerate(graph.tensors):
            self.produced[t.producer].append(t_i)
            for u in set(t.users):
                self.used[u].append(t_i)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_event = ""
        self.holds: dict[tuple, list[int]] = {}  # key -> [device bytes, hold count]
        self.releases: dict[tuple, list[tuple]] = {}  # (ctx, event) -> keys to release
        self.grad_alloc, self.grad_free = gradient_bytes(graph)
        self.parent: dict[Region, Region] = {}
        self.needed: dict[Region, int] = {}
        self.stop_node: dict[Region, tuple[int, bool]] = {}
        self.starts_at: list[list[Region]] = [[] for _ in graph.nodes]
        for r in self.regions:
            self.starts_at[r.start].append(r)
        state_prefix = [0]
        for nd in graph.nodes:
            state_prefix.append(state_prefix[-1] + nd.state_bytes)
        self.state_bytes = {r: state_prefix[r.stop] - state_prefix[r.start] for r in self.regions}
        # Where recomputation stops needs every save, parameters and inputs included; a graph
        # that does not say (hand-built ones) is replayed to the region's end, which never
        # under-counts.
        self.early_stop = any(nd.saves_for_backward for nd in graph.nodes)
        self.timeline: list[tuple[str, int]] = []
        self.recompute_flops = 0
        self.recompute_time_s = 0.0
        self.offload_bytes = 0
        self.fetches: dict[tuple, list[int]] = {}  # (ctx, node) -> offloaded bytes it reads

    # -- bookkeeping -------------------------------------------------------------------------
    def _hold(self, key: tuple, size: int, count: int) -> None:
        if count <= 0:
            return
        if key not in self.holds:
            self.holds[key] = [size, 0]
            self.live_bytes += size
        self.holds[key][1] += count

    def _release(self, key: tuple) -> None:
        entry = self.holds.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.holds[key]
            self.live_bytes -= entry[0]

    def _release_at(self, ctx: Region, event: tuple) -> None:
        for key in self.releases.pop((ctx, event), ()):
            self._release(key)

    def _later(self, ctx: Region, event: tuple, key: tuple) -> None:
        self.releases.setdefault((ctx, event), []).append(key)

    def _mark(self, event: str, extra_bytes: int = 0) -> None:
        now = self.live_bytes + extra_bytes
        self.timeline.append((event, now))
        if now > self.peak_bytes:
            self.peak_bytes, self.peak_event = now, event

    def children(self, ctx: Region) -> list[Region]:
        inner = [r for r in self.regions if r.depth == ctx.depth + 1]
        if ctx is ROOT:
            return inner
        return [r for r in inner if ctx.covers(r)]

    @staticmethod
    def _owner(i: int, children: list[Region]) -> Region | None:
        for r in children:
            if i in r:
                return r
        return None

    # -- the two passes ------------------------------------------------------------------------
    def forward(self, ctx: Region, label: str) -> None:
        """Run nodes of ``ctx`` forward, holding what ctx's own backward will need.

        A recomputation stops early: non-reentrant checkpoint raises once the last tensor the
        region saved is back (``_stop_node`` says where).
        """
        start, stop = (0, len(self.g.nodes)) if ctx is ROOT else (ctx.start, ctx.stop)
        children = self.children(ctx)
        last, partial = (stop - 1, False) if ctx is ROOT else self._stop_node(ctx, children)
        if ctx is not ROOT and ctx.kind != "offload" and self.state_bytes[ctx]:
            # rewrite's fresh copies of the pre-step buffer values, for this recomputation
            key = ("state_run", ctx)
            self._hold(key, self.state_bytes[ctx], 1)
            self._later(ctx, ("recompute_end",), key)
        for i in range(start, last + 1):
            here = self._owner(i, children)
            self._hold_state_copies(ctx, children, i)
            if ctx is not ROOT and i in ctx.saved_nodes:
                # selective: the cached output is still held by the parent; the node does not
                # run again, so its inputs lose this reader at once.
                for t_i in self.used[i]:
                    self._release((ctx, t_i))
                self._release_at(self.parent[ctx], ("cached", ctx, i))
                continue
            for t_i in self.produced[i]:
                if partial and i == last and self.g.tensors[t_i].after_last_save:
                    continue  # the recomputation stops before the node makes it
                self._hold_tensor(ctx, children, here, t_i, start, stop, last + 1)
            self._mark(f"{label}:{self.g.nodes[i].name}", self.g.nodes[i].fwd_temp_bytes)
            if ctx is not ROOT:
                self.recompute_flops += self.g.nodes[i].fwd_flops
                self.recompute_time_s += self.g.node_time_s(i)
            for t_i in self.used[i] + self.produced[i]:
                self._release((ctx, t_i))  # one forward use, or the producer's own hold
        if ctx is not ROOT:
            self._release_at(ctx, ("recompute_end",))

    def _stop_node(self, region: Region, children: list[Region]) -> tuple[int, bool]:
        """Where ``region``'s recomputation stops: (its last node, whether that node stops
        part-way, after its last save). The last save is either a node of the region's own
        whose forward saves for backward, or a nested checkpoint's inputs, which its parent
        saves on its behalf as the nested region begins (so the recomputation stops before
        that nested region runs; nested regions before it run whole). (-1, False) when nothing
        saves. Without ``Node.saves_for_backward`` on the graph: the region's last node."""
        if not self.early_stop:
            return region.stop - 1, False
        if region not in self.stop_node:
            last: tuple[int, bool] = (-1, False)
            for i in range(region.start, region.stop):
                inner = self._owner(i, children)
                if inner is not None and inner.kind != "offload":
                    if i == inner.start:
                        last = (i - 1, False)  # stops as the nested region saves its inputs
                elif self.g.nodes[i].saves_for_backward:
                    # an offload region (not a checkpoint) reached is replayed whole
                    last = (i, True) if inner is None else (inner.stop - 1, False)
            self.stop_node[region] = last
        return self.stop_node[region]

    def _hold_state_copies(self, ctx: Region, children: list[Region], i: int) -> None:
        """Regions starting at node ``i`` inside ``ctx`` copy the buffers they write (BatchNorm
        statistics) before running, for their recomputation; the copies live until the
        region's backward ends (nested ones: until their enclosing child of ctx ends)."""
        for r in self.starts_at[i]:
            if r is ctx or r.kind == "offload" or not self.state_bytes[r]:
                continue
            if ctx is not ROOT and not ctx.covers(r):
                continue
            top = self._owner(i, children)
            key = ("state", ctx, r)
            self._hold(key, self.state_bytes[r], 1)
            self._later(ctx, ("region_end", top), key)

    def _last_needed(self, region: Region) -> int:
        """The last recomputed node of ``region`` whose output its backward reads (-1: none)."""
        if region not in self.needed:
            last = -1
            for i in range(region.start, region.stop):
                if i in region.saved_nodes:
                    continue
                for t_i in self.produced[i]:
                    if any(region.start <= s < region.stop for s in self.g.tensors[t_i].saved_by):
                        last = i
            self.needed[region] = last
        return self.needed[region]

    def _hold_tensor(self, ctx, children, here, t_i, start, stop, run_stop) -> None:
        """Allocate storage ``t_i`` with one hold per reason it must stay alive.

        Forward readers count up to ``run_stop`` (where a recomputation stops)."""
        t = self.g.tensors[t_i]
        key = (ctx, t_i)
        if t.held_to_end:
            if ctx is not ROOT:
                return  # the first forward's copy is still alive and is reused
            self._hold(key, t.size_bytes, 1)  # never released: lives to the end of the step
        fwd_users = sum(1 for u in set(t.users) if start <= u < run_stop and u > t.producer)
        self._hold(key, t.size_bytes, 1 + fwd_users)  # released by producer and each user
        if ctx is ROOT and t.is_output:
            self._hold(key, t.size_bytes, 1)
            self._later(ctx, ("backward_start",), key)
        if ctx is not ROOT and any(not start <= u < stop for u in (*t.users, *t.saved_by)):
            # A region output: the recomputed region returns it, so it lives to the end of the
            # recomputation (and is then discarded: the original is what later nodes use).
            self._hold(key, t.size_bytes, 1)
            self._later(ctx, ("recompute_end",), key)
        cached_here = (
            here is not None and here.kind == "selective" and t.producer in here.saved_nodes
        )
        kept_for: set[Region] = set()
        input_of: set[Region] = set()  # nested regions it is an argument of
        for s in set(t.saved_by):
            if not start <= s < stop:
                continue
            owner = self._owner(s, children)
            if owner is None:
                self._hold(key, t.size_bytes, 1)
                self._later(ctx, ("bwd", s), key)
            elif owner is not here:
                input_of.add(owner)
            elif cached_here:
                kept_for.add(owner)  # its backward reads the cached output
            elif owner.kind == "offload":
                self.offload_bytes += t.size_bytes
                self.fetches.setdefault((ctx, s), []).append(t.size_bytes)
        for u in set(t.users):
            owner = self._owner(u, children)
            if start <= u < stop and owner is not None and owner is not here:
                input_of.add(owner)
        for region in input_of:
            if ctx is ROOT or region.kind == "offload" or any(s in region for s in t.saved_by):
                kept_for.add(region)  # the checkpoint keeps its arguments
            else:
                # Inside a recomputation a nested checkpoint's arguments are tensors its parent
                # recovered: handed over, and dropped by the parent, as the nested region's own
                # recomputation begins; alive after it only if something in it saves them.
                self._hold(key, t.size_bytes, 1)
                self._later(region, ("recompute_end",), key)
        if cached_here and here not in kept_for:
            # Selective checkpointing caches every output of a saved op, needed or not. The
            # recomputation hands it back (and drops it) when it reaches the op; but it stops
            # early after the last tensor backward needs, and a cache entry it never reaches
            # lives as long as the region's autograd graph.
            if t.producer < self._last_needed(here):
                self._hold(key, t.size_bytes, 1)
                self._later(ctx, ("cached", here, t.producer), key)
            else:
                kept_for.add(here)
        for region in kept_for:
            self._hold(key, t.size_bytes, 1)
            self._later(ctx, ("region_end", region), key)

    def backward(self, ctx: Region, label: str = "bwd") -> None:
        start, stop = (0, len(self.g.nodes)) if ctx is ROOT else (ctx.start, ctx.stop)
        children = self.children(ctx)
        i = stop - 1
        while i >= start:
            region = self._owner(i, children)
            if region is not None and region.kind != "offload":
                self.parent[region] = ctx
                self.forward(region, "recompute")
                self.backward(region)
                self._release_at(ctx, ("region_end", region))
                i = region.start - 1
                continue
            node = self.g.nodes[i]
            self.live_bytes += self.grad_alloc[i]  # gradients and parameter gradients
            fetched = sum(self.fetches.pop((ctx, i), ()))  # offloaded storages come back
            self._mark(f"{label}:{node.name}", node.bwd_temp_bytes + fetched)
            self.live_bytes -= self.grad_free[i]
            self._release_at(ctx, ("bwd", i))
            if region is not None and i == region.start:
                self._release_at(ctx, ("region_end", region))  # an offload region's inputs
            i -= 1


def simulate(graph: CostGraph, schedule: Schedule) -> Simulation:
    """Predict peak bytes, recompute FLOPs/time and a memory timeline for one training step."""
    replay = _Replay(graph, schedule)
    replay.forward(ROOT, "fwd")
    replay._release_at(ROOT, ("backward_start",))
    replay.backward(ROOT)
    offload_time_s = 2 * replay.offload_bytes / graph.offload_bytes_per_s
    return Simulation(
        peak_bytes=replay.peak_bytes,
        peak_event=replay.peak_event,
        recompute_flops=replay.recompute_flops,
        recompute_time_s=replay.recompute_time_s,
        offload_bytes=replay.offload_bytes,
        offload_time_s=offload_time_s,
        timeline=tuple(replay.timeline),
        step_time_s=graph.step_time_s
        + replay.recompute_time_s
        + offload_time_s
        + len(schedule.regions) * graph.region_overhead_s,
    )
