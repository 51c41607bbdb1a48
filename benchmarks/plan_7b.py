"""Plan a Llama-7B-shaped model on a laptop: fake tensors / the meta device, no real allocation.

Llama-7B shape: 32 layers, d_model 4096, 32 heads, SwiGLU MLP 11008, RMSNorm, rotary
embeddings, vocabulary 32000; sequence 4096, batch 1, bf16, eager (explicit softmax) attention.
The model is built on the meta device, so its 6.7 B parameters take no memory; ``plan()``
captures and prices it on fake tensors. Prints the wall time and peak resident memory of the
whole ``plan()``, the predicted peak for no checkpointing, every layer, and the best solver at
40 GB and 24 GB, and compares the per-layer activation bytes with Korthikanti et al. (2022),
s·b·h·(34 + 5·a·s/h) bytes per layer in half precision.

Run: ``python -m benchmarks.plan_7b`` (``--layers 2`` for a quick look).

``--batch-sweep`` instead draws, for micro-batches 1, 2, 4, ... 64, the predicted peak of no
checkpointing, checkpointing every layer and planner's plan under an 80 GB cap (``--cap-gb``),
and the predicted tokens/s of each on the H100 profile (``planner.devices``), as a PNG
(``--png``) and a printed table. Every figure is a prediction (fake tensors, roofline), not a
measurement.
"""

from __future__ import annotations

