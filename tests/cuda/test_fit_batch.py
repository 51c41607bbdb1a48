"""planner.fit_batch on CUDA, priced on the model's own device (ops timed there): the sweep
doubles until no plan fits, and every fitting batch size's plan, applied to a fresh model and
measured by the allocator's statistics, stays within the cap."""

from __future__ import annotations

import pytest
import torch

import planner
from benchmarks.models import GPT
from tests.cuda.common import GPT_SMALL

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def fresh(device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_SMALL).to(device)


def inputs_on(device: torch.device):
    def make_input(batch_size: int):
        g = torch.Generator().manual_seed(batch_size)
        shape = (batch_size, GPT_SMALL.seq_len)
        idx = torch.randint(0, GPT_SMALL.vocab_size, shape, generator=g)
        targets = torch.randint(0, GPT_SMALL.vocab_size, shape, generator=g)
        return idx.to(device), targets.to(device)

    return make_input


def check_fit_batch(device: torch.device) -> None:
    make_input = inputs_on(device)
    cap_bytes = planner.measure(fresh(device), make_input(4)).peak_bytes  # eager at batch 4
    fit = planner.fit_batch(fresh(device), make_input, cap_bytes / 1e9)
    sizes = [r.batch_size for r in fit.rows]
    assert sizes == [2**k for k in range(len(sizes))]
    assert not fit.rows[-1].fits and all(r.fits for r in fit.rows[:-1])
    assert len(fit.rows) >= 4  # checkpointing lets the batch grow beyond eager's 4
    for r in fit.rows[:-1]:
        p = fit.plans[r.batch_size]
        measured = planner.measure(p.apply(fresh(device)), make_input(r.batch_size))
        assert measured.peak_bytes <= fit.cap_bytes, (r.batch_size, measured.peak_bytes)
        error = p.predicted_peak_bytes / measured.peak_bytes - 1
        assert abs(error) <= 0.01, (r.batch_size, p.predicted_peak_bytes, measured.peak_bytes)


def test_fit_batch_plans_fit_the_cap_measured_on_the_device():
    check_fit_batch(CUDA)
