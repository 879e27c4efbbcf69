"""GRPO trainer: reference via disabled adapters, exact accumulation, a reward that rises, exact resume."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    SMALL_RUN,
    first_digit_is_one,
    fixed_experience,
    one_round_gradients,
    rewards_before_and_after_training,
    uninterrupted_and_resumed,
)

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.models.parameters import adapters_disabled
from grpo_ascend.models.policy import CompletionLogprobs, apply_peft, default_lora_config, load_causal_lm


def _config(tmp_path, **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), **kw})


def test_reference_is_base_with_adapters_disabled(tiny_model_dir):
    torch.manual_seed(0)
    base = load_causal_lm(str(tiny_model_dir))
    base_lp = CompletionLogprobs(base)
    peft_model = apply_peft(load_causal_lm(str(tiny_model_dir)), default_lora_config(r=4))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # make the adapter change the outputs
    lp = CompletionLogprobs(peft_model)
    prompt = torch.randint(5, 500, (3, 7))
    comp = torch.randint(5, 500, (3, 5))
    pm, cm = torch.ones_like(prompt), torch.ones_like(comp)
    pm[0, :2] = 0
    with torch.no_grad():
        expected = base_lp(prompt, pm, comp, cm)[0]
        with adapters_disabled(peft_model):
            ref = lp(prompt, pm, comp, cm)[0]
        adapted = lp(prompt, pm, comp, cm)[0]
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-6)
    assert (adapted - expected).abs().max() > 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_is_exact(tmp_path, tiny_model_dir, loss_type):
    grads = []
    for micro, accum in ((8, 1), (2, 4)):
        cfg = _config(tmp_path, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                      steps_per_generation=accum, loss_type=loss_type, beta=0.04, num_generations=2)
        trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                              peft_config=default_lora_config(r=4))
        for name, p in trainer.policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(hash(name) % 1000))
        grads.append(one_round_gradients(trainer, fixed_experience())[0])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5)


def test_no_full_vocabulary_tensor_outlives_a_micro_batch_backward(tmp_path, tiny_model_dir):
    """Without an entropy term the policy forward's entropies carry no graph: the trainer keeps them
    (detached into the stats) through the backward, and the checkpointed chunks' softmax/product
    recomputed there for them, never consumed, would live on into the next micro-batch -- 3 [chunk, V]
    tensors per chunk, 2.6 GiB at Qwen2.5's vocabulary with 8 x 256 tokens (docs/benchmarks.md)."""
    import gc
    import warnings

    def is_vocab_tensor(o, vocab):
        try:
            return isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[1] == vocab
        except ReferenceError:  # a weakref proxy whose object is gone
            return False

    def vocab_tensors(vocab):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sum(o.numel() for o in gc.get_objects() if is_vocab_tensor(o, vocab))

    cfg = _config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, beta=0.04, num_generations=2)
    trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4))
    vocab = trainer.policy.config.vocab_size
    alive, backward = [], trainer.strategy.backward  # every micro-batch's backward goes through the strategy
    trainer.strategy.backward = lambda model, loss: (backward(model, loss), alive.append(vocab_tensors(vocab)))
    one_round_gradients(trainer, fixed_experience())
    assert alive == [0, 0]


@pytest.mark.slow
def test_reward_rises_on_a_learnable_pattern(tmp_path, tiny_warm_model_dir):
    """The trained policy's sampled reward on held-out prompts ends far above the same evaluation
    before training (the control: same model, prompts and sampling, no updates).

    Measured (eval reward before → after, 64 held-out prompts × 8): 0.32 → 0.99 (warm seed 0), 0.29 → 0.99
    (warm seed 1); at learning rate 0, 0.32 → 0.32 exactly; with the advantages' sign flipped 0.32 → 0.00,
    and this fails.
    """
    cfg = _config(tmp_path, max_steps=30, per_device_train_batch_size=32, num_generations=8, learning_rate=5e-3,
                  max_completion_length=8, temperature=1.0, per_device_eval_batch_size=256)
    trainer = GRPOTrainer(str(tiny_warm_model_dir), first_digit_is_one, cfg, arithmetic_dataset(400, seed=5),
                          peft_config=default_lora_config(r=8))
    control, trained = rewards_before_and_after_training(trainer, arithmetic_dataset(64, seed=6))
    assert trained > control + 0.3, (trained, control)


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}


