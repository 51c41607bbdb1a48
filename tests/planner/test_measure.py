"""measure(): agrees with MemTracker, is exact where bytes can be counted by hand, sees the
memory that checkpointing saves, and leaves the caller's grads, buffers and RNG alone."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from benchmarks.models import (
    gpt_ref_small_example,
    mlp_example,
    residual_cnn_example,
)
from planner.measurement import measure, measured_step_time
from planner.passes.step import call, split_input, training_loss

F32 = 4


def memtracker_peak_bytes(model: nn.Module, example_input) -> int:
    """Peak of the same step under torch's own MemTracker, above what existed before it."""
    for p in model.parameters():
        p.grad = None
    args, kwargs = split_input(example_input)
    tracker = MemTracker()
    tracker.track_external(model, *args, *kwargs.values())
    cpu = torch.device("cpu")
    base_bytes = tracker.get_tracker_snapshot("current")[cpu]["Total"]
    with tracker:
        training_loss(call(model, example_input)).backward()
    for p in model.parameters():
        p.grad = None
    return tracker.get_tracker_snapshot("peak")[cpu]["Total"] - base_bytes


EXAMPLES = {
    "gpt_ref_small": gpt_ref_small_example,
    "residual_cnn": lambda: residual_cnn_example(batch=4, size=16),
    "mlp": lambda: mlp_example(batch=64, width=128, depth=3),
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_peak_agrees_with_memtracker(name):
    model, x = EXAMPLES[name]()
    m = measure(model, x)
    reference_bytes = memtracker_peak_bytes(model, x)
    assert m.method == "tracker"
    assert abs(m.peak_bytes - reference_bytes) <= 0.02 * reference_bytes
    assert 0 < m.saved_bytes < m.peak_bytes
    assert m.step_time_s > 0


def test_linear_chain_bytes_are_exact():
    # y = W3 W2 W1 x, no bias, loss = y.sum(). Forward keeps h1, h2 for the weight gradients
    # (h3 is dropped: sum's backward needs only its shape; x and the W are baseline).
    batch, d0, d1, d2, d3 = 64, 16, 32, 48, 8
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(d0, d1, bias=False), nn.Linear(d1, d2, bias=False), nn.Linear(d2, d3, bias=False)
    )
    x = torch.randn(batch, d0)
    h1, h2 = batch * d1 * F32, batch * d2 * F32
    dh1, dh2 = h1, h2  # input gradients have their activations' shapes
    g1, g2, g3 = d0 * d1 * F32, d1 * d2 * F32, d2 * d3 * F32
    scalars = 2 * F32  # the loss and its ones_like seed gradient

    m = measure(model, x)

    assert m.saved_bytes == h1 + h2
    # Peak: right after layer 2's backward, h2 is gone but h1 (layer 1's weight grad needs it),
    # dh2 (layer 2's incoming grad), dh1 and the weight grads of layers 3 and 2 are all alive.
    assert m.peak_bytes == h1 + dh2 + dh1 + g3 + g2 + scalars
    assert m.peak_event.startswith("backward:")
    # After backward only the parameter gradients remain: gradients made in backward count.
    assert m.timeline[-1] == ("backward:end", g1 + g2 + g3)


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def test_checkpoint_every_block_measures_lower_than_eager():
    model, x = gpt_ref_small_example()
    eager = measure(model, x)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block)
    ckpt = measure(model, x)
    assert ckpt.peak_bytes < eager.peak_bytes
    assert ckpt.saved_bytes < eager.saved_bytes
    assert ckpt.peak_bytes == pytest.approx(memtracker_peak_bytes(model, x), rel=0.02)


@pytest.mark.parametrize("name", ["gpt_ref_small", "mlp"])
def test_profiler_agrees_with_tracker_on_eager(name):
    model, x = EXAMPLES[name]()
    tracked = measure(model, x, method="tracker")
    profiled = measure(model, x, method="profiler")
    assert profiled.method == "profiler"
    assert profiled.peak_bytes == pytest.approx(tracked.peak_bytes, rel=0.02)
    assert profiled.saved_bytes == pytest.approx(tracked.saved_bytes, rel=0.02)


def test_compiled_module_is_measured_with_the_profiler():
    torch._dynamo.reset()
    model, x = EXAMPLES["mlp"]()
    eager = measure(model, x)
    compiled = measure(torch.compile(model, backend="aot_eager"), x)
    assert compiled.method == "profiler"
    assert compiled.peak_bytes == pytest.approx(eager.peak_bytes, rel=0.02)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "run",
    [lambda m, x: measure(m, x, warmup=1, repeats=2), measured_step_time],
    ids=["measure", "measured_step_time"],
)
def test_leaves_grads_buffers_and_rng_as_found(run):
    model, x = residual_cnn_example(batch=4, size=16)
    training_loss(model(x)).backward()
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads]
    bn = model.stem[1]
    running_mean, batches = bn.running_mean.clone(), bn.num_batches_tracked.clone()
    rng = torch.get_rng_state()

    run(model, x)

    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(g, v) for g, v in zip(grads, grad_values))
    assert torch.equal(bn.running_mean, running_mean)
    assert torch.equal(bn.num_batches_tracked, batches)
    assert torch.equal(torch.get_rng_state(), rng)


