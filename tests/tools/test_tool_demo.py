"""The calculator demo: the calculator tool, the products task, the compact tool prompt of
``builtin:tiny-tool-warm``, its warm-start transcripts, and (slow) that GRPO raises its accuracy."""

from __future__ import annotations

import pytest
from helpers import SMALL_RUN, rewards_before_and_after_training
from transformers import AutoTokenizer

from grpo_ascend.data.prompts import load_prompt_dataset
from grpo_ascend.data.synthetic import product_problems
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.models.tiny_model import FLAVOURS, resolve_builtin
from grpo_ascend.models.tiny_tokenizer import CHAT_TEMPLATE, COMPACT_TOOLS_CHAT_TEMPLATE
from grpo_ascend.models.tiny_tool_warm import tool_transcript
from grpo_ascend.tools import Toolset, calculator, check_tool_chat_template, load_toolset, render_tool_suffix
from grpo_ascend.tools.execution import ToolResult


def test_calculator_is_exact_and_refuses_anything_but_arithmetic():
    assert calculator("123 * 45") == "5535"
    assert calculator(" (2 + 3) * -4 ") == "-20"
    assert calculator("7 / 2") == "3.5" and calculator("8 / 2") == "4" and calculator("2 ** 10") == "1024"
    assert calculator("1 / 0") == "Error: division by zero"
    assert "not an arithmetic expression" in calculator("12 *")
    assert "unsupported element" in calculator("__import__('os').system('true')")
    assert "exponent" in calculator("9 ** 9 ** 9")
    assert "longer than" in calculator("1+" * 200 + "1")
    tools = load_toolset(["calculator"])
    schema = tools.schemas[0]["function"]
    assert tools.names == ["calculator"] and schema["parameters"]["required"] == ["expression"]


def test_products_task():
    problems = product_problems(200, seed=3)
    assert problems == product_problems(200, seed=3)
    for p in problems:
        a, op, b = p.question.removeprefix("What is ").rstrip("?").split()
        assert op == "*" and len(a) == 3 and len(b) == 2 and int(a) * int(b) == p.answer
    ds = load_prompt_dataset("synthetic:products", synthetic_kwargs={"n": 5, "digits": [2, 1], "seed": 1})
    assert ds[0]["prompt"][-1]["content"].startswith("What is ") and len(ds) == 5
    with pytest.raises(DataError, match="did you mean 'products'"):
        load_prompt_dataset("synthetic:product")
    with pytest.raises(DataError, match="valid: n, seed, digits"):
        load_prompt_dataset("synthetic:products", synthetic_kwargs={"max_operand": 3})


