"""The selection's top-k in one Pallas kernel: a radix select of each row's k-th largest score and the
order-keeping compaction of the entries above it, both inside one program per row.

Why a kernel: `topk.top_count_ascending`'s XLA radix select needs ~40 kernels (8 rounds of a count, a digit
choice and a prefix update; two running counts; a scatter), and a `clo` layer program at b1 is bound by the
host's per-kernel work (XLA re-records the layer's CUDA graph on every call), so on an H100 it lost to
`jax.lax.top_k` + sort (32.2 vs 29.6 ms per step) although its GPU time is half. Here the whole selection is
one launch.

Per row (one program): keys are the scores as order-preserving uint32 (`topk.orderable_keys`); 32 / 4
rounds each read the row once in chunks and count, for the 15 candidate digits, the keys that share the
prefix found so far with a digit at least as large; the largest digit still holding the wanted count extends
the prefix. Then one more pass writes the index of every key above the threshold, and of the first `take`
keys equal to it, at its running position (a triangular count inside the chunk plus the chunks before), and
zeros past the count. Semantics and output equal `top_count_ascending`'s (ties to the lower index).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import cdiv, load, triton_params

DIGIT_BITS = 4


def _select_kernel(want_ref, keys_ref, idx_ref, *, N, K, chunk, out_chunk):
    # want_ref [1]: this row's count (0 <= want <= K, <= its entries above the floor); keys_ref [N] uint32;
    # idx_ref [K] int32: the selected indices ascending, then 0
    from jax.experimental.pallas import triton as plgpu

    width = 1 << DIGIT_BITS
    want = want_ref[0]
    lanes = jnp.arange(chunk, dtype=jnp.int32)
    cand = jnp.arange(width, dtype=jnp.int32)
    n_chunks = cdiv(N, chunk)

    def keys_at(c):
        pos = c * chunk + lanes
        return pos, load(keys_ref.at[pos], mask=pos < N, other=0)  # key 0: below every selectable one

    prefix = jnp.zeros((), jnp.uint32)
    remaining = jnp.maximum(want, 1)
    for shift in range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        above = shift + DIGIT_BITS

        def count(c, counts, shift=shift, above=above, prefix=prefix):
            _, keys = keys_at(c)
            digit = ((keys >> shift) & (width - 1)).astype(jnp.int32)
            match = ((keys >> above) == (prefix >> above)) if above < 32 else jnp.ones_like(digit, dtype=bool)
            hit = match[None, :] & (digit[None, :] >= cand[:, None])  # [width, chunk]
            return counts + jnp.sum(hit.astype(jnp.int32), axis=1)

        counts = jax.lax.fori_loop(0, n_chunks, count, jnp.zeros((width,), jnp.int32))
        # counts[c] = #(match & digit >= c): the largest c >= 1 still holding `remaining`, else 0
        d = jnp.sum(((counts >= remaining) & (cand >= 1)).astype(jnp.int32))
        higher = jnp.sum(jnp.where(cand == d + 1, counts, 0))
        remaining = remaining - higher
        prefix = prefix | (d.astype(jnp.uint32) << shift)
    threshold, take = prefix, remaining

    # zeros past the count first (the scatter below writes the rest; one program: in order)
    def zero(c, _):
        pos = c * out_chunk + jnp.arange(out_chunk, dtype=jnp.int32)
        plgpu.store(idx_ref.at[pos], jnp.zeros((out_chunk,), jnp.int32), mask=(pos < K) & (pos >= want))
        return 0

    jax.lax.fori_loop(0, cdiv(K, out_chunk), zero, 0)
    lower = lanes[None, :] <= lanes[:, None]  # [chunk, chunk]: j <= i

    def compact(c, carry):
        written, eq_seen = carry
        pos, keys = keys_at(c)
        gt = keys > threshold
        eq = (keys == threshold) & (pos < N)
        eq_rank = eq_seen + jnp.sum((lower & eq[None, :]).astype(jnp.int32), axis=1)  # inclusive
        chosen = (gt | (eq & (eq_rank <= take))) & (want > 0)
        slot = written + jnp.sum((lower & chosen[None, :]).astype(jnp.int32), axis=1) - 1
        # lanes not chosen get distinct slots past the end: masked out on the GPU, and never aliasing a
        # chosen lane's slot (interpret mode writes a masked scatter as read, select, write)
        slot = jnp.where(chosen, slot, K + lanes)
        plgpu.store(idx_ref.at[slot], pos, mask=chosen & (slot < K))
        return written + jnp.sum(chosen.astype(jnp.int32)), eq_seen + jnp.sum(eq.astype(jnp.int32))

    jax.lax.fori_loop(0, n_chunks, compact, (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)))


def select_rows_kernel(keys, want, k, *, chunk=128, out_chunk=128, num_warps=4, interpret=False):
    """(indices [R, k] int32 ascending, then 0) of the want[r] largest keys of each row of keys [R, N]
    (uint32, `topk.orderable_keys`); want [R] int32, each <= k and <= the row's keys above the floor
    (`topk.top_count_ascending` clips it). One program per row."""
    R, N = keys.shape
    kernel = functools.partial(_select_kernel, N=N, K=k, chunk=chunk, out_chunk=out_chunk)
    return pl.pallas_call(
        kernel,
        grid=(R,),
        in_specs=[pl.BlockSpec((1,), lambda r: (r,)), pl.BlockSpec((None, N), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((None, k), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((R, k), jnp.int32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kvo_select_rows",
    )(want.astype(jnp.int32), keys)
