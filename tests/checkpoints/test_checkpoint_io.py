"""The shared I/O of checkpoints and export (atomic folder, manifest) and the public adapter helpers."""

from __future__ import annotations

import os

import pytest
import torch

from grpo_ascend.checkpoints import files as io
from grpo_ascend.checkpoints.adapters import (
    adapter_names,
    adapter_state_dict,
    load_adapter_state_dict,
    non_adapter_trainable,
)
from grpo_ascend.errors import CheckpointError
from grpo_ascend.models.wrappers import is_peft, unwrap_model


def _write(folder, files):
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


def _read(folder):
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# atomic folder
# --------------------------------------------------------------------------------------------


def test_atomic_folder_replaces_the_old_folder_whole(tmp_path):
    target = tmp_path / "out"
    _write(target, {"old.txt": "old", "sub/a.txt": "1"})
    with io.AtomicFolder(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-out-")
        assert not (tmp / "old.txt").exists()  # the body starts from an empty folder
        _write(tmp, {"new.txt": "new", "sub/b.txt": "2"})
        assert _read(target) == {"old.txt": "old", "sub/a.txt": "1"}  # untouched until the body ends
    assert _read(target) == {"new.txt": "new", "sub/b.txt": "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or trash folder left


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_atomic_folder_leaves_the_previous_folder_intact_when_the_body_raises(tmp_path, error):
    target = tmp_path / "out"
    _write(target, {"keep.txt": "previous"})
    with pytest.raises(type(error)):
        with io.AtomicFolder(target) as tmp:
            _write(tmp, {"half.txt": "partial"})
            raise error
    assert _read(target) == {"keep.txt": "previous"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_folder_puts_the_old_folder_back_when_the_swap_fails(tmp_path, monkeypatch):
    target = tmp_path / "out"
    _write(target, {"keep.txt": "previous"})
    real_replace = os.replace
    calls = []

    def failing_replace(src, dst):
        calls.append((os.fspath(src), os.fspath(dst)))
        if len(calls) == 2:  # the rename of the new folder into place
            raise OSError("simulated rename failure")
        real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        with io.AtomicFolder(target) as tmp:
            _write(tmp, {"new.txt": "new"})
    monkeypatch.setattr(io.os, "replace", real_replace)
    assert os.path.basename(calls[0][1]).startswith(".trash-out-")
    assert _read(target) == {"keep.txt": "previous"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_crash_between_the_two_renames_is_repaired(tmp_path):
    # the old folder was moved aside and the process died before the new one arrived
    _write(tmp_path / ".trash-out-123-456", {"keep.txt": "previous"})
    _write(tmp_path / ".trash-other-1-2", {"x": "other"})
    _write(tmp_path / ".trash-done-1-2", {"x": "stale"})
    _write(tmp_path / "done", {"x": "current"})
    assert io.restore_interrupted_swaps(tmp_path, "out") == [tmp_path / "out"]
    assert _read(tmp_path / "out") == {"keep.txt": "previous"}
    assert (tmp_path / ".trash-other-1-2").exists()  # another folder's: left to its owner
    assert io.restore_interrupted_swaps(tmp_path) == [tmp_path / "other"]
    assert _read(tmp_path / "done") == {"x": "current"}  # a newer folder exists: the trash stays trash
    # an AtomicFolder run repairs its own target first, then replaces it as usual
    _write(tmp_path / ".trash-res-9-9", {"v": "1"})
    with io.AtomicFolder(tmp_path / "res") as tmp:
        assert _read(tmp_path / "res") == {"v": "1"}
        _write(tmp, {"v": "2"})
    assert _read(tmp_path / "res") == {"v": "2"}


def test_atomic_folder_finishes_a_staging_folder_and_refuses_a_foreign_one(tmp_path):
    target = tmp_path / "checkpoint-3"
    staging = io.make_staging_dir(target)
    _write(staging, {"shards/rank0.pt": "r0"})  # written by another rank before the main one finishes
    with io.AtomicFolder(target, staging=staging) as tmp:
        assert tmp == staging
        _write(tmp, {"weights": "w"})
    assert _read(target) == {"shards/rank0.pt": "r0", "weights": "w"} and not staging.exists()
    with pytest.raises(CheckpointError, match="not made by make_staging_dir for"):
        io.AtomicFolder(tmp_path / "checkpoint-4", staging=io.make_staging_dir(tmp_path / "checkpoint-5"))


# --------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------


def test_manifest_lists_every_file_and_detects_a_changed_byte(tmp_path):
    _write(tmp_path, {"a.bin": "abcdef", "sub/b.json": "{}"})
    manifest = io.write_manifest(tmp_path, {"format": "x", "step": 4})
    assert manifest["step"] == 4 and sorted(manifest["files"]) == ["a.bin", "sub/b.json"]
    assert manifest["files"]["a.bin"] == {"size": 6, "sha256": io.sha256_file(tmp_path / "a.bin")}
    assert io.read_json(tmp_path / io.MANIFEST_NAME) == manifest
    io.check_manifest_files(tmp_path, manifest["files"])
    (tmp_path / "a.bin").write_text("abcdeX")  # same size, one byte differs
    io.check_manifest_files(tmp_path, manifest["files"], verify_hashes=False)  # sizes alone cannot tell
    with pytest.raises(CheckpointError, match=r"a\.bin' is damaged: its sha256 does not match manifest\.json"):
        io.check_manifest_files(tmp_path, manifest["files"])
    (tmp_path / "a.bin").write_text("abc")
    with pytest.raises(CheckpointError, match=r"a\.bin' is truncated or altered: 3 bytes, expected 6"):
        io.check_manifest_files(tmp_path, manifest["files"], verify_hashes=False)
    (tmp_path / "sub" / "b.json").unlink()
    with pytest.raises(CheckpointError, match=r"b\.json' is missing \(listed in manifest\.json\)"):
        io.check_manifest_files(tmp_path, {"sub/b.json": manifest["files"]["sub/b.json"]})


def test_readers_name_the_bad_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"bad\.json' is not valid JSON"):
        io.read_json(tmp_path / "bad.json")
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        io.write_json(tmp_path / "x.json", {"t": torch.ones(1)}, "trainer_state")
    io.save_tensors(tmp_path / "t.safetensors", {"w": torch.arange(4.0).view(2, 2).t()})  # non-contiguous view
    assert torch.equal(io.load_tensors(tmp_path / "t.safetensors")["w"], torch.tensor([[0.0, 2.0], [1.0, 3.0]]))
    (tmp_path / "t.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"t\.safetensors' is not a readable safetensors file"):
        io.load_tensors(tmp_path / "t.safetensors")
    io.torch_save({"step": 3, "x": torch.ones(2)}, tmp_path / "s.pt")
    assert io.torch_load(tmp_path / "s.pt")["step"] == 3
    torch.save({"obj": object()}, tmp_path / "unsafe.pt")  # needs arbitrary unpickling: refused
    with pytest.raises(CheckpointError, match=r"unsafe\.pt' cannot be read with torch\.load\(weights_only=True\)"):
        io.torch_load(tmp_path / "unsafe.pt")


# --------------------------------------------------------------------------------------------
# adapters
# --------------------------------------------------------------------------------------------


def _lora(tiny_model_dir):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from grpo_ascend.models.policy import apply_peft

    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    return apply_peft(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)


def test_is_peft_means_a_peft_model_and_nothing_that_looks_like_one(tiny_model_dir):
    model = _lora(tiny_model_dir)
    assert is_peft(model)
    assert not is_peft(model.get_base_model())
    assert not is_peft(torch.nn.ModuleDict({"policy": model}))  # a container is saved as plain parameters

    class LooksLikePeft(torch.nn.Module):  # has the attributes, but no peft_config / PEFT state dict
        def disable_adapter(self):
            return None

        def get_base_model(self):
            return self

    assert not is_peft(LooksLikePeft())
    assert is_peft(unwrap_model(torch.nn.DataParallel(model)))


def test_adapter_helpers_round_trip_and_separate_the_value_head(tiny_model_dir):
    from peft import LoraConfig

    model = _lora(tiny_model_dir)
    model.add_adapter("critic", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    model.add_module("value_head", torch.nn.Linear(3, 1))
    model.set_adapter("critic")
    assert adapter_names(model) == ["default", "critic"]  # PEFT's top-level adapter first, whatever is active
    state = adapter_state_dict(model, "default")
    assert state and all("lora_" in name and ".default." not in name for name in state)  # PEFT's saved names
    changed = {name: torch.full_like(t, 0.5) for name, t in state.items()}
    assert load_adapter_state_dict(model, changed, "default") == []
    assert all(torch.equal(t, changed[n]) for n, t in adapter_state_dict(model, "default").items())
    assert all(not torch.equal(t, changed[n]) for n, t in adapter_state_dict(model, "critic").items())
    assert sorted(non_adapter_trainable(model)) == ["value_head.bias", "value_head.weight"]
