"""The budget is a promise (issue 21): plans that measured over their prediction, and over the
budget, before their cause was found.

- A tiny Hugging Face Llama planned in place at 31% and 35% of its eager peak: its nested
  regions (``layers.0`` holding ``layers.0.self_attn``) measured 1,798,280 B against
  1,652,232 B predicted (1.07x the budget) and 1,942,472 B against 1,876,424 B (1.02x).
  The cause: Hugging Face passes a decoder layer's tensors to its attention as keywords
  (``self_attn(hidden_states=...)``), and ``torch.utils.checkpoint`` holds keyword arguments in
  its frame (the recomputation's closure) instead of saving them through its parent's hooks, so
  a nested region's keyword tensors lived from its forward to the end of its backward.
  Applied plans now pass every tensor argument positionally (``planner/inplace.py``).
- Every checkpointed decoder layer measured 512 B over: it is passed ``position_ids`` that no
  op in it reads, which the checkpoint saves all the same (simulate's Rule 2). The eager
  pricing now counts a storage passed to a module call as read by it (``passes/eager.py``).
- Bloom planned at half its eager peak measured 8,250,248 B against 7,412,104 B predicted: its
  attention returns the attention probabilities beside its output and the block loop holds
  them until the next block returns, which the pricing run never saw (autograd saved them
  too). Python's lifetimes of saved storages now come from a forward under ``no_grad``.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from torch import nn

import planner
from planner.devices import device_profile
from planner.graph_form import price
from planner.inplace_form import build_inplace_plan, price_inplace
from planner.solvers.costgraph import Region, Schedule
from planner.solvers.registry import solve
from planner.solvers.simulate import simulate

os.environ["HF_HUB_OFFLINE"] = "1"  # tiny configs only; a download would be a bug

WIDTH, ROWS = 64, 256  # one activation: 64 KiB


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, *, hidden: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(hidden)) * scale


class Layer(nn.Module):
    """Calls its child with keyword tensors made inside the layer, and is passed a tensor it
    never reads (``unused``), as Hugging Face decoder layers are."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = Attn()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, unused: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        return x + self.lin(torch.relu(self.attn(hidden=h, scale=torch.sigmoid(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[0] * 4)  # passed to each layer, read by none
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, unused=ids)
        return h


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize(
    "paths",
    [
        (("layers.1", 0), ("layers.1.attn", 1)),  # keyword tensors of a nested region
        (("layers.0", 0), ("layers.2", 0)),  # a tensor passed, never read
    ],
)
def test_keyword_and_unread_arguments_are_priced_as_measured(paths) -> None:
    """Before the fix the nest measured 1,022,088 B against 916,616 B predicted (the keyword
    tensors held by the nested checkpoint's frame), the two layers 891,016 B against 882,824 B
    (``ids``, 8,192 B, saved by the checkpoints though no op reads it)."""
    x = torch.randn(ROWS, WIDTH)
    eg = price_inplace(_net(), x, device=device_profile("cpu"))
    span = {path: s for s, path in eg.spans.items()}
    schedule = Schedule(tuple(Region(*span[p], depth=d) for p, d in paths))
    model = _net()
    p = build_inplace_plan(model, eg, schedule, 10**9)
    p.apply(model)
    measured = planner.measure(model, x).peak_bytes
    assert measured == p.predicted_peak_bytes
    # same gradients as the model without regions
    ref = _net()
    ref(x).sum().backward()
    model.zero_grad()
    model(x).sum().backward()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


# --- the tiny Llama of the issue ---------------------------------------------------------------


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).train()


@pytest.fixture(scope="module")
def llama_priced():
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (4, 64))
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[1, 48:] = 0  # one padded row: the attention mask is materialised
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    # roofline prices (the "cpu" profile): the same plans on every run
    eg = price_inplace(_llama(), batch, device=device_profile("cpu"))
    return eg, batch


@pytest.mark.slow
@pytest.mark.parametrize(
    ("share", "objective"), [(0.31, "time"), (0.31, "flops"), (0.35, "time"), (0.35, "flops")]
)
def test_llama_nested_plans_keep_their_budget(llama_priced, share, objective) -> None:
    """Before: 1,798,280 B measured at 31% (1,652,232 predicted, budget 1,681,244) and
    1,942,472 B at 35% (1,876,424 predicted, budget 1,898,178)."""
    eg, batch = llama_priced
    budget_bytes = int(share * simulate(eg.graph, Schedule()).peak_bytes)
    schedule = solve(eg.graph, budget_bytes, "auto", objective)
    model = _llama()
    p = build_inplace_plan(model, eg, schedule, budget_bytes)
    assert any(r.depth > 0 for r in p.module_regions), "the case is about nested regions"
    p.apply(model)
    measured = planner.measure(model, batch).peak_bytes
    assert measured == p.predicted_peak_bytes
    assert measured <= budget_bytes


