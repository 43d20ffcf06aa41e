"""What the score kernels share: the GQA group's logits and their reduction (outside a kernel and inside one), a
masked load of a ref's rows as a power-of-two tile, and the valid-position mask of lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import load


def group_logits(q, k, scale):
    """q [B, n_heads, d], k [B, n_kv, S, d] -> scale * q.k [B, n_kv, G, S] in float32, each query head against
    its KV head's keys (the references' exact form)."""
    B, H, d = q.shape
    n_kv = k.shape[1]
    qg = q.reshape(B, n_kv, H // n_kv, d)
    return jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST) * scale


def check_group_reduce(group_reduce):
    if group_reduce not in ("sum", "max", "mean"):
        raise ValueError(f"group_reduce must be sum|max|mean, got {group_reduce!r}")


def reduce_group(s, group_reduce):
    """s [B, n_kv, G, N] -> [B, n_kv, N]."""
    check_group_reduce(group_reduce)
    return {"sum": jnp.sum, "max": jnp.max, "mean": jnp.mean}[group_reduce](s, axis=2)


def reduce_group_rows(s, G, group_reduce):
    """In-kernel twin of reduce_group: reduce the first G rows of a row-padded tile
    s [Gp, N] (rows >= G are padding and ignored) -> [N]."""
    gmask = (jnp.arange(s.shape[0]) < G)[:, None]
    if group_reduce == "max":
        return jnp.max(jnp.where(gmask, s, -jnp.inf), axis=0)
    r = jnp.sum(jnp.where(gmask, s, 0.0), axis=0)
    return r / G if group_reduce == "mean" else r


def load_rows(ref, start, block, row_ok, c, cp, other):
    """Load rows start..start+block (masked by row_ok) of a [N, c] ref as a [block, cp]
    tile (cp = c padded to a power of two; padded columns read as ``other``)."""
    if cp == c:
        return load(ref.at[pl.ds(start, block), :], mask=row_ok[:, None], other=other)
    rows = start + jnp.arange(block, dtype=jnp.int32)
    cols = jnp.arange(cp, dtype=jnp.int32)
    msk = row_ok[:, None] & (cols < c)[None, :]
    return load(ref.at[rows[:, None], cols[None, :]], mask=msk, other=other)


def valid_mask(lengths, N, B):
    """[B, 1 or n_kv, N]: positions < lengths ([B], or per KV head [B, n_kv])."""
    if lengths is None:
        return jnp.ones((B, 1, N), bool)
    lengths = lengths.astype(jnp.int32)
    return jnp.arange(N)[None, None, :] < (lengths[:, :, None] if lengths.ndim == 2 else lengths[:, None, None])
