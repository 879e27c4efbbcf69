"""Shared fixtures: the offline tiny model (built once per machine, cached) and quiet logs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The test models are tiny: one thread is as fast as two for them, and it avoids OpenMP spin-wait
# thrashing (tens of times slower) when the 2-core CI machine runs anything else at the same time.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Directory of the random-init ``tiny`` Qwen2 model and its tokenizer."""
    from grpo_ascend.tiny_model import build_tiny_model

    return build_tiny_model("tiny")


@pytest.fixture(scope="session")
def tiny_warm_model_dir():
    """Directory of the ``tiny`` model after its supervised warm start on the synthetic task.

    ``GRPO_ASCEND_WARM_SEED=N`` builds the warm start from another seed: a stand-in for another
    machine, whose float reduction order gives a slightly different warm model.
    """
    from grpo_ascend.tiny_model import build_tiny_model

    return build_tiny_model("tiny", warm=True, seed=int(os.environ.get("GRPO_ASCEND_WARM_SEED", "0")))


@pytest.fixture(scope="session")
def tiny_tool_model_dir():
    """Directory of ``builtin:tiny-tool-warm`` (the warm model after calculator transcripts); the
    warm seed as for :func:`tiny_warm_model_dir`."""
    from grpo_ascend.tiny_model import build_tiny_model

    return build_tiny_model("tiny", warm=True, tools=True, seed=int(os.environ.get("GRPO_ASCEND_WARM_SEED", "0")))


@pytest.fixture()
def tiny_model(tiny_model_dir):
    """A fresh fp32 ``tiny`` model (eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def chaotic(tiny_model_dir):
    """The tiny model with its weights perturbed (fixed seed) so that greedy outputs vary.

    The plain random-init model has nearly flat logits and greedy-decodes one token forever,
    which would make parity tests vacuous.
    """
    from helpers import perturb_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = perturb_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


#: Files that build the slowest model (``tiny-tool-warm``, minutes) go first: under the two workers of
#: scripts/test.sh one worker builds it while the other runs the rest, instead of it starting last.
FIRST_FILES = ("test_tool_demo.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST_FILES)
