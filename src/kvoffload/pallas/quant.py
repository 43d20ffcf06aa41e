"""Group-wise asymmetric int4 quantization (FlexGen style) and int4 decode attention.

Quantization of x [..., D] along the last dim with groups of ``group_size``
(default 64; must divide D):
    mn = min over group, mx = max over group, step = (mx - mn) / 15
    code = clip(round((x - mn) / step), 0, 15)       (step == 0 -> code 0)
    x_hat = code * step + mn
``step`` and ``mn`` are stored as float32 [..., D // group_size] (``scales="token"``: one row's values share
a group, e.g. a token's head_dim). ``scales="channel"`` (KIVI, arXiv 2402.02750: keys have outlier channels,
so a key is quantized per channel) groups along axis -2 instead: x [..., T, D] gets one step and min per
column over its T rows, float32 [..., 1, D]; the codes stay row-major packed [..., T, D // 2], so a row
gather still takes whole rows (and the row's block's scales). ``group_size`` is unused there.

Packing (split-half, chosen so a kernel unpacks into two contiguous halves):
packed [..., D // 2] uint8, byte j = code[j] | (code[j + D // 2] << 4).

int8 (``quantize_int8``, bits=8): the same groups with step = (mx - mn) / 255 and one uint8 code per value,
unpacked [..., D] (per token only): a host pool's keys where per-token int4 loses accuracy
(``int4_k_quant="int8"``).

A QuantizedKV is a pytree (codes, step, mn). ``decode_attention_int4`` attends over
int4 K/V without materialising the dequantised cache: per group g,
q.k = step_g * (q_g . code_g) + mn_g * sum(q_g), and likewise for p @ V.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import (
    NEG_INF,
    cdiv,
    default_scale,
    dot_split,
    load,
    next_pow2,
    online_softmax_init,
    online_softmax_step,
    split_blocks,
)
from kvoffload.pallas.decode_attention import _attend_masked, flash_decode


SCALES = ("token", "channel")  # what one step / min covers: a group of a row (token) or a column (channel)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "step", "mn"], meta_fields=["group_size", "scales", "bits"])
@dataclasses.dataclass(frozen=True)
class QuantizedInt:
    """Group-quantized values: int4 (packed two a byte) or int8 codes with a float32 step and min per group."""

    codes: jax.Array  # uint8 [..., D // 2] packed (split-half; bits 4) or [..., D] (bits 8)
    step: jax.Array  # float32 [..., D // group_size] ("token"); [..., 1 or T, D] ("channel", int4 only)
    mn: jax.Array  # float32, shaped like step
    group_size: int = 64
    scales: str = "token"
    bits: int = 4

    @property
    def shape(self):
        return (*self.codes.shape[:-1], self.codes.shape[-1] * (2 if self.bits == 4 else 1))


def pack_int4(codes):
    """codes uint8/int [..., D] in [0, 15] -> packed uint8 [..., D // 2] (split-half)."""
    D = codes.shape[-1]
    c = codes.astype(jnp.uint8)
    return (c[..., : D // 2] | (c[..., D // 2:] << 4)).astype(jnp.uint8)


def unpack_int4(packed):
    """packed uint8 [..., D // 2] -> codes uint8 [..., D]."""
    lo = packed & jnp.uint8(15)
    hi = packed >> 4
    return jnp.concatenate([lo, hi], axis=-1)


def _codes_of(xf, mn, mx, top=15):
    step = (mx - mn) / float(top)
    inv = jnp.where(step > 0, 1.0 / jnp.where(step > 0, step, 1.0), 0.0)
    return jnp.clip(jnp.round((xf - mn) * inv), 0, top).astype(jnp.uint8), step


def quantize_int4(x, group_size=64, scales="token"):
    """x [..., D] ("channel": [..., T, D]) -> QuantizedInt (see module docstring)."""
    D = x.shape[-1]
    if scales not in SCALES:
        raise ValueError(f"scales must be one of {SCALES}, got {scales!r}")
    if scales == "channel":
        if D % 2 or x.ndim < 2:
            raise ValueError(f"per-channel int4 needs x [..., T, D] with D even, got shape {x.shape}")
        xf = x.astype(jnp.float32)
        mn = jnp.min(xf, axis=-2, keepdims=True)
        codes, step = _codes_of(xf, mn, jnp.max(xf, axis=-2, keepdims=True))
        return QuantizedInt(pack_int4(codes), step, mn, group_size, scales)
    if D % group_size or D % 2:
        raise ValueError(f"group_size {group_size} must divide D={D} (D even)")
    codes, step, mn = _token_groups(x, group_size, 15)
    return QuantizedInt(pack_int4(codes), step, mn, group_size)


def quantize_int8(x, group_size=64):
    """x [..., D] -> QuantizedInt with bits=8: a uint8 code per value [..., D], float32 step and min per group of
    group_size along D (step = range / 255)."""
    D = x.shape[-1]
    if D % group_size:
        raise ValueError(f"group_size {group_size} must divide D={D}")
    codes, step, mn = _token_groups(x, group_size, 255)
    return QuantizedInt(codes, step, mn, group_size, "token", 8)


def _token_groups(x, group_size, top):
    """(codes [..., D] uint8 in [0, top], step, min [..., D // group_size]): x's groups of group_size along D."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    mn = jnp.min(xf, axis=-1)
    codes, step = _codes_of(xf, mn[..., None], jnp.max(xf, axis=-1)[..., None], top)
    return codes.reshape(x.shape), step[..., 0], mn


def dequantize(qx: QuantizedInt, dtype=jnp.float32):
    """The values a QuantizedInt (int4 or int8 codes) stands for, in dtype."""
    codes = (unpack_int4(qx.codes) if qx.bits == 4 else qx.codes).astype(jnp.float32)
    if qx.scales == "channel":  # step / mn [..., 1, D] (an extent's blocks) or [..., T, D] (gathered rows)
        return (codes * qx.step + qx.mn).astype(dtype)
    D = codes.shape[-1]
    gs = qx.group_size
    c = codes.reshape(*codes.shape[:-1], D // gs, gs)
    x = c * qx.step[..., None] + qx.mn[..., None]
    return x.reshape(codes.shape).astype(dtype)


# ----------------------------------------------------------------------------
# int4 decode attention
# ----------------------------------------------------------------------------


def decode_attention_int4_reference(q, kq: QuantizedInt, vq: QuantizedInt, lengths, *,
                                    scale=None):
    """Decode attention over int4 K/V (dequantise, then attend). kq/vq [B, n_kv, S, d]."""
    B, H, d = q.shape
    k = dequantize(kq)
    v = dequantize(vq)
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    qg = q.reshape(B, n_kv, G, d).astype(jnp.float32)  # int4 path computes in fp32
    valid = jnp.arange(S)[None, None, :] < lengths.astype(jnp.int32)[:, None, None]
    out, lse = _attend_masked(qg, k, v, valid, scale)
    return out.reshape(B, H, d).astype(q.dtype), lse.reshape(B, H)


def int4_kernel_supported(d, group_size) -> bool:
    half = d // 2
    w = min(group_size, half)
    return (d % group_size == 0 and next_pow2(half) == half and half >= 16
            and next_pow2(w) == w and w >= 16 and half % w == 0)


def _chunks(d, gs):
    """Static list of (nibble_half, col_offset_in_half, width, group_id)."""
    half = d // 2
    w = min(gs, half)
    out = []
    for h in range(2):
        for c in range(half // w):
            out.append((h, c * w, w, (h * half + c * w) // gs))
    return out


def _int4_kernel(len_ref, q_ref, kc_ref, ks_ref, km_ref, vc_ref, vs_ref, vm_ref,
                 o_ref, lse_ref, *, scale, block_s, blocks_per_split, d, gs, S, n_groups,
                 q_terms, p_terms):
    # q_ref [Gp, d] (fp32); kc/vc [S, d//2] uint8; ks/km/vs/vm [S, n_groups] f32
    # o_ref [Gp, d]; lse_ref [Gp]
    split = pl.program_id(2)
    length = jnp.minimum(len_ref[0], S)
    chunk_start = split * (blocks_per_split * block_s)
    n_valid = jnp.clip((length - chunk_start + block_s - 1) // block_s, 0, blocks_per_split)
    half = d // 2
    w = min(gs, half)
    offs = list(range(0, half, w))  # byte-column chunks; each holds a lo and a hi part
    # (offset, half) -> group id
    gid = {(off, h): (h * half + off) // gs for off in offs for h in (0, 1)}
    q_lo = [q_ref[:, pl.ds(off, w)] for off in offs]
    q_hi = [q_ref[:, pl.ds(half + off, w)] for off in offs]
    Gp = q_lo[0].shape[0]
    qsum = [None] * n_groups
    for off, ql, qh in zip(offs, q_lo, q_hi):
        for h, qc in ((0, ql), (1, qh)):
            g = gid[(off, h)]
            t = jnp.sum(qc, axis=1)
            qsum[g] = t if qsum[g] is None else qsum[g] + t

    def body(i, carry):
        acc_lo, acc_hi, m, l = carry
        start = chunk_start + i * block_s
        rows = start + jnp.arange(block_s, dtype=jnp.int32)
        row_ok = rows < length
        rsl = pl.ds(start, block_s)
        kstep = [load(ks_ref.at[rsl, jnp.int32(g)], mask=row_ok, other=0.0)
                 for g in range(n_groups)]
        kmn = [load(km_ref.at[rsl, jnp.int32(g)], mask=row_ok, other=0.0)
               for g in range(n_groups)]
        s = jnp.zeros((Gp, block_s), jnp.float32)
        for off, ql, qh in zip(offs, q_lo, q_hi):
            byte = load(kc_ref.at[rsl, pl.ds(off, w)], mask=row_ok[:, None], other=0)
            for h, qc in ((0, ql), (1, qh)):
                code = (byte >> 4) if h else (byte & 15)
                g = gid[(off, h)]
                s = s + dot_split(qc, code.astype(jnp.float32), q_terms,
                                  trans_b=True) * kstep[g][None, :]
        for g in range(n_groups):
            s = s + qsum[g][:, None] * kmn[g][None, :]
        m_new, l_new, p, alpha = online_softmax_step(m, l, s * scale, row_ok)
        vstep = [load(vs_ref.at[rsl, jnp.int32(g)], mask=row_ok, other=0.0)
                 for g in range(n_groups)]
        vmn = [load(vm_ref.at[rsl, jnp.int32(g)], mask=row_ok, other=0.0)
               for g in range(n_groups)]
        pm = [jnp.sum(p * vmn[g][None, :], axis=1) for g in range(n_groups)]
        new_lo, new_hi = [], []
        for off, al, ah in zip(offs, acc_lo, acc_hi):
            byte = load(vc_ref.at[rsl, pl.ds(off, w)], mask=row_ok[:, None], other=0)
            for h, acc, dst in ((0, al, new_lo), (1, ah, new_hi)):
                code = ((byte >> 4) if h else (byte & 15)).astype(jnp.float32)
                g = gid[(off, h)]
                pv = dot_split(p * vstep[g][None, :], code, p_terms) + pm[g][:, None]
                dst.append(acc * alpha[:, None] + pv)
        return tuple(new_lo), tuple(new_hi), m_new, l_new

    z = tuple(jnp.zeros((Gp, w), jnp.float32) for _ in offs)
    acc_lo, acc_hi, m, l = jax.lax.fori_loop(0, n_valid, body, (z, z, *online_softmax_init(Gp)))
    safe_l = jnp.where(l > 0, l, 1.0)
    for off, al, ah in zip(offs, acc_lo, acc_hi):
        o_ref[:, pl.ds(off, w)] = (al / safe_l[:, None]).astype(o_ref.dtype)
        o_ref[:, pl.ds(half + off, w)] = (ah / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe_l), NEG_INF)


def decode_attention_int4_kernel(q, kq: QuantizedInt, vq: QuantizedInt, lengths, *,
                                 scale=None, interpret=False, poison=False, block_s=64, num_splits=None,
                                 num_warps=4, num_stages=2):
    """Pallas (Triton) decode attention reading packed int4 K/V directly.

    Needs d//2 a power of two >= 16 and min(group_size, d//2) a power of two >= 16
    (d = 64, 128 with group 32/64); the op layer falls back to the reference otherwise.
    Code dots run on bf16 tensor cores (codes 0..15 are exact in bf16); the fp32 operand
    (q, and p * step) is split into 3 bf16 pieces for fp32 inputs (1 for bf16 inputs).
    """
    B, H, d = q.shape
    _, n_kv, S, _ = kq.codes.shape
    G = H // n_kv
    gs = kq.group_size
    if not int4_kernel_supported(d, gs) or vq.group_size != gs:
        raise ValueError(f"int4 kernel unsupported for d={d}, group_size={gs}")
    scale = default_scale(d, scale)
    Gp = max(16, next_pow2(G))
    n_groups = d // gs
    block_s = min(block_s, max(16, next_pow2(S)))
    blocks_per_split, num_splits = split_blocks(B, n_kv, cdiv(S, block_s), num_splits)
    qg = jnp.pad(q.reshape(B, n_kv, G, d).astype(jnp.float32),
                 ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    kernel = functools.partial(
        _int4_kernel, scale=scale, block_s=block_s, blocks_per_split=blocks_per_split,
        d=d, gs=gs, S=S, n_groups=n_groups,
        q_terms=1 if q.dtype == jnp.bfloat16 else 3,
        p_terms=2 if q.dtype == jnp.bfloat16 else 3)
    full = lambda last: pl.BlockSpec((None, None, S, last), lambda b, h, s: (b, h, 0, 0))  # noqa: E731
    return flash_decode(
        kernel,
        (lengths.astype(jnp.int32), qg, kq.codes, kq.step.astype(jnp.float32), kq.mn.astype(jnp.float32),
         vq.codes, vq.step.astype(jnp.float32), vq.mn.astype(jnp.float32)),
        [pl.BlockSpec((1,), lambda b, h, s: (b,)),
         pl.BlockSpec((None, None, Gp, d), lambda b, h, s: (b, h, 0, 0)),
         full(d // 2), full(n_groups), full(n_groups),
         full(d // 2), full(n_groups), full(n_groups)],
        q=q, n_kv=n_kv, num_splits=num_splits, Gp=Gp, dp=d, name="kvo_decode_attention_int4",
        interpret=interpret, poison=poison, num_warps=num_warps, num_stages=num_stages)
