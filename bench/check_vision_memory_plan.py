"""The memory plan of a vision-language run that trains its vision tower against the peak memory the run
measures, per phase, on the CPU (as bench/check_memory_plan.py does for text models).

The model is the built-in tiny Qwen2.5-VL with a wider, deeper vision tower (hidden 192, MLP 768, 4 blocks) and a
processor that makes every picture 224x224 (1,024 patches of 7 pixels, 256 image tokens), so that the tower's
activations kept for the backward weigh against the measurement's slack. LoRA on the language model and the
tower (``train_vision_parts: [vision_tower]``, the merger inside it trains too), one prompt of G=8 rows per
step, 2 steps. The plan is computed from the run's config objects with the run's prompt width (image tokens
included), once as planned and once as if the vision part were frozen, to show what the trained tower adds.

Generation is read in the first round only: the tower's activations are sub-4-MiB tensors that live in the heap,
and after a training phase freed them the heap stays resident, so a later round's generation reads the training
phase's level (0.64 GiB against 0.55 in the first round of lora-vision-tower) whatever it allocates.

    python bench/check_vision_memory_plan.py          # a table
    python bench/check_vision_memory_plan.py --json   # VISION_MEMORY_PLAN_CHECK {row: {phase: [measured, planned]}}
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_memory_plan import BASE, GiB, warm_up  # noqa: E402

#: The vision tower of the measured model, and the pictures' side in pixels.
TOWER = {"hidden_size": 192, "intermediate_size": 768, "depth": 4, "num_heads": 4}
SIDE = 224
#: Run first, on the built-in tiny Qwen2.5-VL, and not reported: it loads what the first vision-language run
#: touches lazily (the model's code, the processor, the tower's kernels), which would otherwise be charged to the
#: first configuration measured; its tensors are small, so the heap it leaves behind holds little.
WARM_UP = {"train_vision_parts": ["vision_tower"], "max_steps": 1}
CASES = {"warm-up": WARM_UP, "lora-frozen-vision": {"train_vision_parts": []},
         "lora-vision-tower": {"train_vision_parts": ["vision_tower"]},
         "lora-vision-tower-checkpointing": {"train_vision_parts": ["vision_tower"], "gradient_checkpointing": True}}


def build_model(out: Path) -> Path:
    """The tiny Qwen2.5-VL with :data:`TOWER` and a processor making every picture SIDE x SIDE, saved in ``out``."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from grpo_ascend.models.tiny_vlm import build_tiny_vlm
    from grpo_ascend.models.vision_language import load_processor

    tiny = build_tiny_vlm("qwen2_5_vl")
    config = AutoConfig.from_pretrained(tiny)
    for key, value in TOWER.items():
        setattr(config.vision_config, key, value)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).float().save_pretrained(out)
    processor = load_processor(tiny)
    processor.image_processor.min_pixels = processor.image_processor.max_pixels = SIDE * SIDE
    processor.image_processor.size = {"shortest_edge": SIDE * SIDE, "longest_edge": SIDE * SIDE}
    processor.save_pretrained(out)
    return out


def _alternate(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(i % 2) for i in range(len(completions))]


def prompt_width(processor: Any, dataset: Any) -> int:
    """The longest prompt in tokens, image tokens included, as the processor renders the dataset's rows."""
    widths = []
    for row in dataset:
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["prompt"][0]["content"]}]}]
        text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        widths.append(processor(text=[text], images=[row["image"]], return_tensors="pt")["input_ids"].shape[1])
    return max(widths)


def measure(name: str, model_dir: Path, out_dir: str) -> dict[str, tuple[float, float, float]]:
    """{phase: (measured GiB above the baseline, planned GiB, planned GiB with the vision part frozen)}."""
    from grpo_ascend import device as dev
    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.config.recipe import RecipeConfig
    from grpo_ascend.distributed.memory_layout import plain_layout
    from grpo_ascend.models.policy import default_lora_config
    from grpo_ascend.models.vision_language import load_processor
    from grpo_ascend.planning.memory_plan import load_model_shape, plan_memory, settings_from_config
    from grpo_ascend.trainers.grpo import GRPOTrainer
    from grpo_ascend.vision.shapes_task import coloured_shapes_dataset

    dataset = coloured_shapes_dataset(8)
    args = GRPOConfig(**{**BASE, "max_prompt_length": 512, **CASES[name], "output_dir": out_dir})
    processor = load_processor(model_dir)
    gc.collect()
    baseline = dev.memory_stats("cpu")["allocated"]
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[_alternate], args=args, train_dataset=dataset,
                          processing_class=processor, peft_config=default_lora_config(8, 16))
    trainer.train()
    measured: dict[str, float] = {}
    for record in trainer.state.log_history:
        for key, value in record.items():
            phase = key.rsplit("/", 1)[-1]
            if key.startswith("memory/peak_gb/") and not (phase == "generation" and phase in measured):
                measured[phase] = max(measured.get(phase, 0.0), value * GiB - baseline)
    shape = load_model_shape(str(model_dir))
    settings = settings_from_config(RecipeConfig(use_peft=True, lora_r=8), args, "cpu", 1,
                                    prompt_width(processor, dataset))
    settings = dataclasses.replace(settings, images_per_prompt=1)
    plan = plan_memory(shape, settings, plain_layout(1))
    frozen = plan_memory(shape, dataclasses.replace(settings, train_vision_parts=()), plain_layout(1))
    del trainer
    gc.collect()
    return {phase: (measured[phase] / GiB, plan.phase_bytes(phase) / GiB, frozen.phase_bytes(phase) / GiB)
            for phase in plan.phases if phase in measured}


def run_case(name: str) -> dict[str, tuple[float, float, float]]:
    """One configuration in this (fresh) process: the warm-ups, then the measurement. Every configuration runs in
    a process of its own: the heap keeps the holes a run's sub-4-MiB tensors leave (the vision tower's are), and
    a later run in the same process would reuse them without its resident set growing."""
    from grpo_ascend.models.tiny_vlm import build_tiny_vlm

    warm_up()
    with tempfile.TemporaryDirectory() as out:
        measure("warm-up", build_tiny_vlm("qwen2_5_vl"), str(Path(out) / "warm-up"))
        return measure(name, build_model(Path(out) / "model"), str(Path(out) / name))


def main() -> None:
    import subprocess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object {row: {phase: [measured, planned, "
                        "planned frozen]}}")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one configuration, in a process started by main
    ns = parser.parse_args()
    if ns.case:
        print("VISION_CASE " + json.dumps(run_case(ns.case)))
        return
    results = {}
    for name in [n for n in CASES if n != "warm-up" and (not ns.only or n in ns.only)]:
        done = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True)
        line = next(x for x in done.stdout.splitlines() if x.startswith("VISION_CASE "))
        results[name] = json.loads(line.split(" ", 1)[1])
    if ns.json:
        print("VISION_MEMORY_PLAN_CHECK " + json.dumps(results))
        return
    print("| configuration | phase | measured GiB | planned GiB | planned / measured | planned, vision frozen |")
    print("|---|---|---|---|---|---|")
    for name, phases in results.items():
        for phase, (got, want, frozen) in phases.items():
            print(f"| {name} | {phase} | {got:.3f} | {want:.3f} | {want / got:.2f} | {frozen:.3f} |", flush=True)


if __name__ == "__main__":
    main()
