"""The training step that planner plans and measures: forward, a loss, backward.

Shared by ``passes/estimate.py`` and ``planner/measurement.py`` so both price the same step.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from planner.solvers.errors import LossFallbackWarning, UnsupportedModelError

ExampleInput = torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
# loss_fn(output) -> loss, or loss_fn(output, batch) -> loss (see takes_batch)
LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class StepTime:
    """Median wall times of untracked training steps, split where backward starts."""

    forward_s: float  # the module's forward and the loss
    backward_s: float
    # The same step with the module's whole forward under one checkpoint (None: not measured):
    # what recomputation really costs on this device, beside the ops' forward.
    checkpointed_s: float | None = None
    # ... and under a selective policy that recomputes every op: what the policy's per-op
    # dispatch adds (None: not measured).
    selective_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s


def split_input(example_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A tensor, a tuple/list of tensors, or a dict of keyword tensors -> (args, kwargs)."""
    if isinstance(example_input, torch.Tensor):
        return (example_input,), {}
    if isinstance(example_input, Mapping):
        return (), dict(example_input)
    if isinstance(example_input, (tuple, list)):
        return tuple(example_input), {}
    raise TypeError(
        f"example_input must be a tensor, a tuple of tensors or a dict of keyword tensors, "
        f"got {type(example_input).__name__}"
    )


def join_input(example_input: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``split_input``'s inverse: ``args``/``kwargs`` in the shape of ``example_input``."""
    if isinstance(example_input, torch.Tensor):
        return args[0]
    if isinstance(example_input, Mapping):
        return dict(kwargs)
    return tuple(args)


def takes_batch(loss_fn: LossFn | None) -> bool:
    """Whether ``loss_fn`` is called as ``loss_fn(output, batch)``: it has two or more
    positional parameters without a default (``lambda out, batch: ...``)."""
    if loss_fn is None:
        return False
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the one-argument form
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is p.empty]
    return len(required) >= 2


def model_input(
    module: torch.nn.Module, example_input: Any, loss_fn: LossFn | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The (args, kwargs) the step calls ``module`` with.

    With a ``loss_fn(output, batch)`` the batch may hold entries only the loss reads (labels):
    those the module's ``forward`` takes no parameter for are left out of the call, as a
    Hugging Face ``Trainer`` drops the columns its model's forward does not take.
    """
    args, kwargs = split_input(example_input)
    if not takes_batch(loss_fn):
        return args, kwargs
    return taken_input(module, args, kwargs)


def taken_input(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` less what ``module.forward`` has no parameter for."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return args, kwargs
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        named = {p.name for p in params if p.kind != inspect.Parameter.POSITIONAL_ONLY}
        kwargs = {k: v for k, v in kwargs.items() if k in named}
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        args = args[: sum(p.kind in positional and p.name not in kwargs for p in params)]
    return args, kwargs


def call(module: torch.nn.Module, example_input: Any, loss_fn: LossFn | None = None) -> Any:
    """``module`` called on the batch (what of it the module takes, see :func:`model_input`)."""
    args, kwargs = model_input(module, example_input, loss_fn)
    return module(*args, **kwargs)


def tensor_leaves(output: Any) -> list[torch.Tensor]:
    """Tensors in a (nested) output, dicts and ModelOutputs included."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in tensor_leaves(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in tensor_leaves(v)]
    return []


def floating_leaves(output: Any) -> list[torch.Tensor]:
    """Floating-point tensors in a (nested) output, dicts and ModelOutputs included."""
    return [t for t in tensor_leaves(output) if t.is_floating_point()]


def training_loss(
    output: Any, loss_fn: LossFn | None = None, batch: Any = None, *, warn: bool = False
) -> torch.Tensor:
    """The scalar the step differentiates.

    ``loss_fn(output)`` or ``loss_fn(output, batch)`` (:func:`takes_batch`) when given; else the
    model's own ``loss`` (Hugging Face style, a ``.loss`` attribute or a ``"loss"`` key); else
    the sum of every floating output. ``warn``: say so (a ``LossFallbackWarning``) when it is
    that sum of anything but one scalar (a model returning a scalar returns its loss), which
    planning does once per plan.
    """
    if loss_fn is not None:
        return loss_fn(output, batch) if takes_batch(loss_fn) else loss_fn(output)
    has_loss = isinstance(output, Mapping) and "loss" in output or hasattr(output, "loss")
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in floating_leaves(output) if t.requires_grad]
    # a model that returns one scalar returns its loss (as the quickstart's does): no warning
    scalar_loss = isinstance(output, torch.Tensor) and output.dim() == 0
    if warn and leaves and not scalar_loss:
        why = (
            f"the model returned no loss ({type(output).__name__}.loss is None: a Hugging Face "
            f"model computes it only when the batch holds labels)"
            if has_loss
            else f"the model's output ({type(output).__name__}) holds no loss"
        )
        warnings.warn(
            f"planner: {why}, so the planned step differentiates the sum of its "
            f"{len(leaves)} floating output(s). Put the labels in the example input, or pass "
            f"loss_fn=... (loss_fn(output) or loss_fn(output, batch)) to plan the loss you "
            f"train with.",
            LossFallbackWarning,
            stacklevel=4,
        )
    if not leaves:
        what = (
            f"a {output.dtype} tensor"
            if isinstance(output, torch.Tensor)
            else type(output).__name__
        )
        raise UnsupportedModelError(
            f"the model's output ({what}) holds no floating tensor that "
            f"requires grad, so there is no loss to differentiate; say how to compute the loss: "
            f"loss_fn=... (a function of the model's output, returning a scalar tensor), on the "
            f"command line --loss MODULE:FUNCTION"
        )
    return sum(t.sum() for t in leaves)


