"""``planner.integrations.hf.PlanCallback`` with ``Trainer``, PEFT (LoRA) and trl (issue 24).

A tiny Llama (4 layers, hidden 64, GQA, CPU, float32) trains 3 steps with the callback and
without it from the same seed: every step's gradients are bitwise equal, the plan is at 50% of
the predicted eager peak, and the Trainer's logs carry the predicted and the measured peak.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import planner
from planner.integrations.hf import PlanCallback, add_callback
from tests.planner.tiny_llama import BATCH, SEQ, Rows, batch, llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS = 3


class Grads(transformers.TrainerCallback):
    """Every optimizer step's parameter gradients, as the optimizer is about to see them."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.steps.append(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )


def train(model: torch.nn.Module, out_dir: str, callback: PlanCallback | None = None, **extra):
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=0, **extra,
    )  # fmt: skip
    grads = Grads()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(BATCH * STEPS), callbacks=[grads]
    )
    if callback is not None:
        add_callback(trainer, callback)
    trainer.train()
    return trainer, grads


def assert_bitwise(a: Grads, b: Grads) -> None:
    assert len(a.steps) == len(b.steps) == STEPS
    for step, (ga, gb) in enumerate(zip(a.steps, b.steps)):
        assert ga.keys() == gb.keys() and ga
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"step {step}: {name} differs"


def assert_peaks_logged(trainer: Any, plan: Any) -> list[dict]:
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS
    for h in logged:
        assert h["planner/predicted_peak_bytes"] == plan.predicted_peak_bytes
        assert h["planner/budget_bytes"] == plan.budget_bytes
        measured = h["planner/measured_peak_bytes"]
        # the Trainer's step is the planned one (forward, model's loss, backward) at the
        # planned shape: within 5% of the prediction, and within the budget
        assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, h
        assert measured <= plan.budget_bytes, h
    return logged


def test_at_shape_tiles_each_batch_tensor_to_the_largest_shape():
    from planner.integrations import at_shape

    x = batch(rows=2, length=6)
    tiled = at_shape({**x, "use_cache": False}, (5, 16))
    assert tiled["use_cache"] is False
    for key in ("input_ids", "attention_mask", "labels"):
        assert tiled[key].shape == (5, 16)
        assert torch.equal(tiled[key][:2, :6], x[key])  # rows and positions repeat
        assert torch.equal(tiled[key][2:4, 6:12], x[key])
    assert at_shape(x, None) is x


def test_callback_options_are_checked_when_it_is_built():
    """The checks both callbacks share (``PlanCallbackCore``): one of plan and budget, a
    positive measuring interval, an in-place plan; each says what to pass instead."""
    with pytest.raises(ValueError, match="not both or neither"):
        PlanCallback()
    with pytest.raises(ValueError, match="not both or neither"):
        PlanCallback("plan.json", mem_budget_gb=1.0)
    with pytest.raises(ValueError, match="measure_every_n_steps must be >= 1, got 0"):
        PlanCallback(mem_budget_gb="50%", measure_every_n_steps=0)
    with pytest.raises(TypeError, match="plan must be an InplacePlan"):
        PlanCallback(3)
    cb = PlanCallback(mem_budget_gb="50%", largest_shape=(2, 8), measure_every_n_steps=2)
    assert (cb.plan, cb.largest_shape, cb.history) == (None, (2, 8), [])
    assert PlanCallback(mem_budget_gb=1.0).history is not cb.history


def test_trainer_plans_on_first_batch_at_half_eager(tmp_path):
    ref_trainer, ref = train(llama(), str(tmp_path / "ref"))
    model = llama()
    cb = PlanCallback(mem_budget_gb="50%", largest_shape=(BATCH, SEQ), device="cpu")
    trainer, got = train(model, str(tmp_path / "plan"), cb)

    plan = cb.plan
    assert planner.applied_plan(model) is plan and len(plan.regions) > 0
    assert plan.budget_bytes == round(0.5 * plan.baseline_peak_bytes)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert_bitwise(got, ref)
    for a, b in zip(model.parameters(), ref_trainer.model.parameters()):
        assert torch.equal(a, b)
    logged = assert_peaks_logged(trainer, plan)
    assert cb.history == [
        {k: v for k, v in h.items() if k.startswith("planner/") or k == "step"} for h in logged
    ]


