"""The user's own training stack (issue 24): a loss that reads the batch's labels, clear errors
for what planning on fake tensors cannot follow, plan files that refuse a model of other
shapes."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.passes.regions import Place, RunPlace, SpanPlace
from planner.planning import price_form
from planner.solvers.costgraph import Region, Schedule
from planner.solvers.errors import UnsupportedModelError
from tests.helpers import assert_same_step_copy


class _Classifier(nn.Module):
    """Residual MLP blocks and a head: a forward that takes only the features."""

    def __init__(self, width: int = 32, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _classifier_batch(width: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    model = _Classifier(width)
    batch = {"x": torch.randn(64, width), "labels": torch.randint(0, 10, (64,))}
    return model, batch


def _cross_entropy(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(output, batch["labels"])


def _least_bytes(model, batch, form, loss_fn) -> int:
    with pytest.raises(planner.InfeasibleBudgetError) as e:
        planner.plan(model, batch, 1e-9, form=form, loss_fn=loss_fn, device="cpu")
    return e.value.min_bytes


# --------------------------------------------------------------------------- a step with labels


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_a_loss_of_output_and_batch_is_priced_measured_and_trains_alike(form):
    """loss_fn(output, batch) with the labels in the example input: the model gets what its
    forward takes, the loss the whole batch; priced on fake tensors, measured for real."""
    model, batch = _classifier_batch()
    reference = copy.deepcopy(model)
    eager_bytes = planner.measure(model, batch, _cross_entropy).peak_bytes
    least = _least_bytes(model, batch, form, _cross_entropy)
    assert least < eager_bytes
    for budget in (least + (eager_bytes - least) // 3, (least + eager_bytes) // 2):
        p = planner.plan(
            model, batch, budget / 1e9, form=form, loss_fn=_cross_entropy, device="cpu"
        )
        assert p.regions and p.baseline_peak_bytes == eager_bytes
        planned = p.apply(copy.deepcopy(model)) if form == "inplace" else p.module
        measured = planner.measure(planned, batch, _cross_entropy).peak_bytes
        assert measured <= p.predicted_peak_bytes <= budget
        if form == "inplace":  # priced on what eager runs: exact
            assert measured == p.predicted_peak_bytes
        else:  # the graph form prices the exported graph, on the safe side
            assert p.predicted_peak_bytes <= 1.01 * measured
        assert_same_step_copy(reference, planned, batch, loss_fn=_cross_entropy)


def test_a_tuple_batch_gives_the_model_the_features_and_the_loss_the_labels():
    model, batch = _classifier_batch()
    pair = (batch["x"], batch["labels"])

    def loss_fn(output, b):
        return F.cross_entropy(output, b[1])

    p = planner.plan(model, pair, 1.0, form="inplace", loss_fn=loss_fn, solver="none", device="cpu")
    assert p.baseline_peak_bytes == planner.measure(model, pair, loss_fn).peak_bytes


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_labels_held_from_outside_the_batch_say_how_to_pass_them(form):
    model, batch = _classifier_batch()
    labels = batch["labels"]
    with pytest.raises(UnsupportedModelError, match=r"Put the labels in the example input"):
        planner.plan(
            model,
            batch["x"],
            1.0,
            form=form,
            loss_fn=lambda out: F.cross_entropy(out, labels),
            device="cpu",
        )


# --------------------------------------------------------------------------- clear errors


class _Gate(nn.Module):
    """Branches on a value, or reads one with .item()."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.how == "if":
            return h * 2 if h.sum() > 0 else h
        return h * x.abs().max().item()


@pytest.mark.parametrize("how", ["if", "item"])
def test_data_dependent_control_flow_names_the_module_and_the_fix(how):
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(_Gate(how), nn.ReLU()), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    fix = r"module '1\.0' \(_Gate\) reads a tensor's value .* Fix: .*torch\.where"
    with pytest.raises(UnsupportedModelError, match=fix):
        planner.plan(model, x, 1.0, form="inplace", device="cpu")
    if how == "item":  # a branch stops torch.export itself (a CaptureError saying so)
        with pytest.raises(UnsupportedModelError, match=fix):
            planner.plan(model, x, 1.0, form="graph", device="cpu")


