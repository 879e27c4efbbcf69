"""Export: PEFT-format adapter and merged model round trips, dtype casts, the CLI, and its errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_ascend.checkpoints import checkpoint as ckpt
from grpo_ascend.checkpoints.export import export_checkpoint, parse_dtype
from grpo_ascend.cli import main
from grpo_ascend.errors import CheckpointError, ConfigError


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


# The tests load exports with plain PEFT, as users do; peft itself reads transformers' deprecated property.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A LoRA policy trained a few steps (non-zero B), its checkpoint, and reference logits."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from grpo_ascend.models.policy import apply_peft

    torch.manual_seed(0)
    model = apply_peft(
        _base(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        ids = torch.randint(3, 500, (2, 9))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    run = tmp_path_factory.mktemp("run")
    contents = ckpt.CheckpointContents(model=model, optimizer=optimizer, trainer_state={}, tokenizer=tokenizer)
    path = ckpt.save_checkpoint(run, 3, contents)
    ids = torch.randint(3, 500, (3, 11))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"model": model, "path": path, "ids": ids, "logits": logits, "tokenizer": tokenizer, "run": run}


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapter_export_round_trip_is_exact(trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    out = export_checkpoint(trained["path"], tmp_path / "adapter")
    names = {p.name for p in out.iterdir()}
    assert {ckpt.ADAPTER_CONFIG_NAME, ckpt.ADAPTER_WEIGHTS_NAME, "tokenizer.json"} <= names
    assert not names & {ckpt.OPTIMIZER_NAME, ckpt.RNG_NAME, ckpt.MANIFEST_NAME, "model.safetensors"}
    config = json.loads((out / ckpt.ADAPTER_CONFIG_NAME).read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir) and config["inference_mode"] is True
    loaded = PeftModel.from_pretrained(_base(tiny_model_dir), out)
    logits = _logits(loaded, trained["ids"])
    assert not torch.equal(logits, _logits(_base(tiny_model_dir), trained["ids"]))  # the adapter does something
    assert torch.equal(logits, trained["logits"])
    assert AutoTokenizer.from_pretrained(out).pad_token == "<|endoftext|>"


def test_merged_export_matches_within_fp32_tolerance(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_checkpoint(trained["path"], tmp_path / "merged", merge=True)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert ckpt.ADAPTER_CONFIG_NAME not in names
    weights = load_file(str(out / "model.safetensors"))
    assert not any("lora" in key for key in weights)
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(_logits(merged, trained["ids"]), trained["logits"], rtol=1e-4, atol=1e-4)
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


def test_bf16_exports(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(trained["path"], tmp_path / "a16", dtype="bf16")
    assert {t.dtype for t in load_file(str(out / ckpt.ADAPTER_WEIGHTS_NAME)).values()} == {torch.bfloat16}
    out = export_checkpoint(trained["path"], tmp_path / "m16", merge=True, dtype="bf16")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    torch.testing.assert_close(_logits(merged.float(), trained["ids"]), trained["logits"], rtol=0.05, atol=0.05)


def test_live_model_export_for_end_of_training(trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = trained["model"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = export_checkpoint(model, tmp_path / "adapter", tokenizer=trained["tokenizer"], base_model="builtin:tiny")
    config = json.loads((out / ckpt.ADAPTER_CONFIG_NAME).read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir)  # builtin name resolved to its folder
    assert torch.equal(_logits(PeftModel.from_pretrained(_base(tiny_model_dir), out), trained["ids"]), trained["logits"])
    merged_dir = export_checkpoint(model, tmp_path / "merged", merge=True, tokenizer=trained["tokenizer"])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    torch.testing.assert_close(_logits(merged, trained["ids"]), trained["logits"], rtol=1e-4, atol=1e-4)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # exporting never touches the live policy
    assert (merged_dir / "tokenizer.json").is_file()


def test_full_finetune_checkpoint_exports_a_full_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _base(tiny_model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    path = ckpt.save_checkpoint(tmp_path / "run", 1, ckpt.CheckpointContents(model=model, trainer_state={}))
    out = export_checkpoint(path, tmp_path / "full")
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(3, 500, (2, 8))
    assert torch.equal(_logits(exported, ids), _logits(model, ids))
    assert exported.lm_head.weight is exported.model.embed_tokens.weight


def test_cli_export_adapter_merge_and_run_folder(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert main(["export", str(trained["path"]), "--out", str(tmp_path / "a")]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    assert (tmp_path / "a" / ckpt.ADAPTER_WEIGHTS_NAME).is_file()
    # a run folder exports its latest checkpoint; an earlier export in --out is replaced
    assert main(["export", str(trained["run"]), "--out", str(tmp_path / "a"), "--merge", "--dtype", "fp32"]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    assert not (tmp_path / "a" / ckpt.ADAPTER_CONFIG_NAME).exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    torch.testing.assert_close(_logits(merged, trained["ids"]), trained["logits"], rtol=1e-4, atol=1e-4)


def test_cli_errors_are_one_line_with_exit_code_2(trained, tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["export", str(trained["path"]), "--out", str(busy)]) == 2
    assert "not an earlier export" in capsys.readouterr().err
    assert (busy / "notes.txt").read_text() == "mine"
    assert main(["export", str(trained["path"]), "--out", str(trained["path"] / "x")]) == 2
    assert "overlaps the checkpoint" in capsys.readouterr().err


def test_merge_with_wrong_base_model_is_a_clear_error(trained, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**trained["model"].get_base_model().config.to_dict(), "intermediate_size": 256})
    other = tmp_path / "other-base"
    Qwen2ForCausalLM(config).save_pretrained(other)
    with pytest.raises(CheckpointError, match=r"shape .* in the checkpoint but .*--base-model"):
        export_checkpoint(trained["path"], tmp_path / "m", merge=True, base_model=str(other))
    assert not (tmp_path / "m").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_damaged_checkpoint_is_not_exported(trained, tmp_path):
    import shutil

    copy = tmp_path / "checkpoint-3"
    shutil.copytree(trained["path"], copy)
    (copy / ckpt.ADAPTER_WEIGHTS_NAME).write_bytes(b"short")
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors.* truncated"):
        export_checkpoint(copy, tmp_path / "out")


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float16") is torch.float16
    assert parse_dtype(None) is None
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        parse_dtype("bf61")


def test_live_full_model_export_casts_without_touching_the_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _base(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.1)
    out = export_checkpoint(model, tmp_path / "full16", dtype="bf16")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert torch.equal(exported.model.norm.weight, model.model.norm.weight.to(torch.bfloat16))
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert (out / "tokenizer.json").is_file()  # taken from the base model's folder


def test_ppo_full_finetune_checkpoint_exports_the_policy(tiny_model_dir, tmp_path):
    """PPO saves policy and critic side by side; export writes the policy alone."""
    from transformers import AutoModelForCausalLM

    policy = _base(tiny_model_dir)
    with torch.no_grad():
        policy.model.layers[1].self_attn.q_proj.weight.mul_(1.25)
    both = torch.nn.ModuleDict({"policy": policy, "critic": torch.nn.Linear(4, 1)})
    path = ckpt.save_checkpoint(tmp_path / "run", 2, ckpt.CheckpointContents(model=both, trainer_state={}))
    out = export_checkpoint(path, tmp_path / "full", base_model=str(tiny_model_dir))
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(3, 500, (2, 8))
    assert torch.equal(_logits(exported, ids), _logits(policy, ids))
