"""The rollout process on a device of its own takes its versions over a transfer group (forced here with
weight_transfer: collective, gloo on the CPU): bit for bit into its model, tied and untied heads, LoRA and full,
after a real optimizer step; the previous version kept for pinned requests; the group built once per process,
rebuilt after a restart; a hung process stops the push within weight_sync_timeout."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from helpers import SMALL_RUN, index_in_group, perturb_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.errors import ConfigError, RolloutError
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.models.sampler_copy import sampler_copy, synced_tensors
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.process.client import ProcessBackend, ProcessSettings
from grpo_ascend.rollout.process.weight_ring import VersionEvicted
from grpo_ascend.rollout.process.worker import RolloutServer, WorkerSpec
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.weight_transfer.group import TransferGroup
from grpo_ascend.weight_transfer.manifest import Manifest
from grpo_ascend.weight_transfer.sender import WeightSender
from grpo_ascend.weight_transfer.settings import rollout_process_transfer

COLLECTIVE = ProcessSettings(threads=1, transfer="collective", bucket_bytes=512 * 1024, weight_sync_timeout=20.0)


def _policy(model_dir, tied: bool, lora: bool) -> torch.nn.Module:
    """The tiny model (``tied`` head or not; ``lora``: a PEFT adapter) after one Adam step."""
    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = perturb_weights(AutoModelForCausalLM.from_config(config).float())
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, default_lora_config(r=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=0.05)
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model.eval()


def _push_into(server: RolloutServer, policy: torch.nn.Module, version: int) -> None:
    """What ProcessBackend does, with the worker's side in this process: build, send, receive."""
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in synced_tensors(policy)]
    manifest = Manifest.plan(specs, 512 * 1024)
    store, address = TransferGroup.listen(2, 20.0)
    done = []

    def send() -> None:
        group = TransferGroup.build(store, address, 0, "cpu", 20.0)
        done.append(WeightSender("cpu").send(manifest, synced_tensors(policy), [group]))

    thread = threading.Thread(target=send)
    thread.start()
    assert server.receive_weights(address.to_json(), version, manifest.to_json()) == version
    thread.join()
    assert not done[0].failed and len(manifest.buckets) > 1


