"""Perplexity over a long text with a sliding window, through any KV policy.

Each window ``tokens[begin:end]`` is handed to the engine's
``teacher_forced_logprobs``: its first ``prefix_len`` tokens (the context already
scored by earlier windows) are prefilled, the rest are decoded one step at a time
through the policy, so the policy's decode path (what it keeps, fetches or
recomputes) is what gets measured. Windows follow the usual strided scheme: every
token from position 1 on is scored exactly once, with up to ``window - stride``
tokens of extra context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

__all__ = ["Window", "sliding_windows", "PerplexityResult", "perplexity", "text_tokens", "random_tokens"]


@dataclass(frozen=True)
class Window:
    begin: int
    end: int
    prefix_len: int  # tokens of [begin, end) prefilled; the rest are scored

    @property
    def scored(self) -> int:
        return self.end - self.begin - self.prefix_len


def sliding_windows(n_tokens: int, window: int, stride: int, decode_tokens: int | None = None) -> Iterator[Window]:
    """Windows covering ``n_tokens`` tokens.

    ``window``: tokens per engine call; ``stride``: step between window starts.
    ``decode_tokens``: when set, score only the last ``decode_tokens`` tokens of each
    window (the rest become context) -- fewer decode steps, longer contexts.
    """
    if n_tokens < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if window < 2 or stride < 1 or stride > window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window (got window={window}, stride={stride})")
    prev_end = 0
    begin = 0
    while True:
        end = min(begin + window, n_tokens)
        start_scoring = max(prev_end, begin + 1)
        if decode_tokens is not None:
            start_scoring = max(start_scoring, end - decode_tokens)
        if start_scoring < end:
            yield Window(begin, end, start_scoring - begin)
        prev_end = end
        if end >= n_tokens:
            return
        # overlap by at least one token: a window's first token has no context to be scored with
        begin = min(begin + stride, end - 1)


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    windows: int
    logprobs: np.ndarray

    def to_json(self) -> dict:
        return {"ppl": self.ppl, "nll": self.nll, "tokens": self.tokens, "windows": self.windows}


LogprobFn = Callable[[Sequence[int], int], np.ndarray]


def perplexity(tokens: Sequence[int], logprob_fn: LogprobFn, window: int, stride: int | None = None,
               decode_tokens: int | None = None,
               on_window: Callable[[Window, np.ndarray], None] | None = None) -> PerplexityResult:
    """Sliding-window perplexity of ``tokens``.

    ``logprob_fn(tokens, prefix_len)`` returns log p(tokens[t] | tokens[:t]) for
    t in [prefix_len, len(tokens)) -- the signature of
    ``kvoffload.engine.teacher_forced_logprobs`` with model and policy bound.
    """
    tokens = [int(t) for t in tokens]
    stride = window if stride is None else stride
    chunks, n_windows = [], 0
    for w in sliding_windows(len(tokens), window, stride, decode_tokens):
        lp = np.asarray(logprob_fn(tokens[w.begin:w.end], w.prefix_len), dtype=np.float64).reshape(-1)
        if lp.shape[0] != w.scored:
            raise RuntimeError(f"logprob function returned {lp.shape[0]} values for {w.scored} scored tokens")
        if on_window is not None:
            on_window(w, lp)
        chunks.append(lp)
        n_windows += 1
    lp = np.concatenate(chunks) if chunks else np.zeros(0)
    nll = float(-lp.mean()) if lp.size else float("nan")
    return PerplexityResult(math.exp(nll) if lp.size else float("nan"), nll, int(lp.size), n_windows, lp)


def text_tokens(tok, text: str, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of ``text`` (with the tokenizer's BOS, if it adds one)."""
    ids = list(tok.encode(text, add_special_tokens=True))
    if len(ids) < n_tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[:n_tokens]


def random_tokens(vocab_size: int, n_tokens: int, seed: int = 0) -> list[int]:
    """Uniformly random token ids: the baseline a working model must beat by far."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, size=n_tokens)]
