"""Where a graph can be cut into checkpoint regions, and what crosses each cut.

A cut ``c`` (1 <= c < n) lies between node ``c - 1`` and node ``c``. The bytes crossing it are
the storages produced before it that a node after it still reads or saves for backward: what a
region starting at ``c`` must keep as inputs, and what a solver's state at ``c`` holds. In a
residual stream only the stream tensor crosses a block boundary, so good cuts are cheap ones.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from planner.solvers.costgraph import CostGraph

_TOKEN = re.compile(r"[A-Za-z_]\w*|\d+")


@dataclass(frozen=True)
class Cut:
    """A cut point and the storages that cross it (indices into ``graph.tensors``)."""

    index: int
    crossing_bytes: int
    crossing: tuple[int, ...]


def last_need(graph: CostGraph, t_i: int) -> int:
    """Last node (forward order) that reads or saves storage ``t_i``."""
    t = graph.tensors[t_i]
    return max((t.producer, *t.users, *t.saved_by))


def forbidden_cuts(graph: CostGraph) -> frozenset[int]:
    """Cuts no region may begin or end at: c with ``t.producer < c <= w`` for a storage ``t``
    that node ``w`` writes in place.

    A region starting there would read ``t`` from outside and recompute, in backward, from the
    value the write left (``passes/rewrite.py`` refuses it); a region ending there is harmless,
    but forbidding the cut as a whole keeps one rule for every solver.
    """
    out: set[int] = set()
    for t in graph.tensors:
        if t.written_by:
            out.update(range(t.producer + 1, max(t.written_by) + 1))
    return frozenset(out)


def allowed_cuts(graph: CostGraph) -> list[bool]:
    """``allowed_cuts(graph)[c]`` for c in 0..n: may a region boundary lie at cut c."""
    forbidden = forbidden_cuts(graph)
    return [c not in forbidden for c in range(len(graph.nodes) + 1)]


def region_bounds(graph: CostGraph) -> list[int]:
    """The distinct cuts a region boundary may use, 0 and n included.

    Cuts on either side of a node that allocates nothing (a view, an in-place op) hold the same
    storages, so each run of such equivalent cuts is represented once: by its first allowed cut
    (normally the one right after the allocating node).
    """
    n = len(graph.nodes)
    allocates = [False] * n
    for t in graph.tensors:
        allocates[t.producer] |= not t.held_to_end  # held storages are alive on both sides
    ok = allowed_cuts(graph)
    bounds: list[int] = []
    taken = False
    for c in range(n + 1):
        if c in (0, n) or allocates[c - 1]:
            taken = False  # a new run of equivalent cuts starts here
        if ok[c] and not taken:
            bounds.append(c)
            taken = True
    return bounds


def cut_points(graph: CostGraph) -> list[Cut]:
    """Every cut 1..n-1 with the storages crossing it, in O(n + tensors + crossings)."""
    n = len(graph.nodes)
    starts: list[list[int]] = [[] for _ in range(n + 1)]
    for t_i, t in enumerate(graph.tensors):
        end = last_need(graph, t_i)
        if end > t.producer:
            starts[t.producer + 1].append(t_i)
    cuts: list[Cut] = []
    live: dict[int, int] = {}  # tensor -> last node needing it
    for c in range(1, n):
        for t_i in starts[c]:
            live[t_i] = last_need(graph, t_i)
        for t_i in [t_i for t_i, end in live.items() if end < c]:
            del live[t_i]
        crossing = tuple(sorted(live))
        size = sum(graph.tensors[t_i].size_bytes for t_i in crossing)
        cuts.append(Cut(c, size, crossing))
    return cuts


def crossing_bytes(graph: CostGraph) -> list[int]:
    """``crossing_bytes(graph)[c]`` for c in 0..n (0 at both ends), via a difference array."""
    n = len(graph.nodes)
    diff = [0] * (n + 2)
    for t_i, t in enumerate(graph.tensors):
        end = last_need(graph, t_i)
        if end > t.producer:
            diff[t.producer + 1] += t.size_bytes
            diff[end + 1] -= t.size_bytes
    out, running = [0] * (n + 1), 0
    for c in range(n + 1):
        running += diff[c]
        out[c] = running
    out[0] = out[n] = 0
    return out


def block_key(module_path: str) -> tuple[str, int] | None:
    """('blocks', 3) for 'blocks.3.attn.qkv' or "blocks[3].attn"; None outside any list."""
    tokens = _TOKEN.findall(module_path)
    for k, tok in enumerate(tokens):
        if tok.isdigit():
            return ".".join(tokens[:k]), int(tok)
    return None


def block_spans(graph: CostGraph) -> list[tuple[int, int]]:
    """[start, stop) node spans of repeated blocks (``blocks.0``, ``blocks.1``, ...), in order.

    The container with the most distinct indices wins; empty when no module repeats. Adjacent
    spans are moved to the cheapest cut between one block's last node and the next's first.
    """
    groups: dict[str, dict[int, list[int]]] = {}
    for i, node in enumerate(graph.nodes):
        key = block_key(node.module_path)
        if key is not None:
            groups.setdefault(key[0], {}).setdefault(key[1], []).append(i)
    if not groups:
        return []
    prefix = max(groups, key=lambda p: len(groups[p]))
    blocks = groups[prefix]
    if len(blocks) < 2:
        return []
    spans = [(min(idx), max(idx) + 1) for _, idx in sorted(blocks.items())]
    spans.sort()
    crossing = crossing_bytes(graph)
    ok = allowed_cuts(graph)
    n = len(graph.nodes)
    # The outer ends move outwards to an allowed cut (0 and n always are).
    first = max(c for c in range(spans[0][0] + 1) if ok[c])
    bounds = [first]
    for (_, stop), (nxt, _) in zip(spans, spans[1:]):
        lo, hi = min(stop, nxt), max(stop, nxt)
        lo = max(lo, bounds[-1] + 1)
        hi = max(hi, lo)
        allowed = [c for c in range(lo, min(hi, n - 1) + 1) if ok[c]]
        if allowed:  # else the two blocks merge into one span (an in-place write joins them)
            bounds.append(min(allowed, key=lambda c: (crossing[c], abs(c - stop))))
    last = max(spans[-1][1], bounds[-1] + 1)
    bounds.append(min(c for c in range(last, n + 1) if ok[c]))
    return list(zip(bounds, bounds[1:]))


def even_cuts(graph: CostGraph, n_segments: int, lo: int = 0, hi: int | None = None) -> list[int]:
    """Boundaries lo = b0 < b1 < ... < bk = hi splitting [lo, hi) into ~n_segments pieces.

    Each inner boundary is the cheapest cut (fewest crossing bytes) within half a segment of
    the evenly spaced position, so segments follow the model's natural seams. Cuts forbidden by
    in-place writes are never used (there may then be fewer pieces).
    """
    hi = len(graph.nodes) if hi is None else hi
    n_segments = max(1, min(n_segments, hi - lo))
    crossing = crossing_bytes(graph)
    ok = allowed_cuts(graph)
    width = (hi - lo) / n_segments
    bounds = [lo]
    for j in range(1, n_segments):
        target = lo + j * width
        a = max(bounds[-1] + 1, math.ceil(target - width / 2))
        b = min(hi - (n_segments - j), math.floor(target + width / 2))
        if a > b:
            a = b = max(bounds[-1] + 1, min(round(target), hi - (n_segments - j)))
        window = [c for c in range(a, min(b, hi - 1) + 1) if ok[c]]
        if not window:  # in-place writes forbid the window: the nearest allowed cut instead
            rest = [c for c in range(bounds[-1] + 1, hi) if ok[c]]
            if not rest:
                break
            window = [min(rest, key=lambda c: abs(c - target))]
        bounds.append(min(window, key=lambda c: (crossing[c], abs(c - target))))
    bounds.append(hi)
    return bounds
