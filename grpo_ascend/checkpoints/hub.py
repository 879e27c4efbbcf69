"""Pushing a run to the Hugging Face Hub (``push_to_hub``, ``hub_model_id``, ``hub_strategy``), through
``huggingface_hub``'s ``HfApi``, with transformers' meanings: the repo is created when the trainer is
built, ``output_dir`` is uploaded without its ``checkpoint-*`` folders and ``_*`` files, and per
``hub_strategy`` checkpoints go up as ``last-checkpoint/`` or ``checkpoint-N/``.

Every failure (offline mode, no token, no network, no write access) becomes a :class:`HubError` that
says what went wrong and how to fix it, or how to upload the saved folder later.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_ascend.errors import GrpoAscendError

#: What an upload of output_dir leaves out (as transformers: checkpoints go up only per hub_strategy);
#: ``best`` is a link to the best checkpoint (docs/evaluation.md).
IGNORE_PATTERNS = ["_*", "checkpoint-*", "best/*", ".save_model-tmp*"]


class HubError(GrpoAscendError, RuntimeError):
    """The Hub could not be reached or refused the request."""


def hf_api() -> Any:
    """``huggingface_hub.HfApi()`` (a function so tests can replace it)."""
    from huggingface_hub import HfApi

    return HfApi()


def _explain(action: str, repo: str, exc: Exception | str) -> HubError:
    """One error that names the failure and the fix (``exc``: the client's exception, or our own reason)."""
    from huggingface_hub import constants

    if isinstance(exc, Exception):
        name = type(exc).__name__
        reason = f"{str(exc).splitlines()[0] if str(exc) else name} ({name})"
    else:
        name, reason = "", exc
    if constants.HF_HUB_OFFLINE or name == "OfflineModeIsEnabled":
        fix = ("HF_HUB_OFFLINE is set, so nothing can be uploaded: unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) "
               "on a machine with network access")
    elif name == "LocalTokenNotFoundError" or "401" in reason or "token" in reason.lower():
        fix = "log in with `hf auth login`, set HF_TOKEN, or pass hub_token= (a token with write access)"
    elif "403" in reason:
        fix = "the token has no write access to that repo: use a write token, or a hub_model_id under your own account"
    else:
        fix = "check the network connection to the Hub (HF_ENDPOINT) and the repo name"
    return HubError(f"push_to_hub: could not {action} {repo!r}: {reason}. To fix: {fix}; or set push_to_hub=False "
                    "and upload the saved folder later with `hf upload REPO OUTPUT_DIR`")


def repo_name(hub_model_id: str | None, output_dir: str | os.PathLike) -> str:
    """The repo to create: ``hub_model_id``, else the output folder's name (as transformers)."""
    return hub_model_id if hub_model_id else Path(output_dir).absolute().name


def _check_reachable(action: str, repo: str, token: str | None) -> None:
    """Offline mode and a missing token are known before any request: say so at once (no network wait)."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise _explain(action, repo, "offline mode is enabled")
    if token is None and get_token() is None:
        raise _explain(action, repo, "no Hub token: not logged in and HF_TOKEN is not set")


def create_repo(name: str, token: str | None, private: bool | None) -> str:
    """Create the model repo (or find it) and return its full id ``user/name``."""
    _check_reachable("create the Hub repo", name, token)
    try:
        return hf_api().create_repo(name, token=token, private=private, exist_ok=True).repo_id
    except Exception as exc:  # every failure of the Hub client becomes one clear error
        raise _explain("create the Hub repo", name, exc) from exc


def upload(repo_id: str, folder: str | os.PathLike, commit_message: str, token: str | None,
           revision: str | None, path_in_repo: str | None = None, ignore: list[str] | None = None,
           blocking: bool = True) -> Any:
    """Upload ``folder`` into ``repo_id`` (under ``path_in_repo``); a CommitInfo, or a Future when not blocking."""
    _check_reachable("upload to", repo_id, token)
    try:
        return hf_api().upload_folder(repo_id=repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                      commit_message=commit_message, token=token, revision=revision,
                                      ignore_patterns=ignore, run_as_future=not blocking)
    except Exception as exc:  # every failure of the Hub client becomes one clear error
        raise _explain("upload to", repo_id, exc) from exc


def write_model_card(folder: Path, base_model: str, is_adapter: bool, model_name: str,
                     dataset_name: str | None = None, tags: list[str] | str | None = None) -> Path:
    """A short README.md model card (YAML front matter the Hub reads, then how the model was trained)."""
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    all_tags = ["grpo-ascend", "grpo", *[t for t in tags if t not in ("grpo-ascend", "grpo")]]
    lines = ["---"]
    if base_model and not Path(base_model).exists():  # a hub id; a local path means nothing on the Hub
        lines.append(f"base_model: {base_model}")
    if dataset_name:
        lines.append(f"datasets:\n- {dataset_name}")
    if is_adapter:
        lines.append("library_name: peft")
    lines += ["tags:", *[f"- {t}" for t in all_tags], "---", "", f"# {model_name}", ""]
    what = "a LoRA adapter (load it with peft's PeftModel.from_pretrained)" if is_adapter else "a full model"
    lines.append(f"Trained with GRPO by grpo-ascend: {what}" + (f", on {dataset_name}." if dataset_name else "."))
    path = folder / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