@pytest.mark.parametrize(("tied", "lora"), [(True, False), (False, False), (True, True), (False, True)])
def test_received_values_are_the_sent_ones_bit_for_bit(tiny_model_dir, tied, lora):
    policy = _policy(tiny_model_dir, tied, lora)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(num_generations=1, max_completion_length=4)
    server = RolloutServer(WorkerSpec(sampler_copy(policy), tok, params, "cpu", None, "fp32", 0, 20.0,
                                      transfer="collective"), None)
    with torch.no_grad():  # the server starts from other weights, so every tensor must arrive
        for p in server.model.parameters():
            p.zero_()
    _push_into(server, policy, 1)
    sent = {name: t.detach().clone() for name, t in synced_tensors(policy)}
    live = dict(server.model.named_parameters())
    assert set(sent) <= set(live) and (not lora or any(".mlp." in n or "proj" in n for n in sent))
    for name, tensor in sent.items():
        assert torch.equal(live[name].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    if tied:
        assert server.model.lm_head.weight.data_ptr() == server.model.model.embed_tokens.weight.data_ptr()
    # version 0 (all zeros) is kept for a request pinned to it, swapped in and back; an older one is gone
    ids = [tok("hello").input_ids]
    assert server.generate(ids, params, 0, None, 0).policy_versions.unique().tolist() == [0]
    assert all(float(live[n].abs().max()) == 0 for n in sent)
    assert server.generate(ids, params, 0, None, None).policy_versions.unique().tolist() == [1]
    assert all(torch.equal(live[n], t) for n, t in sent.items())
    _push_into(server, policy, 2)
    with pytest.raises(VersionEvicted, match="version 0 is no longer"):
        server.generate(ids, params, 0, None, 0)
    server.ring.close()


def test_rollout_process_over_a_group_samples_as_the_trainer_and_builds_the_group_once(tiny_model_dir):
    policy = _policy(tiny_model_dir, tied=True, lora=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(num_generations=2, max_completion_length=8, temperature=1.0)
    ids = [tok("hello there").input_ids, tok("one two").input_ids]
    built = TransferGroup.built
    remote = ProcessBackend(policy, tok, params, COLLECTIVE, torch.device("cpu"), 0)
    try:
        assert remote.ring is None
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in policy.parameters():
                    if p.requires_grad:
                        p.add_(0.01)
            remote.sync_weights(PolicyWeights(policy, version))
        assert TransferGroup.built == built + 1 and remote.published_version == 3
        sampled = remote.generate_ids(ids, params, torch.Generator().manual_seed(3))
        assert sampled.policy_versions.unique().tolist() == [3]
        with torch.no_grad():
            logps = _trainer_logprobs(policy, sampled)
        torch.testing.assert_close(logps * sampled.completion_mask, sampled.sampling_logprobs * sampled.completion_mask,
                                   rtol=0, atol=1e-5)
        with remote.pinned(2):  # one_step_off's pin: the previous version is still on the rollout device
            assert remote.generate_ids(ids, params).policy_versions.unique().tolist() == [2]
        os.kill(remote.pid, signal.SIGKILL)
        remote.sync_weights(PolicyWeights(policy, 4))  # restarted, re-joined with a new group, this version pushed
        assert remote.restarts == 1 and TransferGroup.built == built + 2
        assert remote.generate_ids(ids, params).policy_versions.unique().tolist() == [4]
    finally:
        remote.close()


def _trainer_logprobs(policy: torch.nn.Module, batch) -> torch.Tensor:
    from grpo_ascend.models.policy import CompletionLogprobs

    logps, _ = CompletionLogprobs(policy)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                          batch.completion_mask, temperature=1.0)
    return logps


def test_a_hung_rollout_process_stops_the_push_within_weight_sync_timeout(tiny_model_dir):
    policy = _policy(tiny_model_dir, tied=True, lora=False)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(num_generations=1, max_completion_length=4)
    settings = ProcessSettings(threads=1, transfer="collective", weight_sync_timeout=2.0)
    remote = ProcessBackend(policy, tok, params, settings, torch.device("cpu"), 0)
    try:
        remote.sync_weights(PolicyWeights(policy, 1))
        os.kill(remote.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RolloutError, match=r"weight_sync_timeout=2") as caught:
            remote.sync_weights(PolicyWeights(policy, 2))
        assert time.monotonic() - started < 15 and "\n" not in str(caught.value)
        assert remote.pid is None  # stopped: the next request starts a fresh process
    finally:
        if remote.pid is not None:
            os.kill(remote.pid, signal.SIGKILL)
        remote.close()


def test_weight_transfer_for_the_rollout_process_resolves_with_one_line():
    assert rollout_process_transfer("auto", "cpu", "cpu")[0] == "ring"
    assert rollout_process_transfer("collective", "cpu", "cpu")[0] == "collective"
    with pytest.raises(ConfigError, match="does not apply to the built-in rollout process"):
        rollout_process_transfer("files", "cpu", "cpu")
    with pytest.raises(ConfigError, match="weight_transfer must be one of"):
        rollout_process_transfer("socket", "cpu", "cpu")


def test_one_step_off_over_a_group_keeps_the_versions_exact_and_builds_it_once(tmp_path, tiny_model_dir):
    """The trainer's path: batch k sampled with version k - 1 exactly, the sampler's log-probs the trainer's on the
    first batch (same weights), one group for the whole run, closed with the process at the end."""
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": 5},
                     rollout_mode="one_step_off", weight_transfer="collective")
    trainer = GRPOTrainer(str(tiny_model_dir), index_in_group(cfg.num_generations), cfg, arithmetic_dataset(40, seed=1),
                          peft_config=default_lora_config(r=4))
    seen = []
    take = trainer.experience.source.next_scored

    def recording(*a, **kw):
        exp = take(*a, **kw)
        seen.append((trainer.step, exp.policy_versions.min().item(), exp.policy_versions.max().item()))
        return exp

    trainer.experience.source.next_scored = recording
    built = TransferGroup.built
    trainer.train()
    assert trainer.rollout.backend.ring is None
    assert seen == [(0, 0, 0), (1, 0, 0), (2, 1, 1), (3, 2, 2), (4, 3, 3)]
    assert TransferGroup.built == built + 1
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in r]
    assert len(gaps) == 5 and gaps[0] < 1e-5 and min(gaps[1:]) > 100 * gaps[0]
