"""On CUDA too a checkpoint preserves its RNG state only where it draws random numbers.

The stash is no device memory there (CUDA's generator states are CPU tensors:
``region_state_bytes`` 0, simulate's Rule 12 prices nothing either way), but the same fact
decides which regions run with ``preserve_rng_state``: the dropout block and the region around
it replay their masks (the loss and gradients of the unwrapped model, with the same seed), and
the block without dropout takes no RNG state at all."""

from __future__ import annotations

import copy

import pytest
import torch

from planner.planning import price_form
from tests.cuda.common import assert_close_step, assert_close_step_copy, to_device
from tests.planner.test_rng_state import _model, _schedule, _states_taken

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::planner.LossFallbackWarning"),
]

CUDA = torch.device("cuda")


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_only_the_dropout_regions_preserve_on_cuda(form):
    model, x = _model(0.3)
    model, x = model.to(CUDA), to_device(x, CUDA)
    priced = price_form(model, x, form, device="h100")  # times by a profile: no calibration
    assert priced.graph.region_state_bytes == 0
    p = priced.build(_schedule(priced, form), priced.eager_peak_bytes)
    assert [r.preserve_rng_state for r in p.regions] == [True, True, False]
    applied = p.apply(copy.deepcopy(model)) if form == "inplace" else p.module
    if form == "inplace":
        assert_close_step_copy(model, applied, x)
    else:
        assert_close_step(model, applied, x)
    assert _states_taken(applied, x) == 5  # as on the CPU: none for the block without dropout
