"""TRL 1.16's own example script (trl/scripts/grpo.py) with only its GRPOTrainer import replaced by ours:
it parses TRL's GRPOConfig / ModelConfig, trains with LoRA and evaluation, saves, ends; PEFT loads the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TRL_IMPORT = "    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n"
OUR_IMPORT = "    from trl import get_dataset, get_peft_config, get_quantization_config\n\n    from grpo_ascend import GRPOTrainer\n"
REPO = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path) -> Path:
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl==1.16.0)")
    source = Path(trl.__file__).parent / "scripts" / "grpo.py"
    if not source.is_file():
        pytest.skip(f"this trl ({trl.__version__}) does not ship scripts/grpo.py")
    text = source.read_text()
    assert text.count(TRL_IMPORT) == 1, "TRL's script imports GRPOTrainer differently now; update TRL_IMPORT"
    script = tmp_path / "grpo.py"
    script.write_text(text.replace(TRL_IMPORT, OUR_IMPORT))
    return script


@pytest.mark.slow
def test_trl_example_script_runs_with_our_trainer_and_saves_a_peft_adapter(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    script = _script(tmp_path)
    data = tmp_path / "data"  # a local dataset folder: datasets finds the train / test splits by file name
    data.mkdir()
    for split, n in (("train", 16), ("test", 4)):
        rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i % 5}?"}], "solution": str(i + i % 5)}
                for i in range(n)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the script imports a dotted reward path from its working directory; this one differs within every
    # group of 4 whatever was sampled (the completion's index in its group), so a step moves the adapter
    (tmp_path / "my_rewards.py").write_text(
        "def index(completions, **kwargs):\n    return [float(i % 4) for i in range(len(completions))]\n")
    out = tmp_path / "out"
    args = [
        "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data),
        "--reward_funcs", "think_format_reward", "my_rewards.index",  # one of TRL's rewards by name, one by path
        "--output_dir", str(out), "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "8", "--learning_rate", "0.01", "--seed", "0",
        "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "4",
        "--save_steps", "2", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "True",
        "--bf16", "False",  # TRL's own config refuses its bf16 default on a CPU without --use_cpu
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Training completed." in run.stdout and f"Model saved to {out}." in run.stdout
    assert "TRLConfigWarning" not in run.stderr  # everything the script sets is mapped

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("eval/reward" in r for r in records)  # eval_dataset= and eval_strategy reached our evaluation
    config = json.loads((out / "run_config.json").read_text())
    assert config["model_init_kwargs"]["dtype"] == "float32"  # ModelConfig's dtype, via model_init_kwargs
    assert (config["max_completion_length"], config["num_generations"]) == (8, 4)

    # what save_model wrote loads in PEFT, holds the trainer's final weights (checkpoint-2) and is trained
    saved = load_file(out / "adapter_model.safetensors")
    final = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    assert saved.keys() == final.keys() and saved
    for name in saved:
        torch.testing.assert_close(saved[name], final[name], rtol=0, atol=0)
    assert any(t.abs().max() > 0 for k, t in saved.items() if "lora_B" in k)  # LoRA's B starts at zero
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(5, 500, (1, 6))
    with torch.no_grad():
        before = base(ids).logits
        model = PeftModel.from_pretrained(base, out).eval()
        after = model(ids).logits
        state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(state) == len(saved)
    assert (after - before).abs().max() > 1e-6
