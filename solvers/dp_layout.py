"""The static side of dp's programme (``solvers/dp.py``): the search's space (:class:`Space`)
laid over a graph's prices -- where regions may begin and end, what a storage's lifetime is in a
context, the bytes of a region's pieces that do not depend on the crossing state, memoised --
and the state keys that let equal blocks share their states (hash-consed descriptions)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from planner.solvers.prices import Prices, region_peak

# See simulate's Rule 2: (f, q): the backward of every node before node f in a context (and in
# the regions nested in it) runs with q units fewer than the context's shift counts: a
# top-level region's frame, which holds q units (its arguments only it keeps, its RNG stash),
# dies at the backward of f, its first saving node. None: no such node in the context.
Credit = tuple[int, int] | None
# A crossing storage's flag: False (read later in the context), True (kept for backward), or
# ARG: an argument of the region being recomputed, alive to the end of its recomputation and
# no longer unless a region nested in it reads it (simulate's Rule 3).
ARG = 2


@dataclass(frozen=True)
class Space:
    """The bounds and switches of one programme's search (``DPOptions`` resolved for a graph):
    regions end within ``max_span`` boundaries of their start, or at ``coarse_cuts`` at most
    ``coarse_span`` of them apart; nested at most ``max_depth`` deep (None: any depth); bytes
    counted up to ``grid_units`` units; top-level ``selective`` and ``offload`` regions offered
    or not; ``spans``: a module-granular graph's region spans (None: any interval)."""

    coarse_cuts: tuple[int, ...]
    max_span: int
    max_depth: int | None
    grid_units: int
    coarse_span: int
    selective: bool
    spans: frozenset[tuple[int, int]] | None = None
    offload: bool = False


