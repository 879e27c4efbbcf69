"""TRL's dataset forms and reward tokenizers: a streamed (``IterableDataset``) train set with exact
resume across an epoch boundary, ``max_steps`` required for it, streamed and named eval sets (a dict
or ``DatasetDict``) with per-set metric keys and best-checkpoint selection by them, and
``reward_processing_classes`` scoring a reward model with the tokenizer given for it."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset
from helpers import SMALL_RUN, preempt_and_resume

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.prompts import StreamSampler, make_prompt_sampler
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.eval_metrics import best_metric_key
from grpo_ascend.models.policy import default_lora_config
from reward_models import RewardSet

CPU = torch.device("cpu")


def _config(tmp_path, name="run", **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / name), **kw})


def _prompts(n, tag="p"):
    return Dataset.from_dict({"prompt": [f"{tag}{i} what is {i} + 1?" for i in range(n)], "row": list(range(n))})


def _length_reward(completions, **kwargs):
    """Varies within every group, so every step moves the weights."""
    return [len(c) / 10 for c in completions]


# ------------------------------------------------------------------------------------- streamed train set
def test_stream_sampler_resumes_exactly_and_refuses_the_other_kind():
    stream = _prompts(5).to_iterable_dataset()
    first = make_prompt_sampler(stream, seed=3)
    assert isinstance(first, StreamSampler)
    drawn = [r["row"] for r in first.next_rows(7)]  # crosses into epoch 1 (a new shuffle)
    assert sorted(drawn[:5]) == [0, 1, 2, 3, 4] and drawn[:5] != [0, 1, 2, 3, 4]
    state = first.state_dict()
    assert state == {"kind": "stream", "epoch": 1, "position": 2, "draws": 7, "seed": 3, "size": 5}
    assert first.epochs_done == pytest.approx(1.4)
    rest = [r["row"] for r in first.next_rows(6)]
    resumed = make_prompt_sampler(stream, seed=3)
    resumed.load_state_dict(state)
    assert [r["row"] for r in resumed.next_rows(6)] == rest
    in_order = make_prompt_sampler(stream, shuffle=False)
    assert [r["row"] for r in in_order.next_rows(7)] == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(DataError, match="map-style dataset of 5 prompts"):
        make_prompt_sampler(stream).load_state_dict(make_prompt_sampler(_prompts(5)).state_dict())
    with pytest.raises(DataError, match="streamed dataset"):
        make_prompt_sampler(_prompts(5)).load_state_dict(state)
    with pytest.raises(DataError, match="no prompt column"):
        make_prompt_sampler(Dataset.from_dict({"text": ["a"]}).to_iterable_dataset())
    with pytest.raises(DataError, match="one-shot iterator"):
        make_prompt_sampler(iter([{"prompt": "a"}]))
    from_generator = IterableDataset.from_generator(lambda: ({"prompt": f"g{i}"} for i in range(3)))
    assert [r["prompt"] for r in make_prompt_sampler(from_generator, shuffle=False).next_rows(4)] == ["g0", "g1", "g2",
                                                                                                     "g0"]


def test_a_streamed_train_set_needs_max_steps(tmp_path):
    with pytest.raises(ConfigError, match=r"train_dataset is a stream .*set max_steps > 0 \(got max_steps=-1\)"):
        GRPOTrainer("builtin:tiny", _length_reward, args=_config(tmp_path, max_steps=-1),
                    train_dataset=_prompts(4).to_iterable_dataset())


def test_streamed_training_resumes_with_the_prompts_of_an_uninterrupted_run(tmp_path):
    """5 streamed prompts, 2 per step, 4 steps: the run crosses an epoch boundary after the checkpoint
    at step 2; the interrupted and resumed run draws the same prompts in the same order, and ends with
    the same weights."""

    seen: list[list[str]] = []  # the prompts each trainer drew, one list per trainer made

    def make(name):
        drawn: list[str] = []
        seen.append(drawn)

        def recording_reward(prompts, completions, **kwargs):
            drawn.extend(prompts[::4])  # one entry per prompt (G = 4)
            return _length_reward(completions)

        cfg = _config(tmp_path, name, max_steps=4, save_steps=2)
        return GRPOTrainer("builtin:tiny", recording_reward, args=cfg, train_dataset=_prompts(5).to_iterable_dataset(),
                           peft_config=default_lora_config(r=4))

    full, killed, resumed = preempt_and_resume(make, step=2)
    full_seen, before, after = seen
    assert len(full_seen) == 8 and sorted(full_seen[:5]) == sorted(_prompts(5)["prompt"])
    assert full_seen[5:] != full_seen[:3]  # epoch 1 is shuffled anew
    assert killed.step == 2 and len(before) == 4
    assert before + after == full_seen
    assert resumed.state.epoch == pytest.approx(8 / 5)
    for (name, a), b in zip(full.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------- eval sets
def _set_reward(completions, target, trainer_state=None, **kwargs):
    """The row's ``target`` column: each eval set scores its own constant."""
    return [float(t) for t in target]


