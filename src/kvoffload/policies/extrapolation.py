"""TokenSelect length extrapolation: `tokenselect` with ``extrapolate=True`` takes
prompts longer than the model's trained positions (``max_position_embeddings``) and keeps every
position fed to RoPE below ``token_budget`` (<= the trained window).

The scheme, as in pzs19/TokenSelect ``patcher/token_retrieval.py`` (released config: n_init 128,
n_local 512, top_k 2048, prefill chunks of 512):

* Keys are stored WITHOUT RoPE (their ``patch_model`` replaces vLLM's ``get_rope`` by None and the
  attention forward skips the rotary step; RoPE is applied inside FlashInfer with
  ``pos_encoding_mode="ROPE_LLAMA"``). Here: q/k/v are projected at position 0 (the identity rotation).
* Attention runs over the selected tokens only, and positions are the ranks in the selection: the
  attended set (sinks, top-k by soft vote, local window), in original order, gets positions 0..n-1 and
  the query the last one (FlashInfer's ROPE_LLAMA numbers the KV entries it is given 0..n-1, the queries
  at the end: ``patched_radix_attention_decode_forward_flashinfer`` passes only ``retrieved_indices``).
  So the local window keeps its relative positions, the selected context is compressed next to it.
* Selection (``TokenRetriever.retrieval_indices``): the query is rotated at position n_local
  (QUERY_ROTATE; a chunk's queries at n_local + i, then averaged) and scored against the unrotated keys
  with the soft vote (per-head softmax summed: ``get_topk_tokens``). Here per KV head (the GQA group's
  heads), as the rest of `tokenselect`; theirs sums over all heads (one selection per layer).
* Prefill (``patched_radix_attention_extend_forward_flashinfer``): chunks of ``prefill_chunk`` tokens;
  each chunk's K/V are stored, then the chunk attends (causally) to the tokens selected from its past
  by the chunk's averaged query (sinks, top-k, the newest past tokens) plus itself, at rank positions.
  Their local window (n_local = the chunk size) holds exactly the chunk; here the chunk is attended in
  full and ``num_recent`` newest past tokens are forced in too (a superset: the same when num_recent=0).
* Inside the window nothing changes: when the whole context fits the budget every token is selected,
  ranks equal the original positions, and the result is ordinary attention (their
  ``n_init + topk + n_local >= current_num_tokens`` branch attends every token).
* Their released ``patch()`` sets QUERY_CACHE = False: no selection cache in this mode.

Kept on the device as one dense cache of un-rotated keys and values per layer (placement kv=gpu only).
RoPE (LLaMA family) only: OPT's learned absolute positions have no rank re-numbering to apply, so OPT
is refused. The state records the largest position ever fed to RoPE (``max_position``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.errors import KVOffloadError
from kvoffload.models.common import apply_rope, pytree_dataclass, rope_cos_sin
from kvoffload.models.transformer import family
from kvoffload.runtime.layer import put_rows
from kvoffload.policies.selection.choose import choose_tokens


class ExtrapolationError(KVOffloadError, ValueError):
    """Length extrapolation asked for where the scheme cannot apply."""


@dataclasses.dataclass(frozen=True)
class Extrapolation:
    """The options of the mode (hashable: a static argument of the jitted steps)."""

    token_budget: int  # tokens attended per query and KV head, sinks and local window included
    num_sink: int
    num_recent: int  # >= 1: the newest token (the query's own) is always attended
    prefill_chunk: int

    def check(self, cfg) -> None:
        if cfg.has_sliding_layers:  # the runner attends a selection renumbered 0..n-1: no window of positions
            raise ExtrapolationError(
                "tokenselect extrapolate=True cannot run a model with sliding-window layers: its dense runner "
                "renumbers the attended tokens' positions, so no layer can keep a window of positions; run "
                "tokenselect with extrapolate=False (sliding layers then attend their window as `full` does)")
        if cfg.family != "llama":
            raise ExtrapolationError(
                f"length extrapolation (extrapolate=True) needs RoPE positions (LLaMA family); "
                f"{cfg.family!r} models use learned absolute positions, which cannot be renumbered")
        if self.token_budget > cfg.max_position_embeddings:
            raise ExtrapolationError(
                f"with extrapolate=True token_budget ({self.token_budget}) must be <= the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings}): the positions attended are 0..budget-1")


@pytree_dataclass
class ExtrapolationState:
    k: tuple  # per layer [B, n_kv, S, d]: keys without RoPE
    v: tuple  # per layer [B, n_kv, S, d]
    lengths: Any  # [B] int32: tokens held per request
    max_position: Any  # [] int32: the largest position fed to RoPE so far (prefill and decode)


def rotate(cfg, x, positions):
    """RoPE of x [B, n, T, d] at positions [B, T]."""
    cos, sin = rope_cos_sin(cfg, positions)
    return apply_rope(x, cos, sin)


def unrotated_qkv(cfg, lp, x):
    """q [B, H, T, d], k, v [B, n_kv, T, d] without RoPE (position 0 is the identity rotation)."""
    return family(cfg).qkv(cfg, lp, x, jnp.zeros(x.shape[:2], jnp.int32))


def select_and_gather(cfg, conf: Extrapolation, q_vote, kc, vc, context, n_select):
    """Selection over the first `context` [B] cached tokens by the soft vote of q_vote [B, H, d]
    (already rotated), sinks and the newest num_recent forced in; returns (k rotated at its ranks
    0..n-1, v, num_valid [B, n_kv]) with n_select (static) slots."""

    B, S = kc.shape[0], kc.shape[2]
    scores = ops.tokenselect_scores(q_vote, kc, context)
    want = jnp.full((B,), n_select, jnp.int32)
    idx, nv = choose_tokens(scores, jnp.arange(S, dtype=jnp.int32), None, context, want, n_select,
                            conf.num_sink, conf.num_recent, 1)
    k_sel = jnp.take_along_axis(kc, idx[..., None], axis=2)
    v_sel = jnp.take_along_axis(vc, idx[..., None], axis=2)
    ranks = jnp.broadcast_to(jnp.arange(idx.shape[-1], dtype=jnp.int32), (B, idx.shape[-1]))
    return rotate(cfg, k_sel, ranks), v_sel, nv


def _store_layer(cfg, lp, h, kc, vc, at):
    """One layer's un-rotated q [B, H, T, d], k, v [B, n_kv, T, d] of h [B, T, hidden], and its caches kc,
    vc [B, n_kv, S, d] with k, v written at token index at[b] per row."""
    q, k, v = unrotated_qkv(cfg, lp, family(cfg).attn_input(cfg, lp, h))
    return q, k, v, put_rows(kc, k, at, 1), put_rows(vc, v, at, 1)


@functools.partial(jax.jit, static_argnames=("cfg", "conf"), donate_argnames=("state",))
def prefill_chunk(cfg, conf: Extrapolation, params, state: ExtrapolationState, tokens, start):
    """One prompt chunk tokens [B, C] at token index start (a traced scalar, the same for every row)
    through every layer. Returns (hidden [B, C, hidden], state)."""
    fam = family(cfg)
    B, C = tokens.shape
    S = state.k[0].shape[2]
    n_past = min(conf.token_budget - C, S)
    past = jnp.full((B,), start, jnp.int32)
    h = fam.embed(cfg, params, tokens, None)  # LLaMA: RoPE carries the positions
    ks, vs, top = [], [], state.max_position
    for lp, kc, vc in zip(params.layers, state.k, state.v):
        q, k, v, kc, vc = _store_layer(cfg, lp, h, kc, vc, past)
        # the chunk's vote query: each query rotated at num_recent + i, averaged (their QUERY_ROTATE)
        q_vote = jnp.mean(rotate(cfg, q, conf.num_recent + jnp.broadcast_to(jnp.arange(C), (B, C))), axis=2)
        k_past, v_past, nv = select_and_gather(cfg, conf, q_vote, kc, vc, past, n_past)
        m = nv[:, 0]  # every KV head selects as many (the valid count is shared)
        pos = m[:, None] + jnp.arange(C, dtype=jnp.int32)[None]  # [B, C]: the chunk right after its selection
        keys = jnp.concatenate([k_past, rotate(cfg, k, pos)], axis=2)
        vals = jnp.concatenate([v_past, v.astype(v_past.dtype)], axis=2)
        qr = rotate(cfg, q, pos)
        P = k_past.shape[2]
        slot = jnp.arange(P + C)
        past_ok = slot[None, None, :] < m[:, None, None]  # the selected past tokens
        causal = (slot - P)[None, :] <= jnp.arange(C)[:, None]  # the chunk: causal within itself
        valid = jnp.broadcast_to(jnp.where(slot < P, past_ok, causal[None]), (B, C, P + C))
        o = _masked_attention(qr, keys, vals, valid)
        top = jnp.maximum(top, jnp.max(pos))
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o.astype(h.dtype)))
        ks.append(kc)
        vs.append(vc)
    return h, ExtrapolationState(k=tuple(ks), v=tuple(vs), lengths=state.lengths, max_position=top)


def _masked_attention(q, k, v, valid):
    """q [B, H, C, d] over k, v [B, n_kv, N, d] where valid [B, C, N]; returns [B, H, C, d]."""
    B, H, C, d = q.shape
    n_kv = k.shape[1]
    qg = q.reshape(B, n_kv, H // n_kv, C, d)
    s = jnp.einsum("bkgqd,bknd->bkgqn", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgqn,bknd->bkgqd", p, v.astype(jnp.float32))
    return o.reshape(B, H, C, d)


def prefill(model, conf: Extrapolation, tokens, lengths, capacity: int):
    """The prompt (tokens [B, T] right-padded, lengths [B]) in chunks of conf.prefill_chunk.
    Returns (logits [B, V] at each prompt's last token, state)."""
    cfg = model.config
    conf.check(cfg)
    fam = family(cfg)
    B = tokens.shape[0]
    C = conf.prefill_chunk
    lengths = jnp.asarray(lengths, jnp.int32)
    t = -(-int(jnp.max(lengths)) // C) * C
    tokens = tokens[:, :t] if tokens.shape[1] >= t else jnp.pad(tokens, ((0, 0), (0, t - tokens.shape[1])))
    S = max(capacity, t)
    dtype = model.params.layers[0].wk.dtype
    shape = (B, cfg.num_kv_heads, S, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    state = ExtrapolationState(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                               lengths=lengths, max_position=jnp.zeros((), jnp.int32))
    hs = []
    for start in range(0, t, C):
        h, state = prefill_chunk(cfg, conf, model.params, state, tokens[:, start:start + C], jnp.int32(start))
        hs.append(h)
    h = jnp.concatenate(hs, axis=1)
    last = jnp.take_along_axis(h, (state.lengths - 1)[:, None, None], axis=1)[:, 0]  # (lengths was donated)
    return fam.logits(cfg, model.params, last), state


@functools.partial(jax.jit, static_argnames=("cfg", "conf"), donate_argnames=("state",))
def decode_step(cfg, conf: Extrapolation, params, state: ExtrapolationState, tokens):
    """One token per request (tokens [B]). Returns (logits [B, V], state)."""
    fam = family(cfg)
    B = tokens.shape[0]
    S = state.k[0].shape[2]
    at = state.lengths
    context = at + 1
    n_select = min(conf.token_budget, S)
    h = fam.embed(cfg, params, tokens[:, None], None)
    ks, vs, top = [], [], state.max_position
    for lp, kc, vc in zip(params.layers, state.k, state.v):
        q, _, _, kc, vc = _store_layer(cfg, lp, h, kc, vc, at)
        q_vote = rotate(cfg, q, jnp.full((B, 1), conf.num_recent, jnp.int32))[:, :, 0]
        k_sel, v_sel, nv = select_and_gather(cfg, conf, q_vote, kc, vc, context, n_select)
        q_pos = nv[:, :1] - 1  # the query is the newest selected token (forced in): the last rank
        qr = rotate(cfg, q, q_pos)[:, :, 0]
        slots = jnp.broadcast_to(jnp.arange(n_select, dtype=jnp.int32), nv.shape + (n_select,))
        o, _ = ops.sparse_attention(qr, k_sel, v_sel, slots, num_valid=nv)
        top = jnp.maximum(top, jnp.max(q_pos))
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o.astype(h.dtype)[:, :, None]))
        ks.append(kc)
        vs.append(vc)
    logits = fam.logits(cfg, params, h[:, 0])
    return logits, ExtrapolationState(k=tuple(ks), v=tuple(vs), lengths=context, max_position=top)
