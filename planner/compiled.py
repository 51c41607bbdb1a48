"""Plans for ``torch.compile``: ``planner.plan(..., compiled=True)`` (issue 21).

What compile runs is not what eager runs, in two ways that matter for the budget:

1. **Nested regions are flattened.** Under compile a checkpoint is dynamo's
   ``tag_activation_checkpoint``; AOT autograd traces an inner checkpoint inside an outer one
   into the same joint graph, each op tagged with a recompute policy, and the min-cut
   partitioner recomputes every tagged op at most once in the backward graph. Eager nesting
   recomputes the inner region twice (once inside the outer's recomputation, where its
   internals are dropped, once for its own backward); compiled, the inner region's internals
   are recomputed once with the outer region and live until the inner backward. A nested plan
   therefore runs as its flattened plan: the tiny Llama of ``benchmarks/compiled_inplace.py``
   planned at 30% of its eager peak (nested) measured 1.175x (``aot_eager``) and 1.41x
   (inductor) its budget compiled, 0.93x and 1.12x the flattened plan's predicted peak.
   So a compiled plan is solved without nesting (``dp``'s ``max_depth=1``; ``ilp`` never
   nests), which loses nothing compile could carry out.
2. **The compiled step's own peak differs from eager's.** The partitioner recomputes each op
   just before its first use and may save other tensors than eager autograd does, and
   inductor fuses kernels, which holds a fused kernel's inputs until the kernel runs. Measured
   on flat plans (CPU, tiny Llama and GPT-2; BENCHMARKS.md "In-place plans under
   torch.compile"), the compiled peak was 0.73-0.96x the eager prediction with ``aot_eager``
   and per-block inductor, and up to 1.115x with whole-model inductor (Llama planned flat at
   50% of its eager peak: 1.015x with inductor's decompositions and partitioner but no
   inductor code, ``aot_eager_decomp_partition``; 0.929x with inductor's fusion off,
   ``max_fusion_size=1``; so fusion, which is not modelled here). The plan is instead made
   against the budget less :data:`COMPILED_MARGIN`, stated in the plan's summary and solver
   note.

The plan's ``budget_bytes`` stays the caller's budget (what the measured compiled peak must keep
under); ``predicted_peak_bytes`` stays the eager prediction, at most ``budget * (1 - margin)``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from planner.solvers.costgraph import CostGraph, Objective, Schedule
from planner.solvers.dp_levels import DPOptions
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import solve

# The share of the budget kept free for what compile adds to the eager prediction of a flat
# plan: the worst measured was +11.5% (whole-model inductor fusion, CPU, tiny Llama), which
# 15% covers with 5% of the budget to spare (1.115 * 0.85 = 0.948).
COMPILED_MARGIN = 0.15


def compiled_budget_bytes(budget_bytes: int) -> int:
    """The budget a compiled plan is solved against: ``budget_bytes`` less the margin."""
    return math.floor(budget_bytes * (1 - COMPILED_MARGIN))


def flat_solver_options(solver: str, solver_opts: dict[str, Any]) -> dict[str, Any]:
    """``solver_opts`` with nesting turned off for ``solver`` (dp, and dp inside auto; ilp and
    none never nest)."""
    opts = dict(solver_opts)
    if solver == "dp":
        _check_flat(opts.get("max_depth", 1), "max_depth")
        opts["max_depth"] = 1
    elif solver == "auto":
        dp = opts.get("dp", DPOptions())
        if isinstance(dp, DPOptions):
            opts["dp"] = replace(dp, max_depth=1)  # its default, None, nests at any depth
        else:
            _check_flat(dict(dp).get("max_depth", 1), "dp={'max_depth': ...}")
            opts["dp"] = {**dict(dp), "max_depth": 1}
    return opts


def _check_flat(max_depth: Any, name: str) -> None:
    if max_depth != 1:
        raise ValueError(
            f"compiled=True plans without nested regions (torch.compile flattens them), so "
            f"{name} must be 1, got {max_depth!r}; leave it out"
        )


def solve_compiled(
    graph: CostGraph,
    budget_bytes: int,
    solver: str,
    objective: Objective,
    max_recompute_flops_fraction: float | None,
    solver_opts: dict[str, Any],
) -> Schedule:
    """Solve ``graph`` for a compiled step: without nesting, against
    :func:`compiled_budget_bytes`; the margin is stated in the schedule's note. An
    ``InfeasibleBudgetError`` states the least budget in the caller's terms."""
    try:
        schedule = solve(
            graph,
            compiled_budget_bytes(budget_bytes),
            solver,
            objective,
            max_recompute_flops_fraction,
            **flat_solver_options(solver, solver_opts),
        )
    except InfeasibleBudgetError as e:
        raise compiled_infeasible(e, budget_bytes) from None
    if any(r.depth for r in schedule.regions):  # a solver that ignored max_depth: a bug
        raise AssertionError(f"compiled plan with nested regions from {schedule.solver!r}")
    note = compiled_note(budget_bytes)
    return replace(schedule, note=f"{note}; {schedule.note}" if schedule.note else note)


def compiled_note(budget_bytes: int) -> str:
    return (
        f"compiled: planned without nested regions against the budget less a "
        f"{COMPILED_MARGIN:.0%} margin for torch.compile ({compiled_budget_bytes(budget_bytes):,}"
        f" of {budget_bytes:,} B)"
    )


def compiled_infeasible(e: InfeasibleBudgetError, budget_bytes: int) -> InfeasibleBudgetError:
    """``e`` (raised against the reduced budget) restated in the caller's budget."""
    least = None if e.min_bytes is None else math.ceil(e.min_bytes / (1 - COMPILED_MARGIN))
    return InfeasibleBudgetError(
        budget_bytes,
        least,
        f"(compiled=True: planned without nested regions, which torch.compile flattens, and "
        f"against the budget less a {COMPILED_MARGIN:.0%} margin for what compile adds)",
    )
