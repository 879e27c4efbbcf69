"""Prompt datasets: loading (hub, local files, the synthetic task), checks, and resumable sampling."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.data.synthetic import SYNTHETIC_TASKS
from grpo_ascend.errors import DataError, closest

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
#: The prompt of a row without one, when environments supply the prompts (TRL 1.16: an empty user message,
#: to which ``reset()``'s observation is added).
EMPTY_PROMPT: list[dict[str, str]] = [{"role": "user", "content": ""}]


def row_prompt(row: Mapping[str, Any]) -> Any:
    """A dataset row's prompt; :data:`EMPTY_PROMPT` for a row without one (only environment runs accept such
    datasets, see :func:`check_prompt_dataset`'s ``require_prompt``)."""
    return row["prompt"] if "prompt" in row else [dict(m) for m in EMPTY_PROMPT]


def load_prompt_dataset(
    spec: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    synthetic_kwargs: dict[str, Any] | None = None,
    prompt_column: str = "prompt",
    system_prompt: str | None = None,
    max_samples: int | None = None,
):
    """Load a prompt dataset from ``synthetic:<task>`` (``arithmetic``, ``products``, ``coloured_shapes``), a local file, or a hub id, then check it."""
    from datasets import load_dataset

    if spec.startswith("synthetic:"):
        import inspect


        task = spec.split(":", 1)[1]
        if task not in SYNTHETIC_TASKS:
            known = ", ".join(f"synthetic:{t}" for t in SYNTHETIC_TASKS)
            raise DataError(f"unknown synthetic task {task!r}{closest(task, SYNTHETIC_TASKS)}; the built-in ones are {known}")
        builder = SYNTHETIC_TASKS[task]
        kwargs = dict(synthetic_kwargs or {})
        if system_prompt is not None:
            kwargs["system_prompt"] = system_prompt
        try:
            ds = builder(**kwargs)
        except TypeError as exc:
            valid = ", ".join(p for p in inspect.signature(builder).parameters if p != "system_prompt")
            raise DataError(f"dataset_kwargs for {spec}: {exc}; valid: {valid}") from exc
        system_prompt = None
    else:
        suffix = Path(spec).suffix.lower()
        if suffix in _LOCAL_FORMATS or os.path.exists(spec):
            if not os.path.exists(spec):
                raise DataError(f"dataset file not found: {spec!r}")
            if suffix not in _LOCAL_FORMATS:
                raise DataError(f"dataset file {spec!r}: expected one of {sorted(_LOCAL_FORMATS)}")
            if not Path(spec).read_bytes().strip():
                raise DataError(f"the prompt dataset is empty: {spec!r} has no rows")
            try:
                ds = load_dataset(_LOCAL_FORMATS[suffix], data_files=spec, split="train")
            except Exception as exc:  # datasets raises many types for unreadable files
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise DataError(f"could not read dataset file {spec!r}: {reason}") from exc
        else:
            try:
                ds = load_dataset(spec, config_name, split=split)
            except Exception as exc:
                raise DataError(
                    f"could not load dataset {spec!r} (split {split!r}): {exc}".splitlines()[0]
                    + " — offline? use a local file or synthetic:arithmetic"
                ) from exc
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    check_prompt_dataset(ds, prompt_column)
    if prompt_column != "prompt":
        if "prompt" in ds.column_names:
            ds = ds.remove_columns("prompt")
        ds = ds.rename_column(prompt_column, "prompt")
    if system_prompt is not None:
        ds = ds.map(lambda row: {"prompt": with_system_prompt(row["prompt"], system_prompt)})
    return ds


def is_stream(ds: Any) -> bool:
    """True for a dataset read by iteration only (``datasets.IterableDataset``, e.g. ``streaming=True``)."""
    return hasattr(ds, "__iter__") and not hasattr(ds, "__len__")


def dataset_columns(ds: Any) -> list[str]:
    """The column names of a dataset, a stream (its features, else its first row) or a list of rows."""
    names = getattr(ds, "column_names", None)
    if names is not None:
        return list(names)
    first = next(iter(ds), None)
    if first is None:
        raise DataError("the prompt dataset is empty; check the file, split or max_train_samples")
    return list(first)


def check_prompt_dataset(ds: Any, prompt_column: str = "prompt", require_prompt: bool = True) -> None:
    """Refuse empty datasets and datasets without the prompt column (listing the columns it has).

    A stream (:func:`is_stream`) is checked by its features, or by its first row when it declares none;
    a stream that turns out empty is refused when it is first read. ``require_prompt=False`` (environments
    supply the prompts, TRL 1.16's ``environment_factory``) accepts rows without one (:func:`row_prompt`).
    """
    if not is_stream(ds) and len(ds) == 0:
        raise DataError("the prompt dataset is empty; check the file, split or max_train_samples")
    if is_stream(ds) and iter(ds) is ds:
        raise DataError(f"the dataset is a one-shot iterator ({type(ds).__name__}): it cannot be read again for a new "
                        "epoch, a resume or an evaluation; pass a datasets.Dataset or datasets.IterableDataset "
                        "(e.g. IterableDataset.from_generator)")
    columns = dataset_columns(ds)
    if require_prompt and prompt_column not in columns:
        raise DataError(
            f"the dataset has no prompt column {prompt_column!r}; its columns are {columns} — "
            "set prompt_column to the one holding the prompts"
        )


def eval_prompt_rows(ds: Any) -> Any:
    """An eval set indexable by row: a map-style dataset as it is, a stream read once into a list of rows."""
    if not is_stream(ds):
        return ds
    rows = [dict(row) for row in ds]
    if not rows:
        raise DataError("the eval dataset is empty: the stream yielded no rows")
    return rows


