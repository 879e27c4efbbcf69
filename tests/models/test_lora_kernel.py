"""The fused LoRA linear kernel (grpo_ascend/models/lora_kernel.py): peft's numbers, fewer passes, fallbacks."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from grpo_ascend.models import compat_peft, lora_kernel
from grpo_ascend.models.lora_merge import lora_merged


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _pair(**lora):
    """(peft model, fused copy) with non-zero LoRA B weights."""
    torch.manual_seed(0)
    model = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    fused = copy.deepcopy(model)
    assert lora_kernel.install(fused) == 2
    return model, fused


def _run(model, x, seed=1):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_matches_peft_forward_and_gradients(dropout):
    model, fused = _pair(lora_dropout=dropout)
    x = torch.randn(3, 5, 16)
    for m in (model, fused):
        m.train()
    ref, ref_gx, ref_grads = _run(model, x)
    out, gx, grads = _run(fused, x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
    assert sorted(grads) == sorted(ref_grads) and any("lora_A" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_trainable_base_weight_and_bias_get_peft_gradients():
    model, fused = _pair()
    for m in (model, fused):
        m.base_model.model.up.base_layer.weight.requires_grad_(True)
        m.base_model.model.up.base_layer.bias.requires_grad_(True)
    x = torch.randn(4, 16)
    _, _, ref = _run(model, x)
    _, _, got = _run(fused, x)
    for name in ("base_model.model.up.base_layer.weight", "base_model.model.up.base_layer.bias"):
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)


def test_no_full_width_multiply_or_add():
    """The point of the kernel: the adapter branch adds no [tokens, out] element-wise pass (fwd or bwd)."""
    from torch.profiler import ProfilerActivity, profile

    model, fused = _pair()
    x = torch.randn(64, 16)

    def elementwise_calls(m):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            m(x).sum().backward()
        return sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                   if e.key in ("aten::mul", "aten::add") and any(s[:1] == [64] for s in e.input_shapes if s))

    assert elementwise_calls(model) >= 4  # peft: a multiply and an add per layer, and the backward's
    assert elementwise_calls(fused) == 0


def test_falls_back_to_peft_when_the_call_is_not_plain():
    x = torch.randn(2, 16)
    model, fused = _pair()
    with model.disable_adapter(), fused.disable_adapter():  # the reference forward
        torch.testing.assert_close(fused(x), model(x))
    with lora_merged(fused) as merged:  # rollouts' folded weights: recognised as mergeable
        assert merged
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)
    dora, dora_fused = _pair(use_dora=True)
    assert compat_peft.plain_lora_parts(next(compat_peft.lora_layers(dora_fused)), x) is None
    torch.testing.assert_close(dora_fused(x), dora(x))


def test_under_autocast_casts_like_linear(monkeypatch):
    """Every layer fused (the second one's input is bf16 against float32 weights), peft's numbers."""
    calls = []
    model, fused = _pair()
    plain = lora_kernel.lora_linear
    monkeypatch.setattr(lora_kernel, "lora_linear", lambda x, *a: calls.append(x.dtype) or plain(x, *a))
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _, ref_grads = _run(model, x)
        out, _, grads = _run(fused, x)
    assert calls == [torch.float32, torch.bfloat16]
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for name in ref_grads:
        assert grads[name].dtype == torch.float32
        assert (grads[name] - ref_grads[name]).norm() < 2e-2 * ref_grads[name].norm(), name  # bf16 rounding


def test_state_dict_deepcopy_and_merge_unchanged():
    model, fused = _pair()
    assert list(fused.state_dict()) == list(model.state_dict())
    assert isinstance(copy.deepcopy(fused).base_model.model.up, lora_kernel.FusedLoraLinear)
    x = torch.randn(2, 16)
    merged = copy.deepcopy(fused).merge_and_unload()
    assert type(merged.up) is nn.Linear and not list(compat_peft.lora_layers(merged))
    torch.testing.assert_close(merged(x), model(x), rtol=1e-5, atol=1e-5)
