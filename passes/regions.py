"""A checkpoint region, and its place in the model when it is carried out in place.

:class:`Region` (public as ``planner.Region``, ``plan.regions``) is what both forms of plan list
and what ``passes/rewrite.py`` cuts out of a GraphModule. The solvers' ``solvers.costgraph.Region``
is the same region as an index interval [start, stop) of CostGraph nodes.

An in-place region is carried out on the model's own modules, at one of three places:

- :class:`ModulePlace`: one submodule, every call of it (``blocks.0``);
- :class:`RunPlace`: consecutive children [start, stop) of an ``nn.Sequential``, run as one call
  (``blocks[0:2]``);
- :class:`SpanPlace`: a stretch of one module's own forward, its own ops and its children's
  calls together, from the fx call node labelled ``first`` to the one labelled ``last``
  (``passes/parent_spans.py``; ``(max_pool2d..down.0)`` at the root, ``blocks.0.mlp(fc..proj)``).

Each place's ``path`` is the module it is of (the module, the Sequential, the parent whose
forward it cuts) and its ``name`` the string plans have always named the region by: the plan
file, the summary and users read names, the code reads places. :func:`parse_place` reads a name
back, only where a name comes from outside (a plan file, a user's string). No torch here: the
planner package and ``passes/`` share these types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModulePlace:
    """Every call of the module at ``path`` ("" is the root)."""

    path: str

    @property
    def name(self) -> str:
        return self.path


@dataclass(frozen=True)
class RunPlace:
    """Children [start, stop) of the ``nn.Sequential`` at ``path``, run as one call."""

    path: str
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.path}[{self.start}:{self.stop}]"


@dataclass(frozen=True)
class SpanPlace:
    """The stretch of ``path``'s own forward from its call node labelled ``first`` to the one
    labelled ``last``, inclusive (``parent_spans.node_labels``). Empty ends stand for the
    module's traced forward as a whole, which holds no span of its own (what the plan file
    checks and ``EagerGraph.refused`` notes of a module that offers no spans)."""

    path: str
    first: str
    last: str

    @property
    def name(self) -> str:
        return f"{self.path}({self.first}..{self.last})"


Place = ModulePlace | RunPlace | SpanPlace

_SPAN_NAME = re.compile(r"(?P<path>[^()]*)\((?P<first>[\w.]+?)\.\.(?P<last>[\w.]+)\)")
_RUN_NAME = re.compile(r"(?P<path>.*)\[(?P<start>\d+):(?P<stop>\d+)\]")


def parse_place(name: str) -> Place:
    """The place an in-place region's ``name`` names (the inverse of each place's ``name``), for
    names read from a plan file or given by a user."""
    if (span := _SPAN_NAME.fullmatch(name)) is not None:
        return SpanPlace(span["path"], span["first"], span["last"])
    if (run := _RUN_NAME.fullmatch(name)) is not None:
        return RunPlace(run["path"], int(run["start"]), int(run["stop"]))
    return ModulePlace(name)


def place_of(region: Region) -> Place:
    """Where in the model an in-place ``region`` is: its place, or for one a user made from
    its name alone (``planner.Region("blocks.0", ())``), the place that name names."""
    return region.place if region.place is not None else parse_place(region.name)


@dataclass(frozen=True)
class Region:
    """A checkpoint region as users see it (``planner.Region``, ``plan.regions``).

    ``name``: in a graph plan the GraphModule attribute that runs it (``ckpt_blocks_0``); in an
    in-place plan its place's name (``blocks.0``, also ``path``). ``nodes``: the cost-graph node
    names it covers, in order (a graph plan's are fx node names, which the rewrite cuts by);
    ``depth`` 0 is outermost, a region of depth d+1 lies inside one of depth d; ``kind``:
    'recompute', 'selective' (keep the outputs of ``saved_nodes``, recompute the rest) or
    'offload' (keep what backward needs in host memory). ``preserve_rng_state``: its checkpoint
    stashes the RNG state and replays it on recomputation, as a region over an op that draws
    random numbers (dropout) must; planning sets it from the priced step
    (``CostGraph.preserves_rng_state``, simulate's Rule 12), so a region without one neither
    stashes nor is priced for it. True when not known (the safe side).

    What applying in place needs besides, with no graph and no shapes: ``keeps``, (op overload,
    occurrence within the call) of the ops a selective region keeps; ``ops``, the overloads its
    forward was planned to run, in order, to detect divergence at run time; ``state_buffers``,
    buffers its forward writes (BatchNorm statistics), recomputed on copies; ``place``, where in
    the model it runs (None in a graph plan; :meth:`at` names the region by it).
    """

    name: str
    nodes: tuple[str, ...]
    depth: int = 0
    kind: str = "recompute"
    saved_nodes: tuple[str, ...] = ()
    preserve_rng_state: bool = True
    keeps: tuple[tuple[str, int], ...] = ()
    ops: tuple[str, ...] = ()
    state_buffers: tuple[str, ...] = ()
    place: Place | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.place is not None and self.place.name != self.name:
            raise ValueError(f"region {self.name!r} is named otherwise than its place {self.place}")

    @classmethod
    def at(cls, place: Place, nodes: tuple[str, ...] = (), **fields: Any) -> Region:
        """The in-place region at ``place``, named by it; ``fields`` as the constructor's."""
        return cls(place.name, nodes, place=place, **fields)

    @property
    def path(self) -> str:
        """An in-place region's name: the path of the module it is, a run's (``blocks[0:2]``)
        or a span's (``blocks.0(mul..down_proj)``); ``place`` holds their parts."""
        return self.name
