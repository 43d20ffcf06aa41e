"""The decode loop: validate, bucket, prefill through the policy, then decode token by token.

Shapes are bucketed (prompt length to a multiple of PROMPT_BUCKET, cache capacity to a multiple of
CAPACITY_BUCKET) so the number of compilations stays small while sequences grow.

The loop never waits for the device per token: sampling, the EOS bookkeeping and the check for
non-finite logits run in one jitted function whose results stay on the device (a [B, max_new_tokens]
token buffer, per-row done flags, the first step with non-finite logits). The host reads them only
every `sync_every` steps (to stop once every row is done) and once at the end.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.errors import GenerationInputError, KVOffloadError
from kvoffload.models.common import pytree_dataclass
from kvoffload.models.sampling import check_sampling, sample
from kvoffload.models.transformer import family, layer_prefill
from kvoffload.policies import available_policies, make_policy
from kvoffload.policies.base import Policy

PROMPT_BUCKET = 64
CAPACITY_BUCKET = 128
LONG = 1024  # past this length buckets are 4x coarser: fewer compilations for long-context eval
TOKEN_BUCKET = 64
SYNC_EVERY = 16  # decode steps between two reads of the device's done flags


class NonFiniteLogitsError(KVOffloadError, FloatingPointError):
    """The model produced NaN or inf logits; no token is chosen from them."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def bucket(n: int, step: int) -> int:
    return _round_up(n, step if n <= LONG else 4 * step)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_count(name: str, n, minimum: int = 0) -> int:
    """An integer argument (max_new_tokens, sync_every, ...) as a Python int, refused with one
    message when it is not an integer (2.5, True, "3") or is below `minimum`."""
    if not _is_int(n) or int(n) < minimum:
        raise GenerationInputError(f"{name} must be an integer >= {minimum}, got {n!r}")
    return int(n)


def check_token_ids(what: str, ids, vocab_size: int) -> None:
    """Refuses token ids that are not integers (1.7, True, "a") or lie outside the vocabulary."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise GenerationInputError(f"{what} must be a sequence of integer token ids, got {type(ids).__name__}")
    if isinstance(ids, (np.ndarray, jax.Array)):
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise GenerationInputError(f"{what} must be a 1-D array of integer token ids, got dtype {arr.dtype} "
                                       f"and shape {arr.shape}")
    else:
        wrong = [t for t in ids if not _is_int(t)]
        if wrong:
            raise GenerationInputError(f"{what} has token ids that are not integers: {wrong[:5]}")
        arr = np.asarray([int(t) for t in ids], np.int64)
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise GenerationInputError(
            f"{what} has token ids outside the vocabulary (size {vocab_size}): {bad[:5].tolist()}")


def check_lengths(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, extrapolate: bool = False):
    """Refuses, before any work, prompts that are empty, hold non-integer or out-of-vocabulary ids,
    or cannot fit the model's positions (unless the policy extrapolates: tokenselect's
    extrapolate=True keeps positions inside the window itself), and a max_new_tokens that is not an
    integer >= 0."""
    max_new_tokens = check_count("max_new_tokens", max_new_tokens)
    limit = float("inf") if extrapolate else model.config.max_position_embeddings
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise GenerationInputError("no prompts given (generate takes a list of token-id lists)")
    for i, p in enumerate(prompts):
        if _is_int(p):
            raise GenerationInputError("prompts must be a list of token-id lists, got a flat list of ints "
                                       "(wrap a single prompt: [ids])")
        check_token_ids(f"prompt {i}", p, model.config.vocab_size)
        if len(p) == 0:
            raise GenerationInputError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > limit:
            raise GenerationInputError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} positions but the model allows {limit}. Shorten the prompt or "
                "generate fewer tokens (kvoffload never truncates silently)."
            )


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0):
    """Right-pads to a bucketed length. Returns (tokens [B, T] int32, lengths [B] int32)."""
    longest = max(len(p) for p in prompts)
    t = bucket(longest, PROMPT_BUCKET)
    tokens = np.full((len(prompts), t), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = np.asarray(p, np.int32)
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def resolve_policy(policy: str | Policy, policy_options: dict | None) -> Policy:
    """A policy by name built with policy_options, or a built policy as it is. Options beside a built policy
    are refused (they would be ignored): unknown ones by name, known ones with where they go instead."""
    if isinstance(policy, Policy):
        if policy_options:
            from kvoffload.policies.base import check_options
            from kvoffload.policies.options import PolicyOptionError

            name = getattr(policy, "name", type(policy).__name__)
            if name in available_policies():
                check_options(name, policy_options)  # an unknown or bad option is named as for a policy by name
            first = next(iter(policy_options))
            raise PolicyOptionError(
                f"policy_options ({', '.join(policy_options)}) given with a built policy {name!r} would be ignored; "
                f"pass them to make_policy({name!r}, ...) or give the policy by name", first)
        return policy
    return make_policy(policy, **(policy_options or {}))


def extrapolates(policy: Policy) -> bool:
    """Whether the policy accepts prompts past the model's trained positions (tokenselect, extrapolate=True)."""
    return bool(getattr(policy, "extrapolates", False))