def _loss_warnings(fn) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if w.category is planner.LossFallbackWarning]


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_a_loss_that_falls_back_to_the_sum_of_outputs_says_so_once(form):
    model, batch = _classifier_batch()
    x = batch["x"]

    def plan(**kw):
        return planner.plan(model, x, 1.0, form=form, solver="none", device="cpu", **kw)

    (message,) = _loss_warnings(plan)
    assert "holds no loss" in message and "loss_fn=" in message
    assert _loss_warnings(lambda: plan(loss_fn=lambda out: out.logsumexp(-1).mean())) == []


def test_a_model_that_returns_its_scalar_loss_plans_without_a_warning():
    model, batch = _classifier_batch()

    class _WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x, labels):
            return F.cross_entropy(self.inner(x), labels)

    args = (batch["x"], batch["labels"])
    plan = functools.partial(planner.plan, _WithLoss(), args, 1.0, form="inplace", device="cpu")
    assert _loss_warnings(plan) == []


def test_an_hf_output_without_loss_says_the_batch_has_no_labels():
    from transformers.modeling_outputs import CausalLMOutput

    class _LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.embed(input_ids))
            loss = (
                None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            )
            return CausalLMOutput(loss=loss, logits=logits)

    ids = torch.randint(0, 16, (2, 8))
    plan = functools.partial(planner.plan, _LM(), mem_budget_gb=1.0, form="inplace", device="cpu")
    (message,) = _loss_warnings(lambda: plan(example_input={"input_ids": ids}))
    assert "CausalLMOutput.loss is None" in message and "labels" in message
    assert _loss_warnings(lambda: plan(example_input={"input_ids": ids, "labels": ids})) == []


# --------------------------------------------------------------------------- plan files


def test_a_plan_refuses_a_model_whose_parameter_shapes_differ(tmp_path):
    model, batch = _classifier_batch(width=32)
    wider, _ = _classifier_batch(width=64)  # the same module tree, other widths
    p = planner.plan(model, batch, 1.0, form="inplace", loss_fn=_cross_entropy, device="cpu")
    path = tmp_path / "plan.json"
    p.save(path)
    first = r"parameter 'blocks\.0\.0\.weight' of shape \[128, 32\], this model has \[256, 64\]"
    with pytest.raises(planner.PlanFileError, match=first):
        planner.apply_plan(wider, path)
    with pytest.raises(planner.PlanFileError, match=first):
        p.apply(wider)
    assert planner.apply_plan(model, path) is model


def test_a_plan_file_saved_before_parameter_shapes_still_applies(tmp_path):
    import json

    from planner.plan_file import _checksum

    model, batch = _classifier_batch()
    wider, _ = _classifier_batch(width=64)
    path = tmp_path / "plan.json"
    planner.plan(model, batch, 1.0, form="inplace", loss_fn=_cross_entropy, device="cpu").save(path)
    body = json.loads(path.read_text())
    del body["checksum"], body["parameter_shapes"]
    body["checksum"] = _checksum(body)
    path.write_text(json.dumps(body))
    assert planner.apply_plan(model, path) is model
    assert planner.apply_plan(wider, path) is wider  # no shapes recorded: not checked


# --------------------------------------------------------------------------- BatchNorm in place


class _BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: BatchNorm, in-place ReLU, in-place residual add."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class _ResNet(nn.Module):
    def __init__(self, channels: int = 8, blocks: int = 6) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
        )
        self.layers = nn.Sequential(*(_BasicBlock(channels) for _ in range(blocks)))
        self.fc = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))


