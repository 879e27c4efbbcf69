"""PPO with 2 data-parallel processes on the CPU (gloo over loopback): one optimizer step over a fixed
global batch gives the single-process gradients for the policy adapter, the critic adapter and the
value head. This checks the critic's own DDP wrapper (the shared base is not registered in it) and
that the policy's wrapper does not hold critic parameters.

Run as a script, this file is one rank: ``python tests/trainers/test_ppo_distributed.py OUT MODEL_DIR``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

WORLD = 2
ROWS = 16


def _global_batch() -> dict[str, torch.Tensor]:
    """16 completions; the second half has far more valid tokens than the first (token-mean losses
    are only exact across ranks if the normaliser counts all ranks' tokens)."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(5, 500, (ROWS, 6), generator=g)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[::3, :2] = 0
    completion = torch.randint(5, 500, (ROWS, 7), generator=g)
    lengths = torch.tensor([1, 2, 1, 3, 2, 1, 2, 1, 7, 6, 7, 5, 7, 7, 6, 7])
    mask = (torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {
        "prompt_ids": prompt, "prompt_mask": prompt_mask, "completion_ids": completion, "completion_mask": mask,
        "old_logps": (-3 - torch.rand(ROWS, 7, generator=g)) * mask,
        "values": torch.randn(ROWS, 7, generator=g) * mask,
        "advantages": torch.randn(ROWS, 7, generator=g) * mask,
        "returns": torch.randn(ROWS, 7, generator=g) * mask,
    }


def step_gradients(model_dir: str, out: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Gradients (after the DDP average) of one PPO optimizer step over this rank's share of the batch."""
    from helpers import make_experience, one_round_gradients

    from grpo_ascend import PPOConfig, PPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.models.policy import default_lora_config

    accum = 4 // world
    cfg = PPOConfig(output_dir=out, num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=accum,
                    num_mini_batches=1, max_completion_length=7, max_prompt_length=96, max_steps=1, save_steps=0,
                    disable_tqdm=True, log_completions_steps=0, seed=0, length_bucket=16, kl_coef=0.0,
                    entropy_coef=0.01, cliprange_value=0.1, vf_coef=0.5)
    trainer = PPOTrainer(model_dir, lambda completions, **kw: [0.0] * len(completions), cfg, arithmetic_dataset(8),
                         peft_config=default_lora_config(r=4))
    with torch.no_grad():
        for name, p in trainer.policy.named_parameters():
            if p.requires_grad:
                seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) % 100_003
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    batch = _global_batch()
    per_rank = ROWS // world
    mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    exp = make_experience(mine["prompt_ids"], mine["prompt_mask"], mine["completion_ids"], mine["completion_mask"],
                          old_logps=mine["old_logps"])
    return one_round_gradients(trainer, exp, values=mine["values"], advantages=mine["advantages"],
                               returns=mine["returns"])[0]


@pytest.mark.slow
def test_two_processes_give_the_single_process_gradients(tmp_path, tiny_model_dir):
    from distributed_runs import run_ranks

    run_ranks([__file__, str(tmp_path), str(tiny_model_dir)], tmp_path, "rank", timeout=300)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = step_gradients(str(tiny_model_dir), str(tmp_path / "single"), 0, 1)
    finally:
        torch.set_num_threads(before)
    assert any("critic" in k for k in expected) and any("value_head" in k for k in expected)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"grads_rank{rank}.pt")
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # helpers, as tests/conftest.py does
    out_dir, model_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    grads = step_gradients(model_dir, str(Path(out_dir) / f"run_rank{rank}"), rank, int(os.environ["WORLD_SIZE"]))
    torch.save(grads, Path(out_dir) / f"grads_rank{rank}.pt")
