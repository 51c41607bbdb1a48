"""Capture: an ``nn.Module`` and an example input -> a ``torch.fx.GraphModule``.

In: the user's model (in its current train/eval mode) and an example input (a tensor, a tuple of
tensors, or a dict of keyword tensors). Out: :class:`Captured`, whose ``module`` computes the
same function and holds the model's own ``Parameter`` and buffer objects, so training the
captured module trains the model.

Front-ends, in order: ``torch.export.export(strict=False).module()`` (aten-level graph; works on
Hugging Face models), then ``torch.fx.symbolic_trace`` (module-level graph). When both fail the
error names the line of the model that stopped them and how to get past it.
"""

from __future__ import annotations

import traceback
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from planner.passes.step import split_input
from planner.solvers.errors import CaptureError

Frontend = str  # "export" | "symbolic_trace"


@dataclass(frozen=True)
class Captured:
    module: torch.fx.GraphModule
    args: tuple
    kwargs: dict = field(default_factory=dict)
    frontend: Frontend = "export"


def capture(model: nn.Module, example_input: Any) -> Captured:
    """Capture ``model`` as a GraphModule that shares its parameters and buffers."""
    args, kwargs = _checked_input(example_input)
    errors: list[tuple[str, BaseException]] = []
    try:
        gm = _export(model, args, kwargs)
        frontend = "export"
    except Exception as export_error:  # noqa: BLE001 - every export failure falls back
        errors.append(("torch.export", export_error))
        try:
            gm = torch.fx.symbolic_trace(model)
            frontend = "symbolic_trace"
        except Exception as trace_error:  # noqa: BLE001
            errors.append(("torch.fx.symbolic_trace", trace_error))
            raise CaptureError(_explain(model, errors)) from export_error
        _check_runs(gm, args, kwargs, export_error)
    _share_state(model, gm)
    _pin_mode(gm, model.training)
    return Captured(module=gm, args=args, kwargs=kwargs, frontend=frontend)


def _checked_input(example_input: Any) -> tuple[tuple, dict]:
    try:
        args, kwargs = split_input(example_input)
    except TypeError as e:
        raise CaptureError(f"{e}; pass example_input=... as one of those") from None
    leaves = [*enumerate(args), *kwargs.items()]
    for where, leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, int, float, bool, type(None))):
            raise CaptureError(
                f"example_input[{where!r}] is a {type(leaf).__name__}, not a tensor; pass "
                f"example_input=... as a tensor, a tuple of tensors or a dict of keyword tensors"
            )
    return args, kwargs


def _check_runs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, export_error) -> None:
    """symbolic_trace never looks at the input: run the graph on fake copies of it once."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            # Fake parameters and buffers too: the run must not touch the model's state
            # (BatchNorm's in-place num_batches_tracked update, say).
            state = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
            fake_state, fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, mode.from_tensor, (state, args, kwargs)
            )
            torch.func.functional_call(gm, fake_state, fake_args, fake_kwargs)
    except (DataDependentOutputException, GuardOnDataDependentSymNode):
        return  # fake tensors cannot read values (e.g. BatchNorm momentum=None); not a misfit
    except Exception as e:  # noqa: BLE001 - any other failure means the input does not fit
        shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(
            f"example_input (tensor shapes {shapes}) does not fit the model: "
            f"{type(e).__name__}: {first}. torch.export also failed: "
            f"{type(export_error).__name__}: {str(export_error).strip().splitlines()[0]}. "
            f"Fix: pass an example input of the shapes and dtypes you train with"
        ) from e


def _export(model: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    # Training never reads a KV cache, and a cache object in the output stops torch.export
    # (Hugging Face models with config.use_cache=True).
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", False) is True
    if cached:
        config.use_cache = False
    try:
        ep = torch.export.export(model, args, kwargs, strict=False)
    finally:
        if cached:
            config.use_cache = True
    # check_guards=False: input checks run as a forward pre-hook instead of a `_guards_fn`
    # call_module node, so the graph holds only the model's own operations.
    return ep.module(check_guards=False)


def _share_state(model: nn.Module, gm: torch.fx.GraphModule) -> None:
    """Re-bind any parameter/buffer the front-end copied to the model's own object."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own_buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        if name in own and own[name] is not p:
            _setattr_path(gm, name, own[name])
    for name, b in list(gm.named_buffers(remove_duplicate=False)):
        if name in own_buffers and own_buffers[name] is not b:
            owner, attr = _owner(gm, name)
            owner._buffers[attr] = own_buffers[name]


def _owner(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, attr = dotted.split(".")
    mod = root
    for part in path:
        mod = getattr(mod, part)
    return mod, attr


def _setattr_path(root: nn.Module, dotted: str, value: nn.Parameter) -> None:
    owner, attr = _owner(root, dotted)
    owner._parameters[attr] = value


def _pin_mode(gm: torch.fx.GraphModule, training: bool) -> None:
    """The graph baked in the model's train/eval behaviour (dropout, batch norm).

    Asking for the mode it already has is a no-op (training loops call ``.train()`` every
    epoch); asking for the other one raises, since the graph cannot switch.
    """
    mode_name = "train" if training else "eval"

    def _train(self: nn.Module, mode: bool = True) -> nn.Module:
        if mode != training:
            raise CaptureError(
                f"this module was captured in {mode_name} mode and its graph cannot switch "
                f"mode; call model.{'eval' if training else 'train'}() before planner.plan() "
                "to get a module for the other mode"
            )
        return self

    gm.train = types.MethodType(_train, gm)  # type: ignore[method-assign]
    gm.eval = types.MethodType(lambda self: _train(self, False), gm)  # type: ignore[method-assign]
    gm.training = training


def _user_frame(error: BaseException) -> str:
    """The deepest traceback line inside the user's code (not torch's), if any."""
    frames = traceback.extract_tb(error.__traceback__)
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    user = [f for f in frames if not f.filename.startswith(torch_dir)]
    if not user:
        return ""
    f = user[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


_DATA_DEPENDENT = (
    "data-dependent",
    "data dependent",
    "GuardOnDataDependentSymNode",
    "symbolically traced variables cannot be used as inputs to control flow",
    "Could not guard on data-dependent",
)


def _explain(model: nn.Module, errors: list[tuple[str, BaseException]]) -> str:
    name = type(model).__name__
    lines = [f"could not capture {name} as a torch.fx graph."]
    for frontend, err in errors:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = _user_frame(err)
        lines.append(f"  {frontend} failed: {type(err).__name__}: {first}")
        if where:
            lines.append(f"    at {where}")
    text = " ".join(str(e) for _, e in errors)
    if any(k in text for k in _DATA_DEPENDENT):
        lines.append(
            "The model branches on tensor values (data-dependent control flow). Fix: express "
            "the branch with torch.cond / torch.where, or move it out of forward(); if it "
            "depends on input shapes, plan with the shapes you train with."
        )
    else:
        lines.append(
            "Fix: make forward() traceable by torch.export (see the line above), or pass a "
            "model whose forward takes and returns tensors only."
        )
    return "\n".join(lines)