def _assert_trains_alike_with_statistics(reference, planned, x, steps: int = 2) -> None:
    """Bitwise the same loss, gradients and BatchNorm statistics, step after step: each
    statistic updated exactly once per step (num_batches_tracked counts the steps)."""
    counts = {n: b.item() for n, b in planned.named_buffers() if n.endswith("batches_tracked")}
    assert counts
    for _ in range(steps):
        assert_same_step_copy(reference, planned, x)
    for (name, a), b in zip(reference.named_buffers(), planned.buffers()):
        assert torch.equal(a, b), f"buffer {name} differs"
        if name in counts:
            assert b.item() == counts[name] + steps, name


def _bn_paths(model) -> set[str]:
    return {path for path, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}


def _covered(model, region: Place, nodes: tuple[str, ...] = ()) -> set[str]:
    """The module paths an in-place region runs: a module's, a run's children's, or those whose
    ops a span of a module's own forward runs (its ``nodes``: ``<module path>:<op>:<k>``)."""
    if isinstance(region, SpanPlace):
        return {node.split(":")[0] for node in nodes}
    path = region.path
    children = slice(region.start, region.stop) if isinstance(region, RunPlace) else None
    module = model.get_submodule(path)
    if children is not None:
        module = module[children]
        names = range(children.start, children.stop)
        return {
            f"{path}.{k}{f'.{n}' if n else ''}"
            for k, c in zip(names, module)
            for n, _ in c.named_modules()
        }
    return {f"{path}.{n}" if n else path for n, _ in module.named_modules()}


def test_a_resnet_with_batchnorm_and_in_place_relu_plans_below_half_of_eager(tmp_path):
    torch.manual_seed(0)
    model, x = _ResNet(), torch.randn(4, 3, 16, 16)
    reference = copy.deepcopy(model)
    eager_bytes = planner.measure(model, x).peak_bytes
    budget = eager_bytes // 2
    p = planner.plan(model, x, budget / 1e9, form="inplace", device="cpu")
    regions = {r.name for r in p.regions}
    # regions hold BatchNorm modules (whole blocks: the in-place ReLU ties a BN to its block)
    assert any(any(bn.startswith(f"{r}.") for bn in _bn_paths(model)) for r in regions)
    planned = p.apply(copy.deepcopy(model))
    measured = planner.measure(planned, x).peak_bytes
    assert measured == p.predicted_peak_bytes <= budget
    _assert_trains_alike_with_statistics(reference, planned, x)
    path = tmp_path / "plan.json"
    p.save(path)  # the statistics a region writes travel in the file
    from_file = planner.apply_plan(copy.deepcopy(reference), path)
    _assert_trains_alike_with_statistics(copy.deepcopy(reference), from_file, x, steps=1)


def test_the_unet_plans_at_half_of_eager_in_place_with_batchnorm_regions():
    """The U-Net's skips and concatenations live in the root's own forward, whose spans are
    regions in place too (passes/parent_spans.py), with module regions and runs of a
    Sequential's children (conv + BN of each conv-BN-ReLU); none of its ops draws random
    numbers, so no region stashes the RNG state (simulate's Rule 12). At half of eager: measured
    as predicted, within the budget, and trained bitwise alike, BatchNorm statistics included
    (how far below half: tests/planner/test_unet_floor.py)."""
    from tests.models_zoo import small_unet_example

    model, x = small_unet_example()
    reference = copy.deepcopy(model)
    half = planner.measure(model, x).peak_bytes // 2
    p = planner.plan(model, x, half / 1e9, form="inplace", device="cpu")
    assert _bn_paths(model) & set().union(*(_covered(model, r.place, r.nodes) for r in p.regions))
    planned = p.apply(copy.deepcopy(model))
    assert planner.measure(planned, x).peak_bytes == p.predicted_peak_bytes <= half
    _assert_trains_alike_with_statistics(reference, planned, x)


# ------------------------------------------------------------ runs of an nn.Sequential's children


def _residual_cnn():
    """benchmarks' ResidualCNN, small: a Sequential of 4 residual blocks with BatchNorm. With
    one region per block its least in-place budget was 51.6% of eager (every block's input
    held by its region at the last block's backward)."""
    from benchmarks.models import residual_cnn_example

    model, x = residual_cnn_example(batch=8, size=16, channels=8, n_blocks=4)
    return model.train(), x


