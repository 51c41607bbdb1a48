"""planner.clear_caches(): every module-level cache in planner, passes and solvers is listed in
planner/caches.py, and clearing empties each one."""

from __future__ import annotations

import functools
import importlib
import pkgutil
import random

import planner
from planner import caches
from planner.passes import cpu_timing, op_timing
from planner.solvers import dp_search as dp
from planner.solvers.costgraph import Schedule
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import random_chain

_SKIP = {"planner.__main__"}


def _module_tables() -> set[tuple[str, str]]:
    """(module, name) of every functools cache defined in a module of planner, and of every
    private module-level dict named as a constant (``_TIMES``): where a process keeps what it
    measured or solved. (Public upper-case tables are the modules' constants.)"""
    found = set()
    names = [m.name for m in pkgutil.walk_packages(planner.__path__, "planner.")]
    for name in names:
        if name in _SKIP or ".integrations" in name:
            continue  # optional frameworks' hooks
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr.startswith("__"):
                continue
            cached = isinstance(value, functools._lru_cache_wrapper)
            if cached and value.__module__ != name:
                continue  # imported from where it is defined
            table = isinstance(value, dict) and attr.startswith("_") and attr[1:].isupper()
            if cached or table:
                found.add((name, attr))
    return found


def test_every_module_cache_is_listed_as_cleared_or_kept():
    listed = {(c.module, c.attribute) for c in (*caches.CLEARED, *caches.KEPT)}
    unlisted = _module_tables() - listed
    assert not unlisted, f"add these to planner/caches.py (CLEARED or KEPT): {sorted(unlisted)}"
    for cache in (*caches.CLEARED, *caches.KEPT):
        cache.target()  # each listed name exists


def test_clear_caches_empties_every_cache():
    cpu_timing._clock_cost_s()
    op_timing._TIMES[("cpu", ("x",))] = 1.0
    graph = random_chain(random.Random(0), 30)
    dp.solve_dp(graph, 0.8 * simulate(graph, Schedule()).peak_bytes)
    assert dp._SOLVED_CACHE and op_timing._TIMES
    planner.clear_caches()
    for cache in caches.CLEARED:
        target = cache.target()
        size = target.cache_info().currsize if hasattr(target, "cache_info") else len(target)
        assert size == 0, cache
