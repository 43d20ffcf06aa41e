"""The serving cache on the device and the two programs that use it.

Layout (per layer): a block store K, V [N + 1, n_kv, blk, d] (block 0: scratch) that every request's full
blocks live in, and a tail K, V [slots, n_kv, blk, d], one row per batch slot, holding each request's
partly filled last block. Requests join and leave the batch between steps, so nothing is lockstep: each
slot has its own length, its own block table and its own tail fill. The host side (which block belongs to
whom, the prefix cache) is `serve/blocks.py`; these programs only read the tables the host hands them.

- `prefill_with_prefix`: one request's prompt after its cached prefix. The prefix's K/V is gathered from the
  store into a [1, n_kv, T, d] buffer, the rest of the prompt computed into it chunk-wise (causal attention
  over prefix and chunk), and the new full blocks written to their blocks, the partial one to the slot's tail.
- `decode`: one token for every slot: its K/V appended to the tail, attention over the slot's full blocks
  (paged) and its tail merged exactly by log-sum-exp, and a tail that fills up written to its next block.

Shapes are static per prompt bucket and per table width (the scheduler passes the widest row's blocks rounded
up to a power of two), so a server compiles a handful of programs as its requests grow, then none.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.models.common import attention_window, prefill_attention_chunk, pytree_dataclass
from kvoffload.models.transformer import family


@pytree_dataclass
class ServeCache:
    k: tuple  # per layer [N + 1, n_kv, blk, d]
    v: tuple
    tail_k: tuple  # per layer [slots, n_kv, blk, d]
    tail_v: tuple


def block_bytes(cfg, dtype, block_tokens: int) -> int:
    """Bytes of one block across every layer (K and V)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_tokens * cfg.head_dim * jnp.dtype(dtype).itemsize


def kv_dtype(model):
    """The dtype the model's K/V come out in (traced, nothing computed)."""
    cfg, fam, lp = model.config, family(model.config), model.params.layers[0]
    pos = jnp.zeros((1, 1), jnp.int32)
    h = jax.eval_shape(lambda: fam.embed(cfg, model.params, pos, pos))
    return jax.eval_shape(lambda: fam.qkv(cfg, lp, fam.attn_input(cfg, lp, jnp.zeros(h.shape, h.dtype)), pos))[1].dtype


def make_cache(model, num_blocks: int, slots: int, block_tokens: int) -> ServeCache:
    cfg = model.config
    dt = kv_dtype(model)
    device = jax.tree.leaves(model.params)[0].devices()
    device = next(iter(device))
    store = (num_blocks + 1, cfg.num_kv_heads, block_tokens, cfg.head_dim)
    tail = (slots, cfg.num_kv_heads, block_tokens, cfg.head_dim)
    z = lambda shape: jax.device_put(jnp.zeros(shape, dt), device)  # noqa: E731  committed like outputs
    n = cfg.num_layers
    return ServeCache(k=tuple(z(store) for _ in range(n)), v=tuple(z(store) for _ in range(n)),
                      tail_k=tuple(z(tail) for _ in range(n)), tail_v=tuple(z(tail) for _ in range(n)))


def _gather_rows(store, table):
    """store [N, n_kv, blk, d], table [M] -> [1, n_kv, M * blk, d] (the blocks laid end to end)."""
    g = store[table]  # [M, n_kv, blk, d]
    m, nkv, blk, d = g.shape
    return g.transpose(1, 0, 2, 3).reshape(1, nkv, m * blk, d)


def _as_blocks(buf, blk):
    """[1, n_kv, M * blk, d] -> [M, n_kv, blk, d]."""
    _, nkv, t, d = buf.shape
    return buf[0].reshape(nkv, t // blk, blk, d).transpose(1, 0, 2, 3)


def _write(store_k, store_v, dest, k_blocks, v_blocks):
    """Writes block i of k_blocks / v_blocks (per layer [n, n_kv, blk, d]) to store block dest[i] (scratch: 0).
    A program of its own, with the store donated and nothing else reading it, so XLA writes in place: inside
    the programs that also read the store it copied the whole store each call."""
    return (tuple(s.at[dest].set(b) for s, b in zip(store_k, k_blocks)),
            tuple(s.at[dest].set(b) for s, b in zip(store_v, v_blocks)))


_write = jax.jit(_write, donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("tail_k", "tail_v"))
def _prefill(cfg, params, store_k, store_v, tail_k, tail_v, tokens, start, length, table, slot):
    """tokens [1, Tc]: the prompt from position `start` (a multiple of blk: the cached prefix's end) on,
    right-padded; length: the prompt's tokens. table [M] (M * blk = T >= start + Tc + blk): the blocks holding
    positions [0, start) first, scratch after. Returns (logits [1, V] at the last prompt token, tails, and per
    layer the buffer's K and V as blocks [M, n_kv, blk, d] for `_write`)."""
    fam = family(cfg)
    blk = store_k[0].shape[2]
    tc = tokens.shape[1]
    positions = (start + jnp.arange(tc, dtype=jnp.int32))[None]
    lengths = jnp.reshape(length, (1,))
    h = fam.embed(cfg, params, tokens, positions)
    new_k, new_v, new_tk, new_tv = [], [], [], []
    full = length // blk  # the prompt's full blocks; block `full` is the partial one (the tail)
    for lp, ks, vs, tk, tv in zip(params.layers, store_k, store_v, tail_k, tail_v):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        kbuf = jax.lax.dynamic_update_slice_in_dim(_gather_rows(ks, table), k.astype(ks.dtype), start, axis=2)
        vbuf = jax.lax.dynamic_update_slice_in_dim(_gather_rows(vs, table), v.astype(vs.dtype), start, axis=2)
        o = prefill_attention_chunk(q, kbuf, vbuf, start, lengths, window=attention_window(cfg, lp))
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o))
        kb, vb = _as_blocks(kbuf, blk), _as_blocks(vbuf, blk)
        new_k.append(kb)
        new_v.append(vb)
        new_tk.append(jax.lax.dynamic_update_index_in_dim(tk, kb[full], slot, axis=0))
        new_tv.append(jax.lax.dynamic_update_index_in_dim(tv, vb[full], slot, axis=0))
    last = jax.lax.dynamic_index_in_dim(h, length - 1 - start, axis=1, keepdims=False)
    return fam.logits(cfg, params, last), tuple(new_tk), tuple(new_tv), tuple(new_k), tuple(new_v)