def test_a_residual_cnn_plans_below_half_of_eager_with_runs_of_its_blocks(tmp_path):
    """Runs of consecutive blocks checkpointed as one call, nested, free the block inputs the
    per-block regions held: below half of eager, measured as predicted, trained alike (loss,
    gradients, BatchNorm statistics bitwise), through a plan file too."""
    model, x = _residual_cnn()
    reference = copy.deepcopy(model)
    eager_bytes = planner.measure(copy.deepcopy(model), x).peak_bytes
    least = _least_bytes(model, x, "inplace", None)
    assert least < eager_bytes / 2
    p = planner.plan(model, x, least / 1e9, form="inplace", device="cpu")
    runs = [r.name for r in p.regions if r.name.startswith("blocks[")]
    assert runs, [r.name for r in p.regions]
    planned = p.apply(copy.deepcopy(model))
    assert planner.measure(planned, x).peak_bytes == p.predicted_peak_bytes <= least
    _assert_trains_alike_with_statistics(copy.deepcopy(reference), planned, x)
    path = tmp_path / "plan.json"
    p.save(path)
    from planner.inplace_form import load_inplace

    assert load_inplace(path).regions == p.regions  # the run regions' names, ops, statistics
    from_file = planner.apply_plan(copy.deepcopy(reference), path)
    assert planner.measure(from_file, x).peak_bytes == p.predicted_peak_bytes
    _assert_trains_alike_with_statistics(copy.deepcopy(reference), from_file, x, steps=1)
    planner.remove(from_file)
    assert not any("forward" in m.__dict__ for m in from_file.modules())


@pytest.mark.parametrize(
    "names",
    [
        ("blocks[0:3]", "blocks[0:2]"),  # BatchNorm copies made again in the recomputation
        ("blocks[0:3]", "blocks.0", "blocks.1", "blocks.2"),
        ("blocks", "blocks[0:3]", "blocks[1:3]", "blocks.1"),  # a run inside the Sequential's
    ],
)
def test_nested_runs_are_priced_as_measured(names):
    """simulate's Rule 9 for a region nested in a recomputation: its BatchNorm copies die with
    that call's frame (288 B over the measured peak before)."""
    from planner.devices import device_profile
    from planner.inplace_form import build_inplace_plan, price_inplace

    model, x = _residual_cnn()
    eg = price_inplace(model, x, device=device_profile("cpu"))
    span = {path: s for s, path in eg.spans.items()}
    spans = [span[n] for n in names]
    regions = tuple(
        Region(a, b, depth=sum(1 for c, d in spans if c <= a and b <= d and (c, d) != (a, b)))
        for a, b in spans
    )
    p = build_inplace_plan(model, eg, Schedule(regions), 10**12)
    assert [r.name for r in p.regions] == list(names)
    reference = copy.deepcopy(model)
    planned = p.apply(copy.deepcopy(model))
    assert planner.measure(planned, x).peak_bytes == p.predicted_peak_bytes
    _assert_trains_alike_with_statistics(reference, planned, x, steps=1)


def test_runs_compile_and_train_alike():
    """torch.compile over a model with runs applied: the run structure is fixed when applied,
    so dynamo traces plain loops; bitwise the same loss, gradients and statistics."""
    model, x = _residual_cnn()
    reference = copy.deepcopy(model)
    least = _least_bytes(model, x, "inplace", None)
    p = planner.plan(model, x, least / 1e9, form="inplace", device="cpu")
    assert any("[" in r.name for r in p.regions)
    planned = p.apply(copy.deepcopy(model))
    torch._dynamo.reset()
    compiled = torch.compile(planned, backend="aot_eager")
    for module in (reference, compiled):
        torch.manual_seed(0)
        module(x).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), planned.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(reference.named_buffers(), planned.buffers()):
        assert torch.equal(a, b), name