import argparse
import math
import resource
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 32
    d_model: int = 4096
    n_head: int = 32
    d_ff: int = 11008
    vocab_size: int = 32000
    seq_len: int = 4096
    batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    # "eager": explicit fp32 softmax over S x S scores (Hugging Face's eager Llama); "sdpa": a
    # causal F.scaled_dot_product_attention in its own module (``self_attn.core``), priced as
    # the flash kernel (what long sequences need: no S x S tensor).
    attention: str = "eager"


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V, causal, in one fused kernel (a module of its own, so that a
    plan applied in place may checkpoint or offload it alone, as Megatron's core attention)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.device.type == "meta":
            # What F.scaled_dot_product_attention runs on an H100: the meta device has no
            # kernel choice of its own (it would take the math path, S x S scores and all).
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.core = CoreAttention() if cfg.attention == "sdpa" else None
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        hd = d // self.n_head
        q, k, v = (
            p(x).view(b, s, self.n_head, hd).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.core is not None:
            return self.o_proj(self.core(q, k, v).transpose(1, 2).reshape(b, s, d))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        hd = cfg.d_model // cfg.n_head
        inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(cfg.seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().to(cfg.dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(cfg.dtype), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def llama_example(cfg: LlamaConfig = LlamaConfig(), device: str = "meta"):
    with torch.device(device):
        model = Llama(cfg).to(cfg.dtype)
        idx = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long)
        targets = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long)
    return model, (idx, targets)


def korthikanti_layer_bytes(cfg: LlamaConfig) -> int:
    """s·b·h·(34 + 5·a·s/h): activations one GPT layer keeps, half precision, no dropout
    saving reductions (Korthikanti et al. 2022, eq. 1)."""
    s, b, h, a = cfg.seq_len, cfg.batch, cfg.d_model, cfg.n_head
    return int(s * b * h * (34 + 5 * a * s / h))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def layer_saved_bytes(graph, layer: str) -> tuple[int, int]:
    """Bytes one layer keeps for backward without checkpointing: (all, attention S x S part)."""
    total = quadratic = 0
    for t in graph.tensors:
        node = graph.nodes[t.producer]
        inside = node.module_path == layer or node.module_path.startswith(layer + ".")
        if inside and t.saved_by:
            total += t.size_bytes
            if "attention" in node.tags:
                quadratic += t.size_bytes
    return total, quadratic


def llama_for_batch(batch_size: int, layers: int = 32, seq: int = 4096):
    """The Llama-7B shape on the meta device at a micro-batch size (a fit-batch FACTORY)."""
    return llama_example(LlamaConfig(n_layer=layers, seq_len=seq, batch=batch_size))


@dataclass(frozen=True)
class SweepRow:
    batch: int
    step: str  # "no checkpointing" | "every layer" | "planner"
    peak_bytes: int | None  # None: no plan fits the cap
    step_time_s: float | None
    tokens_per_s: float | None
    solver: str = ""


def batch_sweep(
    cfg: LlamaConfig, batches: list[int], cap_bytes: float, device: str = "h100", solver="dp"
) -> list[SweepRow]:
    """Predicted peak and tokens/s per micro-batch: no checkpointing, every layer, planner."""
    from planner.planning import price
    from planner.solvers.costgraph import Schedule
    from planner.solvers.errors import InfeasibleBudgetError
    from planner.solvers.registry import get_solver
    from planner.solvers.simulate import simulate

    rows = []
    for b in batches:
        t0 = time.perf_counter()
        model, example = llama_example(replace(cfg, batch=b))
        priced = price(model, example, device=device)
        graph, tokens = priced.graph, b * cfg.seq_len
        for step, schedule in (
            ("no checkpointing", Schedule()),
            ("every layer", get_solver("uniform")(graph, math.inf)),
        ):
            sim = simulate(graph, schedule)
            rows.append(
                SweepRow(b, step, sim.peak_bytes, sim.step_time_s, tokens / sim.step_time_s)
            )
        try:
            p = priced.plan(round(cap_bytes), solver)
            rows.append(
                SweepRow(
                    b,
                    "planner",
                    p.predicted_peak_bytes,
                    p.predicted_step_time_s,
                    tokens / p.predicted_step_time_s,
                    p.solver,
                )
            )
        except InfeasibleBudgetError:
            rows.append(SweepRow(b, "planner", None, None, None, solver))
        print(f"  batch {b}: priced and planned in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def plot_sweep(rows: list[SweepRow], cap_bytes: float, device: str, title: str):
    """Predicted peak (left) and tokens/s where the step fits the cap (right) against batch."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    memory, speed = fig.subplots(1, 2)
    for k, step in enumerate(("no checkpointing", "every layer", "planner")):
        mine = [r for r in rows if r.step == step and r.peak_bytes is not None]
        fits = [r for r in mine if r.peak_bytes <= cap_bytes]
        style = dict(color=f"C{k}", marker="o", label=step)
        memory.plot([r.batch for r in mine], [r.peak_bytes / 1e9 for r in mine], **style)
        speed.plot([r.batch for r in fits], [r.tokens_per_s for r in fits], **style)
    memory.axhline(cap_bytes / 1e9, color="red", lw=1, ls="--", label="cap")
    memory.set_yscale("log")  # no checkpointing at batch 64 dwarfs the cap
    memory.set_ylabel("predicted peak of one step (GB)")
    speed.set_ylabel(f"predicted tokens/s on {device} (fits the cap)")
    for ax in (memory, speed):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch size")
        ax.legend(fontsize=8)
    fig.suptitle(title + " (predictions)")
    return fig


def sweep_main(args: argparse.Namespace) -> None:
    cfg = LlamaConfig(n_layer=args.layers, seq_len=args.seq)
    batches = [int(b) for b in args.batches.split(",")]
    cap_bytes = args.cap_gb * 1e9
    print(
        f"Llama-7B shape ({cfg.n_layer} layers, seq {cfg.seq_len}, bf16, meta device), "
        f"cap {args.cap_gb:g} GB, times on the {args.device} profile; all figures predicted"
    )
    rows = batch_sweep(cfg, batches, cap_bytes, args.device, args.solver)
    print("\n| micro-batch | step | predicted peak | fits | predicted step time | tokens/s |")
    print("|---:|---|---:|---|---:|---:|")
    for r in rows:
        if r.peak_bytes is None:
            print(f"| {r.batch} | {r.step} | no plan fits {args.cap_gb:g} GB | no | - | - |")
            continue
        fits = "yes" if r.peak_bytes <= cap_bytes else "no"
        name = f"{r.step} ({r.solver})" if r.solver else r.step
        print(
            f"| {r.batch} | {name} | {r.peak_bytes / 1e9:.1f} GB | {fits} "
            f"| {r.step_time_s:.2f} s | {r.tokens_per_s:,.0f} |"
        )
    best = max(
        (r for r in rows if r.peak_bytes is not None and r.peak_bytes <= cap_bytes),
        key=lambda r: r.tokens_per_s or 0.0,
        default=None,
    )
    if best is not None:
        print(
            f"\nmost tokens/s under {args.cap_gb:g} GB: micro-batch {best.batch}, {best.step}, "
            f"{best.tokens_per_s:,.0f} tokens/s (predicted)"
        )
    title = f"Llama-7B shape, seq {cfg.seq_len}, bf16, cap {args.cap_gb:g} GB"
    plot_sweep(rows, cap_bytes, args.device, title).savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


# Llama-2-70B's dimensions with full multi-head attention (no grouped-query K/V: 78 B
# parameters where the real model has 69 B; its K/V projections are 8x wider).
LLAMA_70B = LlamaConfig(n_layer=80, d_model=8192, n_head=64, d_ff=28672)


@dataclass(frozen=True)
class FSDPRow:
    shape: str
    seq: int
    step: str  # "no checkpointing" | "every layer" | "planner, no offload" | "planner + offload"
    peak_bytes: int | None  # one rank's predicted peak above its baseline; None: nothing fits
    step_time_s: float | None
    tokens_per_s: float | None  # one rank's
    offload_bytes: int = 0
    regions: int = 0
    note: str = ""


def fsdp_rows(
    shape: str,
    cfg: LlamaConfig,
    world: int,
    device: str,
    cap_bytes: float,
    time_limit_s: float = 120.0,
):
    """One rank of ``world`` under FSDP2 (per-layer units, bf16, flash attention), priced on the
    meta device with ``device``'s profile: no checkpointing, every layer, planner without and
    with offload, each within ``cap_bytes`` less the rank's baseline. Returns (budget in
    bytes, rows, the plan with offload or None)."""
    from planner.devices import device_profile
    from planner.fsdp import FSDPConfig
    from planner.inplace_form import build_inplace_plan, price_inplace
    from planner.solvers.auto import AutoOptions
    from planner.solvers.costgraph import Region, Schedule
    from planner.solvers.dp_levels import DPOptions
    from planner.solvers.errors import InfeasibleBudgetError
    from planner.solvers.ilp import ILPOptions
    from planner.solvers.registry import get_solver
    from planner.solvers.simulate import simulate

    model, example = llama_example(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    # The pre-step baseline of one rank: its bf16 parameter shard and AdamW's two moments
    # (same dtype). The budget is what the step may add on top of it.
    baseline_bytes = 3 * n_params * cfg.dtype.itemsize // world
    budget = cap_bytes - baseline_bytes
    eg = price_inplace(model, example, device=device_profile(device), fsdp=FSDPConfig(world))
    graph, tokens = eg.graph, cfg.batch * cfg.seq_len
    every = Schedule(
        tuple(Region(*eg.module_spans[f"layers.{i}"]) for i in range(cfg.n_layer)), "uniform"
    )
    rows, with_offload = [], None

    def row(step: str, schedule: Schedule, note: str = "") -> FSDPRow:
        sim = simulate(graph, schedule)
        return FSDPRow(
            shape,
            cfg.seq_len,
            step,
            sim.peak_bytes,
            sim.step_time_s,
            tokens / sim.step_time_s,
            sim.offload_bytes,
            len(schedule.regions),
            note,
        )

    rows += [row("no checkpointing", Schedule()), row("every layer", every)]
    for step, offload in (("planner, no offload", False), ("planner + offload", None)):
        options = AutoOptions(
            time_limit_s=time_limit_s,
            dp=DPOptions(max_depth=2, offload=offload),
            ilp=ILPOptions(offload=offload),  # auto runs it on graphs of up to ILP_MAX_NODES nodes
        )
        try:
            schedule = get_solver("auto")(graph, budget, options)
        except InfeasibleBudgetError:  # its stated least is dp's grid's, not shown
            rows.append(FSDPRow(shape, cfg.seq_len, step, None, None, None))
            continue
        rows.append(row(step, schedule, schedule.solver))
        if offload is None:
            with_offload = build_inplace_plan(model, eg, schedule, round(budget))
    return budget, baseline_bytes, rows, with_offload


def fsdp_main(args: argparse.Namespace) -> None:
    world, cap_bytes = args.fsdp, args.cap_gb * 1e9
    shapes = {"7B": LlamaConfig(), "70B": LLAMA_70B}
    seqs = [int(s) for s in args.seqs.split(",")]
    print(
        f"FSDP2 on {world} x {args.cap_gb:g} GB ({args.device} profile), one rank's figures; "
        f"Llama shapes, bf16, flash attention, batch 1 per rank, meta device. All figures are "
        f"predictions (fake tensors, roofline times, FSDP2's buffers; communication time not "
        f"counted)."
    )
    table, reasons = [], []
    for shape in args.shapes.split(","):
        for seq in seqs:
            t0 = time.perf_counter()
            cfg = replace(shapes[shape], seq_len=seq, attention="sdpa")
            if args.layers:
                cfg = replace(cfg, n_layer=args.layers)
            budget, baseline, rows, plan = fsdp_rows(
                shape, cfg, world, args.device, cap_bytes, args.time_limit_s
            )
            print(
                f"  {shape} ({cfg.n_layer} layers) at {seq}: per-rank baseline "
                f"{baseline / 1e9:.1f} GB, step budget {budget / 1e9:.1f} GB; priced and planned "
                f"in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
            table += [(budget, r) for r in rows]
            if plan is not None and plan.simulation.offload_bytes:
                why = [ln for ln in plan.summary().splitlines() if "offloaded" in ln]
                reasons.append((shape, seq, why))
    print(
        "\n| shape | seq | step | per-rank peak | fits | step time | tokens/s per rank "
        "| offloaded | regions |"
    )
    print("|---|---:|---|---:|---|---:|---:|---:|---:|")
    for budget, r in table:
        if r.peak_bytes is None:
            print(f"| {r.shape} | {r.seq} | {r.step} | no plan found | no | - | - | - | - |")
            continue
        fits = "yes" if r.peak_bytes <= budget else "no"
        name = f"{r.step} ({r.note})" if r.note else r.step
        print(
            f"| {r.shape} | {r.seq} | {name} | {r.peak_bytes / 1e9:.1f} GB | {fits} "
            f"| {r.step_time_s:.2f} s | {r.tokens_per_s:,.0f} | {r.offload_bytes / 1e9:.2f} GB "
            f"| {r.regions} |"
        )
    for shape, seq, why in reasons:
        print(f"\n{shape} at {seq}, why offload (planner's summary):")
        alike: dict[str, list[str]] = {}  # repeated layers give the same reason
        for line in why:
            name, _, reason = line.strip().partition(" offloaded ")
            alike.setdefault(reason, []).append(name)
        for reason, names in alike.items():
            more = f" (and {len(names) - 1} more alike)" if len(names) > 1 else ""
            print(f"  {names[0]} offloaded {reason}{more}" if reason else f"  {names[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--solvers", default="auto,greedy,uniform,sqrt", help="candidates for 'best'"
    )
    parser.add_argument("--batch-sweep", action="store_true", help="the micro-batch sweep")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64", help="for --batch-sweep")
    parser.add_argument("--cap-gb", type=float, default=80.0, help="for --batch-sweep")
    parser.add_argument("--device", default="h100", help="profile for --batch-sweep")
    parser.add_argument("--solver", default="dp", help="planner's solver for --batch-sweep")
    parser.add_argument("--png", default="plan_7b_batch_sweep.png", help="for --batch-sweep")
    parser.add_argument("--fsdp", type=int, default=0, help="per-rank plans for N ranks")
    parser.add_argument("--shapes", default="7B,70B", help="for --fsdp")
    parser.add_argument("--seqs", default="4096,32768", help="for --fsdp")
    parser.add_argument("--time-limit-s", type=float, default=120.0, help="for --fsdp")
    args = parser.parse_args()
    if args.fsdp:
        args.layers = args.layers if args.layers != 32 else 0  # 0: each shape's own depth
        fsdp_main(args)
        return
    if args.batch_sweep:
        sweep_main(args)
        return
    cfg = LlamaConfig(n_layer=args.layers, seq_len=args.seq)

    import planner
    from planner.solvers.costgraph import Schedule
    from planner.solvers.errors import InfeasibleBudgetError
    from planner.solvers.registry import get_solver
    from planner.solvers.simulate import simulate

    t0 = time.perf_counter()
    model, example = llama_example(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    # What a user runs: the whole pipeline (capture, estimate, default solver, rewrite) at 24 GB.
    p = planner.plan(model, example, mem_budget_gb=24, form="graph")
    plan_s = time.perf_counter() - t0
    graph = p.graph
    print(
        f"Llama-7B shape: {n_params / 1e9:.2f} B parameters, {cfg.n_layer} layers, "
        f"seq {cfg.seq_len}, batch {cfg.batch}, {str(cfg.dtype).removeprefix('torch.')}, "
        f"{len(graph.nodes)} graph nodes"
    )
    print(
        f"plan(model, example, mem_budget_gb=24) on the meta device ({p.solver}, "
        f"{len(p.regions)} regions): {plan_s:.1f} s wall, peak RSS "
        f"{peak_rss_bytes() / 2**30:.2f} GiB (limits: 60 s, 4 GB)"
    )
    eager = simulate(graph, Schedule())
    every = simulate(graph, get_solver("uniform")(graph, math.inf))
    print(f"\npredicted peak, no checkpointing: {eager.peak_bytes / 2**30:.1f} GiB")
    print(
        f"predicted peak, every layer:      {every.peak_bytes / 2**30:.1f} GiB "
        f"(+{every.recompute_flops / graph.step_flops:.1%} FLOPs)"
    )
    for budget_gb in (40, 24):
        best = None
        for name in args.solvers.split(","):
            t1 = time.perf_counter()
            try:
                sched = get_solver(name)(graph, budget_gb * 1e9)
            except InfeasibleBudgetError as e:
                print(f"  {name} @ {budget_gb} GB: infeasible (least {e.min_bytes / 1e9:.1f} GB)")
                continue
            sim = simulate(graph, sched)
            solve_s = time.perf_counter() - t1
            if best is None or sim.recompute_time_s < best[1].recompute_time_s:
                best = (name, sim, solve_s)
        if best:
            name, sim, solve_s = best
            print(
                f"best @ {budget_gb} GB: {name}, predicted peak {sim.peak_bytes / 1e9:.1f} GB "
                f"({sim.peak_bytes / 2**30:.1f} GiB), +{sim.recompute_flops / graph.step_flops:.1%}"
                f" FLOPs, solved in {solve_s:.1f} s"
            )

    mid = f"layers.{cfg.n_layer // 2}"
    total, quadratic = layer_saved_bytes(graph, mid)
    sbh = cfg.seq_len * cfg.batch * cfg.d_model
    formula = korthikanti_layer_bytes(cfg)
    print(
        f"\nper-layer activations kept for backward ({mid}): {total / 2**30:.2f} GiB "
        f"= sbh x {total / sbh:.1f} ({quadratic / sbh:.1f} of it S x S attention)"
    )
    print(
        f"Korthikanti et al. 2022, sbh(34 + 5as/h): {formula / 2**30:.2f} GiB "
        f"= sbh x {formula / sbh:.1f} (34 + {5 * cfg.n_head * cfg.seq_len / cfg.d_model:.0f})"
    )
    print(EXPLANATION)


EXPLANATION = """
Why they differ (the formula is for GPT-3-style layers in pure half precision):
- S x S terms: the formula counts scores 2as^2b + softmax 2as^2b + dropout mask as^2b = 5as^2b.
  This Llama computes softmax in fp32 (as Hugging Face's eager Llama does) and saves that fp32
  output (4as^2b) plus its bf16 cast for the matmul with V (2as^2b); no attention dropout, and
  the causal mask is one bool S x S shared by all heads. 6as^2b instead of 5as^2b.
- Linear terms: RMSNorm upcasts to fp32 and keeps the fp32 input, its bf16 cast and the normed
  output (8sbh per norm, two norms) where LayerNorm keeps 2sbh; SwiGLU keeps gate, silu(gate),
  up and their product at 11008 = 2.6875h wide (4 x 5.375sbh) where GELU keeps 2 x 8sbh and a
  dropout mask; rotary embeddings keep the rotated q and k; no dropout masks anywhere.
"""


if __name__ == "__main__":
    main()
