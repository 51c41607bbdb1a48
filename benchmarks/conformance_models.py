"""The architectures of the conformance sweep (``benchmarks/conformance.py``): tiny, random init,
float32, built with no download.

Each entry of :data:`ZOO` maps a name to a factory ``(batch_size) -> (model, example_input)``
returning a model in train mode and its input at that batch size. Hugging Face decoders come
both ways users call them: with an ``attention_mask`` whose last row is padded (the path padded
batches take, README) and without one (packed pretraining batches, where transformers' SDPA path
materialises no mask).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.models import unet_example

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny configs only; a download would be a bug

VOCAB, PAD = 64, 0
SEQ = 64  # tokens per row of every language model
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD}
# The decoder shape Llama, Mistral, Qwen2, Mixtral and Qwen2-MoE share: grouped-query attention
# (4 query heads, 2 key/value heads), RoPE, RMSNorm, SwiGLU, attention dropout.
DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    use_cache=False, **SPECIAL,
)  # fmt: skip
# The same shape with one key/value head per query head (GPT-NeoX, Phi).
MHA_DECODER = {k: v for k, v in DECODER.items() if k != "num_key_value_heads"}

Example = tuple[nn.Module, Any]


def tokens(batch: int, *, mask: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    """A causal-LM batch of ``batch`` x SEQ; with ``mask`` the last row is right-padded by an
    eighth of its length (mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    if not mask:
        return {"input_ids": ids, "labels": ids}
    m = torch.ones_like(ids)
    ids[-1, -SEQ // 8 :] = PAD
    m[-1, -SEQ // 8 :] = 0
    return {"input_ids": ids, "attention_mask": m, "labels": ids.masked_fill(m == 0, -100)}


def _hf(config_cls: str, model_cls: str, mask: bool, **cfg: Any) -> Callable[[int], Example]:
    def make(batch: int) -> Example:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**cfg)
        model = getattr(transformers, model_cls)(config).train()
        return model, tokens(batch, mask=mask)

    return make


def bert(batch: int) -> Example:
    """BERT masked LM: encoder-only, attention mask, token types, dropout."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=SEQ, pad_token_id=PAD,
    )  # fmt: skip
    return BertForMaskedLM(cfg).train(), tokens(batch, mask=True)


def bart(batch: int) -> Example:
    """Bart: encoder-decoder (cross-attention), decoder inputs shifted from the labels."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=SEQ, use_cache=False,
        decoder_start_token_id=2, **SPECIAL,
    )  # fmt: skip
    x = tokens(batch, mask=False)
    return BartForConditionalGeneration(cfg).train(), x


def t5(batch: int) -> Example:
    """T5: encoder-decoder with relative position bias, no attention mask."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, use_cache=False, decoder_start_token_id=PAD, pad_token_id=PAD,
        eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg).train(), tokens(batch, mask=False)


def _images(batch: int, labels: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(batch, 3, 32, 32, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, labels, (batch,), generator=g)}


def vit(batch: int) -> Example:
    """ViT image classifier: 32x32 images, 4x4 patches (64 and a class token: with 8x8 patches,
    17 tokens, the step's peak was its parameters' gradients, which no plan lowers)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
    )  # fmt: skip
    return ViTForImageClassification(cfg).train(), _images(batch, 10)


def mamba(batch: int) -> Example:
    """Mamba: a selective state-space model (the sequential scan, no fused kernels on CPU)."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    cfg = MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, use_cache=False, **SPECIAL,
    )  # fmt: skip
    x = tokens(batch, mask=False)
    x["input_ids"], x["labels"] = x["input_ids"][:, :32], x["labels"][:, :32]
    return MambaForCausalLM(cfg).train(), x


def mamba2(batch: int) -> Example:
    """Mamba-2: state-space duality, chunked scan (the torch path on CPU)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    cfg = Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
        state_size=8, n_groups=1, expand=2, chunk_size=16, use_cache=False, **SPECIAL,
    )  # fmt: skip
    return Mamba2ForCausalLM(cfg).train(), tokens(batch, mask=False)


def resnet(batch: int) -> Example:
    """Hugging Face's ResNet: BatchNorm in every block, residual adds."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=2)
    return ResNetForImageClassification(cfg).train(), _images(batch, 2)


def swin(batch: int) -> Example:
    """Swin: shifted-window attention, patch merging between stages."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    cfg = SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=2,
    )  # fmt: skip
    return SwinForImageClassification(cfg).train(), _images(batch, 2)