def test_compact_tool_prompt_is_short_and_the_plain_template_is_unchanged(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.chat_template == CHAT_TEMPLATE  # the other built-in models keep their template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 123 * 45?"}]
    schemas = Toolset([calculator]).schemas
    full = tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    tok.chat_template = COMPACT_TOOLS_CHAT_TEMPLATE
    check_tool_chat_template(tok)
    compact = tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert compact == (
        "<|im_start|>system\nBe brief.\n<tools>calculator(expression: string): Evaluate an arithmetic expression."
        "</tools><|im_end|>\n<|im_start|>user\nWhat is 123 * 45?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(tok(compact)["input_ids"]) * 3 < len(tok(full)["input_ids"])
    # Without tools, and for calls and responses, the two templates render the same.
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 1"}}}]}
    rest = [call, {"role": "tool", "name": "calculator", "content": "2"}]
    for template_kwargs in ({}, {"tools": schemas}):
        texts = []
        for template in (CHAT_TEMPLATE, COMPACT_TOOLS_CHAT_TEMPLATE):
            tok.chat_template = template
            texts.append(tok.apply_chat_template([*messages, *rest], tokenize=False, **template_kwargs))
        if template_kwargs:
            texts = [t[t.index("<|im_start|>user"):] for t in texts]
        assert texts[0] == texts[1]
    assert "tool-warm" in FLAVOURS
    with pytest.raises(ConfigError, match=r"builtin:<size>\[-warm\|-tool-warm\]"):
        resolve_builtin("builtin:tiny-toolwarm")


def test_calculator_warm_start_trains_on_until_its_calls_copy_the_expressions(monkeypatch):
    """Extra call-heavy passes run while greedy calls copy under COPY_CRITERION of the expressions (a warm
    start another CPU built can end the phases without it), at most MAX_EXTRA_PHASES, each with new data."""
    from grpo_ascend.models import tiny_tool_warm as warm

    for accuracies, extra_seeds in (([0.81], []), ([0.1, 0.3, 0.6], [18, 19]), ([0.0] * 9, [18, 19, 20, 21])):
        ran, measured = [], iter(accuracies)
        monkeypatch.setattr(warm, "tool_warm_phase", lambda model, tok, phase, seed, ran=ran: ran.append((phase, seed)))
        monkeypatch.setattr(warm, "call_copy_accuracy", lambda model, tok, seed, it=measured: next(it))
        warm.tool_warm_start(object(), object(), seed=11)
        assert [seed for _, seed in ran[:3]] == [11 + p.seed_offset for p in warm.TOOL_WARM_PHASES]
        assert ran[3:] == [(warm.EXTRA_PHASE, s) for s in extra_seeds], accuracies


def test_call_copy_accuracy_reads_the_greedy_call(tiny_tool_model_dir):
    """The shipped calculator warm start copies most held-out expressions into its calls; the plain warm
    start (never shown a call) copies none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_ascend.models.tiny_model import build_tiny_model
    from grpo_ascend.models.tiny_tool_warm import COPY_CRITERION, call_copy_accuracy

    tokenizer = AutoTokenizer.from_pretrained(tiny_tool_model_dir)
    tool_warm = AutoModelForCausalLM.from_pretrained(tiny_tool_model_dir)
    assert call_copy_accuracy(tool_warm, tokenizer, n=8) >= COPY_CRITERION
    plain = AutoModelForCausalLM.from_pretrained(build_tiny_model("tiny", warm=True))
    assert call_copy_accuracy(plain, tokenizer, n=8) == 0.0


def test_warm_start_transcripts_are_what_a_rollout_generates(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = COMPACT_TOOLS_CHAT_TEMPLATE
    ids, labels = tool_transcript(tok, "What is 123 * 45?", 5535, "call")
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Solve the problem. Put only the final number inside <answer></answer>."},
         {"role": "user", "content": "What is 123 * 45?"}],
        tools=Toolset([calculator]).schemas, tokenize=False, add_generation_prompt=True)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    suffix = render_tool_suffix(tok, [ToolResult("calculator", "5535")])
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 45"}}\n</tool_call>'
    generated = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer = tok("<answer>5535</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[n_prompt:] == generated + suffix + answer
    assert labels == [-100] * n_prompt + generated + [-100] * len(suffix) + answer
    ids, labels = tool_transcript(tok, "What is 123 * 45?", 5535, "no_tools")
    assert "<tools>" not in tok.decode(ids) and labels[-len(answer):] == answer


def _calculator_trainer(tmp_path, model_dir, learning_rate=1e-3, tools=("calculator",), steps=16):
    """A short GRPO run of the demo's setting (products, the calculator, accuracy), not yet trained."""
    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend.data.synthetic import products_dataset
    from grpo_ascend.models.policy import default_lora_config
    from reward_models import load_reward_function

    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": steps, "num_generations": 8,
                        "per_device_train_batch_size": 32, "learning_rate": learning_rate,
                        "max_completion_length": 100, "max_prompt_length": 160, "temperature": 1.0,
                        "max_tool_calling_iterations": 1, "loss_type": "dapo", "beta": 0.0,
                        "per_device_eval_batch_size": 256})
    return GRPOTrainer(str(model_dir), [load_reward_function({"name": "accuracy", "math_verify": False})], cfg,
                       products_dataset(64, seed=5), peft_config=default_lora_config(r=16), tools=list(tools))


@pytest.mark.slow
def test_accuracy_rises_with_the_calculator(tmp_path, tiny_tool_model_dir):
    """Trained with the calculator, the tool-warm model's sampled accuracy on held-out products ends
    far above the same evaluation before training (the control: same model, prompts and sampling, no
    updates; equal at learning rate 0): GRPO makes it call the tool and copy the result.

    Measured (eval accuracy before → after, 32 held-out products × 8): 0.52 → 0.82 (warm seed 0).
    About 33 s on one thread.
    """
    from grpo_ascend.data.synthetic import products_dataset

    control, trained = rewards_before_and_after_training(_calculator_trainer(tmp_path, tiny_tool_model_dir),
                                                         products_dataset(32, seed=6))
    assert trained > control + 0.1, (trained, control)
