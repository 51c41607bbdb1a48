"""Shared by the CUDA tests: small models moved to a device, and gradients compared within a
tolerance (CUDA kernels that accumulate with atomics, SDPA's memory-efficient backward or
index_put's, are not bitwise deterministic from one run to the next).

Every helper takes the device, so a test body can be run on the CPU as well (how the bodies
were checked on a machine without a GPU)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

import planner
from benchmarks.models import GPTConfig, gpt_example
from benchmarks.plan_7b import LlamaConfig, llama_example
from tests.helpers import step

# Activations of a few hundred KiB each: the caching allocator rounds every block up to 512
# bytes, which the memory model does not price, so the tensors must dwarf that rounding for
# predictions to hold within 1% (bias gradients of 512 B are a few of the step's MiB).
GPT_SMALL = GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=256, vocab_size=256)
LLAMA_SMALL = LlamaConfig(
    n_layer=2,
    d_model=128,
    n_head=4,
    d_ff=352,
    vocab_size=256,
    seq_len=256,
    batch=4,
    dtype=torch.float32,
    attention="sdpa",
)


def to_device(value: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def gpt(device: torch.device, cfg: GPTConfig = GPT_SMALL, batch: int = 4, seed: int = 0):
    """GPT-ref's architecture at ``cfg``, built on the CPU (the same weights on every device)."""
    model, example = gpt_example(cfg, batch=batch, seed=seed)
    return model.to(device), to_device(example, device)


def llama(device: torch.device, cfg: LlamaConfig = LLAMA_SMALL, seed: int = 0):
    """plan_7b's Llama (RMSNorm, rotary, SwiGLU, SDPA core attention) at ``cfg``."""
    torch.manual_seed(seed)
    model, _ = llama_example(cfg, device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    shape = (cfg.batch, cfg.seq_len)
    idx = torch.randint(0, cfg.vocab_size, shape, generator=g)
    targets = torch.randint(0, cfg.vocab_size, shape, generator=g)
    return model.to(device), to_device((idx, targets), device)


MODELS = {"gpt": gpt, "llama": llama}


def assert_close_step_copy(
    reference: nn.Module,
    model: nn.Module,
    example_input: Any,
    seed: int = 0,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> None:
    """``model`` (equal in value to ``reference``) gives the loss and every gradient
    ``reference`` gives, within ``rtol``/``atol`` (the same seed, dropout included)."""
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]
    loss_a, grads_a = step(reference, example_input, _trained(reference), seed)
    loss_b, grads_b = step(model, example_input, _trained(model), seed)
    torch.testing.assert_close(loss_b, loss_a, rtol=rtol, atol=atol)
    for name, ga, gb in zip(names, grads_a, grads_b):
        assert (ga is None) == (gb is None), name
        if ga is not None:
            torch.testing.assert_close(gb, ga, rtol=rtol, atol=atol, msg=f"gradient of {name}")


def assert_close_step(
    model: nn.Module, module: nn.Module, example_input: Any, *, rtol=1e-4, atol=1e-6
) -> None:
    """``module`` (sharing ``model``'s parameters: a graph plan's GraphModule) gives the loss
    and gradients ``model`` gives, within tolerance."""
    params = _trained(model)
    loss_a, grads_a = step(model, example_input, params)
    loss_b, grads_b = step(module, example_input, params)
    torch.testing.assert_close(loss_b, loss_a, rtol=rtol, atol=atol)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, ga, gb in zip(names, grads_a, grads_b):
        assert (ga is None) == (gb is None), name
        if ga is not None:
            torch.testing.assert_close(gb, ga, rtol=rtol, atol=atol, msg=f"gradient of {name}")


def _trained(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def plan_half(model: nn.Module, example_input: Any, form: str, eager_bytes: int):
    """The plan at half ``eager_bytes``, or at the least feasible budget when half is not."""
    try:
        return planner.plan(model, example_input, eager_bytes / 2 / 1e9, form=form)
    except planner.InfeasibleBudgetError as e:
        assert e.min_bytes > eager_bytes / 2
        return planner.plan(model, example_input, (e.min_bytes + 0.5) / 1e9, form=form)
