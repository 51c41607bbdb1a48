"""The Plan: one frozen type for plans of either form, and the Region a plan lists.

A plan is data: the regions to checkpoint, what it predicts for one step, the budget, the
solver and its note, and its ``target``, the form's own part (``planner/graph_form.py``: the
GraphModule that carries it out; ``planner/inplace_form.py``: what applying it to the model's
own modules checks). What a plan does (``apply``, ``summary``, ``save``) its target does, so
this module imports nothing of the pipeline, and ``report``, ``plots`` and ``plan_file``, which
read plans, import nothing of the pipeline but this.

A new prediction is one more field of :class:`Predictions` (a unit at the end of its name:
``_bytes``, ``_flops``, ``_s``) and the line of :meth:`Predictions.of` that computes it from
the priced step and its simulation; the plan file and the summary read the fields as they find
them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from planner.passes.parent_spans import split_span
from planner.passes.rewrite import NamedRegion
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.simulate import Simulation

if TYPE_CHECKING:
    import torch

GB = 10**9  # mem_budget_gb counts decimal gigabytes, as its name says


def gb_to_bytes(gb: float) -> int:
    """Decimal gigabytes (10^9 bytes) in bytes, as every budget and device size is counted."""
    return round(float(gb) * GB)


@dataclass(frozen=True)
class Region(NamedRegion):
    """A checkpoint region as users see it (``planner.Region``, ``plan.regions``).

    ``name``: in a graph plan the GraphModule attribute that runs it (``ckpt_blocks_0``); in
    an in-place plan the path of the module it checkpoints (``blocks.0``, also ``path``).
    ``nodes``: the cost-graph node names it covers, in order; ``depth`` 0 is outermost, a
    region of depth d+1 lies inside one of depth d; ``kind``: 'recompute', 'selective' (keep
    the outputs of ``saved_nodes``, recompute the rest) or 'offload' (keep what backward needs
    in host memory). The solvers' ``solvers.costgraph.Region`` is the same region as an index
    interval of the cost graph.

    What applying in place needs besides, with no graph and no shapes: ``keeps``, (op
    overload, occurrence within the call) of the ops a selective region keeps; ``ops``, the
    overloads its forward was planned to run, in order, to detect divergence at run time;
    ``state_buffers``, buffers its forward writes (BatchNorm statistics), recomputed on copies.
    """

    keeps: tuple[tuple[str, int], ...] = ()
    ops: tuple[str, ...] = ()
    state_buffers: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        """The module path of an in-place region (its name; for a run of an nn.Sequential's
        children, ``blocks[0:2]``, the Sequential's path and the slice: :func:`split_run`; for
        a span of a module's own forward, ``blocks.0(mul..down_proj)``: :func:`region_module`)."""
        return self.name


def split_run(name: str) -> tuple[str, slice | None]:
    """(module path, children slice) of an in-place region's name: ``blocks[0:2]`` is a run of
    children 0 and 1 of the ``nn.Sequential`` ``blocks``; a plain path has no slice."""
    match = _RUN_NAME.fullmatch(name)
    if match is None:
        return name, None
    return match["path"], slice(int(match["a"]), int(match["b"]))


_RUN_NAME = re.compile(r"(?P<path>.*)\[(?P<a>\d+):(?P<b>\d+)\]")


def region_module(name: str) -> str:
    """The path of the module an in-place region is of: the module itself, a run's
    nn.Sequential (``blocks[0:2]``: :func:`split_run`), or the module whose own forward a span
    is of (``blocks.0(mul..down_proj)``: ``passes/parent_spans.py`` ``split_span``)."""
    span = split_span(name)
    return split_run(name)[0] if span is None else span[0]


@dataclass(frozen=True)
class Predictions:
    """What a plan predicts for one forward+loss+backward step, units in the names.

    Bytes are peaks above the pre-step baseline (DESIGN.md). Times are 0 in a plan read from a
    file saved before they were recorded.
    """

    peak_bytes: int
    baseline_peak_bytes: int  # the same step without checkpointing
    recompute_flops: int
    step_flops: int  # of one step without checkpointing (forward + backward)
    recompute_time_s: float = 0.0
    step_time_s: float = 0.0  # forward + backward + recompute (+ offload transfers)

    # the fields the summary and compare's table put in words of their own; any other is shown
    # by its name and unit (:meth:`others`)
    described: ClassVar[frozenset[str]] = frozenset(
        {
            "peak_bytes",
            "baseline_peak_bytes",
            "recompute_flops",
            "step_flops",
            "recompute_time_s",
            "step_time_s",
        }
    )

    @classmethod
    def of(cls, graph: CostGraph, simulation: Simulation, baseline_peak_bytes: int) -> Predictions:
        """What a plan of either form predicts: ``simulation`` of a schedule over the priced
        step ``graph``, whose peak without checkpointing is ``baseline_peak_bytes``."""
        return cls(
            peak_bytes=simulation.peak_bytes,
            baseline_peak_bytes=baseline_peak_bytes,
            recompute_flops=simulation.recompute_flops,
            step_flops=graph.step_flops,
            recompute_time_s=simulation.recompute_time_s,
            step_time_s=simulation.step_time_s,
        )

    def others(self) -> tuple[tuple[str, float], ...]:
        """(name, value) of every field not in ``described``, in declaration order."""
        return tuple(
            (f.name, getattr(self, f.name)) for f in fields(self) if f.name not in self.described
        )


class Target(Protocol):
    """A plan's form: what it adds to the plan, and what the plan's own methods ask of it."""

    form: ClassVar[str]

    def apply(self, plan: Plan, model: torch.nn.Module) -> torch.nn.Module: ...

    def summary(self, plan: Plan, verbose: bool) -> str: ...

    def save(self, plan: Plan, path: str | Path) -> None: ...


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan, of either form (``form``: "inplace" or "graph").

    In place (the default of ``planner.plan``): ``p.apply(model)`` wraps the model's own
    region modules and the model trains as before. Graph: ``p.module`` (a GraphModule sharing
    the model's parameters) carries it out; train it in the model's place.

    ``graph``, ``schedule`` and ``simulation`` are the priced step, the solver's schedule and
    its simulation (None in an in-place plan read from a file). The target's own fields read
    through the plan: ``p.module`` and ``p.fingerprint`` (graph), ``p.model_class``,
    ``p.planned_shape``, ... (in place).
    """

    solver: str
    regions: tuple[Region, ...]
    budget_bytes: int
    predictions: Predictions
    target: Target
    notes: str = ""  # what the solver said of its schedule
    # plan(..., compiled=True): solved flat against budget_bytes * (1 - compiled_margin)
    # (planner/compiled.py); 0.0 for an eager plan and for a plan read from a file
    compiled_margin: float = field(default=0.0, repr=False)
    solve_time_s: float = field(default=0.0, repr=False)  # 0 for a plan read from a file
    graph: CostGraph | None = field(default=None, repr=False, compare=False)
    schedule: Schedule | None = field(default=None, repr=False, compare=False)
    simulation: Simulation | None = field(default=None, repr=False, compare=False)

    @property
    def form(self) -> str:
        return self.target.form

    def __getattr__(self, name: str) -> Any:
        # the target's fields (p.module, p.planned_shape, ...); never while being built
        if name.startswith("_") or name == "target":
            raise AttributeError(name)
        try:
            return getattr(self.target, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__} ({self.form} form) has no attribute {name!r}"
            ) from None

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Carry the plan out on ``model``'s own modules (in place); returns the same object.
        The model warns once (``planner.OverShapeWarning``) when called with a larger input
        than planned. A graph plan raises: train ``p.module`` instead."""
        return self.target.apply(self, model)

    def summary(self, verbose: bool = False) -> str:
        """The regions, what each frees and what its recomputation costs, and the totals.

        ``verbose`` adds what the solver reported (its note, optimality gap) and per-region
        node counts and kept nodes.
        """
        return self.target.summary(self, verbose)

    def save(self, path: str | Path) -> None:
        """Write a versioned JSON that ``planner.apply_plan`` re-applies without solving."""
        self.target.save(self, path)

    # the predictions under the names plans have always had
    @property
    def predicted_peak_bytes(self) -> int:
        return self.predictions.peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.predictions.baseline_peak_bytes

    @property
    def predicted_recompute_flops(self) -> int:
        return self.predictions.recompute_flops

    @property
    def step_flops(self) -> int:
        return self.predictions.step_flops

    @property
    def predicted_recompute_time_s(self) -> float:
        return self.predictions.recompute_time_s

    @property
    def predicted_step_time_s(self) -> float:
        """Forward + backward + recomputation (+ offload transfers) of one step, in seconds."""
        return self.predictions.step_time_s

    @property
    def module_regions(self) -> tuple[Region, ...]:
        """The regions (what in-place plans called their module regions)."""
        return self.regions


InplacePlan = Plan  # the name in-place plans had; one type now
