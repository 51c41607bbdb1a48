"""A dp state's value ``V[m]`` (the least time within ``m`` memory units) kept as its
breakpoints: a non-increasing step function, infinite below its first point.

A table over every unit costs the same whatever it holds: on GPT-ref in place, dp's states held
~280 distinct values on a 131,072-unit grid, so the dense tables took 8 GB and most of the
solve's time. Each :class:`Frontier` operation costs the number of points instead, so the grid
can be fine (or every byte) at the cost of a coarse one.

Each point also carries the index of the option that reaches its value (``labels``), as the
dense table's per-unit choice did; points are merged exactly as the dense table compared unit by
unit (an option replaces the best where it is strictly better), so both give the same values and
the same choices.

Most of dp's functions are tiny (on a tiny Llama's graph, two thirds of its merges joined
one-point functions and nine in ten had six points or fewer), where numpy's cost per call was
most of the solve; on GPT-ref's and a 7B Llama's graphs, where functions are longer, walking
every merge in Python made dp 1.5 to 3 times slower. So merges of up to SMALL_POINTS points in
all walk Python lists, larger ones numpy arrays, with the same result.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

INF = math.inf
# The most points a merge (add, improve) walks in Python (module docstring). dp on a tiny
# Llama's graph form, this process's CPU time: 13.9-14.9 s with numpy alone, 9.7-12.2 s with
# 16 (32: 9.8-11.9; 64 lost it again); GPT-ref's and a 7B Llama's solves unchanged.
SMALL_POINTS = 16


@dataclass(frozen=True, eq=False)
class Frontier:
    """``V[m] = ys[k]`` for ``xs[k] <= m < xs[k + 1]`` (``xs`` strictly increasing, from 0),
    INF below ``xs[0]``; ``labels[k]``: the option that gives ``ys[k]``."""

    xs: np.ndarray
    ys: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.xs)

    @property
    def top(self) -> float:
        """The value at the largest budget (INF only when nothing fits anywhere)."""
        return float(self.ys[-1]) if len(self.xs) else INF

    @property
    def first(self) -> int | None:
        """The least ``m`` with a finite value, or None."""
        return int(self.xs[0]) if len(self.xs) else None

    def _index(self, m: int) -> int:
        return int(self.xs.searchsorted(m, side="right")) - 1

    def at(self, m: int) -> float:
        k = self._index(m)
        return INF if k < 0 else float(self.ys[k])

    def label_at(self, m: int) -> int:
        k = self._index(m)
        if k < 0:
            raise IndexError(f"no option reaches {m} units")
        return int(self.labels[k])

    def shifted(self, k: int, size: int) -> Frontier:
        """``W[m] = V[m - k]`` for m in [0, size): right by ``k`` units (left when negative,
        the values past the top staying the top's)."""
        if not len(self.xs) or k == 0:
            return self
        xs = self.xs + k
        if k > 0:
            n = int(xs.searchsorted(size))
            return Frontier(xs[:n], self.ys[:n], self.labels[:n])
        return Frontier(xs, self.ys, self.labels).from_(0)

    def from_(self, lo: int) -> Frontier:
        """INF below ``lo`` units, unchanged from it."""
        k = self._index(lo)
        if k < 0 or (k == 0 and self.xs[0] == lo):
            return self
        xs = self.xs[k:].copy()
        xs[0] = lo
        return Frontier(xs, self.ys[k:], self.labels[k:])

    def plus(self, seconds: float) -> Frontier:
        return Frontier(self.xs, self.ys + seconds, self.labels)

    def add(self, other: Frontier) -> Frontier:
        """``V[m] + W[m]`` (labels dropped: a sum is an option's value, labelled when merged)."""
        if not len(self.xs) or not len(other.xs):
            return EMPTY
        if len(self.xs) + len(other.xs) <= SMALL_POINTS:
            return _small_sum(self, other)
        xs = _merged(self.xs, other.xs)
        xs = xs[xs.searchsorted(max(self.xs[0], other.xs[0])) :]
        ys = self.ys[self.xs.searchsorted(xs, side="right") - 1]
        ys += other.ys[other.xs.searchsorted(xs, side="right") - 1]
        keep = np.empty(len(xs), bool)
        keep[0] = True  # equal points (a breakpoint of both) are dropped as no change
        np.less(ys[1:], ys[:-1], out=keep[1:])
        return Frontier(xs[keep], ys[keep], np.zeros(int(keep.sum()), np.int32))


def constant(start: int, seconds: float, label: int = 0) -> Frontier:
    """``seconds`` from ``start`` units up."""
    return Frontier(np.array([start], np.int64), np.array([seconds]), np.array([label], np.int32))


EMPTY = Frontier(np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int32))


