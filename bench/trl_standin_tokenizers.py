"""Offline stand-ins for the tokenizers of TRL's tiny test models (used by ``bench/trl_tests_harness.py``).

Each is a byte-level BPE trained here on a few kilobytes of text (about 600 tokens, the 256 byte tokens first in
GPT-2's order, so ``198`` is a newline and ``220`` a space as in Qwen's and Llama 3's vocabularies) plus its
family's special tokens in the family's order. A vocabulary of the real size (Qwen's 151,643 tokens, which would
give the real ids to ``<|im_end|>``, ``<tool_call>``, ...) made TRL's trainer about ten times slower per step on
the CPU, which put a whole run out of reach; ``QWEN_BASE_VOCAB`` builds that layout where it is wanted. Chat
templates are the ones the installed ``trl`` package ships for the family (the real models' templates; TRL recognises some of them, e.g. to parse tool
calls), or a short one of ours where TRL ships none.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from importlib import resources

#: Qwen2.5's added tokens in id order from 151643; Qwen3 appends the last four.
QWEN2_5_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
QWEN3_SPECIALS = QWEN2_5_SPECIALS + ["<tool_response>", "</tool_response>", "<think>", "</think>"]
#: Tokens that are added but not special in Qwen's tokenizers (kept when decoding with skip_special_tokens).
QWEN_NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
QWEN_BASE_VOCAB = 151643  # Qwen's ids of its added tokens start here (TokenizerSpec.base_vocab; unused by default)
LEARNED_VOCAB = 700


@dataclass(frozen=True)
class TokenizerSpec:
    """One family's tokenizer: its special tokens (in id order), which of them are bos / eos / pad, the base
    vocabulary's size (None: the learned tokens alone), its chat template (TRL's file name or template text)."""

    specials: list[str]
    eos: str
    pad: str | None = None
    bos: str | None = None
    base_vocab: int | None = None
    template: str = "chatml"
    non_special: set[str] = field(default_factory=set)
    extra_special_tokens: dict[str, str] = field(default_factory=dict)
    add_bos: bool = False


CHATML = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}{%- endif %}"
    "{%- endfor %}"
)
OWN_TEMPLATES = {"chatml": CHATML, "mistral": MISTRAL}

SPECS: dict[str, TokenizerSpec] = {
    "qwen2_5": TokenizerSpec(QWEN2_5_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", template="qwen2_5",
                            non_special=QWEN_NON_SPECIAL),
    "qwen3": TokenizerSpec(QWEN3_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", template="qwen3",
                          non_special=QWEN_NON_SPECIAL),
    "qwen2_5_vl": TokenizerSpec(QWEN2_5_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", template="qwen2_5_vl",
                               non_special=QWEN_NON_SPECIAL),
    "qwen3_5": TokenizerSpec(QWEN3_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", template="qwen3_5_nothink",
                            non_special=QWEN_NON_SPECIAL),
    "qwen3_6": TokenizerSpec(QWEN3_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", template="qwen3_6",
                            non_special=QWEN_NON_SPECIAL),
    "llama3_2": TokenizerSpec(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                               "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                              eos="<|eot_id|>", bos="<|begin_of_text|>", template="llama3_2", add_bos=True),
    "mistral": TokenizerSpec(["<unk>", "<s>", "</s>"], eos="</s>", bos="<s>", template="mistral", add_bos=True),
    "gemma": TokenizerSpec(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
                           eos="<eos>", pad="<pad>", bos="<bos>", template="gemma", add_bos=True),
    "gemma3": TokenizerSpec(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                             "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                            eos="<eos>", pad="<pad>", bos="<bos>", template="gemma3", add_bos=True,
                            extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                  "image_token": "<image_soft_token>"}),
    "gemma4": TokenizerSpec(["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|image>", "<image|>",
                             "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>", "<|think|>",
                             "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                             "<|tool_response>", "<tool_response|>", '<|"|>'],
                            eos="<turn|>", pad="<pad>", bos="<bos>", template="gemma4", add_bos=True,
                            extra_special_tokens={"image_token": "<|image|>", "boi_token": "<|image>",
                                                  "eoi_token": "<image|>", "audio_token": "<|audio|>",
                                                  "boa_token": "<|audio>", "eoa_token": "<audio|>"}),
    "cohere2": TokenizerSpec(["<PAD>", "<UNK>", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>",
                              "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>",
                              "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>"],
                             eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", bos="<BOS_TOKEN>", template="cohere2",
                             add_bos=True),
    "glm4moe": TokenizerSpec(["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                              "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                              "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
                             eos="<|user|>", pad="<|endoftext|>", template="glm4moe"),
    "gptoss": TokenizerSpec(["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                             "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"],
                            eos="<|return|>", pad="<|endoftext|>", bos="<|startoftext|>", template="gptoss"),
    "llava": TokenizerSpec(["<unk>", "<s>", "</s>", "<image>", "<pad>"], eos="</s>", pad="<pad>", bos="<s>",
                           template="llava_next", add_bos=True, extra_special_tokens={"image_token": "<image>"}),
}


def corpus() -> list[str]:
    """Training text: the Zen of Python (TRL's test prompts are its lines), numbers, and chat-like lines."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    zen = "".join(this.d.get(c, c) for c in this.s).splitlines()
    numbers = [" ".join(str(i * j) for j in range(12)) for i in range(30)]
    chat = ["What is better than ugly? Beautiful is better than ugly, said the user to the assistant.",
            'Call {"name": "multiply", "arguments": {"a": 3, "b": 4}} and answer: the tool returned 12.',
            "I don't know any tool. Done! Yes, no, maybe: the answer is 42."]
    return zen * 4 + numbers + chat * 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (printable bytes map to themselves, the rest to chars from U+0100)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def chat_template(name: str) -> str:
    """The chat template ``name``: the installed trl's ``chat_templates/<name>.jinja``, else one of ours."""
    if name in OWN_TEMPLATES:
        return OWN_TEMPLATES[name]
    path = resources.files("trl") / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(f"no chat template {name!r}: expected {path} in the installed trl, or one of "
                                f"{sorted(OWN_TEMPLATES)}")
    return path.read_text()


def build_tokenizer(family: str):
    """The stand-in tokenizer of ``family`` (a key of :data:`SPECS`), a ``PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = SPECS[family]
    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre
    learner.train_from_iterator(corpus(), trainer=trainers.BpeTrainer(
        vocab_size=LEARNED_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    learned = learner.get_vocab()
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for token, _ in sorted(learned.items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    for i in range(len(vocab), spec.base_vocab or 0):
        vocab[f"<|standin_{i}|>"] = i  # unused filler up to the real family's first added id
    import json

    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in json.loads(learner.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=t not in spec.non_special, normalized=False)
                            for t in spec.specials])
    kwargs = {"eos_token": spec.eos, "pad_token": spec.pad, "bos_token": spec.bos}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in kwargs.items() if v},
                                   extra_special_tokens=spec.extra_special_tokens or None)
    if spec.add_bos and spec.bos:
        from tokenizers import processors

        bos_id = fast.convert_tokens_to_ids(spec.bos)
        fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)])
    fast.chat_template = chat_template(spec.template)
    return fast
