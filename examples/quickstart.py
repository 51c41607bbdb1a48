"""Quickstart: plan a small GPT to half its eager memory, apply the plan to the model in place,
check it trains exactly as before, and measure both.

Run from anywhere after installing planner: ``python examples/quickstart.py``.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import planner


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 1024, d: int = 256, heads: int = 4, layers: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


torch.manual_seed(0)
model = TinyGPT()
tokens = torch.randint(0, 1024, (8, 256))
example_input = (tokens, tokens.roll(-1, dims=1))  # plan at the largest shape you train
untouched = copy.deepcopy(model)

# step time: the median of three steps (the first touches fresh memory, on a shared machine
# one step is noisy)
eager = planner.measure(model, example_input, repeats=3)
p = planner.plan(model, example_input, mem_budget_gb=0.5 * eager.peak_bytes / 1e9)  # in place
print(p.summary())

p.apply(model)  # the same model object, its own blocks now checkpointed as planned
after = planner.measure(model, example_input, repeats=3)
print(
    f"measured peak: {eager.peak_bytes / 2**20:.1f} MiB eager -> "
    f"{after.peak_bytes / 2**20:.1f} MiB planned (predicted {p.predicted_peak_bytes / 2**20:.1f} "
    f"MiB, solver {p.solver}); step time {eager.step_time_s:.2f} s -> {after.step_time_s:.2f} s"
)

# Same loss and gradients as the untouched model, at the planned shape and a shorter one.
for length in (256, 100):
    batch = (tokens[:, :length], tokens.roll(-1, dims=1)[:, :length])
    losses = []
    for m in (untouched, model):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = m(*batch)
        loss.backward()
        losses.append(loss.detach())
    same = all(
        torch.equal(a.grad, b.grad) for a, b in zip(untouched.parameters(), model.parameters())
    )
    print(f"length {length}: loss equal {torch.equal(*losses)}, every gradient equal {same}")
    assert same and torch.equal(*losses)
