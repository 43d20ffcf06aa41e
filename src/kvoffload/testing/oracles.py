"""The float64 NumPy oracles every kernel check compares against, and what every check shares: random inputs with
their float64 copies (never zeros), the errors against an oracle, the result dict.

A check returns ``dict(name, mode, err, tol, ok, ...)``; mode: "reference" (pure jnp), "kernel" (compiled
Pallas), "interpret" (Pallas interpret).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

TOL = {"float32": 1e-5, "bfloat16": 1e-2}
# The kernels' bf16 path rounds p to bf16 before p @ V (as every flash kernel does);
# the float64 NumPy reference does not, hence the bf16 tolerance.


def _dt(name):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _rand(rng, shape, dtype, scale=1.0):
    x = rng.standard_normal(shape) * scale
    x = np.where(np.abs(x) < 1e-3, 1e-3, x)  # never exact zeros
    a = jnp.asarray(x, _dt(dtype))
    return a, np.asarray(a.astype(jnp.float32), np.float64)


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf")
    if not np.all(np.isfinite(out)):
        return float("nan")
    den = np.linalg.norm(ref.ravel())
    return float(np.linalg.norm((out - ref).ravel()) / max(den, 1e-30))


def lse_err(lse, ref):
    lse = np.asarray(lse, np.float64)
    ref = np.asarray(ref, np.float64)
    if lse.shape != ref.shape or np.any(np.isnan(lse)):
        return float("nan")
    fin = np.isfinite(ref)
    if np.any(np.isfinite(lse) != fin) or np.any(lse[~fin] != ref[~fin]):
        return float("inf")
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(lse[fin] - ref[fin]) / np.maximum(1.0, np.abs(ref[fin]))))


def _result(name, mode, errs, tol, **info):
    worst = max(errs.values()) if errs else 0.0
    ok = bool(np.isfinite(worst) and worst < tol)
    return dict(name=name, mode=mode, err=worst, tol=tol, ok=ok, **errs, **info)


# ----------------------------------------------------------------------------
# float64 NumPy references
# ----------------------------------------------------------------------------


def np_attend(q, k, v, valid, scale):
    """q [B, H, d]; k, v [B, n_kv, N, d]; valid [B, n_kv, N] -> out [B,H,d], lse [B,H]."""
    B, H, d = q.shape
    n_kv = k.shape[1]
    G = H // n_kv
    out = np.zeros((B, H, d))
    lse = np.full((B, H), -np.inf)
    for b in range(B):
        for h in range(H):
            kh = h // G
            m = valid[b, kh]
            if not m.any():
                continue
            s = (k[b, kh][m] @ q[b, h]) * scale
            mx = s.max()
            p = np.exp(s - mx)
            out[b, h] = p @ v[b, kh][m] / p.sum()
            lse[b, h] = mx + np.log(p.sum())
    return out, lse


def np_positions(indices, num_valid, page_size, S, lengths=None):
    B, n_kv, K = indices.shape
    N = K * page_size
    pos = np.zeros((B, n_kv, N), np.int64)
    ok = np.zeros((B, n_kv, N), bool)
    for b in range(B):
        lim = S if lengths is None else min(S, int(lengths[b]))
        for h in range(n_kv):
            nv = K if num_valid is None else int(num_valid[b, h])
            for e in range(K):
                for j in range(page_size):
                    p = int(indices[b, h, e]) * page_size + j
                    pos[b, h, e * page_size + j] = min(max(p, 0), S - 1)
                    ok[b, h, e * page_size + j] = e < nv and 0 <= p < lim
    return pos, ok


def np_recompute_kv(x, wk, bk, wv, bv, cos, sin, n_kv):
    """K, V [B, n_kv, T, d] = x @ W + b, RoPE (HF split-half) on K where cos/sin are given."""
    B, T, _ = x.shape
    d = wk.shape[1] // n_kv
    k = (x @ wk + bk).reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
    v = (x @ wv + bv).reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
    if cos is not None:
        c, s = cos[:, None], sin[:, None]
        k1, k2 = k[..., : d // 2], k[..., d // 2:]
        k = np.concatenate([k1 * c - k2 * s, k2 * c + k1 * s], -1)
    return k, v


def np_paged_dense(blocks64, table, num_blocks):
    """float64 pool [E, n_kv, blk, d] + table -> dense [B, n_kv, M*blk, d] and valid mask."""
    E, n_kv, blk, d = blocks64.shape
    B, M = table.shape
    dense = np.zeros((B, n_kv, M * blk, d))
    for b in range(B):
        for j in range(int(num_blocks[b])):
            dense[b, :, j * blk:(j + 1) * blk] = blocks64[int(table[b, j])]
    valid = np.arange(M * blk)[None, None, :] < (np.asarray(num_blocks) * blk)[:, None, None]
    return dense, np.broadcast_to(valid, (B, n_kv, M * blk))


def np_hata_encode(x64, w64):
    proj = x64 @ w64
    bits = (proj > 0).astype(np.uint64)
    r = w64.shape[1]
    bits = bits.reshape(*bits.shape[:-1], r // 32, 32)
    return (bits << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def _np_dequantize(qx) -> np.ndarray:
    """A per-token-group QuantizedInt's values in NumPy float64 of float32 arithmetic: codes * step + min."""
    codes = np.asarray(qx.codes)
    if qx.bits == 4:  # split-half packing: low nibbles the first half of the columns
        codes = np.concatenate([codes & 15, codes >> 4], axis=-1)
    c = codes.astype(np.float32).reshape(*codes.shape[:-1], -1, qx.group_size)
    x = c * np.asarray(qx.step, np.float32)[..., None] + np.asarray(qx.mn, np.float32)[..., None]
    return x.reshape(codes.shape).astype(np.float64)
