"""Costing: a tracked step's records (``passes/trace.py``) -> the CostGraph both estimators return.

One step for ``passes/estimate.py`` and ``passes/eager.py`` alike: the storages that outlive their
op become ``Tensor``s (who reads them, who saves them for backward, when they die), each record a
``Node`` (FLOPs, bytes moved, forward and backward working sets, parameter gradients, model state
written), tagged from its op class (``solvers/op_classes.py``) and its place in the step:
``attention`` (S x S outputs, fused attention), ``skip`` (values read far apart), ``random``,
``inplace``, ``batchnorm``, ``view``. Time: the roofline of the caller's device rates, or the
step's own aten calls timed on the device (:func:`with_measured_times`), whose runs also give
the kernel workspaces the working sets add (:func:`with_workspaces`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from planner.passes.device_calibration import Calibration
from planner.passes.fresh_memory import FRESH_SHARE
from planner.passes.op_timing import Timer, measure_timing
from planner.passes.overhead_fits import host_floor_s
from planner.passes.step import StepTime
from planner.passes.trace import OpRecord, RecordedCall, Segment, Storage, Tracker, is_tensor
from planner.solvers.costgraph import BufferChange, CostGraph, GradBuffer, Node, Tensor
from planner.solvers.op_classes import SCORE_OPS, is_fused_attention, op_class_tags, short_op_name
from planner.solvers.rates import DeviceProfile

# A value whose first and last consumers lie this many non-view nodes apart is a "skip".
SKIP_GAP_NODES = 3


def cost_graph(
    tracker: Tracker,
    inputs: Any,
    rates: DeviceProfile,
    device: torch.device,
    estimator: str,
    sdpa_backend: str | None = None,
) -> CostGraph:
    """The CostGraph of ``tracker``'s records (one node each) for a step run on ``device``,
    timed by ``rates``' roofline, with ``estimator`` named in its ``meta``.

    ``inputs``: the step's input tensors, whose sequence lengths (dimensions past the batch)
    make an (S, S)-ended output attention scores. ``sdpa_backend``: the kernel priced when the
    tracker saw none dispatched (None: unknown).
    """
    records = tracker.records
    seq_lens = {d for x in tree_leaves(inputs) if is_tensor(x) for d in tuple(x.shape)[1:] if d > 1}
    tensors, produced_bytes, param_grad, grad_alloc, buffers = storage_records(
        tracker, [r.name for r in records]
    )
    attention = attention_nodes(records, seq_lens)
    skips = skip_nodes(records)
    nodes = []
    for i, r in enumerate(records):
        tags = node_tags(i, short_op_name(r.op), r.module_type, attention, skips, tracker)
        if r.is_view and produced_bytes[i] == 0:
            tags.add("view")
        bseg = tracker.segments.by_node.get(i, Segment())
        nodes.append(
            Node(
                name=r.name,
                op=r.op,
                inputs=tuple(sorted(r.inputs)),
                module_path=r.module_path,
                fwd_flops=tracker.flops.get(("fwd", i), 0),
                bwd_flops=tracker.flops.get(("bwd", i), 0) + tracker.flops.get(("loss", i), 0),
                fwd_bytes_accessed=tracker.moved_bytes.get(("fwd", i), 0),
                bwd_bytes_accessed=tracker.moved_bytes.get(("bwd", i), 0)
                + tracker.moved_bytes.get(("loss", i), 0),
                fwd_temp_bytes=max(0, r.fwd.peak_above_start_bytes - produced_bytes[i]),
                bwd_temp_bytes=bseg.peak_above_start_bytes - grad_alloc[i] - param_grad[i],
                param_grad_bytes=param_grad[i],
                tags=frozenset(tags),
                state_bytes=sum(tracker.state_written.get(i, {}).values()),
                state_saved_bytes=state_saved_bytes(tracker, i),
                saves_for_backward=i in tracker.allocated_at_last_save,
                fwd_calls=r.fwd_calls,
                draws_random=i in tracker.random_nodes,
            )
        )
    # Which fused-attention kernel the prices assume: math materialises the S x S scores,
    # flash / memory-efficient keep only the output and a log-sum-exp per row.
    backends = ",".join(sorted(tracker.sdpa_backends)) or sdpa_backend
    graph = roofline_graph(nodes, tensors, buffers, rates, estimator, backends)
    return dataclasses.replace(
        graph, buffer_changes=loss_step_holds(tracker), **device_fields(device, rates)
    )


def loss_step_holds(tracker: Tracker) -> tuple[BufferChange, ...]:
    """What the graph form's loss step keeps for its backward, as bytes held at fixed points
    of the step whatever the schedule (simulate's Rule 11): the loss runs after the captured
    graph, outside every region, so no region drops what it saves. Its own storages from the
    end of the forward, and the outputs only it saves (``Tracker.loss_held``) from the start
    of backward, where the outputs are released, each to the backward it dies in (that of
    the last node, which the loss's backward is charged to)."""
    n = len(tracker.records)
    changes = []
    saves, outputs = "the loss step's saves", "an output the loss step saves"
    for rec in _loss_kept(tracker):
        assert rec.freed_at is not None
        changes.append(BufferChange(("fwd", rec.node), rec.nbytes, saves))
        changes.append(BufferChange(("bwd", rec.freed_at), -rec.nbytes, saves))
    for rec, owner in tracker.loss_held:
        changes.append(BufferChange(("bwd", n), rec.nbytes, outputs))
        changes.append(BufferChange(("bwd", owner), -rec.nbytes, outputs))
    return tuple(changes)


def _loss_kept(tracker: Tracker) -> list[Storage]:
    """The loss step's storages that live into backward and die there (what it saves)."""
    return [
        r
        for r in tracker.loss_storages
        if not r.alive and r.freed_at is not None and not r.held_to_end
    ]


def attention_nodes(records: list[OpRecord], seq_lens: set[int]) -> set[int]:
    """Nodes whose outputs grow with the square of the sequence length.

    A fused attention op; a matmul whose output ends in (S, S) for an input's sequence length
    S (the scores); and every node after it that keeps an (S, S)-ended output computed from an
    attention node (scale, mask, softmax, dropout, casts), up to the matmul with V.
    """
    found: set[int] = set()
    for i, r in enumerate(records):
        name = short_op_name(r.op)
        if is_fused_attention(name):
            found.add(i)
            continue
        square = any(len(s) >= 2 and s[-1] == s[-2] and s[-1] in seq_lens for s in r.shapes)
        if square and (name in SCORE_OPS or r.inputs & found):
            found.add(i)
    return found


def skip_nodes(records: list[OpRecord]) -> set[int]:
    """Producers of values read by two consumers far apart (residual streams, U-Net links)."""
    users: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        for p in r.inputs:
            users[p].append(i)
    prefix = [0]
    for r in records:
        prefix.append(prefix[-1] + (not r.is_view))
    return {
        i
        for i, us in users.items()
        if len(us) >= 2 and prefix[max(us)] - prefix[min(us) + 1] >= SKIP_GAP_NODES
    }


def device_fields(device: torch.device, rates: DeviceProfile) -> dict[str, Any]:
    """The CostGraph fields that depend on the device and its profile.

    ``region_state_bytes`` (simulate's Rule 12): ``preserve_rng_state`` stashes
    ``torch.get_rng_state()``, a CPU tensor, device memory only on the CPU; CUDA's generator
    states are CPU tensors too, so 0 there (and on meta, which plans for an accelerator). Only
    regions over a node that draws random numbers (``Node.draws_random``) stash it.
    Offloading (Rule 7) as the profile says: its host link, and how far transfers overlap."""
    stash = torch.get_rng_state().untyped_storage().nbytes() if device.type == "cpu" else 0
    return {
        "region_state_bytes": stash,
        "host_link": rates.host_link and device.type != "cpu",
        "offload_overlap": rates.offload_overlap,
    }


def with_measured_times(
    graph: CostGraph,
    tracker: Tracker,
    device: torch.device,
    rates: DeviceProfile,
    step_time: StepTime | None,
    timer: Timer | None = None,
) -> CostGraph:
    """``graph`` with node times from its aten calls timed on ``device`` (the tracker recorded
    them: ``record_calls``) and the checkpoint overhead measured there, both from ``timer``
    (``op_timing.Timer``; None: ``op_timing.measure_timing``)."""
    calls = [r.call for recorded in tracker.calls.values() for r in recorded if r.call]
    timing = (timer or measure_timing)(calls, device)
    if step_time is None:
        step_time = timing.step_time
    times, how = _measured_times(tracker, timing, rates, step_time)
    fresh = timing.fresh_memory
    faults_s = 0.0
    if fresh.min_bytes is not None:
        how += (
            f"; blocks of {fresh.min_bytes / 2**20:g} MiB or more mapped afresh, "
            f"{fresh.seconds_per_byte * 2**30:.2f} s per GiB ({FRESH_SHARE:.0%} of them)"
        )
        faults_s = sum(fresh.cost_s(r.allocated_bytes) for rs in tracker.calls.values() for r in rs)
    if timing.source:
        how += f"; calibration: {timing.source}"
    graph, folded = with_workspaces(graph, tracker, timing.workspace_bytes)
    if folded:
        how += f"; kernel workspaces: {folded} nodes' working sets"
    nodes = tuple(
        dataclasses.replace(
            n,
            fwd_time_s=times.get(("fwd", i), 0.0),
            # the graph form's loss step: in the step, never recomputed (Tracker.outside_node)
            bwd_time_s=times.get(("bwd", i), 0.0) + times.get(("loss", i), 0.0),
        )
        for i, n in enumerate(graph.nodes)
    )
    overhead = timing.checkpoint
    graph = dataclasses.replace(
        graph,
        nodes=nodes,
        region_overhead_s=overhead.region_s,
        saving_node_overhead_s=overhead.per_saving_node_s,
        selective_call_overhead_s=overhead.per_selective_call_s,
        offload_region_overhead_s=overhead.offload_region_s,
        offloaded_storage_overhead_s=overhead.per_offloaded_storage_s,
    )
    if step_time is not None and step_time.checkpointed_s is not None:
        # The step checkpointed whole recomputes the forward (to its last save): what that
        # takes beyond the plain step and the region's overhead, over the nodes' forward times.
        # Recomputation runs in backward, on storages backward just freed and hot caches, and
        # is often cheaper than the first forward.
        forward_s = sum(graph.node_time_s(i) for i in range(len(nodes)))
        extra_s = step_time.checkpointed_s - step_time.step_s
        extra_s -= graph.checkpoint_overhead_s(0, len(nodes))
        scale = min(2.0, max(0.25, extra_s / max(forward_s, 1e-12)))
        graph = dataclasses.replace(graph, recompute_scale=scale)
        how += f"; recomputation x {scale:.2f} of forward (a step checkpointed whole)"
    if step_time is not None and None not in (step_time.checkpointed_s, step_time.selective_s):
        # The same, under a selective policy that recomputes every op: the policy's dispatch,
        # per aten call, in forward and in the recomputation. Per call, not per node: a node
        # that dispatches several ops (a matmul's views and bmm) costs the policy as many times.
        calls = sum(n.fwd_calls for n in nodes)
        per_call_s = max(0.0, (step_time.selective_s - step_time.checkpointed_s) / max(calls, 1))
        graph = dataclasses.replace(graph, selective_call_overhead_s=per_call_s)
        how += f"; selective policy + {per_call_s * 1e6:.1f} us per call"
    meta = {**graph.meta, "timing": how}
    if faults_s and faults_s >= PAGE_FAULTS_NOTED * graph.step_time_s:
        meta["page_faults"] = (
            f"{faults_s:.3g} s of forward+backward is page faults: malloc maps blocks of "
            f"{fresh.min_bytes / 2**20:g} MiB or more afresh (README: page faults; "
            f"MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 avoids them)"
        )
    return dataclasses.replace(graph, meta=meta)


# The share of a step's predicted time in page faults from which a plan's summary says so.
PAGE_FAULTS_NOTED = 0.05


def with_workspaces(
    graph: CostGraph, tracker: Tracker, workspace_bytes: Mapping[str, int]
) -> tuple[CostGraph, int]:
    """``graph`` with each node's forward and backward working sets raised by its calls' kernel
    workspaces (``cuda_timing.workspace_bytes``: scratch a CUDA kernel allocates and frees inside
    the call, by ``OpCall.key_text``), and how many nodes that raised.

    A call's workspace stands on what is live once its outputs are allocated
    (``Segment.calls``: the bytes above the segment's start then), so the segment's peak above
    its start becomes max(its traced peak, max over its calls of that level + the call's
    workspace), and the node's temp is that peak less what the node keeps, as ``cost_graph``
    prices it: in forward its outputs that outlive it (``fwd_temp_bytes``), in backward the
    gradients and parameter gradients it allocates (``bwd_temp_bytes``). Recomputation replays
    the forward's calls, and simulate prices it with ``fwd_temp_bytes`` too.

    Without figures (off CUDA, a device profile, no ``time_ops``) the graph is unchanged."""
    if not any(workspace_bytes.values()):
        return graph, 0

    def peak_with(seg: Segment | None) -> int | None:
        if seg is None:
            return None
        levels = [at + w for call, at in seg.calls if (w := workspace_bytes.get(call.key_text))]
        return max(levels, default=None)

    kept_fwd = [0] * len(graph.nodes)
    for t in graph.tensors:
        kept_fwd[t.producer] += t.size_bytes
    kept_bwd = [n.param_grad_bytes for n in graph.nodes]
    for b in graph.grad_buffers:
        kept_bwd[b.alloc_node] += b.size_bytes
    nodes, folded = list(graph.nodes), 0
    for i, node in enumerate(nodes):
        fwd, bwd = tracker.records[i].fwd, tracker.segments.by_node.get(i)
        fwd_temp, bwd_temp = node.fwd_temp_bytes, node.bwd_temp_bytes
        if (peak := peak_with(fwd)) is not None:
            fwd_temp = max(fwd_temp, peak - kept_fwd[i])
        if (peak := peak_with(bwd)) is not None:
            bwd_temp = max(bwd_temp, peak - kept_bwd[i])
        if (fwd_temp, bwd_temp) != (node.fwd_temp_bytes, node.bwd_temp_bytes):
            nodes[i] = dataclasses.replace(node, fwd_temp_bytes=fwd_temp, bwd_temp_bytes=bwd_temp)
            folded += 1
    return dataclasses.replace(graph, nodes=tuple(nodes)), folded


def _measured_times(
    tracker: Tracker, timing: Calibration, rates: DeviceProfile, step_time: StepTime | None
) -> tuple[dict[tuple[str, int], float], str]:
    """Seconds per (phase, node): its aten calls timed alone on ``device`` (the roofline for
    those that cannot run alone), plus what the step spends per call around them, and how.

    With the real step's ``step_time`` (forward and backward measured on the device), that
    per-call share is fitted per phase so the phase adds up to its measured time: the model's
    own Python, autograd and dispatch, not a stand-in's. When the ops timed alone already take
    longer than the phase (they missed cache reuse the real step has), they are scaled down
    instead. Without it, the share of a stand-in chain (``overhead_fits.call_overhead_s``, in
    ``timing``). On an accelerator that share is the host's time per call, which overlaps the
    kernels (``overhead_fits.host_overlaps``): a call costs at least it, not it more.
    """
    measured = timing.op_times_s

    def alone(r: RecordedCall) -> float:
        seconds = None if r.call is None else measured.get(r.call.key_text)
        if seconds is None:
            seconds = max(r.flops / rates.flops_per_s, r.moved_bytes / rates.bytes_per_s)
        return seconds + timing.fresh_memory.cost_s(r.allocated_bytes)

    alone_s = {where: [alone(r) for r in recorded] for where, recorded in tracker.calls.items()}

    def with_host(per_call_s: float, where: tuple[str, int]) -> float:
        if timing.host_overlaps:
            return sum(max(s, per_call_s) for s in alone_s[where])
        return sum(alone_s[where]) + len(alone_s[where]) * per_call_s

    per_call = "at least" if timing.host_overlaps else "+"
    if step_time is None:
        overhead_s = timing.call_overhead_s
        how = f"ops timed alone {per_call} {overhead_s * 1e6:.1f} us per call (stand-in chain)"
        return {w: with_host(overhead_s, w) for w in alone_s}, how
    times: dict[tuple[str, int], float] = {}
    how = []
    # the loss step is measured with the forward (measurement.time_step)
    phases = ((("fwd", "loss"), step_time.forward_s), (("bwd",), step_time.backward_s))
    for (phase, *also), phase_s in phases:
        wheres = [w for w in alone_s if w[0] in (phase, *also)]
        calls_s = [s for w in wheres for s in alone_s[w]]
        total_alone_s = sum(calls_s)
        if phase_s >= total_alone_s:
            if timing.host_overlaps:
                per_call_s = host_floor_s(calls_s, phase_s)
            else:
                per_call_s = (phase_s - total_alone_s) / max(len(calls_s), 1)
            times.update({w: with_host(per_call_s, w) for w in wheres})
            how.append(
                f"{phase} {phase_s * 1e3:.2f} ms: {per_call} {per_call_s * 1e6:.1f} us per call"
            )
        else:
            scale = phase_s / total_alone_s
            times.update({w: sum(alone_s[w]) * scale for w in wheres})
            how.append(f"{phase} {phase_s * 1e3:.2f} ms: ops x {scale:.2f}")
    return times, "ops timed alone, fitted to the measured step (" + "; ".join(how) + ")"


def roofline_graph(
    nodes: list[Node],
    tensors: list[Tensor],
    buffers: list[GradBuffer],
    rates: DeviceProfile,
    estimator: str,
    sdpa_backend: str | None,
) -> CostGraph:
    """The CostGraph of priced nodes and storages, timed by ``rates``' roofline (until
    :func:`with_measured_times`), with what priced it in ``meta``."""
    meta = {
        "estimator": estimator,
        "device": rates.name,
        "rates": f"{rates.flops_per_s:.3g} FLOP/s, {rates.bytes_per_s:.3g} B/s",
        "timing": "roofline",
    }
    if sdpa_backend:
        meta["sdpa_backend"] = sdpa_backend
    return CostGraph(
        nodes=tuple(nodes),
        tensors=tuple(tensors),
        flops_per_s=rates.flops_per_s,
        bytes_per_s=rates.bytes_per_s,
        offload_bytes_per_s=rates.host_bytes_per_s,
        grad_buffers=tuple(buffers),
        meta=meta,
    )


def storage_records(
    tracker: Tracker, names: list[str]
) -> tuple[list[Tensor], list[int], list[int], list[int], list[GradBuffer]]:
    """The CostGraph's storages from a tracked step whose nodes are named ``names``.

    ``tracker.died_at``: id(storage record) -> node whose forward was running when it died, for
    ``Tensor.freed_after`` (eager code, where Python frees storages, not the last reader).

    Returns (tensors, bytes each node produces, parameter-gradient bytes and gradient-buffer
    bytes each node's backward allocates, gradient buffers).
    """
    # Forward storages that outlived their node are the graph's tensors, but what the loss
    # step saves (held whatever the schedule: loss_step_holds).
    tensors: list[Tensor] = []
    produced_bytes = [0] * len(names)
    recs: list[Storage] = []
    held = set(map(id, _loss_kept(tracker)))
    for i in range(len(names)):
        for rec in tracker.allocated.get(("fwd", i), []):
            if id(rec) in held:
                continue
            survived = rec.alive or rec.users or rec.saved_by or rec.is_output or rec.held_to_end
            survived = survived or id(rec) in tracker.casts  # the cache held it
            # read by no op, yet held past its node (a composite's discarded output, kept by
            # the C++ frame until it returns: SDPA's math path on CPU casts the attention
            # weights back to bf16 and drops them only as it returns): alive to its death
            survived = survived or tracker.died_at.get(id(rec), -1) > rec.node
            if not survived:
                continue
            recs.append(rec)
    for t_i, rec in enumerate(recs):
        at_save = tracker.allocated_at_last_save.get(rec.node)
        after_last_save = (
            at_save is not None and tracker.allocated[("fwd", rec.node)].index(rec) >= at_save
        )
        users = tuple(sorted(u for u in rec.users if u != rec.node))
        grad_bytes = rec.nbytes if rec.requires_grad else 0
        died = tracker.died_at.get(id(rec), -1)
        tensors.append(
            Tensor(
                name=f"{names[rec.node]}:{t_i}",
                size_bytes=rec.nbytes,
                producer=rec.node,
                users=users,
                saved_by=tuple(sorted(rec.saved_by)),
                grad_bytes=grad_bytes,
                is_output=rec.is_output and not rec.held_to_end,
                held_to_end=rec.held_to_end or (rec.alive and not rec.is_output),
                written_by=tuple(sorted(w for w in rec.written_by if w != rec.node)),
                after_last_save=after_last_save,
                freed_after=died if died > max((rec.node, *users)) else -1,
            )
        )
        produced_bytes[rec.node] += rec.nbytes
    # Backward storages: alive after the step -> parameter gradients; freed by a later node's
    # backward -> a gradient buffer; freed within their own node -> part of its working set.
    param_grad = [0] * len(names)
    grad_alloc = [0] * len(names)
    buffers: list[GradBuffer] = []
    for (phase, i), allocated in tracker.allocated.items():
        if phase != "bwd" or i < 0:
            continue
        for r in allocated:
            if r.alive:
                param_grad[i] += r.nbytes
            elif r.freed_at is not None and r.freed_at < i:
                buffers.append(GradBuffer(r.nbytes, alloc_node=i, free_node=r.freed_at))
                grad_alloc[i] += r.nbytes
    return tensors, produced_bytes, param_grad, grad_alloc, buffers


def node_tags(
    i: int, op_name: str, module_type: str, attention: set[int], skips: set[int], tracker: Tracker
) -> set[str]:
    """The tags of node ``i`` (short op name ``op_name``, issued by a ``module_type``) but
    ``view``, which depends on what the node produces."""
    tags = op_class_tags(op_name)
    tags |= {tag for tag, nodes in (("attention", attention), ("skip", skips)) if i in nodes}
    if i in tracker.random_nodes:
        tags.add("random")
    if op_name.endswith("_") and not op_name.startswith("_"):
        tags.add("inplace")
    if "batch_norm" in op_name or "BatchNorm" in module_type:
        tags.add("batchnorm")
    return tags


def state_saved_bytes(tracker: Any, i: int) -> int:
    """The bytes of the model buffers node ``i`` writes in forward and also saves for backward
    (see ``Node.state_saved_bytes``)."""
    written = tracker.state_written.get(i, {})
    return sum(n for k, n in written.items() if k in tracker.state_saved.get(i, ()))
