"""lora_merged folds LoRA into the weights for generation and restores them bit for bit."""

from __future__ import annotations

import torch

from grpo_ascend.models.lora_merge import lora_merge_bytes, lora_merged
from grpo_ascend.models.policy import apply_peft, default_lora_config
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.sampling import SamplingParams


def _adapted(model, **lora):
    torch.manual_seed(0)
    policy = apply_peft(model, default_lora_config(r=4, **lora))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return policy


def test_merged_forward_equals_adapter_forward_and_weights_come_back_exactly(tiny_model):
    model, tok = tiny_model
    policy = _adapted(model)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    grads = {n: p.requires_grad for n, p in policy.named_parameters()}
    ids = tok(["3+4=", "12+7= 1"], return_tensors="pt", padding=True)
    with torch.no_grad():
        plain = policy(**ids).logits
        with lora_merged(policy) as merged:
            assert merged
            folded = policy(**ids).logits
        after = policy(**ids).logits
    torch.testing.assert_close(folded, plain, rtol=0, atol=1e-4)
    assert torch.equal(after, plain)
    for n, p in policy.named_parameters():
        assert torch.equal(p, before[n]), n  # bit-for-bit: originals swapped back, no W + d - d
        assert p.requires_grad == grads[n], n
    # the adapters matter, so the equality above is not vacuous
    with torch.no_grad(), policy.disable_adapter():
        assert (policy(**ids).logits - plain).abs().max() > 1e-3


def test_merged_copy_is_stored_in_the_decode_layout(tiny_model, monkeypatch):
    """On the CPU the merged weight is W + delta stored [in, out] (a transposed view, the layout MKL's
    small-row sgemm runs fastest); where the device keeps its own layout it stays row-major."""
    from grpo_ascend import device as dev
    from grpo_ascend.models import compat_peft

    model, _ = tiny_model
    policy = _adapted(model)
    layer = next(compat_peft.lora_layers(policy))
    weight = compat_peft.base_weight(layer)
    expected = weight.detach() + compat_peft.delta_weight(layer, "default").detach()
    original = weight.data
    for transposed in (True, False):
        monkeypatch.setattr(dev, "decode_weights_transposed", lambda device, *shape, t=transposed: t)
        with torch.no_grad(), lora_merged(policy):
            merged = compat_peft.base_weight(layer)
            assert merged.shape == original.shape
            assert merged.stride() == ((1, merged.shape[0]) if transposed else original.stride())
            torch.testing.assert_close(merged.detach(), expected, rtol=1e-6, atol=1e-7)  # one fused addmm
        assert compat_peft.base_weight(layer).data_ptr() == original.data_ptr()  # the original storage is back
    monkeypatch.undo()
    assert dev.decode_weights_transposed("cpu") and not dev.decode_weights_transposed("cuda:0")
    assert not dev.decode_weights_transposed("npu:0") and not dev.decode_weights_transposed("cuda:0", (8, 4), 16)


def test_decode_layout_is_measured_once_per_shape_and_thread_count(monkeypatch):
    """On the CPU the layout of a decode weight is the one measured faster at its shape: the plain
    [in, out] operand only when clearly faster (timing noise keeps nn.Linear's), each (rows, in, out,
    dtype, threads) timed once per process."""
    from grpo_ascend import device as dev
    from grpo_ascend.device import calibration

    assert calibration.choose_plain(1.0, 0.9) and not calibration.choose_plain(1.0, 0.97)
    timed = []

    def fake_measure(rows, k, n, dtype):
        timed.append((rows, k, n))
        return (1.0, 0.5) if n == 256 else (1.0, 1.2)

    monkeypatch.setattr(calibration, "measure_layouts", fake_measure)
    calibration.forget_measurements()  # timed here whatever ran before; the fake's choices are forgotten after
    threads = torch.get_num_threads()
    try:
        assert dev.decode_weights_transposed("cpu", (256, 512), 32)  # [out, in]: 512 -> 256, plain faster
        assert not dev.decode_weights_transposed("cpu", (1376, 512), 32)
        assert dev.decode_weights_transposed("cpu", (256, 512), 32) and timed == [(32, 512, 256), (32, 512, 1376)]
        torch.set_num_threads(threads + 1)
        dev.decode_weights_transposed("cpu", (256, 512), 32)
    finally:
        torch.set_num_threads(threads)
        calibration.forget_measurements()
    assert len(timed) == 3  # another thread count is measured again


