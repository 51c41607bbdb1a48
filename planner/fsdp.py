"""Per-rank plans under FSDP2: ``plan(..., form="inplace", fsdp=FSDPConfig(world_size=N))``.

Each rank runs the whole model on its own micro-batch (the example input is one rank's), but
holds only a 1/N shard of each parameter and gradient between uses. The budget is one rank's
peak above its pre-step baseline (DESIGN.md): the sharded parameters (and optimizer state) are
that baseline; what FSDP2 allocates during the step counts. :func:`fsdp_changes` turns FSDP2's
buffers into ``CostGraph.buffer_changes`` at the units' boundaries, so ``solvers/simulate.py``
stays the one memory model (its Rule 11). The units are torchtitan's: ``fully_shard`` on each
block (default: each child of the model's first ``nn.ModuleList``) and on the root, which owns
every other parameter. :func:`shard` applies exactly those units.

What one rank holds, from ``torch/distributed/fsdp/_fully_shard`` (``_fsdp_param_group.py``,
``_fsdp_collectives.py``, ``_fsdp_state.py``), with ``full(u)`` the unit's parameters padded
so dim 0 divides by N, and ``grads(u)`` its trainable parameters' unpadded bytes:

- Forward, unit pre-forward: the all-gather output ``full(u)``; the previous unit's all-gather
  output (kept for copy-out overlap) is freed; the unsharded parameters ``full(u)`` are copied
  out of it. Post-forward: with ``reshard_after_forward``, the unsharded parameters are freed.
  The root does not reshard after forward; the last all-gather output is freed at the root's
  post-forward.
- Backward, a block's pre-backward (as the gradient of its output is ready, so before the
  recomputation of a checkpoint inside it): its prefetched all-gather output becomes its
  unsharded parameters and is freed, and the next block's (in backward order) is all-gathered
  (FSDP2's default backward prefetch). At backward's start the root prefetches the last block.
- Post-backward (once the block's input gradient is done): unsharded parameters freed; the
  previous unit's reduce-scatter input freed (one kept in flight); the reduce-scatter input
  ``full(u)`` allocated, the unsharded gradients ``grads(u)`` freed, the sharded gradients
  ``full(u) / N`` allocated (kept to the end of the step). The root's post-backward ends the
  step, and the last reduce-scatter input is freed with it.
- Gloo (CPU) runs each collective through a copy of the whole unit: an all-gather's is freed
  at once; a reduce-scatter's is held by its work object until the next reduce-scatter has
  allocated its own (seen in the allocator's events; the last one until the step ends).

Not modelled (refused or out of scope): mixed-precision policies, CPU offload of parameters,
HSDP, explicit forward prefetch, gradient accumulation without reduce-scatter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from planner.passes.eager import EagerGraph
from planner.solvers.costgraph import BufferChange
from planner.solvers.errors import UnsupportedModelError

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class FSDPConfig:
    """How the model will be sharded: ``world_size`` ranks of FSDP2 (``fully_shard``).

    ``units``: module paths given their own ``fully_shard`` (besides the root, which takes every
    other parameter); None: each child of the model's first ``nn.ModuleList`` (torchtitan's
    transformer blocks). ``reshard_after_forward`` for those units (the root never reshards
    after forward, as FSDP2 decides for it).
    """

    world_size: int
    reshard_after_forward: bool = True
    units: tuple[str, ...] | None = None
    # The process group's backend. Gloo (CPU) runs each all-gather and reduce-scatter through a
    # temporary the size of the whole unit (seen in the allocator's events), NCCL in place.
    backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"FSDPConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"FSDPConfig.world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"FSDPConfig.world_size must be >= 1, got {self.world_size}")


def unit_paths(model: torch.nn.Module, config: FSDPConfig) -> tuple[str, ...]:
    """The module paths sharded as their own units (the root aside)."""
    if config.units is not None:
        for path in config.units:
            try:
                model.get_submodule(path)
            except AttributeError:
                raise UnsupportedModelError(
                    f"FSDPConfig.units names {path!r}, which {type(model).__name__} does not "
                    f"have; give paths of its submodules (e.g. 'layers.0')"
                ) from None
        return tuple(config.units)
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            prefix = f"{path}." if path else ""
            return tuple(f"{prefix}{name}" for name, _ in module.named_children())
    raise UnsupportedModelError(
        f"{type(model).__name__} has no nn.ModuleList whose children to shard as FSDP2 units; "
        f"name them with FSDPConfig(units=('path.to.block', ...))"
    )


@dataclass(frozen=True)
class _Unit:
    path: str
    start: int  # its first node (the root: 0)
    stop: int  # one past its last node
    full_bytes: int  # unsharded (all-gathered) parameters, dim 0 padded to the world size
    grad_bytes: int  # its trainable parameters' gradients, unpadded (what autograd makes)
    reduce_bytes: int  # the reduce-scatter input: trainable parameters, padded


def _padded_bytes(p: torch.Tensor, world_size: int) -> int:
    if p.dim() == 0:
        return world_size * p.element_size()
    rows = math.ceil(p.shape[0] / world_size) * world_size
    return rows * math.prod(p.shape[1:]) * p.element_size()


def _units(model: torch.nn.Module, eg: EagerGraph, config: FSDPConfig) -> list[_Unit]:
    paths = unit_paths(model, config)
    n, world = len(eg.graph.nodes), config.world_size
    owner: dict[int, str] = {}  # id(parameter) -> the innermost unit that shards it
    for path in ("", *sorted(paths, key=lambda p: p.count("."))):
        for p in model.get_submodule(path).parameters():
            owner[id(p)] = path
    units = []
    for path in ("", *paths):
        if path and path not in eg.module_spans:
            raise UnsupportedModelError(
                f"FSDP unit {path!r} is not called exactly once per step, so its all-gathers "
                f"cannot be placed; choose units called once (FSDPConfig(units=...))"
            )
        start, stop = (0, n) if not path else eg.module_spans[path]
        mine = [p for p in model.get_submodule(path).parameters() if owner[id(p)] == path]
        trainable = [p for p in mine if p.requires_grad]
        units.append(
            _Unit(
                path=path,
                start=start,
                stop=stop,
                full_bytes=sum(_padded_bytes(p, world) for p in mine),
                grad_bytes=sum(p.numel() * p.element_size() for p in trainable),
                reduce_bytes=sum(_padded_bytes(p, world) for p in trainable),
            )
        )
    blocks = sorted(units[1:], key=lambda u: u.start)
    for a, b in zip(blocks, blocks[1:]):
        if b.start < a.stop:
            raise UnsupportedModelError(
                f"FSDP units {a.path!r} and {b.path!r} overlap (one inside the other); give "
                f"FSDPConfig(units=...) disjoint blocks"
            )
    return [units[0], *blocks]


def fsdp_changes(
    model: torch.nn.Module, eg: EagerGraph, config: FSDPConfig
) -> tuple[BufferChange, ...]:
    """FSDP2's buffers on one rank as CostGraph buffer changes (module docstring)."""
    root, *blocks = _units(model, eg, config)
    n, world = len(eg.graph.nodes), config.world_size
    gloo = config.backend == "gloo"
    changes: list[BufferChange] = []

    def add(after: tuple[str, int], delta_bytes: int, what: str) -> None:
        if delta_bytes:
            changes.append(BufferChange(after, delta_bytes, what))

    def name(u: _Unit) -> str:
        return u.path or "root"

    def collective(after: tuple[str, int], u: _Unit, size_bytes: int, what: str) -> None:
        """A collective's output, and gloo's transient copy of the whole unit."""
        add(after, size_bytes, f"fsdp:{what} {name(u)}")
        if gloo:
            add(after, u.full_bytes, f"fsdp:{what} {name(u)} (gloo copy)")
            add(after, -u.full_bytes, "")

    # Forward: the root's all-gather at the step's start, then each block's at its first node.
    collective(("fwd", -1), root, root.full_bytes, "all-gather")
    add(("fwd", -1), root.full_bytes, "fsdp:unshard root")
    held = root  # whose all-gather output is kept for copy-out overlap
    for u in blocks:
        collective(("fwd", u.start - 1), u, u.full_bytes, "all-gather")
        add(("fwd", u.start - 1), -held.full_bytes, "")
        add(("fwd", u.start - 1), u.full_bytes, f"fsdp:unshard {name(u)}")
        held = u
        if config.reshard_after_forward:
            add(("fwd", u.stop - 1), -u.full_bytes, "")
    # The root's post-forward frees the last all-gather output. Its span ends where the loss
    # the step adds outside the model begins (or at the last node).
    root_stop = eg.module_spans.get("", (0, n))[1]
    add(("fwd", root_stop - 1), -held.full_bytes, "")

    # Backward: blocks in reverse. A resharded block is all-gathered by the prefetch of the
    # block after it (the root's, for the last block), unsharded at its own pre-backward.
    resharded = config.reshard_after_forward
    if resharded and blocks:
        collective(("bwd", n), blocks[-1], blocks[-1].full_bytes, "all-gather")
    rs_held: _Unit | None = None
    for k in range(len(blocks) - 1, -1, -1):
        u = blocks[k]
        if resharded:
            pre = ("bwd", u.stop)
            add(pre, u.full_bytes, f"fsdp:unshard {name(u)}")
            add(pre, -u.full_bytes, "")
            if k > 0:
                collective(pre, blocks[k - 1], blocks[k - 1].full_bytes, "all-gather")
        rs_held = _post_backward(add, u, ("bwd", u.start), rs_held, world, gloo)
    rs_held = _post_backward(add, root, ("bwd", 0), rs_held, world, gloo)
    add(("bwd", 0), -rs_held.reduce_bytes, "")  # the root's final callback
    if gloo:
        add(("bwd", 0), -rs_held.full_bytes, "")
    return tuple(changes)


