"""Reference models for tests and benchmarks (plain torch, random init, no downloads).

- GPT-ref: 12 blocks, d_model 256, 4 heads, MLP 4x, sequence 256, batch 8, vocabulary 1024,
  explicit causal softmax attention (matmul -> mask -> softmax -> dropout -> matmul),
  dropout 0.1, LayerNorm, residuals, cross-entropy loss inside forward.
  ``attention="sdpa"`` swaps in ``F.scaled_dot_product_attention``.
- A residual CNN, a small U-Net with long encoder->decoder skips, an MLP.

Each ``*_example`` function returns ``(model, example_input)`` ready for ``planner.plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    d_model: int = 256
    n_head: int = 4
    seq_len: int = 256
    vocab_size: int = 1024
    dropout: float = 0.1
    attention: str = "eager"  # "eager" (explicit softmax) or "sdpa"


GPT_REF = GPTConfig()
GPT_REF_SMALL = GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=32, vocab_size=128)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.attention, self.p = cfg.n_head, cfg.attention, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            p = self.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:, :, :s, :s], float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, s, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPT_REF) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_example(cfg: GPTConfig = GPT_REF, batch: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    return model, (idx, targets)


def gpt_ref_example(seed: int = 0):
    return gpt_example(GPT_REF, batch=8, seed=seed)


def gpt_ref_small_example(seed: int = 0):
    return gpt_example(GPT_REF_SMALL, batch=2, seed=seed)


def gpt_ref_for_batch(batch_size: int, seed: int = 0):
    """GPT-ref at a given batch size (a FACTORY for ``python -m planner fit-batch``)."""
    return gpt_example(GPT_REF, batch=batch_size, seed=seed)


def gpt_ref_small_for_batch(batch_size: int, seed: int = 0):
    """GPT-ref-small at a given batch size (a FACTORY for ``python -m planner fit-batch``)."""
    return gpt_example(GPT_REF_SMALL, batch=batch_size, seed=seed)


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResidualCNN(nn.Module):
    def __init__(self, channels: int = 32, n_blocks: int = 6, n_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(*(ResBlock(channels) for _ in range(n_blocks)))
        self.head = nn.Linear(channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def residual_cnn_example(batch: int = 8, size: int = 32, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return ResidualCNN(**kwargs), torch.randn(batch, 3, size, size)


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
    )


class UNet(nn.Module):
    """Encoder -> bottleneck -> decoder; each decoder level concatenates its encoder's output."""

    def __init__(self, channels: int = 16, depth: int = 3) -> None:
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.stem = _conv_bn_relu(3, widths[0])
        self.down = nn.ModuleList(_conv_bn_relu(widths[i], widths[i + 1]) for i in range(depth))
        levels = list(reversed(range(depth)))
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in levels
        )
        self.dec = nn.ModuleList(
            _conv_bn_relu(2 * widths[i], widths[i]) for i in reversed(range(depth))
        )
        self.out = nn.Conv2d(widths[0], 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(F.max_pool2d(x, 2))
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def unet_example(batch: int = 4, size: int = 64, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return UNet(**kwargs), torch.randn(batch, 3, size, size)


class MLPNet(nn.Module):
    def __init__(self, width: int = 512, depth: int = 8, d_in: int = 256) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(d_in, width),
            *(m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())),
            nn.Linear(width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp_example(batch: int = 2048, seed: int = 0, **kwargs):
    # At 2048 rows the activations (~70 MiB) outweigh the 8 MiB of parameter gradients, so
    # checkpointing has something to save (at 256 the gradients alone set the peak).
    torch.manual_seed(seed)
    model = MLPNet(**kwargs)
    return model, torch.randn(batch, model.layers[0].in_features)
