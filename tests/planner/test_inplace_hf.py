"""In-place plans on Hugging Face models, used the way people train them (issue 11).

GPT-2 and Llama from tiny configs (float32, CPU, dropout on) are planned at half their measured
eager peak for a batch of 4 x 128 tokens and applied to the model itself (``p.apply(model)``).
Then the model, not a copy of it, is trained, evaluated, saved, reloaded and asked to generate:

- loss and every parameter gradient bitwise equal to an unwrapped copy at three sequence
  lengths, padding and attention mask included; measured peak within the budget at each;
- ``Trainer.train()`` on batches padded to their own longest sequence ends with bitwise the
  parameters an unwrapped copy's ``Trainer.train()`` ends with, and it checkpointed while doing
  so; ``evaluate()`` and ``generate()`` run without checkpointing and agree with the copy;
  ``save_model()`` + ``from_pretrained()`` give back the weights with embeddings still tied;
- LoRA (peft): planned after ``get_peft_model``; only the adapter gets gradients; the adapter
  saves and loads with peft's own ``save_pretrained`` / ``PeftModel.from_pretrained``;
- a saved plan applied to a freshly built model (``planner.apply_plan(model, path)``) gives
  bitwise the gradients and the measured peak of the original applied plan;
- Mistral (grouped-query SDPA) and Bloom (a custom ``autograd.Function`` GeLU): bitwise
  gradients, and the predicted no-checkpoint peak within 1% of the model's own eager peak.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import planner
from tests.helpers import assert_same_step_copy

os.environ["HF_HUB_OFFLINE"] = "1"  # tiny configs only; a download would be a bug

pytestmark = pytest.mark.slow

VOCAB, PAD = 64, 0
BATCH, SEQ = 4, 128  # the planned shape
LENGTHS = (128, 96, 40)  # the planned length and two shorter ones


# --- models ------------------------------------------------------------------------------------

# Token ids the configs name (bos, eos, pad) must lie inside the tiny vocabulary.
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD}


def gpt2(seed: int = 0) -> torch.nn.Module:
    """GPT-2, 3 layers, d 64, tied embeddings, embedding/attention/residual dropout 0.1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=3, n_head=2, use_cache=False,
        **SPECIAL,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).train()


# Llama and Mistral share their decoder's shape: grouped-query attention, RoPE, RMSNorm, SwiGLU.
DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    attention_dropout=0.1, use_cache=False, **SPECIAL,
)  # fmt: skip


def llama(seed: int = 0) -> torch.nn.Module:
    """Llama, 3 layers, d 64, grouped-query attention, tied embeddings, attention dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**DECODER, tie_word_embeddings=True)).train()


def mistral(seed: int = 0) -> torch.nn.Module:
    """Mistral: grouped-query attention through SDPA (transformers' eager path for it differs
    from what export captures: no repeated key/value heads, no materialised mask)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**DECODER, sliding_window=None)).train()


def bloom(seed: int = 0) -> torch.nn.Module:
    """Bloom: its GeLU is a custom ``autograd.Function`` (export inlines it, eager does not)."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    cfg = BloomConfig(
        vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=4, hidden_dropout=0.1,
        attention_dropout=0.1, use_cache=False, **SPECIAL,
    )  # fmt: skip
    return BloomForCausalLM(cfg).train()


def tokens(length: int, batch: int = BATCH, seed: int = 1, pad_last: int | None = None) -> dict:
    """A causal-LM batch; the last row right-padded by ``pad_last`` tokens (mask 0, label -100),
    by default an eighth of the length: what a collator padding to the longest row makes, and
    the input to plan with (README: under fake tensors transformers cannot see that a mask is all
    ones, so it prices the masked attention path padded batches take)."""
    pad_last = length // 8 if pad_last is None else pad_last
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if pad_last:
        ids[-1, -pad_last:] = PAD
        mask[-1, -pad_last:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def wrapped_paths(model: torch.nn.Module) -> set[str]:
    """Modules whose ``forward`` an applied plan replaced (an instance attribute)."""
    return {path for path, m in model.named_modules() if "forward" in m.__dict__}


def plain_peak_at(model: torch.nn.Module, length: int, **batch: Any) -> int:
    return planner.measure(model, tokens(length, **batch)).peak_bytes


@dataclass(frozen=True)
class Applied:
    """A model planned at half its eager peak and applied in place, and its untouched twin."""

    name: str
    model: torch.nn.Module
    reference: torch.nn.Module  # an unwrapped deep copy taken before applying: same weights
    plan: Any
    eager_peak_bytes: int
    param_ids: tuple[int, ...]  # id() of model's parameters before applying
    peaks: dict[int, int] = field(default_factory=dict)  # length -> measured peak bytes

    def peak_at(self, length: int) -> int:
        """The applied model's measured peak for a batch of ``length`` tokens (cached)."""
        if length not in self.peaks:
            self.peaks[length] = plain_peak_at(self.model, length)
        return self.peaks[length]


