"""A forward that writes into slices of a tensor it made (DeepSeek-V3's MLA key) prices and plans.

Pricing used to deadlock there: the in-place ``copy_`` into a view makes autograd rebase the
view's history, which replays the view; the replayed op reached the tracker, which read the
same view's ``grad_fn`` under the lock autograd held. The small model runs in a subprocess with
a time limit, so that a deadlock fails the test instead of hanging the suite.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import planner
from tests.helpers import assert_same_step_copy

os.environ["HF_HUB_OFFLINE"] = "1"

KEY_IN_SLICES = textwrap.dedent(
    """
    import torch, planner

    class ExpandKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kv = torch.nn.Linear(16, 16)
            self.rot = torch.nn.Linear(16, 4)

        def forward(self, x):
            nope, rot = self.kv(x), self.rot(x)
            key = nope.new_empty(*nope.shape[:-1], 20)
            key[..., :16].copy_(nope)
            key[..., 16:].copy_(rot)
            return key.square().sum()

    model = torch.nn.Sequential(ExpandKV())
    x = torch.randn(4, 8, 16)
    p = planner.plan(model, x, 1.0, loss_fn=lambda out: out, device="cpu")
    measured = planner.measure(model, x, loss_fn=lambda out: out).peak_bytes
    print(p.predicted_peak_bytes, measured)
    """
)


def test_a_forward_writing_into_slices_of_a_new_tensor_prices_without_deadlock() -> None:
    done = subprocess.run(
        [sys.executable, "-c", KEY_IN_SLICES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    predicted, measured = map(int, done.stdout.split())
    assert predicted == measured


def deepseek_v3(seed: int = 0) -> torch.nn.Module:
    """DeepSeek-V3 from a tiny config: MLA attention (low-rank q and kv), routed experts."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2,
        topk_group=1, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(cfg)


@pytest.mark.slow
def test_deepseek_v3_plans_in_place_at_half_of_eager() -> None:
    model = deepseek_v3()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    eager_bytes = planner.measure(model, batch).peak_bytes
    budget_bytes = eager_bytes // 2
    p = planner.plan(model, batch, budget_bytes / 1e9)
    assert p.regions, "half of eager needs checkpointing"
    p.apply(model)
    measured_bytes = planner.measure(model, batch).peak_bytes
    assert measured_bytes <= p.predicted_peak_bytes <= budget_bytes
    assert_same_step_copy(reference, model, batch)
