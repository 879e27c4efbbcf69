"""A synthetic visual task for vision-language GRPO, offline: which colour is the shape in the picture?

Each row holds a small picture of one red or blue shape (square or disc, random size and place on a grey
ground) and the question. The policy answers with the colour's code: a completion starting with a letter
from ``a``-``m`` means red, ``n``-``z`` blue (:func:`colour_code_reward`). About half of a random policy's
letters already fall in either half, so a group has reward variance from the first step, and only a
policy that looks at the picture can do better than chance: the text is the same for every row.
"""

from __future__ import annotations

import random
from typing import Any

COLOURS = {"red": (220, 40, 40), "blue": (40, 60, 220)}
#: The first letters that name each colour.
CODES = {"red": "abcdefghijklm", "blue": "nopqrstuvwxyz"}
QUESTION = "Which colour is the shape? Answer with its code."
SIDE = 28


def shape_image(colour: str, rng: random.Random) -> Any:
    """A ``SIDE`` x ``SIDE`` picture of one ``colour`` shape on grey."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), (128, 128, 128))
    size = rng.randint(14, 24)
    x, y = rng.randint(0, SIDE - size), rng.randint(0, SIDE - size)
    draw = ImageDraw.Draw(image)
    box = (x, y, x + size, y + size)
    (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=COLOURS[colour])
    return image


def shape_rows(n: int, seed: int = 0) -> list[tuple[str, Any]]:
    """``n`` (colour, picture) pairs, reproducible by ``seed``: the rows of :func:`coloured_shapes_dataset`."""
    rng = random.Random(seed)
    colours = [rng.choice(sorted(COLOURS)) for _ in range(n)]
    return [(c, shape_image(c, rng)) for c in colours]


def coloured_shapes_dataset(n: int, seed: int = 0) -> Any:
    """``n`` rows of ``prompt`` (a chat turn), ``image`` and ``colour`` (the answer), reproducible by ``seed``."""
    from datasets import Dataset, Features, Image, Value

    pairs = shape_rows(n, seed)
    rows = {"prompt": [[{"role": "user", "content": QUESTION}] for _ in pairs],
            "image": [image for _, image in pairs], "colour": [colour for colour, _ in pairs]}
    features = Features({"prompt": [{"role": Value("string"), "content": Value("string")}], "image": Image(),
                         "colour": Value("string")})
    return Dataset.from_dict(rows, features=features)


def swapped_colours(dataset: Any) -> Any:
    """``dataset`` with every ``colour`` answer swapped (red <-> blue): a policy that reads the picture scores low
    on it, one that ignores the picture scores as on the true answers."""
    other = {"red": "blue", "blue": "red"}
    return dataset.map(lambda row: {"colour": other[row["colour"]]})


def colour_code_reward(completions: list[Any], colour: list[str], **kwargs: Any) -> list[float]:
    """1 when a completion's first letter is its picture's colour code (see the module docstring), else 0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    scores = []
    for text, answer in zip(texts, colour):
        first = next((ch for ch in text.lower() if ch.isalpha()), "")
        scores.append(1.0 if first and first in CODES[answer] else 0.0)
    return scores
