"""Vision-language GRPO on the built-in engine: prompts with images sample and train with the same log-probs
(each family against transformers' own forward), the rows of one prompt share its images, rows with the same
text but other pictures do not, only the language model's LoRA trains, and bad input gets one clear line."""

from __future__ import annotations

import io

import pytest
import torch
from datasets import Dataset
from PIL import Image

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.checkpoints.export import export_checkpoint
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.models.policy import CompletionLogprobs, default_lora_config, load_causal_lm, load_tokenizer
from grpo_ascend.models.tiny_vlm import build_tiny_vlm
from grpo_ascend.models.vision_language import load_processor
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.protocol import PromptRollout
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.images import row_images
from grpo_ascend.vision.positions import image_placeholders
from grpo_ascend.vision.shapes_task import colour_code_reward, coloured_shapes_dataset

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
QUESTION = [{"role": "user", "content": "what colour?"}]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "llava", "llava_next", "qwen3_5", "gemma4"])
def vlm(request):
    path = build_tiny_vlm(request.param)
    processor = load_processor(path)
    return load_causal_lm(str(path)).eval(), processor


def _rows():
    colours = [(255, 0, 0), (0, 0, 255), (0, 255, 0)]
    rows = [{"prompt": QUESTION, "image": Image.new("RGB", (40, 30), c)} for c in colours]  # same text, other pictures
    rows.append({"prompt": "a row without images"})
    rows.append({"prompt": QUESTION, "images": [Image.new("RGB", (28, 28), (9, 9, 9)), Image.new("RGB", (56, 56), (200, 9, 9))]})
    return rows


def test_sampler_trainer_and_transformers_agree_on_prompts_with_images(vlm):
    model, processor = vlm
    engine = RolloutEngine(model, load_tokenizer(model, processor), SamplingParams(num_generations=3,
                                                                                 max_completion_length=6))
    rows = _rows()
    batch = PromptRollout(engine, processor=processor).generate_rows(rows, generator=torch.Generator().manual_seed(0))
    assert batch.vision.rows[0] is batch.vision.rows[2] and batch.vision.rows[3] is not batch.vision.rows[2]
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.vision)
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        for share in (True, False):
            logps, _ = CompletionLogprobs(model, share_prompts=share)(*inputs)
            assert (logps - batch.sampling_logprobs)[mask].abs().max() < 1e-5
        for row in (3, 6, 12):  # the second picture, two pictures; transformers' forward over prompt + completion
            prompt = rows[row // 3]
            encoded = processor(text=[batch.prompt_texts[row]], images=row_images(prompt) or None,
                                return_tensors="pt", add_special_tokens=False)
            n = int(batch.completion_mask[row].sum())
            slots = image_placeholders(model.config, batch.completion_ids[row, :n]).nonzero()
            n = int(slots[0]) if len(slots) else n  # transformers would read a sampled image token as a slot
            width, completion = encoded["input_ids"].shape[1], batch.completion_ids[row: row + 1, :n]
            extra = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
            if "mm_token_type_ids" in extra:
                extra["mm_token_type_ids"] = torch.nn.functional.pad(extra["mm_token_type_ids"], (0, completion.shape[1]))
            ids = torch.cat([encoded["input_ids"], completion], dim=1)
            if hasattr(model.model, "rope_deltas"):
                model.model.rope_deltas = None
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0, width - 1: -1]
            reference = torch.log_softmax(logits.float(), -1).gather(1, completion[0, :, None]).squeeze(1)
            assert (batch.sampling_logprobs[row, :n] - reference[:n]).abs().max() < 1e-5


