"""Solvers by name, each with its options as one frozen dataclass.

A solver is ``solve(graph, budget_bytes, options) -> Schedule``; ``register(name, options=...)``
records it with its options class. The registered function also takes its options as keyword
arguments (``solve_dp(graph, budget, max_span=4)``): they are checked against the options class,
and an unknown one is a ValueError naming the valid ones, never silently ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from planner.solvers.costgraph import (
    CostGraph,
    Objective,
    Schedule,
    check_objective,
    graph_for_objective,
    weighted_graph,
)
from planner.solvers.errors import RecomputeCapError
from planner.solvers.simulate import simulate

# Every solver returns within this many seconds unless told otherwise (the whole of plan()'s
# solve step: ``auto`` shares it among the solvers it runs).
DEFAULT_TIME_LIMIT_S = 60.0


@dataclass(frozen=True)
class SolverOptions:
    """What every solver takes. ``time_limit_s``: the solver returns within about this much
    CPU time of this process (the exact ones stop searching and answer with the best schedule
    found so far).

    Every solver time limit is counted on one clock, ``time.process_time()``, as
    :class:`SharedTimeLimit` charges it: other jobs on the machine stretch a solve's wall time,
    not its work, and must not cut it short where a quiet machine would not (and so change the
    plan). The MILP backends ``ilp`` hands what is left to count it as near that as they can:
    CBC (a subprocess) its own CPU time, HiGHS (in this process) its wall clock, the one it
    has (:func:`planner.solvers.ilp.solve_highs`)."""

    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    # Whether the solver searches for as long as its limit lets it (dp, ilp, auto): a limit
    # shared among solves goes to these (``SharedTimeLimit``); the others answer in
    # milliseconds whatever their limit.
    searches: ClassVar[bool] = False

    def deadline(self) -> float:
        """The ``time.process_time()`` value by which the solver must have answered: every
        solver's clock (see the class)."""
        return time.process_time() + self.time_limit_s


class SharedTimeLimit:
    """One time limit shared by several solves (the capped objective's, ``compare``'s,
    ``fit_batch``'s), instead of each taking the whole limit: each solve gets an equal share
    of the time left, so time a solve did not use goes to the ones after it; where searching
    solvers share it with quick ones (``compare``), a search's share counts only the searches
    left (``SolverOptions.searches``). Only the solves
    (run inside :meth:`solving`) spend it, not the pricing or measuring between them, and
    they spend the CPU time this process gave them, not the wall clock's: other jobs on the
    machine stretch a solve's wall time, not its work, and must not leave the solves after it
    shorter shares (and so other plans) than a quiet machine would."""

    def __init__(self, time_limit_s: float) -> None:
        self.left_s = time_limit_s

    @classmethod
    def starting_now(cls, time_limit_s: float) -> SharedTimeLimit:
        return cls(time_limit_s)

    def share_s(self, solves_left: int) -> float:
        """The next solve's limit when ``solves_left`` solves (it included) remain; at least
        MIN_SHARE_S, so a solve past the limit still answers (with its quickest schedule)."""
        return max(MIN_SHARE_S, self.left_s / max(solves_left, 1))

    @contextlib.contextmanager
    def solving(self) -> Iterator[None]:
        """Charge the CPU time spent inside to the limit."""
        start = time.process_time()
        try:
            yield
        finally:
            self.left_s -= time.process_time() - start


# The least a shared limit gives one solve.
MIN_SHARE_S = 0.05


def default_time_limit_s(solver: str, opts: Mapping[str, Any]) -> float:
    """The time limit ``solver`` takes with ``opts``: theirs, else the solver's default."""
    if "time_limit_s" in opts:
        return float(opts["time_limit_s"])
    return float(get_solver(solver).options().time_limit_s)


def time_limit_text(options: SolverOptions) -> str:
    """How every solver's note names its time limit (``auto`` looks for it)."""
    return f"time limit ({options.time_limit_s:g} s)"


