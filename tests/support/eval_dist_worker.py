"""One rank of tests/trainers/test_evaluation_distributed.py: ``python tests/support/eval_dist_worker.py evaluate OUT_DIR SPEC``.

Under the gloo process group the launcher's environment describes, in one launch:

1. a 4-step GRPO run with evaluation (on start and every 2 steps, the best checkpoint by
   ``eval/reward``) whose writes under its output_dir are audited;
2. ``evaluate()`` on a one-prompt set after training (rank 1 gets no prompt at all);
3. the same run without evaluation, in another output_dir.

Saves ``OUT_DIR/eval_rank<R>.pt``: the evaluation records, the best (step, value) this rank holds,
its writes, the one-prompt metrics and the trainable weights after each run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

#: 5 eval prompts in chunks of 2 (per_device_eval_batch_size 6 // 3 generations): rank 0 gets 3, rank 1 gets 2.
EVAL_SIZE, EVAL_SEED, SMALL_SEED = 5, 7, 9


def eval_config(output_dir: str, evaluating: bool = True) -> Any:
    from grpo_ascend import GRPOConfig

    settings = dict(
        output_dir=output_dir, num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
        steps_per_generation=2, max_completion_length=10, max_prompt_length=96, learning_rate=5e-3, max_steps=4,
        save_steps=2, logging_steps=1, disable_tqdm=True, log_completions_steps=0, seed=0,
        lr_scheduler_type="constant", length_bucket=16, beta=0.02,
        num_generations_eval=3, per_device_eval_batch_size=6, eval_pass_threshold=0.5,
    )
    if evaluating:
        settings.update(eval_strategy="steps", eval_steps=2, eval_on_start=True, metric_for_best_model="eval/reward")
    return GRPOConfig(**settings)


def eval_trainer(model_dir: str, cfg: Any) -> Any:
    """A GRPO trainer on the tiny model (LoRA rank 4, dist_worker's reward) with the eval set when evaluating."""
    from dist_worker import even_token_fraction

    from grpo_ascend import GRPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.models.policy import default_lora_config

    eval_dataset = arithmetic_dataset(EVAL_SIZE, seed=EVAL_SEED) if cfg.eval_strategy != "no" else None
    return GRPOTrainer(model_dir, even_token_fraction, cfg, arithmetic_dataset(12, seed=3), eval_dataset=eval_dataset,
                       peft_config=default_lora_config(r=4))


def trainable(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}


def run(out: Path, spec: dict[str, Any], rank: int) -> None:
    from dist_worker import WriteAudit

    from grpo_ascend.data.synthetic import arithmetic_dataset

    cfg = eval_config(str(out / "run"))
    audit = WriteAudit(Path(cfg.output_dir))
    trainer = eval_trainer(spec["model_dir"], cfg)
    trainer.train()
    evaluations = [r for r in trainer.state.log_history if "eval/reward" in r]
    small = trainer.evaluate(arithmetic_dataset(1, seed=SMALL_SEED))
    audit.active = False
    results: dict[str, Any] = {
        "evaluations": evaluations,
        "best": (trainer.run.best.step, trainer.run.best.value), "writes": audit.writes, "small": small,
        "weights_evaluated": trainable(trainer),
    }
    plain = eval_trainer(spec["model_dir"], eval_config(str(out / "run_plain"), evaluating=False))
    plain.train()
    results["weights_plain"] = trainable(plain)
    torch.save(results, out / f"eval_rank{rank}.pt")


def main() -> int:
    _, out, spec = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    run(out, spec, int(os.environ["RANK"]))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    raise SystemExit(main())
