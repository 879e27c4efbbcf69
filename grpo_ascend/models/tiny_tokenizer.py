"""The built-in tiny models' tokenizer: a byte-level BPE trained offline on generated text (digits one per
token), its special and tool-calling tokens, and its ChatML chat templates (full and compact tool prompts)."""

from __future__ import annotations

import random

from grpo_ascend.data.synthetic import arithmetic_problems

VOCAB_SIZE = 1024
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
#: Qwen-style tool tags, one token each; not "special", so decoding with skip_special_tokens keeps them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2.5-style: with ``tools`` the system turn lists their JSON schemas; assistant ``tool_calls``
# render as <tool_call> JSON blocks; consecutive ``tool`` messages form one user turn of
# <tool_response> blocks. Without tools it renders exactly as the plain ChatML template.
_FULL_TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
)
# The ``tiny-tool-warm`` model's variant: the same tool format (tools in the system turn, <tool_call>
# JSON calls, <tool_response> blocks), but each tool listed as one signature line
# ``name(arg: type, ...): description`` instead of its whole JSON schema and the instructions,
# which would make a tiny model's prompt ~500 tokens.
_COMPACT_TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}"
    "{%- if tool.get('function') %}{%- set tool = tool['function'] %}{%- endif %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- tool['name'] + '(' }}"
    "{%- for arg, spec in tool.get('parameters', {}).get('properties', {}).items() %}"
    "{{- arg + ': ' + (spec.get('type', 'any') if spec.get('type', 'any') is string else spec['type'] | join('|')) }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ')' }}{%- if tool.get('description') %}{{- ': ' + tool['description'] }}{%- endif %}"
    "{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- endif %}"
)
#: The Jinja that renders an assistant message's tool calls (one ``<tool_call>`` JSON block each).
TOOL_CALLS = (
    "{%- for call in message['tool_calls'] %}"
    "{%- if call.get('function') %}{%- set call = call['function'] %}{%- endif %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
)
_MESSAGES = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
) + TOOL_CALLS + (
    "{{- '<|im_end|>\\n' }}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


CHAT_TEMPLATE = _FULL_TOOLS_SYSTEM + _MESSAGES
COMPACT_TOOLS_CHAT_TEMPLATE = _COMPACT_TOOLS_SYSTEM + _MESSAGES


#: The words of the tokenizer's general text (word soup); benchmarks draw prompts from them too.
WORDS = (
    "the a model reward policy group token sample answer question number step value train learn "
    "good bad fast slow small large think reason because so then first next last plus minus times "
    "equal result correct wrong yes no please write short long story about cat dog sun moon tree "
    "river city road book music light dark red blue green hello world assistant user system"
).split()


def _tokenizer_corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Deterministic training text: rendered arithmetic chats plus word soup for general prompts."""
    rng = random.Random(seed)
    lines = []
    for p in arithmetic_problems(n, seed=seed, max_operand=100, ops="+-*"):
        lines.append(f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n{p.completion}<|im_end|>")
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 16))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        lines.append(sentence)
    return lines


def build_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 0):
    """Train the byte-level BPE tokenizer (digits split one per token) and wrap it for transformers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    # Added after training so the BPE vocabulary and every other id stay as in version 2.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