def with_system_prompt(prompt: str | list[dict[str, str]], system_prompt: str) -> list[dict[str, str]]:
    """Turn a text prompt into a chat with a system message; chats get one if they have none."""
    if isinstance(prompt, str):
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
    if prompt and prompt[0].get("role") == "system":
        return list(prompt)
    return [{"role": "system", "content": system_prompt}, *prompt]


def is_conversational(prompt: Any) -> bool:
    """True for TRL's conversational format: a list of {'role', 'content'} messages."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def make_prompt_sampler(dataset: Any, seed: int = 0, shuffle: bool = True,
                        require_prompt: bool = True) -> PromptSampler | StreamSampler:
    """The resumable sampler for ``dataset``: :class:`StreamSampler` for a stream, else :class:`PromptSampler`
    (``require_prompt``: see :func:`check_prompt_dataset`)."""
    check_prompt_dataset(dataset, require_prompt=require_prompt)
    return StreamSampler(dataset, seed, shuffle) if is_stream(dataset) else PromptSampler(dataset, seed, shuffle)


class _Sampler:
    """What both samplers hold: the dataset (checked by :func:`make_prompt_sampler`), the seed and whether to shuffle, and the position."""

    def __init__(self, dataset: Any, seed: int, shuffle: bool):
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0


class PromptSampler(_Sampler):
    """Endless, seeded sampling of dataset rows, epoch by epoch, with an exact-resume state.

    Each epoch uses a permutation drawn from ``seed + epoch`` (or the identity when not shuffling),
    so the order depends only on (seed, epoch, position) — the state is two integers.
    """

    def __init__(self, dataset: Any, seed: int = 0, shuffle: bool = True):
        super().__init__(dataset, seed, shuffle)
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=gen).tolist()

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.position / len(self.dataset)

    @property
    def draws(self) -> int:
        """Rows drawn so far over all epochs (numbers each draw's prompts, e.g. as group ids)."""
        return self.epoch * len(self.dataset) + self.position

    def next_rows(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` rows, crossing into the next epoch (new permutation) when needed."""
        rows = []
        while len(rows) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(rows), len(self._order) - self.position)
            idx = self._order[self.position : self.position + take]
            batch = self.dataset[idx] if take else {}
            rows.extend({k: batch[k][i] for k in batch} for i in range(take))
            self.position += take
        return rows

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("kind") == StreamSampler.kind:
            raise DataError("the checkpoint was taken on a streamed dataset (datasets.IterableDataset), this run has a "
                            "map-style one; resume with the same dataset")
        if state.get("size") not in (None, len(self.dataset)):
            raise DataError(
                f"the checkpoint was taken on a dataset of {state['size']} prompts, this one has "
                f"{len(self.dataset)}; resume with the same dataset"
            )
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)


class StreamSampler(_Sampler):
    """Endless sampling of a stream (``datasets.IterableDataset``), pass by pass, with an exact-resume state.

    As in transformers, a stream that runs out starts over as the next epoch. With ``shuffle`` each
    pass goes through the dataset's buffered shuffle seeded by ``seed`` and re-seeded per epoch
    (``set_epoch``), as TRL shuffles a streamed train set; the order then depends only on (seed,
    epoch, position). The state is those integers: a resume reads the epoch's pass again and skips
    the rows already drawn (re-reading them, since a stream cannot seek), so it continues with
    exactly the rows an uninterrupted run would draw. A stream without ``shuffle``/``set_epoch``
    (a plain iterable) is read in its own order.
    """

    kind = "stream"

    def __init__(self, dataset: Any, seed: int = 0, shuffle: bool = True):
        super().__init__(dataset, seed, shuffle)
        self.draws = 0  #: rows drawn so far over all epochs (numbers each draw's prompts)
        self.size: int | None = None  #: rows in one pass, known once a pass has ended
        self._ordered = dataset.shuffle(seed=seed) if shuffle and hasattr(dataset, "shuffle") else dataset
        self._rows: Iterator[Any] | None = None

    @property
    def epochs_done(self) -> float:
        """Completed passes, plus the fraction of this one once a pass's length is known."""
        return self.epoch + (self.position / self.size if self.size else 0.0)

    def _open(self, skip: int) -> Iterator[Any]:
        if hasattr(self._ordered, "set_epoch"):
            self._ordered.set_epoch(self.epoch)
        return itertools.islice(iter(self._ordered), skip, None)

    def next_rows(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` rows, starting the next epoch (a new pass) when the stream runs out."""
        rows: list[dict[str, Any]] = []
        if self._rows is None:
            self._rows = self._open(self.position)
        while len(rows) < n:
            row = next(self._rows, None)
            if row is None:
                if self.position == 0:
                    raise DataError("the prompt dataset is empty: the stream yielded no rows")
                self.size = self.position
                self.epoch += 1
                self.position = 0
                self._rows = self._open(0)
                continue
            rows.append(dict(row))
            self.position += 1
            self.draws += 1
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "position": self.position, "draws": self.draws,
                "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise DataError(
                f"the checkpoint was taken on a map-style dataset of {state.get('size')} prompts, this run streams "
                "its prompts (datasets.IterableDataset); resume with the same dataset"
            )
        self.seed = int(state.get("seed", self.seed))
        if self.shuffle and hasattr(self.dataset, "shuffle"):
            self._ordered = self.dataset.shuffle(seed=self.seed)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.draws = int(state["draws"])
        self.size = None if state.get("size") is None else int(state["size"])
        self._rows = None  # reopened at the next draw, skipping the rows already drawn in this epoch
