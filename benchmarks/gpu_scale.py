"""planner against the checkpointing people run, on a Llama-3.2-1B-shaped model (random init).

Anchors, each as users run it: no checkpointing; Hugging Face ``gradient_checkpointing_enable``
(every layer, ``use_reentrant=False``); torchtitan's op-level selective checkpointing per
decoder layer (its save list and every-second-matmul rule); ``torch.compile`` with
``activation_memory_budget=0.5``. Each row: planner planned at that anchor's measured peak,
applied in place on a fresh model, measured the same way (``planner.measure``).

    python -m benchmarks.gpu_scale --smoke              # toy size on CPU, seconds
    python -m benchmarks.gpu_scale --out benchmarks/results/gpu_scale-h100.json   # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import planner
from planner.measurement import measure
from planner.solvers.sac import SAVE_LIST

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9


def _torch_op(name: str) -> Any:
    """The op named as our nodes name it ("aten.mm.default"), or None where this torch lacks it."""
    try:
        return functools.reduce(getattr, name.split("."), torch.ops)
    except (AttributeError, RuntimeError):
        return None


# torchtitan's _op_sac_save_list, as the ``sac`` solver prices it (solvers/sac.py)
_SAVE_LIST = {op for name in SAVE_LIST if (op := _torch_op(name)) is not None}


@dataclass(frozen=True)
class Row:
    anchor: str
    status: str  # "ok", or why the row did not run
    budget_bytes: int = 0
    anchor_tokens_per_s: float = 0.0
    anchor_reserved_bytes: int = 0
    planner_tokens_per_s: float = 0.0
    planner_measured_peak_bytes: int = 0
    planner_predicted_peak_bytes: int = 0
    planner_reserved_bytes: int = 0
    planner_predicted_step_time_s: float = 0.0
    planner_measured_step_time_s: float = 0.0


def llama(smoke: bool, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256)
        if smoke
        else dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=8192, vocab_size=128256)
    )  # fmt: skip
    config = LlamaConfig(
        **shape, attn_implementation="sdpa", max_position_embeddings=8192, use_cache=False
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _titan_policy() -> Any:
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if op == torch.ops.aten.mm.default:
            counts[f"{key}_mm"] += 1
        # torchtitan saves every op in the list except every second mm
        keep = op in _SAVE_LIST and not (
            op == torch.ops.aten.mm.default and counts[f"{key}_mm"] % 2 == 0
        )
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _TitanLayer(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            self.layer, *args, use_reentrant=False, context_fn=_titan_policy, **kwargs
        )


def anchor_model(name: str, smoke: bool, device: str, dtype: torch.dtype) -> torch.nn.Module:
    model = llama(smoke, device, dtype)
    if name == "hf_gradient_checkpointing":
        model.gradient_checkpointing_enable({"use_reentrant": False})
    elif name == "torchtitan_sac":
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = _TitanLayer(layer)
    elif name == "compile_budget_0.5":  # compiled under the budget in run_row
        model = torch.compile(model)
    return model


def _tokens_per_s(model: torch.nn.Module, batch: dict, steps: int) -> tuple[float, int]:
    """Steps with AdamW after a warm-up step; tokens/s and the allocator's reserved peak."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    cuda = batch["input_ids"].is_cuda
    for i in range(steps + 1):
        if i == 1:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    reserved = torch.cuda.max_memory_reserved() if cuda else 0
    return batch["input_ids"].numel() * steps / elapsed, reserved


def run_row(name: str, args: argparse.Namespace, batch: dict, dtype: torch.dtype) -> Row:
    if name == "compile_budget_0.5" and args.smoke and not args.compile:
        return Row(name, "skipped: --smoke leaves torch.compile out (minutes on CPU); --compile")
    if name == "hf_cpu_offload":
        return Row(name, "unavailable: transformers has no activation CPU offload API")
    compiled = name.startswith("compile")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = anchor_model(name, args.smoke, args.device, dtype)
    # compile's activation budget applies to the anchor alone (planner's row compiles with
    # the default, as a user of planner would)
    budget = 0.5 if compiled else torch._functorch.config.activation_memory_budget
    with torch._functorch.config.patch(activation_memory_budget=budget):
        peak = measure(model, batch).peak_bytes
        anchor_tps, anchor_reserved = _tokens_per_s(model, batch, args.steps)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = llama(args.smoke, args.device, dtype)
    p = planner.plan(model, batch, peak / GB, compiled=compiled)
    p.apply(model)
    if compiled:
        model = torch.compile(model)
    got = measure(model, batch, repeats=args.steps)
    tps, reserved = _tokens_per_s(model, batch, args.steps)
    return Row(
        name, "ok", int(peak), anchor_tps, anchor_reserved, tps, got.peak_bytes,
        p.predictions.peak_bytes, reserved, p.predictions.step_time_s, got.step_time_s,
    )  # fmt: skip


ANCHORS = ("no_checkpointing", "hf_gradient_checkpointing", "torchtitan_sac",
           "compile_budget_0.5", "hf_cpu_offload")  # fmt: skip


def table(rows: list[Row]) -> str:
    lines = ["| anchor | budget GB | anchor tok/s | planner tok/s | planner peak GB "
             "(predicted) | status |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r.anchor} | {r.budget_bytes / GB:.4f} | {r.anchor_tokens_per_s:,.0f} | "
            f"{r.planner_tokens_per_s:,.0f} | {r.planner_measured_peak_bytes / GB:.4f} "
            f"({r.planner_predicted_peak_bytes / GB:.4f}) | {r.status} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on CPU, fp32")
    ap.add_argument("--compile", action="store_true", help="keep the compile row in --smoke")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    args.seq = args.seq or (32 if args.smoke else 4096)
    args.steps = args.steps or (2 if args.smoke else 10)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    vocab = 256 if args.smoke else 128256
    ids = torch.randint(vocab, (1, args.seq), generator=gen).to(args.device)
    batch = {"input_ids": ids, "labels": ids}
    gpu = torch.cuda.get_device_name().split()[-1].lower() if args.device == "cuda" else "cpu"
    rows = [run_row(name, args, batch, dtype) for name in ANCHORS]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    result = {
        "n_params": sum(p.numel() for p in llama(args.smoke, "meta", dtype).parameters()),
        "device": gpu, "torch": torch.__version__, "commit": commit.stdout.strip(),
        "seq": args.seq, "steps": args.steps, "rows": [asdict(r) for r in rows],
    }  # fmt: skip
    out = args.out or RESULTS / f"gpu_scale-{'smoke' if args.smoke else gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
