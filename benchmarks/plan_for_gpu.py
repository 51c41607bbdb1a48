"""Plan Hugging Face Llama-3 shapes for an H100 from a machine without one (the meta device).

The question: "will Llama-3-8B at 8K context fit on an H100, and what will checkpointing cost?",
asked the way the README advises for a Hugging Face model (``attn_implementation="sdpa"``,
``use_cache=False``, an ``attention_mask``), built on the meta device and planned with
``device="h100"``. Fused attention must be priced as the H100 runs it
(``passes/attention_kernels.py``), not as meta's math path, which keeps an S x S tensor a layer.

For each shape it prints and writes (``--out``, JSON) the plan's wall time, the process's peak
resident memory, the predicted no-checkpoint peak, the attention kernel the summary names, and
a count of what the step keeps at its peak made by hand from the model's shapes
(:func:`counted_peak_bytes`), with the prediction's error against it. It also plans each shape
at half its predicted no-checkpoint peak (or finds that no plan fits there: a 70B's
bf16 parameter gradients alone are 141 GB).

Run: ``python -m benchmarks.plan_for_gpu`` (both shapes; ``--shapes 8B`` for one).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from dataclasses import asdict, dataclass

import torch

import planner

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int = 128256


SHAPES = {
    "8B": Shape("Llama-3-8B", 32, 4096, 14336, 32, 8, 8192),
    "70B": Shape("Llama-3-70B", 80, 8192, 28672, 64, 8, 4096),
}


def counted_peak_bytes(s: Shape, padded: bool) -> dict[str, int]:
    """What a bf16 Llama step of batch 1 keeps at its peak, counted from the shapes.

    Per layer, kept for backward: each RMSNorm's float32 copy, its bf16 cast and the weighted
    output (4 + 2 + 2 bytes per element of s x h, twice); the rotated query; the keys and
    values, repeated to every head on the padded path (transformers' ``repeat_kv``: no
    grouped-query kernel takes a mask) or as they are for flash; the attention output and
    o_proj's contiguous input; the SwiGLU's four s x mlp tensors; the log-sum-exp (float32 per
    head and row, rows padded to 32 on the memory-efficient kernel); on the padded path the
    additive mask each call makes from the boolean one (s x s, bf16). The peak comes in the
    loss's backward: the final norm's three tensors, the float32 log-softmax kept for
    backward, its float32 gradient and the bf16 gradient of the logits (4 + 4 + 2 bytes per
    element of s x vocab).
    """
    sh = s.seq * s.hidden
    kv_heads = s.heads if padded else s.kv_heads
    kv = 2 * BF16 * s.seq * kv_heads * (s.hidden // s.heads)
    rows = -(-s.seq // 32) * 32 if padded else s.seq
    layer = {
        "norms": 2 * (FP32 + BF16 + BF16) * sh,
        "query": BF16 * sh,
        "keys_values": kv,
        "attention_out_and_o_proj_input": 2 * BF16 * sh,
        "swiglu": 4 * BF16 * s.seq * s.mlp,
        "logsumexp": FP32 * s.heads * rows,
        "additive_mask": BF16 * s.seq * s.seq if padded else 0,
    }
    per_layer = sum(layer.values())
    head = (FP32 + BF16 + BF16) * sh + (FP32 + FP32 + BF16) * s.seq * s.vocab
    return {**{f"layer_{k}": v for k, v in layer.items()}, "per_layer": per_layer,
            "layers": s.layers * per_layer, "head_and_loss": head,
            "total": s.layers * per_layer + head}  # fmt: skip


def llama_on_meta(s: Shape, mask: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=s.layers, hidden_size=s.hidden, intermediate_size=s.mlp,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(1, s.seq, dtype=torch.long)
        batch = {"input_ids": ids, "labels": ids}
        if mask:
            batch["attention_mask"] = torch.ones(1, s.seq, dtype=torch.long)
    return model, batch


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(s: Shape, mask: bool, device: str) -> dict:
    model, batch = llama_on_meta(s, mask)
    start = time.perf_counter()
    p = planner.plan(model, batch, 1e4, device=device)  # no budget binds: the eager step
    plan_s = time.perf_counter() - start
    half_gb = p.baseline_peak_bytes / 2 / 1e9
    start = time.perf_counter()
    try:
        half = planner.plan(model, batch, half_gb, device=device)
        at_half = {
            "predicted_peak_bytes": half.predicted_peak_bytes,
            "regions": len(half.regions),
            "predicted_step_s": half.predicted_step_time_s,
        }
    except planner.InfeasibleBudgetError as e:  # the parameter gradients alone exceed it
        at_half = {"infeasible": True, "least_feasible_bytes": e.min_bytes}
    half_s = time.perf_counter() - start
    counted = counted_peak_bytes(s, padded=mask)
    attention = next(line for line in p.summary().splitlines() if line.startswith("attention"))
    return {
        "shape": asdict(s),
        "attention_mask": mask,
        "device": device,
        "plan_s": round(plan_s, 2),
        "peak_rss_bytes": peak_rss_bytes(),
        "predicted_eager_peak_bytes": p.baseline_peak_bytes,
        "counted_peak_bytes": counted["total"],
        "error_vs_count": p.baseline_peak_bytes / counted["total"] - 1,
        "count": counted,
        "attention": attention,
        "half_budget_gb": half_gb,
        "half_plan_s": round(half_s, 2),
        "at_half": at_half,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8B,70B")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--no-mask", action="store_true", help="plan without the attention mask")
    parser.add_argument("--out", default="benchmarks/results/plan_for_gpu.json")
    args = parser.parse_args()
    rows = [run(SHAPES[n], not args.no_mask, args.device) for n in args.shapes.split(",")]
    for r in rows:
        gib = 2**30
        print(
            f"{r['shape']['name']} seq {r['shape']['seq']} on {r['device']}: plan "
            f"{r['plan_s']:.1f} s (half budget {r['half_plan_s']:.1f} s), peak RSS "
            f"{r['peak_rss_bytes'] / 1e9:.2f} GB; predicted eager peak "
            f"{r['predicted_eager_peak_bytes'] / gib:.2f} GiB, counted "
            f"{r['counted_peak_bytes'] / gib:.2f} GiB ({r['error_vs_count']:+.2%}); "
            f"{r['attention']}"
        )
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
