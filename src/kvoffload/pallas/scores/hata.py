"""HATA Hamming scores on packed sign codes: xor + popcount on int32 words (``popcount="swar"`` is a shift/mask
fallback), r - hamming per query head, optionally times the key norm, aggregated over the GQA group.

HATA packed sign codes
----------------------
A code of r bits (r a multiple of 32) for a vector x and projection W [d, r] is
bit_j = 1 if (x @ W)_j > 0 else 0, stored as uint32 words of shape [..., r // 32]:
bit j lives in word j // 32 at bit position j % 32 (LSB first), i.e.
word_w = sum_{i<32} bit_{32 w + i} << i. ``hata_encode`` produces this format;
the HATA trainer must produce the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import NEG_INF, cdiv, load, next_pow2, pallas_call, triton_params
from kvoffload.pallas.scores.common import check_group_reduce, load_rows, reduce_group, valid_mask


def hata_encode(x, w):
    """x [..., d], w [d, r] (r % 32 == 0) -> packed codes uint32 [..., r // 32]
    (bit j = (x @ w)_j > 0, in word j // 32 at bit j % 32, LSB first)."""
    r = w.shape[-1]
    if r % 32:
        raise ValueError(f"code bits r={r} must be a multiple of 32")
    proj = jnp.einsum("...d,dr->...r", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    bits = (proj > 0).astype(jnp.uint32).reshape(*proj.shape[:-1], r // 32, 32)
    shifts = jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)


def hamming_distance(a, b):
    """Number of differing bits between packed codes a, b (broadcasting) -> int32."""
    return jnp.sum(jax.lax.population_count(jnp.bitwise_xor(a, b)).astype(jnp.int32), axis=-1)


def hata_scores_reference(q_codes, k_codes, lengths=None, *, k_norm=None, group_reduce="sum"):
    """HATA similarity: r - hamming(q_code, k_code) per query head (higher = closer),
    optionally multiplied by the key norm, aggregated over the GQA group.
    q_codes [B, n_heads, W] uint32; k_codes [B, n_kv, S, W] uint32; k_norm [B, n_kv, S]
    or None. Returns [B, n_kv, S] float32."""
    B, H, W = q_codes.shape
    _, n_kv, S, _ = k_codes.shape
    G = H // n_kv
    r = 32 * W
    qc = q_codes.reshape(B, n_kv, G, 1, W)
    ham = hamming_distance(qc, k_codes[:, :, None])  # [B, n_kv, G, S]
    s = (r - ham).astype(jnp.float32)
    if k_norm is not None:
        s = s * k_norm.astype(jnp.float32)[:, :, None]
    s = reduce_group(s, group_reduce)
    return jnp.where(valid_mask(lengths, S, B), s, NEG_INF)


def popcount_swar(x):
    """Population count of int32/uint32 words with shifts, masks and one multiply only
    (the SWAR bit trick); wraps modulo 2**32, so it is exact for every bit pattern."""
    x = x.astype(jnp.int32)
    sr = jax.lax.shift_right_logical
    x = x - (sr(x, jnp.int32(1)) & jnp.int32(0x55555555))
    x = (x & jnp.int32(0x33333333)) + (sr(x, jnp.int32(2)) & jnp.int32(0x33333333))
    x = (x + sr(x, jnp.int32(4))) & jnp.int32(0x0F0F0F0F)
    return sr(x * jnp.int32(0x01010101), jnp.int32(24))


def _popcount(x, popcount):
    if popcount == "native":  # int32 -> libdevice __nv_popc in the Triton lowering
        return jax.lax.population_count(x)
    if popcount == "swar":
        return popcount_swar(x)
    raise ValueError(f"popcount must be native|swar, got {popcount!r}")


def _hata_kernel(len_ref, q_ref, k_ref, *rest, block_s, S, G, W, Wp, r_bits, with_norm,
                 group_reduce, popcount):
    # len_ref [1]; q_ref [G, Wp] int32 (zero-padded words); k_ref [S, W] int32;
    # n_ref [S] (with_norm); o_ref [block_s]
    n_ref, o_ref = rest if with_norm else (None, rest[0])
    j = pl.program_id(2)
    start = j * block_s
    rows = start + jnp.arange(block_s, dtype=jnp.int32)
    row_ok = rows < jnp.minimum(len_ref[0], S)
    kb = load_rows(k_ref, start, block_s, row_ok, W, Wp, 0)  # [block_s, Wp] int32
    nrm = load(n_ref.at[rows], mask=row_ok, other=0.0).astype(jnp.float32) if with_norm else None
    acc = None
    for g in range(G):  # static: G is small, each head is a [block_s, Wp] xor + popcount
        ham = jnp.sum(_popcount(jnp.bitwise_xor(kb, q_ref[g, :][None, :]), popcount), axis=1)
        s = (r_bits - ham).astype(jnp.float32)
        if with_norm:
            s = s * nrm
        if acc is None:
            acc = s
        elif group_reduce == "max":
            acc = jnp.maximum(acc, s)
        else:
            acc = acc + s
    if group_reduce == "mean":
        acc = acc / G
    o_ref[...] = jnp.where(row_ok, acc, -jnp.inf)


def hata_scores_kernel(q_codes, k_codes, lengths=None, *, k_norm=None, group_reduce="sum",
                       interpret=False, poison=False, block_s=None, popcount="native",
                       num_warps=4):
    """Pallas (Triton) HATA scores; same semantics as the reference.

    One program per (batch, kv head, block of keys): a [block_s, W] tile of key codes
    (bit-cast to int32, which the Triton popcount takes), xor with each query head's
    code, popcount (``popcount="native"``: lax.population_count -> __nv_popc;
    ``"swar"``: shifts/masks/multiply only), summed over words, times the key norm,
    reduced over the group."""
    check_group_reduce(group_reduce)  # (a bad popcount name raises while tracing)
    B, H, W = q_codes.shape
    _, n_kv, S, _ = k_codes.shape
    G = H // n_kv
    Wp = max(2, next_pow2(W))
    if block_s is None:
        block_s = 256
    block_s = min(block_s, max(16, next_pow2(S)))
    n_blocks = cdiv(S, block_s)
    if lengths is None:
        lengths = jnp.full((B,), S, jnp.int32)
    def as_i32(x):  # same bits; the Triton popcount takes int32
        return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)

    qc = as_i32(q_codes).reshape(B, n_kv, G, W)
    if Wp != W:
        qc = jnp.pad(qc, ((0, 0), (0, 0), (0, 0), (0, Wp - W)))
    with_norm = k_norm is not None
    kernel = functools.partial(_hata_kernel, block_s=block_s, S=S, G=G, W=W, Wp=Wp,
                               r_bits=32 * W, with_norm=with_norm, group_reduce=group_reduce,
                               popcount=popcount)
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, j: (b,)),
        pl.BlockSpec((None, None, G, Wp), lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((None, None, S, W), lambda b, h, j: (b, h, 0, 0)),
    ]
    args = [jnp.asarray(lengths, jnp.int32), qc, as_i32(k_codes)]
    if with_norm:
        in_specs.append(pl.BlockSpec((None, None, S), lambda b, h, j: (b, h, 0)))
        args.append(k_norm)
    out = pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, n_blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block_s), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, n_kv, n_blocks * block_s), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="kvo_hata_scores",
    )(*args)
    return out[:, :, :S]
