"""The vLLM server client's collective weight sync and request gate, with fake servers (no vLLM): the fakes answer
the client's routes in-process and receive over real gloo groups, as a server's workers do."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.vllm.collective_sync import (
    ADAPTER_PATH,
    ENGINE_NAME,
    FORGET_ADAPTER_PATH,
    JOIN_PATH,
    PROBE_PATH,
    RECEIVE_PATH,
    CollectiveSync,
    resolve_transfer,
)
from grpo_ascend.rollout.vllm.request_gate import RequestGate
from grpo_ascend.rollout.vllm.server_http import ServerError
from grpo_ascend.weight_transfer.group import GroupAddress, TransferGroup
from grpo_ascend.weight_transfer.manifest import Manifest
from grpo_ascend.weight_transfer.receiver import WeightReceiver

OURS = {"engine": ENGINE_NAME, "workers": 1, "device_type": "cpu", "dtype": "float32"}


class FakeServers:
    """Servers by URL: ``ours`` answer the probe and receive over their group; ``broken`` fail every load."""

    def __init__(self, ours=(), plain=(), broken=()) -> None:
        self.ours, self.plain, self.broken = set(ours) | set(broken), set(plain), set(broken)
        self.groups: dict[str, TransferGroup] = {}
        self.received: dict[str, dict[str, torch.Tensor]] = {}
        self.adapters: dict[str, dict[str, tuple[dict, dict[str, torch.Tensor]]]] = {}
        self.calls: list[tuple[str, str]] = []

    def __call__(self, url, method, path, body=None, timeout=None, retries=None):
        self.calls.append((url, path))
        if url in self.plain or url not in self.ours:
            raise ServerError(f"vLLM server {url} {method} {path} answered 404: Not Found")
        if path == PROBE_PATH:
            return OURS
        if path == JOIN_PATH:
            info = body["init_info"]
            self.groups[url] = TransferGroup.join(GroupAddress.from_json(info["address"]), 1, "cpu",
                                                  info["timeout_s"])
            return {"joined": True}
        if path in (RECEIVE_PATH, ADAPTER_PATH):
            if url in self.broken:
                raise ServerError(f"vLLM server {url} POST {path} answered 500: out of memory")
            manifest = Manifest.from_json(body["update_info"]["manifest"])
            got = {}
            for bucket in WeightReceiver(self.groups[url]).buckets(manifest):
                got.update((name, view.clone()) for name, view in bucket)
            if path == ADAPTER_PATH:
                self.adapters.setdefault(url, {})[body["lora_name"]] = (body["config"], got)
            else:
                self.received[url] = got
            return {"received": True, "checksums": []}
        if path == FORGET_ADAPTER_PATH:
            self.adapters.get(url, {}).pop(body["lora_name"], None)
        return {}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))


def test_resolve_files_asks_nothing_collective_refuses_a_plain_server_and_auto_falls_back(caplog):
    fake = FakeServers(ours=["http://a:1"], plain=["http://b:1"])
    assert resolve_transfer("files", fake, ["http://a:1", "http://b:1"], "cpu") is None and fake.calls == []
    with pytest.raises(ConfigError) as err:
        resolve_transfer("collective", fake, ["http://a:1", "http://b:1"], "cpu")
    message = str(err.value)
    assert "\n" not in message and "http://b:1" in message and "grpo_ascend.rollout.vllm.serve" in message
    with caplog.at_level(logging.WARNING):
        assert resolve_transfer("auto", fake, ["http://a:1", "http://b:1"], "cpu") is None
    assert len(caplog.records) == 1 and "http://b:1" in caplog.records[0].getMessage()
    ends = resolve_transfer("auto", fake, ["http://a:1"], "cpu")
    assert ends is not None and ends["http://a:1"].workers == 1 and ends["http://a:1"].dtype == torch.float32


def test_servers_receive_every_tensor_bit_for_bit_over_groups_built_once_and_a_failed_one_is_dropped():
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    fake = FakeServers(ours=urls[:2], broken=urls[2:])
    sync = CollectiveSync(fake, resolve_transfer("collective", fake, urls, "cpu"), "cpu", timeout_s=3.0,
                          bucket_bytes=2048)
    policy = model()
    built = TransferGroup.built
    try:
        failed = sync.send(urls, PolicyWeights(policy, 1))
        assert list(failed) == [urls[2]] and "out of memory" in failed[urls[2]]
        assert set(sync.groups) == set(urls[:2])  # the failed one's group is closed: a restart joins a new one
        groups = dict(sync.groups)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.25)
        assert sync.send(urls[:2], PolicyWeights(policy, 2)) == {}
        assert sync.groups == groups and TransferGroup.built - built == 6  # 3 groups x 2 sides, none rebuilt
        assert len(sync.last_report.failed) == 0 and sync.last_report.buckets > 1
        for url in urls[:2]:
            sent = dict(policy.state_dict())
            assert sorted(fake.received[url]) == sorted(sent)
            for name, tensor in sent.items():
                assert torch.equal(fake.received[url][name], tensor), (url, name)
    finally:
        sync.close()
        for group in fake.groups.values():
            group.close()
    assert sync.groups == {}


def test_an_adapter_goes_into_the_servers_memory_over_the_same_groups_as_json_config():
    urls = ["http://a:1", "http://b:1"]
    fake = FakeServers(ours=urls[:1], broken=urls[1:])
    sync = CollectiveSync(fake, resolve_transfer("collective", fake, urls, "cpu"), "cpu", timeout_s=3.0,
                          bucket_bytes=1024)
    torch.manual_seed(0)
    tensors = [(f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight", torch.randn(8, 16, dtype=dtype))
               for i in range(3) for ab, dtype in (("A", torch.float32), ("B", torch.bfloat16))]
    config = {"r": 8, "lora_alpha": 16, "target_modules": {"q_proj", "v_proj"}}
    built = TransferGroup.built
    try:
        failed = sync.send_adapter(urls, "policy-v1", config, tensors)
        assert list(failed) == [urls[1]] and "receiving the adapter failed" in failed[urls[1]]
        assert sync.send_adapter(urls[:1], "policy-v2", config, tensors[::-1]) == {}
        assert TransferGroup.built - built == 4  # one group per server, reused by the second version
        got_config, got = fake.adapters[urls[0]]["policy-v1"]
        assert got_config["target_modules"] == ["q_proj", "v_proj"]  # JSON, as an adapter folder's config
        assert list(got) == [n for n, _ in tensors]
        for name, tensor in tensors:  # every tensor in its own dtype, every bit
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        sync.forget_adapter(urls[:1], "policy-v1")
        assert list(fake.adapters[urls[0]]) == ["policy-v2"]
    finally:
        sync.close()
        for group in fake.groups.values():
            group.close()


def test_a_full_weight_load_waits_for_requests_in_flight_and_holds_new_ones():
    gate, events = RequestGate(), []
    first_in, release_first = threading.Event(), threading.Event()

    def request(name, hold=None):
        with gate.request():
            events.append(f"{name} start")
            if hold is not None:
                first_in.set()
                hold.wait(5)
            events.append(f"{name} end")

    def load():
        with gate.exclusive():
            events.append("load start")
            time.sleep(0.2)
            events.append("load end")

    t1 = threading.Thread(target=request, args=("r1", release_first))
    t1.start()
    first_in.wait(5)
    loader = threading.Thread(target=load)
    loader.start()
    time.sleep(0.1)
    t2 = threading.Thread(target=request, args=("r2",))  # arrives while the load waits: goes after it
    t2.start()
    time.sleep(0.1)
    assert events == ["r1 start"] and gate.in_flight == 1
    release_first.set()
    for t in (t1, loader, t2):
        t.join(5)
    assert events == ["r1 start", "r1 end", "load start", "load end", "r2 start", "r2 end"]
