"""When Python drops the storages autograd saved in an eager step (:func:`python_lifetimes`),
learnt from a second forward under ``torch.no_grad()``, where nothing is saved.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx

from planner.passes.eager_tracker import OpTracker, recording_calls
from planner.passes.forward_wrapper import ForwardWrapper
from planner.passes.mask_decisions import mask_decisions_as_eager
from planner.passes.parent_spans import in_order
from planner.passes.step import LossFn, amp_forward, model_input, split_input
from planner.passes.trace import fake_step


def python_lifetimes(
    model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None,
    tracker: OpTracker,
    traced: dict[str, fx.GraphModule],
) -> str:
    """Learn when Python drops the storages autograd saved, and note it in ``tracker.died_at``.

    A storage saved for backward outlives the forward in the priced run, so its finalizer never
    says when Python let go of it; but inside a region, which saves nothing, Python's own
    references are what keep it (``Tensor.freed_after``, simulate's Rule 1). Bloom's attention
    returns its (B, H, S, S) attention probabilities beside its output, and the model's block
    loop holds them in ``outputs`` until the next block returns: priced dead at the region's end,
    a checkpointed Bloom measured 838,144 B above its prediction. So the model's forward runs a
    second time on fake tensors under ``torch.no_grad()``, where nothing is saved and every
    storage dies when Python drops it; its ops are matched to the priced run's by name
    (``<module path>:<op>:<k>``), op and output shapes, and each saved storage takes the death
    of its counterpart (an op of that run that the priced run lacks maps to the priced run's
    node before the next match: later, on the safe side). Returns how it went, for the graph's
    ``meta``.

    The modules in ``traced`` (path -> traced forward: ``passes/parent_spans.py``) run their
    traced forward in that run, as an applied plan runs them where their storages' lifetimes
    count: inside a region (``EagerGraph.traced_forwards``). fx's code drops each value at its
    last use; the module's own code may hold it longer (the U-Net's list of skips: 232,640 B
    least, measured 221,420 B, priced on the original forward; 213,300 B, exact, on the traced).
    """
    saved = [
        (i, j, rec)
        for (phase, i), recs in tracker.allocated.items()
        if phase == "fwd" and i >= 0
        for j, rec in enumerate(recs)
        if rec.saved_by and id(rec) not in tracker.died_at and id(rec) not in tracker.casts
    ]
    if not saved:
        return "no saved storage"
    other = OpTracker(attention=tracker.attention)
    fs = fake_step(model, example_input, other)
    call_args, call_kwargs = model_input(model, fs.batch, loss_fn)
    _, kwargs = split_input(example_input)
    try:
        with (
            mask_decisions_as_eager(kwargs),
            running_traced(model, traced),
            recording_calls(model, other),
            fs.running(),
            torch.no_grad(),
        ):
            other.recording = True
            with amp_forward():
                out = model(*call_args, **call_kwargs)
            other.claim_pending()
            other.recording = False
            del out
    except Exception as e:  # noqa: BLE001 - the priced run stands; only these lifetimes are lost
        return f"unknown for saved storages (the forward under no_grad failed: {e!r:.200})"
    key = [(r.name, r.op, tuple(r.shapes)) for r in tracker.records]
    key_other = [(r.name, r.op, tuple(r.shapes)) for r in other.records]
    to_priced: dict[int, int] = {}  # node of the no_grad run -> the priced run's node
    if key == key_other:
        to_priced = {k: k for k in range(len(key))}
    else:
        matcher = difflib.SequenceMatcher(None, key, key_other, autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            to_priced.update({b + d: a + d for d in range(size)})
    from_priced = {a: b for b, a in to_priced.items()}
    # an unmatched node of the no_grad run: the priced node before the next matched one
    later = [len(tracker.records) - 1] * (len(other.records) + 1)
    for b in range(len(other.records) - 1, -1, -1):
        later[b] = to_priced[b] if b in to_priced else later[b + 1] - (b + 1 in to_priced)
    held = 0
    for i, j, rec in saved:
        b = from_priced.get(i)
        if b is None:
            continue
        recs = other.allocated.get(("fwd", b), [])
        if len(recs) <= j or recs[j].nbytes != rec.nbytes:
            continue
        died = other.died_at.get(id(recs[j]))
        if died is not None and died >= 0:
            tracker.died_at[id(rec)] = later[died]
            held += 1
    return f"from a forward under no_grad: {held} of {len(saved)} saved storages"


@contextmanager
def running_traced(model: torch.nn.Module, traced: dict[str, fx.GraphModule]) -> Iterator[None]:
    """Each module of ``traced`` runs its traced forward (on its live attributes) meanwhile."""

    class Traced(ForwardWrapper):
        def __init__(self, gm: fx.GraphModule) -> None:
            self.gm = gm

        def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = fx.Interpreter(module, graph=self.gm.graph)
            return run.run(*in_order(module, args, kwargs))

    installed: list[tuple[Traced, torch.nn.Module]] = []
    try:
        for path, gm in traced.items():
            wrapper, module = Traced(gm), model.get_submodule(path)
            wrapper.install(module)
            installed.append((wrapper, module))
        yield
    finally:
        for wrapper, module in reversed(installed):
            wrapper.uninstall(module)