def eos_token_ids(model) -> list[int]:
    """The ids that end a sequence: the model config's plus the tokenizer's."""
    tok_ids = getattr(model.tokenizer, "eos_token_ids", ()) or ()
    return sorted(set(model.config.eos_token_ids) | set(int(i) for i in tok_ids))


# ---------------------------------------------------------------------------------------------
# Non-finite logits: a diagnosis after the fact


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(cfg, params, tokens, positions):
    return family(cfg).embed(cfg, params, tokens, positions)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer_output(cfg, lp, h, positions, lengths):
    return layer_prefill(cfg, lp, h, positions, lengths)[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _last_logits(cfg, params, h, lengths):
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return family(cfg).logits(cfg, params, last)


@jax.jit
def _finite_where(x, real):
    """Whether x [B, T, ...] is finite at every position where real [B, T] is True."""
    return jnp.all(jnp.isfinite(x) | ~real.reshape(real.shape + (1,) * (x.ndim - 2)))


def first_nonfinite_layer(model, prompt: Sequence[int]) -> str | None:
    """Reruns the prompt's prefill through the family's layer functions and names where the hidden
    state (at the prompt's real positions) first stops being finite: 'the embedding', 'layer i'
    (0-based) or 'the output head'; None when the whole prefill is finite."""
    cfg, params = model.config, model.params
    tokens, lengths = pad_prompts([prompt])
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    real = positions < lengths[:, None]
    h = _embed(cfg, params, tokens, positions)
    if not _finite_where(h, real):
        return "the embedding"
    for i, lp in enumerate(params.layers):
        h = _layer_output(cfg, lp, h, positions, lengths)
        if not _finite_where(h, real):
            return f"layer {i}"
    if not _finite_where(_last_logits(cfg, params, h, lengths)[:, None], real[:, :1]):
        return "the output head"
    return None


def nonfinite_weights(params) -> list[str]:
    """The floating-point tensors of a parameter pytree holding NaN or inf, as 'path (n of size
    values)', in pytree order."""
    leaves = [(jax.tree_util.keystr(path).lstrip("."), a)
              for path, a in jax.tree_util.tree_flatten_with_path(params)[0]
              if jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact)]
    counts = jax.device_get([jnp.sum(~jnp.isfinite(a)) for _, a in leaves])
    return [f"{name} ({int(n)} of {a.size} values)" for (name, a), n in zip(leaves, counts) if n]


def largest_weight(params) -> str:
    """'VALUE (path)': the floating-point weight of largest magnitude in a parameter pytree."""
    leaves = [(jax.tree_util.keystr(path).lstrip("."), a)
              for path, a in jax.tree_util.tree_flatten_with_path(params)[0]
              if jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact) and jnp.asarray(a).size]
    peaks = jax.device_get([jnp.max(jnp.abs(a)).astype(jnp.float32) for _, a in leaves])
    i = int(np.argmax(peaks))
    return f"{float(peaks[i]):.3g} ({leaves[i][0]})"


