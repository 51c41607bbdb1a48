"""The model's repeated blocks in an in-place plan, and the groups of them it can carry out.

In place (``CostGraph.region_spans`` set) a region must be one module call, a run of an
``nn.Sequential``'s children or a span of a module's own forward. The classic strategies count
in blocks: the repeated module calls of the model's own containers (a ModuleList's layers, a
Sequential's children), found from the nodes' module paths (``layers.3.mlp`` belongs to block
``layers.3``). A container counts when at least two of its children run the same ops (a
decoder's layers, a ResNet's blocks, a U-Net's down and up levels), so a Sequential of a conv,
a norm and an activation is not a stack of blocks. The blocks of every such outermost container
are taken, in execution order: a U-Net's encoder, upsampling and decoder levels alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.solvers.costgraph import CostGraph, Region
from planner.solvers.cuts import block_key
from planner.solvers.errors import UnsupportedModelError

# The solvers that need no blocks in place: they search the spans themselves.
BLOCKLESS_SOLVERS = ("auto", "dp", "ilp", "none")


@dataclass(frozen=True)
class Block:
    """One repeated module call: ``path`` (``layers.3``) over nodes [start, stop)."""

    path: str
    start: int
    stop: int


def module_blocks(graph: CostGraph) -> list[Block]:
    """The repeated blocks of an in-place graph whose calls are regions it can carry, in
    execution order (empty when the model has none)."""
    spans = graph.region_spans or frozenset()
    members: dict[str, dict[int, list[int]]] = {}
    for i, node in enumerate(graph.nodes):
        key = block_key(node.module_path)
        if key is not None:
            members.setdefault(key[0], {}).setdefault(key[1], []).append(i)
    blocks: list[Block] = []
    for prefix, by_index in members.items():
        calls = {k: (min(idx), max(idx) + 1) for k, idx in by_index.items()}
        ops = [tuple(graph.nodes[i].op for i in range(a, b)) for a, b in calls.values()]
        if len(set(ops)) == len(ops):  # no two children alike: not a stack of blocks
            continue
        blocks += [
            Block(f"{prefix}.{k}", a, b)
            for k, (a, b) in calls.items()
            if b - a == len(by_index[k]) and (a, b) in spans
        ]
    blocks.sort(key=lambda b: b.start)
    # block_key takes a path's first index, so containers do not nest; should two calls still
    # overlap, the first is kept (blocks are consecutive, never one inside another)
    out: list[Block] = []
    for b in blocks:
        if not out or b.start >= out[-1].stop:
            out.append(b)
    return out


def require_blocks(graph: CostGraph, solver: str) -> list[Block]:
    """``module_blocks``, or UnsupportedModelError saying the model has none (two at least)."""
    blocks = module_blocks(graph)
    if len(blocks) < 2:
        raise UnsupportedModelError(
            f"solver {solver!r} checkpoints the model's repeated blocks (a ModuleList's layers, "
            f"a Sequential's children that run the same ops), and this model has "
            f"{'one' if blocks else 'none'} that a plan applied in place can wrap; solvers "
            f"{', '.join(map(repr, BLOCKLESS_SOLVERS))} still apply (they choose among the "
            f"module calls themselves), or plan with form='graph'"
        )
    return blocks


def group_regions(graph: CostGraph, blocks: Sequence[Block], depth: int = 0) -> list[Region]:
    """Regions covering consecutive ``blocks`` as one group: one region where the group is one
    span (a single block, a Sequential run, a span of the parent's forward); else the fewest
    spans that cover it, each the longest run of blocks from where the last ended (the nearest
    grouping an in-place plan can carry out; every single block is a span)."""
    spans = graph.region_spans or frozenset()
    out, i = [], 0
    while i < len(blocks):
        j = max(j for j in range(i, len(blocks)) if (blocks[i].start, blocks[j].stop) in spans)
        out.append(Region(blocks[i].start, blocks[j].stop, depth))
        i = j + 1
    return out


def grouped(graph: CostGraph, blocks: Sequence[Block], k: int) -> tuple[list[Region], int]:
    """Regions of every ``k`` consecutive blocks, and how many groups were split into more
    than one region (no span covers them)."""
    regions: list[Region] = []
    split = 0
    for g in range(0, len(blocks), max(1, k)):
        made = group_regions(graph, blocks[g : g + max(1, k)])
        split += len(made) > 1
        regions += made
    return regions, split


def split_note(split: int, k: int) -> str:
    return (
        ""
        if not split
        else f"; {split} group(s) of {k} blocks are no one module call or span, each wrapped "
        f"as the fewest spans that cover it"
    )


def nest_depths(regions: Sequence[Region]) -> list[Region]:
    """``regions`` (distinct intervals, any order) with each depth its number of enclosing
    regions, sorted as ``finish`` keeps them."""
    ordered = sorted(set((r.start, r.stop) for r in regions), key=lambda s: (s[0], -s[1]))
    out, stack = [], []
    for a, b in ordered:
        while stack and stack[-1][1] <= a:
            stack.pop()
        out.append(Region(a, b, len(stack)))
        stack.append((a, b))
    return out
