"""The rewritten module composes with torch.compile, DDP and FSDP2 (CPU, gloo, 2 processes)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.models import GPT, GPTConfig
from planner.passes.capture import capture
from planner.passes.regions import Region
from planner.passes.rewrite import CALL_OPS, rewrite
from tests.helpers import assert_same_step, step

# Dropout off for the distributed tests: each rank draws its own masks, so a 2-rank step can
# only match a 1-process step when nothing is random.
TINY = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64, dropout=0.0)


def _build(cfg: GPTConfig = TINY, batch: int = 4):
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    return model, (idx, tgt)


def _rewritten(model, example_input):
    """Two regions, the second with two nested ones: every region kind path is exercised."""
    gm = capture(model, example_input).module
    calls = [n.name for n in gm.graph.nodes if n.op in CALL_OPS]
    regions = [
        Region("ckpt_a", tuple(calls[3:30])),
        Region("ckpt_b", tuple(calls[30:60])),
        Region("ckpt_b_1", tuple(calls[32:40]), depth=1),
        Region("ckpt_b_2", tuple(calls[45:55]), depth=1, kind="selective",
               saved_nodes=(calls[46],)),
    ]  # fmt: skip
    return rewrite(gm, regions)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compile_aot_eager_bitwise(dropout):
    """Dynamo + AOTAutograd trace the checkpoint regions without graph breaks."""
    torch._dynamo.reset()
    cfg = GPTConfig(**{**TINY.__dict__, "dropout": dropout})
    model, example_input = _build(cfg)
    compiled = torch.compile(_rewritten(model, example_input), backend="aot_eager")
    assert_same_step(model, compiled, example_input)


@pytest.mark.slow
def test_compile_inductor_close():
    torch._dynamo.reset()
    model, example_input = _build(GPTConfig(**{**TINY.__dict__, "dropout": 0.1}))
    params = list(model.parameters())
    compiled = torch.compile(_rewritten(model, example_input))
    # inductor draws its own random numbers unless told to use eager's
    with torch._inductor.config.patch(fallback_random=True):
        loss, grads = step(compiled, example_input, params)
    ref_loss, ref_grads = step(model, example_input, params)
    torch.testing.assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _worker(rank: int, world: int, init: str, out: str, modes: tuple[str, ...]) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {}
        for mode in modes:
            model, (idx, tgt) = _build()
            part = (idx.chunk(world)[rank], tgt.chunk(world)[rank])
            if mode == "ddp_model":
                module = torch.nn.parallel.DistributedDataParallel(model)
            elif mode == "ddp":
                module = torch.nn.parallel.DistributedDataParallel(_rewritten(model, part))
            else:
                from torch.distributed.fsdp import fully_shard

                module = fully_shard(_rewritten(model, part))
            loss = module(*part)
            loss.backward()
            grads = {}
            for name, p in module.named_parameters():
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name.removeprefix("module.")] = grad.detach().clone()
            results[mode] = {"loss": loss.detach(), "grads": grads}
        if rank == 0:
            torch.save(results, out)
        # Both ranks leave together: a rank tearing gloo down while its peer's last collective
        # is still in flight aborts the process (seen once in CI: SIGABRT, "terminate called
        # without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_distributed(modes: tuple[str, ...], tmp_path) -> dict:
    out = tmp_path / "results.pt"
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/init", str(out), modes), nprocs=2, join=True)
    return torch.load(out)


def _single_process_grads() -> dict:
    model, example_input = _build()
    model(*example_input).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
def test_ddp_gloo_two_processes(tmp_path):
    results = _run_distributed(("ddp", "ddp_model"), tmp_path)
    ours, theirs = results["ddp"], results["ddp_model"]
    # DDP over the rewritten module == DDP over the model, bit for bit
    assert theirs["grads"].keys() == ours["grads"].keys()
    for name, g in theirs["grads"].items():
        assert torch.equal(g, ours["grads"][name]), name
    # and == one process on the whole batch, up to the all-reduce's float rounding
    for name, g in _single_process_grads().items():
        torch.testing.assert_close(ours["grads"][name], g, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_gloo_two_processes(tmp_path):
    ours = _run_distributed(("fsdp",), tmp_path)["fsdp"]
    single = _single_process_grads()
    assert ours["grads"].keys() == single.keys()
    for name, g in single.items():
        torch.testing.assert_close(ours["grads"][name], g, rtol=1e-5, atol=1e-6)


def test_compile_batchnorm_state_once_per_step():
    """BatchNorm regions under torch.compile: dynamo runs them eagerly (their once-only state
    update is a side effect it will not trace) and the running statistics stay exact."""
    import copy

    from benchmarks.models import residual_cnn_example

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, x = residual_cnn_example(batch=4, size=8, n_blocks=2, channels=8)
    model = copy.deepcopy(ref)
    gm = capture(model, x).module
    calls = [n.name for n in gm.graph.nodes if n.op in CALL_OPS]
    compiled = torch.compile(
        rewrite(gm, [Region("ckpt_a", tuple(calls[:8])), Region("ckpt_b", tuple(calls[8:16]))]),
        backend="aot_eager",
    )
    for module in (ref, compiled):
        for s in range(3):
            torch.manual_seed(s)
            module(x).sum().backward()
    assert model.stem[1].num_batches_tracked.item() == 3
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def _backward_addmms(module, example_input) -> int:
    """addmm calls in the backward graph inductor's partitioner makes (min-cut, inductor's
    decompositions; graphs run eagerly): each one is a linear recomputed in backward."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import select_decomp_table

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=keep,
        bw_compiler=keep,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )
    torch._dynamo.reset()
    # a cached graph would skip the partitioner
    with torch._functorch.config.patch(enable_autograd_cache=False):
        step(torch.compile(module, backend=backend), example_input, list(module.parameters()))
    forward, backward = graphs
    return sum(n.target is torch.ops.aten.addmm.default for n in backward.graph.nodes)


def test_compile_selective_regions_keep_what_they_save():
    """Under torch.compile a selective region still keeps the ops planner saves: the
    partitioner sees them as MUST_SAVE and recomputes none of its linears in backward (it
    used to see every op as PREFER_RECOMPUTE and recompute all of them, like a plain region)."""
    from tests.passes.test_rewrite_training import _is_matmul, _regions

    model, example_input = _build(GPTConfig(**{**TINY.__dict__, "dropout": 0.1}))
    gm = capture(model, example_input).module
    blocks = ["blocks.0", "blocks.1"]
    plain = rewrite(gm, _regions(gm, blocks))
    selective = rewrite(gm, _regions(gm, blocks, kind="selective", saved=_is_matmul))
    # 4 biased linears a block, 2 blocks, all recomputed but the last block's output
    # projection: only dropout (its mask is saved, random ops never recompute) and the
    # residual add read it, and neither needs it in backward
    assert _backward_addmms(plain, example_input) == 7
    assert _backward_addmms(selective, example_input) == 0
    torch._dynamo.reset()
    assert_same_step(model, torch.compile(selective, backend="aot_eager"), example_input)