@pytest.mark.slow
def test_fit_batch_plan_keeps_the_cap() -> None:
    """fit_batch at a 12 MB cap on the Llama: its batch-32 plan (nested regions) predicted
    11,738,888 B and measured 13,312,264 B before (the issue's figures, on op timings:
    11,796,232 and 13,329,160)."""

    def make_input(batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(batch_size)
        ids = torch.randint(3, 64, (batch_size, 64), generator=g)
        mask = torch.ones(batch_size, 64, dtype=torch.long)
        mask[min(1, batch_size - 1), 48:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}

    fit = planner.fit_batch(_llama(), make_input, 0.012, [32], device="cpu", form="inplace")
    (row,) = fit.rows
    assert row.fits
    p = fit.plans[32]
    assert any(r.depth > 0 for r in p.module_regions)
    model = _llama()
    p.apply(model)
    measured = planner.measure(model, make_input(32)).peak_bytes
    assert measured == p.predicted_peak_bytes <= fit.cap_bytes


# --- Rule 4 ------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, 8 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))  # the last op that saves anything
        return h[:, :WIDTH] * 2 + 0  # a slice, a scale, an add: nothing saved


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.blk, self.b = nn.Linear(WIDTH, WIDTH), Block(), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.blk(self.a(x)))


def _toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


def test_trailing_backward_before_the_recomputation_is_priced_as_measured() -> None:
    """simulate's Rule 4: the slice's backward (a 1 MiB gradient) runs before ``blk``
    recomputes, since nothing after tanh unpacks a saved tensor. Before: 3,298,504 B predicted,
    3,303,560 B measured."""
    x = torch.randn(2 * ROWS, WIDTH)
    eg = price_inplace(_toy(), x, device=device_profile("cpu"))
    (blk,) = (s for s, path in eg.spans.items() if path == "blk")
    model = _toy()
    p = build_inplace_plan(model, eg, Schedule((Region(*blk),)), 10**9)
    p.apply(model)
    measured = planner.measure(model, x)
    assert measured.peak_bytes == p.predicted_peak_bytes
    events = [e for e, _ in p.simulation.timeline]
    assert events.index("bwd:blk:slice:0") < events.index("recompute:blk:tanh:0")


# --- Rule 2: a checkpoint's frame lives only while something it saved is still to unpack ----


class NoSave(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, h], dim=1) + 1  # cat and add save nothing for backward


class LeadNoSave(nn.Module):
    """cumsum saves nothing and its backward is the region's heaviest; the linear saves."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * WIDTH, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cumsum(h, 1))


class Outer(nn.Module):
    """Saves nothing of its own; ``inner`` saves after a cumsum."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LeadNoSave()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner(h * 2)


class FrameToy(nn.Module):
    def __init__(self, blk: nn.Module, width_out: int) -> None:
        super().__init__()
        self.a, self.blk = nn.Linear(WIDTH, 2 * WIDTH), blk
        self.b = nn.Linear(width_out, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.blk(self.a(x)))


FRAME_TOYS = {
    "no_save": (NoSave, 4 * WIDTH),
    "lead": (LeadNoSave, 4),
    "nested_lead": (Outer, 4),
}


def _frame_toy(name: str) -> FrameToy:
    torch.manual_seed(0)
    cls, width_out = FRAME_TOYS[name]
    return FrameToy(cls(), width_out)


@pytest.mark.parametrize(
    ("name", "paths"),
    [
        ("no_save", (("blk", 0),)),
        ("lead", (("blk", 0),)),
        ("nested_lead", (("blk", 0), ("blk.inner", 1))),
    ],
)
def test_a_checkpoint_frees_its_arguments_with_its_frame(name, paths) -> None:
    """simulate's Rule 2: ``torch.utils.checkpoint``'s frame (the region's arguments, its RNG
    stash) is referenced only by the unpack hooks of what the region saved, so it dies at the
    backward of the region's first saving node, or with its forward when nothing in it saves.
    Before, simulate held the arguments (``a``'s 128 KiB output) to the region's backward's
    end: no_save 721,160 B predicted, 660,416 B measured; lead 663,768 B against 527,640 B
    (the cumsum's backward, after the linear's, is the peak); nested_lead 668,824 B against
    527,640 B (``blk`` saves nothing of its own: its frame goes with ``blk.inner``'s)."""
    x = torch.randn(ROWS, WIDTH)
    eg = price_inplace(_frame_toy(name), x, device=device_profile("cpu"))
    span = {path: s for s, path in eg.spans.items()}
    schedule = Schedule(tuple(Region(*span[p], depth=d) for p, d in paths))
    model = _frame_toy(name)
    p = build_inplace_plan(model, eg, schedule, 10**9)
    p.apply(model)
    assert planner.measure(model, x).peak_bytes == p.predicted_peak_bytes


def test_graph_regions_that_save_nothing_hold_no_arguments() -> None:
    """The graph form, the same rule: a region over the cat and the add. Before: 721,160 B
    predicted, 660,416 B measured (as the conformance sweep's GPT-NeoX point at 76% of eager:
    greedy's plan, five such regions, 831,624 B predicted, 732,808 B measured)."""
    x = torch.randn(ROWS, WIDTH)
    priced = price(_frame_toy("no_save"), x, device=device_profile("cpu"))
    names = [nd.name for nd in priced.graph.nodes]
    (cat,) = (i for i, n in enumerate(names) if "cat" in n)
    (add,) = (i for i, n in enumerate(names) if "add" in n and i > cat)
    assert not any(priced.graph.nodes[i].saves_for_backward for i in range(cat, add + 1))
    p = priced.build(Schedule((Region(cat, add + 1),)), 10**9)
    assert planner.measure(p.module, x).peak_bytes == p.predicted_peak_bytes


