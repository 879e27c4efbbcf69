"""push_to_hub: a clear error offline or without a token, and what would be uploaded where (Hub API faked)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import SMALL_RUN, index_in_group

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.checkpoints import hub
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.models.policy import default_lora_config


class FakeHub:
    """Records create_repo / upload_folder calls and the files each upload would send (the real filter)."""

    def __init__(self):
        self.repos, self.uploads = [], []

    def create_repo(self, repo_id, token=None, private=None, exist_ok=False):
        self.repos.append({"repo_id": repo_id, "token": token, "private": private, "exist_ok": exist_ok})
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"alice/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, commit_message=None, token=None,
                      revision=None, ignore_patterns=None, run_as_future=False):
        from huggingface_hub.utils import filter_repo_objects

        root = Path(folder_path)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        sent = sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))
        contents = {f: (root / f).read_bytes() for f in sent if f.endswith((".json", ".md", ".safetensors"))}
        self.uploads.append({"repo_id": repo_id, "path_in_repo": path_in_repo, "message": commit_message,
                             "token": token, "revision": revision, "files": sent, "contents": contents,
                             "future": run_as_future})
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")


def _config(tmp_path, **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), **kw})


def _trainer(tmp_path, tiny_model_dir, **kw):
    # The index reward differs within every group whatever was sampled, so a step moves the adapter.
    cfg = _config(tmp_path, **kw)
    return GRPOTrainer(str(tiny_model_dir), index_in_group(cfg.num_generations), cfg, arithmetic_dataset(8),
                       peft_config=default_lora_config(r=4))


def test_offline_push_fails_before_training_saying_what_to_do(tmp_path, tiny_model_dir, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.HubError) as info:
        _trainer(tmp_path, tiny_model_dir, push_to_hub=True, hub_model_id="alice/tiny-grpo")
    text = str(info.value)
    assert "could not create the Hub repo 'alice/tiny-grpo'" in text and "HF_HUB_OFFLINE is set" in text
    assert "push_to_hub=False" in text and "hf upload REPO OUTPUT_DIR" in text


def test_push_without_a_token_says_how_to_log_in(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    monkeypatch.setattr(hub, "hf_api", lambda: pytest.fail("no request may be sent without a token"))
    with pytest.raises(hub.HubError, match=r"no Hub token.*hf auth login.*HF_TOKEN.*hub_token="):
        hub.create_repo("tiny-grpo", token=None, private=None)
    # a token the Hub rejects (401) gets the same advice
    def rejected():
        class Api:
            def create_repo(self, *a, **k):
                raise RuntimeError("401 Client Error: Unauthorized for url: https://huggingface.co/api/repos/create")
        return Api()
    monkeypatch.setattr(hub, "hf_api", rejected)
    with pytest.raises(hub.HubError, match=r"401 Client Error.*hf auth login"):
        hub.create_repo("tiny-grpo", token="hf_bad", private=None)


def test_push_uploads_the_saved_model_to_the_repo(tmp_path, tiny_model_dir, monkeypatch):
    """Repo created at start; each checkpoint pushes the model and (hub_strategy='checkpoint') the checkpoint
    as last-checkpoint/; push_to_hub uploads output_dir without checkpoint-* plus a model card; the uploaded
    adapter is the trained one."""
    from huggingface_hub import constants
    from safetensors.torch import load

    from grpo_ascend.checkpoints.adapters import adapter_state_dict

    fake = FakeHub()
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the fake Hub is reachable
    trainer = _trainer(tmp_path, tiny_model_dir, push_to_hub=True, hub_model_id="alice/tiny-grpo",
                       hub_token="hf_tok", hub_strategy="checkpoint", hub_private_repo=True, max_steps=2, save_steps=1)
    assert fake.repos == [{"repo_id": "alice/tiny-grpo", "token": "hf_tok", "private": True, "exist_ok": True}]
    assert trainer.hub_model_id == "alice/tiny-grpo"
    trainer.train()
    messages = [(u["message"], u["path_in_repo"]) for u in fake.uploads]
    assert messages == [("Training in progress, step 1", None), ("Training in progress, step 1, checkpoint",
                         "last-checkpoint"), ("Training in progress, step 2", None),
                        ("Training in progress, step 2, checkpoint", "last-checkpoint")]
    model_push, checkpoint_push = fake.uploads[2], fake.uploads[3]
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "metrics.jsonl"} <= set(
        model_push["files"])
    assert not any(f.startswith("checkpoint-") for f in model_push["files"])
    assert checkpoint_push["files"] == sorted(str(p.relative_to(tmp_path / "run" / "checkpoint-2"))
                                              for p in (tmp_path / "run" / "checkpoint-2").rglob("*") if p.is_file())
    assert all(u["token"] == "hf_tok" and u["repo_id"] == "alice/tiny-grpo" for u in fake.uploads)

    fake.uploads.clear()
    (tmp_path / "run" / "best").symlink_to("checkpoint-2")  # as evaluation leaves it: a link, not uploaded twice
    info = trainer.push_to_hub(dataset_name="local/arithmetic", tags="rl")
    assert info.commit_url.startswith("https://huggingface.co/alice/tiny-grpo")
    [final] = fake.uploads
    assert final["message"] == "End of training" and final["path_in_repo"] is None and not final["future"]
    assert not any(f.startswith(("best/", "checkpoint-")) for f in final["files"]) and "README.md" in final["files"]
    card = final["contents"]["README.md"].decode()
    assert "library_name: peft" in card and "- local/arithmetic" in card and "- rl" in card
    sent = load(final["contents"]["adapter_model.safetensors"])
    trained = adapter_state_dict(trainer.model, "default")
    assert sent.keys() == trained.keys() and len(sent) > 0
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, trained[name].detach().cpu(), rtol=0, atol=0)
    assert any(t.abs().max() > 0 for k, t in sent.items() if "lora_B" in k)  # trained, not the zero init
    assert json.loads(final["contents"]["adapter_config.json"])["r"] == 4

    fake.uploads.clear()
    trainer.save_model(tmp_path / "elsewhere")  # with push_to_hub, save_model pushes output_dir (transformers)
    assert [u["message"] for u in fake.uploads] == ["Model save"]
