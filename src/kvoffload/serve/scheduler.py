"""Continuous batching: requests join the running batch between decode steps and leave when done.

One thread steps the scheduler (`step`); any thread may `submit` and `cancel`. A step admits waiting
requests in arrival order while a batch slot and enough blocks are free (a request reserves the blocks of
its whole budget, prompt + max_tokens, at admission, so a running request never runs out), prefills each
newcomer's uncached prompt, then decodes one token for every running request. A request leaves on an end
token, a stop token or string, max_tokens, or cancellation; its slot and its references to blocks are
released at once. A request that could never fit (past the context, or more blocks than the cache holds)
is refused at submit with a ServeError naming the limit; one that does not fit now waits.

Only the `full` policy (K/V in device memory) runs here: the other policies keep a batch's state in
layouts fixed at prefill for the whole batch (see POLICY_REFUSALS), so rows cannot join or leave.
"""

from __future__ import annotations

import itertools
from collections import Counter
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvoffload.engine import eos_token_ids
from kvoffload.errors import ServeError
from kvoffload.serve import cache as dev
from kvoffload.serve.blocks import SCRATCH, BlockAllocator, block_keys, root_key
from kvoffload.serve.sampling import SamplingParams, sample_rows

# why each other policy cannot run under continuous batching (the scheduler refuses it with this)
_LOCKSTEP = ("lays a batch's K/V out at prefill as position-major extents shared by every row and flushes "
             "every row's tail in lockstep, so a row cannot join or leave a running batch")
POLICY_REFUSALS = {
    "offload": _LOCKSTEP, "kvpr": _LOCKSTEP + " (its split point and stored activations are per batch too)",
    "hybrid": _LOCKSTEP + " (its block classes and mini-batches are planned for the whole batch at prefill)",
    "clo": "keeps per-head GPU caches, row buffers and thresholds sized for the whole batch at prefill",
    "tokenselect": "keeps its selection cache and token spaces sized for the whole batch at prefill",
}
SERVE_OPTIONS = ("block_tokens",)  # the policy options the serving cache takes


def check_policy(policy: str, options: dict | None) -> dict:
    """The policy options the scheduler uses, or a ServeError naming why the policy or an option is refused."""
    if policy != "full":
        why = POLICY_REFUSALS.get(policy, "is not a policy the serving scheduler knows")
        raise ServeError(f"policy {policy!r} cannot run under the serving scheduler: it {why}. "
                         "Serve with --policy full (K/V in device memory, paged per request).")
    options = dict(options or {})
    bad = [k for k in options if k not in SERVE_OPTIONS]
    if bad:
        raise ServeError(f"policy option(s) {', '.join(bad)} do not apply to the serving cache; it takes "
                         f"{', '.join(SERVE_OPTIONS)} (the batch size and cache size are serve's own flags)")
    if "block_tokens" in options:
        b = options["block_tokens"]
        b = int(b) if isinstance(b, str) and b.isdigit() else b
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b > 64 or b & (b - 1):
            raise ServeError(f"block_tokens must be a power of two in [1, 64], got {options['block_tokens']!r}")
        options["block_tokens"] = b
    return options


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    # called on the stepping thread: (request, new text, finished); the text is safe to show (no partial
    # character, nothing a stop string could still claim)
    on_update: Callable[["Request", str, bool], None] | None = None
    id: int = field(default_factory=itertools.count().__next__)
    output: list[int] = field(default_factory=list)
    text: str = ""  # the text shown so far
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    cancelled: bool = False
    # scheduler-private
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are stored

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def metrics(self) -> dict:
        """Time to first token, decode rate and prefix-cache hits."""
        out = {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.output),
               "cached_tokens": self.cached_tokens}
        if self.first_token_time is not None:
            out["time_to_first_token_s"] = self.first_token_time - self.arrival
        if self.finish_time is not None and self.first_token_time is not None and len(self.output) > 1:
            out["tokens_per_s"] = (len(self.output) - 1) / max(self.finish_time - self.first_token_time, 1e-9)
        return out


