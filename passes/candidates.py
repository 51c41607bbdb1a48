"""The regions an eager step offers: :class:`EagerGraph`, the priced step with each candidate's
node span and place, and the candidates among module calls and runs of an ``nn.Sequential``'s
children (:func:`module_candidates`; spans of modules' own forwards:
``passes/parent_candidates.py``).

A module call is a candidate when it is called once per step, with grad, writing no state but
its own buffers, not passed one tensor as two arguments, and no in-place write crosses its
boundary; ``EagerGraph.refused`` says why any other is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS

from planner.passes.regions import ModulePlace, Place, RunPlace, SpanPlace
from planner.solvers.costgraph import CostGraph
from planner.solvers.cuts import forbidden_cuts

# Ops selective checkpointing lets through without asking its policy (nor counting them).
UNCOUNTED_OPS = frozenset(str(op) for op in SAC_IGNORED_OPS)


@dataclass(frozen=True)
class EagerGraph:
    """A priced eager step and the module calls that may become regions.

    ``places``: (start, stop) -> where in the model the region over that span would run
    (``passes/regions.py``: a module, a run of a Sequential's children, a span of a module's own
    forward), for every span in ``graph.region_spans`` (the outermost module when several share
    one span); ``spans``: the same spans -> their places' names. ``refused``: module path (or
    run, or traced forward) name -> why it is not a candidate. ``module_types``: module path
    -> class name, of every module of the model.
    ``module_spans``: module path -> (start, stop), of every module called exactly once per
    step (candidate or not), for passes that place events at module boundaries (FSDP2 units).
    """

    graph: CostGraph
    places: dict[tuple[int, int], Place]
    refused: dict[str, str]
    module_types: dict[str, str]
    module_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    # candidate path -> the buffers its forward writes (BatchNorm statistics), relative to it:
    # an applied region runs its recomputations on copies of them (``planner/inplace.py``)
    state_buffers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the modules with spans whose traced forward drops some storage earlier than their own
    # forward does, priced as the traced forward runs (their storages' lifetimes:
    # ``passes/python_lifetimes.py``): a plan runs that forward for each one inside a region
    # (``traced_forwards_needed``)
    traced_forwards: tuple[str, ...] = ()

    @property
    def spans(self) -> dict[tuple[int, int], str]:
        """(start, stop) -> the name of the region over that span (its place's)."""
        return {span: place.name for span, place in self.places.items()}

    def traced_forwards_needed(self, regions: Iterable[tuple[int, int]]) -> tuple[str, ...]:
        """The modules a plan of ``regions`` ([start, stop) node intervals, each in ``places``)
        runs as their fx trace does (``passes/parent_spans.py``): those holding a span of their
        own, and those of ``traced_forwards`` whose call lies inside a region (their storages'
        lifetimes are then Python's, priced as the traced forward drops them)."""
        regions = tuple(regions)
        owners = {p.path for r in regions if isinstance(p := self.places[r], SpanPlace)}
        return tuple(sorted(owners)) + tuple(
            path
            for path in self.traced_forwards
            if path not in owners
            and any(
                a <= self.module_spans[path][0] <= self.module_spans[path][1] <= b
                for a, b in regions
            )
        )

    def op_sequence(self, start: int, stop: int) -> list[str]:
        """The overloads a selective-checkpoint policy sees in nodes [start, stop), in order."""
        ops = (self.graph.nodes[i].op for i in range(start, stop))
        return [op for op in ops if op not in UNCOUNTED_OPS]

    def op_key(self, i: int, start: int) -> tuple[str, int]:
        """(overload, occurrence of it since ``start``): how a policy names node ``i``."""
        op = self.graph.nodes[i].op
        return op, self.op_sequence(start, i).count(op)


def module_candidates(
    model: torch.nn.Module,
    graph: CostGraph,
    calls: dict[str, list[tuple[int, int, bool]]],
    written: dict[int, set[str | None]],
    aliased: set[str],
) -> EagerGraph:
    forbidden = forbidden_cuts(graph)
    places: dict[tuple[int, int], Place] = {}
    refused: dict[str, str] = {}
    state: dict[str, tuple[str, ...]] = {}
    for path, _ in model.named_modules():  # parents first: a shared span keeps the outermost
        made = calls.get(path, [])
        if len(made) != 1:
            if made:
                refused[path] = f"called {len(made)} times per step"
            continue
        start, stop, grad = made[0]
        if stop == start:
            continue
        names = set().union(*(written.get(i, ()) for i in range(start, stop)))
        prefix = f"{path}." if path else ""
        if not grad:
            refused[path] = "runs under torch.no_grad()"
        elif None in names or not all(n.startswith(prefix) for n in names):  # type: ignore[union-attr]
            # recomputation could not run on copies of state outside the module's own buffers
            refused[path] = "writes state in forward that is not its own buffers"
        elif path in aliased:
            # nn.MultiheadAttention takes its packed-projection path when `query is key`; a
            # checkpoint nested in another recomputes it from inputs unpacked one by one, no
            # longer the same object, so it runs other ops than it saved and
            # torch.utils.checkpoint raises (measured on nn.TransformerEncoderLayer).
            refused[path] = "is called with one tensor as several arguments"
        elif start in forbidden or stop in forbidden:
            refused[path] = "an in-place write crosses its boundary"
        else:
            places.setdefault((start, stop), ModulePlace(path))
            if names:  # BatchNorm statistics: updated once, recomputed on copies (Rule 9)
                state[path] = tuple(sorted(n[len(prefix) :] for n in names))  # type: ignore[index]
    for run, (start, stop), names in _sequential_runs(model, calls, written):
        prefix = f"{run.path}." if run.path else ""
        if start in forbidden or stop in forbidden:
            refused[run.name] = "an in-place write crosses its boundary"
        elif None in names or not all(n.startswith(prefix) for n in names):  # type: ignore[union-attr]
            refused[run.name] = "writes state in forward that is not its children's own buffers"
        elif (start, stop) not in places:  # a run a module already spans is that module
            places[(start, stop)] = run
            if names:
                state[run.name] = tuple(sorted(n[len(prefix) :] for n in names))  # type: ignore[index]
    types = {path: type(m).__name__ for path, m in model.named_modules()}
    once = {path: made[0][:2] for path, made in calls.items() if len(made) == 1}
    return EagerGraph(
        graph=replace(graph, region_spans=frozenset(places)),
        places=places,
        refused=refused,
        module_types=types,
        module_spans=once,
        state_buffers=state,
    )


# nn.Sequential's own forward: it runs its children one after the other and nothing else
_SEQUENTIAL_FORWARD = torch.nn.Sequential.forward


# Runs start and end at most this many places in a Sequential (O(n^2) spans for dp: 528 at 32
# cut 58.5% of eager off a 32-child MLP and took dp 4 s); a longer one's runs start and end
# every ceil(n / MAX_RUN_CUTS) children.
MAX_RUN_CUTS = 32


def _sequential_runs(
    model: torch.nn.Module,
    calls: dict[str, list[tuple[int, int, bool]]],
    written: dict[int, set[str | None]],
) -> Iterator[tuple[RunPlace, tuple[int, int], set[str | None]]]:
    """(the run's place, ``path[a:b]``, its node span, state names written) of every run
    of two or more consecutive children of an ``nn.Sequential`` that is not all of them: a
    region ``planner/inplace.py`` applies as one checkpointed call of those children
    (``inplace.RunForward``). Only a Sequential whose forward is nn.Sequential's own (so the
    run's ops are exactly its children's, back to back), called once with grad, whose children
    are each called once, by it. A Sequential of more than MAX_RUN_CUTS children offers the
    runs between every k-th child (k = ceil(n / MAX_RUN_CUTS))."""
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Sequential):
            continue
        if type(module).forward is not _SEQUENTIAL_FORWARD or len(calls.get(path, ())) != 1:
            continue
        n = len(module)
        if n < 3 or not calls[path][0][2]:
            continue
        prefix = f"{path}." if path else ""
        made = [calls.get(f"{prefix}{k}", []) for k in range(n)]
        if any(len(m) != 1 or not m[0][2] for m in made):
            continue
        bounds = [m[0][:2] for m in made]
        if bounds[0][0] != calls[path][0][0] or bounds[-1][1] != calls[path][0][1]:
            continue
        if any(bounds[k][1] != bounds[k + 1][0] for k in range(n - 1)):
            continue
        stride = -(-n // MAX_RUN_CUTS)
        cuts = sorted({*range(0, n, stride), n})
        for i, a in enumerate(cuts):
            for b in cuts[i + 1 :]:
                if b - a < 2 or (a, b) == (0, n):
                    continue  # one child is that child's region; all is the Sequential's
                start, stop = bounds[a][0], bounds[b - 1][1]
                if stop == start:
                    continue
                names = set().union(*(written.get(i, ()) for i in range(start, stop)))
                # a run writes only the buffers of its own children
                own = tuple(f"{prefix}{k}." for k in range(a, b))
                names = {n_ if n_ is None or n_.startswith(own) else None for n_ in names}
                yield RunPlace(path, a, b), (start, stop), names
