"""What the vLLM backend tests (tests/rollout/vllm_backend/) share: the parity bounds of the sampler's log-probs
against the trainer's, long prompts that span several KV-cache blocks, and a few training steps that move
every weight. Imports no vLLM itself."""

from __future__ import annotations

import torch

from grpo_ascend.models.policy import CompletionLogprobs
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.protocol import PromptRollout
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.inputs import RowVision

#: Parity bound of the sampler's log-probs and the trainer's recomputed ones (fp32).
PARITY = 1e-4
#: A difference that a missing sync or a stale prefix cache must exceed.
STALE = 1e-2
WORDS = "the model answers one question then the next with a short number plus a word about the city".split()


def long_prompts(n: int, words: int = 200) -> list[str]:
    """``n`` distinct prompts of ``words`` words (well over one 128-token cache block each)."""
    return [" ".join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(words)) for i in range(n)]


def recomputed(policy, batch, temperature: float, vision=None) -> torch.Tensor:
    """The trainer's log-probs of the batch's completions (its log-prob forward, with the rows' images: the batch's
    own unless ``vision`` is given), 0 where masked."""
    with torch.no_grad():
        logps, _ = CompletionLogprobs(policy)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                              batch.completion_mask, vision if vision is not None else batch.vision,
                                              temperature=temperature)
    return logps * batch.completion_mask


class Versions:
    """Successive weight versions of one policy, as the trainer's optimizer steps number them."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self, policy) -> PolicyWeights:
        self.step += 1
        return PolicyWeights(policy, self.step)


def max_error(policy, batch, temperature: float) -> float:
    return float((recomputed(policy, batch, temperature) - batch.sampling_logprobs).abs().max())


def train_steps(policy, batch, steps: int = 3, lr: float = 5e-2) -> None:
    """``steps`` AdamW steps raising the log-likelihood of the batch's completions (moves every weight used)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    policy.train()
    for _ in range(steps):
        logps, _ = CompletionLogprobs(policy)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                              batch.completion_mask, batch.vision, temperature=1.0)
        loss = -(logps * batch.completion_mask).sum() / batch.completion_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.eval()


def sampling(**overrides) -> SamplingParams:
    values = dict(num_generations=2, max_completion_length=12, temperature=0.8, max_prompt_length=None, seed=None)
    values.update(overrides)
    return SamplingParams(**values)


def image_rows(colours=((255, 0, 0), (0, 0, 255))) -> list[dict]:
    """Rows for image parity: the same question under pictures of ``colours`` (rows 0, 1), a row without images
    and a row with two pictures of other sizes."""
    from PIL import Image

    question = [{"role": "user", "content": "what colour is the shape?"}]
    rows = [{"prompt": question, "image": Image.new("RGB", (40, 30), c)} for c in colours]
    rows.append({"prompt": "a row without images"})
    rows.append({"prompt": question, "images": [Image.new("RGB", (28, 28), (9, 9, 9)),
                                                Image.new("RGB", (56, 56), (200, 9, 9))]})
    return rows


def vlm_lora_policy(model_dir, r: int = 8):
    """The vision-language model at ``model_dir`` with a LoRA adapter on its language model (as the trainer puts
    it), its B matrices drawn so that the adapter changes the output from the first sync."""
    from peft import LoraConfig

    from grpo_ascend.models.policy import apply_peft, load_causal_lm
    from grpo_ascend.models.vision_language import language_model_linear_targets

    model = load_causal_lm(str(model_dir)).eval()
    policy = apply_peft(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                          target_modules=language_model_linear_targets(model))).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return policy


#: Sampling for the image parity rounds.
IMAGE_PARAMS = SamplingParams(num_generations=3, max_completion_length=8, temperature=1.0, max_prompt_length=None)


def check_rows_read_their_own_pictures(policy, batch, parity: float) -> None:
    """Parity on every row, and the pictures matter: row 0's completions read under row 1's picture (same text)
    get other log-probs, so a sampler that mixed the rows' pictures up would fail the parity."""
    assert batch.prompt_ids.shape[0] == 12 and batch.vision.rows[9].num_images == 2
    assert batch.vision.rows[6] is None or batch.vision.rows[6].num_images == 0  # the row without images
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[3])  # same text, other picture
    assert max_error(policy, batch, 1.0) <= parity
    swapped = RowVision([batch.vision.rows[3]] * 3 + batch.vision.rows[3:])
    moved = (recomputed(policy, batch, 1.0, swapped) - recomputed(policy, batch, 1.0))[:3].abs().max()
    assert float(moved) > STALE, float(moved)


def run_rounds(backend, policy, processor, rounds: int = 2) -> list[float]:
    """``rounds`` of: sync the adapter, sample the image rows, check them, train on them; the errors measured."""
    rollout, versions, errors = PromptRollout(backend, processor=processor), Versions(), []
    generator = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        backend.sync_weights(versions(policy))
        batch = rollout.generate_rows(image_rows(), generator=generator)
        check_rows_read_their_own_pictures(policy, batch, PARITY)
        errors.append(max_error(policy, batch, 1.0))
        train_steps(policy, batch, steps=1)
    return errors
