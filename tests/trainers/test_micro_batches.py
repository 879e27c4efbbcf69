"""Token-budget micro-batches (``max_tokens_per_micro_batch``): the packing keeps every row once
within the budget, deterministically; the step's loss and gradient equal one micro-batch's for every
loss type (GRPO and PPO); ranks with different packings agree on one count, or plan together where
every rank runs at the widest micro-batch; bad settings are refused."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import SMALL_RUN, first_digit_is_one, intercept_optimizer_steps, make_experience, run_round

from grpo_ascend import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.trainers.micro_batches import (
    TokenCost,
    next_fit,
    pack_by_tokens,
    pack_in_lockstep,
    split_to,
)


def _cost_of(part, lengths, groups, cost):
    return cost(len(part), len({groups[i] for i in part}), max(lengths[i] for i in part))


def _total(parts, lengths, groups, cost):
    return sum(_cost_of(p, lengths, groups, cost) for p in parts)


# ------------------------------------------------------------------------------ packing
def test_packing_on_numbers():
    # Rows 0-3 are two groups of 2 (prompt width 4, shared); the longest group goes first.
    cost = TokenCost(prompt_width=4, completion_width=10, share_prompts=True)
    lengths, groups = [2, 3, 9, 8], [0, 0, 1, 1]
    assert pack_by_tokens(lengths, groups, 22, cost) == [[2, 3], [1, 0]]  # 2×9+4 = 22; 2×3+4 = 10
    assert pack_by_tokens(lengths, groups, 100, cost) == [[2, 3, 1, 0]]  # 4×9 + 2×4 = 44
    # Long prompts keep groups whole; long completions spread them to pad less (two prompts run each).
    long_prompt = TokenCost(prompt_width=40, completion_width=10, share_prompts=True)
    assert pack_by_tokens([9, 1, 9, 1], [0, 0, 1, 1], 60, long_prompt) == [[0, 1], [2, 3]]  # 2×(2×9+40) = 116
    long_completion = TokenCost(prompt_width=2, completion_width=100, share_prompts=True)
    assert pack_by_tokens([90, 5, 90, 5], [0, 0, 1, 1], 200, long_completion) == [[0, 2], [1, 3]]  # 184 + 14
    # Not shared: the prompt is paid per row, and a row over the budget gets a micro-batch of its own.
    alone = TokenCost(prompt_width=4, completion_width=60, share_prompts=False)
    assert pack_by_tokens([2, 50, 2], [0, 0, 0], 20, alone) == [[1], [0, 2]]  # 54 > 20 alone; 2×6 = 12
    # The device's length bucket rounds the micro-batch width up (as the forward does), capped at the width.
    bucketed = TokenCost(prompt_width=0, completion_width=20, share_prompts=False, length_bucket=16)
    assert (bucketed.width(3), bucketed.width(17), bucketed.width(0)) == (16, 20, 16)


@pytest.mark.parametrize("share", [True, False])
def test_packing_keeps_every_row_once_within_budget_deterministically(share):
    rng = random.Random(0)
    for _ in range(200):
        G, n_groups = rng.choice([1, 2, 4]), rng.randint(1, 8)
        width, prompt = rng.randint(1, 40), rng.randint(0, 30)
        lengths = [rng.randint(0, width) for _ in range(G * n_groups)]
        groups = [g for g in rng.sample(range(100), n_groups) for _ in range(G)]
        cost = TokenCost(prompt, width, share, length_bucket=rng.choice([1, 8]))
        budget = rng.randint(1, 3 * G * (width + prompt))
        parts = pack_by_tokens(lengths, groups, budget, cost)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        assert all(p for p in parts)
        for p in parts:  # within the budget, or a single row that exceeds it alone
            assert _cost_of(p, lengths, groups, cost) <= budget or len(p) == 1
        if share:  # a group's rows are adjacent in a micro-batch (its prompt runs once there), and
            # the packing runs no more tokens than keeping every group whole would
            for p in parts:
                runs = [groups[i] for k, i in enumerate(p) if k == 0 or groups[p[k - 1]] != groups[i]]
                assert len(runs) == len(set(runs)), (p, groups)
            whole = next_fit([[i for i, x in enumerate(groups) if x == g] for g in dict.fromkeys(groups)],
                              lengths, groups, budget, cost)
            assert _total(parts, lengths, groups, cost) <= _total(whole, lengths, groups, cost)
        assert pack_by_tokens(list(lengths), list(groups), budget, cost) == parts


def test_packing_cuts_padding_against_fixed_micro_batches():
    """Varied lengths in a seeded order: the budget packs them with fewer padded tokens than fixed
    micro-batches of 4 whose largest costs the same budget."""
    rng = random.Random(3)
    lengths = [rng.choice([4, 8, 60, 120]) for _ in range(32)]
    groups = list(range(32))
    cost = TokenCost(prompt_width=20, completion_width=120, share_prompts=False)
    fixed = [list(range(k, k + 4)) for k in range(0, 32, 4)]
    budget = max(_cost_of(p, lengths, groups, cost) for p in fixed)
    packed = pack_by_tokens(lengths, groups, budget, cost)
    total = sum(_cost_of(p, lengths, groups, cost) for p in packed)
    assert total < 0.75 * sum(_cost_of(p, lengths, groups, cost) for p in fixed)


def test_split_to_reaches_the_count_at_group_boundaries():
    groups = [0, 0, 1, 1, 2, 2, 3]
    parts = split_to([[0, 1, 2, 3, 4, 5], [6]], 3, groups)
    assert parts == [[0, 1], [2, 3, 4, 5], [6]] or parts == [[0, 1, 2, 3], [4, 5], [6]]
    assert split_to([[0, 1, 2]], 3, [0, 0, 0]) == [[0], [1], [2]]
    assert split_to([[0], [1]], 2, groups) == [[0], [1]]
    with pytest.raises(ValueError, match="cannot split 2 rows into 3"):
        split_to([[0, 1]], 3, groups)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "512"])
def test_bad_budget_is_refused(bad):
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        GRPOConfig(max_tokens_per_micro_batch=bad)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        pack_by_tokens([1], [0], bad, TokenCost(1, 1, True))


def test_lockstep_plan_keeps_the_budget_at_the_widest_over_ranks():
    """Where micro-batch k of every rank runs at the widest completion over all ranks (parameter-sharding
    strategies), the joint plan gives every rank as many micro-batches, each row once, within the budget."""
    cost = TokenCost(6, 7, share_prompts=True)
    short, long = [1, 2, 1, 3, 2, 1, 2, 1], [7, 6, 7, 5, 7, 7, 6, 7]
    plan = pack_in_lockstep([(short, list(range(8)), cost), (long, list(range(8)), cost)], 40)
    assert [len(p) for p in plan] == [3, 3]  # alone, rank 0 packs 2 (at its own width 3)
    rng = random.Random(1)
    for _ in range(300):
        world, n, width, prompt, G = rng.randint(1, 4), rng.randint(1, 12), rng.randint(1, 30), rng.randint(0, 20), 2
        cost = TokenCost(prompt, width, rng.random() < 0.5)
        steps = [([rng.randint(0, width) for _ in range(n)], [r * 100 + i // G for i in range(n)], cost)
                 for r in range(world)]
        budget = rng.randint(1, 2 * n * (width + prompt))
        plan = pack_in_lockstep(steps, budget)
        assert len({len(parts) for parts in plan}) == 1
        for parts in plan:
            assert sorted(i for p in parts for i in p) == list(range(n))
        for k in range(len(plan[0])):
            widest = max(steps[r][0][i] for r in range(world) for i in plan[r][k])
            for (_, groups, _), parts in zip(steps, plan):
                part = parts[k]
                assert len(part) == 1 or cost(len(part), len({groups[i] for i in part}), widest) <= budget
        assert pack_in_lockstep(steps, budget) == plan


class _TwoRanks:
    """Rank 0 of two, the other rank's step rows given (gather and max as the collectives would)."""

    def __init__(self, other_row):
        self.rank, self.other_row = 0, other_row

    def gather(self, value):
        return torch.cat([value, torch.tensor([self.other_row], dtype=value.dtype)])

    def reduce(self, value, op="sum"):
        raise AssertionError("the lockstep plan needs no count agreement")


