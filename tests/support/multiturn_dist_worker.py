"""One rank of tests/trainers/test_multiturn_distributed.py: a short GRPO run with an environment's tool on
the scripted model (multiturn_scripts.py), under the gloo process group the launcher's environment
describes, then an evaluation on 3 prompts. Saves this rank's trainable weights to
``OUT_DIR/weights_rank<R>.pt`` and its eval metrics to ``OUT_DIR/eval_rank<R>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main() -> int:
    _, out, spec = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    from datasets import Dataset
    from helpers import SMALL_RUN
    from multiturn_scripts import PROMPT, AddEnv, scripted_add_model

    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend.models.policy import default_lora_config

    model, tok, call, suffix, seq = scripted_add_model(spec["model_dir"])
    model.script = dict(list(model.script.items())[: len(call)])  # the answer after the tool is sampled
    # One tool step: a <tool_call> the answer may sample (p ≈ 0.002 a token) is never run, so one call per
    # completion, no failed call and the right sum hold whatever was sampled.

    def reward(prompts, completions, **kwargs):
        return [float(len(c[-1]["content"]) % 3 == 0) for c in completions]

    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(out / "run"), "max_steps": 2, "max_prompt_length": 1024,
                        "max_completion_length": len(call) + len(suffix) + 8, "per_device_train_batch_size": 4,
                        "max_tool_calling_iterations": 1})
    trainer = GRPOTrainer(model, reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 8), processing_class=tok,
                          peft_config=default_lora_config(r=4), environment_factory=AddEnv)
    trainer.train()
    rank = int(os.environ["RANK"])
    # 3 eval prompts in chunks of 2 (per_device_eval_batch_size 4 // 2 generations): rank 0 gets 2, rank 1 one.
    trainer.args.num_generations_eval, trainer.args.per_device_eval_batch_size = 2, 4
    metrics = trainer.evaluate(Dataset.from_list([{"prompt": PROMPT}] * 3))
    (out / f"eval_rank{rank}.json").write_text(json.dumps(metrics))
    weights = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    torch.save(weights, out / f"weights_rank{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