def plan_and_apply(name: str, model: torch.nn.Module) -> Applied:
    eager_bytes = plain_peak_at(model, SEQ)
    # Roofline prices (device="cpu"): the same plan on every run, whatever the machine's load.
    p = planner.plan(model, tokens(SEQ), eager_bytes / 2 / 1e9, form="inplace", device="cpu")
    reference = copy.deepcopy(model)
    param_ids = tuple(id(t) for t in model.parameters())
    assert p.apply(model) is model
    return Applied(name, model, reference, p, eager_bytes, param_ids)


BUILDERS = {"gpt2": gpt2, "llama": llama, "mistral": mistral, "bloom": bloom}
_CASES: dict[str, Applied] = {}


def case(name: str) -> Applied:
    """Each model planned and applied once per test session (planning is the slow part)."""
    if name not in _CASES:
        _CASES[name] = plan_and_apply(name, BUILDERS[name]())
    return _CASES[name]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def applied(request) -> Applied:
    """The two models the training-stack tests (Trainer, LoRA, saved plans) run on."""
    return case(request.param)


@pytest.fixture(scope="module", params=list(BUILDERS))
def any_applied(request) -> Applied:
    """Every model: Mistral (grouped-query SDPA) and Bloom (custom autograd.Function) too."""
    return case(request.param)


# Known defects of the in-place planner (branch inplace), each a reproducer for the report;
# strict, so a fix shows as XPASS. (check, model) -> cause. (Bloom's prediction, 7.07 MiB
# against 8.25 MiB measured, was one: its attention probabilities, held by the block loop past
# the region's end, are now priced as held: passes/eager.py ``_python_lifetimes``.)
KNOWN: dict[tuple[str, str], str] = {}


def expect_defect(request, check: str, name: str) -> None:
    reason = KNOWN.get((check, name))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason))


# --- the applied model is the user's model -----------------------------------------------------


def test_apply_keeps_the_model(any_applied: Applied):
    model, ref, p = any_applied.model, any_applied.reference, any_applied.plan
    assert p.form == "inplace"
    assert type(model) is type(ref)
    assert list(model.state_dict()) == list(ref.state_dict())  # no wrapper prefix
    assert tuple(id(t) for t in model.parameters()) == any_applied.param_ids
    if ref.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    # Half the eager peak needs checkpointing: the plan wraps modules, exactly its regions' (a
    # span's: the module whose own forward it is of) and those it runs traced
    regions = {r.place.path for r in p.regions} | set(p.traced_forwards)
    assert p.regions and wrapped_paths(model) == regions
    for path in wrapped_paths(model):
        module = model.get_submodule(path)
        # Trainer and generate() read forward signatures (label names, logits_to_keep, ...)
        own = type(module).forward.__get__(module)
        assert inspect.signature(module.forward) == inspect.signature(own)


@pytest.mark.parametrize("length", LENGTHS)
def test_gradients_bitwise_at_any_length(any_applied: Applied, length: int):
    batch = tokens(length, seed=length)
    assert_same_step_copy(any_applied.reference, any_applied.model, batch, seed=length)


@pytest.mark.parametrize("length", LENGTHS)
def test_measured_peak_within_budget(any_applied: Applied, length: int, request):
    expect_defect(request, "budget", f"{any_applied.name}-{length}")
    measured = any_applied.peak_at(length)
    budget = any_applied.plan.budget_bytes
    assert measured <= budget, (
        f"{any_applied.name} at {BATCH}x{length}: measured {measured / 2**20:.2f} MiB > budget "
        f"{budget / 2**20:.2f} MiB (eager {any_applied.eager_peak_bytes / 2**20:.2f} MiB)"
    )
    if length < SEQ:  # shorter batches take less memory than the planned one
        assert measured < any_applied.peak_at(SEQ)