@contextmanager
def loss_on_fake_tensors() -> Iterator[None]:
    """Around the loss of a step priced on fake tensors: a real tensor the loss reads from
    outside the batch (labels a ``loss_fn`` closes over) becomes an error saying how to pass it."""
    try:
        yield
    except AssertionError as e:
        if "FakeTensor" not in str(e):
            raise
        raise UnsupportedModelError(
            "the loss reads a tensor that is not part of the example input (labels that "
            "loss_fn holds from outside?); planning runs the step on fake tensors made from the "
            "model's parameters, buffers and example input only. Put the labels in the example "
            "input and take them from the batch: loss_fn=lambda output, batch: "
            "F.cross_entropy(output, batch['labels']) (batch entries the model's forward does "
            "not take are left out of its call)"
        ) from e


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What fake tensors raise where the step reads a tensor's value (``.item()``, ``if t:``,
    ``nonzero``, a boolean mask)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode


def data_dependent_error(
    where: str | None, module_type: str | None, error: BaseException
) -> UnsupportedModelError:
    """The error for a step that reads a tensor's value in module ``where`` (None: in the loss,
    outside the model), which planning on fake tensors cannot follow."""
    what = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    part = (
        "the loss"
        if where is None
        else ("the model's own forward" if where == "" else f"module {where!r}")
        + (f" ({module_type})" if module_type else "")
    )
    return UnsupportedModelError(
        f"{part} reads a tensor's value ({what}: .item(), `if tensor`, or an output whose "
        f"shape depends on values), which planning cannot follow: it runs the step on fake "
        f"tensors, which have shapes but no values, so it cannot tell which ops run or what "
        f"they keep. Fix: make that forward value-independent (torch.where instead of `if`, "
        f"keep tensors instead of .item()), or move the value-dependent part out of it: compute "
        f"it before the model call and pass the result in (a flag or Python number), so the "
        f"same ops run on every batch. Plan with the path you train with."
    )


