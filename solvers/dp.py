"""``dp``'s programme: a Rotor-style dynamic programme over the linearised graph (the solver
around it, its levels and caches: ``solvers/dp_search.py``).

The schedule space is every laminar family of recompute regions, nested to any depth. The
programme walks a *context* (the whole step, or one region being recomputed) left to right.
At a cut it knows the *crossing state* -- each storage produced earlier in the context that a
later node still reads or saves, with a flag saying whether something already forces autograd
or a checkpoint to keep it for backward -- and how many bytes everything kept so far takes.

Every event of ``simulate`` then splits into bytes kept by what lies left of the cut (a prefix
sum) plus bytes fixed by the next step alone: gradient buffers appear and free in reverse node
order whatever the schedule, so they are a function of position; a node's forward working set
is the crossing storages plus its own; and a region's recomputation and backward depend only on
the region (the context it runs in holds fixed bytes meanwhile). So a step is "node ``c`` runs
unchecked" or "nodes ``[c, j)`` form a region"; a region's inside is the same programme one
level down, and a state's value is ``V[m]``: the least recompute time of the rest of its context
using at most ``m`` bytes more than what is already kept.

``V`` is a non-increasing step function of the budget, kept as its breakpoints
(``solvers/frontier.py``): its cost is the number of distinct (memory, time) trade-offs a state
has, not the budget's size, so dp counts every byte by default (a known tool dies with
MemoryError on large budgets; dp's earlier dense tables, 131,072 steps, took 8 GB and most of
its time on GPT-ref in place). ``DPOptions.grid`` rounds every byte count *up* to steps of
budget / grid, so such plans stay within the budget too.

Inside regions a state is keyed by what it depends on rather than where it is (its suffix of
nodes described relative to the context's end, hash-consed), so the repeated blocks of a
transformer share their work.

At the top level the programme also offers selective regions between coarse cuts (matmul
outputs cached, the rest recomputed; ``solvers/selective.py``).

On a module-granular graph (``CostGraph.region_spans``, for plans applied in place) regions are
exactly the spans, nested as the module tree allows, and selective regions are offered on every
span at the top level; the space is then every laminar family of spans, solved in one level.

The table. ``Programme.memo[key] = (V, at, choices)``, one entry per state, where ``key``
interns the state ``(c, b, crossing, root, whole_ok, depth, credit, ctx_stash)``
(:meth:`Layout.key`):

- ``c``: the cut the state is at, the next node to decide on (0 <= c < b);
- ``b``: the end of its context, the cut after the context's last node (n at the root);
- ``crossing``: the storages made in the context before ``c`` that something from ``c`` on
  still reads or saves, each with its flag (False: read later; True: kept for backward;
  ``ARG``: an argument of the region being recomputed, Rule 3), sorted;
- ``root``: the context is the whole step's first forward (else a region's recomputation);
- ``whole_ok``: a region [c, b) may be chosen (False only at a region context's start);
- ``depth``: the nesting depth of the context (0 at the root; counted only under
  ``max_depth``);
- ``credit``: :data:`Credit`, the frame of a top-level region that dies inside the context;
- ``ctx_stash``: units of fork_rng's copy the context's recomputation holds (Rule 12).

Inside a region the key is the state's description relative to ``b`` (the suffix of nodes,
the crossing storages' signatures), so equal blocks share one entry, which records the node
``at`` it was solved at. ``V[m]`` (a :class:`Frontier`, ``m`` in grid units from 0 to
``Space.grid_units``) is the least recompute time, in seconds, of nodes [c, b) with at most
``m`` units more than what is kept when the state starts (INF: nothing fits); each breakpoint
of ``V`` is labelled with the index of the :data:`Choice` in ``choices`` that gives it: stop
the recomputation (:class:`Stop`), run the nodes to the next boundary unchecked
(:class:`Run`), or make [c, j) a recompute (:class:`Nested`), selective (:class:`Selective`) or
offload (:class:`Offload`) region; each names the state it leads to by its key.
:meth:`Programme.regions` reads a schedule back from the table, choice by choice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from planner.solvers.costgraph import Region
from planner.solvers.dp_layout import ARG, Credit, Layout, Space
from planner.solvers.frontier import EMPTY, Frontier, constant, improve
from planner.solvers.prices import Prices, exposed_transfer_s

INF = math.inf


class Work:
    """A search's work so far, counted (states solved, their frontiers' points): what a level
    costs, the same on every machine and under any load. Each search owns one and hands it to
    the programmes it runs."""

    def __init__(self) -> None:
        self.states = 0
        self.cells = 0

    def nominal_s(self) -> float:
        return self.states * STATE_NOMINAL_S + self.cells * CELL_NOMINAL_S


# Whether to refine is decided on the work a level is predicted to take, in the seconds it
# takes a reference CPU core (this project's x86-64 machine: GPT-ref in place, 3,265 states and
# 914,016 points, 0.7 s of CPU time): the same decision under any load and on
# any machine, so the same graph and budget give the same plan. Only the time limit itself
# (a safety net the default levels stay well inside) is the wall clock's.
STATE_NOMINAL_S = 2e-4
CELL_NOMINAL_S = 1.6e-8


# A state's choices, one per breakpoint of its value that it gave (``Frontier`` labels index
# them); ``rest`` is the memo key of the state after the choice (None: the context's end), and
# ``kept_units`` what the choice leaves kept for the rest (the budget the rest has is that much
# less).
@dataclass(frozen=True, slots=True)
class Stop:
    """The recomputation stops here (simulate's Rule 5): the rest runs only its backward."""


@dataclass(frozen=True, slots=True)
class Run:
    """The nodes up to ``stop`` run unchecked in this context."""

    stop: int
    rest: int | None
    kept_units: int


@dataclass(frozen=True, slots=True)
class Nested:
    """Nodes [start, stop) form a recompute region, its inside the state ``inner`` with
    ``inner_shift`` units held around it (``rest`` None: the recomputation stops before it,
    Rule 5)."""

    start: int
    stop: int
    inner: int | None
    inner_shift: int
    rest: int | None
    kept_units: int


@dataclass(frozen=True, slots=True)
class Selective:
    """Nodes [start, stop) form a top-level selective region caching ``keep``'s outputs."""

    start: int
    stop: int
    keep: tuple[int, ...]
    rest: int | None
    kept_units: int


@dataclass(frozen=True, slots=True)
class Offload:
    """Nodes [start, stop) form a top-level offload region (Rule 7)."""

    start: int
    stop: int
    rest: int | None
    kept_units: int


Choice = Stop | Run | Nested | Selective | Offload
STOP = Stop()


class OutOfTime(Exception):
    """The programme passed its deadline; what it had built is incomplete and dropped."""


class Programme(Layout):
    """The memoised recursion. A state is (c, b, crossing, root, whole_ok, depth):

    cut ``c`` inside a context ending at ``b`` (``root``: the whole step, else a region being
    recomputed); ``crossing`` is a sorted tuple of (tensor, kept) pairs; ``whole_ok`` is False
    only at the start of a region context, where a child equal to the region is pointless.
    Inside a region, bytes are counted relative to the gradient bytes live while it is
    recomputed, which is what lets equal blocks share states. A region context also carries
    ``ctx_stash``, the units of fork_rng's copy its recomputation holds (simulate's Rule 12:
    its region draws random numbers), part of its states' keys.
    """

    def __init__(
        self, p: Prices, space: Space, deadline: float | None = None, work: Work | None = None
    ) -> None:
        super().__init__(p, space)
        self.deadline = deadline
        self.work = Work() if work is None else work  # counted here, read by the search
        # key -> (V, node it was computed at, its choices: V's labels index them); a key is the
        # state's description interned to an int (:meth:`key`), cheap to hash and to store
        self.memo: dict[int, tuple[Frontier, int, list[Choice]]] = {}
        self._end = constant(0, 0.0)

    def selective_option(self, c, j, b, crossing, best, options, keep):
        """Nodes [c, j) as a selective region at the root: the outputs of the ``keep`` nodes
        that the region saves are cached from the first forward (held until the region's
        backward ends) and those nodes are not recomputed; everything else is."""
        p, root = self.p, True
        if not keep:
            return best
        # See simulate's Rule 2: the frame holds the arguments and the stash to the backward
        # of the region's first saving node (none when nothing in it saves)
        frame = self.first_save[c] < j
        stash = p.stash_of(c, j) if frame else 0
        args = sum(p.size_units[t] for t, kept in crossing if not kept and self.needed_in(t, c, j))
        fwd_own, inner, own_kept, own_nxt, cost = self.selective_parts(c, j, b, keep, args)
        fwd = sum(p.size_units[t] for t, _ in crossing) + fwd_own
        held = sum(p.size_units[t] for t, kept in crossing if kept) + (args if frame else 0)
        held += stash  # its own; fork_rng's copy and the cached outputs are in ``inner``
        kept_bytes, nxt = stash + own_kept, list(own_nxt)
        for t, kept in crossing:
            if self.last_need(t, b, root) < j:
                kept_bytes += p.size_units[t] if frame or kept else 0
            else:
                nxt.append((t, kept or (frame and self.needed_in(t, c, j))))
        nxt = tuple(sorted(nxt))
        rest_key = self.key(j, b, nxt, root, True, 0)
        rest = self.value_at(rest_key, j, b, nxt, root, True, 0)
        if rest.top == INF:
            return best
        need = max(fwd, held + p.grad_after_units[j] + inner)
        v = rest.shifted(kept_bytes, self.size).plus(cost).from_(max(need, 0))
        best, better = improve(best, v, len(options))
        if better:
            options.append(Selective(c, j, tuple(keep), rest_key, kept_bytes))
        return best

    # -- the recursion -----------------------------------------------------------------------
    def step(
        self,
        i: int,
        b: int,
        crossing: tuple,
        root: bool,
        partial: bool = False,
        offload: tuple[int, int] | None = None,
        credit: Credit = None,
        ctx_stash: int = 0,
    ):
        """Node i unchecked: (bytes its events need, bytes it leaves kept, crossing after).
        ``partial``: a recomputation stopping at i, after its last save (Rule 5), so without
        what i allocates after it. ``offload``: i lies in an offload region over those nodes,
        which sends what i saves of the storages made inside it to host, and brings it back
        for i's backward (Rule 7). ``credit``: see :data:`Credit`. ``ctx_stash``: units of
        fork_rng's copy the context's recomputation holds (Rule 12; 0 at the root)."""
        p = self.p
        own, saves = p.produced[i], p.saves[i]
        fetched = 0
        if offload is not None:
            sent = {t for t in saves if offload[0] <= p.producer[t] < offload[1]}
            saves, fetched = saves - sent, sum(p.size_units[t] for t in sent)
        if partial:
            own = tuple(t for t in own if not p.after_last_save[t])
        fwd = (
            sum(p.size_units[t] for t, _ in crossing)
            + sum(p.size_units[t] for t in own)
            + p.fwd_temp_units[i]
        )
        # a recomputation runs with fork_rng's copy of the stash it restored (Rule 12)
        fwd += p.held_fwd_units[i] if root else ctx_stash + self.trig_grad[b]  # Rule 4
        bwd = (p.grad_at_bwd_units[i] if root else p.grad_rel(i, b)) + p.bwd_temp_units[i] + fetched
        bwd += sum(p.size_units[t] for t, kept in crossing if kept is True or t in saves)
        bwd += sum(p.size_units[t] for t in own if t in saves)
        if credit is not None and i < credit[0]:
            bwd -= credit[1]
        kept_bytes, nxt = 0, []
        for t, kept in crossing:
            if kept == ARG:
                if i < b - 1:
                    nxt.append((t, ARG))
                continue
            kept = kept or t in saves
            if self.last_need(t, b, root) == i:
                kept_bytes += p.size_units[t] if kept else 0
            else:
                nxt.append((t, kept))
        for t in own:
            if self.last_need(t, b, root) == i:
                kept_bytes += p.size_units[t] if t in saves else 0
            else:
                nxt.append((t, t in saves))
        return max(fwd, bwd), kept_bytes, tuple(sorted(nxt))

    def run(
        self,
        c: int,
        stop: int,
        b: int,
        crossing: tuple,
        root: bool,
        last_save: int,
        credit: Credit = None,
        ctx_stash: int = 0,
    ) -> tuple[int, int, tuple, int | None]:
        """Nodes [c, stop) unchecked, one :meth:`step` after another: (bytes their events need,
        bytes they leave kept, crossing after, and when ``last_save`` lies among them the
        bytes a recomputation stopping after it needs (Rule 5), else None).

        The same sums as repeated :meth:`step` calls, kept as running totals and updated only
        for the storages a node allocates, saves or last needs, so a node costs its own
        storages rather than the whole crossing (a scan keeps hundreds alive)."""
        p = self.p
        cross = dict(crossing)
        cross_bytes = sum(p.size_units[t] for t in cross)
        held_bytes = sum(p.size_units[t] for t, kept in crossing if kept is True)
        need, kept_bytes, stopped = 0, 0, None
        for i in range(c, stop):
            saves = p.saves[i]
            if i == last_save:
                here = tuple(sorted(cross.items()))
                more, kept_more, after = self.step(i, b, here, root, True, None, credit, ctx_stash)
                kept_more += sum(p.size_units[t] for t, kept in after if kept is True)
                # Rule 4: the nodes after the last save ran their backward before it
                tail = self.bwd_max(i + 1, b)
                stopped = max(need, kept_bytes + more, tail)
            fwd = cross_bytes + self.own_bytes[i] + p.fwd_temp_units[i]
            # a recomputation runs with fork_rng's copy of the stash it restored (Rule 12)
            fwd += p.held_fwd_units[i] if root else ctx_stash + self.trig_grad[b]  # Rule 4
            bwd = (p.grad_at_bwd_units[i] if root else p.grad_rel(i, b)) + p.bwd_temp_units[i]
            bwd += held_bytes + self.own_saved_bytes[i]
            if credit is not None and i < credit[0]:
                bwd -= credit[1]
            for t in saves:
                kept = cross.get(t)
                if kept is None or kept is True:
                    continue
                bwd += p.size_units[t]  # read here, and saved by this node
                if kept is False:
                    cross[t] = True
                    held_bytes += p.size_units[t]
            need = max(need, kept_bytes + max(fwd, bwd))
            if i == b - 1 and not root:  # the context's end: nothing crosses it
                kept_bytes += held_bytes + self.own_saved_bytes[i]
                cross, cross_bytes, held_bytes = {}, 0, 0
                continue
            for t in self.dies_at[i]:
                kept = cross.get(t)
                if kept is None or kept == ARG or (root and p.is_output[t]):
                    continue
                del cross[t]
                cross_bytes -= p.size_units[t]
                if kept:
                    kept_bytes += p.size_units[t]
                    held_bytes -= p.size_units[t]
            for t in p.produced[i]:
                if self.last_need(t, b, root) == i:
                    kept_bytes += p.size_units[t] if t in saves else 0
                else:
                    cross[t] = t in saves
                    cross_bytes += p.size_units[t]
                    held_bytes += p.size_units[t] if t in saves else 0
        return need, kept_bytes, tuple(sorted(cross.items())), stopped

    def value_at(
        self,
        key: int | None,
        c: int,
        b: int,
        crossing: tuple,
        root: bool,
        whole_ok: bool,
        depth: int,
        credit: Credit = None,
        ctx_stash: int = 0,
    ) -> Frontier:
        """``V[m]``: least recompute time from cut c to the context's end within m units, for
        the state whose :meth:`key` is ``key`` (callers keep the key: the choices they record
        name the state by it). ``ctx_stash``: units of fork_rng's copy the context's
        recomputation holds (Rule 12: its region's :meth:`Prices.stash_of`; 0 at the root)."""
        if key is None:
            return self._end
        got = self.memo.get(key)
        if got is not None:
            return got[0]
        if self.deadline is not None and time.process_time() > self.deadline:
            raise OutOfTime
        p, size = self.p, self.size
        options: list = []
        best = EMPTY
        # A recomputation runs this context's nodes, so they cost time; the first forward
        # does not.
        run_s = p.prefix_time_s.__getitem__ if not root else lambda _: 0.0
        stopping = self.early_stop and not root
        last_save = self.last_save[b] if stopping else b
        # Nodes up to the next boundary run unchecked in this context.
        stop = min(self.next_bound[c], b)
        need, kept_bytes, nxt, stopped = self.run(
            c, stop, b, crossing, root, last_save, credit, ctx_stash
        )
        if stopped is not None and stopped < size:
            # See simulate's Rule 5: the recomputation stops after node last_save's last save;
            # the nodes after it save nothing and do not run again, only their backward.
            best, _ = improve(best, constant(stopped, run_s(last_save + 1) - run_s(c)), 0)
            options.append(STOP)
        if last_save < c:  # nothing left saves: the recomputation stopped before c
            stopped = self.bwd_max(c, b, credit)  # Rule 4: their backward ran before it
            if stopped < size:
                best, _ = improve(best, constant(stopped, 0.0), len(options))
                options.append(STOP)
        if need < size:
            rest_key = self.key(stop, b, nxt, root, True, depth, credit, ctx_stash)
            rest = self.value_at(rest_key, stop, b, nxt, root, True, depth, credit, ctx_stash)
            v = rest.shifted(kept_bytes, size).from_(need)  # below the need nothing fits
            best, better = improve(best, v.plus(run_s(stop) - run_s(c)), len(options))
            if better:
                options.append(Run(stop, rest_key, kept_bytes))
        if self.max_depth is None or depth < self.max_depth:
            best = self.region_options(
                c, b, crossing, root, whole_ok, depth, credit, ctx_stash, best, options
            )
        if root and self.offload and (self.max_depth is None or depth < self.max_depth):
            best = self.offload_options(c, b, crossing, best, options)
        self.memo[key] = (best, c, options)
        self.work.states += 1
        self.work.cells += len(best)
        return best

    def region_options(
        self,
        c: int,
        b: int,
        crossing: tuple,
        root: bool,
        whole_ok: bool,
        depth: int,
        credit: Credit,
        ctx_stash: int,
        best: Frontier,
        options: list[Choice],
    ) -> Frontier:
        """Nodes [c, j) as a recompute region, for each allowed end j (and, at the root
        between coarse cuts, as selective ones): ``best`` improved by each, their choices
        appended to ``options``. The state's arguments as :meth:`value_at`'s."""
        p, size = self.p, self.size
        run_s = p.prefix_time_s.__getitem__ if not root else lambda _: 0.0
        stopping = self.early_stop and not root
        last_save = self.last_save[b] if stopping else b
        cross_bytes = sum(p.size_units[t] for t, _ in crossing)
        ends = self.region_ends(c, b)
        peaks = self.fwd_peaks(c, b, root, ends[-1] if ends else c, ctx_stash)
        survivors = self.survivors(c, b, root, ends)
        if ends:
            crossing_kept, unread, info = self.crossing_info(c, b, crossing, root, ends[-1])
        for j in ends:
            if j == b and not whole_ok:
                break
            child_stash = p.stash_of(c, j)  # Rule 12: none unless it preserves
            fwd = cross_bytes + peaks[j - 1 - c] + child_stash
            fwd += 0 if root else self.trig_grad[b]  # Rule 4
            if fwd >= size and not stopping:
                break  # the forward working set only grows with j
            held, inner_crossing, args = self.child_args(j, crossing_kept, info, root)
            # See simulate's Rule 2: at the top level the child's frame holds its arguments
            # and its stash to the backward of its first saving node; no frame when nothing
            # in it saves. In a recomputation, Rules 3 and 12 (unchanged by the frame).
            frame = not root or self.first_save[c] < j
            stash = child_stash if frame else 0
            inner_credit = credit if credit is not None and c < credit[0] else None
            if not frame:
                held -= args  # what only the frame would have held
            elif root and c < self.first_save[c]:
                inner_credit = (self.first_save[c], args + stash)
            inner_state = (c, j, inner_crossing, False, False, depth + 1)
            inner_state += (inner_credit, child_stash)
            inner_key = self.key(*inner_state)
            inner_shift = held + (p.grad_after_units[j] if root else p.grad_after_rel(j, b))
            inner_shift += stash  # its own stash, to its backward's end
            if stopping and last_save < j:
                # See simulate's Rule 5: the child is this recomputation's last save (its
                # arguments), so the recomputation stops before it; the nodes after it run
                # only their backward, with the child's arguments still alive (Rule 3).
                inner = self.value_at(inner_key, *inner_state)
                v = inner.shifted(inner_shift, size).plus(p.overhead_s(c, j, "recompute"))
                # Rule 4: the nodes after the child run their backward before this
                # recomputation, with nothing of it alive
                v = v.from_(self.bwd_max(j, b, credit))
                best, better = improve(best, v, len(options))
                if better:
                    options.append(Nested(c, j, inner_key, inner_shift, None, 0))
            if fwd >= size:
                continue
            coarse = self.span_ends is not None or (self.is_coarse[c] and self.is_coarse[j])
            if root and self.selective and coarse:
                keeps = {tuple(i for i in range(c, j) if k[i]) for k in self.keep_sets}
                for keep in sorted(keeps):
                    best = self.selective_option(c, j, b, crossing, best, options, keep)
            inner = self.value_at(inner_key, *inner_state)
            if inner.top == INF:
                continue
            kept_bytes, nxt = stash, [(t, False) for t in survivors[j]]
            nxt += unread
            for t, kept, t_size, need_at, _, end in info:
                if kept == ARG and not need_at < j:
                    nxt.append((t, ARG))  # alive to this recomputation's end (Rule 3)
                elif end < j:
                    if frame or kept is True:
                        kept_bytes += t_size  # read inside the region: kept as its input
                else:
                    # an argument of this context read inside the region is kept as its
                    # input too, past this recomputation's end (Rule 3)
                    nxt.append((t, kept is True or (frame and need_at < j)))
            nxt = tuple(sorted(nxt))
            rest_key = self.key(j, b, nxt, root, True, depth, credit, ctx_stash)
            rest = self.value_at(rest_key, j, b, nxt, root, True, depth, credit, ctx_stash)
            if rest.top == INF:
                continue
            # only budgets from the forward's need up (below it nothing fits)
            v = inner.shifted(inner_shift, size).add(rest.shifted(kept_bytes, size))
            # the child runs in this context's recomputation, and costs its own overhead
            v = v.from_(fwd).plus(run_s(j) - run_s(c) + p.overhead_s(c, j, "recompute"))
            best, better = improve(best, v, len(options))
            if better:
                options.append(Nested(c, j, inner_key, inner_shift, rest_key, kept_bytes))
        return best

    def offload_options(self, c, b, crossing, best, options):
        """Nodes [c, j) as a top-level offload region, for each allowed end j: they run once,
        what they save of their own storages goes to host and comes back for the backward
        that reads it, their arguments stay to the region's end (Rule 7); no recomputation,
        the exposed transfer time instead."""
        p = self.p
        for j in self.region_ends(c, b):
            args = tuple(sorted((t, kept or self.needed_in(t, c, j)) for t, kept in crossing))
            need, kept_bytes, sent_bytes, nxt = 0, 0, 0, args
            for i in range(c, j):
                more, kept_more, nxt = self.step(i, b, nxt, True, offload=(c, j))
                need = max(need, kept_bytes + more)
                kept_bytes += kept_more
                sent_bytes += sum(p.size_bytes[t] for t in p.saves[i] if c <= p.producer[t] < j)
            if need >= self.size:
                break  # the region's working set only grows with j
            rest_key = self.key(j, b, nxt, True, True, 0)
            rest = self.value_at(rest_key, j, b, nxt, True, True, 0)
            if rest.top == INF:
                continue
            transfer_s = exposed_transfer_s(
                sent_bytes,
                p.fwd_prefix_s[j] - p.fwd_prefix_s[c],
                p.offload_bytes_per_s,
                p.offload_overlap,
            )
            v = rest.shifted(kept_bytes, self.size).from_(need)
            v = v.plus(transfer_s + p.overhead_s(c, j, "offload"))
            best, better = improve(best, v, len(options))
            if better:
                options.append(Offload(c, j, rest_key, kept_bytes))
        return best

    def regions(self, key, m: int, at: int, depth: int = 0) -> list[Region]:
        """Rebuild the regions of state ``key`` within ``m`` units, the state being at node
        ``at`` (its value may have been computed elsewhere: shift by the difference)."""
        out: list[Region] = []
        while key is not None:
            value, computed_at, options = self.memo[key]
            offset = at - computed_at
            choice: Choice = options[value.label_at(m)]
            match choice:
                case Stop():
                    break
                case Run(stop, rest, kept):
                    at = stop + offset
                case Offload(c, j, rest, kept):
                    out.append(Region(c + offset, j + offset, depth, "offload"))
                    at = j + offset
                case Selective(c, j, keep, rest, kept):
                    saved = frozenset(i + offset for i in keep)
                    out.append(Region(c + offset, j + offset, depth, "selective", saved))
                    at = j + offset
                case Nested(c, j, inner, inner_shift, rest, kept):
                    out.append(Region(c + offset, j + offset, depth=depth))
                    if inner is not None:
                        inner_m = min(m - inner_shift, self.size - 1)
                        out += self.regions(inner, inner_m, c + offset, depth + 1)
                    at = j + offset
            key, m = rest, m - kept
        return out