def test_baseline_prediction_is_eager_peak(any_applied: Applied):
    """Priced on what eager runs: the predicted no-checkpoint peak is the measured eager peak
    (under export, Bloom's graph needed 1.87x and Mistral's 1.08x the model's own memory)."""
    baseline, eager = any_applied.plan.baseline_peak_bytes, any_applied.eager_peak_bytes
    assert abs(baseline - eager) <= 0.01 * eager, (
        f"{any_applied.name}: predicted no-checkpoint peak {baseline / 2**20:.3f} MiB vs "
        f"measured eager {eager / 2**20:.3f} MiB"
    )


def test_prediction_matches_measurement_at_planned_shape(any_applied: Applied, request):
    expect_defect(request, "prediction", any_applied.name)
    measured = any_applied.peak_at(SEQ)
    predicted = any_applied.plan.predicted_peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (
        f"{any_applied.name}: predicted {predicted / 2**20:.3f} MiB, measured "
        f"{measured / 2**20:.3f} MiB"
    )


def diverged_regions(model: torch.nn.Module, batch: dict) -> list[str]:
    """planner's warnings that a region ran other ops than planned, in one step of ``model``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return [str(w.message) for w in caught if "ran other operations" in str(w.message)]


def test_planned_ops_run_at_planned_shape(any_applied: Applied):
    """The input it was planned with runs exactly the planned op sequence: no region falls
    back to full recomputation (planner warns, once per module, when one does)."""
    model = any_applied.plan.apply(copy.deepcopy(any_applied.reference))  # not warned yet
    diverged = diverged_regions(model, tokens(SEQ))
    assert not diverged, diverged[0]


def test_unpadded_batch_falls_back_exactly_and_within_budget(applied: Applied, request):
    """A batch without padding takes transformers' other attention path: real tensors let it see
    the mask is all ones and skip it for SDPA's ``is_causal`` (ones, tril inside SDPA), while the
    fake pricing run cannot (``is_tracing()`` counts FakeTensors: transformers
    utils/import_utils.py, masking_utils.py) and prices the materialised mask (scalar_tensor,
    scalar_tensor, where). Selective regions then see other ops than planned and recompute
    fully: the same gradients, still within budget."""
    expect_defect(request, "unpadded", applied.name)
    model = applied.plan.apply(copy.deepcopy(applied.reference))
    batch = tokens(SEQ, pad_last=0)
    diverged_regions(model, batch)
    assert_same_step_copy(applied.reference, model, batch)
    measured = plain_peak_at(model, SEQ, pad_last=0)
    assert measured <= applied.plan.budget_bytes, (measured, applied.plan.budget_bytes)


# --- Trainer, evaluate, save/load, generate ----------------------------------------------------


class Texts(torch.utils.data.Dataset):
    """Token sequences of the given lengths (no padding: the collator pads per batch)."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


class PadToLongest:
    """Pads each batch to its own longest sequence; labels -100 on padding. Records lengths."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        n = max(len(r["input_ids"]) for r in rows)
        self.lengths.append(n)
        ids = torch.full((len(rows), n), PAD)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = r["input_ids"]
            mask[i, : len(r["input_ids"])] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }


TRAIN_LENGTHS = [128, 96, 40, 70, 33, 17, 50, 20, 96, 64, 40, 12]
EVAL_LENGTHS = [40, 60, 128, 17, 90]


class CheckpointCalls:
    """Counts torch.utils.checkpoint's non-reentrant calls (every in-place region runs one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = torch.utils.checkpoint._checkpoint_without_reentrant_generator

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(
            torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", counting
        )

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def trainer_for(model: torch.nn.Module, out_dir: str) -> tuple[Any, PadToLongest]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        max_steps=3, learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    collator = PadToLongest()
    trainer = Trainer(
        model=model,
        args=args,
        data_collator=collator,
        train_dataset=Texts(TRAIN_LENGTHS, seed=2),
        eval_dataset=Texts(EVAL_LENGTHS, seed=3),
    )
    return trainer, collator


