"""Causal attention of one prefill chunk over the keys before and in it (chunked prefill, 1M-token prompts).

A chunk's queries q [B, nh, Tc, d] sit at positions q_start + [0, Tc) (q_start traced: one compilation for
every chunk); k, v [B, n_kv, T, d] are the layer's whole K/V buffers, of which only positions < q_start + Tc
are read (later ones may be unwritten); keys at positions >= lengths[b] are masked. The reference is
`models.common.prefill_attention_chunk` (XLA: an online softmax over 1024-key blocks that writes each block's
fp32 scores [B, nh, Tc, 1024] to memory and reads them back several times: at 1M tokens 93 s per Llama-3-8B
layer on an H200, ~13x the matmul floor). The kernel is flash attention: each program holds a [block_q, d]
query tile and walks the key blocks up to its last query with the online softmax in registers, so the
scores never reach memory.

Grid (B, nh, cdiv(Tc, block_q)); each query head reads its KV head's keys (GQA: h // (nh / n_kv)). Tiles are
powers of two; other head dims and ragged ends are handled with masked loads and stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import (
    cdiv,
    cdiv_traced,
    default_scale,
    dot,
    load,
    next_pow2,
    online_softmax_init,
    online_softmax_step,
    softmax_stats_to_out,
    triton_params,
)


def _prefill_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, o_ref, *, scale, block_q, block_k, d, dp, Tc, T):
    # start_ref [1]: the chunk's first position; len_ref [1]: this row's prompt length;
    # q_ref [Tc, d] (this head's chunk), k_ref / v_ref [T, d] (its KV head's buffers), o_ref [Tc, d]
    from jax.experimental.pallas import triton as plgpu

    i = pl.program_id(2)
    q_start = start_ref[0]
    length = jnp.minimum(len_ref[0], T)
    qrows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)  # rows of the chunk
    qpos = q_start + qrows
    q_ok = qrows < Tc
    cols = jnp.arange(dp, dtype=jnp.int32)
    col_ok = cols < d
    q = load(q_ref.at[qrows[:, None], cols[None, :]], mask=q_ok[:, None] & col_ok[None, :], other=0.0)
    q = q.astype(k_ref.dtype)
    # keys this tile can see: up to its last query's position, inside the prompt and the buffer
    last = q_start + jnp.minimum((i + 1) * block_q, Tc)  # exclusive
    n_blocks = cdiv_traced(jnp.minimum(last, length), block_k)

    def body(j, carry):
        acc, m, l = carry
        rows = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        row_ok = rows < length
        msk = row_ok[:, None] & col_ok[None, :]
        kb = load(k_ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)
        vb = load(v_ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)
        s = dot(q, kb, trans_b=True) * scale  # [block_q, block_k] fp32
        causal = row_ok[None, :] & (rows[None, :] <= qpos[:, None])
        m_new, l_new, p, alpha = online_softmax_step(m, l, s, causal)
        return acc * alpha[:, None] + dot(p.astype(vb.dtype), vb), m_new, l_new

    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, (jnp.zeros((block_q, dp), jnp.float32),
                                                      *online_softmax_init(block_q)))
    out, _ = softmax_stats_to_out(acc, l, m)
    plgpu.store(o_ref.at[qrows[:, None], cols[None, :]], out.astype(o_ref.dtype),
                mask=q_ok[:, None] & col_ok[None, :])


def prefill_attention_chunk_kernel(q, k, v, q_start, lengths, *, scale=None, block_q=64, block_k=64,
                                   num_warps=4, num_stages=2, interpret=False):
    """Pallas (Triton) flash attention of a prefill chunk; the semantics of
    `models.common.prefill_attention_chunk` (returns [B, nh, Tc, d] in q.dtype)."""
    B, nh, Tc, d = q.shape
    _, n_kv, T, _ = k.shape
    G = nh // n_kv
    scale = default_scale(d, scale)
    dp = max(16, next_pow2(d))
    block_q = min(int(block_q), max(16, next_pow2(Tc)))
    block_k = min(int(block_k), max(16, next_pow2(T)))
    kernel = functools.partial(_prefill_kernel, scale=scale, block_q=block_q, block_k=block_k, d=d, dp=dp,
                               Tc=Tc, T=T)
    start = jnp.reshape(jnp.asarray(q_start, jnp.int32), (1,))
    return pl.pallas_call(
        kernel,
        grid=(B, nh, cdiv(Tc, block_q)),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, i: (0,)),
            pl.BlockSpec((1,), lambda b, h, i: (b,)),
            pl.BlockSpec((None, None, Tc, d), lambda b, h, i: (b, h, 0, 0)),
            pl.BlockSpec((None, None, T, d), lambda b, h, i: (b, h // G, 0, 0)),
            pl.BlockSpec((None, None, T, d), lambda b, h, i: (b, h // G, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, Tc, d), lambda b, h, i: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, nh, Tc, d), q.dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvo_prefill_attention",
    )(start, lengths.astype(jnp.int32), q, k, v)
