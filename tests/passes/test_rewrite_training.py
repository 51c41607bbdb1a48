"""Rewrite under real training: nested/selective/offload regions, BatchNorm, RNG, autocast,
in-place ops, tied weights, shapes. Every check is bitwise (float32, CPU, same seed)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from benchmarks.models import (
    GPT,
    GPT_REF_SMALL,
    ResBlock,
    gpt_ref_small_example,
    residual_cnn_example,
)
from planner.passes.capture import capture
from planner.passes.regions import Region
from planner.passes.rewrite import CALL_OPS, CheckpointRegion, region_name, rewrite
from planner.solvers.errors import UnsupportedModelError
from tests.helpers import assert_same_step


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op in CALL_OPS]


def _path(node):
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0]
    return str(node.target) if node.op == "call_module" else ""


def _regions(gm, prefixes, depth=0, kind="recompute", saved=lambda n: False):
    taken: set[str] = set()
    out = []
    for prefix in prefixes:
        nodes = [n for n in _calls(gm) if _path(n) == prefix or _path(n).startswith(prefix + ".")]
        name = region_name(gm, [n.name for n in nodes], taken)
        taken.add(name)
        keep = tuple(n.name for n in nodes if saved(n))
        out.append(Region(name, tuple(n.name for n in nodes), depth, kind, keep))
    return out


@pytest.fixture(scope="module")
def gpt():
    model, example_input = gpt_ref_small_example()
    return model, example_input, capture(model, example_input).module


BLOCKS = ["blocks.0", "blocks.1"]
PARTS = ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]


def _is_matmul(node):
    return any(k in node.name for k in ("linear", "matmul"))


# --------------------------------------------------------------------------- region kinds


def test_nested_regions_bitwise(gpt):
    model, example_input, gm = gpt
    new = rewrite(gm, _regions(gm, BLOCKS) + _regions(gm, PARTS, depth=1))
    body = new.ckpt_blocks_0.body
    assert "ckpt_blocks_0_attn = self.ckpt_blocks_0_attn(" in body.code
    assert isinstance(body.ckpt_blocks_0_mlp, CheckpointRegion)
    assert list(new.state_dict()) == list(model.state_dict())
    assert_same_step(model, new, example_input)


@pytest.mark.parametrize("kind", ["selective", "offload"])
def test_selective_and_offload_bitwise(gpt, kind):
    model, example_input, gm = gpt
    new = rewrite(gm, _regions(gm, BLOCKS, kind=kind, saved=_is_matmul))
    if kind == "selective":
        assert "save_output(torch.ops.aten.linear.default" in new.ckpt_blocks_0.body.code
    assert_same_step(model, new, example_input)


def test_mixed_nesting_bitwise(gpt):
    model, example_input, gm = gpt
    regions = (
        _regions(gm, BLOCKS)
        + _regions(gm, ["blocks.0.attn"], depth=1, kind="selective", saved=_is_matmul)
        + _regions(gm, ["blocks.1.mlp"], depth=1, kind="offload")
    )
    assert_same_step(model, rewrite(gm, regions), example_input)
    # a selective region holding a nested recompute region
    regions = _regions(gm, ["blocks.0"], kind="selective", saved=_is_matmul)
    regions = [
        Region(
            r.name,
            r.nodes,
            0,
            r.kind,
            tuple(s for s in r.saved_nodes if s in ("linear_2", "linear_3")),
        )
        for r in regions
    ] + _regions(gm, ["blocks.0.attn"], depth=1)
    assert_same_step(model, rewrite(gm, regions), example_input)


class _CountOps(TorchDispatchMode):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.count = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.startswith(self.name)
        return func(*args, **(kwargs or {}))


def _addmm_in_backward(module, example_input) -> int:
    torch.manual_seed(0)
    loss = module(*example_input)
    counter = _CountOps("addmm")
    with counter:
        loss.backward()
    return counter.count


def test_selective_keeps_what_it_saves(gpt):
    """Recompute regions rerun every linear (addmm) in backward; selective ones keep them."""
    model, example_input, gm = gpt
    plain = _addmm_in_backward(rewrite(gm, _regions(gm, BLOCKS)), example_input)
    keep = rewrite(gm, _regions(gm, BLOCKS, kind="selective", saved=_is_matmul))
    assert plain == 8  # 4 linears with bias per block, 2 blocks, recomputed once
    assert _addmm_in_backward(keep, example_input) == 0
    assert _addmm_in_backward(gm, example_input) == 0
    model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- BatchNorm


def _train_steps(module, x, steps=3):
    opt = torch.optim.SGD([p for p in module.parameters()], lr=0.1)
    for s in range(steps):
        torch.manual_seed(s)
        opt.zero_grad()
        module(x).square().mean().backward()
        opt.step()


def _assert_same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_plain_checkpoint_updates_batchnorm_twice():
    """The problem the rewrite solves: torch.utils.checkpoint alone counts the batch twice."""
    torch.manual_seed(0)
    block, x = ResBlock(4), torch.randn(2, 4, 6, 6, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert block.bn1.num_batches_tracked.item() == 2


def test_batchnorm_running_stats_once_per_step():
    torch.manual_seed(0)
    ref, x = residual_cnn_example(batch=4, size=8, n_blocks=2, channels=8)
    model = copy.deepcopy(ref)
    gm = capture(model, x).module
    new = rewrite(gm, _regions(gm, ["stem", "blocks.0", "blocks.1"]))
    assert new.ckpt_blocks_0.state_inputs  # the running stats are known as state
    _train_steps(ref, x)
    _train_steps(new, x)
    assert model.blocks[0].bn1.num_batches_tracked.item() == 3
    _assert_same_state(ref, model)


class _BNVariants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn_cma = nn.BatchNorm2d(4, momentum=None)  # cumulative moving average
        self.bn_free = nn.BatchNorm2d(4, track_running_stats=False)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = torch.relu(self.bn_free(self.bn_cma(self.conv(x))))
        return self.head(y.mean((2, 3)))


def test_batchnorm_momentum_none_and_untracked():
    torch.manual_seed(0)
    ref, x = _BNVariants(), torch.randn(4, 3, 6, 6)
    model = copy.deepcopy(ref)
    captured = capture(model, x)
    gm = captured.module
    names = [n.name for n in _calls(gm)]
    bn_at = next(i for i, n in enumerate(_calls(gm)) if "bn_free" in _path(n))
    new = rewrite(gm, [Region("ckpt_features", tuple(names[: bn_at + 2]))])
    _train_steps(ref, x)
    _train_steps(new, x)
    assert model.bn_cma.num_batches_tracked.item() == 3
    _assert_same_state(ref, model)
    assert_same_step(model, new, x)


# --------------------------------------------------------------------------- RNG, autocast


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = F.dropout(torch.relu(self.a(x)), p=0.5, training=True)
        h = h + 0.1 * torch.rand_like(h)
        return self.b(h).sum()


def test_random_ops_replay_on_recompute():
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(8, 16)
    gm = capture(model, x).module
    new = rewrite(gm, [Region("ckpt_all", tuple(n.name for n in _calls(gm)))])
    assert_same_step(model, new, x, seed=3)


def test_autocast_bf16_bitwise(gpt):
    model, example_input, gm = gpt
    new = rewrite(gm, _regions(gm, BLOCKS) + _regions(gm, PARTS, depth=1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same_step(model, new, example_input)


# --------------------------------------------------------------------------- refusals, aliasing


class _LaterInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        y = torch.sigmoid(h) * 2
        h.add_(1)
        return self.b(y) + h


class _InPlaceOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        r = torch.relu(h)
        h.mul_(2)
        return self.b(r) + h


def test_in_place_write_to_region_input_is_refused():
    x = torch.randn(3, 4)
    gm = capture(_LaterInPlace(), x).module
    names = [n.name for n in _calls(gm)]  # linear, sigmoid, mul, add_, linear_1, add
    with pytest.raises(UnsupportedModelError, match=r"node add_ .* writes in place to linear"):
        rewrite(gm, [Region("ckpt_act", (names[1], names[2]))])
    model = _InPlaceOnInput()
    gm = capture(model, x).module
    names = [n.name for n in _calls(gm)]  # linear, relu, mul_, linear_1, add
    with pytest.raises(UnsupportedModelError, match=r"mul_ .* region ckpt_act"):
        rewrite(gm, [Region("ckpt_act", tuple(names[1:3]))])
    # the same in-place op is fine when the region also produces what it writes
    assert_same_step(model, rewrite(gm, [Region("ckpt_act", tuple(names[0:3]))]), x)


def test_tied_weights():
    torch.manual_seed(0)
    model = GPT(GPT_REF_SMALL)
    model.head.weight = model.tok_emb.weight
    idx = torch.randint(0, GPT_REF_SMALL.vocab_size, (2, GPT_REF_SMALL.seq_len))
    gm = capture(model, (idx, idx)).module
    calls = _calls(gm)
    # the embedding and the head each in their own region: one Parameter, two readers
    regions = [
        Region("ckpt_embed", tuple(n.name for n in calls[:6])),
        Region("ckpt_head", tuple(n.name for n in calls[-6:])),
    ]
    new = rewrite(gm, regions)
    assert list(new.state_dict()) == list(model.state_dict())
    assert new.get_parameter("head.weight") is model.tok_emb.weight
    assert_same_step(model, new, (idx, idx))


# --------------------------------------------------------------------------- shapes


def test_other_batch_size_refused_when_captured_static(gpt):
    model, (idx, tgt), gm = gpt
    new = rewrite(gm, _regions(gm, BLOCKS))
    wider = torch.randint(0, GPT_REF_SMALL.vocab_size, (4, GPT_REF_SMALL.seq_len))
    with pytest.raises(RuntimeError, match="dynamic_shapes"):
        new(wider, wider)


def test_dynamic_batch_when_captured_dynamic():
    model, (idx, tgt) = gpt_ref_small_example()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (idx, tgt), dynamic_shapes=({0: batch}, {0: batch}))
    gm = ep.module(check_guards=False)
    new = rewrite(gm, _regions(gm, BLOCKS) + _regions(gm, PARTS, depth=1))
    wider = torch.randint(0, GPT_REF_SMALL.vocab_size, (5, GPT_REF_SMALL.seq_len))
    assert_same_step(model, new, (wider, wider))
    assert_same_step(model, new, (idx, tgt))