def test_trainer_train_evaluate_save_generate(applied: Applied, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    # Train fresh copies (the fixture's model stays as planned for the other tests).
    model = applied.plan.apply(copy.deepcopy(applied.reference))
    ref = copy.deepcopy(applied.reference)
    calls = CheckpointCalls(monkeypatch)
    runs = {}
    for name, m in (("planned", model), ("reference", ref)):
        torch.manual_seed(0)  # same data order and dropout masks for both
        trainer, collator = trainer_for(m, str(tmp_path / name))
        result = trainer.train()
        trained_calls = calls.take()
        metrics = trainer.evaluate()
        eval_calls = calls.take()
        runs[name] = (trainer, collator, result, metrics, trained_calls, eval_calls)

    trainer, collator, result, metrics, trained_calls, eval_calls = runs["planned"]
    _, ref_collator, ref_result, ref_metrics, ref_calls, _ = runs["reference"]
    # each batch padded to its own longest sequence, and they differ
    train_lengths = collator.lengths[:3]
    assert len(set(train_lengths)) > 1 and max(train_lengths) <= SEQ, train_lengths
    assert collator.lengths == ref_collator.lengths
    # it checkpointed every region in every training step, and never in evaluation
    assert ref_calls == 0
    assert trained_calls == 3 * len(applied.plan.regions), trained_calls
    assert eval_calls == 0
    # and trained exactly like the unwrapped copy
    assert result.training_loss == ref_result.training_loss
    assert metrics["eval_loss"] == ref_metrics["eval_loss"]
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name} differs after Trainer.train()"

    # save_model + from_pretrained: same weights, embeddings still tied
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert type(loaded) is type(model)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    state = model.state_dict()
    assert list(loaded.state_dict()) == list(state)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key

    # generate(): no checkpointing (no grad), the same tokens as the unwrapped copy
    prompt = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    out = model.eval().generate(prompt, max_new_tokens=6, do_sample=False)
    assert calls.take() == 0
    assert torch.equal(out, ref.eval().generate(prompt, max_new_tokens=6, do_sample=False))
    assert out.shape == (2, 14)


# --- a saved plan on a freshly built model -----------------------------------------------------


def test_saved_plan_on_fresh_model(applied: Applied, tmp_path):
    path = tmp_path / "plan.json"
    applied.plan.save(str(path))
    fresh = {"gpt2": gpt2, "llama": llama}[applied.name]()  # same seed: same weights
    assert planner.apply_plan(fresh, str(path)) is fresh
    assert wrapped_paths(fresh) == wrapped_paths(applied.model)
    for length in (SEQ, 40):
        batch = tokens(length, seed=7)
        assert_same_step_copy(applied.model, fresh, batch, seed=7)
    assert plain_peak_at(fresh, SEQ) == applied.peak_at(SEQ)
    # removing it restores the model's own forward everywhere
    assert planner.remove(fresh) is fresh and not wrapped_paths(fresh)


def test_saved_plan_refused_on_other_architecture(applied: Applied, tmp_path):
    path = tmp_path / "plan.json"
    applied.plan.save(str(path))
    other = {"gpt2": llama, "llama": gpt2}[applied.name]()
    with pytest.raises(planner.PlanFileError, match=type(applied.model).__name__):
        planner.apply_plan(other, str(path))
    assert not wrapped_paths(other)


# --- LoRA --------------------------------------------------------------------------------------


def test_lora_adapter_only_gradients_and_peft_save_load(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    def lora_model() -> torch.nn.Module:
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        return get_peft_model(llama(), cfg)

    model = lora_model()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    eager_bytes = plain_peak_at(model, SEQ)
    # Roofline prices (device="cpu"): the same plan on every run, whatever the machine's load.
    p = planner.plan(model, tokens(SEQ), eager_bytes / 2 / 1e9, form="inplace", device="cpu")
    ref = copy.deepcopy(model)
    assert p.apply(model) is model and wrapped_paths(model)
    assert plain_peak_at(model, SEQ) <= p.budget_bytes

    adapters = {n for n, t in model.named_parameters() if t.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    for m in (model, ref):
        torch.manual_seed(0)
        opt = torch.optim.AdamW([t for t in m.parameters() if t.requires_grad], lr=1e-2)
        for step, length in enumerate(LENGTHS):
            opt.zero_grad(set_to_none=True)
            m(**tokens(length, seed=step)).loss.backward()
            with_grad = {n for n, t in m.named_parameters() if t.grad is not None}
            assert with_grad == adapters  # every adapter weight, nothing of the frozen base
            opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name} differs after training"
    for k, v in model.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), f"frozen {k} changed"

    model.save_pretrained(str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(llama(), str(tmp_path / "adapter"))
    state = model.state_dict()
    lora_keys = [k for k in state if "lora_" in k]
    assert lora_keys
    for key in lora_keys:
        assert torch.equal(loaded.state_dict()[key], state[key]), key
