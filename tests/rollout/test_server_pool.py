"""The vLLM server client's own logic without vLLM: requests spread over servers and reassembled, dead servers
dropped, adapter versions kept while requests use them, weight-sync timeouts. A fake transport, then a fake
OpenAI-style server (a few threads of http.server) in place of vLLM."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from grpo_ascend.errors import ConfigError, RolloutError
from grpo_ascend.rollout.protocol import PromptRollout
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm.server import VLLMServerRollout
from grpo_ascend.rollout.vllm.server_http import ServerGone
from grpo_ascend.rollout.vllm.server_pool import ServerPool, server_urls
from grpo_ascend.rollout.vllm.server_versions import Loaded, VersionLedger

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def test_server_urls_accepts_one_a_list_or_commas_and_names_a_bad_entry():
    assert server_urls("http://a:1/") == ["http://a:1"]
    assert server_urls("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    assert server_urls(["http://a:1", "https://b"]) == ["http://a:1", "https://b"]
    with pytest.raises(ConfigError, match="'a:1' is not an http"):
        server_urls(["a:1"])
    with pytest.raises(ConfigError, match="names no server"):
        server_urls([])
    with pytest.raises(ConfigError, match="twice"):
        server_urls([A, A + "/"])


def test_jobs_spread_by_group_and_come_back_in_order():
    pool = ServerPool([A, B, C], per_server=2)
    served = []

    def call(url, job):
        served.append((url, job))
        time.sleep(0.001 * (job % 3))  # answers arrive out of order
        return job * 10

    keys = [i // 4 for i in range(24)]  # six groups of four rows
    assert pool.map(call, list(range(24)), keys) == [j * 10 for j in range(24)]
    by_group = {}
    for url, job in served:
        by_group.setdefault(keys[job], set()).add(url)
    assert all(len(urls) == 1 for urls in by_group.values())  # a group stays on one server
    assert Counter(url for url, _ in served) == {A: 8, B: 8, C: 8}


def test_a_dead_server_is_dropped_once_and_its_jobs_go_to_the_others(caplog):
    pool = ServerPool([A, B, C])
    calls = Counter()

    def call(url, job):
        calls[url] += 1
        if url == B:
            raise ServerGone(f"the vLLM server at {url} stopped answering (refused)", "refused")
        return (url, job)

    with caplog.at_level(logging.WARNING):
        answers = pool.map(call, list(range(9)))
    assert [job for _, job in answers] == list(range(9)) and {url for url, _ in answers} == {A, C}
    assert pool.live == [A, C]
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1 and B in drops[0].getMessage() and "2 of 3 servers left" in drops[0].getMessage()
    assert pool.map(call, [0, 1]) == [(A, 0), (C, 1)] and calls[B] <= 3  # never asked again


def test_every_server_dead_is_one_clear_line():
    pool = ServerPool([A, B])

    def gone(url, job=None):
        raise ServerGone(f"the vLLM server at {url} stopped answering", "connection refused")

    with pytest.raises(ServerGone) as err:
        pool.map(gone, [1, 2, 3])
    message = str(err.value)
    assert isinstance(err.value, RolloutError) and "\n" not in message
    assert A in message and B in message and "resume" in message
    with pytest.raises(ServerGone):
        ServerPool([A]).broadcast(gone)


def test_ledger_keeps_versions_in_use_and_the_newest():
    ledger = VersionLedger(keep=2)
    assert ledger.lease(None) is None  # before any sync: the base model
    v = {i: Loaded(i, f"policy-v{i}", Path_(f"/x/{i}")) for i in range(5)}
    assert ledger.add(v[0]) == [] and ledger.add(v[1]) == []
    held = ledger.lease(0)  # a request pinned to version 0 (one_step_off)
    newest = ledger.lease(None)
    assert held == v[0] and newest == v[1]
    assert ledger.add(v[2]) == []  # 0 is past the two newest but in use
    assert ledger.versions == [0, 1, 2]
    assert ledger.release(held) == [v[0]]  # its last request ended: unload it now
    assert ledger.release(newest) == [] and ledger.add(v[3]) == [v[1]]
    with pytest.raises(RolloutError, match="policy version 0 is not on the vLLM servers"):
        ledger.lease(0)
    full = VersionLedger(keep=2)
    full.add(Loaded(7, "base"))
    assert full.add(Loaded(8, "base")) == [] and full.lease(7).version == 8  # weights replaced in place: the newest


def Path_(text):  # noqa: N802 - a Path, short
    from pathlib import Path

    return Path(text)


# ---------------------------------------------------------------- the client against fake servers


@dataclass
class FakeServer:
    """An OpenAI-style completions server: answers ``n`` choices of ``[version, prompt length]`` tokens, tracks
    the adapters loaded and the requests running on each, and records an unload of an adapter a request uses."""

    delay: float = 0.0
    load_delay: float = 0.0
    loaded: set = field(default_factory=set)
    running: Counter = field(default_factory=Counter)
    served: Counter = field(default_factory=Counter)
    violations: list = field(default_factory=list)
    loads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, port: int = 0):
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, value):
                raw = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):  # noqa: N802
                with state.lock:
                    models = [{"id": "base"}] + [{"id": name} for name in sorted(state.loaded)]
                self._answer({"/v1/models": {"data": models}, "/version": {"version": "fake"}}.get(self.path, {}))

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter":
                    time.sleep(state.load_delay)
                    with state.lock:
                        state.loaded.add(body["lora_name"])
                        state.loads += 1
                elif self.path == "/v1/unload_lora_adapter":
                    with state.lock:
                        if state.running[body["lora_name"]]:
                            state.violations.append(f"unloaded {body['lora_name']} under a request")
                        state.loaded.discard(body["lora_name"])
                elif self.path == "/v1/completions":
                    name = body["model"]
                    with state.lock:
                        if name != "base" and name not in state.loaded:
                            state.violations.append(f"asked for {name}, not loaded")
                        state.running[name] += 1
                        state.served[name] += 1
                    time.sleep(state.delay)
                    with state.lock:
                        state.running[name] -= 1
                    version = -1 if name == "base" else int(name.split("-v")[1])
                    ids = [version + 100, len(body["prompt"]), 1]
                    choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * 3}, "finish_reason": "stop"}
                    return self._answer({"choices": [dict(choice, index=i) for i in range(body["n"])]})
                self._answer({})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Tok:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


@dataclass
class Adapter:
    """What sync_weights reads of PolicyWeights, for a LoRA policy."""

    version: int
    adapter_only: bool = True

    def adapter_config(self):
        return {"r": 2, "target_modules": ["q_proj"], "peft_type": "LORA"}

    def named_tensors(self):
        yield "base_model.model.q_proj.lora_A.weight", torch.zeros(2, 4)

    def complete(self):
        """Nothing to gather: the policy is not sharded."""


def dead_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed on leaving: nothing listens


@pytest.fixture
def servers():
    made = [FakeServer(), FakeServer()]
    yield made, [s.start() for s in made]
    for s in made:
        s.stop()


def make_client(urls, tmp_path, **kw):
    params = SamplingParams(num_generations=2, max_completion_length=4, temperature=1.0)
    return VLLMServerRollout(urls, "base", Tok(), params, adapter_dir=tmp_path, start_timeout=kw.pop("start", 2),
                             retries=0, **kw)


def test_client_spreads_over_live_servers_and_drops_a_dead_one(servers, tmp_path, caplog):
    fakes, urls = servers
    dead = dead_url()
    with caplog.at_level(logging.WARNING):
        client = make_client([urls[0], dead, urls[1]], tmp_path, start=1)
    assert client.pool.live == urls and any(dead in r.getMessage() for r in caplog.records)
    client.sync_weights(Adapter(3))
    assert all(f.loaded == {"policy-v3"} for f in fakes)
    ids = [[5] * (i + 2) for i in range(6)]
    batch = client.generate_ids(ids)
    assert batch.completion_ids[:, 1].tolist() == [len(p) for p in ids for _ in range(2)]  # in prompt order
    assert batch.policy_versions.unique().tolist() == [3] and batch.completion_ids[0, 0] == 103
    assert fakes[0].served["policy-v3"] == fakes[1].served["policy-v3"] == 3
    fakes[1].stop()  # dies mid-run: its prompts go to the other
    batch = client.generate_ids(ids)
    assert batch.completion_ids[:, 1].tolist() == [len(p) for p in ids for _ in range(2)]
    assert client.pool.live == urls[:1]


def test_generate_while_sync_keeps_adapters_requests_use(servers, tmp_path):
    """A producer thread samples (each request 50 ms) while the trainer thread syncs 6 versions: every batch is
    tagged with one version, never older than the one before it, and no adapter is unloaded under a request."""
    fakes, urls = servers
    for f in fakes:
        f.delay = 0.05
    client = make_client(urls, tmp_path, keep_versions=1)
    client.sync_weights(Adapter(0))
    tags, stop = [], threading.Event()

    def produce():
        while not stop.is_set():
            batch = client.generate_ids([[5, 6], [7, 8, 9]])
            versions = batch.policy_versions.unique().tolist()
            assert len(versions) == 1 and batch.completion_ids[0, 0] == versions[0] + 100
            tags.append(versions[0])

    producer = threading.Thread(target=produce)
    producer.start()
    for v in range(1, 7):
        time.sleep(0.03)
        client.sync_weights(Adapter(v))
    time.sleep(0.15)
    stop.set()
    producer.join(10)
    assert tags == sorted(tags) and tags[-1] == 6 and len(set(tags)) >= 3
    assert all(not f.violations for f in fakes)
    assert all(f.loaded == {"policy-v6"} for f in fakes)  # the older ones unloaded once free
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v6"]
    client.close()  # unloads and deletes what it loaded; the next sync of the same version loads it again
    assert all(not f.loaded for f in fakes) and not list(tmp_path.iterdir())
    client.sync_weights(Adapter(6))
    assert all(f.loaded == {"policy-v6"} for f in fakes) and (tmp_path / "policy-v6").is_dir()


def test_pinned_version_and_a_sync_past_its_timeout(servers, tmp_path):
    fakes, urls = servers
    client = make_client(urls[:1], tmp_path, keep_versions=2, sync_timeout=0.5)
    for v in (4, 5):
        client.sync_weights(Adapter(v))
    with client.pinned(4):
        assert client.generate_ids([[5, 6]]).policy_versions.unique().tolist() == [4]
    assert client.generate_ids([[5, 6]]).policy_versions.unique().tolist() == [5]
    fakes[0].load_delay = 2.0
    started = time.monotonic()
    with pytest.raises(RolloutError, match="weight_sync_timeout=0.5 s") as err:
        client.sync_weights(Adapter(6))
    assert "\n" not in str(err.value) and time.monotonic() - started < 1.5


@dataclass
class LiveAdapter(Adapter):
    """An adapter whose tensor the trainer goes on changing after a push."""

    tensor: torch.Tensor = field(default_factory=lambda: torch.zeros(2, 4))

    def named_tensors(self):
        yield "base_model.model.q_proj.lora_A.weight", self.tensor


def test_a_published_version_loads_while_the_trainer_goes_on_and_serves_the_next_request(servers, tmp_path):
    """publish_weights (rollouts ahead of training) returns before the servers load the adapter; the copy it
    took is what they load, whatever the trainer does meanwhile; the next request samples with it."""
    from safetensors.torch import load_file

    from grpo_ascend.rollout.vllm.weights import ADAPTER_WEIGHTS

    fakes, urls = servers
    client = make_client(urls, tmp_path)
    client.sync_weights(Adapter(1))
    for fake in fakes:
        fake.load_delay = 0.4
    live = torch.full((2, 4), 7.0)
    started = time.monotonic()
    client.publish_weights(LiveAdapter(2, tensor=live))
    assert time.monotonic() - started < 0.2 and all(f.loaded == {"policy-v1"} for f in fakes)
    live.add_(1.0)  # the trainer's next optimizer step
    batch = client.generate_ids([[5, 6]])
    assert batch.policy_versions.unique().tolist() == [2]
    assert time.monotonic() - started >= 0.4  # the request waited for the load, and says how long
    assert 0.2 <= batch.timing["weight_wait_s"] <= batch.timing["total_s"]
    assert client.generate_ids([[5, 6]]).timing["weight_wait_s"] < 0.1  # nothing loading: no wait
    assert all(f.loaded == {"policy-v2"} for f in fakes) and all(not f.violations for f in fakes)
    saved = load_file(str(tmp_path / "policy-v2" / ADAPTER_WEIGHTS))
    assert torch.equal(saved["base_model.model.q_proj.lora_A.weight"], torch.full((2, 4), 7.0))


def test_a_published_load_past_its_timeout_stops_the_next_request_in_one_line(servers, tmp_path):
    fakes, urls = servers
    client = make_client(urls[:1], tmp_path, sync_timeout=0.5)
    fakes[0].load_delay = 2.0
    started = time.monotonic()
    client.publish_weights(Adapter(3))
    assert time.monotonic() - started < 0.2
    with pytest.raises(RolloutError, match="policy version 3 .* weight_sync_timeout=0.5 s") as err:
        client.generate_ids([[5, 6]])
    assert "\n" not in str(err.value) and time.monotonic() - started < 1.5
    with pytest.raises(RolloutError, match="weight_sync_timeout=0.5 s"):  # and the next push: the run stops
        client.publish_weights(Adapter(4))


def test_a_multi_turn_session_tags_each_turn_with_the_version_that_sampled_it(servers, tmp_path):
    """A tool loop's session on the servers: each turn's tokens carry the adapter version its request used, an
    appended tool response its turn's, so a batch's staleness counts its oldest turn."""
    _, urls = servers
    params = SamplingParams(num_generations=2, max_completion_length=12, temperature=1.0)
    client = VLLMServerRollout(urls, "base", Tok(), params, adapter_dir=tmp_path, start_timeout=2, retries=0)
    client.sync_weights(Adapter(1))
    with client.start_session([[5, 6]]) as session:
        assert [e.row for e in session.advance()] == [0, 1]
        session.append(0, [42])
        client.sync_weights(Adapter(2))
        assert [e.row for e in session.advance()] == [0]
        out = session.output()
    assert out.completion_ids[0, :7].tolist() == [101, 2, 1, 42, 102, 6, 1]  # [version + 100, context length, 1]
    assert out.policy_versions[0, :7].tolist() == [1, 1, 1, 1, 2, 2, 2]
    assert out.policy_versions[1, :3].tolist() == [1, 1, 1] and out.policy_versions.min() == 1
    client.close()


def test_a_restarted_server_is_taken_back_at_the_next_sync_with_the_versions_in_use(servers, tmp_path):
    """A server that died is dropped; restarted (nothing loaded), it is taken back at the next weight sync, after
    the adapter version requests may still name is loaded on it, and requests reach it again."""
    fakes, urls = servers
    client = make_client(urls, tmp_path, keep_versions=1)
    client.sync_weights(Adapter(1))
    ids = [[5] * (i + 2) for i in range(4)]
    fakes[1].stop()
    client.generate_ids(ids)
    assert client.pool.live == urls[:1] and client.pool.dropped == urls[1:]
    port = int(urls[1].rsplit(":", 1)[1])
    fakes[1] = FakeServer()
    fakes[1].start(port)  # restarted: empty
    client.sync_weights(Adapter(2))
    assert client.pool.live == urls and fakes[1].loaded == {"policy-v2"}  # v1 loaded first, then retired
    client.generate_ids(ids)
    assert fakes[1].served["policy-v2"] == 2 and not fakes[1].violations
    client.close()


def test_training_ranks_after_the_first_wait_for_its_load_and_load_nothing(servers, tmp_path):
    """Two training ranks share the servers: rank 1's sync returns only once rank 0 loaded the version on every
    server, loads and unloads nothing itself, and samples with that version; alone it stops within its timeout."""
    fakes, urls = servers
    for f in fakes:
        f.load_delay = 0.3
    first, second = make_client(urls, tmp_path / "r0"), make_client(urls, tmp_path / "r1")
    first.set_training_rank(0)
    second.set_training_rank(1)
    for version in (1, 2):
        waited: dict[str, float] = {}
        follower = threading.Thread(target=_timed, args=(waited, second.sync_weights, Adapter(version)))
        follower.start()
        time.sleep(0.1)  # rank 1 waits before rank 0 has even begun
        first.sync_weights(Adapter(version))
        follower.join(5)
        assert waited["s"] >= 0.3 and all(f.loaded == {f"policy-v{version}"} for f in fakes)  # v1 unloaded by rank 0
        batch = second.generate_ids([[5, 5], [5, 5, 5]])
        assert batch.policy_versions.unique().tolist() == [version] and not any(f.violations for f in fakes)
    assert [f.loads for f in fakes] == [2, 2]  # one load per version per server: rank 0's
    assert not (tmp_path / "r1").exists()  # rank 1 wrote no adapter
    alone = make_client(urls, tmp_path / "r2", sync_timeout=0.5)
    alone.set_training_rank(1)
    with pytest.raises(RolloutError, match="weight_sync_timeout=0.5 s") as err:
        alone.sync_weights(Adapter(9))
    assert "\n" not in str(err.value)


def _timed(into: dict, call, *args) -> None:
    started = time.perf_counter()
    call(*args)
    into["s"] = time.perf_counter() - started


def test_a_server_backend_refuses_a_vision_language_run_when_it_is_made(servers, tmp_path):
    """Prompts with images need a backend that feeds them to the model: the server client says so at once."""
    client = make_client(servers[1], tmp_path)
    with pytest.raises(ConfigError, match="VLLMServerRollout rollout backend does not take prompts with images yet"):
        PromptRollout(client, processor=object())
    client.close()
