"""Pieces shared by the trainer tests: a quickly learnable reward and a small-run config."""

from __future__ import annotations

# Settings of a short, cheap run on the tiny model (each test overrides what it checks).
SMALL_RUN = dict(
    num_generations=4, per_device_train_batch_size=8, max_completion_length=10, max_prompt_length=96,
    learning_rate=5e-3, max_steps=2, save_steps=0, logging_steps=1, disable_tqdm=True, log_completions_steps=0,
    seed=0, lr_scheduler_type="constant", length_bucket=16,
)


class Preempted(Exception):
    """What a simulated preemption raises right after a checkpoint save."""


def preempt_after_save(trainer, step: int | None = None, error: type[BaseException] = Preempted) -> None:
    """Make ``trainer`` raise ``error`` right after it saves its checkpoint at ``step`` (default: its first),
    as a job preempted then would stop: from an ``on_save`` callback, the save's last act."""

    class StopAfterSave:
        def on_save(self, args, state, control, **kwargs):
            if step is None or trainer.step == step:
                raise error(f"preempted after the save at step {trainer.step}")

    trainer.add_callback(StopAfterSave())


def train_until_preempted(trainer, step: int | None = None) -> None:
    """Run ``trainer.train()`` until its checkpoint at ``step`` (default: its first) is saved, then stop it
    as a preemption would."""
    import pytest

    preempt_after_save(trainer, step, KeyboardInterrupt)  # what a job killed by a signal raises
    with pytest.raises(KeyboardInterrupt):
        trainer.train()


def preempt_and_resume(make, step: int | None = None):
    """(an uninterrupted run, a run preempted right after its checkpoint at ``step`` (default: its first), the
    run resumed from that checkpoint), each a trainer. ``make(name)`` builds a trainer writing into ``name``;
    the preempted and the resumed runs share the output folder "resumed"."""
    full = make("full")
    full.train()
    killed = make("resumed")
    train_until_preempted(killed, step)
    resumed = make("resumed")
    resumed.train(resume_from_checkpoint="latest")
    return full, killed, resumed


def rewards_before_and_after_training(trainer, eval_dataset) -> tuple[float, float]:
    """Mean sampled reward of ``trainer``'s policy on ``eval_dataset`` before ``train()`` and after it.

    The first is the control: the same model, prompts and sampling, without the updates. Evaluation
    seeds its sampling from the config's seed and each prompt's place in the eval set, so without
    learning the two numbers are equal on any machine (a run at learning rate 0 gives a difference
    of exactly 0), whatever reward the warm start begins at; a margin between them is learning.
    """
    before = trainer.evaluate(eval_dataset, metric_key_prefix="control")["control/reward"]
    trainer.train()
    after = trainer.evaluate(eval_dataset, metric_key_prefix="trained")["trained/reward"]
    return before, after


def first_digit_is_one(prompts, completions, **kwargs):
    """A pattern the warm-started policy learns quickly: answers that start with the digit 1."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip().removeprefix("<answer>").startswith("1") else 0.0 for t in texts]


def index_in_group(num_generations: int):
    """A reward function scoring each completion by its index within its group of ``num_generations``.

    A group's completions are contiguous rows, so the rewards differ within every group whatever was
    sampled: every group gets non-zero advantages by construction, on any CPU. (Should a group's
    completions all be the same text, their gradients still cancel; a test that needs a weight change
    even then needs a term that does not depend on the samples, e.g. weight decay.)
    """

    def index_in_group(completions, **kwargs):
        return [float(i % num_generations) for i in range(len(completions))]

    return index_in_group


def make_experience(prompt_ids, prompt_mask, completion_ids, completion_mask, rewards=None, **fields):
    """An Experience from fixed tensors (no generation), as a round's optimizer steps read it."""
    import torch

    from grpo_ascend.experience import Experience

    n, width = completion_ids.shape
    rewards = torch.zeros(n) if rewards is None else rewards
    return Experience(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=completion_mask,
        loss_mask=completion_mask.float(), sampling_logps=torch.zeros(n, width), truncated=torch.zeros(n, dtype=bool),
        rewards=rewards, rewards_per_function=rewards[:, None], reward_names=["fixed"],
        **{"group_ids": torch.arange(n), **fields}, prompts=["p"] * n, completions=["c"] * n,
    )


