"""x @ w[layer]: a linear layer whose weight is one layer's slice of a stacked [L, K, N] array, read in place.

A decode step run as one program loops over layers (docs/ARCHITECTURE.md "A step in one program"), so each
layer's weight is a dynamic slice of a stacked array. XLA does not fuse that slice into its own b1 matmul
(a reduction fusion): it writes the slice out first, in fp32 for the model's fp32-accumulating `linear`, which
tripled the weights' traffic of a Llama-3-8B step (BENCHMARKS 'Host cost of a decode step'). This kernel takes the
stacked array and the layer index and reads W[layer] by pointer arithmetic, as the row kernels read a pool
extent: only the layer's bytes move, once.

x [M, K] (M tokens: batch x 1 at decode), w [L, K, N], layer int32 scalar (traced: the loop's counter);
result [M, N] in x's dtype, accumulated in fp32 as the model's `linear`. The grid is (row tiles, column tiles,
K splits): a split's partial sum goes to an fp32 [S, M, N] buffer and the S partials are added after, so a
wide-K, narrow-N weight (MLP down: 14336 x 4096) still spreads over enough programs to keep the card's memory
busy. Tiles are powers of two (masked at the edges): rows max(16, next_pow2(M)) up to 64, columns block_n,
K chunks block_k. The summation order differs from XLA's matmul (bits differ in the last place of bf16
results); programs that must agree bit for bit use the same form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import cdiv, dot, load, next_pow2, pallas_call, triton_params

TARGET_PROGRAMS = 512  # ~4 programs per SM of an H100 / H200 (132 SMs): enough to keep HBM busy
# tiles of the few-row linear (`ops.matmul_f32`, one weight, one row): the fastest or within 5% of it
# for Llama-3-8B's q, K|V, gate and down weights in a sweep of block_n x block_k x warps x targets (H200)
FEW_ROWS_TILES = dict(block_n=64, block_k=128, num_warps=4, target_programs=256)


def stacked_linear_reference(x, w, layer, out_dtype=None):
    """Pure-jnp x @ w[layer], fp32 accumulation, in x's dtype (or out_dtype)."""
    y = jnp.einsum("mk,kn->mn", x, w[layer], preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def stacked_linear_tiles(M: int, K: int, N: int, block_n: int = 64, block_k: int = 256,
                         target_programs: int = TARGET_PROGRAMS):
    """(row tile, column tile, K chunk, K splits, K per split) of the kernel for x [M, K] @ w [., K, N]."""
    for v, what in ((block_n, "block_n"), (block_k, "block_k")):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{what} must be a power of two >= 16, got {v}")
    bm = min(64, max(16, next_pow2(M)))
    bn = min(block_n, max(16, next_pow2(N)))
    bk = min(block_k, max(16, next_pow2(K)))
    chunks = cdiv(K, bk)
    tiles = cdiv(M, bm) * cdiv(N, bn)
    splits = max(1, min(chunks, target_programs // max(tiles, 1)))
    per_split = cdiv(chunks, splits)  # chunks a split
    splits = cdiv(chunks, per_split)  # no split left empty
    return bm, bn, bk, splits, per_split


def _kernel(layer_ref, x_ref, w_ref, o_ref, **kw):
    linear_tile(layer_ref, x_ref, w_ref, o_ref, pl.program_id(0), pl.program_id(1), pl.program_id(2), **kw)


def linear_tile(layer_ref, x_ref, w_ref, o_ref, i, j, split, *, M, K, N, bm, bn, bk, per_split):
    """One program's work: row tile i, column tile j, K split `split` (the tiles of `stacked_linear_tiles`).
    layer_ref [1]; x_ref [M, K]; w_ref [L, K, N] (the whole stacked array: addressed, not loaded); o_ref [S, M, N]."""
    from jax.experimental.pallas import triton as plgpu

    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    layer = load(layer_ref.at[jnp.zeros((1,), jnp.int32)])  # [1]
    row_ok, col_ok = rows < M, cols < N
    first = split * per_split * bk

    def chunk(c, acc):
        ks = first + c * bk + jnp.arange(bk, dtype=jnp.int32)
        k_ok = ks < K
        xs = load(x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
        ws = load(w_ref.at[layer[:, None], ks[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :],
                  other=0)
        return acc + dot(xs, ws)

    acc = jax.lax.fori_loop(0, per_split, chunk, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(o_ref.at[split, rows[:, None], cols[None, :]], acc, mask=row_ok[:, None] & col_ok[None, :])


def stacked_linear_kernel(x, w, layer, *, interpret=False, block_n=64, block_k=256, num_warps=4, num_stages=3,
                          poison=False, out_dtype=None, target_programs=TARGET_PROGRAMS):
    """Pallas (Triton) x @ w[layer] reading the slice in place; same result as ``stacked_linear_reference`` up
    to summation order. w may be any memory kind the kernel can address (device memory for weights).
    out_dtype: the result's dtype (x's by default; float32 keeps the sum unrounded, for a bias added after)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [L, K, N] with the same K, got x {x.shape}, w {w.shape}")
    M, K = x.shape
    N = w.shape[2]
    bm, bn, bk, splits, per_split = stacked_linear_tiles(M, K, N, block_n, block_k, target_programs)
    kernel = functools.partial(_kernel, M=M, K=K, N=N, bm=bm, bn=bn, bk=bk, per_split=per_split)
    partial = pallas_call(
        kernel, poison=poison,
        grid=(cdiv(M, bm), cdiv(N, bn), splits),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (0,)),
            pl.BlockSpec((M, K), lambda i, j, s: (0, 0)),
            pl.BlockSpec(w.shape, lambda i, j, s: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((splits, M, N), lambda i, j, s: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, M, N), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvo_stacked_linear",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x, w)
    return jnp.sum(partial, axis=0).astype(out_dtype or x.dtype)
