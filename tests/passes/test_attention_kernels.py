"""Fused attention priced as the target device runs it (passes/attention_kernels.py).

A model on the meta device has no fused attention kernel: meta runs the math path, which keeps
the (S, S) attention weights. Planned for a device profile, the step must be priced with the
kernel that device dispatches: for the ``cpu`` profile, node by node the bytes the same model
prices on the CPU itself; for a GPU profile, the kernel torch's CUDA rules pick.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import planner
from planner.devices import device_profile
from planner.inplace_form import price_inplace
from planner.passes.attention_kernels import AttentionCall, cuda_backend
from tests.models_zoo import gpt2_example, llama_example, vit_example

os.environ["HF_HUB_OFFLINE"] = "1"


def memory_of(graph):
    """Every byte of memory a graph prices, node by node: without the times and the traffic
    the roofline times them by (meta's embedding backward runs other ops than the CPU's)."""
    timeless = [
        replace(n, fwd_time_s=None, bwd_time_s=None, fwd_bytes_accessed=0, bwd_bytes_accessed=0)
        for n in graph.nodes
    ]
    return timeless, graph.tensors, graph.grad_buffers


@pytest.mark.parametrize("example", [llama_example, gpt2_example, vit_example])
def test_a_model_on_meta_priced_for_the_cpu_prices_what_the_cpu_runs(example):
    model, batch = example()
    cpu = price_inplace(model, batch, device=device_profile("cpu"))
    # Built on meta as a user does, not moved there: ``Module.to("meta")`` gives each module
    # its own copy of a shared parameter, which unties GPT-2's embedding from its lm_head.
    with torch.device("meta"):
        meta_model, meta_batch = example()
    assert meta_model.training == model.training
    meta = price_inplace(meta_model, meta_batch, device=device_profile("cpu"))
    assert memory_of(meta.graph) == memory_of(cpu.graph)
    assert "untied" not in meta.graph.meta
    assert meta.graph.meta.get("sdpa_backend") == cpu.graph.meta.get("sdpa_backend")


def test_a_tied_embedding_untied_by_moving_the_model_to_meta_is_named():
    model, batch = gpt2_example()
    model.to("meta")
    assert model.lm_head.weight is not model.transformer.wte.weight  # torch's own behaviour
    batch = {k: v.to("meta") for k, v in batch.items()}
    graph = price_inplace(model, batch, device=device_profile("cpu")).graph
    assert "tie_weights()" in graph.meta["untied"]
    # what the note warns of: a gradient for each of the two weights
    assert sum(n.param_grad_bytes for n in graph.nodes) == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )


def call(**changes) -> AttentionCall:
    base = AttentionCall(
        dtype=torch.bfloat16,
        head_dim=128,
        value_head_dim=128,
        has_mask=False,
        dropout_p=0.0,
        is_causal=True,
        grouped_query=True,
        square=True,
    )
    return replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "capability", "kernel"),
    [
        ({}, (9, 0), "flash"),  # a bf16 decoder on an H100
        ({"has_mask": True, "grouped_query": False}, (9, 0), "efficient"),  # padded batches
        ({"has_mask": True}, (9, 0), "math"),  # a mask and grouped heads: no fused kernel
        ({"dtype": torch.float32, "grouped_query": False}, (8, 0), "efficient"),
        ({"dtype": torch.float32}, (8, 0), "math"),
        ({}, (7, 5), "math"),  # bf16 needs sm80 for either fused kernel
        ({"grouped_query": False, "dtype": torch.float16}, (7, 5), "efficient"),
        ({"head_dim": 256, "value_head_dim": 256}, (8, 9), "math"),  # flash's bwd on sm89
        ({"head_dim": 256, "value_head_dim": 256, "grouped_query": False}, (8, 9), "efficient"),
        ({"is_causal": True, "square": False}, (9, 0), "math"),
        ({}, None, "math"),  # capability unknown: the candidate that keeps the most
    ],
)
def test_the_cuda_kernel_follows_torchs_conditions(changes, capability, kernel):
    assert cuda_backend(call(**changes), capability)[0] == kernel


def test_a_disabled_backend_is_not_priced():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert cuda_backend(call(grouped_query=False), (9, 0))[0] == "efficient"


def llama_on_meta(mask: bool, seq: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(1, seq, dtype=torch.long)
        batch = {"input_ids": ids, "labels": ids}
        if mask:
            batch["attention_mask"] = torch.ones(1, seq, dtype=torch.long)
    return model, batch


def ops_of(plan) -> set[str]:
    return {n.op for n in plan.graph.nodes}


def test_a_meta_decoder_planned_for_an_h100_is_priced_with_flash_attention():
    model, batch = llama_on_meta(mask=False)
    p = planner.plan(model, batch, 10, device="h100")
    assert "aten._scaled_dot_product_flash_attention.default" in ops_of(p)
    assert not ops_of(p) & {"aten._softmax.default", "aten._safe_softmax.default"}
    summary = p.summary()
    assert "attention priced as h100 runs it: flash (bfloat16, head dim 16" in summary
    assert "kernel workspaces" in summary


def test_a_meta_attention_mask_plans_on_the_padded_path_and_says_so():
    model, batch = llama_on_meta(mask=True)
    p = planner.plan(model, batch, 10, device="h100")
    assert "aten._scaled_dot_product_efficient_attention.default" in ops_of(p)
    assert "attention_mask on the meta device (values unknown): priced as padded" in p.summary()
    # the padded path keeps each layer's additive mask and the repeated keys: more than flash
    unmasked = planner.plan(*llama_on_meta(mask=False), 10, device="h100")
    assert p.baseline_peak_bytes > unmasked.baseline_peak_bytes


def test_priced_for_a_gpu_every_storage_takes_whole_512_byte_blocks():
    model, batch = llama_on_meta(mask=False, seq=3)
    graph = planner.plan(model, batch, 10, device="h100").graph
    assert all(t.size_bytes % 512 == 0 for t in graph.tensors)