def test_resume_is_exact(tmp_path, tiny_model_dir):
    def make(out, **kw):
        cfg = _config(tmp_path, output_dir=str(out), max_steps=4, num_generations=4, per_device_train_batch_size=8,
                      gradient_accumulation_steps=1, steps_per_generation=2, num_iterations=1, save_steps=2,
                      beta=0.02, **kw)
        return GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(12, seed=3),
                           peft_config=default_lora_config(r=4))

    expected, got, preempted_at = uninterrupted_and_resumed(lambda name: make(tmp_path / name), _weights)
    assert preempted_at == 2
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k

    def stable(path):
        skip = ("time/", "tokens_per_second", "memory/")
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(skip)} for line in open(path)]

    assert stable(tmp_path / "full" / "metrics.jsonl") == stable(tmp_path / "resumed" / "metrics.jsonl")


def test_importance_sampling_correction_is_wired_and_exact_in_fp32(tmp_path, tiny_model_dir):
    """With the fp32 engine the sampler's log-probs are the trainer's: the correction's weights are 1,
    its metrics say so, and training is bit-identical to a run without it."""
    weights = {}
    for on in (False, True):
        cfg = _config(tmp_path, output_dir=str(tmp_path / str(on)), max_steps=2, importance_sampling_correction=on,
                      importance_sampling_mode="token_truncate", importance_sampling_clip_max=2.0)
        trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                              peft_config=default_lora_config(r=4))
        trainer.train()
        weights[on] = _weights(trainer)
    record = json.loads((tmp_path / "True" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["sampling/importance_sampling_ratio/mean"] == 1.0 and record["sampling/kl"] == 0.0
    assert record["sampling/importance_sampling_clipped_fraction"] == 0.0
    for name in weights[False]:
        assert torch.equal(weights[False][name], weights[True][name]), name


def test_reward_functions_log_metrics_and_columns_as_in_trl(tmp_path, tiny_model_dir):
    """TRL 1.16's reward kwargs: log_metric(name, value) is averaged into the step's metrics, log_extra(column,
    values) becomes a samples.jsonl column; a function that takes neither still works."""

    def judged(completions, log_metric, log_extra, **kwargs):
        log_metric("judge/calls", 1.0)
        log_metric("judge/calls", 3.0)
        log_extra("judge_note", [f"note {i}" for i in range(len(completions))])
        return [0.5] * len(completions)

    def plain(prompts, completions, completion_ids, answer, trainer_state):  # no **kwargs: gets no loggers
        return [0.0] * len(completions)

    cfg = _config(tmp_path, max_steps=2, log_completions_steps=1, num_completions_to_print=3)
    GRPOTrainer(str(tiny_model_dir), [judged, plain], cfg, arithmetic_dataset(8),
                peft_config=default_lora_config(r=4)).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["judge/calls"] for r in records] == [2.0, 2.0]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["judge_note"] for s in samples[:3]] == ["note 0", "note 1", "note 2"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # plain PEFT loading
def test_trl_trainer_surface_model_state_callbacks_and_save_model(tmp_path, tiny_model_dir):
    """trainer.model / .state / callbacks= / save_model as a TRL script uses them: events fire in order,
    should_training_stop ends the run after that step, and the saved adapter loads in PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, TrainerCallback

    events = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            events.append(("begin", state.global_step))

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("log", state.global_step, "loss" in logs))

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("step", state.global_step))
            if state.global_step == 2:
                control.should_training_stop = True
            return control

        def on_save(self, args, state, control, **kwargs):
            events.append(("save", state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            events.append(("end", state.global_step))

    cfg = _config(tmp_path, max_steps=5)
    trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4), callbacks=[Recorder])
    assert trainer.model is trainer.policy and trainer.state.max_steps == 5
    trainer.train()
    # as transformers: the closing summary is logged (train_loss, not loss) before on_train_end
    assert events == [("begin", 0), ("log", 1, True), ("step", 1), ("log", 2, True), ("step", 2), ("save", 2),
                      ("log", 2, False), ("end", 2)]
    assert trainer.state.global_step == 2 and [r["step"] for r in trainer.state.log_history] == [1, 2, 2]
    assert "train_loss" in trainer.state.log_history[-1]
    trainer.save_model()  # into the run folder, next to its metrics and checkpoints
    out = tmp_path / "run"
    assert (out / "adapter_model.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    assert (out / "checkpoint-2").is_dir()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    ids = torch.randint(5, 500, (1, 6))
    trainer.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.policy(ids).logits, rtol=0, atol=1e-6)
