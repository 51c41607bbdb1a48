"""A model built on the meta device and planned for this GPU's own profile predicts what
planning on the GPU predicts (node by node, the bytes; the attention kernel), and the plan,
applied to the real model on the GPU, measures what it predicts (kernel workspaces, which a
profile does not price, within 1%)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import planner
from planner.devices import profile_of
from planner.inplace_form import price_inplace

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.randint(0, 256, (2, 512))
    return model, {"input_ids": ids, "labels": ids}


def memory_of(graph):
    """The bytes a graph prices, node by node, less the kernels' workspaces (temporaries the
    GPU measures and a profile does not price) and the times."""
    nodes = [
        replace(n, fwd_time_s=None, bwd_time_s=None, fwd_bytes_accessed=0, bwd_bytes_accessed=0,
                fwd_temp_bytes=0, bwd_temp_bytes=0)
        for n in graph.nodes
    ]  # fmt: skip
    return nodes, graph.tensors


def test_a_meta_model_planned_for_this_gpu_prices_what_the_gpu_prices():
    model, batch = llama("cuda")
    on_gpu = price_inplace(model, batch).graph
    meta_model, meta_batch = llama("meta")
    on_meta = price_inplace(meta_model, meta_batch, device=profile_of(CUDA)).graph
    assert memory_of(on_meta) == memory_of(on_gpu)
    assert on_gpu.meta["sdpa_backend"] in on_meta.meta["attention"]


def test_a_plan_made_on_meta_for_this_gpu_measures_what_it_predicts():
    meta_model, meta_batch = llama("meta")
    eager = planner.plan(meta_model, meta_batch, 1e3, device=profile_of(CUDA))
    p = planner.plan(
        meta_model, meta_batch, eager.baseline_peak_bytes / 2e9, device=profile_of(CUDA)
    )
    model, batch = llama("cuda")
    p.apply(model)
    measured = planner.measure(model, batch).peak_bytes
    assert 0.99 * measured <= p.predicted_peak_bytes <= 1.01 * measured