def _post_backward(add, u: _Unit, at, rs_held: _Unit | None, world: int, gloo: bool) -> _Unit:
    """A unit's post-backward: reshard, reduce-scatter its gradients (module docstring)."""
    add(at, -u.full_bytes, "")  # reshard
    if rs_held is not None:
        add(at, -rs_held.reduce_bytes, "")  # one reduce-scatter input kept in flight
    add(at, u.reduce_bytes, f"fsdp:reduce-scatter input {u.path or 'root'}")
    add(at, -u.grad_bytes, "")  # the unsharded gradients, copied in
    add(at, u.reduce_bytes // world, f"fsdp:sharded grads {u.path or 'root'}")
    if gloo:
        # Gloo's reduce-scatter runs through a copy of the whole unit that its work object
        # holds; seen freed only once the next reduce-scatter has made its own.
        add(at, u.full_bytes, f"fsdp:sharded grads {u.path or 'root'} (gloo copy)")
        if rs_held is not None:
            add(at, -rs_held.full_bytes, "")
    return u


def per_rank(model: torch.nn.Module, eg: EagerGraph, config: FSDPConfig) -> EagerGraph:
    """``eg`` priced for one rank of ``config``: FSDP2's buffers added, and regions kept to
    spans that lie inside one unit (a checkpoint crossing a unit boundary would run FSDP2's
    hooks inside its recomputation)."""
    changes = fsdp_changes(model, eg, config)
    blocks = _units(model, eg, config)[1:]
    places = {
        (start, stop): place
        for (start, stop), place in eg.places.items()
        if all(
            stop <= u.start or start >= u.stop or u.start <= start and stop <= u.stop
            for u in blocks
        )
    }
    graph = replace(
        eg.graph,
        buffer_changes=eg.graph.buffer_changes + changes,
        region_spans=frozenset(places),
        meta={
            **eg.graph.meta,
            "fsdp": f"world size {config.world_size}, units {len(blocks)} + root",
        },
    )
    return replace(eg, graph=graph, places=places)


def shard(model: torch.nn.Module, config: FSDPConfig, mesh: Any = None) -> torch.nn.Module:
    """``fully_shard`` each unit the plan assumed, then the root; returns the model (FSDP2
    changes its class in place). Call after ``p.apply(model)`` (and any per-block compile)."""
    from torch.distributed.fsdp import fully_shard

    if (
        torch.distributed.is_initialized()
        and torch.distributed.get_world_size() != config.world_size
    ):
        raise UnsupportedModelError(
            f"the plan was made for FSDPConfig(world_size={config.world_size}), this process "
            f"group has {torch.distributed.get_world_size()} ranks; plan again with that size"
        )
    for path in unit_paths(model, config):
        fully_shard(
            model.get_submodule(path),
            mesh=mesh,
            reshard_after_forward=config.reshard_after_forward,
        )
    fully_shard(model, mesh=mesh)
    return model