def whisper(batch: int) -> Example:
    """Whisper: a speech encoder (convolutions over log-mel features) and a text decoder."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=32, max_target_positions=32,
        decoder_start_token_id=1, use_cache=False, **SPECIAL,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    features = torch.randn(batch, 16, 64, generator=g)  # 2 x max_source_positions frames
    labels = torch.randint(3, VOCAB, (batch, 16), generator=g)
    return WhisperForConditionalGeneration(cfg).train(), {
        "input_features": features,
        "labels": labels,
    }


class ConvBNReLU(nn.Sequential):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
        )


class CNN(nn.Module):
    """A VGG-style CNN: conv -> BatchNorm -> in-place ReLU stages, pooling, a linear head."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            ConvBNReLU(3, channels),
            ConvBNReLU(channels, channels),
            nn.MaxPool2d(2),
            ConvBNReLU(channels, 2 * channels),
            ConvBNReLU(2 * channels, 2 * channels),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def cnn(batch: int) -> Example:
    torch.manual_seed(0)
    return CNN().train(), torch.randn(batch, 3, 32, 32)


def unet(batch: int) -> Example:
    """benchmarks' U-Net: long encoder->decoder skips, BatchNorm, 2 levels."""
    model, x = unet_example(batch=batch, size=32, seed=0, channels=4, depth=2)
    return model.train(), x


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (pre-norm, GELU, dropout, batch first) with a linear head."""

    def __init__(self, d: int = 64, n_layer: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d, 4, 2 * d, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def transformer_encoder(batch: int) -> Example:
    torch.manual_seed(0)
    return Encoder().train(), torch.randn(batch, SEQ, 64)


ZOO: dict[str, Callable[[int], Example]] = {
    # decoders, grouped-query attention through SDPA
    "llama": _hf("LlamaConfig", "LlamaForCausalLM", True, **DECODER),
    "mistral": _hf("MistralConfig", "MistralForCausalLM", False, sliding_window=None, **DECODER),
    "qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", False, **DECODER),
    "gpt2": _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        True,
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=2,
        use_cache=False,
        **SPECIAL,
    ),  # fmt: skip
    "gpt_neox": _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", False, **MHA_DECODER),
    # logit soft-capping, sliding-window layers, head_dim apart from the width
    "gemma2": _hf(
        "Gemma2Config", "Gemma2ForCausalLM", True, head_dim=16, sliding_window=32, **DECODER
    ),
    # parallel attention and MLP, rotary on part of each head
    "gptj": _hf(
        "GPTJConfig",
        "GPTJForCausalLM",
        False,
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_positions=SEQ,
        use_cache=False,
        **SPECIAL,
    ),  # fmt: skip
    "phi": _hf("PhiConfig", "PhiForCausalLM", False, **MHA_DECODER),
    # a custom autograd.Function (Bloom's GeLU), ALiBi
    "bloom": _hf(
        "BloomConfig",
        "BloomForCausalLM",
        True,
        vocab_size=VOCAB,
        hidden_size=64,
        n_layer=2,
        n_head=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cache=False,
        **SPECIAL,
    ),  # fmt: skip
    "bert": bert,
    "bart": bart,
    "t5": t5,
    "vit": vit,
    # mixtures of experts
    "mixtral": _hf(
        "MixtralConfig",
        "MixtralForCausalLM",
        False,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        **DECODER,
    ),  # fmt: skip
    "qwen2_moe": _hf(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **DECODER,
    ),  # fmt: skip
    "qwen3_moe": _hf(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        False,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        **DECODER,
    ),  # fmt: skip
    "mamba": mamba,
    "mamba2": mamba2,
    # attention, Mamba and mixture-of-experts layers in one model
    "jamba": _hf(
        "JambaConfig",
        "JambaForCausalLM",
        False,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_expand=2,
        use_mamba_kernels=False,
        **DECODER,
    ),  # fmt: skip
    # disentangled attention (relative positions)
    "deberta_v2": _hf(
        "DebertaV2Config",
        "DebertaV2ForMaskedLM",
        True,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        **SPECIAL,
    ),  # fmt: skip
    "resnet": resnet,
    "swin": swin,
    "whisper": whisper,
    # plain torch
    "cnn": cnn,
    "unet": unet,
    "transformer_encoder": transformer_encoder,
}
