"""The learned reward-model scorer on a one-logit sequence-classification head built from the tiny model."""

from __future__ import annotations

import pytest
import torch

from grpo_ascend.errors import ConfigError, RewardError
from reward_models import RewardModelScorer, RewardSet, load_reward_function

CPU = torch.device("cpu")
PROMPTS = ["What is 2 + 2?", "Say hello.", "What is 3 * 3?", "Write a long story about a cat and a dog."]
COMPLETIONS = [
    "<answer>4</answer>",
    "hello world",
    "<answer>9</answer> because three times three",
    "The cat sat.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards are fastest on one thread, and stay fast when other tests load the CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A reward model directory: the tiny Qwen2 with a fresh one-logit score head, and its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.config.pad_token_id = tokenizer.pad_token_id
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    return model, AutoTokenizer.from_pretrained(rm_dir)


def manual_scores(model, tokenizer, texts, add_special_tokens=True, max_length=None):
    """One unpadded forward per text: the score the scorer must reproduce."""
    scores = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            if max_length is not None:
                ids = ids[-max_length:]
            scores.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return scores


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_plain_text_scores_equal_manual_forward(rm_dir, reference, batch_size):
    scorer = RewardModelScorer(str(rm_dir), batch_size=batch_size, device=CPU)
    got = scorer(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4)
    want = manual_scores(*reference, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert len(set(round(w, 6) for w in want)) == 4  # the texts really score differently
    assert got == pytest.approx(want, abs=1e-4)


def test_chat_samples_use_the_rm_chat_template(rm_dir, reference):
    model, tokenizer = reference
    prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    got = RewardModelScorer(rm_dir, batch_size=2, device=CPU)(prompts=prompts, completions=completions)
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    assert texts[0].endswith("<|im_start|>assistant\n<answer>4</answer><|im_end|>\n")
    assert got == pytest.approx(manual_scores(model, tokenizer, texts, add_special_tokens=False), abs=1e-4)


def test_truncation_keeps_the_end(rm_dir, reference):
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    got = RewardModelScorer(rm_dir, max_length=6, batch_size=4, device=CPU)(
        prompts=PROMPTS, completions=COMPLETIONS
    )
    assert got == pytest.approx(manual_scores(*reference, texts, max_length=6), abs=1e-4)


def test_pad_token_falls_back_to_eos(tiny_model_dir, tmp_path, reference):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reference[0].config._name_or_path)
    model.config.pad_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    scorer = RewardModelScorer(model, tokenizer=tokenizer, batch_size=4, device=CPU)
    assert tokenizer.pad_token == tokenizer.eos_token and model.config.pad_token_id == tokenizer.eos_token_id
    got = scorer(prompts=PROMPTS, completions=COMPLETIONS)
    assert got == pytest.approx(
        manual_scores(*reference, [p + c for p, c in zip(PROMPTS, COMPLETIONS)]), abs=1e-4
    )


def test_scorer_is_frozen_and_runs_without_grad(rm_dir):
    scorer = RewardModelScorer(rm_dir, device=CPU)
    assert not scorer.model.training
    assert not any(p.requires_grad for p in scorer.model.parameters())
    assert not scorer.score_ids([[5, 6, 7]]).requires_grad


def test_in_a_reward_set_by_path_and_by_mapping(rm_dir, reference):
    rewards = RewardSet(
        [str(rm_dir), {"name": "reward_model", "model": str(rm_dir), "batch_size": 2}, "format"],
        reward_weights=[1.0, 0.0, 1.0],
        device=CPU,
    )
    assert rewards.names == ["tiny-rm", "tiny-rm_2", "format"]
    assert rewards.funcs[0].device == CPU
    out = rewards(PROMPTS, COMPLETIONS, [[1, 2]] * 4, {"answer": ["4", "x", "9", "x"]})
    want = manual_scores(*reference, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert out.per_function[:, 0].tolist() == pytest.approx(want, abs=1e-4)
    assert out.per_function[:, 1].tolist() == pytest.approx(want, abs=1e-4)
    assert out.total.tolist() == pytest.approx([w + f for w, f in zip(want, [1.0, 0.0, 0.0, 0.0])], abs=1e-4)


def test_loaded_model_object_with_processing_class(rm_dir, reference):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    fn = load_reward_function(model, device=CPU, processing_class=reference[1])
    assert isinstance(fn, RewardModelScorer)
    assert fn(prompts=["a"], completions=["b"]) == pytest.approx(manual_scores(*reference, ["ab"]), abs=1e-4)


def test_dtype_option(rm_dir):
    scorer = RewardModelScorer(rm_dir, device=CPU, dtype="bfloat16")
    assert next(scorer.model.parameters()).dtype == torch.bfloat16
    assert all(isinstance(v, float) for v in scorer(prompts=PROMPTS, completions=COMPLETIONS))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"max_length": -1}, "max_length must be a positive integer"),
        ({"dtype": "int8"}, "dtype must be a floating dtype name"),
        ({"dtype": "float99"}, "dtype must be a floating dtype name"),
    ],
)
def test_option_errors(rm_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RewardModelScorer(rm_dir, device=CPU, **kwargs)


def test_more_than_one_label_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2).save_pretrained(
        tmp_path / "two"
    )
    with pytest.raises(ConfigError, match="has num_labels=2; a reward model must output exactly one logit"):
        RewardModelScorer(tmp_path / "two", device=CPU)
    with pytest.raises(ConfigError, match="has num_labels=2"):
        RewardModelScorer(
            AutoModelForSequenceClassification.from_pretrained(tmp_path / "two"),
            tokenizer=object(),
            device=CPU,
        )


def test_causal_lm_directory_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="num_labels=2"):
        RewardSet([str(tiny_model_dir)], device=CPU)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("models/does-not-exist", "could not load reward model 'models/does-not-exist'"),
    ],
)
def test_missing_model_path(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_reward_function(spec, device=CPU)


def test_loaded_model_without_tokenizer_is_refused(reference):
    with pytest.raises(ConfigError, match="without a tokenizer"):
        RewardModelScorer(reference[0], device=CPU)


def test_bad_calls(rm_dir):
    scorer = RewardModelScorer(rm_dir, device=CPU)
    assert scorer(prompts=[], completions=[]) == []
    with pytest.raises(RewardError, match="got 1 prompts for 2 completions"):
        scorer(prompts=["a"], completions=["b", "c"])
    with pytest.raises(RewardError, match="sample 0 is empty after tokenization"):
        scorer(prompts=[""], completions=[""])