class _OwnSequential(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x) * 2
        return x


def test_runs_are_offered_only_where_sequential_runs_its_children_back_to_back():
    from planner.devices import device_profile
    from planner.inplace_form import price_inplace

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    model = nn.Sequential(
        nn.Sequential(*layers[:3]), _OwnSequential(*layers[3:], nn.Linear(8, 8), nn.Linear(8, 8))
    )
    eg = price_inplace(
        model, torch.randn(4, 8), device=device_profile("cpu"), loss_fn=lambda y: y.sum()
    )
    names = set(eg.spans.values())
    assert {"0[0:2]", "0[1:3]"} <= names  # the whole Sequential is "0" itself
    assert not any(n.startswith("1[") for n in names)  # its own forward runs ops between


def test_a_long_sequential_offers_runs_between_every_kth_child():
    from planner.devices import device_profile
    from planner.inplace_form import price_inplace
    from planner.passes.candidates import MAX_RUN_CUTS

    n = 2 * MAX_RUN_CUTS + 1  # runs start and end at every 3rd child
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n)))
    eg = price_inplace(model, torch.randn(2, 4), device=device_profile("cpu"))
    runs = [p for p in eg.places.values() if isinstance(p, RunPlace)]
    cuts = {*range(0, n, 3), n}
    assert runs and all(r.start in cuts and r.stop in cuts for r in runs)
    assert len(runs) == len(cuts) * (len(cuts) - 1) // 2 - 1  # every pair but all n


def test_a_plan_file_run_on_a_shorter_sequential_names_it(tmp_path):
    from planner.inplace import ModuleRegion
    from planner.inplace_check import check_fits, module_tree

    model, _ = _residual_cnn()
    short, _ = _residual_cnn()
    short.blocks = short.blocks[:2]
    with pytest.raises(planner.PlanFileError, match=r"'blocks' as one call.*at least 3"):
        check_fits(short, "ResidualCNN", module_tree(model), (ModuleRegion("blocks[0:3]"),), "f")


