"""``dp``: a Rotor-style dynamic programme over the linearised graph.

Its claim: among the laminar families of recompute regions of its space, dp finds one of least
predicted step time (recompute time plus each region's bookkeeping,
``CostGraph.region_overhead_s``) whose peak *by simulate* fits the budget. Its prices are
``simulate``'s Rules 1-5 and 10 in closed form: early stop (Rule 5: a recomputation runs to its
last save, the last saving node stops after that save, and a nested region that is the last save
is not run by its parent's recomputation), the lifetimes of nested regions' arguments (Rule
3: to the end of the nested region's own recomputation unless it saves them, and handed down to
the regions nested in it that read them) and of a top-level region's frame (Rule 2: its
arguments and stash live to the backward of its first saving node, a :data:`Credit` its
context carries down; none when nothing in it saves). Asserted against
brute force (every laminar family, scored by ``simulate``) at every budget on random chains,
DAGs with skips and held storages, and chains with in-place writes, with Rule 5 on and off
(``tests/solvers/test_dp_exactness.py``), and with nodes that save nothing
(``tests/solvers/test_frame.py``). Outside that exact space: selective regions, priced as
recomputed to their end, their cache handed back as simulate's Rule 6 says
(``prices.region_peak``),
and three rules only estimated graphs use, which dp does not model exactly, so its prices may
differ from simulate's there: Python-held storages (``Tensor.freed_after``, Rule 1), buffer
copies (Rule 9) and CPU checkpoints' RNG stashes (Rule 12: priced per region over a node that
draws random numbers, nested ones approximately). :func:`solve_dp` replays its answer through
``simulate`` and never returns a plan above the budget by it. ``Schedule.gap`` is 0.0 only when
the space was every interval of the uncoarsened graph on a 1-byte grid and the graph uses none of
those three rules; the note names the space searched.

With ``DPOptions.offload`` (by default: when ``CostGraph.host_link``, a GPU's) the space also
holds top-level offload regions with nothing nested in them (simulate's Rule 7: saves sent to
host, transfers partly hidden behind the region's compute), priced as the time they add to the
step; exact against brute force over the same space too. Never by default on a CPU, where the
host is the device (an offload frees nothing there). On a module-granular graph they are its
spans (the in-place form runs them with ``passes/offload.py``).

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

Graphs with more than ``DPOptions.max_bounds`` region boundaries are coarsened into stages
(:func:`stage_bounds`): regions then begin and end only at stage boundaries and span at most
``DPOptions.staged_span`` stages, and the note says so; such a graph refines only within
STAGED_REFINE_SHARE of the time limit. :func:`solve_dp` is anytime: on a graph with twice
``first_stages`` boundaries or more it solves coarse to fine (``DPOptions.first_stages`` stages,
FIRST_STAGES by default, times LEVEL_GROWTH, up to ``max_bounds``:
:func:`stage_levels`), keeps the best schedule any level found, and answers with it when the
time limit (``DPOptions.time_limit_s``) cuts the next level short or leaves too little time to
start it; the note names the space of the level that answered and what was cut short. The
programme assumes every tensor a node saves is one it reads or produces (true of autograd).
:func:`solve_dp` replays its answer through ``simulate``.

The least feasible budget dp states is not its search's: that moved with the budget's grid,
the objective and how far the time limit let the search get (Qwen2-MoE graph form: 994,216 B
stated at 1 B, then 1,055,976 B at 994,216 B). It is :func:`least_memory`'s, one schedule
sought on a space fixed by counted work, on the graph with objective-free times, and dp
answers with it wherever its search finds nothing within a budget it fits.
"""

from __future__ import annotations

import bisect
import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar

import numpy as np

from planner.solvers.common import finish
from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import allowed_cuts, block_spans, crossing_bytes, even_cuts, region_bounds
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.frontier import EMPTY, Frontier, constant, dense, improve
from planner.solvers.greedy import GreedyOptions, solve_greedy
from planner.solvers.prices import Prices, exposed_transfer_s, prices, region_peak
from planner.solvers.registry import SolverOptions, register, time_limit_text
from planner.solvers.revolve import RevolveOptions, solve_revolve
from planner.solvers.simulate import simulate

INF = math.inf
# See simulate's Rule 2: (f, q): the backward of every node before node f in a context (and in
# the regions nested in it) runs with q units fewer than the context's shift counts: a
# top-level region's frame, which holds q units (its arguments only it keeps, its RNG stash),
# dies at the backward of f, its first saving node. None: no such node in the context.
Credit = tuple[int, int] | None
# A crossing storage's flag: False (read later in the context), True (kept for backward), or
# ARG: an argument of the region being recomputed, alive to the end of its recomputation and
# no longer unless a region nested in it reads it (simulate's Rule 3).
ARG = 2
DEFAULT_SPAN = 8
DEFAULT_COARSE = 24
# A long region crosses at most this many coarse cuts (4 transformer blocks): longer ones
# multiply the states (every cut of the region, for each length) for little gain.
DEFAULT_COARSE_SPAN = 8
# Graphs with more region boundaries than this are coarsened into stages first: the work grows
# with boundaries times span cubed, and past a few hundred it no longer fits a time limit.
DEFAULT_MAX_BOUNDS = 384
# A stage holds several boundaries, so a region reaches as far in fewer of them: on the 10k
# chain, Mamba-128 and the 7B shape, 4 stages plan within 0.04% of 8's step time (Mamba and 7B
# the same plans), 10-35% sooner.
DEFAULT_STAGED_SPAN = 4
# dp solves a graph with more region boundaries than this coarse to fine, from this many
# stages up: an answer early, then better ones while time lasts.
FIRST_STAGES = 48
# Each level has this many times the stages of the one before. A level's work grows about
# linearly with its stages (Mamba-128, CPU: 2.8 s at 48, 10.9 s at 192, 17.6 s at 384), so
# the levels before the last cost about a third of it when each has four times the stages, a
# whole one when each has twice (and on Mamba the 96-stage level found nothing either).
LEVEL_GROWTH = 4
# On a graph coarsened even at the finest level, refining stops once a level improves the
# predicted step time by less than this fraction.
REFINE_GAIN = 0.005
# On such a graph every level is an approximation and each finer one gains less (Mamba-128:
# 0.2% of the step from 194 to 353 stages, for 20 s), so a refinement is started only if it is
# predicted to end within this share of the time limit: the user's wait buys the coarse
# levels' large gains, not the last fraction of a percent.
STAGED_REFINE_SHARE = 1 / 3


