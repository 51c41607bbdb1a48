"""Small models for the end-to-end, bad-input and property tests (random init, no downloads).

Each ``*_example`` returns ``(model, example_input)`` in train mode, sized so that one plan plus a
few measured steps take a few seconds on a CPU. ``spec_model`` builds a network from a drawn
``NetSpec`` for the hypothesis tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.models import unet_example

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny configs only; a download would be a bug


def gpt2_example(seed: int = 0, use_cache: bool = False):
    """Hugging Face GPT-2 (4 layers, d 64): dict input, loss from ``.loss``, tied embeddings.

    ``use_cache=True`` is what a user gets from ``GPT2Config()`` by default: the model then
    returns a ``DynamicCache`` alongside the loss.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    # A vocabulary smaller than the width and a batch of 8 x 64 tokens, so the blocks (which
    # checkpointing can shrink) hold most of the step's memory, not the parameter gradients,
    # the logits and the loss (which it cannot).
    cfg = GPT2Config(
        vocab_size=32, n_positions=64, n_embd=64, n_layer=4, n_head=2, use_cache=use_cache
    )
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (8, 64))
    return model, {"input_ids": ids, "labels": ids}


def llama_example(seed: int = 0):
    """Hugging Face Llama (2 layers, d 32, grouped-query attention, RoPE, RMSNorm, SwiGLU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attention_dropout=0.1,
    )
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def bert_example(seed: int = 0):
    """Hugging Face BERT masked LM (2 layers, d 64): attention mask, token types, dropout."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = BertForMaskedLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (8, 64))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def vit_example(seed: int = 0):
    """Hugging Face ViT image classifier (2 layers, d 32, 16x16 images in 4x4 patches)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    model = ViTForImageClassification(cfg).train()
    return model, {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.randint(0, 3, (4,))}


def resnet_example(seed: int = 0):
    """benchmarks' residual CNN (a stem, an nn.Sequential of 4 ResNet basic blocks with
    BatchNorm, a head), 8 channels, 16x16 images."""
    from benchmarks.models import residual_cnn_example

    return residual_cnn_example(batch=2, size=16, seed=seed, channels=8, n_blocks=4)


def small_unet_example(seed: int = 0):
    """benchmarks' U-Net (long encoder->decoder skips, BatchNorm), 2 levels, 32x32 images."""
    return unet_example(batch=2, size=32, seed=seed, channels=4, depth=2)


class MHABlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class MHANet(nn.Module):
    """A transformer encoder built on ``nn.MultiheadAttention``."""

    def __init__(self, d: int = 32, n_head: int = 2, n_layer: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MHABlock(d, n_head) for _ in range(n_layer))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


def mha_example(seed: int = 0):
    torch.manual_seed(seed)
    return MHANet(), torch.randn(2, 32, 32)


class InplaceBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc1(x))
        y = self.fc2(y)
        y += x  # in-place residual add
        return F.relu_(y)


class InplaceNet(nn.Module):
    """In-place activations (``nn.ReLU(inplace=True)``, ``F.relu_``) and ``x += ...``."""

    def __init__(self, d: int = 32, n_layer: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(InplaceBlock(d) for _ in range(n_layer))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def inplace_example(seed: int = 0):
    torch.manual_seed(seed)
    return InplaceNet(), torch.randn(256, 32)


class TaggedNet(nn.Module):
    """Returns ``(logits, 3, "tag")``: non-tensor outputs beside the tensor."""

    def __init__(self, d: int = 64, n_layer: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(m for _ in range(n_layer) for m in (nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.1)))
        )
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, str]:
        return self.head(self.layers(x)), 3, "tag"


def tagged_example(seed: int = 0):
    torch.manual_seed(seed)
    return TaggedNet(), torch.randn(256, 64)


# The zoo: every model the end-to-end tests plan, in both forms (test_models.py: the graph
# form; test_models_inplace.py: the README's call, in place).
MODELS = {
    "gpt2": gpt2_example,
    "llama": llama_example,
    "bert": bert_example,
    "unet": small_unet_example,
    "mha": mha_example,
    "inplace": inplace_example,
    "tagged": tagged_example,
}
SLOW = frozenset({"gpt2", "llama", "bert"})  # Hugging Face models: marked slow
# Models with repeated blocks, one of each kind the block strategies (uniform, sqrt, revolve,
# selective, sac) are checked on in place: Hugging Face decoders, an encoder, a ViT, a U-Net,
# a ResNet
BLOCK_MODELS = {
    "llama": llama_example,
    "gpt2": gpt2_example,
    "bert": bert_example,
    "vit": vit_example,
    "unet": small_unet_example,
    "resnet": resnet_example,
}


def block_model_params() -> list:
    """BLOCK_MODELS' names as pytest parameters, the Hugging Face ones (SLOW) marked slow."""
    import pytest

    return [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in BLOCK_MODELS]


class DataDependentNet(nn.Module):
    """Branches on a tensor's value: neither torch.export nor symbolic_trace can capture it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # the line the CaptureError must name
            y = y * 2
        return y


class FrozenNet(nn.Module):
    """Every parameter frozen: nothing to train, so nothing to plan."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


# --- networks from a drawn spec (property tests) -------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """One stage: ``kind`` in {"linear", "residual", "branch"}, its width and extras."""

    kind: str
    width: int
    dropout: bool = False
    norm: bool = False  # BatchNorm1d after the first linear


@dataclass(frozen=True)
class NetSpec:
    d_in: int
    batch: int
    layers: tuple[LayerSpec, ...]
    seed: int = 0


class _Stage(nn.Module):
    def __init__(self, d_in: int, spec: LayerSpec) -> None:
        super().__init__()
        self.kind = spec.kind
        self.fc = nn.Linear(d_in, spec.width)
        self.norm = nn.BatchNorm1d(spec.width) if spec.norm else nn.Identity()
        self.drop = nn.Dropout(0.2) if spec.dropout else nn.Identity()
        if spec.kind == "residual":
            self.fc2 = nn.Linear(spec.width, spec.width)
        if spec.kind == "branch":  # two parallel arms joined by a concat and a projection
            self.arm = nn.Linear(d_in, spec.width)
            self.join = nn.Linear(2 * spec.width, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(F.gelu(self.norm(self.fc(x))))
        if self.kind == "residual":
            return y + torch.tanh(self.fc2(y))
        if self.kind == "branch":
            return self.join(torch.cat([y, torch.sigmoid(self.arm(x))], dim=-1))
        return y


class SpecNet(nn.Module):
    def __init__(self, spec: NetSpec) -> None:
        super().__init__()
        widths = [spec.d_in] + [layer.width for layer in spec.layers]
        self.stages = nn.ModuleList(_Stage(w, s) for w, s in zip(widths, spec.layers))
        self.head = nn.Linear(widths[-1], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def spec_model(spec: NetSpec) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(spec.seed)
    model = SpecNet(spec).train()
    return model, torch.randn(spec.batch, spec.d_in)
