"""Per-rank plans under FSDP2 (planner/fsdp.py, simulate's Rule 11).

- The buffer changes of a tiny sharded model, byte by byte, from hand-computed padded sizes.
- simulate applies a change after node i's backward before recomputing a region ending at i-1.
- CPU, gloo, 2 and 4 processes, ``fully_shard`` per block and root (``planner.fsdp.shard``) of a
  tiny GPT-ref and a tiny HF Llama with a per-rank plan applied: every rank's measured peak is
  within its budget and within 5% of the prediction, and the gradients (all-gathered to full)
  equal one process on the whole batch within 1e-6. Measured with ``planner.measure(...,
  method="profiler")``: FSDP2 allocates its unsharded parameters by resizing storages, which only
  the allocator's events see (the dispatch-mode tracker misses them).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import planner
from benchmarks.models import GPT, GPTConfig
from planner.devices import profile_of_model
from planner.fsdp import FSDPConfig, fsdp_changes, per_rank, shard
from planner.passes.eager import eager_graph
from planner.passes.step import call, training_loss
from planner.solvers.costgraph import BufferChange, CostGraph, Node, Region, Schedule, Tensor
from planner.solvers.errors import UnsupportedModelError
from planner.solvers.simulate import simulate

MiB = 2**20


# --- pricing, by hand ---------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 3) for _ in range(2))
        self.head = nn.Linear(3, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, x[:, :1]], dim=1)  # 3 -> 4 features: a root op before the blocks
        for block in self.blocks:
            x = torch.cat([block(x), x[:, :1]], dim=1)
        return self.head(x[:, :3]).sum()


def test_buffer_changes_hand_computed():
    model, x = _Tiny(), torch.randn(2, 3)
    eg = eager_graph(model, x, rates=profile_of_model(model))
    changes = fsdp_changes(model, eg, FSDPConfig(world_size=2))
    # A block: weight 3x4 padded to 4 rows (4*4*4 = 64 B) + bias 3 padded to 4 (16 B) = 80 B
    # all-gathered; gradients unpadded 48 + 12 = 60 B; sharded gradients 80 / 2 = 40 B.
    # The root: head weight 1x3 padded to 2 rows = 24 B; gradient 12 B; sharded 12 B.
    b0, b1 = eg.module_spans["blocks.0"], eg.module_spans["blocks.1"]
    n, root_stop = len(eg.graph.nodes), eg.module_spans[""][1]
    expected = [
        (("fwd", -1), 24, "fsdp:all-gather root"),
        (("fwd", -1), 24, "fsdp:unshard root"),
        (("fwd", b0[0] - 1), 80, "fsdp:all-gather blocks.0"),
        (("fwd", b0[0] - 1), -24, ""),  # the root's all-gather output, after copy-out
        (("fwd", b0[0] - 1), 80, "fsdp:unshard blocks.0"),
        (("fwd", b0[1] - 1), -80, ""),  # reshard after forward
        (("fwd", b1[0] - 1), 80, "fsdp:all-gather blocks.1"),
        (("fwd", b1[0] - 1), -80, ""),
        (("fwd", b1[0] - 1), 80, "fsdp:unshard blocks.1"),
        (("fwd", b1[1] - 1), -80, ""),
        (("fwd", root_stop - 1), -80, ""),  # the root's post-forward: the last all-gather output
        (("bwd", n), 80, "fsdp:all-gather blocks.1"),  # the root's backward prefetch
        (("bwd", b1[1]), 80, "fsdp:unshard blocks.1"),
        (("bwd", b1[1]), -80, ""),
        (("bwd", b1[1]), 80, "fsdp:all-gather blocks.0"),  # prefetch
        (("bwd", b1[0]), -80, ""),  # post-backward: reshard
        (("bwd", b1[0]), 80, "fsdp:reduce-scatter input blocks.1"),
        (("bwd", b1[0]), -60, ""),  # unsharded gradients
        (("bwd", b1[0]), 40, "fsdp:sharded grads blocks.1"),
        (("bwd", b0[1]), 80, "fsdp:unshard blocks.0"),
        (("bwd", b0[1]), -80, ""),
        (("bwd", b0[0]), -80, ""),
        (("bwd", b0[0]), -80, ""),  # blocks.1's reduce-scatter input
        (("bwd", b0[0]), 80, "fsdp:reduce-scatter input blocks.0"),
        (("bwd", b0[0]), -60, ""),
        (("bwd", b0[0]), 40, "fsdp:sharded grads blocks.0"),
        (("bwd", 0), -24, ""),
        (("bwd", 0), -80, ""),
        (("bwd", 0), 24, "fsdp:reduce-scatter input root"),
        (("bwd", 0), -12, ""),
        (("bwd", 0), 12, "fsdp:sharded grads root"),
        (("bwd", 0), -24, ""),  # the last reduce-scatter input, at the final callback
    ]
    assert [(c.after, c.delta_bytes, c.what) for c in changes] == expected
    # By the step's end only the sharded gradients are left of FSDP2's buffers, and the
    # unsharded gradients (which the graph's nodes allocate) are gone.
    assert sum(c.delta_bytes for c in changes) == (40 + 40 + 12) - (60 + 60 + 12)
    # Gloo adds a transient copy of the unit to each collective.
    gloo = fsdp_changes(model, eg, FSDPConfig(world_size=2, backend="gloo"))
    assert sum(c.delta_bytes for c in gloo) == (40 + 40 + 12) - (60 + 60 + 12)
    assert ("fsdp:all-gather blocks.0 (gloo copy)", 80) in [(c.what, c.delta_bytes) for c in gloo]


def test_regions_stay_inside_units():
    model, x = _Tiny(), torch.randn(2, 3)
    eg = per_rank(
        model, eager_graph(model, x, rates=profile_of_model(model)), FSDPConfig(world_size=2)
    )
    units = [eg.module_spans[p] for p in ("blocks.0", "blocks.1")]
    assert set(eg.spans.values()) >= {"blocks.0", "blocks.1", "head"}
    assert "" not in eg.spans.values()  # the root's call spans both blocks
    for start, stop in eg.graph.region_spans:
        assert all(stop <= a or start >= b or (a <= start and stop <= b) for a, b in units)


def test_bad_config():
    with pytest.raises(ValueError, match="world_size"):
        FSDPConfig(world_size=0)
    with pytest.raises(ValueError, match="backend"):
        FSDPConfig(world_size=2, backend="mpi")
    model, x = _Tiny(), torch.randn(2, 3)
    with pytest.raises(UnsupportedModelError, match="does not have"):
        planner.plan(model, x, 1.0, form="inplace", fsdp=FSDPConfig(2, units=("nope",)))
    with pytest.raises(ValueError, match="form='inplace'"):
        planner.plan(model, x, 1.0, fsdp=FSDPConfig(2), form="graph")


def test_backward_change_precedes_recomputation():
    """Rule 11: FSDP2 all-gathers a block when its output's gradient is ready, before the
    checkpoint inside it recomputes, so the recomputation's peak includes the parameters."""
    nodes = tuple(Node(f"n{i}", saves_for_backward=True) for i in range(3))
    tensors = (
        Tensor("a", 100, 0, users=(1,), saved_by=(1,)),
        Tensor("b", 10, 1, users=(2,), saved_by=(2,)),
        Tensor("c", 1, 2),
    )
    unshard = BufferChange(("bwd", 2), 1000, "unshard")
    graph = CostGraph(nodes, tensors, buffer_changes=(unshard, BufferChange(("bwd", 0), -1000)))
    sim = simulate(graph, Schedule((Region(0, 2),)))
    timeline = dict(sim.timeline)
    assert timeline["fwd:n1"] == 110  # no change applies in forward
    assert timeline["unshard"] == 1000  # after n2's backward freed b
    # the recomputation runs with the unit's 1000 B live: a (100), then b (10) too
    assert timeline["recompute:n0"] == 1000 + 100
    assert sim.peak_bytes == timeline["recompute:n1"] == 1000 + 100 + 10
    assert [e for e, _ in sim.timeline].count("unshard") == 1


