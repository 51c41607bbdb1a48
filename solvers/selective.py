"""``selective``: keep the expensive outputs, recompute the cheap and the quadratic ones.

Megatron-style (Korthikanti et al. 2022): inside each block's region the outputs of matmuls and
convolutions with weights are kept, and everything else -- attention scores, softmax, dropout,
normalisation, pointwise ops -- is recomputed in backward. Runs as an op-level policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) inside one region per block.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.solvers.blocks import require_blocks
from planner.solvers.common import finish
from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import block_spans, even_cuts
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.op_classes import out_bytes, worth_keeping
from planner.solvers.registry import SolverOptions, register
from planner.solvers.simulate import simulate


@dataclass(frozen=True)
class SelectiveOptions(SolverOptions):
    """``n_segments``: that many regions at cheap cuts instead of one per block."""

    n_segments: int | None = None


def block_bounds(graph: CostGraph, n_segments: int | None) -> list[tuple[int, int]]:
    """The [start, stop) of each selective region: per block, else per cheap-cut segment; in
    place, per repeated module call (``solvers/blocks.py``)."""
    if graph.region_spans is not None:
        if n_segments is not None:
            raise ValueError(
                "selective's n_segments places regions at cheap cuts, which a plan applied in "
                "place cannot wrap; in place it makes one region per block (leave it unset)"
            )
        return [(b.start, b.stop) for b in require_blocks(graph, "selective")]
    spans = block_spans(graph)
    if spans and n_segments is None:
        bounds = [spans[0][0]] + [stop for _, stop in spans]
    else:
        bounds = even_cuts(graph, n_segments or 4)
    return list(zip(bounds, bounds[1:]))


def finish_selective(
    graph: CostGraph, budget_bytes: float, regions: list[Region], solver: str, note: str
) -> Schedule:
    """``finish``, or the eager step where the regions do not fit and it does: on tiny models
    the regions' inputs can outweigh what they drop."""
    try:
        return finish(graph, budget_bytes, regions, solver, note)
    except InfeasibleBudgetError:
        if simulate(graph, Schedule()).peak_bytes > budget_bytes:
            raise
        return finish(graph, budget_bytes, [], solver, "the eager step fits; regions did not")


@register("selective", options=SelectiveOptions)
def solve_selective(graph: CostGraph, budget_bytes: float, options: SelectiveOptions) -> Schedule:
    """One selective region per block keeping matmul and convolution outputs, the rest
    recomputed (Korthikanti et al.; regions: ``block_bounds``, kept: ``worth_keeping``)."""
    produced = out_bytes(graph)
    regions = []
    for lo, hi in block_bounds(graph, options.n_segments):
        keep = frozenset(i for i in range(lo, hi) if worth_keeping(graph, i, produced))
        regions.append(Region(lo, hi, kind="selective", saved_nodes=keep))
    n_kept = sum(len(r.saved_nodes) for r in regions)
    return finish_selective(
        graph, budget_bytes, regions, "selective", f"{n_kept} matmul outputs kept"
    )
