"""The entropy-bonus coefficient of a GRPO run: fixed, or adaptive (Skywork-OR1, TRL's ``use_adaptive_entropy``).

Adaptive control, per optimizer step, with H the step's mean per-token entropy over the tokens the policy
term trains on (all ranks): the bonus of the step uses ``coef`` only while the *previous* step's H was at
or below ``target`` (0 otherwise; no measurement yet counts as above), and after the step
``coef ← min(coef + delta, coef_max)`` if H <= target, else ``max(coef − delta, coef_min)``. So the bonus
switches on when the entropy collapses towards the target and fades when it recovers.
State is two floats; ``state_dict`` / ``load_state_dict`` make a resumed run continue exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class EntropyControl:
    """``coef``: the coefficient; adaptive when ``adaptive`` (bounds, step and target as in the module docstring)."""

    coef: float
    adaptive: bool = False
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005
    target: float = 0.2
    last_entropy: float = math.inf

    @property
    def enabled(self) -> bool:
        """Whether the loss carries an entropy bonus at all (needs entropies with gradient)."""
        return self.adaptive or self.coef != 0.0

    def applied(self) -> float:
        """The coefficient this optimizer step's loss uses."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step whose trained tokens had mean entropy ``entropy`` (adaptive only)."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])
        self.last_entropy = float(state["last_entropy"])
