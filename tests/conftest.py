"""Shared fixtures: the offline tiny model (built once per machine, cached), quiet logs, and no fake
torch_npu outliving its test.

The tests mirror the packages' folders (tests/rollout/ holds the tests of grpo_ascend/rollout/, tests/project/
the repository-wide checks); code they share lives in tests/support/, which this file puts on ``sys.path``
so that any test imports it by module name (``from helpers import SMALL_RUN``). A test module never imports
another test module.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The test models are tiny: one thread is as fast as two for them, and it avoids OpenMP spin-wait
# thrashing (tens of times slower) when the 2-core CI machine runs anything else at the same time.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _forget_torch_npu():
    """After each test (and its monkeypatches' undo) the device layer imports torch_npu afresh, so a
    fake from tests/support/fake_device.py never outlives the test that put it in."""
    yield
    from grpo_ascend.device import forget_torch_npu

    forget_torch_npu()


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Directory of the random-init ``tiny`` Qwen2 model and its tokenizer."""
    from grpo_ascend.models.tiny_model import build_tiny_model

    return build_tiny_model("tiny")


@pytest.fixture(scope="session")
def tiny_warm_model_dir():
    """Directory of the ``tiny`` model after its supervised warm start on the synthetic task.

    ``GRPO_ASCEND_WARM_SEED=N`` builds the warm start from another seed: a stand-in for another
    machine, whose float reduction order gives a slightly different warm model.
    """
    from grpo_ascend.models.tiny_model import build_tiny_model

    return build_tiny_model("tiny", warm=True, seed=int(os.environ.get("GRPO_ASCEND_WARM_SEED", "0")))


@pytest.fixture(scope="session")
def tiny_tool_model_dir():
    """Directory of ``builtin:tiny-tool-warm`` (the warm model after calculator transcripts); the
    warm seed as for :func:`tiny_warm_model_dir`."""
    from grpo_ascend.models.tiny_model import build_tiny_model

    return build_tiny_model("tiny", warm=True, tools=True, seed=int(os.environ.get("GRPO_ASCEND_WARM_SEED", "0")))


@pytest.fixture(scope="session")
def tiny_vllm_llava_dir():
    """Directory of the tiny LLaVA with a head dimension of 32, the smallest vLLM's CPU attention runs."""
    from grpo_ascend.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm("llava", head_dim=32)


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


#: The longest files first, so that neither of scripts/test.sh's two workers is left running a long file
#: alone at the end (xdist hands out whole files in this order as workers free up). Seconds of one
#: worker in a full run on the 2-core machine in brackets (Intel Xeon, quiet, ranks forked from
#: tests/support/rank_forker.py); single-process files alternate with two-process ones (which use both cores
#: while they run). Refresh from `bash scripts/test.sh --durations=0` when files grow.
LONGEST_FILES = (
    "test_memory_plan.py",  # 82, one test with two fresh-interpreter ranks
    "test_tool_demo.py",  # 62: the calculator learning test
    "test_strategy_contract.py",  # 67, two processes
    "test_ppo.py",  # 58: the PPO learning test
    "test_deepspeed.py",  # 44, two processes
    "test_demo.py",  # 29
    "test_distributed.py",  # 35, two processes
    "test_two_node.py",  # 40 (one run of it on a busy 2-core machine), two machine ranks then two processes
    "test_grpo_trainer.py",  # 21
    "test_hybrid_rollout.py",  # 22 (one run of it): 14 of them the rollout process's start
    "test_fsdp.py",  # 26, two processes
    "test_compiled_decode.py",  # 18
    "test_multiturn_trainer.py",  # 18
    "test_tiny_model.py",  # 14
    "test_checkpoint.py",  # 11
    "test_sandbox.py",  # 11
    "test_cli_doctor.py",  # 10
    "test_smoke.py",  # 13 (one run of it)
    "test_evaluation_tools.py",  # 10
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))
