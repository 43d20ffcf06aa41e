"""KV recomputation from stored attention-input activations (KVPR / HybridServe ACT blocks).

K = RoPE(X W_K + b_K), V = X W_V + b_V, written straight into the cache layout
[B, n_kv, T, d]. RoPE is HF's split-half form: for x = [x1, x2] (halves of the head
dim), rot = [x1*cos - x2*sin, x2*cos + x1*sin], cos/sin [B, T, d//2].

The kernel is one fused pass: per (row tile, kv head) program it computes the
[bt, d] K and V tiles of that head (fp32 accumulation over H in blocks of bk),
applies bias and RoPE in registers and stores both tiles in cache layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import cdiv, dot, next_pow2, pallas_call, triton_params


def apply_rope_split_half(x, cos, sin):
    """x [..., T, d] (float32), cos/sin broadcastable to [..., T, d//2]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def recompute_kv_reference(x, w_k, b_k, w_v, b_v, cos=None, sin=None, *, n_kv, matmul=None):
    """Pure-jnp reference. x [B, T, H] -> k, v [B, n_kv, T, d] in x.dtype (w_k None: V alone, k None).
    matmul(x, w) -> fp32 x @ w: XLA's einsum by default; `ops` passes its few-row linear for a decode step."""
    B, T, H = x.shape
    d = w_v.shape[1] // n_kv
    # HIGHEST keeps fp32 matmuls off TF32. For a bf16 decode step's one token XLA:GPU then wrote x*W_K and x*W_V
    # out in fp32 (H100 dump, Llama-3-8B: 84 MB per layer for 17 MB of weights), yet the default precision was
    # not faster (H100, 2026-11-27); that token now takes `ops.matmul_f32`'s kernel on a GPU.
    if matmul is None:
        def matmul(a, w):
            return jnp.einsum("bth,hn->btn", a, w, preferred_element_type=jnp.float32,
                              precision=jax.lax.Precision.HIGHEST)
    v = matmul(x, w_v)
    if b_v is not None:
        v = v + b_v.astype(jnp.float32)
    v = v.reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
    if w_k is None:
        return None, v.astype(x.dtype)
    k = matmul(x, w_k)
    if b_k is not None:
        k = k + b_k.astype(jnp.float32)
    k = k.reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
    if cos is not None:
        c = cos.astype(jnp.float32)[:, None]
        s = sin.astype(jnp.float32)[:, None]
        k = apply_rope_split_half(k, c, s)
    return k.astype(x.dtype), v.astype(x.dtype)


# ----------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------


def _recompute_kernel(*refs, H, bk, half, has_bias, has_rope):
    # x_ref [bt, H]; wk*/wv* refs [H, half] (the two halves of this head's columns);
    # bias refs [half]; cos/sin refs [bt, half]; outputs k/v [bt, 2*half]
    it = iter(refs)
    x_ref = next(it)
    wk1, wk2, wv1, wv2 = next(it), next(it), next(it), next(it)
    if has_bias:
        bk1, bk2, bv1, bv2 = next(it), next(it), next(it), next(it)
    if has_rope:
        cos_ref, sin_ref = next(it), next(it)
    k_ref, v_ref = next(it), next(it)
    bt = x_ref.shape[0]

    def body(i, acc):
        a1, a2, c1, c2 = acc
        sl = pl.ds(i * bk, bk)
        xb = x_ref[:, sl]
        a1 = a1 + dot(xb, wk1[sl, :])
        a2 = a2 + dot(xb, wk2[sl, :])
        c1 = c1 + dot(xb, wv1[sl, :])
        c2 = c2 + dot(xb, wv2[sl, :])
        return a1, a2, c1, c2

    z = jnp.zeros((bt, half), jnp.float32)
    a1, a2, c1, c2 = jax.lax.fori_loop(0, H // bk, body, (z, z, z, z))
    if has_bias:
        a1 = a1 + bk1[...].astype(jnp.float32)[None, :]
        a2 = a2 + bk2[...].astype(jnp.float32)[None, :]
        c1 = c1 + bv1[...].astype(jnp.float32)[None, :]
        c2 = c2 + bv2[...].astype(jnp.float32)[None, :]
    if has_rope:
        cs = cos_ref[...].astype(jnp.float32)
        sn = sin_ref[...].astype(jnp.float32)
        a1, a2 = a1 * cs - a2 * sn, a2 * cs + a1 * sn
    k_ref[:, pl.ds(0, half)] = a1.astype(k_ref.dtype)
    k_ref[:, pl.ds(half, half)] = a2.astype(k_ref.dtype)
    v_ref[:, pl.ds(0, half)] = c1.astype(v_ref.dtype)
    v_ref[:, pl.ds(half, half)] = c2.astype(v_ref.dtype)


def recompute_kv_supported(x, w_k, n_kv) -> bool:
    B, T, H = x.shape
    d = w_k.shape[1] // n_kv
    half = d // 2
    return half >= 16 and next_pow2(half) == half and H % 16 == 0


def recompute_kv_kernel(
    x, w_k, b_k, w_v, b_v, cos=None, sin=None, *, n_kv, interpret=False, poison=False,
    block_t=None, block_k=None, num_warps=None, num_stages=3,
):
    """Fused Pallas (Triton) K/V recomputation; same semantics as the reference.

    Needs d//2 a power of two >= 16 (d = 64, 128, 256) and H % 16 == 0; the op layer
    falls back to the reference otherwise. T is padded up to the row tile.
    """
    B, T, H = x.shape
    d = w_k.shape[1] // n_kv
    half = d // 2
    if not recompute_kv_supported(x, w_k, n_kv):
        raise ValueError(f"recompute_kv kernel needs pow2 d//2 >= 16 and H%16==0; got d={d}, H={H}")
    has_bias = b_k is not None
    has_rope = cos is not None
    if block_t is None:
        block_t = 128 if d <= 64 else 64
    block_t = min(block_t, max(16, next_pow2(T)))
    if block_k is None:
        block_k = 64
    while H % block_k:
        block_k //= 2
    if num_warps is None:
        num_warps = 4
    Tp = cdiv(T, block_t) * block_t
    xp = x if Tp == T else jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0)))
    w_k = w_k.astype(x.dtype)
    w_v = w_v.astype(x.dtype)
    # [H, n_kv*2, half]: column block j = 2*h + part (part 0: first half of head h)
    wk = w_k.reshape(H, n_kv * 2, half)
    wv = w_v.reshape(H, n_kv * 2, half)
    args = [xp, wk, wk, wv, wv]
    nt = Tp // block_t
    w_spec0 = pl.BlockSpec((H, None, half), lambda b, t, h: (0, 2 * h, 0))
    w_spec1 = pl.BlockSpec((H, None, half), lambda b, t, h: (0, 2 * h + 1, 0))
    in_specs = [
        pl.BlockSpec((None, block_t, H), lambda b, t, h: (b, t, 0)),
        w_spec0, w_spec1, w_spec0, w_spec1,
    ]
    if has_bias:
        bkr = b_k.reshape(n_kv * 2, half)
        bvr = (b_v if b_v is not None else jnp.zeros_like(b_k)).reshape(n_kv * 2, half)
        b0 = pl.BlockSpec((None, half), lambda b, t, h: (2 * h, 0))
        b1 = pl.BlockSpec((None, half), lambda b, t, h: (2 * h + 1, 0))
        args += [bkr, bkr, bvr, bvr]
        in_specs += [b0, b1, b0, b1]
    elif b_v is not None:
        has_bias = True
        bkr = jnp.zeros_like(b_v).reshape(n_kv * 2, half)
        bvr = b_v.reshape(n_kv * 2, half)
        b0 = pl.BlockSpec((None, half), lambda b, t, h: (2 * h, 0))
        b1 = pl.BlockSpec((None, half), lambda b, t, h: (2 * h + 1, 0))
        args += [bkr, bkr, bvr, bvr]
        in_specs += [b0, b1, b0, b1]
    if has_rope:
        cp = cos if Tp == T else jnp.pad(cos, ((0, 0), (0, Tp - T), (0, 0)))
        sp = sin if Tp == T else jnp.pad(sin, ((0, 0), (0, Tp - T), (0, 0)))
        args += [cp, sp]
        cs_spec = pl.BlockSpec((None, block_t, half), lambda b, t, h: (b, t, 0))
        in_specs += [cs_spec, cs_spec]
    kernel = functools.partial(
        _recompute_kernel, H=H, bk=block_k, half=half, has_bias=has_bias, has_rope=has_rope
    )
    out_spec = pl.BlockSpec((None, None, block_t, d), lambda b, t, h: (b, h, t, 0))
    k, v = pallas_call(
        kernel, poison=poison,
        grid=(B, nt, n_kv),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[
            jax.ShapeDtypeStruct((B, n_kv, Tp, d), x.dtype),
            jax.ShapeDtypeStruct((B, n_kv, Tp, d), x.dtype),
        ],
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvo_recompute_kv",
    )(*args)
    if Tp != T:
        k, v = k[:, :, :T], v[:, :, :T]
    return k, v
