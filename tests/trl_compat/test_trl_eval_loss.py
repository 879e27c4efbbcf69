"""evaluate()'s ``eval_loss`` (TRL 1.16's meaning): the GRPO loss on the eval completions, checked against
an independent computation from the model's logits; named and streamed eval sets; the best checkpoint by
``metric_for_best_model: eval_loss``; PPO reports none."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, IterableDataset
from helpers import SMALL_RUN
from transformers import TrainerCallback

from grpo_ascend import GRPOConfig, GRPOTrainer, PPOConfig
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.trainers.ppo import PPOTrainer

PROMPT = "Count: one two three"


def _length_reward(completions, **kwargs):
    """Varies within groups, so the advantages are not all 0."""
    return [float(len(c) % 5) for c in completions]


def _config(tmp_path, name="run", **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / name), "num_generations_eval": 4,
                         "per_device_eval_batch_size": 8, "temperature": 0.9, **kw})


class Recording:
    """The trainer's EvalLoss hook, recording each batch it scores and the loss it returned."""

    def __init__(self, hook):
        self.hook, self.calls = hook, []

    def context(self):
        return self.hook.context()

    def __call__(self, rows, batch, scores):
        loss = self.hook(rows, batch, scores)
        self.calls.append((batch, scores, loss))
        return loss


def _recording(trainer) -> Recording:
    recording = Recording(trainer.evaluator.eval_loss)
    trainer.evaluator.eval_loss = recording
    return recording


def _advantages(total: torch.Tensor, n: int) -> torch.Tensor:
    groups = total.float().view(-1, n)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    tied = groups.amax(1, keepdim=True) == groups.amin(1, keepdim=True)
    return torch.where(tied, torch.zeros_like(adv), adv).flatten()


@torch.no_grad()
def _logps_and_entropies(model, batch, temperature):
    """Per-token log-probs and entropies of the completions, straight from the model's logits."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], 1).long()
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
    start, width = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    logp = (logits[:, start - 1 : start - 1 + width] / temperature).log_softmax(-1)
    return logp.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _dapo_loss(batch, scores, *, policy=None, beta=0.0, entropy_coef=0.0, temperature=1.0) -> tuple[float, float]:
    """DAPO at ratio 1 over one batch: Σ mask·(−A + β·k3 − c·H) / Σ mask; also the KL term's share."""
    mask = batch.completion_mask.float()
    per_token = -_advantages(scores.scored.total, batch.num_generations).unsqueeze(1).expand_as(mask)
    kl_part = 0.0
    if policy is not None:
        logps, entropies = _logps_and_entropies(policy, batch, temperature)
        with policy.disable_adapter():
            ref, _ = _logps_and_entropies(policy, batch, temperature)
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token = per_token + beta * kl - entropy_coef * entropies
        kl_part = float((beta * kl * mask).sum() / mask.sum())
    return float((per_token * mask).sum() / mask.sum()), kl_part


def test_eval_loss_is_the_grpo_loss_on_the_eval_completions(tmp_path, tiny_model_dir):
    """LoRA run moved by one step (so the KL to the adapter-disabled reference is not 0): each eval batch's
    loss equals DAPO at ratio 1 with β·KL and the entropy bonus recomputed from the logits; eval_loss is
    their mean weighted by rows (3 prompts: batches of 8 and 4 completions); no gradient is left."""
    cfg = _config(tmp_path, loss_type="dapo", beta=0.04, entropy_coef=0.01, max_steps=1, learning_rate=5e-2)
    trainer = GRPOTrainer(str(tiny_model_dir), _length_reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 2),
                          eval_dataset=Dataset.from_list([{"prompt": PROMPT}] * 3),
                          peft_config=default_lora_config(r=4))
    trainer.train()
    grads = [None if p.grad is None else p.grad.clone() for p in trainer.policy.parameters()]
    recording = _recording(trainer)
    metrics = trainer.evaluate()

    assert [batch.completion_ids.shape[0] for batch, _, _ in recording.calls] == [8, 4]
    trainer.policy.eval()
    expected, kl_parts = zip(*(_dapo_loss(batch, scores, policy=trainer.policy, beta=0.04, entropy_coef=0.01,
                                          temperature=0.9) for batch, scores, _ in recording.calls))
    assert [loss for _, _, loss in recording.calls] == pytest.approx(list(expected), abs=2e-5)
    assert min(abs(k) for k in kl_parts) > 1e-4  # the KL term counts (well above the tolerance)
    mean = (expected[0] * 8 + expected[1] * 4) / 12
    assert metrics["eval/loss"] == pytest.approx(mean, abs=2e-5)
    assert metrics["eval_loss"] == metrics["eval/loss"]
    assert trainer.state.log_history[-1]["eval_loss"] == metrics["eval_loss"]
    after = [None if p.grad is None else p.grad.clone() for p in trainer.policy.parameters()]
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, after))


