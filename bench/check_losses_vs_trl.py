"""Our policy losses against TRL 1.16's own loss computation on fixed tensors: value and gradient.

    python -m venv --system-site-packages /work/venv-trl   # + a .pth pointing at the project venv
    /work/venv-trl/bin/pip install trl==1.16.0 --no-deps pandas
    PYTHONPATH=$PWD /work/venv-trl/bin/python bench/check_losses_vs_trl.py [--json OUT.json]

TRL's loss lives in the method ``GRPOTrainer._compute_loss(model, inputs)``, which needs a whole
trainer. We call that method itself (TRL's code, unchanged) on a minimal stand-in for ``self``: its
log-prob forward returns our fixed ``logps`` leaf tensor (and fixed entropies), one process, no gradient
accumulation, no entropy bonus. So every loss_type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo),
token- and sequence-level ratios, the k3 KL with and without ``use_bias_correction_kl``, ``delta``,
the vLLM importance-sampling weights multiplying the loss (folded into VESPO's gamma weight), the
off-policy sequence mask (``off_policy_mask_threshold``, against the sampling log-probs) and the
high-entropy token mask (``top_entropy_quantile``) are TRL's own arithmetic.

TRL computes the importance-sampling *ratio* inline in ``_generate_and_score_completions`` (no
callable function): for that part the script rebuilds the ratio from TRL's documented formula
(exp of the per-token, or per-sequence summed, trainer − sampler log-prob difference, truncated or
masked to [clip_min, clip_max]) and compares it with ours; the resulting weights then go through
TRL's ``_compute_loss``. k1/k2 KL estimators have no TRL counterpart and are checked in
tests/algorithms/test_loss_objectives.py only.
"""

from __future__ import annotations

import argparse
import json
import math
import types
from collections import defaultdict

import torch

from grpo_ascend.algorithms.importance_sampling import ImportanceSamplingSettings, importance_sampling_weights
from grpo_ascend.algorithms.losses import PolicyLossBatch, PolicyLossSettings, policy_loss
from grpo_ascend.algorithms.token_selection import high_entropy_mask

B, T, MAX_LEN = 8, 7, 12
EPS, EPS_HIGH, CISPO_CAP, DELTA = 0.2, 0.28, 1.5, 2.0
TAU_POS, TAU_NEG = 1.0, 1.05
# TRL builds SAPO's temperatures with torch.where on Python floats, i.e. in torch's default dtype
# (float32: 1.05 → 1.0499999523): our side gets the same rounded values so float64 runs compare exactly.
TAU_NEG_AS_TRL = float(torch.tensor(TAU_NEG, dtype=torch.get_default_dtype()))


def fixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Ratios spread across both clipping edges; some padding; finite values everywhere (TRL masks by product)."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logps - torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    sampling = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.15
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lengths = torch.tensor([7, 3, 1, 5, 7, 6, 2, 4])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 1.2, -0.3, 0.8, -1.5], dtype=torch.float64)
    return {"logps": logps, "old": old, "ref": ref, "sampling": sampling, "ent": entropies, "mask": mask, "adv": adv}


