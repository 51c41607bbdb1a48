"""The one memory model: replay a Schedule over a CostGraph, forward then backward.

It follows what PyTorch does at run time with non-reentrant ``torch.utils.checkpoint``:

- forward: each storage is allocated by its producer and freed once no forward user is left and
  nothing holds it for backward. Outside any region, autograd holds a storage until the backward
  of the earliest node that saved it. Inside a region, saves are dropped, but the region's inputs
  stay alive until the region's backward ends (the checkpoint keeps its arguments).
- backward, in reverse node order: on reaching a region's last node the region's forward runs
  again (nested regions inside it stay checkpointed) and its backward follows; each node's
  backward allocates the gradients of the storages it read, its parameter gradients (kept to
  the end of the step) and a temporary working set, then frees the gradient of its own output
  and what it alone still held.
- selective regions keep the outputs of their ``saved_nodes`` and recompute only the rest;
  offload regions keep what they save in host memory and bring each storage back when the
  backward that needs it runs.
- storages ``held_to_end`` (autocast's weight copies) live from their first forward to the end
  of the step; recomputation reuses them.

Peak is in bytes above the step's starting baseline (parameters and inputs are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.costgraph import CostGraph, Region, Schedule

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


class InvalidScheduleError(ValueError):
    """A schedule whose regions are not a laminar family of intervals inside the graph."""


def validate(graph: CostGraph, schedule: Schedule) -> None:
    n = len(graph.nodes)
    regions = sorted(schedule.regions, key=lambda r: (r.start, -r.stop))
    for r in regions:
        if not 0 <= r.start < r.stop <= n:
            raise InvalidScheduleError(f"region {r} lies outside nodes 0..{n}")
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
        """Run nodes of ``ctx`` forward, holding what ctx's own backward will need."""
        start, stop = (0, len(self.g.nodes)) if ctx is ROOT else (ctx.start, ctx.stop)
        children = self.children(ctx)
        for i in range(start, stop):
            here = self._owner(i, children)
            if ctx is not ROOT and i in ctx.saved_nodes:
                continue  # selective: the cached output is still held by the parent
            for t_i in self.produced[i]:
                self._hold_tensor(ctx, children, here, t_i, start, stop)
            self._mark(f"{label}:{self.g.nodes[i].name}", self.g.nodes[i].fwd_temp_bytes)
            if ctx is not ROOT:
                self.recompute_flops += self.g.nodes[i].fwd_flops
                self.recompute_time_s += self.g.node_time_s(i)
            for t_i in self.used[i] + self.produced[i]:
                self._release((ctx, t_i))  # one forward use, or the producer's own hold

    def _hold_tensor(self, ctx, children, here, t_i, start, stop) -> None:
        """Allocate storage ``t_i`` with one hold per reason it must stay alive."""
        t = self.g.tensors[t_i]
        key = (ctx, t_i)
        if t.held_to_end:
            if ctx is not ROOT:
                return  # the first forward's copy is still alive and is reused
            self._hold(key, t.size_bytes, 1)  # never released: lives to the end of the step
        fwd_users = sum(1 for u in set(t.users) if start <= u < stop and u > t.producer)
        self._hold(key, t.size_bytes, 1 + fwd_users)  # released by producer and each user
        if ctx is ROOT and t.is_output:
            self._hold(key, t.size_bytes, 1)
            self._later(ctx, ("backward_start",), key)
        kept_for: set[Region] = set()
        for s in set(t.saved_by):
            if not start <= s < stop:
                continue
            owner = self._owner(s, children)
            if owner is None:
                self._hold(key, t.size_bytes, 1)
                self._later(ctx, ("bwd", s), key)
            elif owner is not here:
                kept_for.add(owner)  # a region input: the checkpoint keeps it
            elif owner.kind == "selective" and t.producer in owner.saved_nodes:
                kept_for.add(owner)
            elif owner.kind == "offload":
                self.offload_bytes += t.size_bytes
                self.fetches.setdefault((ctx, s), []).append(t.size_bytes)
        for u in set(t.users):
            owner = self._owner(u, children)
            if start <= u < stop and owner is not None and owner is not here:
                kept_for.add(owner)
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
    return Simulation(
        peak_bytes=replay.peak_bytes,
        peak_event=replay.peak_event,
        recompute_flops=replay.recompute_flops,
        recompute_time_s=replay.recompute_time_s,
        offload_bytes=replay.offload_bytes,
        offload_time_s=2 * replay.offload_bytes / graph.offload_bytes_per_s,
        timeline=tuple(replay.timeline),
    )