@dataclass(frozen=True)
class DPOptions(SolverOptions):
    """dp's search space. A region may span up to ``max_span`` boundaries from any cut, or run
    between two coarse cuts (block boundaries and ``coarse_cuts`` spread ones, None: one per 8
    nodes, at most 24) at most ``coarse_span`` coarse cuts apart; ``max_span=None`` (or a graph
    no longer than it) allows every interval. ``max_depth`` caps the nesting (None: any depth).
    ``grid``: bytes are rounded up to steps of budget / grid (None: every byte counts; a
    state's value is kept as its breakpoints, ``solvers/frontier.py``, so a coarse grid only
    loses plans: on GPT-ref at SAC's measured peak, 2048 steps of 207 kB put SAC's own schedule
    8 MiB over, and dp recomputed attention scores instead). ``selective`` also offers
    top-level selective regions between coarse cuts (matmul outputs kept, the rest
    recomputed). ``max_bounds``: on a graph with more region boundaries
    than this, dp first coarsens it into that many stages (see :func:`stage_bounds`) and
    searches regions whose boundaries are stage boundaries (None: never); a region then spans
    up to ``staged_span`` stages (if less than ``max_span``). ``first_stages``: the coarsest
    level's stages (:func:`stage_levels`)."""

    searches: ClassVar[bool] = True

    max_span: int | None = DEFAULT_SPAN
    coarse_cuts: int | None = None
    max_depth: int | None = None
    grid: int | None = None
    selective: bool = True
    coarse_span: int = DEFAULT_COARSE_SPAN
    max_bounds: int | None = DEFAULT_MAX_BOUNDS
    staged_span: int = DEFAULT_STAGED_SPAN
    first_stages: int = FIRST_STAGES
    # Also offer top-level offload regions (simulate's Rule 7). None: when the graph's device
    # has a host link (``CostGraph.host_link``: offloading frees device memory; never on a CPU).
    offload: bool | None = None


class _Work:
    """The programme's work so far, counted (states solved, their frontiers' points): what a
    level costs,
    the same on every machine and under any load."""

    states = 0
    cells = 0

    def nominal_s(self) -> float:
        return self.states * STATE_NOMINAL_S + self.cells * CELL_NOMINAL_S


WORK = _Work()
# Whether to refine is decided on the work a level is predicted to take, in the seconds it
# takes a reference CPU core (this project's x86-64 machine: GPT-ref in place, 3,265 states and
# 914,016 points, 0.7 s of CPU time): the same decision under any load and on
# any machine, so the same graph and budget give the same plan. Only the time limit itself
# (a safety net the default levels stay well inside) is the wall clock's.
STATE_NOMINAL_S = 2e-4
CELL_NOMINAL_S = 1.6e-8


class OutOfTime(Exception):
    """The programme passed its deadline; what it had built is incomplete and dropped."""