def trl_is_ratio(d: dict[str, torch.Tensor], mode: str, clip_max: float | None, clip_min: float | None):
    """TRL 1.16's vLLM importance-sampling ratio, rebuilt from its formula (see the module docstring)."""
    diff = (d["old"] - d["sampling"]) * d["mask"]
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_loss(d, loss_type, *, level, beta, bias, delta, is_ratio, off_policy=None, quantile=1.0):
    """TRL's ``GRPOTrainer._compute_loss`` on a minimal stand-in trainer; returns (loss, dlogps, metrics)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    logps = d["logps"].clone().requires_grad_(True)
    eps_high = CISPO_CAP if loss_type == "cispo" else EPS_HIGH
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction="sum": x,
                                        pad_across_processes=lambda x, dim=0, pad_index=0: x)
    stub = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, d["ent"], None),
        aux_loss_enabled=False,
        top_entropy_quantile=quantile,
        off_policy_mask_threshold=off_policy,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=EPS,
        epsilon_high=eps_high,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(
            use_bias_correction_kl=bias, delta=delta, steps_per_generation=1,
            sapo_temperature_pos=TAU_POS, sapo_temperature_neg=TAU_NEG,
            vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
        ),
    )
    stub.get_high_entropy_mask = lambda e, m, t: GRPOTrainer.get_high_entropy_mask(stub, e, m, t)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": d["mask"],
        "advantages": d["adv"],
        "old_per_token_logps": d["old"],
        "ref_per_token_logps": d["ref"],
        "num_items_in_batch": d["mask"].sum(),
        "sampling_per_token_logps": d["sampling"],
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.detach(), logps.grad, {k: v[-1] for k, v in stub._metrics["train"].items()}


def our_loss(d, loss_type, *, level, beta, bias, delta, weights, off_policy=None, quantile=1.0):
    logps = d["logps"].clone().requires_grad_(True)
    settings = PolicyLossSettings(
        epsilon=EPS, epsilon_high=CISPO_CAP if loss_type == "cispo" else EPS_HIGH, delta=delta, beta=beta,
        importance_sampling_level=level, max_completion_length=MAX_LEN, kl_estimator="k3",
        use_bias_correction_kl=bias, sapo_temperature_pos=TAU_POS, sapo_temperature_neg=TAU_NEG_AS_TRL,
        off_policy_mask_threshold=off_policy,
    )
    selection = None if quantile == 1.0 else high_entropy_mask(d["ent"], d["mask"], quantile)
    batch = PolicyLossBatch(logps=logps, advantages=d["adv"], mask=d["mask"], old_logps=d["old"],
                            ref_logps=d["ref"], weights=weights, sampling_logps=d["sampling"], selection=selection)
    loss, stats = policy_loss(loss_type, batch, settings)
    loss.backward()
    return loss.detach(), logps.grad, stats


def metric_differences(loss_type: str, level: str, trl: dict, stats: dict, beta: float) -> float:
    """|TRL metric − ours| for the token-mean metrics both report (kl, clip ratios)."""
    n = stats["token_count"]
    pairs = []
    if beta and level == "token":
        pairs.append((trl["kl"], stats["kl_sum"] / n))
    if loss_type == "cispo":
        pairs.append((trl["cispo_clip_ratio"], stats["clipped_high"] / n))
    elif loss_type not in ("sapo", "vespo") and level == "token":
        pairs += [(trl["clip_ratio/low_mean"], stats["clipped_low"] / n),
                  (trl["clip_ratio/high_mean"], stats["clipped_high"] / n),
                  (trl["clip_ratio/region_mean"], stats["clipped_region"] / n)]
    return max((abs(float(a) - float(b)) for a, b in pairs), default=0.0)


def cases():
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        for level in ("token", "sequence"):
            yield loss_type, level, {"beta": 0.0, "bias": False, "delta": None, "is": None}
            yield loss_type, level, {"beta": 0.04, "bias": False, "delta": None, "is": None}
            yield loss_type, level, {"beta": 0.04, "bias": True, "delta": None, "is": None}
        if loss_type not in ("cispo", "sapo", "vespo"):  # delta caps the clipped objective's ratio only
            yield loss_type, "token", {"beta": 0.0, "bias": False, "delta": DELTA, "is": None}
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
            if loss_type == "vespo" and mode.startswith("sequence"):
                continue  # TRL refuses them for VESPO, and so do we
            yield loss_type, "token", {"beta": 0.04, "bias": True, "delta": None, "is": (mode, 1.3, 0.8)}
        yield loss_type, "token", {"beta": 0.04, "bias": True, "delta": None, "is": None, "off_policy": 0.1}
        yield loss_type, "token", {"beta": 0.04, "bias": True, "delta": None, "is": None, "quantile": 0.2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the per-case differences here")
    args = parser.parse_args()
    d = fixed_tensors()
    rows, worst = [], {"loss": 0.0, "grad": 0.0, "metric": 0.0, "is_weight": 0.0}
    for loss_type, level, c in cases():
        trl_ratio = weights = None
        is_diff = 0.0
        if c["is"] is not None:
            mode, clip_max, clip_min = c["is"]
            trl_ratio = trl_is_ratio(d, mode, clip_max, clip_min)
            ours_is = importance_sampling_weights(
                d["sampling"], d["old"], d["mask"], ImportanceSamplingSettings(mode, clip_max, clip_min)
            )
            weights = ours_is.weights
            is_diff = float(((weights - trl_ratio.expand_as(weights)) * d["mask"]).abs().max())
        kw = {"level": level, "beta": c["beta"], "bias": c["bias"], "delta": c["delta"],
              "off_policy": c.get("off_policy"), "quantile": c.get("quantile", 1.0)}
        t_loss, t_grad, t_metrics = trl_loss(d, loss_type, is_ratio=trl_ratio, **kw)
        o_loss, o_grad, o_stats = our_loss(d, loss_type, weights=weights, **kw)
        row = {
            "loss_type": loss_type, "level": level, "beta": c["beta"], "bias_correction_kl": c["bias"],
            "delta": c["delta"], "importance_sampling": c["is"][0] if c["is"] else None,
            "off_policy_mask_threshold": c.get("off_policy"), "top_entropy_quantile": c.get("quantile", 1.0),
            "trl_loss": float(t_loss), "loss_diff": float((t_loss - o_loss).abs()),
            "grad_max_diff": float((t_grad - o_grad).abs().max()),
            "metric_max_diff": metric_differences(loss_type, level, t_metrics, o_stats, c["beta"]),
            "is_weight_max_diff": is_diff,
        }
        rows.append(row)
        for key, name in (("loss", "loss_diff"), ("grad", "grad_max_diff"), ("metric", "metric_max_diff"),
                          ("is_weight", "is_weight_max_diff")):
            worst[key] = max(worst[key], row[name])
    header = f"{'loss_type':8} {'level':8} {'beta':>5} {'bias':>5} {'delta':>5} {'IS mode':17} {'mask':9} " \
             f"{'TRL loss':>11} {'|Δloss|':>9} {'max|Δgrad|':>10} {'|Δmetric|':>9} {'|ΔIS w|':>8}"
    print(header)
    for r in rows:
        mask = (f"opsm={r['off_policy_mask_threshold']}" if r["off_policy_mask_threshold"] is not None else
                f"top={r['top_entropy_quantile']}" if r["top_entropy_quantile"] < 1 else "-")
        print(f"{r['loss_type']:8} {r['level']:8} {r['beta']:5} {r['bias_correction_kl']!s:>5} {r['delta']!s:>5} "
              f"{r['importance_sampling'] or '-':17} {mask:9} {r['trl_loss']:11.6f} {r['loss_diff']:9.1e} "
              f"{r['grad_max_diff']:10.1e} {r['metric_max_diff']:9.1e} {r['is_weight_max_diff']:8.1e}")
    print(f"\n{len(rows)} cases, float64. Max differences vs TRL 1.16: loss {worst['loss']:.2e}, "
          f"gradient {worst['grad']:.2e}, metrics {worst['metric']:.2e}, IS weights {worst['is_weight']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max": worst, "cases": rows}, f, indent=1)
    if max(worst.values()) > 1e-12:
        raise SystemExit("differences above 1e-12")


if __name__ == "__main__":
    main()
