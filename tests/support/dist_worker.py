"""One rank of the multi-process tests: ``python tests/support/dist_worker.py MODE OUT_DIR SPEC_JSON``.

tests/distributed/test_distributed.py starts one of these per rank with the environment a launcher sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT); accelerate then joins them
in a gloo process group on the CPU. Each rank writes its results to ``OUT_DIR/<name>_rank<R>.*``
(never into the trainer's output_dir, whose writers the ``train`` mode audits).

Modes:
  draws  a short GRPO or PPO run (``"algorithm"``) whose reward records the dataset rows it scores;
         saves those row ids per round and the logged epochs.
  contract  the strategy contract (tests/distributed/test_strategy_contract.py) on a fixed global batch (this
         rank's slice): an evaluation, gradients (where whole), loss and global gradient norm of real
         steps at learning rate 0, the NaN skip, a checkpoint round trip and a no-sync micro-batch,
         in one launch. Under ZeRO-3 the (partitioned) trainable weights are gathered to be set or read.
  train  a short GRPO run (optionally resumed, or preempted right after the save at some step;
         ``"lora": false`` fine-tunes the whole model); saves the trainable weights and every
         write this rank made under output_dir.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def even_token_fraction(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                        **kwargs: Any) -> list[float]:
    """A reward that varies within every group, even for the random tiny model: the share of even token ids."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as a plain whole tensor: FSDP's sharded DTensors are all-gathered (every rank must call)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def deterministic_trainable_init(model: torch.nn.Module) -> None:
    """Set every trainable parameter from a generator seeded by its name (same in any process)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) % 100_003
                value = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.05
                if isinstance(param, DTensor):  # FSDP: keep this rank's slice
                    value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                param.copy_(value)


def fixed_global_batch(n: int = 16, prompt_len: int = 6, completion_len: int = 7) -> dict[str, torch.Tensor]:
    """A fixed batch whose second half has far more valid completion tokens than the first; in the
    first half consecutive rows share their prompt in pairs (the log-prob forward's prompt sharing)."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(5, 500, (n, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[::3, :2] = 0
    half = n // 2
    prompt[1:half:2], prompt_mask[1:half:2] = prompt[0:half:2], prompt_mask[0:half:2]
    completion = torch.randint(5, 500, (n, completion_len), generator=g)
    lengths = torch.tensor([1, 2, 1, 3, 2, 1, 2, 1] + [7, 6, 7, 5, 7, 7, 6, 7])[:n]
    completion_mask = (torch.arange(completion_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {
        "prompt_ids": prompt,
        "prompt_mask": prompt_mask,
        "completion_ids": completion,
        "completion_mask": completion_mask,
        "rewards": torch.randn(n, generator=g),
        "old_logps": -3 - torch.rand(n, completion_len, generator=g),
        "ref_logps": -3 - torch.rand(n, completion_len, generator=g),
    }


def _experience(tensors: dict[str, torch.Tensor]) -> Any:
    from helpers import make_experience

    return make_experience(**tensors)


def step_gradients(trainer: Any, tensors: dict[str, torch.Tensor], loss_type: str) -> tuple[list[torch.Tensor], float]:
    """Gradients of one optimizer step over all rows of ``tensors`` (the step itself is not taken)."""
    from helpers import intercept_optimizer_steps, run_round

    captured: list[list[torch.Tensor]] = []

    def capture(params: list[torch.nn.Parameter], finite: torch.Tensor) -> tuple[float, bool]:
        captured.append([whole(p.grad.detach()).clone() for p in params])
        trainer.optimizer.zero_grad(set_to_none=True)
        return 0.0, True

    intercept_optimizer_steps(trainer, capture)
    trainer.args.loss_type = loss_type
    trainer.max_steps = trainer.step + 1
    record = run_round(trainer, _experience(tensors))
    return captured[0], record["loss"]


def step_loss_and_norm(trainer: Any, tensors: dict[str, torch.Tensor], loss_type: str) -> dict[str, float]:
    """Loss and pre-clipping global gradient norm of one real optimizer step (taken at learning rate 0)."""
    from helpers import run_round

    trainer.scheduler.base_lrs = [0.0] * len(trainer.scheduler.base_lrs)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0
    trainer.args.loss_type = loss_type
    trainer.max_steps = trainer.step + 1
    record = run_round(trainer, _experience(tensors))
    return {"loss": record["loss"], "grad_norm": record["grad_norm"]}


def nan_then_finite_step(trainer: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A step whose gradient is NaN on this rank only (rank 0), then a finite one, at a real learning rate."""
    from helpers import run_round

    trainer.scheduler.base_lrs = [1e-2] * len(trainer.scheduler.base_lrs)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1e-2
    trainer.max_steps = trainer.step + 2

    def step(poison: bool) -> dict[str, float]:
        t = dict(tensors)
        if poison and int(os.environ["RANK"]) == 0:
            t["rewards"] = t["rewards"].clone()
            t["rewards"][0] = float("nan")
        return run_round(trainer, _experience(t))

    before = trainable_weights(trainer)
    bad = step(poison=True)
    after_bad = trainable_weights(trainer)
    step(poison=False)
    after_good = trainable_weights(trainer)
    return {
        "skipped_steps": trainer.skipped_steps,
        "bad_grad_norm": bad["grad_norm"],
        "untouched": all(torch.equal(a, b) for a, b in zip(before, after_bad)),
        "moved": any(not torch.equal(a, b) for a, b in zip(after_bad, after_good)),
        "finite_after": all(bool(torch.isfinite(w).all()) for w in after_good),
    }


def trainable_weights(trainer: Any) -> list[torch.Tensor]:
    """Whole copies of the trainable parameters (every rank must call: partitions are gathered)."""
    with trainer.checkpointer.gathered():
        return [whole(p.detach()).clone() for p in trainer.policy.parameters() if p.requires_grad]


def _max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def checkpoint_round_trip(trainer: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Save, take a step, load the save back, take the same step again: the load restores the saved
    weights and the replayed step (weights, optimizer state, loss, grad norm) equals the first; then
    ``load_best_model_at_end`` with the save as the best restores the saved weights again."""
    from helpers import run_round

    from grpo_ascend.trainers.run_state import BestCheckpoint

    def step() -> dict[str, float]:
        trainer.max_steps = trainer.step + 1
        record = run_round(trainer, _experience(tensors))
        return {"loss": record["loss"], "grad_norm": record["grad_norm"]}

    # A constant learning rate (the run's schedule has ended at max_steps; functions are not checkpointed).
    trainer.scheduler.lr_lambdas = [lambda _: 1.0] * len(trainer.scheduler.lr_lambdas)
    trainer.scheduler.base_lrs = [1e-2] * len(trainer.scheduler.base_lrs)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1e-2
    trainer.save_checkpoint()
    saved_step = trainer.step
    saved = trainable_weights(trainer)
    first = step()
    after_first = trainable_weights(trainer)
    trainer.load_checkpoint(Path(trainer.args.output_dir) / f"checkpoint-{saved_step}")
    restored = trainable_weights(trainer)
    loaded_step = trainer.step
    second = step()
    after_second = trainable_weights(trainer)
    # load_best_model_at_end with the saved checkpoint as the best: its weights come back.
    trainer.run.best = BestCheckpoint(saved_step, 0.0, "eval/reward")
    assert trainer.load_best_model()
    best = trainable_weights(trainer)
    return {"restored_diff": _max_difference(saved, restored), "replayed_diff": _max_difference(after_first, after_second),
            "moved": _max_difference(saved, after_first), "first": first, "second": second,
            "saved_step": saved_step, "loaded_step": loaded_step, "best_diff": _max_difference(saved, best)}


def unsynced_micro_batch(trainer: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Forward and backward of this rank's rows inside the strategy's ``no_sync`` for a micro-batch that is
    not the step's last; reports what each engine shows of an unreduced gradient (run last: the
    accumulated gradient is left in place)."""
    model = trainer.logprob_model
    inputs = [tensors[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    trainer.policy.train()
    with trainer.strategy.no_sync(model, last=False):
        logps, _ = model(*inputs, temperature=1.0)
        trainer.strategy.backward(model, (logps * tensors["completion_mask"]).sum())
    boundary = getattr(model, "is_gradient_accumulation_boundary", None)
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    return {"boundary": boundary() if callable(boundary) else None,
            "grads_present": sum(p.grad is not None for p in params),
            "grad_norms": [float(p.grad.norm()) for p in params if p.grad is not None]}


def contract_evaluation(trainer: Any) -> dict[str, float]:
    """``evaluate()`` on 5 prompts in chunks of 2 (2 generations each): rank 0 makes 2 engine calls, rank 1
    one (ZeRO-3 and FSDP2 gather the whole weights once for all of them)."""
    from grpo_ascend.data.synthetic import arithmetic_dataset

    trainer.args.per_device_eval_batch_size = 4
    trainer.args.eval_pass_threshold = 0.5
    return trainer.evaluate(arithmetic_dataset(5, seed=5))


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's rows of the global batch, its completions as wide as its longest (as a rollout pads).

    The ranks then differ in width, in head chunks (logprob_chunk_size=8) and in prompt sharing, and
    must still agree (ZeRO-3 and FSDP gather weights collectively at every module call).
    """
    per_rank = batch["completion_ids"].shape[0] // world
    mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    width = int(mine["completion_mask"].sum(1).max())
    return {k: v[:, :width] if k in ("completion_ids", "completion_mask", "old_logps", "ref_logps")
            else v for k, v in mine.items()}


def run_contract(out: Path, spec: dict[str, Any], rank: int, world: int) -> None:
    """The strategy contract in one launch: elementwise gradients (where the engine keeps them whole),
    loss and global gradient norm of real steps, the NaN skip, and a checkpoint round trip."""
    from helpers import restore_optimizer_steps

    cfg = grads_config(str(out / "run"), world)
    if "max_grad_norm" in spec:
        cfg = cfg.replace(max_grad_norm=spec["max_grad_norm"])
    trainer = make_trainer(spec["model_dir"], cfg)
    with trainer.checkpointer.gathered(modifier_rank=0):  # ZeRO-3: rank 0's values are partitioned back
        deterministic_trainable_init(trainer.policy)
    zero = getattr(trainer.optimizer, "optimizer", None)
    if hasattr(zero, "_restore_from_bit16_weights"):  # ZeRO's fp32 master copy of the re-initialised weights
        zero._restore_from_bit16_weights()
    mine = rank_slice(fixed_global_batch(), rank, world)
    results: dict[str, Any] = {"strategy": trainer.strategy.name, "sharded": sharded(trainer)}
    results["eval"] = contract_evaluation(trainer)  # first: the steps below then show it changed nothing
    if spec.get("elementwise"):
        for loss_type in spec["loss_types"]:
            grads, loss = step_gradients(trainer, mine, loss_type)
            results[f"grads/{loss_type}"] = {"grads": grads, "loss": loss}
        if spec.get("token_budget"):  # token-budget micro-batches: the ranks pack different counts
            trainer.micro_batcher.token_budget = spec["token_budget"]
            for loss_type in spec["loss_types"]:
                grads, loss = step_gradients(trainer, mine, loss_type)
                results[f"budget_grads/{loss_type}"] = {"grads": grads, "loss": loss}
            trainer.micro_batcher.token_budget = None
        restore_optimizer_steps(trainer)  # back to the strategy's step
    for loss_type in spec["loss_types"]:
        results[loss_type] = step_loss_and_norm(trainer, mine, loss_type)
    if spec.get("token_budget"):
        trainer.micro_batcher.token_budget = spec["token_budget"]
        for loss_type in spec.get("budget_loss_types", spec["loss_types"]):
            results[f"budget/{loss_type}"] = {**step_loss_and_norm(trainer, mine, loss_type),
                                              "micro_batches": trainer.run.step_micro_batches}
        trainer.micro_batcher.token_budget = None
    results["nan_step"] = nan_then_finite_step(trainer, mine)
    results["round_trip"] = checkpoint_round_trip(trainer, mine)
    results["no_sync"] = unsynced_micro_batch(trainer, mine)
    torch.save(results, out / f"contract_rank{rank}.pt")


def grads_config(output_dir: str, world_size: int) -> Any:
    """Config for the gradient comparison: one optimizer step over 16 completions in total."""
    from grpo_ascend import GRPOConfig

    accum = 4 // world_size
    return GRPOConfig(
        output_dir=output_dir, num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=accum,
        steps_per_generation=accum, max_completion_length=7, max_prompt_length=96, beta=0.04, max_steps=1,
        save_steps=0, disable_tqdm=True, log_completions_steps=0, seed=0, length_bucket=16, logprob_chunk_size=8,
    )


def make_trainer(model_dir: str, cfg: Any, dataset_size: int = 8, dataset_seed: int = 3, lora: bool = True) -> Any:
    """A GRPO trainer on the tiny model: LoRA rank 4, or full fine-tuning with ``lora=False``."""
    from grpo_ascend import GRPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.models.policy import default_lora_config

    return GRPOTrainer(model_dir, even_token_fraction, cfg, arithmetic_dataset(dataset_size, seed=dataset_seed),
                       peft_config=default_lora_config(r=4) if lora else None)


class WriteAudit:
    """Records every write-like file operation under ``root`` (an audit hook; see sys.addaudithook)."""

    EVENTS = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate", "os.symlink")

    def __init__(self, root: Path):
        self.root = os.path.abspath(root)
        self.writes: list[str] = []
        self.active = True
        sys.addaudithook(self)

    def _inside(self, path: Any) -> bool:
        if isinstance(path, int):
            return False
        try:
            full = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return False
        return full == self.root or full.startswith(self.root + os.sep)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        if event == "open":
            path, mode, flags = args
            if mode is not None:
                writing = any(c in mode for c in "wax+")
            else:
                writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writing and self._inside(path):
                self.writes.append(f"open {path}")
        elif event in self.EVENTS and args and self._inside(args[0]):
            self.writes.append(f"{event} {args[0]}")


def sharded(trainer: Any) -> dict[str, Any]:
    """How FSDP split the policy: the number of fully_shard units and whether the weights are DTensors."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return {"units": 0, "dtensor": False}
    units = sum(isinstance(m, FSDPModule) for m in trainer.logprob_model.modules())
    return {"units": units, "dtensor": any(isinstance(p, DTensor) for p in trainer.policy.parameters())}


def run_train(out: Path, spec: dict[str, Any], rank: int) -> None:
    from helpers import Preempted, preempt_after_save

    from grpo_ascend import GRPOConfig

    settings = {
        "num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
        "steps_per_generation": 2, "max_completion_length": 10, "max_prompt_length": 96, "learning_rate": 5e-3,
        "max_steps": 4, "save_steps": 2, "logging_steps": 1, "disable_tqdm": True, "log_completions_steps": 2,
        "seed": 0, "lr_scheduler_type": "constant", "length_bucket": 16, "beta": 0.02,
        **spec.get("config", {}),
    }
    cfg = GRPOConfig(**settings)
    audit = WriteAudit(Path(cfg.output_dir))
    trainer = make_trainer(spec["model_dir"], cfg, dataset_size=12, lora=spec.get("lora", True))
    stop_after = spec.get("stop_after_step")
    if stop_after is not None:
        preempt_after_save(trainer, stop_after)  # raises Preempted right after that save
    status = "finished"
    try:
        trainer.train(resume_from_checkpoint=spec.get("resume"))
    except Preempted:
        status = "preempted"
    audit.active = False
    with trainer.checkpointer.gathered():  # ZeRO-3 partitions them; every rank takes part
        weights = {k: whole(v.detach()).cpu().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}
    torch.save(weights, out / f"weights_rank{rank}.pt")
    # Parameters this rank holds only a slice of (DeepSpeed ZeRO-3 partitions; none otherwise).
    partitioned = [n for n, p in trainer.policy.named_parameters() if p.numel() < getattr(p, "ds_numel", p.numel())]
    report = {"status": status, "step": trainer.step, "world_size": trainer.accelerator.num_processes,
              "backend": trainer.accelerator.state.backend, "writes": audit.writes,
              "partitioned": partitioned, "parameters": len(list(trainer.policy.parameters())),
              "distributed_type": trainer.accelerator.distributed_type.value, "sharded": sharded(trainer)}
    (out / f"report_rank{rank}.json").write_text(json.dumps(report, indent=1))


def recording_trainer(model_dir: str, algorithm: str, output_dir: str, world: int) -> tuple[Any, list[list[int]]]:
    """A GRPO or PPO trainer over 10 numbered prompts (4 per round in total, whatever ``world``) whose
    reward records the row ids it scores, one list per round."""
    from grpo_ascend import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.models.policy import default_lora_config

    seen: list[list[int]] = []

    def record(completions: list[Any], row_id: list[int], **kwargs: Any) -> list[float]:
        seen.append(sorted(row_id[::2]))  # one id per group of num_generations=2
        return [0.0] * len(completions)

    common = dict(output_dir=output_dir, num_generations=2, per_device_train_batch_size=8 // world, max_steps=3,
                  max_completion_length=4, max_prompt_length=96, save_steps=0, disable_tqdm=True,
                  log_completions_steps=0, seed=0, length_bucket=16)
    dataset = arithmetic_dataset(10, seed=3)
    dataset = dataset.add_column("row_id", list(range(len(dataset))))
    if algorithm == "ppo":
        cls, cfg = PPOTrainer, PPOConfig(**common, ppo_epochs=1, num_mini_batches=1)
    else:
        cls, cfg = GRPOTrainer, GRPOConfig(**common)
    return cls(model_dir, record, cfg, dataset, peft_config=default_lora_config(r=4)), seen


def run_draws(out: Path, spec: dict[str, Any], rank: int, world: int) -> None:
    trainer, seen = recording_trainer(spec["model_dir"], spec["algorithm"], str(out / f"run_rank{rank}"), world)
    trainer.train()
    epochs = [record["epoch"] for record in trainer.tracker.history]
    (out / f"draws_rank{rank}.json").write_text(json.dumps({"rounds": seen, "epochs": epochs}))


def main() -> int:
    mode, out, spec = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out.mkdir(parents=True, exist_ok=True)
    if mode == "train":
        run_train(out, spec, rank)
    elif mode == "contract":
        run_contract(out, spec, rank, world)
    elif mode == "draws":
        run_draws(out, spec, rank, world)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    raise SystemExit(main())