def _with_target(ds, value):
    return ds.add_column("target", [value] * len(ds))


def test_streamed_and_named_eval_sets_give_per_set_metrics(tmp_path):
    """A streamed eval set and a dict / DatasetDict of sets: each set's metrics under transformers'
    prefix ``eval_<name>`` (``eval_<name>/reward``), each logged on its own, all returned together."""
    train = _with_target(_prompts(4), 0.5)
    stream = _with_target(_prompts(3, "s"), 0.25).to_iterable_dataset()
    named = {"data1": _with_target(_prompts(2, "a"), 1.0), "data2": stream}
    trainer = GRPOTrainer("builtin:tiny", _set_reward, args=_config(tmp_path, max_steps=1), train_dataset=train,
                          eval_dataset=named)
    metrics = trainer.evaluate()
    assert metrics["eval_data1/reward"] == 1.0 and metrics["eval_data1/num_prompts"] == 2
    assert metrics["eval_data2/reward"] == 0.25 and metrics["eval_data2/num_prompts"] == 3
    assert not any(k.startswith("eval/") for k in metrics)
    logged = [sorted({k.split("/")[0] for k in r if k != "step"}) for r in trainer.state.log_history]
    assert logged == [["eval_data1", "eval_data1_loss"], ["eval_data2", "eval_data2_loss"]]  # + TRL's loss name
    by_name = trainer.evaluate("data2")  # one of the trainer's sets, by its name
    assert set(by_name) == {k for k in metrics if k.startswith("eval_data2")} and by_name["eval_data2/reward"] == 0.25
    one = trainer.evaluate(_with_target(_prompts(3, "t"), 0.75).to_iterable_dataset())
    assert one["eval/reward"] == 0.75 and one["eval/num_prompts"] == 3
    as_dict = trainer.evaluate(DatasetDict({"x": _with_target(_prompts(2), 0.0)}), metric_key_prefix="test")
    assert as_dict["test_x/reward"] == 0.0
    with pytest.raises(ConfigError, match=r"eval sets are \['data1', 'data2'\]"):
        trainer.evaluate("data3")


def test_best_metric_names_resolve_for_one_and_for_named_eval_sets():
    class Cfg:
        metric_for_best_model = None

    one = {"eval/reward": 1.0, "eval/rewards/f/mean": 2.0}
    named = {"eval_a/reward": 1.0, "eval_b/reward": 2.0, "eval_b/pass@1": 0.5}
    for name, metrics, key in [
        (None, one, "eval/reward"), ("reward", one, "eval/reward"), ("eval_reward", one, "eval/reward"),
        ("eval/rewards/f/mean", one, "eval/rewards/f/mean"), ("rewards/f/mean", one, "eval/rewards/f/mean"),
        ("eval_b/reward", named, "eval_b/reward"), ("b/reward", named, "eval_b/reward"),
        ("eval_b_reward", named, "eval_b/reward"), ("b_pass@1", named, "eval_b/pass@1"),
    ]:
        Cfg.metric_for_best_model = name
        assert best_metric_key(Cfg, metrics) == key, name
    Cfg.metric_for_best_model = "reward"
    with pytest.raises(ConfigError, match=r"'reward' is not an eval metric; choose one of \['eval_a/reward'"):
        best_metric_key(Cfg, named)