# --------------------------------------------------------------------------- mixed precision


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_a_plan_made_inside_autocast_prices_the_amp_step_it_measures(tmp_path):
    """Inside torch.autocast the step is the AMP recipe's: forward and loss under a fresh
    autocast context (its cached bf16 weight copies die with it, unless backward holds them),
    backward outside. Priced as measured, at budgets from the least feasible to eager."""
    model, batch = _classifier_batch()
    with _bf16_autocast():
        eager_bytes = planner.measure(model, batch, _cross_entropy).peak_bytes
        least = _least_bytes(model, batch, "inplace", _cross_entropy)
        for budget in (least, (least + eager_bytes) // 2, eager_bytes):
            p = planner.plan(
                model, batch, budget / 1e9, form="inplace", loss_fn=_cross_entropy, device="cpu"
            )
            assert p.baseline_peak_bytes == eager_bytes
            planned = p.apply(copy.deepcopy(model))
            measured = planner.measure(planned, batch, _cross_entropy).peak_bytes
            assert measured <= p.predicted_peak_bytes <= min(budget, 1.01 * measured)
    assert "autocast cpu bfloat16" in p.summary() and "parameters float32" in p.summary()
    path = tmp_path / "plan.json"
    p.save(path)
    assert '"precision": "parameters float32; autocast cpu bfloat16"' in path.read_text()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plan_autocast_argument_prices_as_inside_autocast(dtype):
    """``plan(..., autocast=dtype)``: the same plan as one made inside ``torch.autocast``, for a
    script that plans outside its training loop; measured inside autocast as predicted."""
    model, batch = _classifier_batch()
    with torch.autocast("cpu", dtype=dtype):
        eager_bytes = planner.measure(model, batch, _cross_entropy).peak_bytes
    kw = dict(form="inplace", loss_fn=_cross_entropy, device="cpu")
    with pytest.raises(planner.InfeasibleBudgetError) as e:
        planner.plan(model, batch, 1e-9, autocast=dtype, **kw)
    budget = (e.value.min_bytes + eager_bytes) // 2
    p = planner.plan(model, batch, budget / 1e9, autocast=dtype, **kw)
    with torch.autocast("cpu", dtype=dtype):
        inside = planner.plan(model, batch, budget / 1e9, **kw)
        measured = planner.measure(p.apply(copy.deepcopy(model)), batch, _cross_entropy)
    assert [r.name for r in p.regions] == [r.name for r in inside.regions] != []
    assert p.baseline_peak_bytes == inside.baseline_peak_bytes == eager_bytes
    assert measured.peak_bytes == p.predicted_peak_bytes == inside.predicted_peak_bytes <= budget
    assert p.precision == f"parameters float32; autocast cpu {str(dtype).removeprefix('torch.')}"
    assert not torch.is_autocast_enabled("cpu")  # the context ends with plan()
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float16"):
        planner.plan(model, batch, budget / 1e9, autocast=torch.float32, **kw)


def test_a_bf16_model_is_priced_in_bf16():
    model, batch = _classifier_batch()
    model = model.to(torch.bfloat16)
    batch["x"] = batch["x"].to(torch.bfloat16)
    eager_bytes = planner.measure(model, batch, _cross_entropy).peak_bytes
    least = _least_bytes(model, batch, "inplace", _cross_entropy)
    budget = (least + eager_bytes) // 2
    p = planner.plan(
        model, batch, budget / 1e9, form="inplace", loss_fn=_cross_entropy, device="cpu"
    )
    assert p.baseline_peak_bytes == eager_bytes
    measured = planner.measure(p.apply(copy.deepcopy(model)), batch, _cross_entropy).peak_bytes
    assert measured == p.predicted_peak_bytes <= budget
    assert "priced in parameters bfloat16" in p.summary()


def test_attention_weights_sdpa_casts_back_and_drops_late_are_priced_to_their_death():
    """Under bf16 autocast on CPU, SDPA's math path computes in float32 and returns its
    attention weights cast back to bf16 as a second output, which SDPA drops only as it
    returns: no op reads that copy, yet it lives through the product with V and the output's
    cast. Priced as a temporary of its cast, a region recomputing the attention was predicted
    16 KiB below its measured peak (the budget promise broken by 1.7%)."""
    pytest.importorskip("transformers")
    from tests.planner.tiny_llama import batch, llama

    model, x = llama(layers=2), batch(2, 32)
    with _bf16_autocast():
        priced = price_form(model, x, "inplace", device="cpu")
        (span,) = [s for s, path in priced.eager.spans.items() if path.endswith("1.self_attn")]
        p = priced.build(Schedule((Region(*span),)), priced.eager_peak_bytes)
        measured = planner.measure(p.apply(copy.deepcopy(model)), x).peak_bytes
    assert p.simulation.peak_event.startswith("recompute:")  # the recomputed attention's peak
    assert measured == p.predicted_peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["autocast", "model"])
def test_a_llama_in_bf16_planned_at_half_of_eager_is_predicted_as_measured(precision):
    """bf16 autocast and a bf16 model (issue 24): predicted within 1% of measured in place
    (exact on CPU), at half the eager peak."""
    pytest.importorskip("transformers")
    from tests.planner.tiny_llama import batch, llama

    model, x = llama(layers=4), batch(2, 64)
    if precision == "model":
        model = model.to(torch.bfloat16)
    with _bf16_autocast() if precision == "autocast" else contextlib.nullcontext():
        eager_bytes = planner.measure(model, x).peak_bytes
        p = planner.plan(model, x, eager_bytes / 2e9, form="inplace", device="cpu")
        measured = planner.measure(p.apply(copy.deepcopy(model)), x).peak_bytes
    assert p.baseline_peak_bytes == eager_bytes and p.regions
    assert measured <= p.budget_bytes
    assert abs(p.predicted_peak_bytes - measured) <= 0.01 * measured
    assert "bfloat16" in p.precision