# --- FSDP2 on gloo, 2 and 4 processes -----------------------------------------------------------

GPT_CFG = GPTConfig(n_layer=3, d_model=32, n_head=2, seq_len=64, vocab_size=64, dropout=0.0)
# Sequences per rank. Gloo's worker thread frees its transient copy of a unit (Rule 11) a moment
# early or late, so a rank can measure one unit's bytes above or below the prediction (seen:
# Llama rank 0 +37,120 B, one layer; GPT -50,816 B): the micro-batches are sized so that one
# unit is under 2% of a rank's peak.
PER_RANK = 8
LLAMA_PER_RANK, LLAMA_SEQ = 4, 128  # its width is 32: its activations per token are small


def _gpt(world: int):
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    g = torch.Generator().manual_seed(1)
    shape = (PER_RANK * world, GPT_CFG.seq_len)
    idx = torch.randint(0, GPT_CFG.vocab_size, shape, generator=g)
    tgt = torch.randint(0, GPT_CFG.vocab_size, shape, generator=g)
    return model, (idx, tgt)


def _llama(world: int):
    from tests.models_zoo import llama_example

    model, _ = llama_example()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0  # each rank would draw its own masks
    g = torch.Generator().manual_seed(1)
    shape = (LLAMA_PER_RANK * world, LLAMA_SEQ)
    ids = torch.randint(0, model.config.vocab_size, shape, generator=g)
    # With the mask, as test_inplace_hf plans Llama: without one, transformers takes a causal
    # SDPA path whose no-plan peak the eager estimator prices 10% high (a single process too).
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