def nonfinite_error(model, prompt: Sequence[int], step: int, row: int) -> NonFiniteLogitsError:
    """The error for non-finite logits first seen at `step` (0 = the prefill) for batch row `row`,
    with a diagnosis: where the prompt's prefill goes non-finite and which weights are."""
    where = "step 0 (the prefill)" if step == 0 else f"decode step {step} (the prefill is step 0)"
    msg = f"non-finite logits (NaN or inf) at {where} for prompt {row}; no tokens are returned."
    try:
        layer = first_nonfinite_layer(model, prompt)
        msg += (f" The prompt's prefill first turns non-finite at {layer}." if layer is not None else
                " The prompt's prefill is finite in every layer: the values went non-finite while decoding"
                " (check the policy's settings and the dtype's range).")
        bad = nonfinite_weights(model.params)
        msg += (f" Non-finite weights: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}." if bad else
                f" Every weight is finite. The largest in magnitude is {largest_weight(model.params)} (weights "
                "that large can overflow the activations).")
    except Exception as e:  # the diagnosis must never hide the error itself
        msg += f" (The diagnosis failed: {type(e).__name__}: {e}.)"
    return NonFiniteLogitsError(msg)


# ---------------------------------------------------------------------------------------------
# The decode loop


@pytree_dataclass
class DecodeProgress:
    """What the loop keeps on the device between host reads."""

    key: Any  # PRNG key; each step splits it into (next key, the step's sampling key)
    tokens: Any  # [B, >= max_new_tokens] int32: the token chosen at each step (every row, even finished ones)
    done: Any  # [B] bool: the row has produced an end token
    step: Any  # int32: the next step's index
    nonfinite_step: Any  # int32: first step whose logits (for a row still generating) were not finite, or -1
    nonfinite_row: Any  # int32: the first such row at that step


def _start_progress(seed: int, batch: int, max_new_tokens: int, device) -> DecodeProgress:
    # committed to the logits' device, like a step's outputs, so the second step reuses the first's program
    if isinstance(device, jax.sharding.Sharding) and not device.is_fully_addressable:
        # a mesh spanning processes (jax.distributed): every process makes the same state in its shards
        return jax.jit(lambda: _progress(seed, batch, max_new_tokens), out_shardings=device)()
    return jax.device_put(_progress(seed, batch, max_new_tokens), device)


def _progress(seed, batch, max_new_tokens):
    return DecodeProgress(
        key=jax.random.key(seed), tokens=jnp.zeros((batch, max_new_tokens), jnp.int32),
        done=jnp.zeros(batch, bool), step=jnp.zeros((), jnp.int32),
        nonfinite_step=jnp.full((), -1, jnp.int32), nonfinite_row=jnp.full((), -1, jnp.int32))


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"), donate_argnames=("progress",))
def _choose_tokens(progress: DecodeProgress, logits, end_ids, temperature: float, top_k: int, top_p: float):
    """Samples the step's tokens [B] and records them. end_ids [E]: the ids that finish a row."""
    key, sub = jax.random.split(progress.key)
    chosen = sample(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p)
    bad_rows = ~jnp.all(jnp.isfinite(logits), axis=-1) & ~progress.done
    first_bad = (progress.nonfinite_step < 0) & jnp.any(bad_rows)
    return chosen, DecodeProgress(
        key=key,
        tokens=jax.lax.dynamic_update_slice(progress.tokens, chosen[:, None], (0, progress.step)),
        done=progress.done | jnp.any(chosen[:, None] == end_ids[None, :], axis=-1),
        step=progress.step + 1,
        nonfinite_step=jnp.where(first_bad, progress.step, progress.nonfinite_step),
        nonfinite_row=jnp.where(first_bad, jnp.argmax(bad_rows).astype(jnp.int32), progress.nonfinite_row),
    )


def _committed(model, arrays):
    """The prompt arrays committed to the parameters' device. A jitted function's outputs are
    committed when an input is, and JAX compiles a function again when an argument's committedness
    changes: with uncommitted prompts the prefill's outputs (logits, the cache) would be
    uncommitted and the first decode step would compile once more at the second step."""
    device = _device_of(jax.tree.leaves(model.params)[0]) or jax.devices()[0]
    return jax.device_put(arrays, device)


def _put(values, where):
    """Host values committed to a device or a sharding (one spanning processes too: device/sharding.put)."""
    from kvoffload.device.sharding import put

    return put(values, where)


def _device_of(x):
    """The one device an array lives on, or its sharding where it is replicated over several (a
    tensor-parallel mesh), or None (not a jax array, or split over several)."""
    if not isinstance(x, jax.Array):
        return None
    devices = x.devices()
    if len(devices) == 1:
        return next(iter(devices))
    return x.sharding if x.sharding.is_fully_replicated else None