def test_trainer_in_bf16_plans_the_first_batch_under_autocast(tmp_path):
    """TrainingArguments(bf16=True): the Trainer's forward runs under torch.autocast, entered
    inside model.forward, so the first batch's pre-hook is outside it; the callback plans
    under bf16 autocast all the same (priced float32, the plan over-predicted the step)."""
    ref_trainer, ref = train(llama(), str(tmp_path / "ref"), bf16=True)
    model = llama()
    cb = PlanCallback(mem_budget_gb="50%", largest_shape=(BATCH, SEQ), device="cpu")
    trainer, got = train(model, str(tmp_path / "plan"), cb, bf16=True)
    plan = cb.plan
    assert plan.precision == "parameters float32; autocast cpu bfloat16" and plan.regions
    assert_bitwise(got, ref)
    assert_peaks_logged(trainer, plan)


def test_trainer_with_peft_applies_a_saved_plan(tmp_path):
    peft = pytest.importorskip("peft")

    def lora() -> torch.nn.Module:
        base = llama()
        torch.manual_seed(1)  # the adapters' initialisation
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(base, config)

    model = lora()
    x = batch()
    eager = planner.plan(model, x, 1.0, "none", form="inplace", device="cpu")
    p = planner.plan(model, x, eager.predicted_peak_bytes / 2e9, form="inplace", device="cpu")
    path = tmp_path / "plan.json"
    p.save(path)
    assert len(p.regions) > 0

    _, ref = train(lora(), str(tmp_path / "ref"))
    cb = PlanCallback(path)
    trainer, got = train(model, str(tmp_path / "plan"), cb)
    assert planner.applied_plan(model) is cb.plan
    assert all("lora_" in n for n in got.steps[0])  # only the adapters train
    assert_bitwise(got, ref)
    assert_peaks_logged(trainer, cb.plan)


def test_gradient_checkpointing_argument_beside_the_callback_is_turned_off(tmp_path):
    model = llama(layers=2)
    cb = PlanCallback(mem_budget_gb="50%", device="cpu")
    with pytest.warns(UserWarning, match="PlanCallback turns it off"):
        train(model, str(tmp_path), cb, gradient_checkpointing=True)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [False, False]
    assert planner.applied_plan(model) is cb.plan and len(cb.plan.regions) > 0


def test_trl_sft_trainer_with_the_callback(tmp_path):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    tokenizers = pytest.importorskip("tokenizers")
    from tests.planner.tiny_llama import VOCAB

    # a word-level tokenizer over the tiny vocabulary: nothing to download
    words = tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(words),
        pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3",
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(SEQ - 24, SEQ, (BATCH * STEPS,), generator=g)
    rows = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in lengths]
    data = datasets.Dataset.from_dict({"input_ids": rows})  # tokenized: trl pads per batch

    def sft(model: torch.nn.Module, name: str, callback: PlanCallback | None):
        args = trl.SFTConfig(
            output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
            learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
            logging_steps=1, disable_tqdm=True, seed=0, gradient_checkpointing=False,
        )  # fmt: skip
        grads = Grads()
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer,
            callbacks=[grads],
        )  # fmt: skip
        if callback is not None:
            add_callback(trainer, callback)
        trainer.train()
        return trainer, grads

    _, ref = sft(llama(), "ref", None)
    model = llama()
    # trl runs the LM head and loss through its fused, tiled kernel (fused_lm_head=True), whose
    # memory lies outside any module region: the least feasible budget is 63% of eager here
    cb = PlanCallback(mem_budget_gb="75%", largest_shape=(BATCH, SEQ), device="cpu")
    trainer, got = sft(model, "plan", cb)
    assert planner.applied_plan(model) is cb.plan and len(cb.plan.regions) > 0
    assert_bitwise(got, ref)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS
    for h in logged:
        assert h["planner/predicted_peak_bytes"] == cb.plan.predicted_peak_bytes
        # batches are padded to their own longest row (at most the planned length)
        assert h["planner/measured_peak_bytes"] <= cb.plan.budget_bytes, h