BUILD = {"gpt": _gpt, "llama": _llama}


def _rank_part(x, rank: int, world: int):
    if isinstance(x, dict):
        return {k: v.chunk(world)[rank] for k, v in x.items()}
    return tuple(t.chunk(world)[rank] for t in x)


def _worker(rank: int, world: int, init: str, plans: dict[str, str], out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {}
        for name, plan_path in plans.items():
            model, x = BUILD[name](world)
            part = _rank_part(x, rank, world)
            assert planner.apply_plan(model, plan_path) is model
            shard(model, FSDPConfig(world, backend="gloo"))
            # Gloo's worker thread sometimes drops its reference to a collective's buffer after
            # the main thread moved on (a race: the same step measures one unit higher now and
            # then), so each rank measures twice and keeps the least.
            peaks = [planner.measure(model, part, method="profiler").peak_bytes for _ in range(2)]
            loss = training_loss(call(model, part))
            loss.backward()
            grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}
            results[name] = {"peaks": peaks, "grads": grads}
        torch.save(results, f"{out}.{rank}")
        dist.barrier()  # all leave together: tearing gloo down mid-collective aborts a peer
    finally:
        dist.destroy_process_group()


def _plan(name: str, world: int, plan_path: str):
    """The per-rank plan at 70% of the unplanned per-rank peak; one process's gradients on the
    whole batch with it applied; and, for the same plan on one rank's micro-batch without
    sharding, the measured and predicted peaks (what FSDP2 adds is the difference)."""
    model, x = BUILD[name](world)
    part = _rank_part(x, 0, world)  # every rank's micro-batch has this shape
    config = FSDPConfig(world, backend="gloo")
    unplanned = per_rank(model, eager_graph(model, part, rates=profile_of_model(model)), config)
    no_plan_bytes = simulate(unplanned.graph, Schedule()).peak_bytes
    # The CPU profile's roofline, not the ops timed on this machine: the same plan on every run.
    p = planner.plan(
        model, part, 0.7 * no_plan_bytes / 1e9, form="inplace", fsdp=config, device="cpu"
    )
    assert p.regions, "70% of the unplanned per-rank peak should need checkpointing"
    p.save(plan_path)
    p.apply(model)
    unsharded = {
        "measured": planner.measure(model, part, method="profiler").peak_bytes,
        "predicted": simulate(replace(p.graph, buffer_changes=()), p.schedule).peak_bytes,
    }
    training_loss(call(model, x)).backward()
    return p, no_plan_bytes, unsharded, {n: t.grad for n, t in model.named_parameters()}


