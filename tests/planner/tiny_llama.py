"""A tiny Hugging Face Llama and padded token batches for the integration tests."""

from __future__ import annotations

import os

import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # tiny configs only; a download would be a bug

VOCAB, PAD = 64, 0
BATCH, SEQ = 4, 128


def llama(seed: int = 0, layers: int = 4) -> torch.nn.Module:
    """Llama: 4 layers, hidden 64, grouped-query attention (4 heads, 2 key/value), attention
    dropout 0.1 (so that bitwise-equal gradients show the random stream kept), no cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attention_dropout=0.1, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).train()


def row(length: int, pad: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One sequence of ``length`` tokens whose last ``pad`` are padding (mask 0, label -100):
    every batch then takes the masked attention path the plan priced (README)."""
    ids = torch.randint(3, VOCAB, (length,), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        ids[-pad:], mask[-pad:] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def batch(rows: int = BATCH, length: int = SEQ, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    items = [row(length, (i + 1) * length // 16, g) for i in range(rows)]
    return {k: torch.stack([r[k] for r in items]) for k in items[0]}


class Rows(torch.utils.data.Dataset):
    """``n`` rows of ``length`` tokens, each with some padding at its end."""

    def __init__(self, n: int, length: int = SEQ, seed: int = 2) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [
            row(length, int(torch.randint(1, length // 4, (), generator=g)), g) for _ in range(n)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]
