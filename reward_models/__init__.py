"""Reward functions: protocol, loading, combining, built-in rule rewards and a learned scorer.

A reward function follows TRL's GRPOTrainer convention: it is called with keyword arguments
``f(prompts=..., completions=..., completion_ids=..., **dataset_columns, trainer_state=...)`` and
returns one float (or None for "not applicable") per completion; ``async def`` functions run
concurrently. :class:`RewardSet` loads, calls, checks and combines several of them.
"""

from reward_models.calling import TrainerStateView
from reward_models.loading import BUILTIN_REWARDS, load_reward_function, register_reward, reward_name
from reward_models.math_answer import AccuracyReward, answers_match, extract_answer, parse_number
from reward_models.reward_model import RewardModelScorer
from reward_models.reward_output import RewardOutput
from reward_models.reward_set import RewardSet, processing_classes_per_function
from reward_models.rules import DEFAULT_FORMAT_PATTERN, FormatReward, LengthPenalty, OverlongPenalty
from reward_models.text import completion_text

__all__ = [
    "BUILTIN_REWARDS",
    "DEFAULT_FORMAT_PATTERN",
    "AccuracyReward",
    "FormatReward",
    "LengthPenalty",
    "OverlongPenalty",
    "RewardModelScorer",
    "RewardOutput",
    "RewardSet",
    "TrainerStateView",
    "answers_match",
    "completion_text",
    "extract_answer",
    "load_reward_function",
    "parse_number",
    "processing_classes_per_function",
    "register_reward",
    "reward_name",
]
