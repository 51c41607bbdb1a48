"""The user's model for a command: MODEL (MODULE:FACTORY or a Hugging Face class) loaded and
built, its example input made from the shape flags, both moved to --device.

Errors in the user's code (an import that fails, a factory that raises) become one-line
:class:`UsageError`s that name the fix.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.cli_flags import UsageError, factory_kwargs, one_line, parse_shape, placement


def load_callable(spec: str, what: str = "MODEL") -> Any:
    """'package.module:attr' or 'path/to/file.py:attr' -> the attribute (dots walk into it).

    ``what`` names the argument in errors: MODEL (MODULE:FACTORY) or --loss (MODULE:FUNCTION).
    """
    form = "MODULE:FACTORY" if what == "MODEL" else "MODULE:FUNCTION"
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        example = "benchmarks.models:gpt_ref_small_example" if what == "MODEL" else "losses:ce"
        raise UsageError(f"{what} must be {form}, e.g. {example}; got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"no such file {module_name!r}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
        sys.path.insert(0, str(path.resolve().parent))
        try:
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:  # the user's file: any error in it is theirs to fix
            raise UsageError(f"cannot load {module_name}: {one_line(e)}") from e
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            named = e.name is None or module_name == e.name or module_name.startswith(e.name + ".")
            if not named:  # the module is there, but something it imports is not
                raise UsageError(
                    f"importing {module_name!r} needs {e.name!r}, which is not installed "
                    f"({one_line(e)})"
                ) from e
            raise UsageError(
                f"cannot import {module_name!r} ({e}); run from the directory that holds it, "
                f"or give a file path like path/to/{module_name.replace('.', '/')}.py:{attr}"
            ) from e
        except Exception as e:
            raise UsageError(f"cannot import {module_name!r}: {one_line(e)}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec} is not callable; {what} must name a function or a class")
    return obj


def is_hf_class(obj: Any) -> bool:
    """A Hugging Face model class: built from a config (``config_class`` or ``from_config``)."""
    return isinstance(obj, type) and (hasattr(obj, "config_class") or hasattr(obj, "from_config"))


def read_hf_config(text: str) -> dict[str, Any]:
    """--hf-config: JSON text, a JSON file, or a directory holding config.json."""
    source = text.strip()
    if not source.startswith("{"):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UsageError(
                f"--hf-config {text!r} is neither a JSON object nor a config file; give e.g. "
                f"--hf-config '{{\"num_hidden_layers\": 2}}' or path/to/config.json"
            )
        source = path.read_text()
    try:
        config = json.loads(source)
    except json.JSONDecodeError as e:
        raise UsageError(f"--hf-config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UsageError("--hf-config must be a JSON object of config fields")
    return config


def build_hf_model(cls: Any, spec: str, config_text: str) -> Any:
    """``cls(cls.config_class(**config))``, or ``cls.from_config`` (the Auto classes, whose
    config names its ``model_type``)."""
    fields = read_hf_config(config_text)
    try:
        if hasattr(cls, "config_class") and cls.config_class is not None:
            config = cls.config_class(**fields)
            return cls(config)
        from transformers import AutoConfig

        fields = dict(fields)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise UsageError(
                f'{spec} picks its model class from the config: give its "model_type" in '
                f'--hf-config, e.g. \'{{"model_type": "llama", "num_hidden_layers": 2}}\''
            )
        return cls.from_config(AutoConfig.for_model(model_type, **fields))
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot build {spec} from --hf-config: {one_line(e)}") from e


def make_model(args: argparse.Namespace, *factory_args: Any) -> Any:
    """What MODEL names, built: a Hugging Face class from --hf-config, else FACTORY called with
    ``factory_args`` and --factory-kwargs. Its errors become one-line usage errors."""
    factory = load_callable(args.model)
    hf_config = getattr(args, "hf_config", None)
    if hf_config is not None:
        if not is_hf_class(factory):
            raise UsageError(
                f"--hf-config builds a Hugging Face model class (one with config_class or "
                f"from_config); {args.model} is not one"
            )
        return build_hf_model(factory, args.model, hf_config)
    if is_hf_class(factory) and not factory_args:
        raise UsageError(
            f"{args.model} is a Hugging Face model class, built from a config: give it with "
            f"--hf-config, e.g. --hf-config '{{\"num_hidden_layers\": 2}}' or "
            f"--hf-config path/to/config.json"
        )
    try:
        return factory(*factory_args, **factory_kwargs(args))
    except UsageError:
        raise
    except Exception as e:  # the user's factory: say what it raised, in one line
        call = ", ".join([*map(repr, factory_args), *(f"{k}=..." for k in factory_kwargs(args))])
        raise UsageError(f"{args.model}({call}) raised {one_line(e)}") from e


def build_example(args: argparse.Namespace) -> tuple[Any, Any]:
    """Build the model; build the example input from the shape flags when it comes alone."""
    import torch

    made = make_model(args)
    if args.hf_config is not None:
        if not args.input_shape:
            raise UsageError(
                f"{args.model} needs the shape of its token ids: --input-shape BATCH,LENGTH, "
                f"e.g. --input-shape 2,128"
            )
        if len(args.input_shape) > 1:
            raise UsageError("--hf-config takes one --input-shape, BATCH,LENGTH of the token ids")
        vocab = getattr(made.config, "vocab_size", None) or args.input_high
        ids = make_inputs(args.input_shape, args.input_dtype or ["int64"], vocab)
        model, example_input = made.train(), {"input_ids": ids, "labels": ids}
    elif isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, example_input = made
        if args.input_shape:
            raise UsageError(f"{args.model} returns its own example input; drop --input-shape")
    elif isinstance(made, torch.nn.Module):
        model = made
        if not args.input_shape:
            raise UsageError(
                f"{args.model} returns a model without an example input; give its shape, "
                f"e.g. --input-shape 8,3,32,32 (repeat the flag for several inputs)"
            )
        example_input = make_inputs(args.input_shape, args.input_dtype, args.input_high)
    else:
        raise UsageError(
            f"{args.model} returned {type(made).__name__}; FACTORY must return an nn.Module or "
            f"a (model, example_input) tuple"
        )
    place = placement(args.device)
    if place is not None:
        model = model.to(place)
        example_input = to_device(example_input, place)
    return model, example_input


def make_inputs(shapes: Sequence[str], dtypes: Sequence[str] | None, int_high: int) -> Any:
    """Random example tensors: floats from a normal distribution, integers in [0, int_high)."""
    import torch

    dtypes = list(dtypes or ["float32"])
    if len(dtypes) == 1:
        dtypes *= len(shapes)
    if len(dtypes) != len(shapes):
        raise UsageError("give one --input-dtype, or one per --input-shape")
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for shape_text, dtype_name in zip(shapes, dtypes):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"unknown dtype {dtype_name!r}; e.g. float32, bfloat16, int64")
        shape = parse_shape(shape_text)
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            tensors.append(torch.randint(0, int_high, shape, generator=generator, dtype=dtype))
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def to_device(example_input: Any, device: Any) -> Any:
    """``example_input`` (a tensor, or a dict, tuple or list of them) moved to ``device``."""
    import torch

    if isinstance(example_input, torch.Tensor):
        return example_input.to(device)
    if isinstance(example_input, dict):
        return {k: to_device(v, device) for k, v in example_input.items()}
    if isinstance(example_input, (tuple, list)):
        return type(example_input)(to_device(v, device) for v in example_input)
    return example_input
