"""Tools that return images in the multi-turn loop, on the built-in engine, for both built-in VLM families.

The tiny random models call tools through the ``coin`` parser registered here (a turn whose text has an even
length calls ``screenshot``), and their EOS logit is raised, so turns are short and rows of one group differ:
some call the tool once or twice, some never. The tool's image depends on its argument, so each row's expected
images can be read back from its messages.
"""

from __future__ import annotations

import copy
import io
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from PIL import Image
from torch import nn

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import CompletionLogprobs, default_lora_config, load_causal_lm, load_tokenizer
from grpo_ascend.models.tiny_vlm import build_tiny_vlm
from grpo_ascend.models.tiny_vlm_tool_templates import use_tool_template
from grpo_ascend.models.vision_language import load_processor
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.multiturn import MultiTurnEngine, ToolSettings
from grpo_ascend.rollout.process.client import ProcessBackend
from grpo_ascend.rollout.row_rollouts import build_tool_rollout
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.tool_images import image_token_id
from grpo_ascend.rollout.vllm.colocated import VLLMColocatedRollout
from grpo_ascend.tools import EnvironmentPool, ToolExecutor, Toolset
from grpo_ascend.tools.parsing import TOOL_CALL_PARSERS, ParsedTurn, ToolCall, register_tool_call_parser

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

if "coin" not in TOOL_CALL_PARSERS:
    @register_tool_call_parser("coin")
    def _coin(text: str) -> ParsedTurn:
        return ParsedTurn(text, [ToolCall("screenshot", {"shade": len(text)})] if len(text) % 2 == 0 else [])


def shot_image(shade: int) -> Image.Image:
    return Image.new("RGB", (28 + 14 * (shade % 3), 28), (shade * 40 % 256, 90, 9))


def screenshot(shade: int) -> list:
    """Take a screenshot.

    Args:
        shade: The grey level.
    """
    return [{"type": "image", "image": shot_image(shade)}, {"type": "text", "text": "Here is the screenshot"}]


def eos_prone(model: nn.Module, bias: float = 5.0) -> nn.Module:
    """``model`` with a head bias raising EOS, so a random model ends its turns after a few tokens."""
    head, eos = model.lm_head, model.config.text_config.eos_token_id or 0
    biased = nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight = nn.Parameter(head.weight.detach().clone())
    with torch.no_grad():
        biased.bias.zero_()
        biased.bias[eos] = bias
    model.lm_head = biased
    return model


@pytest.fixture(scope="module", params=["qwen2_5_vl", "llava"])
def vlm(request):
    path = build_tiny_vlm(request.param)
    processor = use_tool_template(load_processor(path), request.param)
    model = load_causal_lm(str(path)).eval()
    model.config.text_config.eos_token_id = processor.tokenizer.eos_token_id
    return eos_prone(model), processor


PROMPTS = [[{"role": "user", "content": "what colour?"}], [{"role": "user", "content": "take a look"}]]


def _rollout(model, processor, seed=0, iterations=2, length=160):
    settings = ToolSettings(Toolset([screenshot]), ToolExecutor(timeout=10, takes_images=True), parser="coin",
                            max_tool_calling_iterations=iterations)
    engine = MultiTurnEngine(RolloutEngine(model, load_tokenizer(model, processor)), settings, processor)
    images = [[Image.new("RGB", (40, 30), (255, 0, 0))], []]  # a prompt with a picture, one without
    params = SamplingParams(num_generations=4, max_completion_length=length, max_prompt_length=512)
    return engine.generate(PROMPTS, params, torch.Generator().manual_seed(seed), images=images)


def _shades(messages) -> list[int]:
    return [c["function"]["arguments"]["shade"] for m in messages for c in m.get("tool_calls", [])]


def test_tool_images_are_rendered_kept_in_order_and_masked(vlm):
    model, processor = vlm
    for seed in range(8):  # the first seed where a row calls the tool twice (seed 0 or 1 on both families)
        batch = _rollout(model, processor, seed)
        if any(t is not None and t.num_images == 2 for t in batch.vision.tool):
            break
    tool, token = batch.vision.tool, image_token_id(processor)
    with_images = [i for i, t in enumerate(tool) if t is not None]
    assert with_images and len(with_images) < len(tool)  # rows of one group differ
    assert batch.vision.rows[0] is batch.vision.rows[3] and batch.vision.rows[0].num_images == 1
    assert any(tool[i].num_images == 2 for i in with_images)  # some row called twice
    for i in with_images:
        t, shades = tool[i], _shades(batch.messages[i])
        ran = sum(1 for m in batch.messages[i] if m["role"] == "tool")
        assert t.num_images == ran and shades[:ran]
        cols = torch.tensor(t.columns)
        assert (batch.completion_ids[i, cols] == token).all() and (batch.tool_mask[i, cols] == 0).all()
        assert (batch.sampling_logprobs[i, cols] == 0).all() and (batch.completion_mask[i, cols] == 1).all()
        expected = processor.image_processor([shot_image(s) for s in shades[:ran]], return_tensors="pt")
        assert torch.equal(t.per_image["pixel_values"], expected["pixel_values"])  # the row's images, in call order
        text = processor.tokenizer.decode(batch.completion_ids[i, : int(batch.completion_mask[i].sum())])
        assert text.count("Here is the screenshot") == ran
        assert batch.messages[i][1]["content"] == [{"type": "image"}, {"type": "text", "text": "Here is the screenshot"}]