class SolverFn(Protocol):
    options: type[SolverOptions]

    def __call__(
        self,
        graph: CostGraph,
        budget_bytes: float,
        options: SolverOptions | None = None,
        **opts: Any,
    ) -> Schedule: ...


SOLVERS: dict[str, SolverFn] = {}

# Modules whose import registers solvers; loaded on first lookup so that importing a solver
# module directly never recurses through this one.
_MODULES = (
    "planner.solvers.basic",
    "planner.solvers.greedy",
    "planner.solvers.revolve",
    "planner.solvers.selective",
    "planner.solvers.sac",
    "planner.solvers.dp_search",
    "planner.solvers.ilp",
    "planner.solvers.auto",
)


def make_options(cls: type[SolverOptions], opts: Mapping[str, Any], solver: str = "") -> Any:
    """``cls(**opts)``, with an unknown keyword a ValueError naming the valid ones. A field
    whose default is itself an options dataclass (``auto``'s per-solver options) also takes a
    mapping of that class's keywords."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(opts) - set(fields))
    if unknown:
        who = f"solver {solver!r}" if solver else cls.__name__
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for {who}; "
            f"valid options: {', '.join(fields)}"
        )
    values = {}
    for key, value in opts.items():
        default = fields[key].default
        if isinstance(default, SolverOptions) and isinstance(value, Mapping):
            value = make_options(type(default), value, key)
        values[key] = value
    return cls(**values)


def _shallow(options: SolverOptions) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def register(
    name: str, options: type[SolverOptions] = SolverOptions
) -> Callable[[Callable[[CostGraph, float, Any], Schedule]], SolverFn]:
    """Register ``fn(graph, budget_bytes, options)`` as solver ``name`` with ``options``."""

    cls = options

    def wrap(fn: Callable[[CostGraph, float, Any], Schedule]) -> SolverFn:
        @functools.wraps(fn)
        def solve(
            graph: CostGraph,
            budget_bytes: float,
            options: SolverOptions | None = None,
            **kw: Any,
        ) -> Schedule:
            if options is None:
                options = make_options(cls, kw, name)
            elif not isinstance(options, cls):
                raise TypeError(f"solver {name!r} takes {cls.__name__}, not {type(options)}")
            elif kw:
                options = make_options(cls, {**_shallow(options), **kw}, name)
            return fn(graph, budget_bytes, options)

        solve.options = cls  # type: ignore[attr-defined]
        SOLVERS[name] = solve  # type: ignore[assignment]
        return solve  # type: ignore[return-value]

    return wrap


def _load() -> None:
    for module in _MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # a missing dependency inside it is a real error
                raise


def get_solver(name: str) -> SolverFn:
    """The solver registered as ``name``; ValueError naming the known ones otherwise."""
    _load()
    try:
        return SOLVERS[name]
    except KeyError:
        known = ", ".join(sorted(SOLVERS))
        raise ValueError(f"unknown solver {name!r}; known solvers: {known}") from None


def solve(
    graph: CostGraph,
    budget_bytes: float,
    solver: str = "auto",
    objective: Objective = "time",
    max_recompute_flops_fraction: float | None = None,
    **opts: Any,
) -> Schedule:
    """Solver ``solver``'s schedule for ``graph`` within ``budget_bytes``, minimising
    ``objective`` (``graph_for_objective``); a "flops" schedule's note says so.

    ``max_recompute_flops_fraction``: recompute at most this fraction of the step's FLOPs
    (0.005: 0.5%), the fastest such schedule for ``"time"`` (:func:`_within_flops_cap`);
    RecomputeCapError when none within the budget does."""
    solve_fn = get_solver(solver)
    if max_recompute_flops_fraction is not None:
        check_objective(objective)
        if not 0 <= max_recompute_flops_fraction < float("inf"):
            raise ValueError(
                f"max_recompute_flops_fraction must be a fraction >= 0 of the step's FLOPs "
                f"(0.005 for 0.5%), got {max_recompute_flops_fraction!r}"
            )
        cap_flops = max_recompute_flops_fraction * graph.step_flops
        limit = SharedTimeLimit.starting_now(default_time_limit_s(solver, opts))
        return _within_flops_cap(graph, budget_bytes, solve_fn, objective, cap_flops, opts, limit)
    schedule = solve_fn(graph_for_objective(graph, objective), budget_bytes, **opts)
    if objective == "time":
        return schedule
    return _noted(schedule, "minimised recomputed FLOPs (objective='flops'), ties to the faster")


# The FLOPs weight _within_flops_cap searches, in octaves around the graph's own exchange rate
# (its recomputation seconds per second of its FLOPs at flops_per_s), and the halvings of that
# range it makes, a solve each: to a 2^(20/2^8) = 1.06x step in the weight.
CAP_WEIGHT_OCTAVES = (-8.0, 12.0)
CAP_SEARCH_STEPS = 8


def _within_flops_cap(
    graph: CostGraph,
    budget_bytes: float,
    solve_fn: SolverFn,
    objective: Objective,
    cap_flops: float,
    opts: dict[str, Any],
    limit: SharedTimeLimit,
) -> Schedule:
    """The fastest schedule found that recomputes at most ``cap_flops``, its solves sharing
    ``limit`` (the solver's one time limit, not one each).

    Time and FLOPs are traded by a weight on the FLOPs (``weighted_graph``, a Lagrangian
    relaxation of the cap): weight 0 is the fastest schedule, a large one the fewest FLOPs
    (``objective="flops"``). The weight is bisected (geometrically) between the two for the
    smallest one whose schedule keeps to the cap; of the schedules that do, the fastest
    predicted on ``graph``. Exact for the cost model at the trade-offs the weights reach (the
    convex hull of time against FLOPs), and within the weight's last step between them.
    """

    solves = 0

    def attempt(seen: CostGraph) -> tuple[Schedule, float, int]:
        """``solve_fn``'s schedule for the graph it sees, priced on ``graph``."""
        nonlocal solves
        # at most 2 + CAP_SEARCH_STEPS solves: the share of what is left to each remaining one
        share_s = limit.share_s(2 + CAP_SEARCH_STEPS - solves)
        solves += 1
        with limit.solving():
            schedule = solve_fn(seen, budget_bytes, **{**opts, "time_limit_s": share_s})
        sim = simulate(graph, schedule)
        return schedule, sim.step_time_s, sim.recompute_flops

    least = attempt(graph_for_objective(graph, "flops"))
    step_flops = max(graph.step_flops, 1)
    cap_text = f"{cap_flops / step_flops:.2%} of the step's FLOPs"
    if least[2] > cap_flops:
        raise RecomputeCapError(
            f"no schedule within the budget recomputes at most {cap_text}: the least any "
            f"recomputes is {least[2] / step_flops:.2%} (objective='flops'). Raise "
            f"max_recompute_flops_fraction to at least {least[2] / step_flops:.4g}, or raise "
            f"mem_budget_gb."
        )
    if objective == "flops":
        return _noted(least[0], f"minimised recomputed FLOPs, within {cap_text}")
    best = least
    fastest = attempt(graph)
    if fastest[2] <= cap_flops:
        best = fastest
    else:
        flops_s = sum(n.fwd_flops for n in graph.nodes) / graph.flops_per_s
        rate = sum(graph.node_recompute_time_s(i) for i in range(len(graph.nodes))) / flops_s
        low, high = CAP_WEIGHT_OCTAVES  # high: taken to keep to the cap (least's side)
        for _ in range(CAP_SEARCH_STEPS):
            middle = (low + high) / 2
            found = attempt(weighted_graph(graph, rate * 2.0**middle))
            if found[2] <= cap_flops:
                high = middle
                best = min(best, found, key=lambda f: f[1])
            else:
                low = middle
    return _noted(
        best[0],
        f"minimised predicted time within {cap_text} recomputed ({solves} solves trading "
        f"time against FLOPs, sharing one time limit)",
    )


def _noted(schedule: Schedule, said: str) -> Schedule:
    return dataclasses.replace(schedule, note=f"{schedule.note}; {said}" if schedule.note else said)
