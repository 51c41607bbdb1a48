"""The rewrite pass: regions become checkpointed submodules; training stays bitwise the same."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from benchmarks.models import gpt_ref_small_example, residual_cnn_example
from planner.passes.capture import capture
from planner.passes.regions import Region
from planner.passes.rewrite import (
    CALL_OPS,
    CheckpointRegion,
    region_name,
    rewrite,
)
from tests.helpers import assert_same_step


def _captured(example):
    model, example_input = example
    return model, example_input, capture(model, example_input).module


@pytest.fixture(scope="module")
def gpt():
    return _captured(gpt_ref_small_example())


@pytest.fixture(scope="module")
def cnn():
    return _captured(residual_cnn_example(batch=4, size=8, n_blocks=3, channels=8))


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op in CALL_OPS]


def _path(node):
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _module_regions(gm, prefixes):
    """One region per module prefix, named by region_name."""
    taken: set[str] = set()
    regions = []
    for prefix in prefixes:
        nodes = tuple(
            n.name for n in _calls(gm) if _path(n) == prefix or _path(n).startswith(prefix + ".")
        )
        name = region_name(gm, nodes, taken)
        taken.add(name)
        regions.append(Region(name, nodes))
    return regions


def _slices(gm, seed, k):
    """k disjoint random contiguous slices of the call nodes."""
    names = [n.name for n in _calls(gm)]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(names)), 2 * k - 1)) + [len(names)]
    bounds = [0, *cuts]
    regions = []
    for j in range(k):
        # every other interval becomes a region, so plain nodes sit between regions
        start, stop = bounds[2 * j], bounds[2 * j + 1]
        regions.append(Region(f"ckpt_slice_{j}", tuple(names[start:stop])))
    return regions


def test_gpt_blocks_bitwise_and_shared(gpt):
    model, example_input, gm = gpt
    regions = _module_regions(gm, ["blocks.0", "blocks.1"])
    assert [r.name for r in regions] == ["ckpt_blocks_0", "ckpt_blocks_1"]
    new = rewrite(gm, regions)
    assert_same_step(model, new, example_input)
    assert "ckpt_blocks_0 = self.ckpt_blocks_0(" in new.code
    assert "ckpt_blocks_1 = self.ckpt_blocks_1(ckpt_blocks_0, " in new.code
    assert isinstance(new.ckpt_blocks_0, CheckpointRegion)
    # same Parameter objects, same state_dict keys, no stray submodule state
    assert [id(p) for p in new.parameters()] == [id(p) for p in model.parameters()]
    assert list(new.state_dict()) == list(model.state_dict())
    assert all(
        new.state_dict()[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items()
    )
    # the regions' own calls are gone from the parent graph
    parent = {n.name for n in new.graph.nodes}
    assert not parent & set(regions[0].nodes)


def test_gpt_attention_and_mlp_regions(gpt):
    model, example_input, gm = gpt
    prefixes = [f"blocks.{b}.{part}" for b in range(2) for part in ("attn", "mlp")]
    regions = _module_regions(gm, prefixes)
    assert [r.name for r in regions] == [
        "ckpt_blocks_0_attn",
        "ckpt_blocks_0_mlp",
        "ckpt_blocks_1_attn",
        "ckpt_blocks_1_mlp",
    ]
    new = rewrite(gm, regions)
    assert "ckpt_blocks_0_attn = self.ckpt_blocks_0_attn(" in new.code
    assert_same_step(model, new, example_input)


def test_cnn_blocks_bitwise(cnn):
    model, example_input, gm = cnn
    regions = _module_regions(gm, ["stem", "blocks.0", "blocks.1", "blocks.2"])
    assert [r.name for r in regions] == [
        "ckpt_stem",
        "ckpt_blocks_0",
        "ckpt_blocks_1",
        "ckpt_blocks_2",
    ]
    new = rewrite(gm, regions)
    assert_same_step(model, new, example_input)
    assert list(new.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("which", ["gpt", "cnn"])
def test_random_slices_bitwise(which, seed, request):
    model, example_input, gm = request.getfixturevalue(which)
    regions = _slices(gm, seed, k=1 + seed % 3)
    new = rewrite(gm, regions)
    assert all(f"self.{r.name}(" in new.code for r in regions)
    assert_same_step(model, new, example_input)


def test_whole_graph_one_region(gpt):
    model, example_input, gm = gpt
    new = rewrite(gm, [Region("ckpt_all", tuple(n.name for n in _calls(gm)))])
    assert_same_step(model, new, example_input)


def test_region_names(gpt):
    _, _, gm = gpt
    calls = _calls(gm)
    in_blocks = [n.name for n in calls if _path(n).startswith("blocks.")]
    assert region_name(gm, in_blocks, set()) == "ckpt_blocks"
    part = [n.name for n in calls if _path(n).startswith("blocks.0.attn")][:5]
    part += [n.name for n in calls if _path(n).startswith("blocks.0.attn")][5:]
    assert region_name(gm, part, set()) == "ckpt_blocks_0_attn"
    # the attention, then half of the MLP: a range over block 0's children
    attn_mlp = [n.name for n in calls if _path(n).startswith("blocks.0")]
    assert region_name(gm, attn_mlp[2:-3], set()) == "ckpt_blocks_0_attn_to_mlp"
    # block 0 and part of block 1: a sibling range
    span = [n.name for n in calls if _path(n).startswith("blocks.")][:40]
    assert region_name(gm, span, set()) == "ckpt_blocks_0_to_1"
    assert region_name(gm, in_blocks, {"ckpt_blocks"}) == "ckpt_blocks_2"
    assert region_name(gm, in_blocks, {"ckpt_blocks", "ckpt_blocks_2"}) == "ckpt_blocks_3"


def test_input_untouched_and_deterministic(gpt):
    model, example_input, gm = gpt
    before = gm.code
    regions = _module_regions(gm, ["blocks.0", "blocks.1.attn"])
    a, b = rewrite(gm, regions), rewrite(gm, regions)
    assert gm.code == before and not hasattr(gm, "ckpt_blocks_0")
    assert a.code == b.code
    assert a.ckpt_blocks_0.body.code == b.ckpt_blocks_0.body.code
    assert_same_step(model, gm, example_input)


def test_bad_regions_are_refused(gpt):
    _, _, gm = gpt
    names = [n.name for n in _calls(gm)]
    with pytest.raises(ValueError, match="contiguous"):
        rewrite(gm, [Region("ckpt_a", (names[3], names[5]))])
    with pytest.raises(ValueError, match="not in the graph"):
        rewrite(gm, [Region("ckpt_a", ("no_such_node",))])
    with pytest.raises(ValueError, match="overlap"):
        rewrite(gm, [Region("ckpt_a", tuple(names[2:6])), Region("ckpt_b", tuple(names[4:8]))])
    with pytest.raises(ValueError, match="clashes"):
        rewrite(gm, [Region("blocks", tuple(names[2:6]))])
    with pytest.raises(ValueError, match="depth"):
        rewrite(gm, [Region("ckpt_a", tuple(names[2:6]), depth=1)])


class _DictOut(nn.Module):
    """Several outputs, a non-tensor output, a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        u, v = h.chunk(2, dim=-1)
        y = torch.relu(u) * v
        return {"y": self.b(torch.cat([y, u], -1)), "n": 3, "u": u}


def test_multiple_and_dict_outputs():
    torch.manual_seed(0)
    model, x = _DictOut(), torch.randn(4, 8)
    gm = capture(model, x).module
    names = [n.name for n in _calls(gm)]
    # region ends right after chunk: its outputs are the tuple's items used later
    chunk_at = next(i for i, n in enumerate(_calls(gm)) if "chunk" in str(n.target))
    regions = [
        Region("ckpt_head", tuple(names[: chunk_at + 2])),
        Region("ckpt_tail", tuple(names[chunk_at + 3 :])),
    ]
    new = rewrite(gm, regions)
    out_a, out_b = model(x), new(x)
    assert out_b["n"] == 3 and set(out_b) == {"y", "n", "u"}
    assert torch.equal(out_a["y"], out_b["y"]) and torch.equal(out_a["u"], out_b["u"])
    assert_same_step(model, new, x)