def test_sampler_and_trainer_logprobs_agree_with_tool_images(vlm):
    model, processor = vlm
    batch = _rollout(model, processor, seed=1)
    assert batch.vision.any_tool_images
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.vision)
    generated = (batch.completion_mask * batch.tool_mask).bool()
    with torch.no_grad():
        for share in (True, False):
            logps, _ = CompletionLogprobs(model, share_prompts=share)(*inputs)
            assert (logps - batch.sampling_logprobs)[generated].abs().max() < 1e-5
        model.gradient_checkpointing_enable()  # one call over prompt and completion, embedded by us
        try:
            logps, _ = CompletionLogprobs(model)(*inputs)
        finally:
            model.gradient_checkpointing_disable()
        assert (logps - batch.sampling_logprobs)[generated].abs().max() < 1e-5
        checked = [_against_transformers(model, batch, i) for i, t in enumerate(batch.vision.tool) if t is not None]
    assert any(checked)


def _against_transformers(model, batch, row: int) -> bool:
    """Row ``row``'s sampling log-probs against transformers' own forward over prompt + completion with every image
    (the model fills every image token and numbers positions itself), up to the first image token the policy
    sampled (transformers would read it as a slot); False when that leaves nothing after the tool images."""
    prompt, tool = batch.vision.rows[row], batch.vision.tool[row]
    p_ids = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
    n = int(batch.completion_mask[row].sum())
    c_ids = batch.completion_ids[row, :n]
    token = model.config.image_token_id if hasattr(model.config, "image_token_id") else model.config.image_token_index
    sampled = ((c_ids == token) & batch.tool_mask[row, :n].bool()).nonzero()
    n = int(sampled[0]) if len(sampled) else n
    if n <= max(tool.columns) + 1:
        return False
    ids = torch.cat([p_ids, c_ids[:n]])[None]
    inputs = {k: torch.cat([prompt.per_image[k], tool.per_image[k]]) if k in prompt.per_image else tool.per_image[k]
              for k in tool.per_image}
    if "mm_token_type_ids" in prompt.per_token:
        types = torch.zeros_like(ids)
        types[0, : len(p_ids)] = prompt.per_token["mm_token_type_ids"]
        types[0, len(p_ids) + torch.tensor(tool.columns)] = 1
        inputs["mm_token_type_ids"] = types
        model.model.rope_deltas = None
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0, len(p_ids) - 1 : -1]
    reference = torch.log_softmax(logits.float(), -1).gather(1, c_ids[:n, None]).squeeze(1)
    generated = batch.tool_mask[row, :n].bool()
    assert (batch.sampling_logprobs[row, :n] - reference)[generated].abs().max() < 1e-5
    return True


class Screen:
    """An environment whose observation differs per instance, so a group's rows are prefilled one by one."""

    made = 0

    def reset(self, **row) -> str:
        Screen.made += 1
        return f" Screen {Screen.made}."

    def screenshot(self, shade: int) -> list:
        """Take a screenshot.

        Args:
            shade: The grey level.
        """
        return screenshot(shade)


def test_environments_with_images_prefill_rows_one_by_one_and_agree(vlm):
    model, processor = vlm
    args = SimpleNamespace(chat_template_kwargs=None, tool_timeout=10, tool_max_output_chars=4096,
                           tool_call_parser="coin", max_tool_calling_iterations=2)
    params = SamplingParams(num_generations=4, max_completion_length=160, max_prompt_length=512)
    tokenizer = load_tokenizer(model, processor)
    rollout = build_tool_rollout(RolloutEngine(model, tokenizer, params), tokenizer, args, Toolset(),
                                 EnvironmentPool(Screen), processor)
    rows = [{"prompt": PROMPTS[0], "image": Image.new("RGB", (40, 30), (0, 200, 0))}, {"prompt": PROMPTS[1]}]
    batch = rollout.generate_rows(rows, generator=torch.Generator().manual_seed(2))
    vision = batch.vision
    assert [v.num_images for v in vision.rows] == [1] * 4 + [0] * 4 and vision.rows[0] is not vision.rows[1]
    assert vision.any_tool_images and len({t for t in batch.prompt_texts}) == 8  # every row its own observation
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, vision)
    with torch.no_grad():
        logps, _ = CompletionLogprobs(model)(*inputs)
    generated = (batch.completion_mask * batch.tool_mask).bool()
    assert (logps - batch.sampling_logprobs)[generated].abs().max() < 1e-5


