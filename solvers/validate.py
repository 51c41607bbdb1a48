"""What ``simulate`` accepts (its Rule 10 and the laminar shape every solver's schedule has):
the check a schedule passes before it is replayed."""

from __future__ import annotations

from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import forbidden_cuts


class InvalidScheduleError(ValueError):
    """A schedule whose regions are not a laminar family of intervals inside the graph."""


def validate(graph: CostGraph, schedule: Schedule) -> None:
    """InvalidScheduleError unless ``schedule``'s regions are a laminar family of intervals
    inside ``graph``, each on its region spans (if it has them) and at cuts in-place writes
    allow (Rule 10)."""
    n = len(graph.nodes)
    regions = sorted(schedule.regions, key=lambda r: (r.start, -r.stop))
    forbidden = forbidden_cuts(graph)
    for r in regions:
        if not 0 <= r.start < r.stop <= n:
            raise InvalidScheduleError(f"region {r} lies outside nodes 0..{n}")
        if graph.region_spans is not None and (r.start, r.stop) not in graph.region_spans:
            raise InvalidScheduleError(
                f"region {r} is not one of the graph's region spans (one module call each, for "
                f"a plan applied in place); solvers 'auto', 'dp' and 'ilp' keep to them"
            )
        for c in (r.start, r.stop):
            if c in forbidden:
                raise InvalidScheduleError(
                    f"region {r} has a boundary at cut {c}, before node {graph.nodes[c].name}: "
                    f"a storage produced before it is written in place at or after it"
                )
    enclosing: list[Region] = []  # sorted by (start, -stop): the chain of regions around r
    for r in regions:
        while enclosing and enclosing[-1].stop <= r.start:
            enclosing.pop()
        if enclosing and enclosing[-1] == r:
            raise InvalidScheduleError(f"region {r} appears twice")
        if enclosing and r.stop > enclosing[-1].stop:
            raise InvalidScheduleError(f"regions {enclosing[-1]} and {r} overlap without nesting")
        enclosing.append(r)
