"""Through the trainer: fused Ascend kernels go into the model that trains, on the device it was placed on.

The NPU is the fake of tests/support/fake_device.py (kernels computed with torch on CPU tensors); the
trainer's accelerator reports the resolved fake device, and placement onto it is recorded.
"""

from __future__ import annotations

import pytest
import torch
from fake_device import FakeDevice, fake_npu_devices, install
from helpers import SMALL_RUN, first_digit_is_one

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend import device as dev
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.models.policy import default_lora_config, load_causal_lm, load_tokenizer
from grpo_ascend.trainers import base as trainer_base


class _OptimizerBuilt(Exception):
    """Raised where the trainer builds its optimizer: the policy is placed and patched by then."""


@pytest.fixture(autouse=True)
def _restored_npu_env(monkeypatch):
    for name in dev.NPU_RUNTIME_DEFAULTS:  # restored afterwards, whatever resolve_device sets
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


class _AcceleratorOnDevice:
    """A real (CPU) accelerate Accelerator that reports ``device`` as the one it runs on."""

    def __init__(self, accelerator, device) -> None:
        self._accelerator = accelerator
        self.device = device

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def _trainer_until_optimizer(monkeypatch, tmp_path, model, tokenizer):
    """Build a GRPOTrainer whose accelerator resolved the fake NPU; stop when it builds the optimizer."""
    from accelerate import Accelerator

    built = {}

    def make_accelerator(args):
        with monkeypatch.context() as scoped:  # torch.device('npu:0') parses only while resolving
            fake_npu_devices(scoped)
            requested = dev.resolve_device("npu")  # through the fake torch.npu: set_device, runtime defaults
        return _AcceleratorOnDevice(Accelerator(cpu=True), FakeDevice(str(requested))), "fp32"

    class Recorded(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            built["trainer"] = self
            super().__init__(*args, **kwargs)

    real_to = torch.nn.Module.to

    def to(module, *args, **kwargs):
        if args and isinstance(args[0], FakeDevice):
            module.placed_on = str(args[0])
            return module
        return real_to(module, *args, **kwargs)

    def optimizer(params, **kwargs):
        built["params"] = list(params)
        raise _OptimizerBuilt

    monkeypatch.setattr(trainer_base, "make_accelerator", make_accelerator)
    monkeypatch.setattr(torch.nn.Module, "to", to)
    monkeypatch.setattr(torch.optim, "AdamW", optimizer)
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": 2})
    with pytest.raises(_OptimizerBuilt):
        Recorded(model, first_digit_is_one, cfg, arithmetic_dataset(8), processing_class=tokenizer,
                    peft_config=default_lora_config(r=4))
    return built["trainer"], built["params"]


def test_kernels_go_into_the_placed_policy_and_not_into_a_cpu_model(monkeypatch, tmp_path, tiny_model_dir, caplog):
    model = load_causal_lm(str(tiny_model_dir))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    cpu_model = load_causal_lm(str(tiny_model_dir)).eval()  # same family, same process, stays on the CPU
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = cpu_model(ids).logits

    calls = install(monkeypatch, soc="Ascend910B2", npu_devices=False)
    with caplog.at_level("INFO", logger="grpo_ascend.device.npu_patches"):
        trainer, params = _trainer_until_optimizer(monkeypatch, tmp_path, model, tokenizer)
    layers = len(cpu_model.model.layers)
    assert (f"fused kernels on Ascend910B2 (A2): npu_rms_norm: {2 * layers + 1} x Qwen2RMSNorm; "
            f"npu_swiglu: {layers} x Qwen2MLP; npu_rotary_mul: {layers} x Qwen2Attention") in caplog.text
    assert str(trainer.device) == "npu:0" and trainer.policy.placed_on == "npu:0"
    trained = {id(p) for p in trainer.policy.parameters() if p.requires_grad}
    assert {id(p) for p in params} == trained  # the patched policy is the one the optimizer trains

    trainer.policy.eval()
    with torch.no_grad():
        actual = trainer.policy(ids).logits
    # 2 norms per layer + the final norm; one MLP per layer; q and k per layer
    assert calls == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rotary": 2 * layers}
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)  # LoRA B starts at zero

    calls.clear()
    with torch.no_grad():
        again = cpu_model(ids).logits
    assert sum(calls.values()) == 0  # the CPU model kept its eager RMSNorm, MLP and rotary code
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_training_series_chip_gets_only_its_documented_kernels(monkeypatch, tmp_path, tiny_model_dir):
    # Atlas training series: no npu_swiglu kernel; npu_rotary_mul only for head_dim 128 (the tiny model has 32).
    model = load_causal_lm(str(tiny_model_dir))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    calls = install(monkeypatch, soc="Ascend910ProB", npu_devices=False)
    trainer, _ = _trainer_until_optimizer(monkeypatch, tmp_path, model, tokenizer)
    trainer.policy.eval()
    with torch.no_grad():
        trainer.policy(torch.randint(5, 500, (2, 9)))  # the fake raises if an unsupported kernel is called
    assert calls == {"rms_norm": 2 * len(model.model.layers) + 1}


def test_cpu_run_is_not_patched_even_with_torch_npu_importable(monkeypatch, tmp_path, tiny_model_dir):
    calls = install(monkeypatch, soc="Ascend910B2", npu_devices=False)
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": 2, "device": "cpu"})
    trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4))
    with torch.no_grad():
        trainer.policy(torch.randint(5, 500, (2, 9)))
    assert sum(calls.values()) == 0