def test_best_checkpoint_by_a_named_eval_set_metric(tmp_path):
    """Set ``b``'s reward peaks at step 2, set ``a``'s at step 3: ``metric_for_best_model`` in
    transformers' spelling (``eval_b_reward``) picks checkpoint-2 and records ``eval_b/reward``."""

    def step_reward(completions, target, trainer_state=None, **kwargs):
        peak = {"a": 3, "b": 2, "t": -1}
        return [1.0 if trainer_state["step"] == peak[t] else 0.1 * trainer_state["step"] for t in target]

    cfg = _config(tmp_path, max_steps=3, save_steps=1, eval_strategy="steps", metric_for_best_model="eval_b_reward")
    sets = {"a": _with_target(_prompts(1, "a"), "a"), "b": _with_target(_prompts(1, "b"), "b")}
    trainer = GRPOTrainer("builtin:tiny", step_reward, args=cfg, train_dataset=_with_target(_prompts(4), "t"),
                          eval_dataset=sets)
    trainer.train()
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best == {"checkpoint": "checkpoint-2", "step": 2, "metric": "eval_b/reward", "value": 1.0}
    evals = [r for r in trainer.state.log_history if "eval_a/reward" in r]
    assert [(r["step"], r["eval_a/reward"]) for r in evals] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)),
                                                               (3, 1.0)]


# ------------------------------------------------------------------------------------- reward tokenizers
@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A reward model: the tiny Qwen2 with a fresh one-logit head, saved with the tiny tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def word_tokenizer():
    """A word-level tokenizer unlike the model's own: whole words get ids 10, 11, ... (pad id 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "what is two plus three four five yes no the answer".split()
    vocab = {"[UNK]": 1, "</s>": 2, "[PAD]": 3, **{w: 10 + i for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>", pad_token="[PAD]")


PROMPTS = ["what is two plus two", "what is three plus three", "the answer"]
COMPLETIONS = [" four", " five no", " yes yes yes"]


def _manual(rm_dir, tokenizer, texts):
    """One unpadded forward per text: the score of that tokenizer's ids."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([tokenizer(t)["input_ids"]])).logits[0, 0].item() for t in texts]


def test_reward_processing_classes_score_with_the_given_tokenizer(rm_dir, word_tokenizer):
    from transformers import AutoTokenizer

    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert word_tokenizer(texts[0])["input_ids"] == [10, 11, 12, 13, 12, 15]
    want = _manual(rm_dir, word_tokenizer, texts)
    own = _manual(rm_dir, AutoTokenizer.from_pretrained(rm_dir), texts)
    assert all(abs(w - o) > 1e-3 for w, o in zip(want, own))  # the two tokenizers really score differently

    def constant(completions, **kwargs):
        return [0.5] * len(completions)

    rewards = RewardSet([constant, str(rm_dir)], device=CPU, reward_processing_classes=[word_tokenizer, word_tokenizer])
    assert rewards.funcs[1].tokenizer is word_tokenizer  # the plain function's entry is unused
    assert rewards.funcs[1].model.config.pad_token_id == 3  # the rows are padded with the given tokenizer's pad
    out = rewards(PROMPTS, COMPLETIONS, [[1]] * 3, {})
    assert out.per_function[:, 1].tolist() == pytest.approx(want, abs=1e-4)
    single = RewardSet({"name": "reward_model", "model": str(rm_dir), "batch_size": 2}, device=CPU,
                       reward_processing_classes=word_tokenizer)
    assert single(PROMPTS, COMPLETIONS, [[1]] * 3, {}).total.tolist() == pytest.approx(want, abs=1e-4)
    default = RewardSet([str(rm_dir)], device=CPU, reward_processing_classes=[None])
    assert default(PROMPTS, COMPLETIONS, [[1]] * 3, {}).total.tolist() == pytest.approx(own, abs=1e-4)
    with pytest.raises(ConfigError, match="tokenizer was given twice"):
        RewardSet({"name": "reward_model", "model": str(rm_dir), "tokenizer": word_tokenizer}, device=CPU,
                  reward_processing_classes=word_tokenizer)


def test_trainer_takes_reward_processing_classes_and_checks_their_number(tmp_path, rm_dir, word_tokenizer):
    with pytest.raises(ConfigError, match=r"number of reward processing classes \(1\) must match the number of "
                                          r"reward functions \(2\)"):
        GRPOTrainer("builtin:tiny", [_length_reward, str(rm_dir)], args=_config(tmp_path),
                    train_dataset=_prompts(4), reward_processing_classes=[word_tokenizer])
    trainer = GRPOTrainer("builtin:tiny", [_length_reward, str(rm_dir)], args=_config(tmp_path),
                          train_dataset=_prompts(4), reward_processing_classes=[None, word_tokenizer])
    scorer = trainer.rewards.funcs[1]
    assert scorer.tokenizer is word_tokenizer
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    out = trainer.rewards(PROMPTS, COMPLETIONS, [[1]] * 3, {})
    assert out.per_function[:, 1].tolist() == pytest.approx(_manual(rm_dir, word_tokenizer, texts), abs=1e-4)
