"""The classic strategies in place, on the user's own model: ``planner.plan(..., solver=s)`` for
every s on a tiny Hugging Face Llama, GPT-2, BERT and ViT, the U-Net and a ResNet answers with a
plan, or InfeasibleBudgetError stating the least budget; an applied plan measures within its
budget and its own predicted peak, with gradients bitwise those of an untouched copy. The
regions each strategy makes are named on a real model."""

from __future__ import annotations

import copy

import pytest
from torch import nn

import planner
from benchmarks.models import residual_cnn_example
from planner.inplace_form import price_inplace
from planner.solvers.blocks import module_blocks
from planner.solvers.errors import UnsupportedModelError
from tests import models_zoo as zoo
from tests.helpers import assert_same_step_copy

STRATEGIES = ("uniform", "sqrt", "greedy", "revolve", "selective", "sac")
# The blocks found from each model's own structure: a ModuleList's layers, a Sequential's
# children; a U-Net's encoder, upsampling and decoder levels in the order they run (its stem,
# a conv, a norm and a ReLU, runs no two children alike: no blocks)
BLOCKS = {
    "llama": [f"model.layers.{i}" for i in range(2)],
    "gpt2": [f"transformer.h.{i}" for i in range(4)],
    "bert": [f"bert.encoder.layer.{i}" for i in range(2)],
    "vit": [f"vit.layers.{i}" for i in range(2)],
    "unet": ["down.0", "down.1", "up.0", "dec.0", "up.1", "dec.1"],
    "resnet": [f"blocks.{i}" for i in range(4)],
}


@pytest.mark.parametrize("name", zoo.block_model_params())
def test_every_strategy_plans_applies_and_keeps_its_promise(name):
    model, x = zoo.BLOCK_MODELS[name]()
    reference = copy.deepcopy(model)
    assert [b.path for b in module_blocks(price_inplace(model, x).graph)] == BLOCKS[name]
    eager = planner.plan(model, x, 1e3, solver="none")
    budget_bytes = int(0.9 * eager.predicted_peak_bytes)
    planned = 0
    for solver in STRATEGIES:
        try:
            p = planner.plan(model, x, budget_bytes / 1e9, solver=solver)
        except planner.InfeasibleBudgetError as e:
            assert e.min_bytes > budget_bytes, solver
            p = planner.plan(model, x, (e.min_bytes + 0.5) / 1e9, solver=solver)
            assert p.predicted_peak_bytes <= e.min_bytes  # the least it stated is a plan
        planned += bool(p.regions)
        assert p.form == "inplace" and p.solver == solver
        p.apply(model)
        try:
            peak_bytes = planner.measure(model, x, repeats=1).peak_bytes
            assert peak_bytes <= p.predicted_peak_bytes <= p.budget_bytes, solver
            assert_same_step_copy(reference, model, x)
        finally:
            planner.remove(model)
    assert planned >= 5  # greedy alone may find the budget needs no region


def _resnet(n_blocks: int):
    return residual_cnn_example(batch=2, size=8, channels=4, n_blocks=n_blocks)


def _names(p: planner.Plan) -> list[tuple[str, int]]:
    return [(r.name, r.depth) for r in p.regions]


def test_uniform_sqrt_and_revolve_make_the_regions_they_are_named_for():
    model, x = _resnet(4)
    assert [b.path for b in module_blocks(price_inplace(model, x).graph)] == [
        f"blocks.{i}" for i in range(4)
    ]
    every = planner.plan(model, x, 1.0, solver="uniform")
    assert _names(every) == [(f"blocks.{i}", 0) for i in range(4)]
    # every 2nd: runs of the Sequential's children, one checkpointed call each
    second = planner.plan(model, x, 1.0, solver="uniform", k=2)
    assert _names(second) == [("blocks[0:2]", 0), ("blocks[2:4]", 0)]
    # binomial with 1 snapshot: 4 units need 3 sweeps, C(1 + 3, 1) = 4; the first region
    # holds C(1 + 2, 1) = 3 blocks and nests the same split one level down
    nested = planner.plan(model, x, 1.0, solver="revolve", snapshots=1)
    assert _names(nested) == [
        ("blocks[0:3]", 0),
        ("blocks[0:2]", 1),
        ("blocks.0", 2),
        ("blocks.1", 2),
        ("blocks.2", 1),
        ("blocks.3", 0),
    ]
    model9, x9 = _resnet(9)
    sqrt = planner.plan(model9, x9, 1.0, solver="sqrt")  # 3 segments of 3 blocks
    assert _names(sqrt) == [("blocks[0:3]", 0), ("blocks[3:6]", 0), ("blocks[6:9]", 0)]


def test_selective_and_sac_make_one_selective_region_per_block():
    model, x = _resnet(4)
    for solver in ("selective", "sac"):
        p = planner.plan(model, x, 1.0, solver=solver)
        assert [r.name for r in p.regions] == [f"blocks.{i}" for i in range(4)]
        assert {r.kind for r in p.regions} == {"selective"}
    # selective keeps the convolutions; torchtitan's list has no convolution: sac keeps none
    selective = planner.plan(model, x, 1.0, solver="selective")
    assert all(len(r.saved_nodes) == 2 for r in selective.regions)
    assert all("convolution" in op for r in selective.regions for op, _ in r.keeps)
    assert all(not r.saved_nodes for r in planner.plan(model, x, 1.0, solver="sac").regions)


@pytest.mark.slow
def test_sac_saves_every_other_mm_of_each_llama_layer():
    model, x = zoo.llama_example()
    p = planner.plan(model, x, 1.0, solver="sac")
    assert [r.name for r in p.regions] == ["model.layers.0", "model.layers.1"]
    for r in p.regions:
        mms = [i for i, op in enumerate(r.ops) if op == "aten.mm.default"]
        assert len(mms) == 7  # q, k, v, o, gate, up, down
        # the 1st, 3rd, 5th and 7th: what torchtitan's policy saves
        assert sorted(k for op, k in r.keeps) == [0, 2, 4, 6]
        assert {op for op, _ in r.keeps} == {"aten.mm.default"}


@pytest.mark.slow
def test_a_group_no_span_covers_is_wrapped_as_the_fewest_spans_that_do():
    model, x = zoo.gpt2_example()
    p = planner.plan(model, x, 1.0, solver="uniform", k=2)
    assert [r.name for r in p.regions] == [f"transformer.h.{i}" for i in range(4)]
    assert "2 group(s) of 2 blocks are no one module call or span" in p.notes
    # revolve's segments of several layers are no span either: the single layers remain
    nested = planner.plan(model, x, 1.0, solver="revolve", snapshots=1)
    assert [(r.name, r.depth) for r in nested.regions] == [
        (f"transformer.h.{i}", 0) for i in range(4)
    ]
    assert "2 segments no span covers left out" in nested.notes


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.fc(x).relu()).sum()


@pytest.mark.parametrize("solver", STRATEGIES)
def test_a_model_without_repeated_blocks_says_so_and_names_what_applies(solver):
    import torch

    with pytest.raises(UnsupportedModelError, match="repeated blocks") as e:
        planner.plan(_NoBlocks(), torch.randn(4, 8), 1.0, solver=solver)
    assert "'dp'" in str(e.value) and "'ilp'" in str(e.value)
