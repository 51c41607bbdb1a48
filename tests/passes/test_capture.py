import pytest
import torch
from torch import nn

from benchmarks.models import gpt_ref_small_example, residual_cnn_example
from planner.passes.capture import capture
from planner.solvers.errors import CaptureError


def test_gpt_small_exports_and_shares_parameters():
    model, example = gpt_ref_small_example()
    captured = capture(model, example)
    assert captured.frontend == "export"
    assert captured.args == example and captured.kwargs == {}
    own = dict(model.named_parameters())
    got = dict(captured.module.named_parameters())
    assert own.keys() == got.keys()
    assert all(got[k] is own[k] for k in own)
    # Input guards live in a pre-hook, not in a `_guards_fn` node of the graph.
    assert not any(n.op == "call_module" for n in captured.module.graph.nodes)

    torch.manual_seed(1)
    expected = model(*example)
    torch.manual_seed(1)
    assert torch.equal(captured.module(*example), expected)  # dropout included


def test_buffers_shared_and_mode_pinned():
    model, example = residual_cnn_example(batch=2, size=8, n_blocks=1)
    captured = capture(model, example)
    own = dict(model.named_buffers())
    assert all(b is own[k] for k, b in captured.module.named_buffers())
    before = model.stem[1].num_batches_tracked.item()
    captured.module(example)
    assert model.stem[1].num_batches_tracked.item() == before + 1
    captured.module.train()  # the captured mode: allowed, a no-op
    with pytest.raises(CaptureError, match="captured in train mode"):
        captured.module.eval()


def test_eval_mode_is_captured():
    model, example = gpt_ref_small_example()
    model.eval()
    captured = capture(model, example)
    assert torch.equal(captured.module(*example), model(*example))
    assert not any(
        "dropout" in str(n.target) and n.args[-1] is True for n in captured.module.graph.nodes
    )


class _ReturnsModule(nn.Module):
    """Returns a non-tensor object: torch.export refuses, symbolic_trace takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu(), self.lin


def test_falls_back_to_symbolic_trace():
    model = _ReturnsModule()
    x = torch.randn(2, 4)
    captured = capture(model, x)
    assert captured.frontend == "symbolic_trace"
    assert captured.module.lin.weight is model.lin.weight
    assert torch.equal(captured.module(x)[0], model(x)[0])


class _Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


def test_data_dependent_control_flow_names_line_and_fix():
    with pytest.raises(CaptureError) as info:
        capture(_Branchy(), torch.randn(3))
    message = str(info.value)
    assert "_Branchy" in message
    assert "test_capture.py" in message and "if x.sum() > 0" in message
    assert "torch.cond" in message