def test_grpo_step_trains_rows_with_and_without_tool_images(vlm, tmp_path):
    model, processor = vlm
    rows = [{"prompt": PROMPTS[0], "image": Image.new("RGB", (40, 30), (0, 0, 255))}, {"prompt": PROMPTS[1]}]
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                        max_completion_length=64, max_prompt_length=512, learning_rate=1e-2, seed=3, report_to=[],
                        tool_call_parser="coin", max_tool_calling_iterations=2, logging_steps=1)
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return [float(len(str(c))) for c in completions]

    trainer = GRPOTrainer(copy.deepcopy(model), reward, config, Dataset.from_list(rows), processing_class=processor,
                          tools=[screenshot], peft_config=default_lora_config(r=4))
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    trainer.train()
    record = next(r for r in trainer.state.log_history if "loss" in r)
    images = [sum(1 for m in c if m["role"] == "tool" and m["content"][0] == {"type": "image"}) for c in seen]
    assert len(seen) == 8 and 0 in images and max(images) > 0  # rows with and without tool images in the step
    assert record["tools/calls"] > 0 and record["tools/failed_calls"] == 0
    assert abs(record["ratio/mean"] - 1.0) < 1e-5  # one micro-batch before the update: the trainer's = the sampler's
    changed = [n for n, p in trainer.policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and torch.isfinite(torch.tensor(record["loss"]))


def test_bad_tool_image_and_text_only_model_get_one_line(tmp_path):
    def broken(x: int) -> list:
        """Broken.

        Args:
            x: X.
        """
        return [{"type": "image", "image": b"not an image"}]

    call = ParsedTurn("", [ToolCall("broken", {"x": 1})])
    with ToolExecutor(takes_images=True) as executor:
        (result,), = executor.run([call], Toolset([broken]))
    assert result.failure == "bad_output" and "\n" not in result.content
    assert result.content.startswith("Error: tool 'broken' returned an image that cannot be decoded (content block 0")
    assert "return a PIL image, an image file's path or its bytes" in result.content
    with ToolExecutor(takes_images=True) as executor:
        (result,), = executor.run([ParsedTurn("", [ToolCall("b", {})])], Toolset([_returning([{"type": "image", "image": 3}])]))
    assert result.failure == "bad_output" and "(content block 0: int 3; expected a PIL image" in result.content
    with ToolExecutor() as executor:  # a text-only model's executor
        (result,), = executor.run([ParsedTurn("", [ToolCall("screenshot", {"shade": 2})])], Toolset([screenshot]))
    assert result.failure == "bad_output" and "\n" not in result.content
    assert "tool 'screenshot' returned an image (content block 0) but the model is text-only" in result.content
    buffer = io.BytesIO()
    shot_image(1).save(buffer, format="PNG")
    with ToolExecutor(takes_images=True) as executor:  # bytes, as dataset image columns accept them
        (result,), = executor.run([ParsedTurn("", [ToolCall("b", {})])],
                                  Toolset([_returning([{"type": "image", "image": buffer.getvalue()}])]))
    assert result.ok and result.images[0].size == (28 + 14, 28)
    shot_image(2).save(tmp_path / "shot.png")
    with ToolExecutor(takes_images=True) as executor:  # a file path
        (result,), = executor.run([ParsedTurn("", [ToolCall("b", {})])],
                                  Toolset([_returning([{"type": "image", "image": str(tmp_path / "shot.png")}])]))
    assert result.ok and result.images[0].size == (28 + 28, 28)


def test_tool_image_tokens_count_against_max_completion_length(vlm):
    model, processor = vlm
    batch = _rollout(model, processor, length=24)  # a response with an image is 44-48 tokens: it never fits
    assert batch.vision.tool == [None] * len(batch.vision.tool)
    assert batch.tool_metrics["tools/length_limited"] > 0 and batch.completion_mask.sum(1).max() <= 24
    assert all(batch.truncated[i] for i, m in enumerate(batch.messages) if "tool_calls" in m[-1])


def _returning(value):
    def b() -> list:
        """Return a value."""
        return value

    return b


def test_vllm_process_and_text_only_loops_refuse_a_processor(vlm):
    model, processor = vlm
    settings = ToolSettings(Toolset([screenshot]), ToolExecutor(takes_images=True), parser="coin")
    with pytest.raises(ConfigError, match=r"not supported on the VLLMColocatedRollout backend; set use_vllm: false"):
        MultiTurnEngine(object.__new__(VLLMColocatedRollout), settings, processor)
    with pytest.raises(ConfigError, match=r"not supported on the ProcessBackend backend; set use_vllm: false and rollout_mode: sync"):
        MultiTurnEngine(object.__new__(ProcessBackend), settings, processor)
    with pytest.raises(ConfigError, match="VLLMColocatedRollout backend; set use_vllm: false"):
        object.__new__(VLLMColocatedRollout).start_image_session([[1]], [None])
    with pytest.raises(ConfigError, match="ToolExecutor\\(takes_images=True\\)"):
        MultiTurnEngine(RolloutEngine(model, load_tokenizer(model, processor)),
                        ToolSettings(Toolset([screenshot]), ToolExecutor(), parser="coin"), processor)