# Predicted within 5% of measured, on every rank, for both (measured here: GPT-ref -0.0%, Llama
# -0.1%, 2 and 4 ranks, three runs). Llama was 7.2% low until the CostGraph priced the CPU RNG
# state each checkpoint call stashes (simulate's Rule 12; its SDPA is tagged as drawing random
# numbers, so every attention region still does): its plan keeps 8 regions. What FSDP2
# adds is also checked on its own.
WHOLE_WITHIN_5 = ("gpt", "llama")


@pytest.mark.slow
# Four ranks (four processes on CI's two cores) for Llama alone, whose grouped-query attention
# and RNG-stashing regions are the harder prediction: both models took 38 s there.
@pytest.mark.parametrize("world, names", [(2, ("gpt", "llama")), (4, ("llama",))])
def test_fsdp2_per_rank_plans(tmp_path, world, names):
    paths = {name: str(tmp_path / f"{name}.json") for name in names}
    planned = {name: _plan(name, world, paths[name]) for name in names}
    out = str(tmp_path / "results.pt")
    init = f"file://{tmp_path}/init"
    mp.spawn(_worker, args=(world, init, paths, out), nprocs=world, join=True)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(world)]
    for name in names:
        p, no_plan_bytes, unsharded, single = planned[name]
        fsdp_predicted = p.predicted_peak_bytes - unsharded["predicted"]
        print(
            f"\n{name}, {world} ranks: per-rank budget {p.budget_bytes / MiB:.3f} MiB, predicted "
            f"{p.predicted_peak_bytes / MiB:.3f} MiB (no plan {no_plan_bytes / MiB:.3f} MiB), "
            f"regions {[r.name for r in p.regions]}; same plan unsharded: predicted "
            f"{unsharded['predicted'] / MiB:.3f} MiB, "
            f"measured {unsharded['measured'] / MiB:.3f} MiB"
        )
        for rank, results in enumerate(ranks):
            peaks = results[name]["peaks"]
            measured = min(peaks)
            error = (p.predicted_peak_bytes - measured) / measured
            fsdp_measured = measured - unsharded["measured"]
            print(
                f"  rank {rank}: measured {measured / MiB:.3f} MiB ({error:+.1%}; both "
                f"measurements {[round(b / MiB, 3) for b in peaks]} MiB); FSDP2 adds "
                f"{fsdp_measured} B measured, {fsdp_predicted} B predicted"
            )
        for rank, results in enumerate(ranks):
            measured = min(results[name]["peaks"])
            assert measured <= p.budget_bytes, f"{name} rank {rank}"
            fsdp_measured = measured - unsharded["measured"]
            # 2%: gloo's worker thread frees a collective's buffer a moment early or late, so
            # the same step measures up to ~1.1% of the peak apart between runs (4 processes).
            assert abs(fsdp_predicted - fsdp_measured) <= 0.02 * measured, f"{name} rank {rank}"
            if name in WHOLE_WITHIN_5:
                error = abs(p.predicted_peak_bytes - measured) / measured
                assert error <= 0.05, f"{name} rank {rank}: {p.predicted_peak_bytes}, {measured}"
            grads = results[name]["grads"]
            assert grads.keys() == single.keys()
            for n, g in single.items():
                diff = (grads[n] - g).abs().max().item()
                assert diff <= 1e-6, f"{name} rank {rank}: gradient of {n} off by {diff}"