def fixed_experience(n=8, lp=6, lc=5, G=2):
    """A seeded experience of ``n`` rows (prompts ``lp`` tokens with some left padding, completions ``lc``
    tokens with two cut short) with random rewards and old / reference log-probs."""
    import torch

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 500, (n, lp), generator=g)
    pm = torch.ones_like(prompt)
    pm[::3, :2] = 0
    comp = torch.randint(5, 500, (n, lc), generator=g)
    cm = torch.ones_like(comp)
    cm[1, 3:] = 0
    cm[4, 1:] = 0
    return make_experience(prompt, pm, comp, cm, rewards=torch.randn(n, generator=g),
                           old_logps=-3 - torch.rand(n, lc, generator=g), ref_logps=-3 - torch.rand(n, lc, generator=g))


def run_round(trainer, exp, values=None, advantages=None, returns=None, made=None):
    """Run one training round on the fixed experience ``exp`` and return its last step's metrics record.

    ``exp`` stands for the sampled, scored and annotated round; the algorithm completes it as in training
    (GRPO: advantages from its rewards). PPO: ``values``/``advantages``/``returns`` stand for the critic pass
    and GAE, which then do not run (the round's metrics are the experience's own). ``made``: a list that
    receives the completed experience the round trained on. Opens the run (``begin_run``) if it is not open.
    """
    import dataclasses

    from grpo_ascend.experience import experience_metrics

    def make(*args, complete=None, **kwargs):
        if values is not None:
            own = {"advantages": advantages, "extras": {**exp.extras, "values": values, "returns": returns}}
            metrics = experience_metrics(exp, trainer.ranks)
        else:
            own, metrics = complete(exp) if complete is not None else ({}, {})
        completed = dataclasses.replace(exp, **own)
        if made is not None:
            made.append(completed)
        return completed, metrics

    trainer.experience.make = make
    if trainer.tracker is None:
        trainer.begin_run()
    trainer.train_round()
    return trainer.run.last_record


def intercept_optimizer_steps(trainer, step) -> None:
    """Make ``trainer`` call ``step(params, loss_finite) -> (grad_norm, stepped)`` in place of each optimizer step
    (its ``clip_and_step``: clipping, the NaN check, the step and the scheduler), the gradients of ``params`` in
    place, until :func:`restore_optimizer_steps`."""
    trainer.clip_and_step = step


def restore_optimizer_steps(trainer) -> None:
    """Undo :func:`intercept_optimizer_steps`: the trainer's own optimizer steps again."""
    vars(trainer).pop("clip_and_step", None)


def one_round_gradients(trainer, exp, **ppo_fixed):
    """(gradients of the first optimizer step of one round on ``exp`` by parameter name, the step's metrics);
    the step itself is not taken."""
    names = {id(p): n for n, p in trainer.policy.named_parameters()}
    captured = {}

    def capture(params, finite):
        if not captured:
            captured.update({names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None})
        return 0.0, True

    intercept_optimizer_steps(trainer, capture)
    return captured, run_round(trainer, exp, **ppo_fixed)


def perturb_weights(model, scale: float = 0.1, seed: int = 0):
    """Add seeded Gaussian noise (std ``scale``) to every matrix of ``model`` in place, so that a
    random-init model's nearly flat logits vary and greedy outputs are not one token forever."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def uninterrupted_and_resumed(make, state, step: int | None = None):
    """(``state`` of an uninterrupted run, ``state`` of a run preempted right after its checkpoint at ``step``
    (default: its first) and resumed from it, the step it was preempted at); see :func:`preempt_and_resume`."""
    full, killed, resumed = preempt_and_resume(make, step)
    return state(full), state(resumed), killed.step


def capture_scored(trainer) -> list:
    """The scored experiences ``trainer``'s source hands each round (recorded as they pass), in order."""
    seen = []
    take = trainer.experience.source.next_scored

    def recording(*args, **kwargs):
        exp = take(*args, **kwargs)
        seen.append(exp)
        return exp

    trainer.experience.source.next_scored = recording
    return seen