@contextlib.contextmanager
def frozen_gc():
    """Python's garbage collector during a decode loop: every object alive before the loop is moved out of its
    sight (`gc.freeze`) and back after (`gc.unfreeze`), so a full collection inside the loop scans only what
    the loop made. A step allocates host objects for each layer, so every ~100-150 steps a full collection runs,
    and with ~190k objects alive it stalled one step for 117 ms on a 2-core CPU (2-6 ms frozen): a token late,
    a benchmark's step an outlier. Nothing leaks: garbage from before the loop is collected after it. Left alone
    where the caller froze objects already (unfreezing would undo theirs) or turned the collector off."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, policy: str | Policy = "full",
             policy_options: dict | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, stop_on_eos: bool = True, return_logits: bool = False, sync_every: int = SYNC_EVERY,
             on_token: Callable[[int, list[int], np.ndarray], Any] | None = None):
    """Generates up to max_new_tokens for each prompt (a batch). Returns the new tokens per prompt
    (and, with return_logits, the [steps, B, V] logits that chose them, as a numpy array). A row stops after
    its first end token (the model config's and the tokenizer's eos ids) unless stop_on_eos is False.

    The host reads the device every `sync_every` steps (to stop when every row is done; up to
    sync_every - 1 further steps may run, their tokens dropped) and once at the end.
    on_token(step, tokens, done_mask), when given, is called after each step (the loop then reads
    the device every step): tokens is the step's token per row (list of int), done_mask[i] is True
    when row i had finished at an earlier step, so tokens[i] is not part of its output.
    Raises NonFiniteLogitsError, naming the step and the first non-finite layer, instead of
    choosing a token from NaN or inf logits.
    """
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    sync_every = check_count("sync_every", sync_every, minimum=1)
    pol = resolve_policy(policy, policy_options)
    check_lengths(model, prompts, max_new_tokens, extrapolate=extrapolates(pol))
    max_new_tokens = int(max_new_tokens)
    b = len(prompts)
    if max_new_tokens == 0:
        out = [[] for _ in range(b)]
        return (out, np.zeros((0, b, model.config.vocab_size), np.float32)) if return_logits else out
    tokens, _ = _committed(model, pad_prompts(prompts))
    # the lengths go in as host numbers: the pool allocates blocks from them without reading the device
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    capacity = bucket(max(len(p) for p in prompts) + max_new_tokens, CAPACITY_BUCKET)
    logits, state = pol.prefill(model, tokens, lengths, capacity)
    device = _device_of(logits)
    end_ids = eos_token_ids(model) if stop_on_eos else []
    # a row stops at an end id; -1 (never sampled) keeps the array non-empty without stop_on_eos
    end_ids_dev = _put(np.asarray(end_ids or [-1], np.int32), device)
    # the token buffer's width is bucketed too, so calls with nearby max_new_tokens share a program
    progress = _start_progress(seed, b, bucket(max_new_tokens, TOKEN_BUCKET), device)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    step_logits = []
    done_before = np.zeros(b, bool)  # on_token only: the done flags read at the previous step
    nonfinite = None  # (step, row) of the first non-finite logits, once the host has read it

    def read(*extra):
        """One device read of the done flags (and `extra` arrays); records non-finite logits."""
        nonlocal nonfinite
        done, bad_step, bad_row, *rest = jax.device_get(
            (progress.done, progress.nonfinite_step, progress.nonfinite_row, *extra))
        if bad_step >= 0:
            nonfinite = (int(bad_step), int(bad_row))
        return done, *rest

    steps = 0
    with frozen_gc():  # no full collection over every object alive (a stalled step)
        for step in range(max_new_tokens):
            chosen, progress = _choose_tokens(progress, logits, end_ids_dev, **sampling)
            if return_logits:
                step_logits.append(logits)
            steps = step + 1
            last = step == max_new_tokens - 1
            if on_token is not None:
                done, chosen_np = read(chosen)
                if nonfinite:
                    break
                on_token(step, chosen_np.tolist(), done_before.copy())
                done_before = done
                if done.all():
                    break
            elif not last and steps % sync_every == 0:
                done, = read()
                if nonfinite or done.all():
                    break
            if last:
                break
            logits, state = pol.decode_step(model, state, chosen)
    _, chosen_all = read(progress.tokens)
    if nonfinite:
        del logits, state, step_logits  # free the cache: the diagnosis reruns the prompt
        raise nonfinite_error(model, prompts[nonfinite[1]], *nonfinite)
    out = [_until_end(row, set(end_ids)) for row in chosen_all[:, :steps]]
    if not return_logits:
        return out
    # the loop stops at the step where the last row finishes: the logits of later steps are dropped
    all_ended = bool(end_ids) and all(o[-1] in end_ids for o in out)
    kept = max(len(o) for o in out) if all_ended else steps
    return out, np.asarray(jnp.stack(step_logits[:kept]))


def _until_end(row: np.ndarray, end_ids: set[int]) -> list[int]:
    """A row's tokens up to and including its first end token."""
    tokens = row.tolist()
    for j, t in enumerate(tokens):
        if t in end_ids:
            return tokens[: j + 1]
    return tokens


