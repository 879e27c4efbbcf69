"""Tool-calling chat templates for the built-in tiny vision-language models.

The saved tiny VLMs' templates render no tools (their builds stay as they are); :func:`use_tool_template` gives a
loaded processor (and its tokenizer) a template that does, in each family's own style: Qwen2.5-VL's tool format
(schemas in the system turn, ``<tool_call>`` JSON calls, consecutive tool messages as one user turn of
``<tool_response>`` blocks), and LLaVA-1.5's turns (``TOOL: <image>\\n<text>``) with the same calls. A tool
message's content may be a string or content parts: each image part renders as the family's image placeholder,
which the processor expands into the image's tokens. Without tools and tool messages a conversation renders
exactly as with the family's own template.
"""

from __future__ import annotations

from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.tiny_tokenizer import EOS_TOKEN, TOOL_CALLS

_TOOLS_SYSTEM = (
    "{%- if tools %}{{- SYSTEM_OPEN + '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>' + SYSTEM_CLOSE }}{%- endif %}"
)

QWEN2_5_VL_TOOLS_CHAT_TEMPLATE = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}"
    "{%- for part in content %}"
    "{%- if part['type'] == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
    + _TOOLS_SYSTEM.replace("SYSTEM_OPEN", "'<|im_start|>system\\n'").replace("SYSTEM_CLOSE", "'<|im_end|>\\n'")
    + "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}" + TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAVA_TOOLS_CHAT_TEMPLATE = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}"
    "{%- for part in content | selectattr('type', 'equalto', 'image') %}{{- '<image>\\n' }}{%- endfor %}"
    "{%- for part in content | selectattr('type', 'equalto', 'text') %}"
    "{{- part['text'] }}{%- if not loop.last %}{{- ' ' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
    + _TOOLS_SYSTEM.replace("SYSTEM_OPEN", "''").replace("SYSTEM_CLOSE", "' '")
    + "{%- for message in messages %}"
    "{%- if message['role'] != 'system' %}{{- message['role'].upper() + ': ' }}{%- endif %}"
    "{{- render(message['content']) }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}" + TOOL_CALLS + "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{- '" + EOS_TOKEN + "' }}{%- endif %}"
    "{{- ' ' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)

#: family -> its tool-calling template.
TOOLS_CHAT_TEMPLATES = {"qwen2_5_vl": QWEN2_5_VL_TOOLS_CHAT_TEMPLATE, "llava": LLAVA_TOOLS_CHAT_TEMPLATE}


def use_tool_template(processor: Any, family: str) -> Any:
    """``processor`` (a built-in tiny VLM's) with ``family``'s tool-calling template, on it and its tokenizer."""
    if family not in TOOLS_CHAT_TEMPLATES:
        raise ConfigError(f"no tool template for family {family!r}; choose one of {sorted(TOOLS_CHAT_TEMPLATES)}")
    processor.chat_template = processor.tokenizer.chat_template = TOOLS_CHAT_TEMPLATES[family]
    return processor
