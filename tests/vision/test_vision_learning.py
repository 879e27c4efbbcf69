"""GRPO learns the coloured-shapes task from the picture: on held-out pictures the warm-started tiny VLM's sampled
reward rises well above the same evaluation before training (the control), and the trained policy's answers
follow the picture: scored against swapped colours they fall far below their score on the true colours.

Measured (32 held-out pictures x 8 samples, 30 steps of 4 prompts x 8, full fine-tuning of the language model at
learning rate 1e-3): reward 0.69 -> 0.89, swapped colours 0.25 -> 0.09. At learning rate 0 the two rewards are
equal to the last digit and both tests fail.
"""

from __future__ import annotations

import os

import pytest
from helpers import SMALL_RUN, rewards_before_and_after_training

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.models.tiny_vlm import build_tiny_vlm
from grpo_ascend.vision.shapes_task import colour_code_reward, coloured_shapes_dataset, swapped_colours

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.slow]
#: ``GRPO_ASCEND_VLM_LR=0`` shows the assertions failing without learning.
LEARNING_RATE = float(os.environ.get("GRPO_ASCEND_VLM_LR", "1e-3"))


@pytest.fixture(scope="module")
def scores(tmp_path_factory):
    """Held-out rewards before (the control) and after training, on the true and on swapped colours."""
    path = build_tiny_vlm("qwen2_5_vl", warm=True, seed=int(os.environ.get("GRPO_ASCEND_WARM_SEED", "0")))
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path_factory.mktemp("vlm")), "max_steps": 30,
                        "per_device_train_batch_size": 32, "num_generations": 8, "learning_rate": LEARNING_RATE,
                        "max_completion_length": 2, "max_prompt_length": 64, "temperature": 1.0,
                        "num_generations_eval": 8, "per_device_eval_batch_size": 256})
    trainer = GRPOTrainer(str(path), colour_code_reward, cfg, coloured_shapes_dataset(640, seed=3))
    held_out = coloured_shapes_dataset(32, seed=4)
    swapped = swapped_colours(held_out)
    swapped_control = trainer.evaluate(swapped, metric_key_prefix="c")["c/reward"]
    control, trained = rewards_before_and_after_training(trainer, held_out)
    swapped_trained = trainer.evaluate(swapped, metric_key_prefix="t")["t/reward"]
    print(f"held-out reward {control:.3f} -> {trained:.3f}, swapped colours {swapped_control:.3f} -> {swapped_trained:.3f}")
    return {"control": control, "trained": trained, "swapped_control": swapped_control, "swapped_trained": swapped_trained}


def test_the_held_out_reward_rises_above_the_control(scores):
    assert scores["trained"] > scores["control"] + 0.1, scores


def test_the_trained_policy_answers_from_the_picture(scores):
    """Far below on swapped colours, and further below than before training (the warm start reads the picture a
    little already)."""
    assert scores["swapped_trained"] < scores["trained"] - 0.3, scores
    gap_before = scores["control"] - scores["swapped_control"]
    assert scores["trained"] - scores["swapped_trained"] > gap_before + 0.2, scores
