"""`grpo-ascend train / plot / export` end to end, recipe checks, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_ascend.cli import main
from grpo_ascend.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_loads_and_validates(recipe):
    spec, cfg = load_recipe(ROOT / "recipes" / recipe)
    assert spec.reward_funcs
    cfg.batch_plan()


def test_config_reference_page_is_current():
    from grpo_ascend.config.docs import DEFAULT_PATH, update_config_reference

    assert DEFAULT_PATH == ROOT / "docs" / "configuration.md"
    assert update_config_reference(DEFAULT_PATH, check=True), "run: python -m grpo_ascend.config.docs"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("recipe", "extra", "message"),
    [
        (None, [], "config file not found"),
        ("modle: builtin:tiny\n", [], "unknown key 'modle' (did you mean 'model'?)"),
        ("dataset: {data}\nprompt_column: question\n", [], "has no prompt column 'question'; its columns are ['text', 'answer']"),
        ("dataset: {empty}\n", [], "the prompt dataset is empty"),
        ("reward_funcs: [missing_dir/nope.py:f]\n", [], "nope.py"),
        ("num_generations: 1\n", [], "num_generations must be >= 2"),
        ("max_steps: 2\n", ["--learning_rate", "fast"], "learning_rate: expected a number"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, recipe, extra, message):
    data = _write(tmp_path, "d.jsonl", '{"text": "hi", "answer": "1"}\n')
    empty = _write(tmp_path, "e.jsonl", "")
    if recipe is None:
        path = tmp_path / "missing.yaml"
    else:
        path = _write(tmp_path, "r.yaml", "model: builtin:tiny\n" * ("model" not in recipe and "modle" not in recipe)
                      + recipe.format(data=data, empty=empty))
    code, _, err = _run(capsys, "train", str(path), "--output_dir", str(tmp_path / "o"), *extra)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("grpo-ascend: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_train_plot_export_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    recipe = _write(tmp_path, "r.yaml", (
        "model: builtin:tiny\ndataset: synthetic:arithmetic\ndataset_kwargs: {n: 32}\n"
        "reward_funcs: [accuracy, {name: format, tags: [answer]}]\nreward_weights: [1.0, 0.5]\n"
        "num_generations: 4\nper_device_train_batch_size: 8\nmax_completion_length: 6\nmax_prompt_length: 96\n"
        "lora_r: 4\nlora_alpha: 8\nlearning_rate: 1.0e-3\nmax_steps: 3\nsave_steps: 2\nlog_completions_steps: 1\n"
        "num_completions_to_print: 2\nexport_adapter_at_end: true\ndisable_tqdm: true\nreport_to: [tensorboard]\n"))
    code, stdout, err = _run(capsys, "train", str(recipe), "--output_dir", str(out), "--seed", "3")
    assert code == 0, err
    assert "batch plan: 2 prompts × 4 generations" in stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("reward", "rewards/accuracy/mean", "rewards/format/mean", "loss", "grad_norm", "entropy",
                "completion_length/mean", "time/generation", "time/training", "memory/peak_gb", "learning_rate"):
        assert key in metrics[0], key
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and {"prompt", "completion", "reward", "rewards/accuracy"} <= samples[0].keys()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert list(out.glob("*/events.out.tfevents.*")), "TensorBoard events were not written"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3

    code, stdout, err = _run(capsys, "plot", str(out))
    assert code == 0, err
    assert (out / "plot.png").stat().st_size > 10_000

    code, stdout, err = _run(capsys, "export", str(out / "checkpoint-3"), "--out", str(tmp_path / "exported"))
    assert code == 0, err
    assert (tmp_path / "exported" / "adapter_config.json").exists()

    code, stdout, err = _run(capsys, "plot", str(tmp_path / "nothing-here"))
    assert code == 2 and "no metrics" in err


@pytest.mark.slow
def test_docs_python_api_example_runs(tmp_path, monkeypatch):
    """The Python API example of docs/trainer.md runs as written (in a scratch folder)."""
    page = ROOT / "docs" / "trainer.md"
    example = page.read_text().split("## Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(example, str(page), "exec"), {"__name__": "docs_example"})  # noqa: S102 - our own docs
    summary = json.loads((tmp_path / "outputs" / "api" / "summary.json").read_text())
    assert summary["steps"] == 10


def test_an_error_starts_its_own_line_after_the_progress_bar(tmp_path, capsys):
    """A failure mid-run closes the progress bar first, so the error never shares the bar's line."""
    _write(tmp_path, "boom.py", "def boom(completions, **kwargs):\n    raise ValueError('boom')\n")
    recipe = _write(tmp_path, "r.yaml", (
        "model: builtin:tiny\ndataset: synthetic:arithmetic\ndataset_kwargs: {n: 8}\n"
        f"reward_funcs: [{tmp_path / 'boom.py'}:boom]\nnum_generations: 2\nper_device_train_batch_size: 4\n"
        "max_completion_length: 4\nmax_prompt_length: 96\nmax_steps: 2\nsave_steps: 0\ndisable_tqdm: false\n"))
    code, _, err = _run(capsys, "train", str(recipe), "--output_dir", str(tmp_path / "o"))
    assert code == 2, err
    assert "train:" in err, "the progress bar was not shown"
    errors = [line for line in err.splitlines() if "grpo-ascend: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("grpo-ascend: error:") and "boom" in errors[0], err


def test_wrapping_a_model_with_lora_warns_nothing(tiny_model_dir):
    """peft's read of transformers' deprecated is_gradient_checkpointing does not reach the user."""
    import warnings

    from grpo_ascend.models.policy import apply_peft, default_lora_config, load_causal_lm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_peft(load_causal_lm(str(tiny_model_dir)), default_lora_config(r=4))
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))], caught
