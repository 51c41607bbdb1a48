"""In-place plans under torch.compile: the compiled peak against the plan's budget (issue 21).

Tiny Hugging Face Llama (4 layers, width 64, grouped-query attention) and GPT-2 (4 layers,
width 64), batch 4 x 64 tokens with one padded row, ``use_cache=False``, CPU, float32. Each is
planned in place (``form="inplace"``, roofline prices ``device="cpu"``) at shares of its measured
eager peak, as an eager plan and with ``compiled=True`` (``planner/compiled.py``), applied to a
copy, then compiled whole (``torch.compile(model)``) or per block (``block.compile()`` on each
decoder layer, in place) with each backend. Every peak is one ``planner.measure`` step (the
eager column: the live-storage tracker; compiled: the profiler's allocation events of the
third step, after two warm-up steps, since a dispatch-mode tracker would make dynamo run
eager). Graph breaks are dynamo's own counters for that compile.

    python -m benchmarks.compiled_inplace                        # both models, 30/50/70%
    python -m benchmarks.compiled_inplace --models llama --backends aot_eager --shares 0.5 \
        --scopes whole --plans compiled
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from torch import nn
from torch._dynamo.utils import counters

import planner

os.environ["HF_HUB_OFFLINE"] = "1"  # tiny configs only; a download would be a bug

VOCAB, PAD = 128, 0
BATCH, SEQ = 4, 64


def llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).train()


def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=64, n_layer=4, n_head=2, use_cache=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg).train()
    model.loss_type = "ForCausalLM"  # unset, transformers logs a warning dynamo graph-breaks on
    return model


def tokens(length: int = SEQ, batch: int = BATCH, pad_last: int = SEQ // 8) -> dict:
    """Token ids with the last row right-padded (mask 0, label -100)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[-1, -pad_last:] = PAD
    mask[-1, -pad_last:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


BUILDERS = {"llama": llama, "gpt2": gpt2}
BLOCKS = {"llama": lambda m: m.model.layers, "gpt2": lambda m: m.transformer.h}
SCOPES = ("whole", "block")


def compiled_peak(
    name: str, applied: nn.Module, x: dict, scope: str, backend: str
) -> tuple[int, int]:
    """(peak bytes of a steady-state compiled step, dynamo's graph breaks). ``applied`` is
    compiled whole (``torch.compile``) or per block (``block.compile()``, in place: use a
    copy)."""
    torch._dynamo.reset()
    counters.clear()
    if scope == "whole":
        compiled = torch.compile(applied, backend=backend)
    else:
        for block in BLOCKS[name](applied):
            block.compile(backend=backend)
        compiled = applied
    # the profiler's allocation events (a dispatch-mode tracker would make dynamo run eager);
    # the warm-up steps compile, the measured step runs the compiled code
    m = planner.measure(compiled, x, warmup=2, method="profiler")
    return m.peak_bytes, sum(counters["graph_break"].values())


def rows(
    name: str, shares: list[float], backends: list[str], scopes: list[str], kinds: list[str]
) -> list[str]:
    model, x = BUILDERS[name](), tokens()
    eager_bytes = planner.measure(model, x).peak_bytes
    out = []
    for share in shares:
        for kind in kinds:
            try:
                p = planner.plan(
                    model, x, eager_bytes * share / 1e9, form="inplace", device="cpu",
                    compiled=kind == "compiled",
                )  # fmt: skip
            except planner.InfeasibleBudgetError as e:
                least = f"{e.min_bytes:,} B, {e.min_bytes / eager_bytes:.1%} of eager"
                out.append(f"| {name} | {share:.0%} | {kind} | infeasible: least {least} |")
                print(out[-1], flush=True)
                continue
            nested = " nested" if any(r.depth for r in p.regions) else ""
            regions = f"{sum(r.kind == 'selective' for r in p.regions)}/{len(p.regions)}{nested}"
            eager_measured = planner.measure(p.apply(copy.deepcopy(model)), x).peak_bytes
            for scope in scopes:
                for backend in backends:
                    applied = p.apply(copy.deepcopy(model))
                    peak, breaks = compiled_peak(name, applied, x, scope, backend)
                    out.append(
                        f"| {name} | {share:.0%} | {kind} | {p.budget_bytes:,} | "
                        f"{p.predicted_peak_bytes:,} | {eager_measured:,} | {regions} | {scope} | "
                        f"{backend} | {peak:,} | {peak / p.budget_bytes:.3f} | "
                        f"{peak / p.predicted_peak_bytes:.3f} | {breaks} |"
                    )
                    print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument("--shares", default="0.3,0.5,0.7")
    parser.add_argument("--scopes", default=",".join(SCOPES))
    parser.add_argument("--plans", default="eager,compiled", help="plan(compiled=False/True)")
    args = parser.parse_args()
    print(
        "| model | budget (share of eager) | plan | budget B | predicted B | measured eager B | "
        "selective/regions | compiled | backend | measured compiled B | compiled / budget | "
        "compiled / predicted | graph breaks |"
    )
    print("|---|---|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        rows(
            name,
            [float(s) for s in args.shares.split(",")],
            args.backends.split(","),
            args.scopes.split(","),
            args.plans.split(","),
        )


if __name__ == "__main__":
    main()