# --- Rule 1: a saved storage that Python holds past the region (Bloom's attention probs) -----


class HeldBlock(nn.Module):
    """Returns its softmax beside its output, as Bloom's attention returns its probabilities;
    softmax and the linear after it save them, so without checkpointing autograd holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(WIDTH, 8 * WIDTH)
        self.out = nn.Linear(8 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.score(x), dim=-1)
        x = x * torch.ones(ROWS, 32 * WIDTH).sum(-1, keepdim=True)  # a scratch, dropped at once
        return x + self.out(probs), probs


class HeldNet(nn.Module):
    """Holds each block's whole output until the next block returns (BloomModel's loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HeldBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for blk in self.blocks:
            outputs = blk(h)
            h = outputs[0]
        return h


def _held_net() -> HeldNet:
    torch.manual_seed(0)
    return HeldNet()


@pytest.mark.parametrize("paths", [("blocks.1",), ("blocks.0", "blocks.1")])
def test_saved_storage_python_holds_past_its_region_is_priced_as_measured(paths) -> None:
    """simulate's Rule 1 (``Tensor.freed_after``) for storages autograd also saves: the pricing
    run never saw Python drop them, so a region's copy was priced dead at its last reader.
    Before: blocks.1 3,552,392 B predicted, 3,807,168 B measured; blocks.0 and blocks.1
    3,227,016 B against 3,287,936 B (the recomputation holds them to its end too)."""
    x = torch.randn(ROWS, WIDTH)
    eg = price_inplace(_held_net(), x, device=device_profile("cpu"))
    probs = [t for t in eg.graph.tensors if "_softmax" in t.name]
    assert len(probs) == 3 and all(t.saved_by for t in probs)
    assert all(t.freed_after > max((t.producer, *t.users)) for t in probs)
    span = {path: s for s, path in eg.spans.items()}
    model = _held_net()
    p = build_inplace_plan(model, eg, Schedule(tuple(Region(*span[q]) for q in paths)), 10**9)
    p.apply(model)
    assert planner.measure(model, x).peak_bytes == p.predicted_peak_bytes


class GradOnly(HeldNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("this model runs only with gradients")
        return super().forward(x)


def test_a_forward_that_fails_without_grad_is_planned_and_says_so() -> None:
    """The lifetimes come from a second forward under ``no_grad``; a model that refuses it is
    priced as before (its held storages dead at their last reader), and the summary says so."""
    torch.manual_seed(0)
    p = planner.plan(GradOnly(), torch.randn(ROWS, WIDTH), 10**9 / 1e9, device="cpu")
    assert p.graph.meta["python_lifetimes"].startswith("unknown")
    assert "this model runs only with gradients" in p.summary()
    probs = [t for t in p.graph.tensors if "_softmax" in t.name]
    assert len(probs) == 3 and all(t.freed_after == -1 for t in probs)


# --- BatchNorm's saved running statistics in a recomputation --------------------------------


class BNNet(nn.Module):
    """conv -> BatchNorm -> in-place ReLU, then a block (``b``) that starts with BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        )
        self.b = nn.Sequential(
            nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Conv2d(8, 16, 3, padding=1, bias=False)
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)).mean(dim=(2, 3)))


def _bn_net() -> BNNet:
    torch.manual_seed(0)
    return BNNet().train()


def test_batchnorm_saved_statistics_copy_lives_to_its_backward() -> None:
    """simulate's Rule 9: ``b``'s recomputation runs BatchNorm on fresh copies of the running
    statistics, and ``native_batch_norm`` saves them for its backward, so they outlive the
    recomputation (to BatchNorm's backward). Before: 64 B (2 x 8 float32) under the measured
    peak at the conv's backward (conformance CNN: 287,232 B predicted, 287,296 B measured)."""
    x = torch.randn(2, 3, 16, 16)
    eg = price_inplace(_bn_net(), x, device=device_profile("cpu"))
    bn = next(nd for nd in eg.graph.nodes if nd.name.startswith("b.0:native_batch_norm"))
    assert bn.state_saved_bytes == 2 * 8 * 4  # running_mean, running_var (not the counter)
    assert bn.state_bytes == bn.state_saved_bytes
    (blk,) = (s for s, path in eg.spans.items() if path == "b")
    schedule = Schedule((Region(*blk),))
    model = _bn_net()
    p = build_inplace_plan(model, eg, schedule, 10**9)
    p.apply(model)
    measured = planner.measure(model, x).peak_bytes
    assert measured == p.predicted_peak_bytes
    nodes = tuple(replace(nd, state_saved_bytes=0) for nd in eg.graph.nodes)
    old = simulate(replace(eg.graph, nodes=nodes), schedule).peak_bytes
    assert measured - old == bn.state_saved_bytes  # the copies count at the peak
