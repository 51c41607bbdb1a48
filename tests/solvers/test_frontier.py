"""dp's value functions as breakpoints (``solvers/frontier.py``) against the dense tables they
replace: every operation gives the same value at every budget, and ``improve`` the same choice
a unit-by-unit comparison makes; merges walked in Python (small ones) and by numpy alike."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers import frontier
from planner.solvers.frontier import EMPTY, Frontier, constant, dense, improve

SIZE = 24
SMALL_POINTS = frontier.SMALL_POINTS
INF = np.inf


@st.composite
def frontiers(draw: st.DrawFn) -> Frontier:
    """A non-increasing step function over [0, SIZE), some steps repeating a value (labels
    differ there), or none at all."""
    xs = sorted(draw(st.sets(st.integers(0, SIZE - 1), max_size=6)))
    drops = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5]), min_size=len(xs), max_size=6))
    ys = 10.0 - np.cumsum(drops[: len(xs)])
    labels = draw(st.lists(st.integers(0, 3), min_size=len(xs), max_size=6))[: len(xs)]
    return Frontier(np.array(xs, np.int64), np.array(ys), np.array(labels, np.int32))


def dense_labels(v: Frontier) -> list[int | None]:
    return [None if v.at(m) == INF else v.label_at(m) for m in range(SIZE)]


@contextlib.contextmanager
def merging(small_points: int):
    """frontier.SMALL_POINTS set: 0 merges every function with numpy, 12 (two functions of at
    most six points) every one in Python."""
    frontier.SMALL_POINTS = small_points
    try:
        yield
    finally:
        frontier.SMALL_POINTS = SMALL_POINTS


WALKS = pytest.mark.parametrize("small_points", [0, 12])


@WALKS
@settings(max_examples=300, deadline=None, derandomize=True)
@given(frontiers(), frontiers(), st.integers(-SIZE - 2, SIZE + 2), st.integers(-2, SIZE + 2))
def test_each_operation_gives_the_dense_tables_values(
    small_points: int, v: Frontier, w: Frontier, shift: int, lo: int
) -> None:
    with merging(small_points):
        check_operations(v, w, shift, lo)


def check_operations(v: Frontier, w: Frontier, shift: int, lo: int) -> None:
    dv, dw = dense(v, SIZE), dense(w, SIZE)
    for m in range(SIZE):
        assert v.at(m) == dv[m]
    # shifted: W[m] = V[m - k], INF below the start, the top's value past the top
    want = np.array([INF if m - shift < 0 else dv[min(m - shift, SIZE - 1)] for m in range(SIZE)])
    assert np.array_equal(dense(v.shifted(shift, SIZE), SIZE), want)
    want = np.where(np.arange(SIZE) < lo, INF, dv)
    assert np.array_equal(dense(v.from_(lo), SIZE), want)
    assert np.array_equal(dense(v.add(w), SIZE), dv + dw)
    assert np.array_equal(dense(v.plus(1.5), SIZE), dv + 1.5)
    assert v.top == (dv[-1] if len(v) else INF)


@WALKS
@settings(max_examples=300, deadline=None, derandomize=True)
@given(frontiers(), frontiers())
def test_improve_takes_an_option_exactly_where_it_is_strictly_better(
    small_points: int, best: Frontier, option: Frontier
) -> None:
    with merging(small_points):
        got, better = improve(best, option, 9)
    db, do = dense(best, SIZE), dense(option, SIZE)
    assert np.array_equal(dense(got, SIZE), np.minimum(db, do))
    assert better == bool((do < db).any())
    before = dense_labels(best)
    for m, label in enumerate(dense_labels(got)):
        assert label == (9 if do[m] < db[m] else before[m])


def test_an_empty_function_is_infinite_everywhere_and_improved_by_any_option() -> None:
    assert EMPTY.top == INF and EMPTY.first is None
    got, better = improve(EMPTY, constant(3, 2.0), 4)
    assert better and got.first == 3 and got.at(2) == INF and got.label_at(SIZE) == 4
