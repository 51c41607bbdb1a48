"""``selective``: keep the expensive outputs, recompute the cheap and the quadratic ones.

Megatron-style (Korthikanti et al. 2022): inside each block's region the outputs of matmuls and
convolutions with weights are kept, and everything else -- attention scores, softmax, dropout,
normalisation, pointwise ops -- is recomputed in backward. Runs as an op-level policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) inside one region per block.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.solvers.common import finish
from planner.solvers.costgraph import CostGraph, Node, Region, Schedule
from planner.solvers.cuts import block_spans, even_cuts
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.op_classes import FUSED_ATTENTION, MATMUL, WEIGHT_MATMUL
from planner.solvers.registry import SolverOptions, register
from planner.solvers.simulate import simulate


def out_bytes(graph: CostGraph) -> list[int]:
    out = [0] * len(graph.nodes)
    for t in graph.tensors:
        out[t.producer] += t.size_bytes
    return out


def is_matmul(graph: CostGraph, i: int) -> bool:
    """A matmul, convolution or fused attention, whatever its output's size (its tags, from
    ``solvers/op_classes.py``)."""
    return MATMUL in graph.nodes[i].tags


def worth_keeping(graph: CostGraph, i: int, produced: list[int]) -> bool:
    """A weight matmul or convolution, or an activation matmul that does not blow up the size
    (attention's q @ k^T is S x S: recomputed; att @ v is not: kept)."""
    node: Node = graph.nodes[i]
    if "attention" in node.tags and FUSED_ATTENTION not in node.tags:
        return False
    if WEIGHT_MATMUL in node.tags:
        return True
    if MATMUL in node.tags:
        read = sum(produced[j] for j in node.inputs)
        return produced[i] <= max(read, 1)
    return False


@dataclass(frozen=True)
class SelectiveOptions(SolverOptions):
    """``n_segments``: that many regions at cheap cuts instead of one per block."""

    n_segments: int | None = None


@register("selective", options=SelectiveOptions)
def solve_selective(graph: CostGraph, budget_bytes: float, options: SelectiveOptions) -> Schedule:
    """One selective region per block (or per cheap-cut segment when there are no blocks)."""
    n_segments = options.n_segments
    spans = block_spans(graph)
    if spans and n_segments is None:
        bounds = [spans[0][0]] + [stop for _, stop in spans]
    else:
        bounds = even_cuts(graph, n_segments or 4)
    produced = out_bytes(graph)
    regions = []
    for lo, hi in zip(bounds, bounds[1:]):
        keep = frozenset(i for i in range(lo, hi) if worth_keeping(graph, i, produced))
        regions.append(Region(lo, hi, kind="selective", saved_nodes=keep))
    n_kept = sum(len(r.saved_nodes) for r in regions)
    try:
        return finish(graph, budget_bytes, regions, "selective", f"{n_kept} matmul outputs kept")
    except InfeasibleBudgetError:
        if simulate(graph, Schedule()).peak_bytes > budget_bytes:
            raise
        # On tiny models the regions' inputs can outweigh what they drop: the eager step fits.
        return finish(graph, budget_bytes, [], "selective", "the eager step fits; regions did not")
