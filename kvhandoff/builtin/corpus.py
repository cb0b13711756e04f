"""The synthetic two-stage corpus the built-in model is trained on.

Each line looks like a generative-recommendation request and its answer::

    history: kettle tent ... coat mug
    <think> recent kitchen mug before fashion first kitchen so</think>
    <|sid_begin|><a0><b0><c2><|sid_end|></s>

- the *history* is a user's items, each item a word of one of eight categories;
- the *thinking span* names the category and the item of the last history item, the
  category of the one before it and of the first one, with a few filler words; it ends
  with ``</think>`` (or, in :data:`EOS_SHARE` of the lines, with EOS: a user who left);
- the *semantic id* is three tokens, a deterministic function of the history
  (:func:`semantic_id`): ``<a{category of the last item}>``, ``<b{category of the first
  item}>``, ``<c{category of the second-to-last item}>``.

A model that gets the semantic id right reads its context: the same thinking prefix with
another history gives another id. The corpus and the rule are the only definition of
"right" (the demo's accuracy figure uses :func:`semantic_id`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CATEGORIES: dict[str, tuple[str, ...]] = {
    "kitchen": ("kettle", "pan", "knife", "spoon", "mug", "plate", "bowl", "oven"),
    "outdoor": ("tent", "boots", "stove", "map", "rope", "torch", "compass", "kayak"),
    "fashion": ("shirt", "coat", "scarf", "dress", "jeans", "hat", "belt", "jacket"),
    "tech": ("phone", "laptop", "camera", "tablet", "router", "speaker", "monitor", "mouse"),
    "books": ("novel", "atlas", "poetry", "comic", "diary", "essay", "guide", "memoir"),
    "home": ("lamp", "chair", "table", "sofa", "rug", "shelf", "pillow", "curtain"),
    "sport": ("ball", "racket", "bike", "helmet", "gloves", "skates", "bat", "net"),
    "food": ("coffee", "tea", "snack", "fruit", "bread", "cheese", "honey", "pasta"),
}
CATEGORY_NAMES = tuple(CATEGORIES)
ITEMS = tuple(item for items in CATEGORIES.values() for item in items)
ITEM_CATEGORY = {item: c for c, items in enumerate(CATEGORIES.values()) for item in items}
FILLERS = ("maybe", "likely", "because", "price", "season", "budget", "quality", "style",
           "often", "recently", "similar", "popular", "then", "also", "and")

#: Semantic-id tokens: three codebooks of eight, each one token of the tokenizer.
SID_TOKENS = tuple(f"<{book}{i}>" for book in "abc" for i in range(8))

HISTORY_PREFIX = "history:"
EOS_SHARE = 0.05


@dataclass(frozen=True)
class Example:
    history: tuple[str, ...]
    thinking: str  # the words between <think> and its end
    ends_by_eos: bool

    @property
    def prompt(self) -> str:
        """What a client sends for stage 1 (the model continues with its thinking)."""
        return f"{HISTORY_PREFIX} {' '.join(self.history)}\n<think>"


def semantic_id(history: tuple[str, ...] | list[str]) -> list[str]:
    """The rule: the three semantic-id tokens a history maps to."""
    last, before, first = history[-1], history[-2], history[0]
    return [f"<a{ITEM_CATEGORY[last]}>", f"<b{ITEM_CATEGORY[first]}>",
            f"<c{ITEM_CATEGORY[before]}>"]


#: The built-in shop: the semantic ids of the items it sells, a fixed share of all 512.
SHOP_SEED = 20261127
SHOP_SHARE = 0.375


def shop_items() -> list[list[str]]:
    """The semantic ids of the items the built-in shop sells (``--catalog shop=builtin``):
    192 of the 512 ids the rule can give, so the model's best id is not always one."""
    every = [[f"<a{a}>", f"<b{b}>", f"<c{c}>"] for a in range(8) for b in range(8)
             for c in range(8)]
    return sorted(random.Random(SHOP_SEED).sample(every, int(len(every) * SHOP_SHARE)))


def thinking_for(history: tuple[str, ...], rng: random.Random) -> str:
    last, before, first = history[-1], history[-2], history[0]
    words = ["recent", CATEGORY_NAMES[ITEM_CATEGORY[last]], last,
             "before", CATEGORY_NAMES[ITEM_CATEGORY[before]],
             "first", CATEGORY_NAMES[ITEM_CATEGORY[first]]]
    words += [rng.choice(FILLERS) for _ in range(rng.randint(0, 4))]
    return " ".join([*words, "so"])


def make_example(rng: random.Random, min_items: int = 2, max_items: int = 48) -> Example:
    # Users have a few favourite categories: histories are not uniform noise.
    favourites = rng.sample(range(len(CATEGORY_NAMES)), rng.randint(1, 3))
    n = rng.randint(min_items, max_items)
    history = []
    for _ in range(n):
        cat = rng.choice(favourites) if rng.random() < 0.7 else rng.randrange(len(CATEGORY_NAMES))
        history.append(rng.choice(CATEGORIES[CATEGORY_NAMES[cat]]))
    history_t = tuple(history)
    return Example(history_t, thinking_for(history_t, rng), rng.random() < EOS_SHARE)


def tokenizer_lines(seed: int, num_lines: int = 4000) -> list[str]:
    """Text the tokenizer is trained on: corpus lines (special tokens left out)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        ex = make_example(rng)
        lines.append(f"{HISTORY_PREFIX} {' '.join(ex.history)} {ex.thinking}\n")
    return lines
