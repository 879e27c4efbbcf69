"""What feeding a tool's image costs the built-in engine: the incremental feed it uses vs the alternatives.

One prompt with a picture, G rows decoded ``--decoded`` tokens, then one tool response holding one image
(``Here is the screenshot`` and the family's tool turn around it) appended to every row, timed three ways,
taking turns, after a warm-up:

- ``feed image``: what the engine does (rollout/session.py): the response's tokens fed on each row's KV cache,
  the image's features at its tokens (one vision-tower call for the G rows' images) and its positions numbered
  as the model numbers images;
- ``feed text``: the same token ids fed as text (no vision call): what a text tool response of that length costs;
- ``re-prefill``: the alternative the engine does not take: one forward over each row's whole sequence so far
  (prompt, decoded tokens, response) with all its images, building a new cache.

Command: ``python bench/bench_tool_images.py --model tiny-qwen2_5_vl`` (models of bench/vlm_models.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from vlm_models import MODELS, RANDOM_VLMS, TINY_VLMS, build_vlm  # noqa: E402

from grpo_ascend.models.policy import load_tokenizer  # noqa: E402
from grpo_ascend.models.tiny_vlm_tool_templates import use_tool_template  # noqa: E402
from grpo_ascend.rollout.engine import RolloutEngine  # noqa: E402
from grpo_ascend.rollout.image_prompts import VisionPromptEncoder  # noqa: E402
from grpo_ascend.rollout.sampling import SamplingParams  # noqa: E402
from grpo_ascend.rollout.tool_images import render_image_suffix  # noqa: E402
from grpo_ascend.tools.execution import ToolResult  # noqa: E402


def _decoded(engine, prompt_ids, prompt_images, params, steps):
    batch = engine.prefill([prompt_ids], params, torch.Generator().manual_seed(0), shared_prefix=False,
                           images=[prompt_images])
    for _ in range(steps):
        batch.sample()
        batch.step()
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen2_5_vl", choices=MODELS)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--decoded", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    family = TINY_VLMS.get(args.model) or RANDOM_VLMS[args.model][0]
    model, processor = build_vlm(args.model)
    processor = use_tool_template(processor, family)
    engine = RolloutEngine(model, load_tokenizer(model, processor))
    params = SamplingParams(num_generations=args.group, max_completion_length=args.decoded + 160)
    picture = Image.new("RGB", (56, 56), (200, 30, 30))
    encoded, (prompt_images,) = VisionPromptEncoder(processor).encode(
        [[{"role": "user", "content": "look at this"}]], [[picture]], params)
    prompt_ids = encoded.ids[0]
    result = ToolResult("screenshot", [{"type": "image"}, {"type": "text", "text": "Here is the screenshot"}],
                        images=(Image.new("RGB", (56, 56), (30, 30, 200)),))
    suffix, images = render_image_suffix(processor, [result])
    eos = processor.tokenizer.eos_token_id
    times: dict[str, list[float]] = {"feed image": [], "feed text": [], "re-prefill": []}
    with torch.no_grad(), engine.evaluating():
        for repeat in range(args.repeats + 1):
            for way in times:
                batch = _decoded(engine, prompt_ids, prompt_images, params, args.decoded)
                feeds = [[eos, *suffix]] * args.group
                start = time.perf_counter()
                if way == "feed image":
                    shifted = type(images)(images.per_image, tuple(c + 1 for c in images.columns), images.num_images)
                    batch.feed(feeds, [shifted] * args.group)
                elif way == "feed text":
                    batch.feed(feeds)
                else:
                    _reprefill(model, processor, prompt_ids, prompt_images, batch, suffix, images, eos, args)
                elapsed = time.perf_counter() - start
                if repeat:
                    times[way].append(elapsed)
    print(f"{args.model}: G={args.group}, prompt {len(prompt_ids)} tokens, {args.decoded} decoded, tool response "
          f"{len(suffix) + 1} tokens ({len(images.columns)} image tokens), {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads")
    base = statistics.median(times["feed text"])
    for way, values in times.items():
        median = statistics.median(values)
        print(f"  {way:<11} {median * 1e3:8.2f} ms  ({median / base:5.2f}x feed text)")


def _reprefill(model, processor, prompt_ids, prompt_images, batch, suffix, images, eos, args) -> None:
    """One forward over each row's whole sequence with all its images (a new cache), as a re-prefill would run."""
    decoded = batch.tokens.new_full((args.group, args.decoded), processor.tokenizer.pad_token_id)
    ids = torch.cat([torch.tensor([prompt_ids] * args.group), decoded, torch.tensor([[eos, *suffix]] * args.group)],
                    dim=1)
    pixels = {k: torch.cat([prompt_images.per_image[k], images.per_image[k]] * args.group)
              for k in images.per_image}
    extra = {}
    if "mm_token_type_ids" in prompt_images.per_token:
        types = torch.zeros_like(ids)
        types[:, : len(prompt_ids)] = prompt_images.per_token["mm_token_type_ids"]
        types[:, len(prompt_ids) + args.decoded + 1 + torch.tensor(images.columns)] = 1
        extra["mm_token_type_ids"] = types
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1, **pixels, **extra)


if __name__ == "__main__":
    main()
