import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.models import gpt_ref_small_example, residual_cnn_example, unet_example
from passes.capture import capture
from passes.estimate import compute_nodes, estimate
from planner.measure import measure
from solvers.costgraph import Region, Schedule
from solvers.simulate import simulate

F32 = 4


def _estimate(model, example):
    captured = capture(model, example)
    return captured, estimate(captured.module, captured.args, captured.kwargs)


def test_linear_relu_chain_bytes_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    _, graph = _estimate(model, torch.randn(3, 4))
    assert [n.name for n in graph.nodes] == ["linear", "relu", "linear_1"]
    by_producer = {t.producer: t for t in graph.tensors}
    assert len(graph.tensors) == 3
    hidden, relu_out, out = by_producer[0], by_producer[1], by_producer[2]
    # linear output: read by relu only; relu saves its own output, not its input.
    assert (hidden.size_bytes, hidden.users, hidden.saved_by) == (3 * 8 * F32, (1,), ())
    # relu output: saved by relu (for threshold_backward) and by linear_1 (its input).
    assert (relu_out.size_bytes, relu_out.users, relu_out.saved_by) == (3 * 8 * F32, (2,), (1, 2))
    assert (out.size_bytes, out.is_output, out.grad_bytes) == (3 * 2 * F32, True, 3 * 2 * F32)
    # Parameter gradients appear in the backward of the node that uses the parameters.
    assert [n.param_grad_bytes for n in graph.nodes] == [(8 * 4 + 8) * F32, 0, (2 * 8 + 2) * F32]
    assert graph.nodes[2].inputs == (1,)


def test_matmul_flops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2, bias=False))
    _, graph = _estimate(model, torch.randn(3, 4))
    first, second = graph.nodes
    assert first.fwd_flops == 2 * 3 * 4 * 8
    # The input needs no gradient: backward computes the weight gradient only.
    assert first.bwd_flops == 2 * 3 * 4 * 8
    assert second.fwd_flops == 2 * 3 * 8 * 2
    assert second.bwd_flops == 2 * (2 * 3 * 8 * 2)  # input and weight gradients
    assert graph.step_flops == (192 + 192) + (96 + 192)


class _TwoViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x):
        y = self.lin(x)
        return y.view(-1).sin().sum() + y.t().cos().sum()


def test_views_resolve_to_one_storage():
    _, graph = _estimate(_TwoViews(), torch.randn(3, 4))
    names = [n.name for n in graph.nodes]
    y = [t for t in graph.tensors if t.producer == names.index("linear")]
    assert len(y) == 1  # one storage, though sin and cos save two different views of it
    assert y[0].size_bytes == 3 * 8 * F32
    assert y[0].saved_by == (names.index("sin"), names.index("cos"))
    assert set(y[0].users) == {names.index(k) for k in ("view", "sin", "t", "cos")}
    assert "view" in graph.nodes[names.index("view")].tags
    assert "view" in graph.nodes[names.index("t")].tags
    assert not any(t.producer in (names.index("view"), names.index("t")) for t in graph.tensors)


def test_node_names_map_one_to_one():
    model, example = gpt_ref_small_example()
    captured, graph = _estimate(model, example)
    assert [n.name for n in graph.nodes] == [n.name for n in compute_nodes(captured.module)]
    dropout = [n for n in graph.nodes if n.op == "dropout"]
    assert dropout and all("random" in n.tags for n in dropout)
    assert all(p.grad is None for p in model.parameters())  # fake run: nothing real touched


@pytest.mark.parametrize(
    "example",
    [
        gpt_ref_small_example,
        lambda: residual_cnn_example(batch=2, size=16, n_blocks=2),
        lambda: unet_example(batch=2, size=16),
    ],
    ids=["gpt-small", "cnn", "unet"],
)
def test_eager_peak_matches_measurement(example):
    model, x = example()
    _, graph = _estimate(model, x)
    predicted = simulate(graph, Schedule()).peak_bytes
    measured = measure(model, x).peak_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=False)


def test_every_block_checkpoint_matches_measurement():
    model, x = gpt_ref_small_example()
    _, graph = _estimate(model, x)
    regions = []
    for k in range(len(model.blocks)):
        inside = [
            i
            for i, n in enumerate(graph.nodes)
            if n.module_path == f"blocks.{k}" or n.module_path.startswith(f"blocks.{k}.")
        ]
        regions.append(Region(min(inside), max(inside) + 1))
    predicted = simulate(graph, Schedule(tuple(regions))).peak_bytes
    for k in range(len(model.blocks)):
        model.blocks[k] = _Checkpointed(model.blocks[k])
    measured = measure(model, x).peak_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    assert predicted < simulate(graph, Schedule()).peak_bytes