def test_layout_measurement_times_both_layouts():
    from grpo_ascend.device.calibration import measure_layouts

    row_major, plain = measure_layouts(8, 64, 32, torch.float32, repeats=2)
    assert 0 < row_major < 1 and 0 < plain < 1


def test_merged_rollout_samples_the_same_tokens(tiny_model):
    model, tok = tiny_model
    policy = _adapted(model)
    policy.eval()
    engine = RolloutEngine(policy, tok)
    params = SamplingParams(num_generations=2, max_completion_length=10, temperature=0)
    with torch.no_grad():
        plain = engine.generate(["3+4=", "9+9="], params)
        with lora_merged(policy):
            folded = engine.generate(["3+4=", "9+9="], params)
    assert torch.equal(folded.completion_ids, plain.completion_ids)
    m = plain.completion_mask.bool()
    torch.testing.assert_close(folded.sampling_logprobs[m], plain.sampling_logprobs[m], rtol=0, atol=1e-4)


def test_nothing_to_merge_yields_false(tiny_model):
    model, _ = tiny_model
    with lora_merged(model) as merged:
        assert not merged
    assert lora_merge_bytes(model) is None
    dora = _adapted(model, target_modules=["q_proj", "v_proj"])
    dora_cfg = default_lora_config(r=4, target_modules=["k_proj"])
    dora_cfg.use_dora = True
    dora.add_adapter("dora", dora_cfg)
    dora.set_adapter("dora")
    with lora_merged(dora) as merged:  # a DoRA layer is more than W + BA: nothing is merged
        assert not merged
    assert lora_merge_bytes(dora) is None


def test_merge_bytes_counts_the_adapted_weights(tiny_model):
    model, _ = tiny_model
    policy = _adapted(model, target_modules=["q_proj", "v_proj"])
    expected = sum(
        m.weight.nbytes for n, m in policy.named_modules() if n.endswith(("q_proj.base_layer", "v_proj.base_layer"))
    )
    assert lora_merge_bytes(policy) == expected > 0


def _trainer(tmp_path, model_dir, peft=True, **kw):
    from helpers import SMALL_RUN, index_in_group

    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset

    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), **kw})
    return GRPOTrainer(str(model_dir), index_in_group(cfg.num_generations), cfg, arithmetic_dataset(8),
                       peft_config=default_lora_config(r=4) if peft else None)


def test_trainer_decides_and_rolls_out_merged(tmp_path, tiny_model_dir, monkeypatch):
    from grpo_ascend import device as dev
    from grpo_ascend.trainers import base

    assert _trainer(tmp_path, tiny_model_dir).merge_lora_for_rollout  # auto: the copy fits easily
    assert not _trainer(tmp_path, tiny_model_dir, rollout_merge_lora=False).merge_lora_for_rollout
    assert not _trainer(tmp_path, tiny_model_dir, peft=False, rollout_merge_lora=True).merge_lora_for_rollout
    monkeypatch.setattr(dev, "free_memory", lambda device: (1024, 2048))
    assert not _trainer(tmp_path, tiny_model_dir).merge_lora_for_rollout  # auto: not enough free memory
    assert _trainer(tmp_path, tiny_model_dir, rollout_merge_lora=True).merge_lora_for_rollout

    trainer = _trainer(tmp_path, tiny_model_dir, rollout_merge_lora=True, max_steps=1)
    entered = []
    real = base.lora_merged

    def spy(model, rows=None):
        entered.append(model)
        assert rows == trainer.plan.prompts_per_rank * trainer.plan.num_generations  # the decode batch
        return real(model, rows)

    monkeypatch.setattr(base, "lora_merged", spy)
    frozen = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    trainer.train()
    assert entered == [trainer.policy]
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.policy.named_parameters() if n in frozen)
    # The adapter still trains: the index reward gives every group non-zero advantages, and the random-init
    # model's nearly flat logits make a group's completions distinct (two alike: about 556^-10), so the
    # policy gradient is non-zero whatever was sampled.
    assert any(not torch.equal(p, lora[n]) for n, p in trainer.policy.named_parameters() if n in lora)
