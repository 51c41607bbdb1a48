"""fit_batch's sweep over batch sizes: a larger batch's calls priced from the last size's.

A larger batch's step makes the same calls on tensors with more rows. :class:`BatchSweep` keeps
the last step's calls; the calibration's timer (``CalibrationTimer``, constructed with the
sweep) asks it for the next step's estimates: each call's counterpart (:func:`paired_calls`)
and their size ratio, the calls it lacks priced from their counterparts where those are slow
enough to scale (:func:`scaled_times`, corrected per op: :func:`per_op_corrected`), and a call
timed far above its counterpart's figure timed again (:func:`checked`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from planner.calibration_counts import MEASUREMENTS
from planner.passes.op_call import OpCall, TensorSpec
from planner.passes.op_timing import time_call

# In a sweep, a call timed at more than this many times its counterpart's figure at the
# smaller batch, scaled by their sizes, is timed again (:func:`checked`). A burst of load on
# the shared memory system stretches a memory-bound call's CPU time too, and the fastest of a
# few back-to-back repeats all fall in it: GPT-ref's batch 2 was once priced 3x batch 1 (621
# against 206 ms; 412 ms re-run), so fit_batch took batch 1, the slowest. A real step per
# sample grows less than this in one doubling (GPT-ref's slowest call, a matmul whose output
# outgrows the allocator's cached blocks, 1.4x), so the retry costs one more timing.
RETIME_JUMP = 1.5
# Below this an expected figure is left unchecked: dispatch noise, and nothing to the step.
RETIME_MIN_S = 20e-6


def checked(
    call: OpCall,
    seconds: float | None,
    expected_s: float | None,
    device: torch.device,
    repeats: int = 5,
) -> float | None:
    """``seconds``, or ``call`` timed again (``repeats`` runs) if that is faster, when
    ``seconds`` is over RETIME_JUMP times ``expected_s``."""
    if seconds is None or expected_s is None or expected_s < RETIME_MIN_S:
        return seconds
    if seconds <= RETIME_JUMP * expected_s:
        return seconds
    again = time_call(call, device, repeats)
    MEASUREMENTS["retimed"] += 1
    return seconds if again is None else min(seconds, again)


# A call whose counterpart at the smaller batch took at least this long is priced from it
# (``scaled_times``): past a millisecond a CPU kernel's time grows linearly with its rows
# (GPT-ref's matmuls and attention from batch 8 to 64 within a few percent), and timing the
# largest batch sizes' calls, each a few times, was most of a cold ``fit_batch``.
SCALE_MIN_S = 1e-3


def _numel(spec: Any) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n


def _grown_by(small: OpCall, large: OpCall) -> float | None:
    """How many times larger ``large`` is than ``small``: the same op on the same arguments
    but tensors, each tensor the same or its element count times one ratio r > 1 (the
    batch's), its other arguments the same or integers times r (a view's sizes); else None."""
    if small.op != large.op or small.spec != large.spec or len(small.leaves) != len(large.leaves):
        return None
    ratio: float | None = None
    for a, b in zip(small.leaves, large.leaves):
        if a == b:
            continue
        if isinstance(a, TensorSpec) and isinstance(b, TensorSpec):
            if a.dtype != b.dtype or len(a.shape) != len(b.shape) or not _numel(a):
                return None
            r = _numel(b) / _numel(a)
        elif isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a:
            r = b / a
        else:
            return None
        if r <= 1 or (ratio is not None and abs(r - ratio) > 1e-9 * ratio):
            return None
        ratio = r
    return ratio


# How many of an op's largest calls ``per_op_corrected`` times at a new batch size, and how
# many runs each (after a warm-up): the median over the calls is what counts.
CORRECTION_CALLS = 3
CORRECTION_REPEATS = 1


def per_op_corrected(
    scaled: Mapping[str, float], calls: Sequence[OpCall], device: torch.device
) -> dict[str, float]:
    """``scaled`` with each op's figures corrected by a few of its calls timed: its largest.

    Linear scaling holds for compute-bound calls (matmuls: GPT-ref's within 4% from batch 8 to
    64) but not for memory-bound ones, whose tensors outgrow the caches (softmax, GELU and
    pointwise products 2.7-3.9 times their scaled figure at batch 64): the op's CORRECTION_CALLS
    largest calls are timed, one run each (CORRECTION_REPEATS), and the median of their ratios
    of timed to scaled figure applied to all the op's calls, those timed too: one call's ratio
    alone would carry its run's noise to every call of the op, and a call run once after its
    warm-up takes a half to a third of the runs of one timed as ``time_call`` does (the largest
    sizes' calls were most of a cold ``fit_batch``). A few timed calls per batch size instead of
    hundreds; one timed over RETIME_JUMP times its scaled figure is timed again
    (:func:`checked`)."""
    by_text = {c.key_text: c for c in calls}
    groups: dict[str, list[tuple[float, str]]] = {}
    for text, seconds in scaled.items():
        groups.setdefault(str(by_text[text].op), []).append((seconds, text))
    out: dict[str, float] = {}
    for group in groups.values():
        factors = []
        for seconds, text in sorted(group, reverse=True)[:CORRECTION_CALLS]:
            call = by_text[text]
            figure = time_call(call, device, CORRECTION_REPEATS)
            figure = checked(call, figure, seconds, device, CORRECTION_REPEATS)
            MEASUREMENTS["ops"] += 1
            if figure is not None:
                factors.append(figure / seconds)
        factor = statistics.median(factors) if factors else 1.0
        for seconds, text in group:
            out[text] = seconds * factor
    return out


class BatchSweep:
    """What ``fit_batch`` keeps between its batch sizes: the calls of the last step priced.

    A larger batch's step makes the same calls on tensors with more rows: each call whose
    counterpart (the same occurrence of the same op, tensors grown by one ratio r:
    :func:`paired_calls`) took at least SCALE_MIN_S is priced at r times that
    (:func:`scaled_times`), corrected by its op's largest calls timed
    (:func:`per_op_corrected`), instead of being timed again, so a sweep times the calls of
    its small batch sizes and a few calls per op of the larger ones."""

    def __init__(self) -> None:
        self.last_calls: list[OpCall] | None = None
        # their figures (a pinned calibration object is not extended from one size to the next)
        self.last_times_s: dict[str, float | None] = {}

    def estimates(
        self, op_times_s: Mapping[str, float | None], calls: Sequence[OpCall], device: torch.device
    ) -> tuple[dict[str, float] | None, dict[str, float] | None]:
        """(scaled, expected) for ``calls``, the next size's step, given the calibration's
        ``op_times_s``: the figures of the calls it lacks priced from the last step's
        (:func:`scaled_times`, corrected: :func:`per_op_corrected`), and what each paired call
        is expected to take (its counterpart's figure times their size ratio: a call timed far
        above it is timed again, :func:`checked`). (None, None) for the sweep's first step."""
        if self.last_calls is None:
            return None, None
        pairs = paired_calls(self.last_calls, calls)
        earlier_s = {**self.last_times_s, **op_times_s}
        paired = expected_times(earlier_s, pairs)
        expected = {text: small_s * ratio for text, (small_s, ratio) in paired.items()}
        scaled = per_op_corrected(scaled_times(op_times_s, pairs), calls, device)
        return scaled, expected

    def remember(self, calls: Sequence[OpCall], op_times_s: Mapping[str, float | None]) -> None:
        """Keep ``calls``, the step just priced, with their figures in ``op_times_s``: the next
        size's step is priced from them."""
        self.last_calls = list(calls)
        self.last_times_s = {c.key_text: op_times_s.get(c.key_text) for c in calls}


def paired_calls(
    previous: Sequence[OpCall], calls: Sequence[OpCall]
) -> list[tuple[OpCall, OpCall, float]]:
    """Each call of ``calls`` with its counterpart in ``previous`` and how many times larger it
    is (:func:`_grown_by`): the k-th call of an op with the k-th call of that op in
    ``previous``, for every op both steps call equally often. Per op, not by position: a
    step's path may differ in a few views and copies between batch sizes (GPT-ref's batch 1
    makes 5,471 calls, batch 2 5,579), and its matmuls, softmaxes and dropouts still pair."""
    earlier: dict[str, list[OpCall]] = {}
    for call in previous:
        earlier.setdefault(str(call.op), []).append(call)
    counts = Counter(str(call.op) for call in calls)
    seen: Counter[str] = Counter()
    pairs = []
    for large in calls:
        op = str(large.op)
        k = seen[op]
        seen[op] += 1
        smalls = earlier.get(op, ())
        if len(smalls) != counts[op]:
            continue
        ratio = _grown_by(smalls[k], large)
        if ratio is not None:
            pairs.append((smalls[k], large, ratio))
    return pairs


Pairs = Sequence[tuple[OpCall, OpCall, float]]  # what paired_calls returns


def expected_times(
    times_s: Mapping[str, float | None], pairs: Pairs
) -> dict[str, tuple[float, float]]:
    """Call text -> (its counterpart's figure in ``times_s``, their size ratio), for the larger
    call of each of ``pairs`` (:func:`paired_calls`) whose smaller one has a figure."""
    out: dict[str, tuple[float, float]] = {}
    for small, large, ratio in pairs:
        small_s = times_s.get(small.key_text)
        if small_s is not None and large.key_text not in out:
            out[large.key_text] = (small_s, ratio)
    return out


def scaled_times(op_times_s: Mapping[str, float | None], pairs: Pairs) -> dict[str, float]:
    """The larger calls of ``pairs`` (:func:`paired_calls`) that a calibration's ``op_times_s``
    lacks, priced from their smaller counterparts' figures in it (``BatchSweep``)."""
    return {
        text: small_s * ratio
        for text, (small_s, ratio) in expected_times(op_times_s, pairs).items()
        if small_s >= SCALE_MIN_S and text not in op_times_s
    }