def improve(best: Frontier, option: Frontier, label: int) -> tuple[Frontier, bool]:
    """(``best`` with ``option``'s value, labelled ``label``, wherever it is strictly lower;
    whether it is anywhere)."""
    if not len(option.xs):
        return best, False
    if not len(best.xs):
        return Frontier(option.xs, option.ys, np.full(len(option.xs), label, np.int32)), True
    if len(best.xs) + len(option.xs) <= SMALL_POINTS:
        return _small_improve(best, option, label)
    # The option is better somewhere on one of its steps exactly when it is at the step's
    # start, where best (non-increasing) is highest: most options are nowhere better, and this
    # says so without merging.
    k = best.xs.searchsorted(option.xs, side="right") - 1
    if (k >= 0).all() and not (option.ys < best.ys[k]).any():
        return best, False
    xs = _merged(best.xs, option.xs)
    bi = best.xs.searchsorted(xs, side="right") - 1
    oi = option.xs.searchsorted(xs, side="right") - 1
    b_ys, o_ys = best.ys[bi], option.ys[oi]
    b_ys[bi < 0] = INF
    o_ys[oi < 0] = INF
    better = o_ys < b_ys  # somewhere, by the check above
    ys = np.where(better, o_ys, b_ys)
    labels = np.where(better, np.int32(label), best.labels[bi]).astype(np.int32)
    keep = ys < INF  # and a point only where the value or the option changes (not at repeats)
    keep[1:] &= (ys[1:] != ys[:-1]) | (labels[1:] != labels[:-1])
    return Frontier(xs[keep], ys[keep], labels[keep]), True


def _frontier(xs: list[int], ys: list[float], labels: list[int]) -> Frontier:
    return Frontier(np.array(xs, np.int64), np.array(ys), np.array(labels, np.int32))


def _small_sum(a: Frontier, b: Frontier) -> Frontier:
    """:meth:`Frontier.add` walked in Python (SMALL_POINTS)."""
    ax, ay, bx, by = a.xs.tolist(), a.ys.tolist(), b.xs.tolist(), b.ys.tolist()
    x = max(ax[0], bx[0])
    i, j = bisect_right(ax, x), bisect_right(bx, x)  # the points of each at or before x
    xs, ys = [x], [ay[i - 1] + by[j - 1]]
    while i < len(ax) or j < len(bx):
        x = min(ax[i] if i < len(ax) else INF, bx[j] if j < len(bx) else INF)
        i += i < len(ax) and ax[i] == x
        j += j < len(bx) and bx[j] == x
        y = ay[i - 1] + by[j - 1]
        if y < ys[-1]:  # a breakpoint of either that leaves the sum unchanged is none
            xs.append(x)
            ys.append(y)
    return _frontier(xs, ys, [0] * len(xs))


def _small_improve(best: Frontier, option: Frontier, label: int) -> tuple[Frontier, bool]:
    """:func:`improve` of two non-empty functions walked in Python (SMALL_POINTS)."""
    bx, by, bl = best.xs.tolist(), best.ys.tolist(), best.labels.tolist()
    ox, oy = option.xs.tolist(), option.ys.tolist()
    for x, y in zip(ox, oy):  # as improve's check: better at the start of one of its steps
        k = bisect_right(bx, x) - 1
        if k < 0 or y < by[k]:
            break
    else:
        return best, False
    xs: list[int] = []
    ys: list[float] = []
    labels: list[int] = []
    last: tuple[float, int] = (INF, -1)
    i = j = 0  # the points of best and of the option at or before x
    while i < len(bx) or j < len(ox):
        x = min(bx[i] if i < len(bx) else INF, ox[j] if j < len(ox) else INF)
        i += i < len(bx) and bx[i] == x
        j += j < len(ox) and ox[j] == x
        best_y = by[i - 1] if i else INF
        option_y = oy[j - 1] if j else INF
        point = (option_y, label) if option_y < best_y else (best_y, bl[i - 1] if i else -1)
        if point[0] < INF and point != last:  # where the value or the option changes
            xs.append(x)
            ys.append(point[0])
            labels.append(point[1])
        last = point
    return _frontier(xs, ys, labels), True


def _merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Both breakpoint lists in order, repeats kept (cheaper than a union; the callers drop
    the points that change nothing)."""
    xs = np.concatenate((a, b))
    xs.sort()
    return xs


def dense(v: Frontier, size: int) -> np.ndarray:
    """``V[m]`` for m in [0, size) as an array."""
    out = np.full(size, INF)
    for k in range(len(v.xs)):
        if v.xs[k] < size:
            out[v.xs[k] :] = v.ys[k]
    return out
