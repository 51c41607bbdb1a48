"""Every solver's time limit is CPU time of this process (``SolverOptions.deadline``), so other
jobs on the machine, which stretch a solve's wall time and not its work, give the same plan and
the same least budget as a quiet machine."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from planner.solvers.costgraph import Schedule
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import get_solver
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import random_chain

# auto, greedy, revolve and dp in about 0.7 s of CPU each (too long for auto to run ilp too)
LONG = random_chain(random.Random(7), 80)
CHAIN = random_chain(random.Random(7), 24)  # ilp's MILP in well under a second

# (solver, options, graph): every solver that takes a time limit, both MILP backends
SOLVERS = [
    ("auto", {}, LONG),
    ("greedy", {}, LONG),
    ("revolve", {}, LONG),
    ("dp", {}, LONG),
    ("ilp", {"backend": "highs"}, CHAIN),
    ("ilp", {"backend": "cbc"}, CHAIN),
]


def _answer(name: str, opts: dict, graph, frac: float, time_limit_s: float):
    """The solver's regions and note at ``frac`` of the eager peak, or the least it states."""
    budget = frac * simulate(graph, Schedule()).peak_bytes
    try:
        s = get_solver(name)(graph, budget, time_limit_s=time_limit_s, **opts)
    except InfeasibleBudgetError as e:
        return ("least", e.min_bytes)
    assert simulate(graph, s).peak_bytes <= budget
    return (s.regions, s.solver, _cut_short(s.note))


def _cut_short(note: str) -> bool:
    """Whether the note says a time limit cut something short."""
    return any(said in note for said in ("time limit", "stopped at", "cut short"))


def _stretched_wall_clock(monkeypatch) -> None:
    """Every wall clock read 1,000 s later than the last: a machine so loaded that the process
    waits between any two of its steps; its CPU time (``time.process_time``) is untouched."""
    now = [time.perf_counter()]

    def later() -> float:
        now[0] += 1000.0
        return now[0]

    for clock in ("perf_counter", "monotonic", "time"):
        monkeypatch.setattr(time, clock, later)


@pytest.mark.parametrize(("name", "opts", "graph"), SOLVERS, ids=lambda v: str(v)[:12])
def test_a_stretched_wall_clock_changes_no_plan_and_no_least(monkeypatch, name, opts, graph):
    """With the wall clock running 1,000 s per read and a 60 s limit, each solver answers as
    on a quiet machine: the same regions, the same note (nothing said cut short), the same
    least budget below the least feasible; a wall-clock deadline would stop at once."""
    quiet = [_answer(name, opts, graph, frac, 60.0) for frac in (0.7, 0.01)]
    assert quiet[1][0] == "least" and quiet[1][1] is not None, quiet[1]
    _stretched_wall_clock(monkeypatch)
    loaded = [_answer(name, opts, graph, frac, 60.0) for frac in (0.7, 0.01)]
    monkeypatch.undo()
    assert loaded == quiet
    assert quiet[0][2] is False


def _busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on the CPU: other jobs loading the machine while it solves."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_auto_under_a_busy_loop_gives_the_quiet_plan_and_least():
    """auto (greedy, dp and the others sharing one limit) with a limit ten times the CPU
    time it takes on this graph: under a busy loop on the other core (and whatever else the
    machine runs) the same plan, and below the least feasible the same least budget. CPU time
    itself stretches some under load (caches and cores shared): with three times, CI once
    stated a least of 437 B against the quiet 281 B."""
    start = time.process_time()
    quiet = [_answer("auto", {}, LONG, frac, 60.0) for frac in (0.7, 0.01)]
    limit_s = 10 * (time.process_time() - start) / 2
    assert quiet[1][0] == "least" and quiet[1][1] is not None, quiet[1]
    busy = _busy_loops(1)
    try:
        loaded = [_answer("auto", {}, LONG, frac, limit_s) for frac in (0.7, 0.01)]
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert loaded[0][:2] == quiet[0][:2]
    assert loaded[1] == quiet[1]


def test_cbc_counts_what_is_left_of_the_limit_in_its_own_cpu_time(monkeypatch):
    """CBC runs as a subprocess, whose CPU time this process's clock does not see: ilp hands
    it the CPU time left of its limit and has it count that in its own CPU time (pulp's
    ``timeMode="cpu"``; its default is the wall clock), as cbc's command line says."""
    import pulp

    made: list = []
    cbc = pulp.PULP_CBC_CMD

    def spy(*args, **kwargs):
        made.append(cbc(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(pulp, "PULP_CBC_CMD", spy)
    budget = 0.7 * simulate(CHAIN, Schedule()).peak_bytes
    start = time.process_time()
    get_solver("ilp")(CHAIN, budget, backend="cbc", time_limit_s=30.0)
    spent_s = time.process_time() - start
    (solver,) = made
    assert "timeMode cpu" in solver.getOptions()
    assert 30.0 - spent_s <= solver.timeLimit <= 30.0
