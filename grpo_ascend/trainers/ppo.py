"""PPO for causal LMs: a critic, KL-penalised token rewards, GAE, clipped policy and value losses.

Same API as :class:`~grpo_ascend.trainers.grpo.GRPOTrainer` (and the same engine, rewards, loss
registry, checkpoints and metrics)::

    trainer = PPOTrainer(model="builtin:tiny-warm", reward_funcs=[accuracy], args=PPOConfig(...),
                         train_dataset=dataset, peft_config=LoraConfig(...))
    trainer.train()

One rollout batch (``per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches``
completions per device):

1. sample completions and score them (one score per completion);
2. log-probs under the sampling policy (the engine's, exact in fp32) and the reference (base with
   adapters disabled), values from the critic — one no-grad forward each;
3. token rewards ``r_t = −β·(log π − log π_ref)_t`` plus the score on the last completion token,
   β from a fixed or adaptive KL controller;
4. GAE (vectorised, ``gamma``/``lam``), advantages whitened over valid tokens (all ranks);
5. everything the update needs goes into the on-device :class:`RolloutBuffer` (preallocated
   ring, pointer modulo capacity, written with one ``index_copy_`` per field, read by index);
6. ``ppo_epochs`` passes × ``num_mini_batches`` optimizer steps, each accumulating
   ``gradient_accumulation_steps`` micro-batches of: critic forward + clipped value loss
   (``cliprange_value``, × ``vf_coef``) backward with the critic adapter active, then policy
   forward + the registry's clipped policy loss (``loss_type``, default ``bnpo`` = token mean, with
   ``entropy_coef``) backward; one clipped optimizer step over policy and critic parameters.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_ascend.algorithms.gae import gae_advantages
from grpo_ascend.algorithms.kl_control import make_kl_controller, token_rewards
from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
    ppo_value_loss,
)
from grpo_ascend.config import PPOConfig
from grpo_ascend.critic import (
    Critic,
    active_adapter,
    build_critic,
    enable_critic_grads,
    preserve_requires_grad,
)
from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.buffer import FieldSpec, RolloutBuffer
from grpo_ascend.rollout.kv_cache import round_up
from grpo_ascend.trainers.base import RLTrainerBase, Round

# Per-completion fields the update reads back from the rollout buffer: (completion-side?, dtype).
_BUFFER_FIELDS = {
    "prompt_ids": (False, torch.long),
    "prompt_mask": (False, torch.long),
    "completion_ids": (True, torch.long),
    "completion_mask": (True, torch.long),
    "old_logps": (True, torch.float32),
    "values": (True, torch.float32),
    "advantages": (True, torch.float32),
    "returns": (True, torch.float32),
}


class PPOTrainer(RLTrainerBase):
    """PPO trainer on accelerate; ``model`` is a path, hub id, ``builtin:*`` name or a loaded model."""

    config_class = PPOConfig
    args: PPOConfig
    prepared_models = 2  # policy and critic: engines that take one model per run refuse PPO

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: PPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ):
        cfg = args if args is not None else PPOConfig()
        if not isinstance(cfg, PPOConfig):
            raise ConfigError(f"args must be a PPOConfig, got {type(cfg).__name__}")
        POLICY_LOSSES.get(cfg.loss_type)  # fail before loading anything on a bad name
        self.loss_settings = PolicyLossSettings(
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            entropy_coef=cfg.entropy_coef,
            max_completion_length=cfg.max_completion_length,
        )
        self.kl_ctl = make_kl_controller(cfg.kl_coef, cfg.adaptive_kl, cfg.target_kl, cfg.kl_horizon)
        self.critic: Critic | None = None
        super().__init__(model, reward_funcs, cfg, train_dataset, processing_class, peft_config)
        critic = self._critic
        # The policy's data-parallel wrapper exists now without the critic's parameters; the critic
        # gets its own wrapper over exactly its trainable parameters.
        enable_critic_grads(critic)
        self.critic_model = self.accelerator.prepare(critic.module)
        critic_ids = {id(p) for p in critic.trainable}
        self._policy_params = [p for p in self.policy.parameters() if p.requires_grad and id(p) not in critic_ids]
        self._ckpt_module: nn.Module = self.policy
        if critic.owned is not None:  # full fine-tuning: the critic's own backbone is checkpointed too
            self._ckpt_module = nn.ModuleDict({"policy": self.policy, "critic": critic.owned})
        self.use_reference = cfg.kl_coef > 0
        if self.use_reference:
            self._setup_reference()

        round_size = self.plan.completions_per_generation // self.accelerator.num_processes
        capacity = cfg.rollout_buffer_size or round_size
        if capacity < round_size:
            raise ConfigError(
                f"rollout_buffer_size ({capacity}) is smaller than one rollout batch on this device ({round_size} "
                "completions); raise it or leave it unset"
            )
        self.buffer_capacity = capacity
        self.buffer: RolloutBuffer | None = None
        self._buffer_widths = (0, 0)
        self._widths = (0, 0)
        self._round_tokens = torch.zeros((), device=self.device)

    # ------------------------------------------------------------------------------ setup
    def _extra_trainable_parameters(self) -> list[nn.Parameter]:
        """Build the critic (the base calls this before it creates the optimizer)."""
        self.critic = build_critic(self.policy, self.args.critic_init, self.args.critic_model)
        self.critic.module.share_prompts = self.args.share_prompt_prefill
        return list(self.critic.trainable)

    @property
    def _critic(self) -> Critic:
        if self.critic is None:
            raise RuntimeError("the critic is built during RLTrainerBase.__init__")
        return self.critic

    def _trainable_module(self) -> nn.Module:
        """Policy adapter(s) + critic adapter and head (LoRA), or policy + critic modules (full)."""
        return self._ckpt_module

    # ------------------------------------------------------------------------------ buffer
    def _ensure_buffer(self, prompt_width: int, completion_width: int) -> RolloutBuffer:
        """Allocate the ring buffer once at the largest widths the engine can return (bucketed
        max_prompt_length / max_completion_length); grow only when max_prompt_length is unset."""
        args = self.args
        width_p = round_up(args.max_prompt_length, self.length_bucket) if args.max_prompt_length else prompt_width
        width_c = max(round_up(args.max_completion_length, self.length_bucket), completion_width)
        if self.buffer is not None and prompt_width <= self._buffer_widths[0] and completion_width <= self._buffer_widths[1]:
            return self.buffer
        width_p = max(width_p, prompt_width)
        fields = {
            name: FieldSpec((width_c if completion_side else width_p,), dtype)
            for name, (completion_side, dtype) in _BUFFER_FIELDS.items()
        }
        self.buffer = RolloutBuffer(self.buffer_capacity, fields, device=self.device)
        self._buffer_widths = (width_p, width_c)
        return self.buffer

    def _write_buffer(self, tensors: dict[str, Tensor]) -> None:
        prompt_width, completion_width = tensors["prompt_ids"].shape[1], tensors["completion_ids"].shape[1]
        buffer = self._ensure_buffer(prompt_width, completion_width)
        width_p, width_c = self._buffer_widths
        pad = self.tokenizer.pad_token_id
        batch = {}
        for name, (completion_side, dtype) in _BUFFER_FIELDS.items():
            x = tensors[name].to(dtype)
            extra = (width_c if completion_side else width_p) - x.shape[1]
            value = pad if name.endswith("_ids") else 0
            # Prompts are left-padded, completions right-padded, as the engine returns them.
            batch[name] = F.pad(x, (0, extra) if completion_side else (extra, 0), value=value) if extra else x
        buffer.add(**batch)
        self._widths = (prompt_width, completion_width)

    def _read_buffer(self, rows: Tensor, round_size: int) -> dict[str, Tensor]:
        """Rows of the newest rollout batch (device indices, no host sync), cut to its widths."""
        assert self.buffer is not None
        data = self.buffer.get(rows + (self.buffer.size - round_size))
        width_p, width_c = self._widths
        for name, (completion_side, _) in _BUFFER_FIELDS.items():
            x = data[name]
            data[name] = x[:, :width_c] if completion_side else x[:, x.shape[1] - width_p :]
        return data

    # ------------------------------------------------------------------------------ rollouts
    @torch.no_grad()
    def _forward_values(self, rnd: Round) -> Tensor:
        """Critic values [B, Tc] of every completion token state, in micro-batches, without grad."""
        t, out = rnd.tensors, []
        size = self.args.per_device_train_batch_size
        self.critic_model.eval()
        with active_adapter(self.policy, self._critic.adapter):
            for start in range(0, rnd.size, size):
                sl = slice(start, start + size)
                out.append(self.critic_model(t["prompt_ids"][sl], t["prompt_mask"][sl], t["completion_ids"][sl],
                                             t["completion_mask"][sl]))
        return torch.cat(out).float()

    def _global_whiten(self, x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
        """(x − mean) / std over the valid entries of every rank (unbiased variance); masked → 0."""
        m = mask.to(x.dtype)
        sums = torch.stack([(x * m).sum(), m.sum()])
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        mean = sums[0] / sums[1].clamp(min=1)
        sq = ((x - mean) ** 2 * m).sum()
        if self.accelerator.num_processes > 1:
            sq = self.accelerator.reduce(sq, reduction="sum")
        var = sq / (sums[1] - 1).clamp(min=1)
        return (x - mean) * torch.rsqrt(var + eps) * m

    def _prepare_round(self, timings: dict[str, float]) -> tuple[Round, dict[str, float]]:
        args, G = self.args, self.args.num_generations
        prompts_per_rank = self.plan.completions_per_generation // self.accelerator.num_processes // G
        rnd = self._sample_and_score(self.sampler.next_rows(prompts_per_rank), timings)
        metrics = self._completion_metrics(rnd)
        t = rnd.tensors
        mask = t["completion_mask"].float()

        start = time.perf_counter()
        # The engine's log-probs are those of the training forward, exact in fp32; under autocast
        # the training forward is recomputed so the first ratio is exactly 1.
        old_logps = (t["sampling_logprobs"].float() if self.precision == "fp32" else self._forward_logprobs(rnd)) * mask
        start = self._timed(timings, "old_logprobs", start)
        beta = self.kl_ctl.value
        ref_logps = None
        if self.use_reference:
            with preserve_requires_grad(self.policy):  # leaving disable_adapter() would freeze the critic adapter
                ref_logps = self._forward_logprobs(rnd, reference=True)
            start = self._timed(timings, "reference", start)
        values = self._forward_values(rnd) * mask
        start = self._timed(timings, "values", start)

        # Token rewards: −β·KL on every token, the sequence's score added on its last token.
        rewards, kl = token_rewards(t["rewards"], old_logps, ref_logps, mask, beta)
        non_score = -beta * kl
        advantages, returns = gae_advantages(rewards, values, mask, args.gamma, args.lam)
        raw_advantages = advantages
        if args.whiten_advantages:
            advantages = self._global_whiten(advantages, mask)
        self._write_buffer({**t, "old_logps": old_logps, "values": values, "advantages": advantages,
                            "returns": returns})
        self._timed(timings, "advantages", start)
        self._round_tokens = mask.sum()

        # Round statistics over all ranks with one gather each and one host copy.
        gather = self.accelerator.gather
        seq_kl = gather(kl.sum(1))
        tok = gather(mask.sum())
        sums = torch.stack([kl.sum(), non_score.sum(), returns.sum(), values.sum(), raw_advantages.sum(),
                            ((returns - values) * mask).sum(), ((returns - values) ** 2 * mask).sum(),
                            (returns * mask).pow(2).sum()])
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        stats = torch.cat([sums, seq_kl.mean().reshape(1), tok.sum().reshape(1)]).tolist()
        kl_sum, non_score_sum, ret_sum, val_sum, adv_sum, err_sum, err_sq, ret_sq, seq_kl_mean, n_tok = stats
        n_seq = seq_kl.numel()
        n = max(n_tok, 1.0)
        var_ret = ret_sq / n - (ret_sum / n) ** 2
        var_err = err_sq / n - (err_sum / n) ** 2
        metrics.update(
            {
                "kl": kl_sum / n,
                "kl/sequence": seq_kl_mean,
                "kl_coef": beta,
                "non_score_reward": non_score_sum / max(n_seq, 1),
                "returns/mean": ret_sum / n,
                "values/mean": val_sum / n,
                "advantages/mean": adv_sum / n,
                "explained_variance": 1.0 - var_err / var_ret if var_ret > 1e-12 else 0.0,
            }
        )
        if self.use_reference:
            self.kl_ctl.update(seq_kl_mean, n_seq)
        # The rollout tensors now live in the buffer; keep only what metrics and samples need.
        rnd.tensors = {"completion_ids": t["completion_ids"], "rewards": t["rewards"]}
        return rnd, metrics

    def _round_context(self, rnd: Round) -> dict[str, Any]:
        return {"generation_tokens_global": self._sum_over_ranks(self._round_tokens), "round_size": rnd.size}

    # ------------------------------------------------------------------------------ training
    def _optimizer_step(self, rnd: Round, rows: Tensor, round_ctx: dict[str, Any]) -> dict[str, float]:
        args, critic = self.args, self._critic
        data = self._read_buffer(rows, round_ctx["round_size"])
        loss_mask = data["completion_mask"].float()
        normaliser = self._step_normaliser(loss_mask, round_ctx["generation_tokens_global"])
        self.policy.train()
        self.critic_model.train()
        micro_batches = torch.arange(rows.numel(), device=self.device).split(args.per_device_train_batch_size)
        sums: dict[str, Tensor] = {}

        for i, m in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            inputs = (data["prompt_ids"][m], data["prompt_mask"][m], data["completion_ids"][m], data["completion_mask"][m])
            # Critic first, forward *and* backward with its adapter active (gradient checkpointing
            # recomputes the forward during backward with whatever adapter is active then).
            with self._no_sync(self.critic_model, last), active_adapter(self.policy, critic.adapter):
                values = self.critic_model(*inputs)
                v_loss, v_stats = ppo_value_loss(values, data["values"][m], data["returns"][m], loss_mask[m],
                                                 args.cliprange_value, normaliser)
                self._backward(args.vf_coef * v_loss, self.critic_model)
            with self._no_sync(self.logprob_model, last):
                logps, entropies = self.logprob_model(*inputs, temperature=args.temperature, with_entropy=True)
                if entropies is not None and not args.entropy_coef:
                    entropies = entropies.detach()
                batch = PolicyLossBatch(logps=logps, advantages=data["advantages"][m], mask=loss_mask[m],
                                        old_logps=data["old_logps"][m], entropies=entropies)
                pg_loss, stats = policy_loss(args.loss_type, batch, self.loss_settings, normaliser)
                self._backward(pg_loss)
            self._accumulate(sums, {"policy_loss": pg_loss, "value_loss": v_loss,
                                    "value_clipped": v_stats["value_clipped"], **stats})
        total = sums["policy_loss"] + args.vf_coef * sums["value_loss"]
        grad_norm, _ = self._clip_and_step(self._policy_params + critic.trainable, torch.isfinite(total))
        totals = self._reduce(sums)
        world = self.accelerator.num_processes
        n_tok = max(totals.get("token_count", 0.0), 1.0)
        return {
            "loss": (totals["policy_loss"] + args.vf_coef * totals["value_loss"]) / world,
            "policy_loss": totals["policy_loss"] / world,
            "value_loss": totals["value_loss"] / world,
            "value_clip_fraction": totals["value_clipped"] / n_tok,
            "grad_norm": grad_norm,
            **self._policy_metrics(totals),
        }

    # ------------------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> dict[str, Any]:
        return {**super()._trainer_state(), "kl_controller": self.kl_ctl.state_dict()}

    def _restore_trainer_state(self, state: dict[str, Any]) -> None:
        if "kl_controller" in state:
            self.kl_ctl.load_state_dict(state["kl_controller"])