def test_greedy_sampling_with_an_image_is_transformers_generate(vlm):
    model, processor = vlm
    params = SamplingParams(num_generations=1, max_completion_length=8, temperature=0.0, ignore_eos=True)
    engine = RolloutEngine(model, load_tokenizer(model, processor), params)
    row = {"prompt": QUESTION, "image": Image.new("RGB", (40, 30), (0, 0, 255))}
    batch = PromptRollout(engine, processor=processor).generate_rows([row])
    encoded = processor(text=batch.prompt_texts, images=row_images(row), return_tensors="pt", add_special_tokens=False)
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    reference = model.generate(**encoded, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert batch.completion_ids[0].tolist() == reference[0, encoded["input_ids"].shape[1]:].tolist()


def test_a_grpo_step_with_images_trains_the_language_models_lora_only(tmp_path):
    cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                     learning_rate=1e-2, max_completion_length=4, max_prompt_length=128, save_steps=0,
                     logging_steps=1, disable_tqdm=True, log_completions_steps=0, report_to=[])
    seen = []

    def reward(completions, image, colour, **kwargs):  # every column reaches the reward, the pictures included
        seen.extend(image)
        return colour_code_reward(completions, colour)

    trainer = GRPOTrainer("builtin:vlm-qwen2_5_vl", reward, cfg, coloured_shapes_dataset(16, seed=1),
                          peft_config=default_lora_config(r=4))
    lora = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_B" in n}
    vision = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if ".visual." in n}
    assert lora and vision and all(".language_model." in n for n in lora)
    assert trainer.processing_class is trainer.processor
    trainer.train()
    after = dict(trainer.policy.named_parameters())
    assert any(not torch.equal(after[n], before) for n, before in lora.items())
    assert all(torch.equal(after[n], before) for n, before in vision.items())
    assert all("reward" in r for r in trainer.state.log_history if "loss" in r)
    assert len(seen) == 2 * 8 and all(isinstance(i, Image.Image) and i.size == (28, 28) for i in seen)
    # exported: the adapter with the processor, and a merged model, load in plain transformers / PEFT
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    trainer.save_model(tmp_path / "adapter")
    merged_dir = export_checkpoint(tmp_path, tmp_path / "merged", merge=True)  # the run's last checkpoint
    processor = load_processor(tmp_path / "adapter")
    assert type(load_processor(merged_dir)) is type(processor)  # the merged model's folder has it too
    encoded = processor(text=[processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}],
                                                            add_generation_prompt=True, tokenize=False)],
                        images=[seen[0]], return_tensors="pt")
    trainer.policy.eval()
    with torch.no_grad():
        expected = trainer.policy(**encoded).logits
        base = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm("qwen2_5_vl"))
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(**encoded).logits
        merged = AutoModelForImageTextToText.from_pretrained(merged_dir).eval()(**encoded).logits
    torch.testing.assert_close(adapted, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-5)


def test_images_for_a_text_only_model_are_refused_naming_the_column(tmp_path, tiny_model_dir):
    data = Dataset.from_list([{"prompt": "how many squares?", "images": [Image.new("RGB", (8, 8))]}])
    with pytest.raises(DataError, match=r"image column\(s\) \['images'\].*text-only.*remove_columns"):
        GRPOTrainer(str(tiny_model_dir), colour_code_reward, GRPOConfig(output_dir=str(tmp_path)), data)


def test_a_vision_language_model_with_a_plain_tokenizer_is_refused(tmp_path):
    path = build_tiny_vlm("llava")
    tokenizer = load_processor(path).tokenizer
    with pytest.raises(ConfigError, match="takes no images; pass the model's processor"):
        GRPOTrainer(str(path), colour_code_reward, GRPOConfig(output_dir=str(tmp_path)),
                    coloured_shapes_dataset(4), processing_class=tokenizer)


def test_an_undecodable_image_names_its_row_and_column():
    with pytest.raises(DataError, match=r"row 7, column 'image', image 0 cannot be decoded"):
        row_images({"prompt": "x", "image": {"bytes": b"not a png", "path": None}}, 7)
    buffer = io.BytesIO()
    Image.new("L", (4, 4)).save(buffer, format="PNG")
    assert row_images({"images": [{"bytes": buffer.getvalue()}]})[0].mode == "RGB"


def test_more_image_tokens_than_max_prompt_length_says_how_many_and_what_to_change(vlm):
    model, processor = vlm
    engine = RolloutEngine(model, load_tokenizer(model, processor), SamplingParams(max_prompt_length=10))
    with pytest.raises(DataError, match=r"prompt 0 has \d+ tokens with its 1 image\(s\) expanded.*max_prompt_length=10"):
        PromptRollout(engine, processor=processor).generate_rows([_rows()[0]])


