"""Checkpoints: layout, exact resume, atomic save under SIGKILL, and a clear error for each bad case."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from grpo_ascend.checkpoints import checkpoint as ckpt
from grpo_ascend.checkpoints import files as checkpoint_io
from grpo_ascend.checkpoints import run_folders
from grpo_ascend.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _lora(model_dir, r=4, alpha=8, dropout=0.1, seed=0, targets="all-linear"):
    from peft import LoraConfig

    from grpo_ascend.models.policy import apply_peft

    torch.manual_seed(seed)  # LoRA B starts at zero; A's init depends on this seed
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    return apply_peft(_base(model_dir), config)


def _trainer_objects(model):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return optimizer, scheduler


def _train(model, optimizer, scheduler, steps):
    """Steps on random data drawn from every RNG, with dropout on: resume must restore them all."""
    model.train()
    for _ in range(steps):
        length = 6 + random.randint(0, 3) + int(np.random.randint(0, 2))
        ids = torch.randint(3, 500, (2, length))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _draws():
    return torch.rand(4), random.random(), float(np.random.rand())


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture()
def lora_checkpoint(tmp_path, tiny_model_dir):
    """A LoRA model trained 2 steps and its checkpoint-2 (with tokenizer and config)."""
    from transformers import AutoTokenizer

    torch.manual_seed(1)
    model = _lora(tiny_model_dir)
    optimizer, scheduler = _trainer_objects(model)
    _train(model, optimizer, scheduler, 2)
    contents = ckpt.CheckpointContents(
        model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={"epoch": 0.5, "data_position": 7},
        config={"learning_rate": 0.01}, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    path = ckpt.save_checkpoint(tmp_path / "run", 2, contents)
    return path, model, optimizer, scheduler


# --------------------------------------------------------------------------------------------
# exact resume
# --------------------------------------------------------------------------------------------


def test_lora_resume_is_bitwise_exact(tmp_path, tiny_model_dir):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = _lora(tiny_model_dir, seed=0)
    optimizer, scheduler = _trainer_objects(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _train(model, optimizer, scheduler, 3)
    generator = torch.Generator().manual_seed(123)
    generator.manual_seed(5)
    contents = ckpt.CheckpointContents(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        trainer_state={"data_position": 6}, extra_tensors={"sampling_generator": generator.get_state()},
    )
    path = ckpt.save_checkpoint(tmp_path, 3, contents)
    draws_after_save = _draws()
    gen_after_save = torch.rand(3, generator=generator)
    _train(model, optimizer, scheduler, 3)
    expected = _trainable(model)

    torch.manual_seed(999)  # a different LoRA init and different RNG streams: all must be overwritten
    random.seed(999)
    np.random.seed(999)
    fresh = _lora(tiny_model_dir, seed=42)
    optimizer2, scheduler2 = _trainer_objects(fresh)
    scaler2 = torch.amp.GradScaler("cpu")
    loaded = ckpt.load_checkpoint(path, model=fresh, optimizer=optimizer2, scheduler=scheduler2, scaler=scaler2)
    assert loaded.step == 3 and loaded.trainer_state["data_position"] == 6 and loaded.config is None
    assert loaded.path == path
    generator2 = torch.Generator()
    generator2.set_state(loaded.extra_tensors["sampling_generator"])
    assert scaler2.get_scale() == 1024.0
    assert scheduler2.last_epoch == 3
    draws_after_load = _draws()
    assert torch.equal(draws_after_save[0], draws_after_load[0])
    assert draws_after_save[1:] == draws_after_load[1:]
    assert torch.equal(gen_after_save, torch.rand(3, generator=generator2))
    _train(fresh, optimizer2, scheduler2, 3)
    _assert_same(expected, _trainable(fresh))
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()


def test_full_finetune_saves_tied_weights_once_and_resumes_exactly(tmp_path, tiny_model_dir):
    torch.manual_seed(0)
    model = _base(tiny_model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizer, scheduler = _trainer_objects(model)
    _train(model, optimizer, scheduler, 2)
    contents = ckpt.CheckpointContents(model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={})
    path = ckpt.save_checkpoint(tmp_path, 2, contents)
    saved = load_file(str(path / ckpt.FULL_WEIGHTS_NAME))
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    assert set(saved) == {n for n, _ in model.named_parameters()}
    assert not (path / ckpt.ADAPTER_CONFIG_NAME).exists()
    _train(model, optimizer, scheduler, 2)
    expected = _trainable(model)

    torch.manual_seed(0)
    fresh = _base(tiny_model_dir)
    optimizer2, scheduler2 = _trainer_objects(fresh)
    ckpt.load_checkpoint(path, model=fresh, optimizer=optimizer2, scheduler=scheduler2)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    _train(fresh, optimizer2, scheduler2, 2)
    _assert_same(expected, _trainable(fresh))


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------


# Loading with plain PEFT, as a user would: peft itself reads transformers' deprecated property.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_layout_manifest_and_peft_loadable(lora_checkpoint, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoTokenizer

    path, model, _, _ = lora_checkpoint
    assert path.name == "checkpoint-2" and path.parent.name == "run"
    names = {p.name for p in path.iterdir()}
    for required in (ckpt.ADAPTER_CONFIG_NAME, ckpt.ADAPTER_WEIGHTS_NAME, ckpt.OPTIMIZER_NAME, ckpt.SCHEDULER_NAME,
                     ckpt.RNG_NAME, ckpt.TRAINER_STATE_NAME, ckpt.TRAINER_CONFIG_NAME, ckpt.MANIFEST_NAME,
                     "tokenizer.json", "tokenizer_config.json"):
        assert required in names, required
    assert "config.json" not in names  # HF's name for a model config: the trainer config lives elsewhere
    manifest = json.loads((path / ckpt.MANIFEST_NAME).read_text())
    assert manifest["kind"] == "lora" and manifest["step"] == 2 and manifest["adapters"] == {"default": ""}
    assert manifest["base_model_name_or_path"] == str(tiny_model_dir)
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {ckpt.MANIFEST_NAME}
    for rel, info in manifest["files"].items():
        assert (path / rel).stat().st_size == info["size"] and len(info["sha256"]) == 64
    adapter = load_file(str(path / ckpt.ADAPTER_WEIGHTS_NAME))
    assert adapter and all("lora_" in key for key in adapter)  # no frozen base weights
    for name in (ckpt.OPTIMIZER_NAME, ckpt.SCHEDULER_NAME, ckpt.RNG_NAME):
        torch.load(path / name, weights_only=True)
    assert json.loads((path / ckpt.TRAINER_STATE_NAME).read_text()) == {"epoch": 0.5, "data_position": 7, "step": 2}
    assert json.loads((path / ckpt.TRAINER_CONFIG_NAME).read_text()) == {"learning_rate": 0.01}
    # the checkpoint folder itself is a PEFT adapter folder, and holds a loadable tokenizer
    peft_model = PeftModel.from_pretrained(_base(tiny_model_dir), path)
    ids = torch.randint(3, 500, (2, 7))
    model.eval()
    assert torch.equal(peft_model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    assert not list(path.parent.glob(".tmp-*"))


def test_second_adapter_and_value_head_round_trip(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    model = _lora(tiny_model_dir, dropout=0.0)
    model.add_adapter("critic", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    head = torch.nn.Linear(192, 1)
    model.base_model.model.v_head = head
    for name, p in model.named_parameters():  # add_adapter freezes the new adapter; train them all
        if ".critic." in name or "v_head" in name:
            p.requires_grad_(True)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    path = ckpt.save_checkpoint(tmp_path, 1, ckpt.CheckpointContents(model=model, trainer_state={}))
    manifest = json.loads((path / ckpt.MANIFEST_NAME).read_text())
    assert manifest["adapters"] == {"default": "", "critic": "critic"}
    assert (path / "critic" / ckpt.ADAPTER_WEIGHTS_NAME).is_file()
    assert set(load_file(str(path / ckpt.EXTRA_TRAINABLE_NAME))) == {"base_model.model.v_head.weight", "base_model.model.v_head.bias"}

    fresh = _lora(tiny_model_dir, dropout=0.0, seed=3)
    fresh.add_adapter("critic", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    fresh.base_model.model.v_head = torch.nn.Linear(192, 1)
    for name, p in fresh.named_parameters():
        if ".critic." in name or "v_head" in name:
            p.requires_grad_(True)
    ckpt.load_checkpoint(path, model=fresh, restore_rng=False)
    _assert_same(_trainable(model), _trainable(fresh))


# --------------------------------------------------------------------------------------------
# finding, resolving, pruning
# --------------------------------------------------------------------------------------------


def test_latest_resolve_and_save_total_limit(tmp_path, tiny_model_dir):
    model = _lora(tiny_model_dir)
    assert ckpt.find_latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint-N"):
        ckpt.resolve_checkpoint("latest", tmp_path)
    assert ckpt.resolve_checkpoint(None, tmp_path) is None
    for step in (5, 10, 15):
        ckpt.save_checkpoint(tmp_path, step, ckpt.CheckpointContents(model=model, trainer_state={}), save_total_limit=2)
    assert [p.name for p in run_folders.list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-15"]
    # leftovers of a crashed save and a half-written final folder are not "latest"
    (tmp_path / ".tmp-checkpoint-20-abc").mkdir()
    (tmp_path / "checkpoint-25").mkdir()
    (tmp_path / "checkpoint-25" / "adapter_model.safetensors").write_bytes(b"x")
    assert ckpt.find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-15"
    assert ckpt.resolve_checkpoint("latest", tmp_path) == tmp_path / "checkpoint-15"
    assert ckpt.resolve_checkpoint(True, tmp_path) == tmp_path / "checkpoint-15"
    assert ckpt.resolve_checkpoint(str(tmp_path / "checkpoint-10"), tmp_path) == tmp_path / "checkpoint-10"
    assert ckpt.resolve_checkpoint("checkpoint-10", tmp_path) == tmp_path / "checkpoint-10"
    with pytest.raises(CheckpointError, match=r"checkpoint-25.*manifest.json is missing"):
        ckpt.resolve_checkpoint(tmp_path / "checkpoint-25", tmp_path)
    # a limit of 1 keeps the one just written, even when it is not the highest step
    path = ckpt.save_checkpoint(tmp_path, 12, ckpt.CheckpointContents(model=model, trainer_state={}), save_total_limit=1)
    assert run_folders.list_checkpoints(tmp_path) == [path]
    assert not (tmp_path / ".tmp-checkpoint-20-abc").exists()


def test_resaving_a_step_replaces_it(tmp_path, tiny_model_dir):
    model = _lora(tiny_model_dir)
    ckpt.save_checkpoint(tmp_path, 1, ckpt.CheckpointContents(model=model, trainer_state={"v": 1}))
    path = ckpt.save_checkpoint(tmp_path, 1, ckpt.CheckpointContents(model=model, trainer_state={"v": 2}))
    assert ckpt.load_checkpoint(path, model=model, restore_rng=False).trainer_state["v"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_bad_inputs_to_save(tmp_path, tiny_model_dir):
    model = _lora(tiny_model_dir)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        ckpt.save_checkpoint(tmp_path, 1, ckpt.CheckpointContents(model=model, trainer_state={"loss": torch.tensor(1.0)}))
    with pytest.raises(CheckpointError, match="trainer_state\\['step'\\] is 3 but step is 1"):
        ckpt.save_checkpoint(tmp_path, 1, ckpt.CheckpointContents(model=model, trainer_state={"step": 3}))
    assert list(tmp_path.iterdir()) == []  # failed saves leave nothing behind


# --------------------------------------------------------------------------------------------
# crash safety
# --------------------------------------------------------------------------------------------

_CRASH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    from peft import LoraConfig

    from grpo_ascend.models.policy import apply_peft
    from grpo_ascend.checkpoints.checkpoint import CheckpointContents, save_checkpoint
    model = apply_peft(AutoModelForCausalLM.from_pretrained(sys.argv[1]),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(sys.argv[2], 4, CheckpointContents(model=model, optimizer=opt, trainer_state={}), save_total_limit=1)
    print("SAVE FINISHED", flush=True)
    """
)


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(lora_checkpoint, tiny_model_dir):
    previous, model, optimizer, scheduler = lora_checkpoint
    run_dir = previous.parent
    env = {**os.environ, ckpt.PAUSE_ENV: "60", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASH_SCRIPT, str(tiny_model_dir), str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith(ckpt.PAUSE_MARKER):
                break
        assert line.startswith(ckpt.PAUSE_MARKER), f"save never paused (got {line!r})"
        partial = Path(line.split(maxsplit=1)[1].strip())
        assert partial.name.startswith(".tmp-checkpoint-4-") and (partial / ckpt.OPTIMIZER_NAME).exists()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert partial.exists() and not (run_dir / "checkpoint-4").exists()
    assert ckpt.find_latest_checkpoint(run_dir) == previous
    assert ckpt.resolve_checkpoint("latest", run_dir) == previous
    loaded = ckpt.load_checkpoint(previous, model=model, optimizer=optimizer, scheduler=scheduler)
    assert loaded.step == 2 and loaded.trainer_state["data_position"] == 7


# --------------------------------------------------------------------------------------------
# bad checkpoints: each gives its clear error, and nothing is half-loaded
# --------------------------------------------------------------------------------------------


def test_truncated_missing_and_corrupted_files(lora_checkpoint):
    path, model, optimizer, _ = lora_checkpoint
    weights = path / ckpt.ADAPTER_WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors.* is truncated or altered"):
        ckpt.load_checkpoint(path, model=model)
    weights.write_bytes(data[:-4] + b"\0\0\0\1")
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors.* is damaged: its sha256"):
        ckpt.load_checkpoint(path, model=model)
    weights.write_bytes(data)
    (path / ckpt.OPTIMIZER_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.* is missing"):
        ckpt.load_checkpoint(path, model=model, optimizer=optimizer)
    (path / ckpt.MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing.*not a complete"):
        ckpt.load_checkpoint(path, model=model)
    assert ckpt.find_latest_checkpoint(path.parent) is None


def test_damaged_file_with_rewritten_manifest_still_names_the_file(tmp_path, lora_checkpoint):
    path, model, _, _ = lora_checkpoint
    (path / ckpt.RNG_NAME).write_bytes(b"not a torch file")
    (path / ckpt.ADAPTER_WEIGHTS_NAME).write_bytes(b"garbage")
    header = {k: v for k, v in json.loads((path / ckpt.MANIFEST_NAME).read_text()).items() if k != "files"}
    checkpoint_io.write_manifest(path, header)  # the hashes now match the damaged files
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors.* not a readable safetensors file"):
        ckpt.load_checkpoint(path, model=model)


def test_different_lora_rank_names_tensor_and_shapes(lora_checkpoint, tiny_model_dir):
    path, _, _, _ = lora_checkpoint
    other = _lora(tiny_model_dir, r=8, alpha=16)
    before = _trainable(other)
    with pytest.raises(CheckpointError, match=r"LoRA setting 'r' is 4 in the checkpoint but 8"):
        ckpt.load_checkpoint(path, model=other)
    other.peft_config["default"].r = 4  # same config on paper, wrong shapes in fact
    other.peft_config["default"].lora_alpha = 8
    with pytest.raises(CheckpointError, match=r"tensor '.*lora_A.weight' has shape \[4, 192\] in the checkpoint but \[8, 192\]"):
        ckpt.load_checkpoint(path, model=other)
    _assert_same(before, _trainable(other))


def test_different_alpha_and_targets(lora_checkpoint, tiny_model_dir):
    path, _, _, _ = lora_checkpoint
    with pytest.raises(CheckpointError, match=r"'lora_alpha' is 8 in the checkpoint but 32"):
        ckpt.load_checkpoint(path, model=_lora(tiny_model_dir, alpha=32))
    with pytest.raises(CheckpointError, match=r"tensor\(s\) the model does not have"):
        ckpt.load_checkpoint(path, model=_lora(tiny_model_dir, targets=["q_proj", "v_proj"]))


def test_different_model_for_full_checkpoint(tmp_path, tiny_model_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = _base(tiny_model_dir)
    path = ckpt.save_checkpoint(tmp_path, 1, ckpt.CheckpointContents(model=model, trainer_state={}))
    config = Qwen2Config(**{**model.config.to_dict(), "intermediate_size": 256})
    other = Qwen2ForCausalLM(config)
    with pytest.raises(CheckpointError, match=r"mlp.*has shape \[512, 192\] in the checkpoint but \[256, 192\]"):
        ckpt.load_checkpoint(path, model=other)
    with pytest.raises(CheckpointError, match="holds full-model weights.*LoRA PeftModel"):
        ckpt.load_checkpoint(path, model=_lora(tiny_model_dir))


def test_lora_checkpoint_into_plain_model(lora_checkpoint, tiny_model_dir):
    path, _, _, _ = lora_checkpoint
    with pytest.raises(CheckpointError, match="holds a LoRA adapter but the model is not a PeftModel"):
        ckpt.load_checkpoint(path, model=_base(tiny_model_dir))


def test_optimizer_mismatch_and_missing_states_leave_model_untouched(lora_checkpoint, tiny_model_dir):
    path, _, _, _ = lora_checkpoint
    model = _lora(tiny_model_dir, seed=7)
    before = _trainable(model)
    wrong = torch.optim.AdamW([p for n, p in model.named_parameters() if p.requires_grad and "q_proj" in n])
    with pytest.raises(CheckpointError, match=r"optimizer\.pt does not match the optimizer: parameter groups"):
        ckpt.load_checkpoint(path, model=model, optimizer=wrong)
    _assert_same(before, _trainable(model))
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(CheckpointError, match=r"has no scaler\.pt: it was saved without a grad scaler"):
        ckpt.load_checkpoint(path, model=model, scaler=scaler)
    _assert_same(before, _trainable(model))


def test_rng_state_restored_only_when_asked(lora_checkpoint):
    path, model, _, _ = lora_checkpoint
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ckpt.load_checkpoint(path, model=model, restore_rng=False)
    assert torch.equal(torch.rand(3), expected)