class Layout:
    """A programme's tables that depend on the graph and the space only, and the pieces of
    its prices and keys computed from them (memoised: the same for every crossing state)."""

    def __init__(self, p: Prices, space: Space) -> None:
        self.p = p
        self.space = space
        spans, max_depth = space.spans, space.max_depth
        # Top-level offload regions with nothing nested in them.
        self.offload = space.offload
        # Region boundaries only after nodes that allocate (a cut after a view is the same cut
        # as the one before it, and skipping it leaves fewer states), never where an in-place
        # write forbids them. Module-granular graphs: exactly the ends of their region spans.
        self.bounds = list(p.bounds)
        self.span_ends: dict[int, list[int]] | None = None
        if spans is not None:
            self.span_ends = {}
            for a, b in sorted(spans):
                self.span_ends.setdefault(a, []).append(b)
            self.bounds = sorted({0, p.n, *(c for ab in spans for c in ab)})
        # Op-level keeps run inside module regions (applied in place): there a region may also
        # keep every matmul output, the attention scores' too, as SAC's usual policy does.
        self.keep_sets = [p.keepable] if spans is None else [p.keepable, p.matmul]
        self.is_bound = [False] * (p.n + 1)
        for c in self.bounds:
            self.is_bound[c] = True
        self.next_bound = [p.n] * (p.n + 1)
        for c in range(p.n - 1, -1, -1):
            self.next_bound[c] = c + 1 if self.is_bound[c + 1] else self.next_bound[c + 1]
        coarse = {max(b for b in self.bounds if b <= c) for c in space.coarse_cuts}
        self.coarse = sorted(coarse | {0, p.n})
        self.is_coarse = [False] * (p.n + 1)
        for c in self.coarse:
            self.is_coarse[c] = True
        self.max_span = space.max_span
        self.coarse_span = space.coarse_span  # long regions cross at most this many coarse cuts
        self.max_depth = max_depth
        self.selective = space.selective  # top-level selective regions between coarse cuts
        self.size = space.grid_units + 1  # V[m] for m = 0..grid units
        self._ids: dict[tuple, int] = {}
        self._suffix: dict[tuple[int, int], int] = {}
        self._interned: dict[tuple, int] = {}
        # the last node reading or saving each storage (its producer when none does)
        self.last_use = [ns[-1] if ns else p.producer[t] for t, ns in enumerate(p.needers)]
        self._wmax: dict[tuple[int, int, bool, int, int], list[int]] = {}
        self._keys: dict[tuple, int] = {}
        # Memos of what does not depend on the crossing state: a scan keeps hundreds of storages
        # crossing, and the same (tensor, context end) or selective region recurs in many states.
        self._sigs: dict[tuple[int, int, int], tuple] = {}
        self._selective: dict[tuple[int, int, int, tuple[int, ...], int], tuple] = {}
        self._survivors: dict[tuple[int, int, bool], dict[int, list[int]]] = {}
        self.sorted_savers = [sorted(ss) for ss in p.savers]
        # See simulate's Rule 5: recomputations stop after the last node that saves; the last
        # such node before each cut (-1: none).
        self.early_stop = p.rule5_saves is not None
        self.last_save = [-1] * (p.n + 1)
        for i, saves in enumerate(p.rule5_saves or ()):
            self.last_save[i + 1] = i if saves else self.last_save[i]
        # See simulate's Rule 2: a top-level region's frame (its arguments, its RNG stash) lives
        # to the backward of its first saving node, the first such node from each cut (n:
        # none; without save flags the cut itself: held to the region's backward's end).
        self.first_save = list(range(p.n + 1))
        if p.rule5_saves is not None:
            for i in range(p.n - 1, -1, -1):
                self.first_save[i] = i if p.rule5_saves[i] else self.first_save[i + 1]
        # See simulate's Rule 4: a recomputation of a region ending at b runs once the backward
        # of the nodes after its last save is done: its forward's gradients, relative to b's.
        self.trig_grad = [
            p.grad_after_rel(self.last_save[b] + 1, b) if self.last_save[b] >= 0 else 0
            for b in range(p.n + 1)
        ]
        self._bwd_max: dict[tuple[int, int, int, int], int] = {}
        # Per node, for :meth:`run`: the storages whose last reader or saver it is, the bytes it
        # allocates, and those of them it saves.
        self.dies_at: list[list[int]] = [[] for _ in range(p.n)]
        for t, last in enumerate(self.last_use):
            self.dies_at[last].append(t)
        self.own_bytes = [sum(p.size_units[t] for t in own) for own in p.produced]
        # The storages nodes allocate, in node order, for :meth:`fwd_peaks`.
        order = [t for own in p.produced for t in own]
        self._t_producer = np.array([p.producer[t] for t in order], np.int64)
        self._t_size = np.array([p.size_units[t] for t in order], np.int64)
        self._t_last_use = np.array([self.last_use[t] for t in order], np.int64)
        self._t_output = np.array([p.is_output[t] for t in order], bool)
        self._fwd_temp = np.array(p.fwd_temp_units, np.int64)
        self._held_fwd = np.array(p.held_fwd_units, np.int64)
        self.own_saved_bytes = [
            sum(p.size_units[t] for t in own if t in p.saves[i]) for i, own in enumerate(p.produced)
        ]

    # -- static pieces ---------------------------------------------------------------------
    def last_need(self, t: int, b: int, root: bool) -> int:
        """Last node in a context ending at ``b`` that reads or saves ``t``."""
        if root and self.p.is_output[t]:
            return self.p.n  # an output lives until backward starts
        last = self.last_use[t]
        return b - 1 if last >= b else last  # a recomputed region output: to its end

    def needed_in(self, t: int, c: int, j: int) -> bool:
        ns = self.p.needers[t]
        k = bisect.bisect_left(ns, c)
        return k < len(ns) and ns[k] < j

    def bwd_max(self, c: int, b: int, credit: Credit = None) -> int:
        """Most units the backward of a node in [c, b) adds to what is kept (gradient buffers,
        relative to the context's, and its working set): the backward of nodes a stopped
        recomputation did not reach (0 when there are none). ``credit``: see :data:`Credit`."""
        f, q = credit if credit is not None else (c, 0)
        got = self._bwd_max.get((c, b, f, q))
        if got is None:
            p = self.p
            got = max(
                (p.grad_rel(i, b) + p.bwd_temp_units[i] - (q if i < f else 0) for i in range(c, b)),
                default=0,
            )
            self._bwd_max[(c, b, f, q)] = got = max(got, 0)
        return got

    def survivors(self, c: int, b: int, root: bool, ends: list[int]) -> dict[int, list[int]]:
        """For each end j in ``ends``: the storages made in [c, j) still needed at j or later
        in the context ending at ``b`` (``ends``: :meth:`region_ends`, a function of c and b).
        The same for every crossing state at c: memoised."""
        got = self._survivors.get((c, b, root))
        if got is None:
            got, alive, last = {}, [], c
            for j in ends:
                for i in range(last, j):
                    alive += [(t, self.last_need(t, b, root)) for t in self.p.produced[i]]
                last = j
                alive = [(t, end) for t, end in alive if end >= j]
                got[j] = [t for t, _ in alive]
            self._survivors[(c, b, root)] = got
        return got

    def crossing_info(
        self, c: int, b: int, crossing: tuple, root: bool, upto: int
    ) -> tuple[int, tuple, list[tuple]]:
        """The crossing storages of a state at cut c, for its regions [c, j) with j <= ``upto``:
        (bytes of those kept for backward, which every such region holds; the (tensor, flag)
        pairs that cross every such region unread, as they cross; the others as (tensor,
        kept, size, first reader or saver from c on, first saver from c on, last need in the
        context), so that each region asks ``< j`` instead of searching again). A scan keeps
        hundreds of storages alive across a few regions that read none of them."""
        p = self.p
        never = p.n + 1
        kept_bytes, unread, out = 0, [], []
        for t, kept in crossing:
            ns = p.needers[t]
            k = bisect.bisect_left(ns, c)
            need_at = ns[k] if k < len(ns) else never
            end = self.last_need(t, b, root)
            if kept != ARG and kept:
                kept_bytes += p.size_units[t]
            if need_at >= upto and end >= upto:
                unread.append((t, kept if kept == ARG else kept is True))
                continue
            ss = self.sorted_savers[t]
            k = bisect.bisect_left(ss, c)
            save_at = ss[k] if k < len(ss) else never
            out.append((t, kept, p.size_units[t], need_at, save_at, end))
        return kept_bytes, tuple(unread), out

    def child_args(
        self, j: int, kept_bytes: int, info: list[tuple], root: bool
    ) -> tuple[int, tuple, int]:
        """A child region [c, j) of this context (``kept_bytes`` and ``info``:
        :meth:`crossing_info` at c): (units held through its recomputation and backward, the
        crossing its own context starts with, units of its arguments).

        A checkpoint keeps its arguments (Rule 2), and everything kept for backward stays. In a
        recomputation, arguments nothing in the child saves live only to the end of the child's
        own recomputation (Rule 3), the arguments of this context among them: this
        recomputation saves them again for the child; those the child does not read have died
        before it recomputes."""
        held, inner, args = kept_bytes, [], 0
        for t, kept, size, need_at, save_at, _ in info:
            needed = need_at < j
            if kept == ARG:
                if needed:
                    args += size
                    if save_at < j:
                        held += size
                    else:
                        inner.append((t, ARG))
                continue
            if kept:
                continue  # counted in kept_bytes
            if needed:
                args += size
                if root or save_at < j:
                    held += size
                else:
                    inner.append((t, ARG))
        return held, tuple(sorted(inner)), args

    def fwd_peaks(self, c: int, b: int, root: bool, upto: int, ctx_stash: int = 0) -> list[int]:
        """Running max over i in [c, upto) of the bytes produced from c on and alive at i's
        forward (plus i's working set), with the context ending at ``b``: a storage is alive
        from its producer to its last need (:meth:`last_need`), summed as a difference array.
        ``ctx_stash``: units of fork_rng's copy the recomputation holds (Rule 12)."""
        key = (c, b, root, upto, ctx_stash)
        got = self._wmax.get(key)
        if got is None:
            lo, hi = np.searchsorted(self._t_producer, (c, upto))
            size, last = self._t_size[lo:hi], np.minimum(self._t_last_use[lo:hi], b - 1)
            if root:  # an output lives until backward starts
                last = np.where(self._t_output[lo:hi], self.p.n, last)
            diff = np.zeros(upto - c + 1, np.int64)
            np.add.at(diff, self._t_producer[lo:hi] - c, size)
            np.add.at(diff, np.minimum(last + 1, upto) - c, -size)
            alive = np.cumsum(diff[:-1]) + self._fwd_temp[c:upto]
            # the first forward's held storages; a recomputation's fork_rng copy (Rule 12)
            alive += self._held_fwd[c:upto] if root else ctx_stash
            got = self._wmax[key] = np.maximum.accumulate(alive).tolist()
        return got

    def selective_parts(
        self, c: int, j: int, b: int, keep: tuple[int, ...], args: int = 0
    ) -> tuple:
        """What a selective region [c, j) at the root costs, given the units of its arguments
        nothing else keeps (``args``: its frame's, Rule 2), memoised: (its first forward's peak
        above the crossing, its recomputation and backward's peak relative to the gradients
        then, its cache included, bytes of its own storages it leaves kept, those crossing its
        end, its recomputation's and overhead's time)."""
        key = (c, j, b, keep, args)
        got = self._selective.get(key)
        if got is not None:
            return got
        p, root = self.p, True
        keep_set = set(keep)
        # Selective checkpointing caches every output of a kept op, whether backward reads it
        # or not (simulate's model): all of them stay alive to the region's backward.
        cached = [t for i in keep for t in p.produced[i]]
        cached_set = set(cached)
        # The first forward through [c, j): cached outputs stay alive past their last use.
        alive, fwd, ends = 0, 0, {}
        for i in range(c, j):
            for t in p.produced[i]:
                alive += p.size_units[t]
                if t not in cached_set:
                    end = self.last_need(t, b, root)
                    ends[end] = ends.get(end, 0) + p.size_units[t]
            fwd = max(fwd, alive + p.fwd_temp_units[i] + p.held_fwd_units[i] + p.stash_of(c, j))
            alive -= ends.pop(i, 0)
        # Recomputation (kept nodes skipped, their cache handed back as it reaches them: Rule
        # 6, up to where Rule 5 stops it) and backward, relative to the gradients then.
        reached = j
        if self.early_stop:
            reached = self.last_save[j] if self.last_save[j] >= c else -1
        trigger = max(reached, c - 1) if self.early_stop else None  # Rule 4
        first = self.first_save[c]
        stash = p.stash_of(c, j)  # Rule 12
        frame = (first, args + stash) if first < j else None  # Rule 2
        inner = region_peak(p, c, j, keep_set, reached, stash, trigger, frame)
        inner -= p.grad_after_units[j]
        own_kept, own_nxt = 0, []
        for i in range(c, j):
            for t in p.produced[i]:
                if self.last_need(t, b, root) >= j:
                    own_nxt.append((t, t in cached_set))
                elif t in cached_set:
                    own_kept += p.size_units[t]  # cached until the region's backward ends
        cost = sum(p.time_s[i] for i in range(c, j) if i not in keep_set)
        cost += p.overhead_s(c, j, "selective")
        got = (fwd, inner, own_kept, tuple(own_nxt), cost)
        self._selective[key] = got
        return got

    def region_ends(self, c: int, b: int) -> list[int]:
        """Ends j of regions starting at c: any within ``max_span`` nodes, and the coarse cuts
        beyond when c is one (long regions only between cheap cuts); on a module-granular
        graph, the ends of the spans starting at c."""
        if self.span_ends is not None:
            return [j for j in self.span_ends.get(c, ()) if j <= b]
        k = bisect.bisect_right(self.bounds, c)
        ends = [j for j in self.bounds[k : k + self.max_span] if j <= b]
        if self.is_coarse[c] and ends:
            k = bisect.bisect_right(self.coarse, ends[-1])
            top = bisect.bisect_right(self.coarse, c) + self.coarse_span
            ends += [j for j in self.coarse[k:top] if j <= b]
        return ends

    # -- state keys --------------------------------------------------------------------------
    def _tensor_sig(self, t: int, c: int, b: int) -> tuple:
        """Storage ``t`` as a state from cut ``c`` on sees it, relative to the context's end:
        what reads or saves it from ``c`` on (what came before is in its flag). Memoised."""
        got = self._sigs.get((t, c, b))
        if got is None:
            p = self.p
            got = self._sigs[(t, c, b)] = (
                p.size_units[t],
                tuple(u - b for u in p.needers[t] if c <= u < b),
                tuple(sorted(s - b for s in p.savers[t] if c <= s < b)),
                bool(p.needers[t]) and p.needers[t][-1] >= b,  # needed past b: see last_need
                p.after_last_save[t],
            )
        return got

    def suffix_id(self, c: int, b: int) -> int:
        """Interned description of nodes [c, b) relative to ``b`` and to its gradient base.
        Built from ``b`` down without recursion, so long contexts share work too."""
        got = self._suffix.get((c, b))
        if got is not None:
            return got
        p = self.p
        todo, i = [], c
        while i < b and (i, b) not in self._suffix:
            todo.append(i)
            i += 1
        if i == b and (b, b) not in self._suffix:
            desc: tuple = ("end", self.is_coarse[b])
            self._suffix[(b, b)] = self._interned.setdefault(desc, len(self._interned))
        nxt = self._suffix[(i, b)]
        for i in reversed(todo):
            desc = (
                p.fwd_temp_units[i],
                p.bwd_temp_units[i],
                p.time_s[i],
                p.grad_rel(i, b),
                p.grad_after_rel(i, b),
                self.is_coarse[i],
                self.is_bound[i],
                self._spans_at(i, b),
                self.early_stop and p.rule5_saves[i],
                bool(p.stash_units) and p.random[i],  # Rule 12: its regions stash
                tuple(self._tensor_sig(t, i, b) for t in p.produced[i]),
                nxt,
            )
            nxt = self._suffix[(i, b)] = self._interned.setdefault(desc, len(self._interned))
        return nxt

    def _spans_at(self, i: int, b: int) -> tuple[int, ...]:
        """Ends (relative to ``b``) of the region spans starting at node i within the context."""
        if self.span_ends is None:
            return ()
        return tuple(j - b for j in self.span_ends.get(i, ()) if j <= b)

    def key(
        self, c, b, crossing, root, whole_ok, depth, credit: Credit = None, ctx_stash: int = 0
    ) -> int | None:
        """The state's memo key (None at the context's end): states with equal descriptions
        (:meth:`_key`) share one. A crossing is a long tuple and Python does not cache a
        tuple's hash, so each description is hashed once here and stands for an int after."""
        if c == b:
            return None
        d = depth if self.max_depth is not None else 0
        if credit is not None and (c >= credit[0] or not credit[1]):
            credit = None  # no backward before its node left in this context
        where = (c, b, crossing, root, whole_ok, d, credit, ctx_stash)
        got = self._keys.get(where)
        if got is None:
            desc = self._key(c, b, crossing, root, whole_ok, d, credit, ctx_stash)
            got = self._keys[where] = self._ids.setdefault(desc, len(self._ids))
        return got

    def _key(self, c, b, crossing, root, whole_ok, d, credit, ctx_stash):
        if root:
            return ("root", c, crossing, d)
        cross = tuple((self._tensor_sig(t, c, b), kept) for t, kept in crossing)
        lead = None if credit is None else (credit[0] - b, credit[1])
        return (self.suffix_id(c, b), cross, whole_ok, d, self.trig_grad[b], lead, ctx_stash)