_AUTOCAST_DEVICES = ("cpu", "cuda")
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def autocast_for(model: torch.nn.Module, dtype: torch.dtype) -> torch.autocast:
    """``torch.autocast`` in ``dtype`` on the device type of ``model``'s parameters: what
    ``planner.plan(..., autocast=dtype)`` prices the step under (ValueError for another dtype)."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast must be the dtype torch.autocast runs in, torch.bfloat16 or "
            f"torch.float16, got {dtype!r}; None (the default) plans under the caller's own "
            f"torch.autocast context, if any"
        )
    device_type = next((t.device.type for t in model.parameters()), "cpu")
    if device_type not in _AUTOCAST_DEVICES:
        raise ValueError(
            f"autocast={dtype} needs the model on cpu or cuda (its parameters are on "
            f"{device_type}): plan a model on the device you train on, or call planner.plan "
            f"inside that device's torch.autocast context"
        )
    return torch.autocast(device_type, dtype=dtype)


def autocast_dtypes() -> dict[str, torch.dtype]:
    """Device type -> dtype of every ``torch.autocast`` context active here (empty: none)."""
    found = {}
    for device_type in _AUTOCAST_DEVICES:
        try:
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type)
        except TypeError:  # torch < 2.4 took no device type
            enabled = (
                torch.is_autocast_cpu_enabled()
                if device_type == "cpu"
                else torch.is_autocast_enabled()
            )
            dtype = (
                torch.get_autocast_cpu_dtype()
                if device_type == "cpu"
                else torch.get_autocast_gpu_dtype()
            )
        if enabled:
            found[device_type] = dtype
    return found


@contextmanager
def amp_forward() -> Iterator[None]:
    """Around the forward and loss of a step run inside the caller's ``torch.autocast``: the
    step as the AMP recipe runs it, in a fresh autocast context (``with autocast: loss = ...``)
    whose exit drops the cached low-precision weight copies, so they live only as long as
    backward holds them. A plan made inside autocast prices that step, and ``measure`` inside
    it measures that step, whatever the caller's context cached before."""
    if not autocast_dtypes():
        yield
        return
    torch.clear_autocast_cache()
    try:
        yield
    finally:
        torch.clear_autocast_cache()


@contextmanager
def amp_backward() -> Iterator[None]:
    """Around backward: outside autocast, as the AMP recipe runs it. Checkpoint restores the
    forward's autocast state for a recomputation, and, outside any autocast context, the exit
    of that one drops the weight copies the recomputation cast (they live as long as the
    region's backward holds them); inside the caller's context they would stay cached to the
    end of the step, so its nesting is set aside meanwhile."""
    devices = autocast_dtypes()
    if not devices:
        yield
        return
    depth = 0
    while torch.autocast_decrement_nesting() >= 0:
        depth += 1
    torch.autocast_increment_nesting()  # undo the step below zero
    for device_type in devices:  # not an autocast(enabled=False) context: that one nests
        _set_autocast(device_type, False)
    try:
        yield
    finally:
        for device_type in devices:
            _set_autocast(device_type, True)
        for _ in range(depth):
            torch.autocast_increment_nesting()


def _set_autocast(device_type: str, enabled: bool) -> None:
    try:
        torch.set_autocast_enabled(device_type, enabled)
    except TypeError:  # torch < 2.4 took no device type
        if device_type == "cpu":
            torch.set_autocast_cpu_enabled(enabled)
        else:
            torch.set_autocast_enabled(enabled)


def precision_text(model: torch.nn.Module) -> str:
    """The dtypes a step runs in: the parameters' and, inside ``torch.autocast``, autocast's
    (``"parameters float32; autocast cpu bfloat16"``), for summaries and plan files."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    text = f"parameters {', '.join(dtypes) or 'none'}"
    for device_type, dtype in autocast_dtypes().items():
        text += f"; autocast {device_type} {str(dtype).removeprefix('torch.')}"
    return text