def test_rollouts_ahead_of_training_carry_the_images(tmp_path):
    """one_step_off samples in the rollout process: the images travel with each request, and step 1 (sampler and
    trainer on the same weights) gives the trainer's log-probs exactly; later steps are one version old."""
    cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, num_generations=4,
                     learning_rate=1e-2, max_completion_length=4, max_prompt_length=128, save_steps=0,
                     logging_steps=1, disable_tqdm=True, log_completions_steps=0, report_to=[],
                     rollout_mode="one_step_off")
    trainer = GRPOTrainer("builtin:vlm-llava", colour_code_reward, cfg, coloured_shapes_dataset(16, seed=1),
                          peft_config=default_lora_config(r=4))
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in steps]
    assert [r["async/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert gaps[0] < 1e-5 and min(gaps[1:]) > 100 * max(gaps[0], 1e-9)


@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_train_vision_parts_chooses_what_trains_besides_the_language_model(tmp_path, peft):
    """LoRA: adapters on the language model and the chosen parts' linear layers; full fine-tuning: those parts'
    weights trainable, the rest of the vision tower frozen; null (TRL's choice): every weight in full fine-tuning,
    the language model's adapters under LoRA. An unknown part is refused naming the choices."""
    def trainable(parts, family="llava"):
        cfg = GRPOConfig(output_dir=str(tmp_path), report_to=[], train_vision_parts=parts)
        trainer = GRPOTrainer(f"builtin:vlm-{family}", colour_code_reward, cfg, coloured_shapes_dataset(4),
                              peft_config=default_lora_config(r=4) if peft else None)
        return {n for n, p in trainer.policy.named_parameters() if p.requires_grad}

    def where(names):
        return {("language" if ".language_model." in n or "lm_head" in n else
                 "projector" if "projector" in n or ".merger." in n else "vision") for n in names}

    assert where(trainable([])) == {"language"}
    # null, TRL's choice: every weight in full fine-tuning, the language model's adapters under LoRA
    assert where(trainable(None)) == ({"language"} if peft else {"language", "projector", "vision"})
    assert where(trainable(["projector"])) == {"language", "projector"}
    assert where(trainable(["projector"], "qwen2_5_vl")) == {"language", "projector"}  # the merger inside .visual
    assert where(trainable(["vision_tower", "projector"])) == {"language", "projector", "vision"}
    if not peft:  # LLaVA's weights are the language model's, its projector's and its vision tower's: all of them
        assert trainable(None) == trainable(["vision_tower", "projector"])
    with pytest.raises(ConfigError, match=r"train_vision_parts \['eyes'\] unknown: choose from \['projector'"):
        trainable(["eyes"])


def test_under_gradient_checkpointing_the_one_call_forward_agrees_with_the_sampler(vlm):
    """Activation checkpointing drops the prompt cache, so prompt and completion run in one call: every row agrees
    with the sampler except one whose completion sampled an image token (read there as the pad token)."""
    model, processor = vlm
    engine = RolloutEngine(model, load_tokenizer(model, processor), SamplingParams(num_generations=3,
                                                                                 max_completion_length=6))
    batch = PromptRollout(engine, processor=processor).generate_rows(_rows(), generator=torch.Generator().manual_seed(0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        logps, _ = CompletionLogprobs(model)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                             batch.completion_mask, batch.vision)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    clean = ~image_placeholders(model.config, batch.completion_ids).any(1)
    mask = batch.completion_mask.bool() & clean.unsqueeze(1)
    assert clean.sum() >= 12 and (logps.detach() - batch.sampling_logprobs)[mask].abs().max() < 1e-5


def test_the_moe_load_balancing_loss_with_images_is_the_models_own():
    """Qwen3.5 MoE with image prompts: the forward's load-balancing loss (TRL adds it to the GRPO loss) is
    transformers' own over prompt, images and completion, and its log-probs are the sampler's."""
    from grpo_ascend.models.router_aux import router_aux_for

    path = build_tiny_vlm("qwen3_5_moe")
    model, processor = load_causal_lm(str(path)).eval(), load_processor(path)
    params = SamplingParams(num_generations=2, max_completion_length=4, ignore_eos=True)
    engine = RolloutEngine(model, load_tokenizer(model, processor), params)
    pictures = [Image.new("RGB", (40, 30), (255, 0, 0)), Image.new("RGB", (40, 30), (0, 0, 255))]
    batch = PromptRollout(engine, processor=processor).generate_rows(
        [{"prompt": QUESTION, "image": p} for p in pictures], generator=torch.Generator().manual_seed(0))
    forward = CompletionLogprobs(model, router_aux=router_aux_for(model, None))
    with torch.no_grad():
        logps, _, aux = forward(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                batch.vision, aux_loss=True)
        encoded = processor(text=list(batch.prompt_texts), images=[[p] for p in pictures for _ in range(2)],
                            return_tensors="pt", add_special_tokens=False)
        completion = batch.completion_ids
        extra = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
        extra["mm_token_type_ids"] = torch.nn.functional.pad(extra["mm_token_type_ids"], (0, completion.shape[1]))
        ids = torch.cat([encoded["input_ids"], completion], dim=1)
        model.model.rope_deltas = None
        expected = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_router_logits=True, **extra)
    assert batch.completion_mask.all() and not torch.equal(batch.completion_ids[0], batch.completion_ids[2])
    assert (logps - batch.sampling_logprobs).abs().max() < 1e-5
    torch.testing.assert_close(aux, expected.aux_loss, rtol=1e-5, atol=1e-7)