def test_grpo_eval_loss_is_minus_the_mean_advantage_at_ratio_one(tmp_path, tiny_model_dir):
    """loss_type grpo, β = 0: every sequence's token mean is −A, so each batch's loss is −mean(A) = 0."""
    cfg = _config(tmp_path, loss_type="grpo")
    trainer = GRPOTrainer(str(tiny_model_dir), _length_reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 2),
                          eval_dataset=Dataset.from_list([{"prompt": PROMPT}] * 2))
    recording = _recording(trainer)
    metrics = trainer.evaluate()
    batch, scores, loss = recording.calls[0]
    advantages = _advantages(scores.scored.total, 4)
    assert advantages.abs().max() > 0.1
    assert loss == pytest.approx(float(-advantages.mean()), abs=1e-6)
    assert metrics["eval_loss"] == pytest.approx(0.0, abs=1e-6)


def test_named_and_streamed_eval_sets_each_get_their_loss(tmp_path, tiny_model_dir):
    """eval_dataset={"plain": Dataset (2 prompts), "stream": IterableDataset (3 prompts)}: eval_plain_loss and
    eval_stream_loss, each the row-weighted mean of its own batches' DAPO loss."""

    def rows():
        yield from [{"prompt": PROMPT}] * 3

    cfg = _config(tmp_path, loss_type="dapo")
    eval_sets = {"plain": Dataset.from_list([{"prompt": PROMPT}] * 2), "stream": IterableDataset.from_generator(rows)}
    trainer = GRPOTrainer(str(tiny_model_dir), _length_reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 2),
                          eval_dataset=eval_sets)
    recording = _recording(trainer)
    metrics = trainer.evaluate()
    losses = [_dapo_loss(batch, scores)[0] for batch, scores, _ in recording.calls]
    assert [loss for _, _, loss in recording.calls] == pytest.approx(losses, abs=1e-6)
    assert metrics["eval_plain_loss"] == pytest.approx(losses[0], abs=1e-6)
    assert metrics["eval_stream_loss"] == pytest.approx((losses[1] * 8 + losses[2] * 4) / 12, abs=1e-6)
    assert metrics["eval_plain/loss"] == metrics["eval_plain_loss"]
    assert "eval_loss" not in metrics


def test_metric_for_best_model_eval_loss_keeps_the_lowest(tmp_path, tiny_model_dir):
    """Evaluated and saved every step: best.json names the step with the lowest eval loss (lower is better)."""
    seen = []

    class Losses(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen.append((state.global_step, metrics["eval_loss"]))

    cfg = _config(tmp_path, loss_type="dapo", max_steps=3, save_steps=1, eval_strategy="steps", eval_steps=1,
                  metric_for_best_model="eval_loss", learning_rate=5e-2)
    trainer = GRPOTrainer(str(tiny_model_dir), _length_reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 2),
                          eval_dataset=Dataset.from_list([{"prompt": PROMPT}] * 2), callbacks=[Losses()])
    trainer.train()
    assert [step for step, _ in seen] == [1, 2, 3]
    step, value = min(seen, key=lambda entry: entry[1])
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert (best["step"], best["metric"]) == (step, "eval_loss")
    assert best["value"] == pytest.approx(value)


def test_ppo_has_no_eval_loss(tmp_path, tiny_model_dir):
    """PPO has no TRL counterpart of eval_loss: its evaluator computes none (GRPO's does)."""
    data = Dataset.from_list([{"prompt": PROMPT}] * 2)
    cfg = PPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "ppo"), "num_generations": 2})
    ppo = PPOTrainer(str(tiny_model_dir), _length_reward, cfg, data, eval_dataset=data)
    assert ppo.evaluator.eval_loss is None
    grpo = GRPOTrainer(str(tiny_model_dir), _length_reward, _config(tmp_path), data, eval_dataset=data)
    assert grpo.evaluator.eval_loss is not None
