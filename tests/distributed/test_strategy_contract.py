"""The contract every distributed strategy keeps, checked the same way for each one.

One 2-process launch per strategy (plain DDP, DeepSpeed ZeRO-2, ZeRO-3, FSDP2; gloo on the CPU)
runs ``dist_worker.py contract`` on a fixed global batch whose halves hold very different token
counts, with 2 accumulated micro-batches per rank (the strategy's no-sync on the first):

- evaluation: ``evaluate()`` (whole weights for generation, ranks making different numbers of engine
  calls) gives one process's metrics, pass@k/mean@k included, and the steps after it are unchanged;
- exact normalised gradient: the loss and the pre-clipping global gradient norm of a real step
  equal one process's over the whole batch, for every loss type; where the engine keeps whole
  gradients (DDP, FSDP2) each gradient element does too;
- NaN skip: a NaN gradient on one rank skips the step on every rank, weights untouched, and the
  next finite step is taken;
- checkpoint round trip: a save, a step, the load of that save and the same step again restore
  the saved weights exactly and replay the step (weights, loss, grad norm); loading that save as
  the best checkpoint (``load_best_model_at_end``) restores its weights exactly;
- no-sync: a micro-batch that is not the step's last leaves its gradient unreduced (DDP: each
  rank's own; FSDP2: no reduce-scatter yet; DeepSpeed: not an accumulation boundary);
- token-budget micro-batches (``max_tokens_per_micro_batch``) that the two ranks would pack into
  different counts run as many on both (planned together under ZeRO-3 and FSDP2, where every
  rank's micro-batch runs at the widest over ranks) and give the one-process step.

The one-process reference is computed once for all strategies.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import dist_worker
import pytest
import torch
from distributed_runs import FSDP_ENV, LOSS_TYPES, WORLD, ZERO2_ENV, launch, zero3_env

TOKEN_BUDGET = 40  # rank 0's 8 rows pack into 2 micro-batches, rank 1's into 3 (prompt 6 tokens, one per row)
# The slow DeepSpeed launches check the budget on a sequence-mean and a token-sum loss only.
BUDGET_SHORT = {"budget_loss_types": ["grpo", "dapo"]}


def _local_micro_batches(rank: int) -> int:
    """Micro-batches rank ``rank`` packs its rows into on its own (each row is its own group)."""
    from grpo_ascend.trainers.micro_batches import TokenCost, pack_by_tokens

    mine = dist_worker.rank_slice(dist_worker.fixed_global_batch(), rank, WORLD)
    mask = mine["completion_mask"]
    lengths = mask.sum(1).tolist()  # the masks are contiguous from the first column
    cost = TokenCost(mine["prompt_ids"].shape[1], mask.shape[1], share_prompts=True)
    return len(pack_by_tokens(lengths, list(range(len(lengths))), TOKEN_BUDGET, cost))


def _ddp_env(folder: Path) -> dict[str, str]:
    return {}


# name -> (launch environment, whether gradients are whole on every rank, worker settings, norm tolerance)
STRATEGIES: dict[str, tuple[Any, bool, dict[str, Any], float]] = {
    # Each also packs the ranks' rows under a token budget: alone, rank 0 (short completions) packs
    # fewer micro-batches than rank 1; the ranks must run as many (same gradient, no hang).
    "plain": (_ddp_env, True, {"token_budget": TOKEN_BUDGET}, 1e-5),
    "deepspeed-zero2": (lambda folder: ZERO2_ENV, False, {"token_budget": TOKEN_BUDGET, **BUDGET_SHORT}, 1e-4),
    "deepspeed-zero3": (zero3_env, False, {"token_budget": TOKEN_BUDGET, **BUDGET_SHORT}, 1e-4),
    # No clipping: the global norm of the sharded gradients is reduced by the strategy itself.
    "fsdp": (lambda folder: FSDP_ENV, True, {"max_grad_norm": 0, "token_budget": TOKEN_BUDGET}, 1e-5),
}
NEEDS_DEEPSPEED = {"deepspeed-zero2", "deepspeed-zero3"}
# DeepSpeed start-up is slow (~10 s per launch here): those two are deselected by scripts/test.sh --fast.
PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if name in NEEDS_DEEPSPEED else []) for name in STRATEGIES]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir) -> dict[str, Any]:
    """Gradients, loss and gradient norm of one process over the whole batch, per loss type."""
    out = tmp_path_factory.mktemp("one")
    single = dist_worker.make_trainer(str(tiny_model_dir), dist_worker.grads_config(str(out), 1))
    dist_worker.deterministic_trainable_init(single.policy)
    batch = dist_worker.fixed_global_batch()
    halves = batch["completion_mask"].split(batch["completion_mask"].shape[0] // WORLD)
    assert halves[0].sum() * 3 < halves[1].sum()  # the ranks' token counts really differ
    reference = {}
    for loss_type in LOSS_TYPES:
        grads, loss = dist_worker.step_gradients(single, batch, loss_type)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        reference[loss_type] = {"grads": grads, "loss": loss, "grad_norm": norm}
    reference["eval"] = dist_worker.contract_evaluation(single)  # no step was taken: the same weights
    return reference


@pytest.mark.parametrize("name", PARAMS)
def test_strategy_contract(name, one_process, tmp_path, tiny_model_dir):
    if name in NEEDS_DEEPSPEED:
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'grpo-ascend[deepspeed]')")
    env, elementwise, settings, norm_rel = STRATEGIES[name]
    out = tmp_path / name
    launch("contract", out, {"model_dir": str(tiny_model_dir), "loss_types": LOSS_TYPES,
                             "elementwise": elementwise, **settings}, extra_env=env(tmp_path))
    ranks = [torch.load(out / f"contract_rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert {r["strategy"] for r in ranks} == {name.split("-")[0]}
    if name == "fsdp":
        assert all(r["sharded"] == {"units": 5, "dtensor": True} for r in ranks)

    expected_eval = {k: v for k, v in one_process["eval"].items() if k != "eval/runtime"}
    assert any(k.startswith("eval/pass@") for k in expected_eval) and expected_eval["eval/num_prompts"] == 5
    for r, got in enumerate(ranks):
        assert got["eval"].keys() - {"eval/runtime"} == expected_eval.keys(), r
        for key, value in expected_eval.items():
            assert got["eval"][key] == pytest.approx(value, rel=1e-6, abs=1e-7, nan_ok=True), (r, key)

    for loss_type in LOSS_TYPES:
        expected = one_process[loss_type]
        for r, got in enumerate(ranks):
            # exact normalised gradient (2 micro-batches per rank, no sync on the first)
            assert got[loss_type]["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), (loss_type, r)
            assert got[loss_type]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=norm_rel), (loss_type, r)
            if elementwise:
                grads = got[f"grads/{loss_type}"]
                assert grads["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), loss_type
                assert len(grads["grads"]) == len(expected["grads"])
                for a, b in zip(grads["grads"], expected["grads"]):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{loss_type}, rank {r}")
        if name == "plain":  # both ranks hold the same averaged gradient bit for bit
            for a, b in zip(ranks[0][f"grads/{loss_type}"]["grads"], ranks[1][f"grads/{loss_type}"]["grads"]):
                assert torch.equal(a, b), loss_type
        if "token_budget" in settings and loss_type in settings.get("budget_loss_types", LOSS_TYPES):
            # packed 2 and 3 micro-batches alone, run 3 on both ranks, one process's step
            assert [_local_micro_batches(r) for r in range(WORLD)] == [2, 3]
            for r, got in enumerate(ranks):
                budget = got[f"budget/{loss_type}"]
                assert budget["micro_batches"] == 3, (loss_type, r)
                assert budget["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), (loss_type, r)
                assert budget["grad_norm"] == pytest.approx(expected["grad_norm"], rel=norm_rel), (loss_type, r)
                if elementwise:
                    for a, b in zip(got[f"budget_grads/{loss_type}"]["grads"], expected["grads"]):
                        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"budget, {loss_type}, rank {r}")

    for r, got in enumerate(ranks):
        nan = got["nan_step"]  # the NaN gradient is on rank 0 only; every rank skips
        assert nan["skipped_steps"] == 1 and nan["untouched"] and nan["moved"] and nan["finite_after"], (r, nan)
        assert not math.isfinite(nan["bad_grad_norm"]), (r, nan)
        trip = got["round_trip"]
        assert trip["loaded_step"] == trip["saved_step"] and trip["moved"] > 0, (r, trip)
        assert trip["restored_diff"] == 0, (r, trip)
        assert trip["replayed_diff"] == 0 and trip["first"] == trip["second"], (r, trip)
        assert trip["best_diff"] == 0, (r, trip)  # load_best_model_at_end

    # no-sync: a micro-batch that is not the step's last leaves its gradient unreduced
    unsynced = [got["no_sync"] for got in ranks]
    if name == "plain":  # each rank holds its own local gradient, not the average
        assert all(u["grads_present"] > 0 for u in unsynced)
        assert unsynced[0]["grad_norms"] != unsynced[1]["grad_norms"]
    elif name == "fsdp":  # no reduce-scatter yet: the sharded gradients are not there
        assert all(u["grads_present"] == 0 for u in unsynced)
    else:  # the engine was told this is not an accumulation boundary
        assert all(u["boundary"] is False for u in unsynced)