def test_plan_for_rank_gathers_the_other_ranks_rows():
    """The lockstep path reads every rank's prompt width, completion width, lengths and groups from
    one gather, and plans at the widest completion width over ranks."""
    from grpo_ascend.trainers.micro_batches import plan_for_rank

    short, long = [1, 2, 1, 3, 2, 1, 2, 1], [7, 6, 7, 5, 7, 7, 6, 7]
    other = [6, 7, *long, *range(8)]  # prompt width 6, completion width 7, lengths, groups
    cost = TokenCost(prompt_width=6, completion_width=3, share_prompts=True)
    mine, lengths = plan_for_rank(torch.tensor(short), torch.arange(8), cost, 40, _TwoRanks(other),
                                  widest_over_ranks=True)
    assert lengths == short
    expected = pack_in_lockstep([(short, list(range(8)), TokenCost(6, 7, True)),
                                 (long, list(range(8)), TokenCost(6, 7, True))], 40)[0]
    assert mine == expected and len(mine) == 3


# ------------------------------------------------------------------------------ exact gradients
def varied_experience(n=8, lp=6, lc=12, G=2, **fields):
    """Groups of G rows sharing a prompt, completions from 1 to ``lc`` tokens long."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(5, 500, (n // G, lp), generator=g).repeat_interleave(G, 0)
    pm = torch.ones_like(prompt)
    pm[::2, :2] = 0
    comp = torch.randint(5, 500, (n, lc), generator=g)
    lengths = torch.tensor([1, 12, 3, 2, 11, 12, 4, 1][:n])
    cm = (torch.arange(lc) < lengths[:, None]).long()
    return make_experience(prompt, pm, comp, cm, rewards=torch.randn(n, generator=g),
                           **{"group_ids": torch.arange(n) // G, **fields})


def step_gradients(trainer, exp, **ppo_fixed):
    """(gradients of one optimizer step over every row of ``exp``, its metrics); the step is not taken."""
    names = {id(p): n for n, p in trainer.policy.named_parameters()}
    captured = {}

    def capture(params, finite):
        captured.update({names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None})
        trainer.optimizer.zero_grad(set_to_none=True)
        return 0.0, True

    intercept_optimizer_steps(trainer, capture)
    trainer.max_steps = trainer.step + 1
    return captured, run_round(trainer, exp, **ppo_fixed)


def _perturb_adapters(trainer):
    with torch.no_grad():
        for name, p in trainer.policy.named_parameters():
            if "lora_B" in name or "value_head" in name:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))


def _assert_same(a, b):
    assert a.keys() == b.keys() and any(g.abs().max() > 0 for g in a.values())
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


CASES = {  # loss_type and the loss settings it needs; gspo = sequence-level ratios under grpo
    "grpo": ("grpo", {}), "bnpo": ("bnpo", {}), "dr_grpo": ("dr_grpo", {}), "dapo": ("dapo", {}),
    "cispo": ("cispo", {"epsilon_high": 5.0}), "sapo": ("sapo", {}),
    "gspo": ("grpo", {"importance_sampling_level": "sequence"}),
}


@pytest.fixture(scope="module")
def grpo_trainer(tmp_path_factory, tiny_model_dir):
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path_factory.mktemp("tb") / "run"),
                        "num_generations": 2, "max_completion_length": 12, "beta": 0.04, "entropy_coef": 0.01,
                        "length_bucket": 1})
    trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4))
    _perturb_adapters(trainer)
    return trainer


@pytest.mark.parametrize("case", list(CASES))
def test_budget_micro_batches_give_the_one_batch_gradient(grpo_trainer, case):
    """One micro-batch of 8 rows vs the same step packed under a budget into micro-batches of
    different sizes (one row alone over the budget): same loss, same gradient, every loss type."""
    trainer = grpo_trainer
    loss_type, settings = CASES[case]
    trainer.args.loss_type = loss_type
    base = trainer.loss_settings
    trainer.loss_settings = dataclasses.replace(base, **settings)
    g = torch.Generator().manual_seed(2)
    exp = varied_experience(old_logps=-3 - torch.rand(8, 12, generator=g), ref_logps=-3 - torch.rand(8, 12, generator=g))
    try:
        results = {}
        for budget in (None, 17, 40):
            trainer.micro_batcher.token_budget = budget
            results[budget] = step_gradients(trainer, exp)
    finally:
        trainer.micro_batcher.token_budget = None
        trainer.loss_settings = base
    one, metrics = results[None]
    assert "micro_batches" not in metrics
    counts = {b: results[b][1]["micro_batches"] for b in (17, 40)}
    assert counts[17] > counts[40] > 1, counts  # 17 < prompt 6 + 12: the longest rows run alone
    for budget in (17, 40):
        grads, m = results[budget]
        assert m["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
        assert m["kl"] == pytest.approx(metrics["kl"], rel=1e-5)
        _assert_same(grads, one)


def test_a_row_over_the_budget_runs_alone_with_one_warning(grpo_trainer, caplog):
    trainer = grpo_trainer
    trainer.args.loss_type, trainer.micro_batcher.warned_over_budget = "grpo", False
    exp = varied_experience(old_logps=torch.full((8, 12), -3.0), ref_logps=torch.full((8, 12), -3.1))
    try:
        trainer.micro_batcher.token_budget = 10  # every row costs 6 + its length: 7 to 18
        with caplog.at_level("WARNING", logger="grpo_ascend.trainers.micro_batches"):
            _, first = step_gradients(trainer, exp)
            _, second = step_gradients(trainer, exp)
    finally:
        trainer.micro_batcher.token_budget = None
    assert first["micro_batches"] == second["micro_batches"] == 8  # no two rows fit together; none dropped
    warnings = [r for r in caplog.records if "max_tokens_per_micro_batch=10" in r.getMessage()]
    assert len(warnings) == 1 and "18 tokens" in warnings[0].getMessage()


def test_ranks_agree_on_the_micro_batch_count(grpo_trainer, monkeypatch):
    """A rank that packs fewer micro-batches than another splits its own to the agreed (max) count,
    within the budget, and its gradient is unchanged (the count agreement with a stand-in rank)."""
    trainer = grpo_trainer
    trainer.args.loss_type = "bnpo"
    exp = varied_experience(old_logps=torch.full((8, 12), -3.0), ref_logps=torch.full((8, 12), -3.1))
    seen = []
    real = trainer.ranks.reduce

    def reduce(value, op="sum"):
        if value.numel() == 1 and op == "max" and not seen:  # the count: another rank packed 7
            seen.append(int(value))
            return torch.maximum(value, torch.full_like(value, 7.0))
        return real(value, op)

    try:
        trainer.micro_batcher.token_budget = 60
        own, own_metrics = step_gradients(trainer, exp)
        monkeypatch.setattr(trainer.ranks, "reduce", reduce)
        agreed, agreed_metrics = step_gradients(trainer, exp)
    finally:
        trainer.micro_batcher.token_budget = None
    assert seen and seen[0] == own_metrics["micro_batches"] < 7
    assert agreed_metrics["micro_batches"] == 7
    _assert_same(agreed, own)


def test_ppo_budget_micro_batches_give_the_one_batch_gradient(tmp_path, tiny_model_dir):
    """PPO shares the micro-batch path: policy and critic gradients are the same under a budget."""
    cfg = PPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": 2,
                       "max_completion_length": 12, "ppo_epochs": 1, "num_mini_batches": 1, "kl_coef": 0.05,
                       "entropy_coef": 0.01, "cliprange_value": 0.1, "length_bucket": 1})
    trainer = PPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                         peft_config=default_lora_config(r=4))
    _perturb_adapters(trainer)
    g = torch.Generator().manual_seed(4)
    exp = varied_experience()
    cm = exp.completion_mask
    exp = dataclasses.replace(exp, old_logps=(-3 - torch.rand(8, 12, generator=g)) * cm)
    fixed = {k: torch.randn(8, 12, generator=g) * cm for k in ("values", "advantages", "returns")}
    one, metrics = step_gradients(trainer, exp, **fixed)
    trainer.micro_batcher.token_budget = 40
    packed, packed_metrics = step_gradients(trainer, exp, **fixed)
    assert packed_metrics["micro_batches"] > 1
    assert any(g.abs().sum() > 0 for name, g in packed.items() if "value_head" in name)
    for key in ("loss", "policy_loss", "value_loss"):
        assert packed_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    _assert_same(packed, one)


def test_resume_with_a_budget_is_exact(tmp_path, tiny_model_dir):
    """Two steps straight, or the second resumed from the first's checkpoint: the same weights and
    metrics (the packing reads only the round's rows and their seeded order)."""
    import json

    def make(out):
        cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(out), "max_steps": 2, "save_steps": 1,
                            "max_tokens_per_micro_batch": 60, "beta": 0.02})
        return GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8, seed=3),
                           peft_config=default_lora_config(r=4))

    def weights(trainer):
        return {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}

    def records(out):
        skip = ("time/", "tokens_per_second", "memory/")
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(skip)}
                for line in open(out / "metrics.jsonl")]

    full = make(tmp_path / "full")
    full.train()
    resumed = make(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert resumed.step == 2
    expected, got = weights(full), weights(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    straight = records(tmp_path / "full")
    assert straight[-1:] == records(tmp_path / "resumed")[-1:]
    assert all(r["micro_batches"] > 1 for r in straight)