class TextStreamer:
    """An `on_token` callback that prints one row's text as it is decoded, as transformers'
    TextStreamer does: it decodes the row's growing token sequence and emits the new suffix,
    holding text back while it ends in an incomplete character (U+FFFD) until a later token
    completes it. It stops at the row's first end token (not shown) or when the row is done.
    Call finish() after generate to emit what was held back."""

    def __init__(self, tokenizer, emit: Callable[[str], Any], end_ids: Sequence[int] = (), row: int = 0):
        self.tokenizer, self.emit, self.row = tokenizer, emit, row
        self.end_ids = set(end_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.ids: list[int] = []
        self.shown = ""
        self.ended = False

    def __call__(self, step: int, tokens: list[int], done_mask) -> None:
        if self.ended or done_mask[self.row]:
            return
        if tokens[self.row] in self.end_ids:
            self.ended = True
            return
        self.ids.append(tokens[self.row])
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._show(text)

    def finish(self) -> None:
        self._show(self.tokenizer.decode(self.ids))

    def _show(self, text: str) -> None:
        if len(text) > len(self.shown):
            self.emit(text[len(self.shown):])
            self.shown = text


@jax.jit
def _score_step(logits, targets, i):
    """log p(targets[i]) under logits [1, V], whether the logits are finite, and targets[i] as the
    next decode input [1]."""
    token = jax.lax.dynamic_slice(targets, (i,), (1,))
    logprob = jax.nn.log_softmax(logits[0].astype(jnp.float32))[token[0]]
    return logprob, jnp.all(jnp.isfinite(logits)), token


def teacher_forced_logprobs(model, tokens: Sequence[int], prefix_len: int, policy: str | Policy = "full",
                            policy_options: dict | None = None) -> np.ndarray:
    """log p(tokens[t] | tokens[:t]) for t in [prefix_len, len(tokens)): the prefix is prefilled and
    the rest decoded step by step through the policy (so the policy's approximations count).
    The scores stay on the device until one read at the end."""
    check_token_ids("tokens", tokens, model.config.vocab_size)
    prefix_len = check_count("prefix_len", prefix_len, minimum=1)
    if not prefix_len < len(tokens):
        raise GenerationInputError(f"prefix_len must be in [1, {len(tokens)}), got {prefix_len}")
    pol = resolve_policy(policy, policy_options)
    check_lengths(model, [tokens[:prefix_len]], len(tokens) - prefix_len, extrapolate=extrapolates(pol))
    toks, _ = _committed(model, pad_prompts([tokens[:prefix_len]]))
    lengths = np.asarray([prefix_len], np.int32)  # host numbers (see generate)
    logits, state = pol.prefill(model, toks, lengths, bucket(len(tokens), CAPACITY_BUCKET))
    targets = jax.device_put(jnp.asarray(np.asarray(tokens[prefix_len:], np.int32)), _device_of(logits))
    logprobs, finite = [], []
    with frozen_gc():
        for i in range(len(targets)):
            logprob, ok, token = _score_step(logits, targets, i)
            logprobs.append(logprob)
            finite.append(ok)
            if i + 1 < len(targets):
                logits, state = pol.decode_step(model, state, token)
    del logits, state
    logprobs, finite = jax.device_get((jnp.stack(logprobs), jnp.stack(finite)))
    if not finite.all():
        raise nonfinite_error(model, tokens[:prefix_len], int(np.argmin(finite)), 0)
    return np.asarray(logprobs)