class _Programme:
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
        self,
        p: Prices,
        coarse: list[int],
        max_span: int,
        max_depth: int | None,
        grid: int,
        coarse_span: int,
        selective: bool,
        deadline: float | None = None,
        spans: frozenset[tuple[int, int]] | None = None,
        offload: bool = False,
    ) -> None:
        self.p = p
        # Top-level offload regions with nothing nested in them.
        self.offload = offload
        self.deadline = deadline
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
        coarse = {max(b for b in self.bounds if b <= c) for c in coarse}
        self.coarse = sorted(coarse | {0, p.n})
        self.is_coarse = [False] * (p.n + 1)
        for c in self.coarse:
            self.is_coarse[c] = True
        self.max_span = max_span
        self.coarse_span = coarse_span  # long regions cross at most this many coarse cuts
        self.max_depth = max_depth
        self.selective = selective  # top-level selective regions between coarse cuts
        self.size = grid + 1  # V[m] for m = 0..grid units
        # key -> (V, node it was computed at, options, best option per m); a key is the
        # state's description interned to an int (:meth:`key`), cheap to hash and to store
        self.memo: dict[int, tuple[Frontier, int, list]] = {}
        self._ids: dict[tuple, int] = {}
        self._suffix: dict[tuple[int, int], int] = {}
        self._interned: dict[tuple, int] = {}
        # the last node reading or saving each storage (its producer when none does)
        self.last_use = [ns[-1] if ns else p.producer[t] for t, ns in enumerate(p.needers)]
        self._wmax: dict[tuple[int, int, bool, int, int], list[int]] = {}
        self._end = constant(0, 0.0)
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
        self.own_bytes = [sum(p.size[t] for t in own) for own in p.produced]
        # The storages nodes allocate, in node order, for :meth:`fwd_peaks`.
        order = [t for own in p.produced for t in own]
        self._t_producer = np.array([p.producer[t] for t in order], np.int64)
        self._t_size = np.array([p.size[t] for t in order], np.int64)
        self._t_last_use = np.array([self.last_use[t] for t in order], np.int64)
        self._t_output = np.array([p.is_output[t] for t in order], bool)
        self._fwd_temp = np.array(p.fwd_temp, np.int64)
        self._held_fwd = np.array(p.held_fwd, np.int64)
        self.own_saved_bytes = [
            sum(p.size[t] for t in own if t in p.saves[i]) for i, own in enumerate(p.produced)
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
                (p.grad_rel(i, b) + p.bwd_temp[i] - (q if i < f else 0) for i in range(c, b)),
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
                kept_bytes += p.size[t]
            if need_at >= upto and end >= upto:
                unread.append((t, kept if kept == ARG else kept is True))
                continue
            ss = self.sorted_savers[t]
            k = bisect.bisect_left(ss, c)
            save_at = ss[k] if k < len(ss) else never
            out.append((t, kept, p.size[t], need_at, save_at, end))
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
        args = sum(p.size[t] for t, kept in crossing if not kept and self.needed_in(t, c, j))
        fwd_own, inner, own_kept, own_nxt, cost = self.selective_parts(c, j, b, keep, args)
        fwd = sum(p.size[t] for t, _ in crossing) + fwd_own
        held = sum(p.size[t] for t, kept in crossing if kept) + (args if frame else 0)
        held += stash  # its own; fork_rng's copy and the cached outputs are in ``inner``
        kept_bytes, nxt = stash + own_kept, list(own_nxt)
        for t, kept in crossing:
            if self.last_need(t, b, root) < j:
                kept_bytes += p.size[t] if frame or kept else 0
            else:
                nxt.append((t, kept or (frame and self.needed_in(t, c, j))))
        nxt = tuple(sorted(nxt))
        rest_key = self.key(j, b, nxt, root, True, 0)
        rest = self.value_at(rest_key, j, b, nxt, root, True, 0)
        if rest.top == INF:
            return best
        need = max(fwd, held + p.grad_after[j] + inner)
        v = rest.shifted(kept_bytes, self.size).plus(cost).from_(max(need, 0))
        best, better = improve(best, v, len(options))
        if better:
            options.append(("selective", c, j, tuple(keep), rest_key, kept_bytes))
        return best

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
                alive += p.size[t]
                if t not in cached_set:
                    end = self.last_need(t, b, root)
                    ends[end] = ends.get(end, 0) + p.size[t]
            fwd = max(fwd, alive + p.fwd_temp[i] + p.held_fwd[i] + p.stash_of(c, j))
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
        inner -= p.grad_after[j]
        own_kept, own_nxt = 0, []
        for i in range(c, j):
            for t in p.produced[i]:
                if self.last_need(t, b, root) >= j:
                    own_nxt.append((t, t in cached_set))
                elif t in cached_set:
                    own_kept += p.size[t]  # cached until the region's backward ends
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
                p.size[t],
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
                p.fwd_temp[i],
                p.bwd_temp[i],
                p.time_s[i],
                p.grad_rel(i, b),
                p.grad_after_rel(i, b),
                self.is_coarse[i],
                self.is_bound[i],
                self._spans_at(i, b),
                self.early_stop and p.rule5_saves[i],
                bool(p.stash) and p.random[i],  # Rule 12: its regions stash
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
            saves, fetched = saves - sent, sum(p.size[t] for t in sent)
        if partial:
            own = tuple(t for t in own if not p.after_last_save[t])
        fwd = sum(p.size[t] for t, _ in crossing) + sum(p.size[t] for t in own) + p.fwd_temp[i]
        # a recomputation runs with fork_rng's copy of the stash it restored (Rule 12)
        fwd += p.held_fwd[i] if root else ctx_stash + self.trig_grad[b]  # Rule 4
        bwd = (p.grad_at_bwd[i] if root else p.grad_rel(i, b)) + p.bwd_temp[i] + fetched
        bwd += sum(p.size[t] for t, kept in crossing if kept is True or t in saves)
        bwd += sum(p.size[t] for t in own if t in saves)
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
                kept_bytes += p.size[t] if kept else 0
            else:
                nxt.append((t, kept))
        for t in own:
            if self.last_need(t, b, root) == i:
                kept_bytes += p.size[t] if t in saves else 0
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
        cross_bytes = sum(p.size[t] for t in cross)
        held_bytes = sum(p.size[t] for t, kept in crossing if kept is True)
        need, kept_bytes, stopped = 0, 0, None
        for i in range(c, stop):
            saves = p.saves[i]
            if i == last_save:
                here = tuple(sorted(cross.items()))
                more, kept_more, after = self.step(i, b, here, root, True, None, credit, ctx_stash)
                kept_more += sum(p.size[t] for t, kept in after if kept is True)
                # Rule 4: the nodes after the last save ran their backward before it
                tail = self.bwd_max(i + 1, b)
                stopped = max(need, kept_bytes + more, tail)
            fwd = cross_bytes + self.own_bytes[i] + p.fwd_temp[i]
            # a recomputation runs with fork_rng's copy of the stash it restored (Rule 12)
            fwd += p.held_fwd[i] if root else ctx_stash + self.trig_grad[b]  # Rule 4
            bwd = (p.grad_at_bwd[i] if root else p.grad_rel(i, b)) + p.bwd_temp[i]
            bwd += held_bytes + self.own_saved_bytes[i]
            if credit is not None and i < credit[0]:
                bwd -= credit[1]
            for t in saves:
                kept = cross.get(t)
                if kept is None or kept is True:
                    continue
                bwd += p.size[t]  # read here, and saved by this node
                if kept is False:
                    cross[t] = True
                    held_bytes += p.size[t]
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
                cross_bytes -= p.size[t]
                if kept:
                    kept_bytes += p.size[t]
                    held_bytes -= p.size[t]
            for t in p.produced[i]:
                if self.last_need(t, b, root) == i:
                    kept_bytes += p.size[t] if t in saves else 0
                else:
                    cross[t] = t in saves
                    cross_bytes += p.size[t]
                    held_bytes += p.size[t] if t in saves else 0
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
            options.append(("stop",))
        if last_save < c:  # nothing left saves: the recomputation stopped before c
            stopped = self.bwd_max(c, b, credit)  # Rule 4: their backward ran before it
            if stopped < size:
                best, _ = improve(best, constant(stopped, 0.0), len(options))
                options.append(("stop",))
        if need < size:
            rest_key = self.key(stop, b, nxt, root, True, depth, credit, ctx_stash)
            rest = self.value_at(rest_key, stop, b, nxt, root, True, depth, credit, ctx_stash)
            v = rest.shifted(kept_bytes, size).from_(need)  # below the need nothing fits
            best, better = improve(best, v.plus(run_s(stop) - run_s(c)), len(options))
            if better:
                options.append(("run", stop, rest_key, kept_bytes))
        # Nodes [c, j) form a region, for each allowed end j.
        if self.max_depth is None or depth < self.max_depth:
            cross_bytes = sum(p.size[t] for t, _ in crossing)
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
                inner_shift = held + (p.grad_after[j] if root else p.grad_after_rel(j, b))
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
                        options.append(("region", c, j, inner_key, inner_shift, None, 0))
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
                    options.append(
                        (
                            "region",
                            c,
                            j,
                            inner_key,
                            inner_shift,
                            rest_key,
                            kept_bytes,
                        )
                    )
        if root and self.offload and (self.max_depth is None or depth < self.max_depth):
            best = self.offload_options(c, b, crossing, best, options)
        self.memo[key] = (best, c, options)
        WORK.states += 1
        WORK.cells += len(best)
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
                options.append(("offload", c, j, rest_key, kept_bytes))
        return best

    def regions(self, key, m: int, at: int, depth: int = 0) -> list[Region]:
        """Rebuild the regions of state ``key`` within ``m`` units, the state being at node
        ``at`` (its value may have been computed elsewhere: shift by the difference)."""
        out: list[Region] = []
        while key is not None:
            value, computed_at, options = self.memo[key]
            offset = at - computed_at
            option = options[value.label_at(m)]
            if option[0] == "stop":
                break
            if option[0] == "run":
                _, nxt_at, key, kept_bytes = option
                at, m = nxt_at + offset, m - kept_bytes
            elif option[0] == "offload":
                _, c, j, key, kept_bytes = option
                out.append(Region(c + offset, j + offset, depth, "offload"))
                at, m = j + offset, m - kept_bytes
            elif option[0] == "selective":
                _, c, j, keep, key, kept_bytes = option
                saved = frozenset(i + offset for i in keep)
                out.append(Region(c + offset, j + offset, depth, "selective", saved))
                at, m = j + offset, m - kept_bytes
            else:
                _, c, j, inner, inner_shift, rest, kept_bytes = option
                out.append(Region(c + offset, j + offset, depth=depth))
                if inner is not None:
                    inner_m = min(m - inner_shift, self.size - 1)
                    out += self.regions(inner, inner_m, c + offset, depth + 1)
                key, m, at = rest, m - kept_bytes, j + offset
        return out


def coarse_cut_points(graph: CostGraph, count: int | None) -> list[int]:
    """Where long regions may begin and end: every repeated block's boundaries and its
    cheapest inner cut (a transformer block's attention/MLP seam), plus ``count`` cuts spread
    evenly, each the cheapest (fewest crossing bytes) near its even position. None: one per 8
    nodes, at most DEFAULT_COARSE. Not the globally cheapest cuts: those bunch up (in the
    embedding or the head, or all at the start of a uniform chain), where long regions help
    least."""
    n = len(graph.nodes)
    if count is None:
        count = min(DEFAULT_COARSE, max(2, n // 8))
    seeds: set[int] = set()
    for a, b in block_spans(graph):
        seeds |= set(even_cuts(graph, 2, a, b)) if b - a >= 2 else {a, b}
    # A whole-number stride, so equal stretches (a uniform chain) get equally spaced cuts and
    # the programme's states for them coincide (shared by hash-consing).
    stride = max(1, round(n / max(1, count)))
    crossing = crossing_bytes(graph)
    ok = allowed_cuts(graph)  # in-place writes forbid some cuts
    for target in range(stride, n, stride):
        lo, hi = max(1, target - stride // 2), min(n, target + (stride + 1) // 2)
        window = [c for c in range(lo, hi) if ok[c]]
        if window:
            seeds.add(min(window, key=lambda c: (crossing[c], abs(c - target))))
    return sorted({0, n, *seeds})


def stage_bounds(graph: CostGraph, bounds: tuple[int, ...], count: int | None) -> tuple[int, ...]:
    """The region boundaries dp searches: all of ``bounds`` when there are at most ``count``;
    else about ``count`` of them, so that each run of nodes between two (a pointwise chain, a
    view, a scan's steps) becomes one stage. Each repeated block gets the same number of stage
    cuts at the same offsets (the cheapest cuts near even positions inside it, its boundaries
    included), so equal blocks stay equal and the programme shares their work; the rest of the
    graph gets the cheapest cuts near even positions, and the graph's region spans keep their
    ends. Each is moved to the boundary at or before it."""
    if count is None or len(bounds) <= count:
        return bounds
    n = len(graph.nodes)
    spans = block_spans(graph)
    if spans:
        inside = sum(b - a for a, b in spans)
        per_block = max(1, round(count * inside / n / len(spans)))
        picked = {c for a, b in spans for c in even_cuts(graph, per_block, a, b)}
        for lo, hi in ((0, spans[0][0]), (spans[-1][1], n)):
            if hi > lo:
                picked |= set(even_cuts(graph, max(1, round(count * (hi - lo) / n)), lo, hi))
    else:  # whole-number strides: equal stretches (a uniform chain) get equal stages
        picked = set(coarse_cut_points(graph, count))
    if graph.region_spans is not None:
        picked |= {c for span in graph.region_spans for c in span}
    return tuple(sorted({bounds[bisect.bisect_right(bounds, c) - 1] for c in picked | {0, n}}))


@dataclass(frozen=True)
class Solved:
    """One run of the programme up to ``cap_bytes``: ask it for any budget up to that."""

    graph: CostGraph
    programme: _Programme
    root: Frontier

    @property
    def unit_bytes(self) -> int:
        return self.programme.p.unit_bytes

    @property
    def root_value(self) -> np.ndarray:
        """The whole step's ``V[m]`` at every unit of the grid, as an array (one float per
        unit up to the cap: for small graphs and tests; :attr:`root` is the same function)."""
        return dense(self.root, self.programme.size)

    def least_bytes(self) -> int | None:
        """Least budget (rounded up to the grid) any schedule of the space fits, or None."""
        first = self.root.first
        return None if first is None else first * self.unit_bytes

    def schedule(self, budget_bytes: float) -> Schedule | None:
        """The least-recompute schedule within ``budget_bytes``, or None if none fits."""
        m = min(int(budget_bytes // self.unit_bytes), self.programme.size - 1)
        if m < 0 or self.root.at(m) == INF:
            return None
        prog = self.programme
        regions = prog.regions(prog.key(0, prog.p.n, (), True, True, 0), m, 0)
        return Schedule(tuple(regions), "dp")


def solve_all(
    graph: CostGraph,
    cap_bytes: float,
    options: DPOptions = DPOptions(),
    deadline: float | None = None,
) -> Solved:
    """Run the programme once for every budget up to ``cap_bytes`` (OutOfTime past
    ``deadline``, a ``time.process_time()`` value: dp's clock, see :func:`solve_dp`)."""
    unit = 1 if options.grid is None else max(1, math.ceil(cap_bytes / options.grid))
    p = prices(graph, unit)
    p = replace(p, bounds=stage_bounds(graph, p.bounds, options.max_bounds))
    span = p.n if options.max_span is None else options.max_span
    coarse = coarse_cut_points(graph, options.coarse_cuts)
    prog = _Programme(
        p,
        coarse,
        span,
        options.max_depth,
        int(cap_bytes // unit),
        options.coarse_span,
        options.selective,
        deadline,
        graph.region_spans,
        graph.host_link if options.offload is None else options.offload,
    )
    return _run(graph, prog)


def _run(graph: CostGraph, prog: _Programme) -> Solved:
    n = prog.p.n
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * n + 1000))
    try:
        start = (0, n, (), True, True, 0)  # the whole step, from its first cut, as root
        root = prog.value_at(prog.key(*start), *start)
    finally:
        sys.setrecursionlimit(limit)
    return Solved(graph, prog, root)


def without_selective(solved: Solved, deadline: float | None = None) -> Solved:
    """``solved``'s programme run again without selective regions, as :func:`solve_all` with
    ``selective=False`` and the same cap would, sharing every state of a region context
    instead of solving it again: only root states offer selective regions (``value_at``), and
    nothing else about a state depends on ``selective``, so a region context's value and
    choices are the same (T5 in place: 439 of the 547 states). The root's are solved again
    (OutOfTime past ``deadline``)."""
    prog = solved.programme
    root = {i for desc, i in prog._ids.items() if desc[0] == "root"}
    again = copy.copy(prog)  # its caches of what does not depend on the state are shared too
    again.memo = {key: got for key, got in prog.memo.items() if key not in root}
    again.selective = False
    again.deadline = deadline
    return _run(solved.graph, again)


# Programmes already run (:func:`solved_once`), by (graph, space, cap): a programme run up to
# the eager peak answers every budget below it (its cost hardly depends on the cap: the tiny
# GPT-2's graph, 29,176 states, 12.8-13.4 s at caps from 30% to 100% of eager), so a sweep of
# budgets, compare's rows and a re-plan at another budget read one run.
SOLVED_CACHE_SIZE = 4
_SOLVED_CACHE: dict[tuple[CostGraph, DPOptions, float], tuple[Solved, int, int]] = {}


def solved_once(
    graph: CostGraph,
    cap_bytes: float,
    options: DPOptions,
    deadline: float | None,
    make: Callable[[], Solved] | None = None,
) -> Solved:
    """:func:`solve_all`'s run (or ``make()``'s, the same programme got another way), from
    the cache when this graph, space and cap ran before (SOLVED_CACHE_SIZE runs kept). A run
    read from the cache counts the work it took again (``WORK``): whether dp refines further
    is decided on counted work, which must not depend on what ran before."""
    key = (graph, replace(options, time_limit_s=0.0), cap_bytes)
    got = _SOLVED_CACHE.pop(key, None)
    if got is None:
        states, cells = WORK.states, WORK.cells
        solved = make() if make is not None else solve_all(graph, cap_bytes, options, deadline)
        got = (solved, WORK.states - states, WORK.cells - cells)
    else:
        WORK.states += got[1]
        WORK.cells += got[2]
    _keep_recent(_SOLVED_CACHE, key, got, SOLVED_CACHE_SIZE)
    return got[0]


def _keep_recent(cache: dict, key: object, value: object, size: int) -> None:
    """``cache[key] = value`` as the most recent of at most ``size`` entries (a popped
    entry put back is made the most recent)."""
    cache[key] = value
    while len(cache) > size:
        del cache[next(iter(cache))]


# The least-memory schedule (:func:`least_memory`) is sought on dp's levels coarse to fine
# (:func:`dp_levels`, from FIRST_STAGES stages), each one solved
# whole, while the work the next is predicted to take (nominal, counted: ``WORK``) keeps the
# whole search within this many nominal seconds. A fixed count, not the time limit: the least
# stated must not move with the time a caller (auto's share for dp) leaves, nor with the load.
# Qwen2 graph form (112 boundaries): 40 stages 1.4 s, all 112 (predicted 16 s) 9.6 s, 661,128 B
# against 739,424 B; Qwen2-MoE (178): 43 stages 1.5 s, all 178 predicted 25 s: not refined.
LEAST_NOMINAL_S = 20.0
# Of each level's whole step, the schedules at this many of its least budgets where its value
# changes (its frontier's first points) are replayed through simulate and the lowest peak
# kept: where the graph uses simulate's approximated rules, the programme's estimated prices
# do not rank the few least schedules as simulate does (Qwen2: its least cell 663,385 B by
# simulate, a later one 661,128 B).
LEAST_CELLS = 32
# Least-memory schedules already sought, by (graph as least_memory sees it, its space): a
# sweep of budgets, the flops objective's graph and auto's calls then seek it once.
LEAST_CACHE_SIZE = 4


@dataclass(frozen=True)
class LeastMemory:
    """dp's least-memory schedule: ``peak_bytes`` its peak by ``simulate``, the least budget dp
    states (every budget from it up is planned: :func:`solve_dp`); ``space`` names the space
    of the level that found it."""

    peak_bytes: int
    schedule: Schedule
    space: str


def memory_graph(graph: CostGraph) -> CostGraph:
    """``graph`` as the least-memory search sees it: its memory as it is, every node's
    recomputation timed by the roofline and no checkpoint overhead, so that the objective's
    re-timing (``graph_for_objective``, ``weighted_graph``: memory unchanged) does not change
    which of the least-memory schedules is picked (the least the error states)."""
    nodes = tuple(
        replace(
            nd,
            fwd_time_s=max(
                nd.fwd_flops / graph.flops_per_s, nd.fwd_bytes_accessed / graph.bytes_per_s
            ),
        )
        for nd in graph.nodes
    )
    return replace(
        graph,
        nodes=nodes,
        recompute_scale=1.0,
        region_overhead_s=0.0,
        saving_node_overhead_s=0.0,
        selective_call_overhead_s=0.0,
        offload_region_overhead_s=0.0,
        offloaded_storage_overhead_s=0.0,
    )


def least_memory(graph: CostGraph, options: DPOptions = DPOptions()) -> LeastMemory:
    """dp's least-memory schedule over its space without selective regions (whose recomputation
    simulate prices higher than dp), the same whatever the budget asked, the objective, the
    time limit and the load: the least :func:`solve_dp` states, and what it answers with at
    that budget when its search finds nothing (rounding to the budget's grid).

    No deadline: the levels searched are fixed by counted work (LEAST_NOMINAL_S), the coarsest
    always. Cached (LEAST_CACHE_SIZE graphs)."""
    key = (memory_graph(graph), replace(options, time_limit_s=0.0, selective=False))
    got = _LEAST_CACHE.pop(key, None)
    if got is None:
        got = _seek_least_memory(*key)
    _keep_recent(_LEAST_CACHE, key, got, LEAST_CACHE_SIZE)
    return got


_LEAST_CACHE: dict[tuple[CostGraph, DPOptions], LeastMemory] = {}


def _seek_least_memory(graph: CostGraph, options: DPOptions) -> LeastMemory:
    eager = simulate(graph, Schedule()).peak_bytes
    # The eager step itself, for when no schedule lowers its peak: rounded up onto the grid,
    # none (the eager one included) then fits under it.
    best = (eager, Schedule(), "the eager step")
    options = replace(options, first_stages=FIRST_STAGES)
    spent_s, done = 0.0, None  # nominal work so far; (size, nominal s) of the last level
    levels = dp_levels(graph, options)
    for _, level_options, stages in levels:
        span = stages if level_options.max_span is None else min(level_options.max_span, stages)
        # the work grows about as stages x span^2 (Qwen2-MoE: 43 stages, span 4: 1.5 s; 178,
        # span 8: 25 s)
        size = stages * span * span
        if done is not None and spent_s + done[1] * size / done[0] > LEAST_NOMINAL_S:
            break
        work0_s = WORK.nominal_s()
        solved = solve_all(graph, eager, level_options)
        done = (size, WORK.nominal_s() - work0_s)
        spent_s += done[1]
        seen: set[tuple[Region, ...]] = set()
        for m in solved.root.xs[:LEAST_CELLS]:  # the least budgets where the value changes
            schedule = solved.schedule(int(m) * solved.unit_bytes)
            if schedule is None or schedule.regions in seen:
                continue
            seen.add(schedule.regions)
            peak = simulate(graph, schedule).peak_bytes
            if peak < best[0]:
                best = (peak, schedule, _space(graph, level_options)[1])
    peak, schedule, space = best
    return LeastMemory(peak, Schedule(schedule.regions, "dp"), space)


def least_memory_schedule(
    graph: CostGraph, options: DPOptions = DPOptions()
) -> tuple[int, Schedule]:
    """(:func:`least_memory`'s peak by ``simulate``, its schedule)."""
    found = least_memory(graph, options)
    return found.peak_bytes, found.schedule


def least_peak(graph: CostGraph, options: DPOptions = DPOptions()) -> int:
    """The least budget dp states and plans (:func:`least_memory`)."""
    return least_memory(graph, options).peak_bytes


def _prices_exactly(graph: CostGraph) -> bool:
    """Whether dp's prices are simulate's on ``graph`` (see the module docstring)."""
    return not (
        any(nd.state_bytes for nd in graph.nodes)
        or any(t.freed_after > t.producer for t in graph.tensors)
        or graph.region_stash_bytes(0, len(graph.nodes))
    )


def _space(graph: CostGraph, options: DPOptions) -> tuple[bool, str]:
    """(whether the space is every laminar family of the graph's regions, what it is)."""
    depth = "" if options.max_depth is None else f", depth <= {options.max_depth}"
    if graph.region_spans is not None:  # module-granular: the spans are the whole space
        return True, "every module-call region" + depth
    every = options.max_span is None or len(graph.nodes) <= options.max_span
    note = "every interval" if every else f"spans <= {options.max_span} boundaries or coarse cuts"
    bounds = tuple(region_bounds(graph))
    staged = stage_bounds(graph, bounds, options.max_bounds)
    if len(staged) < len(bounds):
        every = False
        note = f"boundaries at {len(staged)} stage cuts of {len(bounds)}, {note}"
    return every, note + depth


class _NoFit(Exception):
    """Nothing in the space searched fits the budget (the least it reaches was not sought)."""


def _solve_within(
    graph: CostGraph, budget_bytes: float, options: DPOptions, deadline: float, eager: int
) -> tuple[tuple[Region, ...], str, float | None]:
    """(regions, note, gap) of the least recompute time within budget over ``options``'
    space; OutOfTime past ``deadline``; _NoFit when nothing of it fits on the budget's grid
    (:func:`solve_dp` then answers with :func:`least_memory`'s schedule if it fits)."""
    every, note = _space(graph, options)
    # Optimal for simulate only where its prices are simulate's (see the module docstring).
    every = every and _prices_exactly(graph)
    # Up to the eager peak, so that the run answers every budget (solved_once); on a grid,
    # whose step is a share of the cap, up to the budget.
    cap = float(eager) if options.grid is None else min(float(budget_bytes), eager)
    solved: Solved | None = None
    for with_selective in (True, False) if options.selective else (False,):
        opts = replace(options, selective=with_selective)
        if solved is None:
            solved = solved_once(graph, cap, opts, deadline)
        else:  # the same programme without selective regions, its region contexts shared
            solved = solved_once(
                graph, cap, opts, deadline, partial(without_selective, solved, deadline)
            )
        schedule = solved.schedule(budget_bytes)
        if schedule is None:
            break  # nothing of the space fits, nor of its part without selective regions
        if simulate(graph, schedule).peak_bytes > budget_bytes:
            continue  # simulate prices selective recomputation higher
        if solved.unit_bytes > 1:
            note += f", bytes rounded up to {solved.unit_bytes}"
        exact = every and solved.unit_bytes == 1
        return schedule.regions, note, 0.0 if exact else None
    raise _NoFit


def dp_levels(graph: CostGraph, options: DPOptions) -> list[tuple[str, DPOptions, int]]:
    """The levels dp solves in turn, coarse to fine: (what the level is, its options, its stage
    count). Finer stages (:func:`stage_levels`; regions then span at most ``staged_span``
    stages); one level on a module-granular graph."""
    bounds = tuple(region_bounds(graph))
    out = []
    for count in stage_levels(graph, options):
        stages = len(stage_bounds(graph, bounds, count))
        level = f"{count} stages" if count is not None else f"all {len(bounds)} boundaries"
        level_options = replace(options, max_bounds=count)
        if stages < len(bounds) and options.max_span is not None:
            span = min(options.max_span, options.staged_span)
            level_options = replace(level_options, max_span=span)
        out.append((level, level_options, stages))
    return out


def stage_levels(graph: CostGraph, options: DPOptions) -> list[int | None]:
    """The stage counts (``max_bounds``) dp solves in turn, coarse to fine:
    ``options.first_stages``, times LEVEL_GROWTH while a level keeps at most half the graph's
    boundaries (a coarser level saves little time then), then ``options.max_bounds``; one level
    on a graph with fewer than twice that many boundaries (or whose regions follow module
    spans, which are never staged)."""
    top = options.max_bounds
    if graph.region_spans is not None:
        return [top]
    n_bounds = len(region_bounds(graph))
    levels: list[int | None] = []
    count = options.first_stages
    while 2 * count <= n_bounds and (top is None or count < top):
        levels.append(count)
        count *= LEVEL_GROWTH
    return [*levels, top]


def is_staged(graph: CostGraph, options: DPOptions) -> bool:
    """Whether dp coarsens ``graph`` into stages even at its finest level (``max_bounds``)."""
    top = options.max_bounds
    return top is not None and graph.region_spans is None and len(region_bounds(graph)) > top


@register("dp", options=DPOptions)
def solve_dp(graph: CostGraph, budget_bytes: float, options: DPOptions) -> Schedule:
    """Least recompute time within the budget over nested regions (the space: DPOptions).

    The least budget it states is :func:`least_memory`'s: one schedule's peak by ``simulate``,
    sought on a space fixed by counted work (no deadline) over the graph with objective-free
    times, so the same whatever the budget asked, the objective, the time limit and the load.
    When nothing of the space searched fits the budget on its grid (rounding up, or a model
    disagreement), that schedule answers if it fits: every budget from the least it states up
    is planned.

    Anytime within ``options.time_limit_s`` (seconds of this process's CPU time): on a graph
    with at least twice FIRST_STAGES region boundaries it solves coarse to fine
    (:func:`stage_levels`), each level a whole programme over finer cuts, and keeps the best
    schedule found (the note names the space that schedule was solved over, and what the time
    limit cut short). A finer level's space need not contain a coarser one's: on the tiny
    GPT-2's graph, 44 stages spanning 4 each reach regions of about 10 boundaries, which all 111
    boundaries spanning 8 reach only between coarse cuts. On a graph coarsened even at its
    finest level (more boundaries than ``max_bounds``), refining stops once a level gains less
    than REFINE_GAIN of the step time.
    A refinement predicted not to finish in the time left (the last level's work per stage
    times its stages, counted: ``WORK``, not timed) is not started. A programme cut short
    answers nothing: with no level done, dp answers with ``greedy``'s schedule (else
    ``revolve``'s, else the least-memory one); the note says so. Each level's programme is run
    up to the eager peak and kept (:func:`solved_once`): a later solve of the same graph at
    another budget reads it.
    """
    # dp's time limit is this process's CPU time, as every solver's (SolverOptions.deadline):
    # other jobs on the machine stretch its wall time, not its work, and must not cut a level
    # short that a quiet machine finishes (and so change the plan).
    deadline = options.deadline()
    start = deadline - options.time_limit_s
    eager = simulate(graph, Schedule()).peak_bytes
    if eager <= budget_bytes:  # nothing to recompute (and no rounding to lose it to)
        return finish(graph, budget_bytes, [], "dp", "the eager step fits", gap=0.0)
    limit = time_limit_text(options)
    levels = dp_levels(graph, options)
    staged = is_staged(graph, options)
    best: tuple[float, tuple[Region, ...], str, float | None] | None = None
    stopped = ""
    search_s = 0.8 * options.time_limit_s  # the search's share, the fallback the rest
    search_end = start + search_s
    done: tuple[int, float] | None = None  # the last level solved: its size and nominal s
    work0_s = WORK.nominal_s()
    for level, level_options, stages in levels:
        level_work_s = WORK.nominal_s()
        if done is not None and best is not None:
            # A level's work grows about linearly with its stages (LEVEL_GROWTH): a
            # refinement that cannot finish in the time left is not started, only to be cut
            # short. A level that may give dp's first answer is
            # always tried (the prediction is conservative: Mamba-128's 192 stages take 2.6
            # times its 48, not 3.8). Time here is nominal (STATE_NOMINAL_S): counted work.
            predicted_s = done[1] * stages / done[0]
            spent_s = level_work_s - work0_s
            left_s = search_s - spent_s
            of = f"the {limit}"
            share_s = STAGED_REFINE_SHARE * options.time_limit_s
            if staged and share_s < search_s:
                left_s, of = (
                    share_s - spent_s,
                    f"the share of the {limit} a staged graph refines in",
                )
            if predicted_s > left_s:
                stopped = (
                    f"; refining to {level} not started (about {predicted_s:.0f} s "
                    f"predicted, {max(left_s, 0.0):.0f} s left of {of})"
                )
                break
        try:
            regions, note, gap = _solve_within(
                graph, budget_bytes, level_options, search_end, eager
            )
        except OutOfTime:
            stopped = f"; refining to {level} cut short at the {limit}"
            break
        except _NoFit:
            done = (stages, WORK.nominal_s() - level_work_s)
            continue
        done = (stages, WORK.nominal_s() - level_work_s)
        step_s = simulate(graph, Schedule(tuple(regions))).step_time_s
        if best is not None and staged and step_s >= best[0] * (1 - REFINE_GAIN):
            if step_s < best[0]:
                best = (step_s, tuple(regions), note, gap)
            stopped = f"; refining stopped at {level} (less than {REFINE_GAIN:.1%} gained)"
            break
        if best is None or step_s < best[0]:
            best = (step_s, tuple(regions), note, gap)
    if best is not None:
        _, regions, note, gap = best
        return finish(graph, budget_bytes, regions, "dp", note + stopped, gap=gap)
    # Nothing of the space searched fits the budget on its grid, or the time limit cut the
    # search short before it found something. When cut short, greedy (cheap, anytime), else
    # revolve, whose deep nesting reaches the least memory of the fixed policies.
    fallback = None
    fallbacks = ((solve_greedy, GreedyOptions), (solve_revolve, RevolveOptions))
    if graph.region_spans is not None or not stopped:
        fallbacks = ()  # neither keeps to module spans
    for solve, opts in fallbacks:
        left_s = max(0.0, deadline - time.process_time())
        try:
            fallback = solve(graph, budget_bytes, opts(time_limit_s=left_s))
            break
        except InfeasibleBudgetError:
            continue
    if fallback is not None:
        # what stopped dp: a level cut short, or one predicted not to finish in the time left
        note = f"dp {stopped.removeprefix('; ')}; {fallback.solver} answered ({fallback.note})"
        return Schedule(fallback.regions, fallback.solver, None, note)
    # The least-memory schedule: the same whatever the budget, the objective or the time
    # limit, so the least it states is planned at that budget and every one above it.
    least = least_memory(graph, options)
    if least.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, least.peak_bytes, "(solver 'dp')")
    # Not proven the least time within the budget: it is picked on objective-free times.
    note = f"least-memory schedule (searched over {least.space}){stopped}"
    return finish(graph, budget_bytes, least.schedule.regions, "dp", note)
