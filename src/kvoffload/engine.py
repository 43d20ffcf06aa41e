"""The decode loop: validate, bucket, prefill through the policy, then decode token by token.

Shapes are bucketed (prompt length to a multiple of PROMPT_BUCKET, cache capacity to a multiple of
CAPACITY_BUCKET) so the number of compilations stays small while sequences grow.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.models.sampling import sample
from kvoffload.policies import make_policy
from kvoffload.policies.base import Policy

PROMPT_BUCKET = 64
CAPACITY_BUCKET = 128
LONG = 1024  # past this length buckets are 4x coarser: fewer compilations for long-context eval


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def bucket(n: int, step: int) -> int:
    return _round_up(n, step if n <= LONG else 4 * step)


def check_lengths(model, prompts: Sequence[Sequence[int]], max_new_tokens: int):
    """Refuses, before any work, prompts that are empty or that cannot fit the model's positions."""
    limit = model.config.max_position_embeddings
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} positions but the model allows {limit}. Shorten the prompt or "
                "generate fewer tokens (kvoffload never truncates silently)."
            )
        bad = [t for t in p if not 0 <= int(t) < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary (size {model.config.vocab_size}): {bad[:5]}")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0):
    """Right-pads to a bucketed length. Returns (tokens [B, T] int32, lengths [B] int32)."""
    longest = max(len(p) for p in prompts)
    t = bucket(longest, PROMPT_BUCKET)
    tokens = np.full((len(prompts), t), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = np.asarray(p, np.int32)
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def resolve_policy(policy: str | Policy, policy_options: dict | None) -> Policy:
    if isinstance(policy, Policy):
        return policy
    return make_policy(policy, **(policy_options or {}))


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, policy: str | Policy = "full",
             policy_options: dict | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, stop_on_eos: bool = True, return_logits: bool = False):
    """Generates up to max_new_tokens for each prompt (a batch). Returns the new tokens per prompt
    (and, with return_logits, the [steps, B, V] logits that chose them)."""
    check_lengths(model, prompts, max_new_tokens)
    pol = resolve_policy(policy, policy_options)
    tokens, lengths = pad_prompts(prompts)
    capacity = bucket(max(len(p) for p in prompts) + max_new_tokens, CAPACITY_BUCKET)
    logits, state = pol.prefill(model, tokens, lengths, capacity)
    eos = set(model.config.eos_token_ids) | set(getattr(model.tokenizer, "eos_token_ids", ()) or ())
    key = jax.random.key(seed)
    b = len(prompts)
    out: list[list[int]] = [[] for _ in range(b)]
    done = np.zeros(b, bool)
    all_logits = []
    for step in range(max_new_tokens):
        key, sub = jax.random.split(key)
        nxt = sample(logits, sub, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        if return_logits:
            all_logits.append(np.asarray(logits))
        nxt_np = np.asarray(nxt)
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt_np[i]))
                if stop_on_eos and int(nxt_np[i]) in eos:
                    done[i] = True
        if done.all() or step == max_new_tokens - 1:
            break
        logits, state = pol.decode_step(model, state, nxt)
    if return_logits:
        return out, np.stack(all_logits)
    return out


def teacher_forced_logprobs(model, tokens: Sequence[int], prefix_len: int, policy: str | Policy = "full",
                            policy_options: dict | None = None) -> np.ndarray:
    """log p(tokens[t] | tokens[:t]) for t in [prefix_len, len(tokens)): the prefix is prefilled and
    the rest decoded step by step through the policy (so the policy's approximations count)."""
    if not 1 <= prefix_len < len(tokens):
        raise ValueError(f"prefix_len must be in [1, {len(tokens)}), got {prefix_len}")
    check_lengths(model, [tokens[:prefix_len]], len(tokens) - prefix_len)
    pol = resolve_policy(policy, policy_options)
    toks, lengths = pad_prompts([tokens[:prefix_len]])
    logits, state = pol.prefill(model, toks, lengths, bucket(len(tokens), CAPACITY_BUCKET))
    out = []
    for t in range(prefix_len, len(tokens)):
        lp = jax.nn.log_softmax(logits[0].astype(jnp.float32))
        out.append(float(lp[tokens[t]]))
        if t + 1 < len(tokens):
            logits, state = pol.decode_step(model, state, jnp.asarray([tokens[t]], jnp.int32))
    return np.asarray(out)