class Scheduler:
    """Continuous batching over the serving cache. max_batch: requests decoded together; num_blocks: blocks
    of block_tokens tokens in the cache; prefix_cache_blocks: unreferenced blocks kept for prefix reuse (0:
    off; default: all); max_seq_len: the most tokens (prompt + output) one request may hold."""

    def __init__(self, model, policy: str = "full", policy_options: dict | None = None, *, max_batch: int = 8,
                 num_blocks: int = 256, prefix_cache_blocks: int | None = None, max_seq_len: int | None = None):
        options = check_policy(policy, policy_options)
        self.model, self.policy = model, policy
        self.blk = options.get("block_tokens", 16)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ServeError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ServeError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        positions = model.config.max_position_embeddings
        self.max_seq_len = min(int(max_seq_len or positions), positions)
        self.slots = max_batch
        self.width = -(-self.max_seq_len // self.blk)  # table entries per request
        self.alloc = BlockAllocator(num_blocks, num_blocks if prefix_cache_blocks is None else prefix_cache_blocks)
        self.cache = dev.make_cache(model, num_blocks, max_batch, self.blk)
        self.first_pos = np.zeros(num_blocks + 1, np.int32)  # each block's first position (sliding windows)
        self.root = root_key(model.source or id(model.params), str(dev.kv_dtype(model)), "device", self.blk)
        self.end_ids = set(eos_token_ids(model))
        self.running: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self._inbox: deque[Request] = deque()
        self._lock = threading.Lock()
        self.wake = threading.Event()  # set when work arrives (the stepping thread sleeps on it)
        self.steps = 0
        self.finished: Counter = Counter()  # requests ended, by finish reason

    # -- any thread ----------------------------------------------------------------------------------

    def submit(self, req: Request) -> Request:
        """Queues a request, or raises ServeError when it can never run (the message names the limit)."""
        vocab = self.model.config.vocab_size
        req.params = req.params.checked(vocab)
        n = len(req.prompt)
        if n == 0:
            raise ServeError("the prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in req.prompt):
            raise ServeError(f"the prompt holds token ids outside the vocabulary (size {vocab})")
        need = n + req.params.max_tokens
        if need > self.max_seq_len:
            raise ServeError(f"the prompt has {n} tokens; with max_tokens={req.params.max_tokens} it needs {need} "
                             f"positions but the context length is {self.max_seq_len}", limit="context_length")
        blocks = self.blocks_needed(req)
        if blocks > self.alloc.num_blocks:
            raise ServeError(f"the request needs {blocks} cache blocks of {self.blk} tokens ({need} tokens) but the "
                             f"KV cache holds {self.alloc.num_blocks}; raise the cache size or lower max_tokens",
                             limit="kv_cache_blocks", status=413)
        with self._lock:
            self._inbox.append(req)
        self.wake.set()
        return req

    def cancel(self, req: Request) -> None:
        """Ends the request at the next step and frees what it holds (a client that went away)."""
        req.cancelled = True
        self.wake.set()

    def blocks_needed(self, req: Request) -> int:
        # K/V are stored for every token but the last one sampled; a tail's tokens need no block until full
        return (len(req.prompt) + req.params.max_tokens - 1) // self.blk

    # -- the stepping thread -------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or any(self.running))

    def step(self) -> None:
        """Admits what fits, prefills the newcomers, decodes one token for every running request."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            self._finish(r, "cancelled")
        for r in self.running:
            if r is not None and r.cancelled:
                self._finish(r, "cancelled")
        while self.waiting and self._admit(self.waiting[0]):
            self.waiting.popleft()
        active = [r for r in self.running if r is not None and not r.done]
        if not active:
            return
        tokens = np.zeros(self.slots, np.int32)
        lengths = np.zeros(self.slots, np.int32)
        # the table as wide as the longest row's full blocks, in powers of two: the attention reads (and on the
        # CPU gathers) every column, and a handful of widths compile (at least 16 columns: short rows share one)
        used = max(r.length // self.blk for r in active) + 1
        tables = np.zeros((self.slots, min(self.width, max(16, 1 << (used - 1).bit_length()))), np.int32)
        flush_to = np.zeros(self.slots, np.int32)
        for r in active:
            tokens[r.slot], lengths[r.slot] = r.output[-1], r.length
            n = min(len(r.blocks), tables.shape[1])
            tables[r.slot, :n] = r.blocks[:n]
            j = r.length // self.blk
            flush_to[r.slot] = r.blocks[j] if (r.length + 1) % self.blk == 0 else SCRATCH
        logits, self.cache = dev.decode(self.model, self.cache, tokens, lengths, tables, flush_to, self.first_pos)
        self.steps += 1
        for r in active:
            r.length += 1
        self._sample(logits, active)

    def fail_all(self, reason: str = "error") -> None:
        """Ends every queued and running request and starts from an empty cache: after a failed step (its
        donated buffers may be gone) neither the requests nor the cached prefixes can trust the cache."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        for r in list(self.waiting) + [r for r in self.running if r is not None]:
            if not r.done:
                self._finish(r, reason)
        self.waiting.clear()
        self.alloc = BlockAllocator(self.alloc.num_blocks, self.alloc.cache_blocks)
        self.cache = dev.make_cache(self.model, self.alloc.num_blocks, self.slots, self.blk)

    def run_until_done(self, max_steps: int = 1_000_000) -> None:
        """Steps until nothing is queued or running (offline use, tests)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError("the scheduler did not finish within max_steps")

    def _admit(self, r: Request) -> bool:
        slot = next((i for i, x in enumerate(self.running) if x is None), None)
        if slot is None:
            return False
        keys = block_keys(self.root, r.prompt, self.blk)
        # at least the last prompt token is computed: its logits choose the first output token
        prefix = self.alloc.lookup(keys[:(len(r.prompt) - 1) // self.blk])
        self.alloc.acquire(prefix)
        fresh = self.alloc.allocate(self.blocks_needed(r) - len(prefix))
        if fresh is None:
            self.alloc.release(prefix)
            return False
        r.slot, r.blocks, r.cached_tokens = slot, prefix + fresh, len(prefix) * self.blk
        self.running[slot] = r
        for j, b in enumerate(r.blocks):
            self.first_pos[b] = j * self.blk
        n_full = len(r.prompt) // self.blk
        logits, self.cache = dev.prefill_with_prefix(self.model, self.cache, r.prompt, prefix,
                                                     r.blocks[len(prefix):n_full], slot, self.blk)
        for j in range(len(prefix), n_full):  # dispatched before any later reader: safe to share now
            self.alloc.register(r.blocks[j], keys[j])
        r.length = len(r.prompt)
        self._sample(logits, [r], rows=[0])
        return True

    def _sample(self, logits, reqs: list[Request], rows: list[int] | None = None) -> None:
        rows = [r.slot for r in reqs] if rows is None else rows
        n = logits.shape[0]
        temp, top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
        top_k, seed, index = np.zeros(n, np.int32), np.zeros(n, np.uint32), np.zeros(n, np.int32)
        for r, i in zip(reqs, rows):
            p = r.params
            temp[i], top_p[i], top_k[i], seed[i], index[i] = p.temperature, p.top_p, p.top_k, p.seed, len(r.output)
        chosen = np.asarray(sample_rows(logits, temp, top_k, top_p, seed, index))  # the step's one host read
        now = time.perf_counter()
        for r, i in zip(reqs, rows):
            r.first_token_time = r.first_token_time or now
            self._append(r, int(chosen[i]))

    def _append(self, r: Request, token: int) -> None:
        p = r.params
        r.output.append(token)
        if (token in self.end_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return self._finish(r, "stop", shown=r.output[:-1])
        text = self.model.tokenizer.decode(r.output) if self.model.tokenizer is not None else ""
        for s in p.stop:
            at = text.find(s, max(0, len(r.text) - len(s) + 1))
            if at >= 0:
                return self._finish(r, "stop", text=text[:at])
        if len(r.output) >= p.max_tokens:
            return self._finish(r, "length", text=text)
        # hold back an incomplete character and what a stop string could still complete
        hold = max((len(s) - 1 for s in p.stop), default=0)
        safe = text[:len(text) - hold] if hold else text
        if safe.endswith("\ufffd"):
            safe = safe.rstrip("\ufffd")
        if len(safe) > len(r.text) and safe.startswith(r.text):
            delta, r.text = safe[len(r.text):], safe
            if r.on_update:
                r.on_update(r, delta, False)

    def _finish(self, r: Request, reason: str, text: str | None = None, shown: list[int] | None = None) -> None:
        if text is None and shown is not None and self.model.tokenizer is not None:
            text = self.model.tokenizer.decode(shown)
        text = r.text if text is None else text
        delta = text[len(r.text):] if text.startswith(r.text) else ""
        r.text, r.finish_reason, r.finish_time = r.text + delta, reason, time.perf_counter()
        self.finished[reason] += 1
        if r.slot >= 0:
            self.running[r.slot] = None
            self.alloc.release(r.blocks)
            r.slot, r.blocks = -1, []
        if r.on_update:
            r.on_update(r, delta, True)
