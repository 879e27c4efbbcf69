"""The scripted tool-calling model and the tool/environment the multi-turn tests share (tests/rollout/test_multiturn.py,
tests/trainers/test_multiturn_trainer.py, test_evaluation_tools.py, multiturn_dist_worker.py).

:class:`ScriptedQwen2` is the tiny Qwen2 whose logits are overridden at chosen absolute positions: what it emits
there depends only on the position, so it behaves identically in the cached loop, in one forward over the whole
conversation and in ``generate``.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from grpo_ascend.tools import ToolResult, Toolset, render_tool_suffix

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    return a + b


class ScriptedQwen2(Qwen2ForCausalLM):
    """Forces token ``script[p]`` as the token at absolute position ``p`` (where set), and never emits
    a token of ``banned`` elsewhere."""

    script: dict[int, int] = {}
    banned: tuple[int, ...] = ()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, logits_to_keep=0,
                **kwargs):
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -input_ids.shape[1]:]
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, logits_to_keep=logits_to_keep, **kwargs)
        k = out.logits.shape[1]
        target = position_ids[:, -k:] + 1
        table = torch.full((int(target.max()) + 2,), -1, dtype=torch.long)
        for p, t in self.script.items():
            if p < table.numel():
                table[p] = t
        forced = table[target.cpu()].to(out.logits.device)
        bias = torch.zeros_like(out.logits)
        hit = forced >= 0
        bias[hit] = -1e4
        bias[hit.nonzero(as_tuple=True) + (forced[hit],)] = 0.0
        if self.banned:
            bias[..., list(self.banned)] = torch.where(hit[..., None], bias[..., list(self.banned)], -1e4)
        out.logits = out.logits + bias
        return out


def token_ids(tok, text) -> list[int]:
    """``text``'s token ids, no special tokens added."""
    return tok(text, add_special_tokens=False)["input_ids"]


PROMPT = [{"role": "user", "content": "add two and three"}]


class AddEnv:
    """One rollout's state: the sums it was asked for."""

    def reset(self, **row):
        self.sums = []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first term.
            b: The second term.
        """
        self.sums.append(a + b)
        return a + b

    def get_reward(self) -> float:
        return float(self.sums == [5])


def scripted_add_model(tiny_model_dir):
    """A model that calls add(2, 3), then answers "five" (positions fixed by the one prompt's length)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = ScriptedQwen2.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(PROMPT, tools=Toolset([add]).schemas, add_generation_prompt=True, tokenize=False)
    start = len(token_ids(tok, text))
    call = token_ids(tok, CALL) + [tok.eos_token_id]
    suffix = render_tool_suffix(tok, [ToolResult("add", "5")])
    seq = call + suffix + token_ids(tok, "five") + [tok.eos_token_id]
    model.script = {start + k: t for k, t in enumerate(seq)}
    return model, tok, call, suffix, seq