class _GrowsEachCall(nn.Module):
    """Reads another number of rows each call: a recomputation does not redo its forward alike."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.linear(x)[: 1 + self.calls % 3]
        return (y * y).sum()


class _AtenCalls(TorchDispatchMode):
    """Counts the aten calls run under it: a clock that ticks 1 us per call, whatever the load."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def now_s(self) -> float:
        return self.calls * 1e-6

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_step_time_prices_recomputation_when_the_model_can_be_checkpointed(monkeypatch):
    """Timed by a clock that counts the aten calls run (a real clock's ordering of a 50 ms
    step's variants moves with the machine's load): the steps checkpointed whole, plain and
    selective, run the forward again beside the plain step."""
    from planner import measurement

    model, x = residual_cnn_example(batch=4, size=16)
    calls = _AtenCalls()
    fake = types.SimpleNamespace(process_time=calls.now_s, perf_counter=calls.now_s)
    monkeypatch.setattr(measurement, "time", fake)
    with calls:
        timed = measured_step_time(model, x, clock="cpu")
    assert timed is not None and timed.forward_s > 0 and timed.backward_s > 0
    # the whole forward recomputed: at least its calls again beside the plain step
    assert timed.checkpointed_s >= timed.step_s + timed.forward_s
    assert timed.selective_s >= timed.step_s + timed.forward_s
    monkeypatch.undo()

    plain_only = measured_step_time(_GrowsEachCall(), torch.randn(4, 8))
    assert plain_only is not None and plain_only.step_s > 0
    assert plain_only.checkpointed_s is None and plain_only.selective_s is None


def test_rejects_unknown_method_and_bad_counts():
    model, x = EXAMPLES["mlp"]()
    with pytest.raises(ValueError, match="method"):
        measure(model, x, method="psychic")
    with pytest.raises(ValueError, match="repeats"):
        measure(model, x, repeats=0)


@pytest.mark.slow
def test_compiled_flops_count_what_the_partitioner_recomputes():
    # benchmarks/vs_anchors.py prices torch.compile's activation_memory_budget by the FLOPs of
    # the graphs handed to the compiler: with budget 1 nothing is recomputed (the same FLOPs as
    # the eager step), with budget 0 nothing is saved and the forward's matmuls run again.
    from benchmarks.vs_anchors import compile_with_budget, step_flops

    model, x = gpt_ref_small_example()
    eager_flops = step_flops(model, x)
    _, _, keep_all_flops = compile_with_budget(model, x, 1.0, backend="aot_eager")
    model, x = gpt_ref_small_example()
    compiled, _, keep_none_flops = compile_with_budget(model, x, 0.0, backend="aot_eager")
    keep_none = measure(compiled, x, warmup=0)
    # the next row's compile resets dynamo, and the kept module recompiles (in a warm-up step):
    # still with its own budget, not torch's default 1.0
    torch._dynamo.reset()
    recompiled = measure(compiled, x, warmup=1)
    torch._dynamo.reset()
    assert keep_all_flops == eager_flops
    assert keep_none_flops > 1.3 * eager_flops
    assert keep_none.method == "profiler" and keep_none.saved_bytes == 0
    assert recompiled.saved_bytes == 0


def test_tracker_counts_the_rng_state_a_checkpoint_stashes():
    """preserve_rng_state stashes torch.get_rng_state() (no op dispatches it) and fork_rng
    copies it again while recomputing: at the recomputation's peak both are live, and the
    tracker counts them as the profiler's allocator events do."""

    class Checkpointed(nn.Module):
        def __init__(self, preserve: bool) -> None:
            super().__init__()
            self.linear, self.preserve = nn.Linear(8, 8), preserve

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            body = lambda y: self.linear(y).relu()  # noqa: E731
            return checkpoint(body, x, use_reentrant=False, preserve_rng_state=self.preserve)

    x = torch.randn(4, 8)
    stash = torch.get_rng_state().untyped_storage().nbytes()
    with_state = measure(Checkpointed(True), x)
    assert with_state.peak_bytes - measure(Checkpointed(False), x).peak_bytes > stash
    assert with_state.peak_bytes == measure(Checkpointed(True), x, method="profiler").peak_bytes
