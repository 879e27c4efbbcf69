"""The policy-loss tests' shared inputs and their one hand-written reference: TRL 1.16's per-token
objectives and aggregations from the published formulas, one sequence and one token at a time."""

from __future__ import annotations

import torch

EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 10
# Ratios crossing 1−ε (0.8) and 1+ε_high (1.28) on both sides of 1, plus one above delta=2.0.
RATIOS = [0.5, 0.79, 0.95, 1.0, 1.1, 1.3, 2.5, 0.7]
CISPO_CAP = 1.2  # below some ratios of make_data (1.3, 2.5) so the cap binds
TAU_POS, TAU_NEG = 1.0, 1.05


def make_data(batch: int = 8, length: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3 - 0.1
    ratio = torch.tensor(
        [RATIOS[(i * length + t) % len(RATIOS)] for i in range(batch) for t in range(length)]
    )
    ratio = ratio.view(batch, length).to(torch.float64)
    old = logps - torch.log(ratio)
    ref = logps + torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.3
    entropies = torch.rand(batch, length, generator=g, dtype=torch.float64) * 2
    lengths = torch.tensor([6, 3, 1, 5, 0, 6, 2, 4][:batch]) % (length + 1)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    # Garbage at padded positions must not leak into values or gradients.
    old = torch.where(mask.bool(), old, torch.full_like(old, -1000.0))
    ref = torch.where(mask.bool(), ref, torch.full_like(ref, 1000.0))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 1.2, -0.3, 0.8, -1.5][:batch], dtype=torch.float64)
    return {"logps": logps, "old": old, "ref": ref, "ent": entropies, "mask": mask, "adv": adv}


def kl_value(name: str, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The k1 / k2 / k3 estimators of KL(π ‖ π_ref) at one token."""
    x = ref - logp
    return {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - x - 1}[name]


def reference_loss(loss_type: str, d: dict[str, torch.Tensor], logps: torch.Tensor, ent: torch.Tensor | None = None,
                   *, level: str = "token", delta: float | None = None, beta: float = 0.0, kl: str = "k3",
                   bias: bool = False, weights: torch.Tensor | None = None, ent_coef: float = 0.0,
                   eps_high: float | None = None) -> torch.Tensor:
    """The loss of one optimizer step on one rank; ``eps_high`` defaults to CISPO_CAP for cispo, else EPS_HIGH."""
    if eps_high is None:
        eps_high = CISPO_CAP if loss_type == "cispo" else EPS_HIGH
    batch, length = logps.shape
    seq_means, token_total, n_tokens = [], torch.zeros((), dtype=torch.float64), 0
    for i in range(batch):
        valid = [t for t in range(length) if d["mask"][i, t] > 0]
        n_tokens += len(valid)
        if not valid:
            seq_means.append(torch.zeros((), dtype=torch.float64))
            continue
        if level == "sequence":
            # GSPO: s_i = (π(y_i)/π_old(y_i))^(1/|y_i|), gradient through the whole sequence.
            s_i = torch.exp(sum(logps[i, t] - d["old"][i, t] for t in valid) / len(valid))
        seq_total = torch.zeros((), dtype=torch.float64)
        for t in valid:
            r = torch.exp(logps[i, t] - d["old"][i, t]) if level == "token" else s_i
            a = d["adv"][i]
            if loss_type == "cispo":
                term = -torch.clamp(r.detach(), max=eps_high) * a * logps[i, t]
            elif loss_type == "sapo":
                tau = TAU_POS if a > 0 else TAU_NEG
                term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            else:
                r_capped = torch.clamp(r, max=delta) if delta is not None else r
                term = -torch.minimum(r_capped * a, torch.clamp(r, 1 - EPS, 1 + eps_high) * a)
            if weights is not None:
                term = term * (weights[i] if weights.dim() == 1 else weights[i, t])
            if beta:
                k = kl_value(kl, logps[i, t], d["ref"][i, t])
                term = term + beta * (k * r if bias else k)
            seq_total = seq_total + term
        seq_means.append(seq_total / len(valid))
        token_total = token_total + seq_total
    # TRL's entropy bonus: the mean per-token entropy over the step's valid tokens, whatever the loss type
    bonus = ent_coef * sum(ent[i, t] for i in range(batch) for t in range(length) if d["mask"][i, t] > 0) / max(
        n_tokens, 1) if ent_coef else 0.0
    if loss_type in ("grpo", "sapo"):
        return sum(seq_means) / batch - bonus
    if loss_type in ("bnpo", "dapo", "cispo"):  # one step, one rank: all three are the token mean
        return token_total / n_tokens - bonus
    if loss_type == "dr_grpo":
        return token_total / (batch * MAX_LEN) - bonus
    raise AssertionError(loss_type)
