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

`prefill_attention_chunk_cudnn` computes the same with cuDNN's flash attention (bf16/fp16 on a GPU), 2.1x the
kernel's rate on an H100 (580 vs 273 TFLOP/s at a 1M-token prompt): the "auto" path on a GPU.
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
    on_gpu,
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


# ----------------------------------------------------------------------------------------------------
# cuDNN flash attention for the same chunk (the fastest path on a GPU)
# ----------------------------------------------------------------------------------------------------

CUDNN_DTYPES = ("bfloat16", "float16")


def cudnn_supported(dtype, head_dim: int) -> bool:
    """Whether `prefill_attention_chunk_cudnn` runs here: a GPU, 16-bit inputs and a head dim that is a
    multiple of 8 up to 256 (cuDNN's flash attention)."""
    return on_gpu() and jnp.dtype(dtype).name in CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= 256


def prefill_attention_chunk_cudnn(q, k, v, q_start, lengths, *, scale=None):
    """A prefill chunk's causal attention (`models.common.prefill_attention_chunk`'s semantics; q [B, nh,
    Tc, d] at positions q_start + [0, Tc), k, v [B, n_kv, T, d] with q_start + Tc <= T) by two cuDNN
    flash-attention calls merged by their log-sum-exp: the keys before the chunk, [0, min(q_start,
    length)), unmasked (a padding mask: cuDNN skips the key tiles past it, so a chunk costs its prefix,
    not the buffer), and the chunk's own keys, causal (top-left: query i sees keys <= i) and cut at the
    length. On an H100 at a 1M-token prompt: 580 TFLOP/s against the Pallas kernel's 273 (what brings
    a 32-layer 1M-token prefill near one 10-minute run). Returns [B, nh, Tc, d] in q.dtype.

    The BNTH layout (the library's [B, heads, T, d]) is reachable only through jax._src: the public
    `jax.nn.dot_product_attention` takes BTNH, which would transpose the whole 1M-token K/V per chunk."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as e:  # pragma: no cover  (a JAX without the module)
        raise RuntimeError(f"prefill_attention_impl='cudnn' needs JAX's cuDNN attention module: {e}") from e
    B, nh, Tc, d = q.shape
    if not cudnn_supported(q.dtype, d):
        raise ValueError(f"prefill_attention_impl='cudnn' needs a GPU, bf16 or fp16 inputs and a head dim that "
                         f"is a multiple of 8 up to 256; got {jnp.dtype(q.dtype).name}, head dim {d} on "
                         f"{jax.default_backend()}")
    scale = default_scale(d, scale)
    q_start = jnp.asarray(q_start, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    q_len = jnp.full((B,), Tc, jnp.int32)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    call = functools.partial(fa.dot_product_attention, scale=scale, qkv_layout="BNTH", return_residual=True)
    prefix = jnp.minimum(q_start, lengths)  # keys before the chunk
    o_pre, lse_pre = call(q, k, v, None, None, q_len, jnp.maximum(prefix, 1), mask_type=fa.MaskType.PADDING)
    own = jnp.clip(lengths - q_start, 0, Tc)  # the chunk's keys inside the prompt
    k_own = jax.lax.dynamic_slice_in_dim(k, q_start, Tc, axis=2)
    v_own = jax.lax.dynamic_slice_in_dim(v, q_start, Tc, axis=2)
    o_own, lse_own = call(q, k_own, v_own, None, None, q_len, jnp.maximum(own, 1),
                          mask_type=fa.MaskType.PADDING_CAUSAL)
    # an empty part (first chunk: no prefix; a chunk past the prompt: no own keys) weighs nothing
    lse_pre = jnp.where((prefix > 0)[:, None, None], lse_pre.astype(jnp.float32), -jnp.inf)
    lse_own = jnp.where((own > 0)[:, None, None], lse_own.astype(jnp.float32), -jnp.inf)
    m = jnp.maximum(lse_pre, lse_own)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_pre, w_own = jnp.exp(lse_pre - m), jnp.exp(lse_own - m)
    tot = jnp.maximum(w_pre + w_own, jnp.finfo(jnp.float32).tiny)
    out = (o_pre.astype(jnp.float32) * (w_pre / tot)[..., None] + o_own.astype(jnp.float32) * (w_own / tot)[..., None])
    return out.astype(q.dtype)
