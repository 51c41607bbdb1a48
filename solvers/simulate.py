"""The one memory model: replay a Schedule over a CostGraph, forward then backward.

It follows what PyTorch does at run time with non-reentrant ``torch.utils.checkpoint``. Its
rules are written once, here, numbered; the code (and every solver that prices regions with the
functions below) says "See Rule N".

Rule 1. Forward lifetimes. Each storage is allocated by its producer and freed once no forward
        user is left and nothing holds it for backward. Outside any region, autograd holds a
        storage until the backward of the earliest node that saved it. A storage with
        ``freed_after`` (eager code: a Python variable outlives its last reader) stays alive
        through that node's forward, without being an input of the regions it lies in.
Rule 2. A region drops what its nodes save, but its checkpoint's frame keeps its arguments (the
        storages it reads from outside) alive: through its forward, and then for as long as
        anything the region saved is still to be unpacked. torch's frame (``saved_args``, and
        the closure that recomputes) is referenced only by the unpack hooks of the tensors
        packed under the region's hooks, which autograd drops at each saving node's backward.
        So the frame lives until the backward of the region's *first* node that saves for
        backward, at any depth (a nested region's saves hold its own frame, which holds its
        arguments packed under the parent's hooks, so the parent's frame too), and a region
        whose nodes save nothing leaves no frame behind: its arguments live only through its
        forward (:func:`frame_node`). Measured: tests/planner/test_budget_promise.py. Graphs
        without ``Node.saves_for_backward`` keep them to the region's backward's end. On the
        safe side, not exact: the frame holds a selective region's unreached cache entries too,
        which Rule 6 keeps to the region's backward's end, and a region nested in a
        recomputation keeps Rule 3's lifetimes even when nothing in it saves.
Rule 3. Nested arguments. The arguments of a region nested in a recomputation are tensors its
        parent recovered: they live until the nested region's own recomputation ends, longer
        only if a node in it saves them (checkpoint.py's Rule 2: inner inputs are saved to the
        parent, which hands them over when the inner checkpoint recomputes). The same holds one
        level down for an argument the nested region passes on: its recomputation saves it
        again for each region nested in it that reads it, so a storage read two or more
        levels down lives until the last of those recomputations ends (or, when a node in one
        of them saves it, until that region's backward ends). A nested region in which
        nothing saves never recomputes (Rule 4), so nothing keeps its arguments: they live as
        the recomputation's own variables (to their last reader, or, past a stop, to its end).
Rule 4. Backward runs in reverse node order. A region's forward runs again when backward first
        unpacks something the region saved: at its last node that saves for backward (at any
        depth: a nested region's saving node recomputes the nested region, which unpacks its
        arguments from the parent first; :func:`trigger_node`). The backward of the nodes after
        that one (trailing nodes that saved nothing: a slice, a scale, a residual add) runs
        before the recomputation, with nothing of the region's recomputed yet. Nested regions
        inside it stay checkpointed; the region outputs it recomputes live until that
        recomputation ends; the backward of the rest follows. Each node's backward allocates
        the gradients of the storages it read, its parameter gradients (kept to the end of the
        step) and a temporary working set, then frees the gradient of its own output and what
        it alone still held (:func:`gradient_bytes`).
Rule 5. Early stop (checkpoint.py's Rule 5). A recomputation stops once it has packed as many
        saved tensors as the region's first forward did: every pack counts -- activations,
        parameters, inputs -- so it runs through the region's last node that saves anything for
        backward, and stops before what that node allocates after its last save
        (``Tensor.after_last_save``); when the last save is a nested region's arguments, just
        before that nested region. :func:`stop_node` says where. Graphs without
        ``Node.saves_for_backward`` (hand-built ones) are recomputed to the region's end.
        A storage that a node past the stop reads is still a variable of the interrupted
        forward: it lives until the recomputation ends (the stop unwinds that frame).
Rule 6. Selective regions keep every output of their ``saved_nodes`` (SAC caches the whole
        output of a kept op). The recomputation does not run a kept node: it takes the cached
        output back as it reaches it (torch pops the cache entry), and the output then lives as
        a recomputed one would: to its last reader in the recomputation, and to the backward of
        each node in the region that saves it. A cache entry the recomputation never reaches
        (Rule 5 stops it first) lives until the region's backward ends.
Rule 7. Offload regions keep what they save in host memory and bring each storage back when the
        backward that needs it runs. The copy out hides behind up to
        ``CostGraph.offload_overlap`` of the region's own forward compute; the copy back, made
        as the backward needs it and not ahead, is exposed; both are step time
        (:func:`offload_time_s`).
Rule 8. Storages ``held_to_end`` (autocast's weight copies) live from their first forward to the
        end of the step; recomputation reuses them.
Rule 9. A region whose nodes write model buffers (``Node.state_bytes``: BatchNorm statistics)
        keeps a copy of their pre-step values from its forward for as long as its frame lives
        (Rule 2: the function it checkpoints holds the copy), and
        makes one more for each recomputation (``passes/rewrite.py``), which lives until the
        recomputation ends (a nested region called again in its parent's recomputation copies
        them again, held by that call's frame, which dies as Rule 12 says)
        -- except the part a node of the region's own saves for backward
        (``Node.state_saved_bytes``: BatchNorm saves the running statistics it ran on, so the
        recomputation's copies), which lives until that node's backward.
Rule 10. Every region boundary is a cut that in-place writes allow (``solvers/cuts.py``;
        checked with the rest of a schedule's shape by ``solvers/validate.py``).
Rule 11. ``CostGraph.buffer_changes`` (FSDP2's per-rank buffers) apply at their fixed points of
        the first forward and of backward, never during a recomputation: a change after node
        i's backward comes before the recomputation of a region ending at node i - 1 (FSDP2
        all-gathers a block for backward before autograd reaches the checkpoint inside it).
Rule 12. Each checkpoint call (recompute and selective regions) over a node that draws
        random numbers (``Node.draws_random``, at any depth: a parent of a random region too)
        runs with ``preserve_rng_state`` and stashes ``CostGraph.region_state_bytes`` (the RNG
        state it restores, a ``torch.get_rng_state()`` tensor taken before the call saves its
        inputs: ``CostGraph.region_stash_bytes``); a call over none runs without it, stashes
        nothing and copies nothing while it recomputes. A stash's frame holds it: in the first
        forward, as long as Rule 2 says the frame lives (to the backward of the region's first
        saving node, or, when nothing in it saves, to its forward's end); in a parent's
        recomputation, until that recomputation ends (recomputed tensors are detached, so the
        nested call's frame dies with it), and this holds too for the nested call at which the
        parent's recomputation stops (Rule 5: it stops as that call saves its inputs, after the
        stash). Recomputing a region that stashed holds one more copy (the state ``fork_rng``
        puts back afterwards) until its recomputation ends. (Traced on CPU against the measured
        step, each RNG state's birth and death: tests/planner/test_nested_measured.py.)
Rule 13. A region's call holds its arguments until it returns. In the pass that runs it (the
        first forward, or a parent's recomputation, at any depth), a storage made before a
        nested region and read inside it lives until that region's last node has run
        forward, whatever its last reader inside (the caller's variable, and checkpoint's own
        frame, keep it). Four regions nested over Gemma-2's attention soft-capping (the scores,
        their scaling, the division and the tanh, each a region's argument one level down)
        held all four at once in the outer region's recomputation: 131,328 B above what
        simulate predicted when each died at its last reader (tests/planner/
        test_nested_measured.py).

Peak is in bytes above the step's starting baseline (parameters and inputs are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.solvers.costgraph import BufferChange, CostGraph, Region, Schedule, Tensor
from planner.solvers.prices import (
    frame_node,
    gradient_bytes,
    offload_time_s,
    rule5_saves,
    stop_node,
    trigger_node,
)
from planner.solvers.validate import validate

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
    # Bytes each offload region sent to host (Rule 7), in schedule order.
    offloaded: tuple[tuple[Region, int], ...] = ()
    # Forward + backward (CostGraph.step_time_s) + recompute + exposed offload transfers,
    # + each region's own bookkeeping (CostGraph.region_overhead_time_s): ``overhead_time_s``.
    step_time_s: float = 0.0
    overhead_time_s: float = 0.0


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
            if t.freed_after > t.producer and t.freed_after not in t.users:
                self.used[t.freed_after].append(t_i)  # held, not read: never a region input
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_event = ""
        self.holds: dict[tuple, list[int]] = {}  # key -> [device bytes, hold count]
        self.releases: dict[tuple, list[tuple]] = {}  # (ctx, event) -> keys to release
        self.grad_alloc, self.grad_free = gradient_bytes(graph)
        self.changes: dict[tuple[str, int], list[BufferChange]] = {}
        for c in graph.buffer_changes:
            self.changes.setdefault(c.after, []).append(c)
        self.parent: dict[Region, Region] = {}
        self.stop_node: dict[Region, tuple[int, bool]] = {}
        self.starts_at: list[list[Region]] = [[] for _ in graph.nodes]
        # the regions holding each node, outermost first (regions sorted by start, then the
        # outer before the inner)
        self.chain: list[list[Region]] = [[] for _ in graph.nodes]
        for r in self.regions:
            self.starts_at[r.start].append(r)
            for i in range(r.start, r.stop):
                self.chain[i].append(r)
        # Each region's children (regions one level deeper inside it), and for each node of a
        # context the child it lies in: looked up at every node, so built once.
        self.kids: dict[Region, list[Region]] = {ROOT: []}
        enclosing: list[Region] = []
        for r in self.regions:
            while enclosing and enclosing[-1].stop <= r.start:
                enclosing.pop()
            self.kids[r] = []
            if r.depth == 0:
                self.kids[ROOT].append(r)
            else:
                up = next((e for e in reversed(enclosing) if e.depth == r.depth - 1), None)
                if up is not None:
                    self.kids[up].append(r)
            enclosing.append(r)
        self.owners: dict[int, dict[int, Region]] = {}  # id(children list) -> node -> child
        state_prefix = [0]
        for nd in graph.nodes:
            state_prefix.append(state_prefix[-1] + nd.state_bytes)
        self.state_bytes = {r: state_prefix[r.stop] - state_prefix[r.start] for r in self.regions}
        self.saves = rule5_saves(graph)
        self.first_saver: dict[Region, int] = {}  # Rule 2's frame_node, per region
        self.early_stop = self.saves is not None
        self.timeline: list[tuple[str, int]] = []
        self.recompute_flops = 0
        self.recompute_time_s = 0.0
        self.offload_bytes = 0
        self.offloaded: dict[Region, int] = {}  # offload region -> bytes it sent to host
        self.fetches: dict[tuple, list[int]] = {}  # (ctx, node) -> offloaded bytes it reads
        self.bwd_done: set[int] = set()  # nodes whose backward has run

    # -- bookkeeping -------------------------------------------------------------------------
    def apply_changes(self, after: tuple[str, int]) -> None:
        """See Rule 11: the buffers allocated or freed at this point, in order."""
        for c in self.changes.get(after, ()):
            self.live_bytes += c.delta_bytes
            if c.delta_bytes > 0:
                self._mark(c.what or f"buffer:{after[0]}:{after[1]}")

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
        return self.kids[ctx]

    def _owner(self, i: int, children: list[Region]) -> Region | None:
        """The region among ``children`` (one context's, disjoint) that holds node ``i``."""
        key = id(children)
        table = self.owners.get(key)
        if table is None:
            table = self.owners[key] = {j: r for r in children for j in range(r.start, r.stop)}
        return table.get(i)

    # -- the two passes ------------------------------------------------------------------------
    def forward(self, ctx: Region, label: str) -> None:
        """Run nodes of ``ctx`` forward, holding what ctx's own backward will need (Rule 1);
        a recomputation stops early (Rule 5)."""
        start, stop = (0, len(self.g.nodes)) if ctx is ROOT else (ctx.start, ctx.stop)
        children = self.children(ctx)
        last, partial = (stop - 1, False) if ctx is ROOT else self._stop_node(ctx, children)
        stash = self.g.region_state_bytes
        own = 0 if ctx is ROOT else self.g.region_stash_bytes(ctx.start, ctx.stop)
        if ctx is not ROOT and ctx.kind != "offload" and own:
            key = ("stash_run", ctx)  # fork_rng's copy of the state it restores (Rule 12)
            self._hold(key, own, 1)
            self._later(ctx, ("recompute_end",), key)
        if ctx is not ROOT and ctx.kind != "offload" and self.state_bytes[ctx]:
            # rewrite's fresh copies of the pre-step buffer values, for this recomputation (Rule 9)
            kept = self._state_saved_in_run(ctx, children, last)
            key = ("state_run", ctx)
            self._hold(key, self.state_bytes[ctx] - sum(kept.values()), 1)
            self._later(ctx, ("recompute_end",), key)
            for i, size in kept.items():
                key = ("state_saved", ctx, i)
                self._hold(key, size, 1)
                self._later(ctx, ("bwd", i), key)
        for i in range(start, last + 1):
            here = self._owner(i, children)
            self._hold_state_copies(ctx, children, i)
            if stash:
                self._stash(ctx, i)
            if ctx is not ROOT and i in ctx.saved_nodes:
                # See Rule 6: the node does not run again, so its inputs lose this reader at
                # once; a cached output handed back lives to its last reader here.
                for t_i in self.used[i]:
                    self._release((ctx, t_i))
                for _, t_i in self.releases.get((self.parent[ctx], ("cached", ctx, i)), ()):
                    self._hold_tensor(ctx, children, here, t_i, start, stop, last + 1)
                    self._release((ctx, t_i))  # the kept node's own hold: it does not run
                self._release_at(self.parent[ctx], ("cached", ctx, i))
                continue
            for t_i in self.produced[i]:
                if partial and i == last and self.g.tensors[t_i].after_last_save:
                    continue  # the recomputation stops before the node makes it
                self._hold_tensor(ctx, children, here, t_i, start, stop, last + 1)
            self._mark(f"{label}:{self.g.nodes[i].name}", self.g.nodes[i].fwd_temp_bytes)
            if ctx is not ROOT:
                self.recompute_flops += self.g.nodes[i].fwd_flops
                self.recompute_time_s += self.g.node_recompute_time_s(i)
            for t_i in self.used[i] + self.produced[i]:
                self._release((ctx, t_i))  # one forward use, or the producer's own hold
            if ctx is ROOT:
                self.apply_changes(("fwd", i))
            self._release_at(ctx, ("fwd_done", i))
        if ctx is not ROOT:
            self._stopped_at_nested(ctx, children, last)
            self._release_at(ctx, ("recompute_end",))

    def _state_saved_in_run(self, ctx: Region, children: list[Region], last: int) -> dict[int, int]:
        """See Rule 9: the nodes of ``ctx``'s own (not nested in a child region, which drops its
        saves) that this recomputation runs through ``last`` and that save the buffer copies
        they write: node -> bytes, held to that node's backward."""
        return {
            i: self.g.nodes[i].state_saved_bytes
            for i in range(ctx.start, last + 1)
            if self.g.nodes[i].state_saved_bytes
            and i not in ctx.saved_nodes
            and self._owner(i, children) is None
        }

    def _stopped_at_nested(self, ctx: Region, children: list[Region], last: int) -> None:
        """See Rule 12: a recomputation that stops as a nested region saves its arguments
        (Rule 5) stops inside that region's checkpoint call, which has stashed its RNG state
        by then: the stash lives until the recomputation ends, and counts at the stop."""
        nested = self._owner(last + 1, children) if last + 1 < ctx.stop else None
        if nested is None or nested.start != last + 1 or nested.kind == "offload":
            return
        stash = self.g.region_stash_bytes(nested.start, nested.stop)
        if not stash:
            return
        self._mark(f"recompute-stash:{self.g.nodes[nested.start].name}", stash)

    def _stop_node(self, region: Region, children: list[Region]) -> tuple[int, bool]:
        """See Rule 5: :func:`stop_node` for ``region`` in this replay."""
        if not self.early_stop:
            return region.stop - 1, False
        if region not in self.stop_node:
            self.stop_node[region] = stop_node(self.g, region, children)
        return self.stop_node[region]

    def _hold_state_copies(self, ctx: Region, children: list[Region], i: int) -> None:
        """Regions starting at node ``i`` inside ``ctx`` copy the buffers they write (BatchNorm
        statistics) before running, for their recomputation. The function checkpoint calls
        holds them, so its frame does: in the first forward they live as long as Rule 2 says
        the region's frame does; in a recomputation as long as Rule 12 says the nested call's
        frame does, to the recomputation's end (the nested region's own recomputation later
        runs on the first forward's copy). Held to the end of the nested region's backward
        instead, a plan nesting a BatchNorm region at the start of its parent's (blocks[0:3]
        over blocks[0:2] of a ResNet) was predicted 288 B over the measured peak."""
        for r in self.starts_at[i]:
            if r is ctx or r.kind == "offload" or not self.state_bytes[r]:
                continue
            if ctx is not ROOT and not ctx.covers(r):
                continue
            key = ("state", ctx, r)
            self._hold(key, self.state_bytes[r], 1)
            self._hold_for_frame(ctx, r, key)

    def _stash(self, ctx: Region, i: int) -> None:
        """See Rule 12: the checkpoints starting at node ``i`` that preserve their RNG state
        stash it."""
        for r in self.starts_at[i]:
            if r is ctx or r.kind == "offload" or (ctx is not ROOT and not ctx.covers(r)):
                continue
            stash = self.g.region_stash_bytes(r.start, r.stop)
            if not stash:
                continue
            key = ("stash", ctx, r)
            self._hold(key, stash, 1)
            self._hold_for_frame(ctx, r, key)

    def _hold_for_frame(self, ctx: Region, r: Region, key: tuple) -> None:
        """See Rule 2: release ``key`` with region ``r``'s checkpoint frame, made in context
        ``ctx``: a frame nothing in ``r`` packs into dies as ``r``'s forward ends; in the
        first forward, the others at the backward of ``r``'s first saving node; in a
        recomputation, with it (Rule 12)."""
        first = self.first_saver.get(r)
        if first is None:
            first = self.first_saver[r] = frame_node(self.saves, r.start, r.stop)
        if first < r.start:
            self._later(ctx, ("fwd_done", r.stop - 1), key)
        elif ctx is ROOT:
            self._later(ROOT, ("frame", first), key)
        else:
            self._later(ctx, ("recompute_end",), key)

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
        if ctx is not ROOT and any(run_stop <= u < stop for u in t.users):
            # See Rule 5: a reader the stopped recomputation never reaches still has it in a
            # variable of the interrupted forward, freed as the stop unwinds that frame.
            self._hold(key, t.size_bytes, 1)
            self._later(ctx, ("recompute_end",), key)
        if t.freed_after > t.producer and t.freed_after not in t.users:
            if start <= t.freed_after < run_stop:
                fwd_users += 1
            elif ctx is not ROOT and t.freed_after >= run_stop:
                # Python still holds it as this recomputation stops: alive until its end
                self._hold(key, t.size_bytes, 1)
                self._later(ctx, ("recompute_end",), key)
        self._hold(key, t.size_bytes, 1 + fwd_users)  # released by producer and each user
        # See Rule 13: the call of a region nested in this pass that reads it holds it to the
        # call's end.
        call_end = self._call_end(ctx, t, start, run_stop)
        if call_end >= 0:
            self._hold(key, t.size_bytes, 1)
            self._later(ctx, ("fwd_done", call_end), key)
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
                pass  # handed back to the recomputation, whose saver keeps it (Rule 6)
            elif owner.kind == "offload":
                self.offload_bytes += t.size_bytes
                self.offloaded[owner] = self.offloaded.get(owner, 0) + t.size_bytes
                self.fetches.setdefault((ctx, s), []).append(t.size_bytes)
        for u in set(t.users):
            owner = self._owner(u, children)
            if start <= u < stop and owner is not None and owner is not here:
                input_of.add(owner)
        for region in input_of:
            if ctx is ROOT and region.kind != "offload":
                self._hold(key, t.size_bytes, 1)
                self._hold_for_frame(ROOT, region, key)
            elif region.kind == "offload" or any(s in region for s in t.saved_by):
                kept_for.add(region)  # the checkpoint keeps its arguments
            else:
                self._hand_down(key, t, region)
        if cached_here and here not in kept_for:
            # See Rule 6: handed back when the recomputation reaches the op, unless Rule 5 stops
            # it first.
            last, partial = self._stop_node(here, self.children(here))
            if t.producer < last or (t.producer == last and not partial):
                self._hold(key, t.size_bytes, 1)
                self._later(ctx, ("cached", here, t.producer), key)
            else:
                kept_for.add(here)
        for region in kept_for:
            self._hold(key, t.size_bytes, 1)
            self._later(ctx, ("region_end", region), key)

    def _call_end(self, ctx: Region, t: Tensor, start: int, run_stop: int) -> int:
        """See Rule 13: the last node of the outermost region nested in ``ctx`` whose call
        takes ``t`` as an argument in this pass (one that holds a reader of ``t`` and not its
        producer), or -1. Such a call runs whole within the pass (Rule 5 stops a recomputation
        before a nested region, never inside one)."""
        end = -1
        for u in set(t.users):
            if start <= u < run_stop:
                for r in self.chain[u]:
                    if r.depth > ctx.depth and r.start > t.producer:
                        end = max(end, r.stop - 1)
                        break
        return end

    def _hand_down(self, key: tuple, t: Tensor, region: Region) -> None:
        """See Rule 3: storage ``t`` is an argument of ``region``, nested in a recomputation,
        and nothing in ``region`` saves it. It lives until ``region``'s own recomputation ends;
        that recomputation saves it again for each region nested in it that reads it (their
        arguments), and so on down. A region in which nothing saves never recomputes (Rule 4):
        nothing keeps its arguments beyond this recomputation's own variables."""
        if self.saves is not None and trigger_node(self.saves, region.start, region.stop) < (
            region.start
        ):
            return
        self._hold(key, t.size_bytes, 1)
        self._later(region, ("recompute_end",), key)
        for kid in self.children(region):
            if kid.kind == "offload" or not any(u in kid for u in (*t.users, *t.saved_by)):
                continue
            if any(s in kid for s in t.saved_by):
                self._hold(key, t.size_bytes, 1)  # until kid's backward unpacks it
                self._later(region, ("region_end", kid), key)
            else:
                self._hand_down(key, t, kid)

    def backward(self, ctx: Region, label: str = "bwd") -> None:
        start, stop = (0, len(self.g.nodes)) if ctx is ROOT else (ctx.start, ctx.stop)
        children = self.children(ctx)
        i = stop - 1
        while i >= start:
            if i in self.bwd_done:  # a trailing node of a region, run before its recomputation
                i -= 1
                continue
            region = self._owner(i, children)
            if region is not None and region.kind != "offload":
                self.parent[region] = ctx
                for j in range(i, self._trigger(region), -1):  # Rule 4: trailing nodes first
                    if j not in self.bwd_done:
                        self._node_backward(ctx, j, label)
                self.forward(region, "recompute")
                self.backward(region)
                self._release_at(ctx, ("region_end", region))
                i = region.start - 1
                continue
            self._node_backward(ctx, i, label)
            if region is not None and i == region.start:
                self._release_at(ctx, ("region_end", region))  # an offload region's inputs
            i -= 1

    def _node_backward(self, ctx: Region, i: int, label: str) -> None:
        node = self.g.nodes[i]
        self.live_bytes += self.grad_alloc[i]  # gradients and parameter gradients
        fetched = sum(self.fetches.pop((ctx, i), ()))  # offloaded storages come back
        self._mark(f"{label}:{node.name}", node.bwd_temp_bytes + fetched)
        self.live_bytes -= self.grad_free[i]
        self._release_at(ctx, ("bwd", i))
        self._release_at(ROOT, ("frame", i))  # first-forward frames whose first saver it is
        self.apply_changes(("bwd", i))
        self.bwd_done.add(i)

    def _trigger(self, region: Region) -> int:
        """See Rule 4: the node whose backward recomputes ``region``."""
        if self.saves is None:
            return region.stop - 1
        return trigger_node(self.saves, region.start, region.stop)


def simulate(graph: CostGraph, schedule: Schedule) -> Simulation:
    """Predict peak bytes, recompute FLOPs/time and a memory timeline for one training step."""
    replay = _Replay(graph, schedule)
    replay.apply_changes(("fwd", -1))
    replay.forward(ROOT, "fwd")
    replay._release_at(ROOT, ("backward_start",))
    replay.apply_changes(("bwd", len(graph.nodes)))
    replay.backward(ROOT)
    transfer_s = sum(
        offload_time_s(graph, r.start, r.stop, size) for r, size in replay.offloaded.items()
    )
    overhead_s = sum(graph.region_overhead_time_s(r) for r in schedule.regions)
    return Simulation(
        peak_bytes=replay.peak_bytes,
        peak_event=replay.peak_event,
        recompute_flops=replay.recompute_flops,
        recompute_time_s=replay.recompute_time_s,
        offload_bytes=replay.offload_bytes,
        offload_time_s=transfer_s,
        offloaded=tuple(replay.offloaded.items()),
        timeline=tuple(replay.timeline),
        step_time_s=graph.step_time_s + replay.recompute_time_s + transfer_s + overhead_s,
        overhead_time_s=overhead_s,
    )