def prefill_with_prefix(model, cache, prompt, prefix_blocks, new_blocks, slot, block_tokens: int,
                        bucket_tokens: int = 64):
    """Prefills `prompt` (token ids) whose first len(prefix_blocks) blocks are cached. new_blocks: the blocks
    for the prompt's remaining full blocks (in order). Returns (logits [1, V], cache)."""
    blk = block_tokens
    start = len(prefix_blocks) * blk
    rest = len(prompt) - start
    tc = -(-rest // bucket_tokens) * bucket_tokens
    m = -(-(start + tc + blk) // bucket_tokens) * bucket_tokens // blk  # T = m * blk, bucketed
    tokens = np.zeros((1, tc), np.int32)
    tokens[0, :rest] = prompt[start:]
    table = np.zeros(m, np.int32)
    table[:len(prefix_blocks)] = prefix_blocks
    dest = np.zeros(m, np.int32)
    dest[len(prefix_blocks):len(prefix_blocks) + len(new_blocks)] = new_blocks
    device = next(iter(cache.k[0].devices()))
    tokens, start, length, table, dest, slot = jax.device_put(
        (tokens, np.int32(start), np.int32(len(prompt)), table, dest, np.int32(slot)), device)
    logits, tail_k, tail_v, kb, vb = _prefill(model.config, model.params, cache.k, cache.v, cache.tail_k,
                                              cache.tail_v, tokens, start, length, table, slot)
    k, v = _write(cache.k, cache.v, dest, kb, vb)
    return logits, ServeCache(k, v, tail_k, tail_v)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("tail_k", "tail_v"))
def _decode(cfg, params, store_k, store_v, tail_k, tail_v, tokens, lengths, tables, first_pos):
    """tokens [S]: each slot's newest token, at position lengths [S] (the tokens it already has K/V for);
    tables [S, M]: each slot's blocks in position order; first_pos [N + 1]: each block's first position
    (sliding windows). Returns (logits [S, V], tails); a tail this token filled is written by `_write`."""
    fam = family(cfg)
    s = tokens.shape[0]
    blk = store_k[0].shape[2]
    full = lengths // blk  # blocks in the store
    fill = lengths % blk  # tokens in the tail before this one
    positions = lengths[:, None]
    h = fam.embed(cfg, params, tokens[:, None], positions)
    rows = jnp.arange(s)
    new_tk, new_tv = [], []
    for lp, ks, vs, tk, tv in zip(params.layers, store_k, store_v, tail_k, tail_v):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        tk = tk.at[rows, :, fill].set(k[:, :, 0].astype(tk.dtype))
        tv = tv.at[rows, :, fill].set(v[:, :, 0].astype(tv.dtype))
        window = attention_window(cfg, lp)
        lo = None if window is None else lengths - window + 1
        o, _ = ops.merge_attention([
            ops.paged_decode_attention(q[:, :, 0], ks, vs, tables, full,
                                       first_pos=None if lo is None else first_pos, start=lo),
            ops.decode_attention(q[:, :, 0], tk, tv, fill + 1, start=None if lo is None else lo - full * blk),
        ])
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o[:, :, None]))
        new_tk.append(tk)
        new_tv.append(tv)
    return fam.logits(cfg, params, h[:, 0]), tuple(new_tk), tuple(new_tv)


def decode(model, cache, tokens, lengths, tables, flush_to, first_pos) -> tuple[Any, ServeCache]:
    """One decode step; flush_to [S]: the block each slot's tail goes to when this token fills it (scratch
    otherwise; no write at all when no slot fills)."""
    device = next(iter(cache.k[0].devices()))
    args = jax.device_put((np.asarray(tokens, np.int32), np.asarray(lengths, np.int32),
                           np.asarray(tables, np.int32), np.asarray(first_pos, np.int32)), device)
    logits, tail_k, tail_v = _decode(model.config, model.params, cache.k, cache.v, cache.tail_k, cache.tail_v,
                                     *args)
    k, v = cache.k, cache.v
    if np.any(flush_to):
        k, v = _write(k, v, jax.device_put(np.asarray(flush_to, np.int32), device), tail_k, tail_v)
    return logits, ServeCache(k, v, tail_k, tail_v)
