"""Per-rank checkpoint plans under FSDP2, in torchtitan's order: plan -> apply -> (compile) ->
fully_shard per block and root.

Each rank plans for what it will hold: its shard of the parameters and gradients, the unsharded
parameters of the blocks in flight (again while a block recomputes in backward), FSDP2's
all-gather and reduce-scatter buffers, and the activations of its own micro-batch. Then it
applies the plan to its model, shards it with the same units the plan assumed, trains a few
steps and measures one.

Run on CPU (gloo): ``torchrun --nproc-per-node 2 examples/fsdp.py``
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import planner
from planner.fsdp import shard

MiB = 2**20


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, -1).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs (and FSDPConfig's backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyGPT()
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own micro-batch
    batch = tuple(torch.randint(0, 256, (4, 128), generator=g) for _ in range(2))

    # 1. plan one rank: FSDP2 units are each child of model.blocks, and the root
    config = planner.FSDPConfig(world_size=world, backend="gloo")
    p = planner.plan(model, batch, mem_budget_gb=0.0045, fsdp=config)  # in place
    # 2. apply in place; 3. (optional) block.compile() here; 4. shard with the plan's units
    p.apply(model)
    shard(model, config)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    # the allocator's events see FSDP2's resized parameter storages (method="profiler")
    m = planner.measure(model, batch, method="profiler")
    print(
        f"rank {rank}: loss {loss.item():.3f}, {len(p.regions)} regions, per-rank budget "
        f"{p.budget_bytes / MiB:.2f} MiB, predicted {p.predicted_peak_bytes / MiB:.2f} MiB "
        f"(no plan {p.baseline_peak_bytes / MiB:.2f} MiB), measured {m.peak_bytes / MiB:.2f} MiB",
        flush=True,
    )
    dist.barrier()  # leave together: tearing gloo down mid-collective aborts a peer
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
