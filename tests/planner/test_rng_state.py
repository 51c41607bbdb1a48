"""A checkpoint preserves its RNG state only where it draws random numbers (simulate's Rule 12).

A region whose ops draw nothing (no dropout in training, ``rand*``, ``bernoulli``...: ops
tagged ``torch.Tag.nondeterministic_seeded``) is applied with ``preserve_rng_state=False``, so
it neither stashes the CPU generator's state (5,056 B of device memory on a CPU) nor copies it
while it recomputes, and is priced so; a region holding such an op, at any depth (a parent of
a dropout block too), keeps both. The same fact (``CostGraph.preserves_rng_state``) decides
both forms' application and the prediction, so prediction and measurement agree, and the
dropout region replays its masks: gradients bitwise equal to the unwrapped model's.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torch import nn

import planner
from planner.inplace import apply_regions
from planner.passes.rewrite import rewrite
from planner.planning import price_form
from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.simulate import simulate
from tests.helpers import assert_same_step, assert_same_step_copy

# The net returns a tensor: the sum of it is the loss meant here.
pytestmark = pytest.mark.filterwarnings("ignore::planner.LossFallbackWarning")

WIDTH, BATCH = 16, 64
STASH_BYTES = torch.get_rng_state().untyped_storage().nbytes()


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class Net(nn.Module):
    """``blocks`` (an nn.Sequential, one call) of two blocks, the first with dropout when
    ``dropout``; a head after them."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(dropout), Block(0.0))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


# The nest: ``blocks`` around both blocks, each block a region inside it.
NEST = (("blocks", 0), ("blocks.0", 1), ("blocks.1", 1))


def _model(dropout: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Net(dropout).train(), torch.randn(BATCH, WIDTH)


def _span(graph: CostGraph, path: str) -> tuple[int, int]:
    """The graph form's node interval of module ``path``'s call (its ops run contiguously)."""
    inside = [
        i
        for i, nd in enumerate(graph.nodes)
        if nd.module_path == path or nd.module_path.startswith(path + ".")
    ]
    assert inside == list(range(inside[0], inside[-1] + 1)), path
    return inside[0], inside[-1] + 1


def _schedule(priced, form: str) -> Schedule:
    if form == "inplace":
        spans = {path: span for span, path in priced.eager.spans.items()}
    else:
        spans = {path: _span(priced.graph, path) for path, _ in NEST}
    return Schedule(tuple(Region(*spans[path], depth) for path, depth in NEST), "manual")


def _every_node_random(graph: CostGraph) -> CostGraph:
    """``graph`` as if every node drew random numbers: every region stashes (Rule 12)."""
    return replace(graph, nodes=tuple(replace(nd, draws_random=True) for nd in graph.nodes))


@contextlib.contextmanager
def _rng_states_taken() -> Iterator[list[int]]:
    """How many times ``torch.get_rng_state`` runs: each checkpoint call that preserves its
    RNG state takes one as it stashes, and one more (fork_rng's) as it recomputes."""
    real, taken = torch.get_rng_state, []

    def counted() -> torch.Tensor:
        taken.append(1)
        return real()

    torch.get_rng_state = counted
    try:
        yield taken
    finally:
        torch.get_rng_state = real


def _states_taken(module: nn.Module, x: torch.Tensor) -> int:
    with _rng_states_taken() as taken:
        module(x).sum().backward()
    return len(taken)


@pytest.mark.parametrize("form", ["inplace", "graph"])
@pytest.mark.parametrize("dropout", [0.3, 0.0])
def test_regions_preserve_rng_state_only_where_they_draw_random_numbers(form, dropout):
    model, x = _model(dropout)
    priced = price_form(model, x, form, device="cpu")
    graph, schedule = priced.graph, _schedule(priced, form)
    assert graph.region_state_bytes == STASH_BYTES  # a CPU: the stash is device memory
    p = priced.build(schedule, priced.eager_peak_bytes)
    preserved = {r.depth: [] for r in p.regions}
    for r in p.regions:
        preserved[r.depth].append(r.preserve_rng_state)
    # the dropout block and the region around it preserve; the block without dropout does not
    assert preserved == {0: [bool(dropout)], 1: [bool(dropout), False]}

    applied = p.apply(copy.deepcopy(model)) if form == "inplace" else p.module
    # predicted as measured, the stashes of the regions that preserve only
    assert planner.measure(applied, x).peak_bytes == p.predicted_peak_bytes
    # dropout's masks replayed on recomputation: the unwrapped model's gradients, bitwise
    if form == "inplace":
        assert_same_step_copy(model, applied, x)
    else:
        assert_same_step(model, applied, x)
    # A region that does not preserve takes no RNG state: first forward, the two that
    # preserve stash one each; backward, the parent's recomputation copies one (fork_rng)
    # and stashes the dropout block's again, whose recomputation copies one.
    assert _states_taken(applied, x) == (5 if dropout else 0)

    # The same regions forced to preserve (every call stashes, as before Rule 12 asked which
    # draw): priced so, measured so, and more memory on this small step.
    if form == "inplace":
        forced_regions = tuple(replace(r, preserve_rng_state=True) for r in p.regions)
        forced = apply_regions(copy.deepcopy(model), forced_regions)
    else:
        forced = rewrite(priced.module, [replace(r, preserve_rng_state=True) for r in p.regions])
    assert _states_taken(forced, x) == 3 + 1 + 2 + 2  # the same count, for all three
    forced_bytes = planner.measure(forced, x).peak_bytes
    assert forced_bytes == simulate(_every_node_random(graph), schedule).peak_bytes
    # at most three stashes alive at once (the nest's first-forward frames): up to 15 KB more
    assert 0 < forced_bytes - p.predicted_peak_bytes <= (1 if dropout else 3) * STASH_BYTES


def test_a_saved_in_place_plan_keeps_which_regions_preserve(tmp_path):
    model, x = _model(0.3)
    priced = price_form(model, x, "inplace", device="cpu")
    p = priced.build(_schedule(priced, "inplace"), priced.eager_peak_bytes)
    p.save(tmp_path / "plan.json")
    applied = planner.apply_plan(copy.deepcopy(model), tmp_path / "plan.json")
    assert [r.preserve_rng_state for r in planner.applied_plan(applied).regions] == [
        True,
        True,
        False,
    ]
    assert planner.measure(applied, x).peak_bytes == p.predicted_peak_bytes
    assert_same_step_copy(model, applied, x)
