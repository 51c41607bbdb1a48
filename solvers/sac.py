"""``sac``: torchtitan's op-level selective activation checkpointing, as it ships, per block.

torchtitan (``torchtitan/distributed/activation_checkpoint.py``, ``selective_ac_option = "op"``)
wraps each transformer block in a checkpoint whose policy saves the outputs of the ops on its
save list and recomputes everything else, except that of the ``aten.mm`` calls it saves only
the odd ones (the first, third, ... of each block: "every second mm" is recomputed). The list
is its compute-intensive ops: plain ``mm`` (a bias-free linear; ``addmm``, a linear with bias,
is not on it), the fused attention kernels (``_scaled_dot_product_*_attention``; on the CPU
attention runs as ``_scaled_dot_product_flash_attention_for_cpu``, which is not on it either),
``max`` (FP8 scales) and the collectives. A region is a selective one per block
(``solvers/blocks.py`` in place) keeping those nodes' outputs; ``simulate`` prices it.
"""

from __future__ import annotations

from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.registry import SolverOptions, register
from planner.solvers.selective import block_bounds, finish_selective

MM = "aten.mm.default"
# torchtitan's _op_sac_save_list, by the names our nodes carry (Node.op); its higher-order ops
# (flex attention, compiled code) never reach an eager step's nodes
SAVE_LIST = frozenset(
    {
        MM,
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "aten.max.default",
    }
)


def saved_by_policy(graph: CostGraph, start: int, stop: int) -> frozenset[int]:
    """The nodes in [start, stop) whose outputs torchtitan's policy saves: those on its save
    list, but of the mm calls only the odd ones, counted from the region's start."""
    saved, mm_count = set(), 0
    for i in range(start, stop):
        op = graph.nodes[i].op
        if op == MM:
            mm_count += 1
        if op in SAVE_LIST and not (op == MM and mm_count % 2 == 0):
            saved.add(i)
    return frozenset(saved)


@register("sac", options=SolverOptions)
def solve_sac(graph: CostGraph, budget_bytes: float, options: SolverOptions) -> Schedule:
    """torchtitan's op-level policy per block: the outputs of its save list's ops kept (of the
    mm calls every other one), the rest recomputed (``saved_by_policy``)."""
    regions = [
        Region(lo, hi, kind="selective", saved_nodes=saved_by_policy(graph, lo, hi))
        for lo, hi in block_bounds(graph, None)
    ]
    n_kept = sum(len(r.saved_nodes) for r in regions)
    note = f"torchtitan's op policy: {n_kept} outputs kept in {len(regions)} blocks"
    return finish_selective(graph, budget_bytes, regions, "sac", note)
