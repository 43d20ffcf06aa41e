"""Row gather from one block extent: rows x[block, head, offset] -> [B, n_kv, K, d] in device memory.

x [E, n_kv, blk, d] is one extent of the block pool (any memory kind, any dtype: bf16/fp32 K/V, the
uint8 codes and float32 group scales of an int4 extent); block, offset [B, n_kv, K] int32 name, per
(request, KV head), K rows by block id and offset inside the block. A row whose block is outside
[0, E) (or whose offset is outside [0, blk)) comes back as 0: a caller spreading a token space over
several extents gathers from each with ``block - first block id`` and keeps each row from its own.

The kernel gathers by pointer arithmetic, so x may be an array in ``pinned_host`` memory: on the GPU
with JAX's Triton lowering the host pointer reaches the kernel and only the selected rows cross PCIe
(zero-copy, as ``sparse_attention``'s reads), where XLA's own gather of a host operand inside a jit
turns into host compute. Tiles are powers of two (Triton rejects others; interpret mode does not
check): the row tile block_k (16-64 rows, masked past K) by next_pow2(d) columns (masked past d).

A headless extent x [E, blk, d] (an activation extent: one row of H values per token, no heads) takes
block, offset [B, K] and gives [B, K, d]; its wide rows are read in column tiles of HEADLESS_COL_TILE
(the grid's second axis, which walks heads for a K/V extent), so a tile stays block_k x 128 as for K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import cdiv, load, next_pow2, pallas_call, triton_params

DEFAULT_BLOCK_K = 64
HEADLESS_COL_TILE = 128  # columns per program for a headless extent's rows (H values: thousands)


def _rows_ok(block, offset, E, blk):
    return (block >= 0) & (block < E) & (offset >= 0) & (offset < blk)


def _row_index(x, block, offset):
    """x's index of every row (clipped inside x; `_rows_ok` says which rows are really x's)."""
    E, blk = x.shape[0], x.shape[-2]
    if x.ndim == 3:  # headless [E, blk, d]: block, offset [B, K]
        return jnp.clip(block, 0, E - 1), jnp.clip(offset, 0, blk - 1)
    head = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :, None]
    return jnp.clip(block, 0, E - 1), jnp.broadcast_to(head, block.shape), jnp.clip(offset, 0, blk - 1)


def _zero_outside(x, block, offset, rows):
    E, blk = x.shape[0], x.shape[-2]
    return jnp.where(_rows_ok(block, offset, E, blk)[..., None], rows, jnp.zeros((), x.dtype))


def gather_rows_reference(x, block, offset):
    """Pure-jnp gather (x in device memory or, on CPU, anywhere JAX can index it)."""
    return _zero_outside(x, block, offset, x[_row_index(x, block, offset)])


def _gather_kernel(block_ref, offset_ref, x_ref, o_ref, *, E, blk, d, dp, K, block_k, headless=False):
    # block_ref, offset_ref [K] (this (b, h), or this b for a headless extent); x_ref [E, blk, d] (head h,
    # or the whole headless extent: the grid's axis 1 then picks a tile of dp columns); o_ref [K, d]
    from jax.experimental.pallas import triton as plgpu

    rows = pl.program_id(2) * block_k + jnp.arange(block_k, dtype=jnp.int32)
    row_in = rows < K
    blocks = load(block_ref.at[rows], mask=row_in, other=-1)
    offs = load(offset_ref.at[rows], mask=row_in, other=0)
    ok = row_in & _rows_ok(blocks, offs, E, blk)
    cols = (pl.program_id(1) * dp if headless else 0) + jnp.arange(dp, dtype=jnp.int32)
    col_ok = cols < d
    at = (jnp.clip(blocks, 0, E - 1)[:, None], jnp.clip(offs, 0, blk - 1)[:, None], cols[None, :])
    vals = load(x_ref.at[at], mask=ok[:, None] & col_ok[None, :], other=0)
    # rows past K and columns past d are never written (masked); the rest, 0 where the row is not x's
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], vals, mask=row_in[:, None] & col_ok[None, :])


def gather_tiles(K: int, d: int, block_k: int | None = None) -> tuple[int, int]:
    """Power-of-two tiles (rows, padded columns) of the gather kernel for K rows of d columns."""
    block_k = DEFAULT_BLOCK_K if block_k is None else int(block_k)
    if block_k < 1 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two, got {block_k}")
    return min(block_k, max(16, next_pow2(K))), max(16, next_pow2(d))


def gather_rows_kernel(x, block, offset, *, interpret=False, block_k=None, num_warps=4, num_stages=1,
                       poison=False):
    """Pallas (Triton) gather; same semantics as ``gather_rows_reference``. Returns device memory."""
    if x.ndim == 3:
        return _gather_rows_headless_kernel(x, block, offset, interpret=interpret, block_k=block_k,
                                            num_warps=num_warps, num_stages=num_stages, poison=poison)
    E, n_kv, blk, d = x.shape
    B, n_kv_i, K = block.shape
    if n_kv_i != n_kv or offset.shape != block.shape:
        raise ValueError(f"block {block.shape} and offset {offset.shape} must be [B, n_kv={n_kv}, K]")
    block_k, dp = gather_tiles(K, d, block_k)
    kernel = functools.partial(_gather_kernel, E=E, blk=blk, d=d, dp=dp, K=K, block_k=block_k)
    return pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, cdiv(K, block_k)),
        in_specs=[
            pl.BlockSpec((None, None, K), lambda b, h, t: (b, h, 0)),
            pl.BlockSpec((None, None, K), lambda b, h, t: (b, h, 0)),
            pl.BlockSpec((E, None, blk, d), lambda b, h, t: (0, h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, K, d), lambda b, h, t: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, n_kv, K, d), x.dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvo_gather_rows",
    )(block.astype(jnp.int32), offset.astype(jnp.int32), x)


def _gather_rows_headless_kernel(x, block, offset, *, interpret, block_k, num_warps, num_stages, poison):
    """The gather of a headless extent x [E, blk, d] (block, offset [B, K] -> [B, K, d]): the same kernel
    with the grid's axis 1 over column tiles of HEADLESS_COL_TILE instead of heads."""
    E, blk, d = x.shape
    B, K = block.shape
    if offset.shape != block.shape:
        raise ValueError(f"block {block.shape} and offset {offset.shape} must both be [B, K]")
    block_k, _ = gather_tiles(K, d, block_k)
    dc = min(HEADLESS_COL_TILE, max(16, next_pow2(d)))
    kernel = functools.partial(_gather_kernel, E=E, blk=blk, d=d, dp=dc, K=K, block_k=block_k, headless=True)
    return pallas_call(
        kernel, poison=poison,
        grid=(B, cdiv(d, dc), cdiv(K, block_k)),
        in_specs=[
            pl.BlockSpec((None, K), lambda b, c, t: (b, 0)),
            pl.BlockSpec((None, K), lambda b, c, t: (b, 0)),
            pl.BlockSpec((E, blk, d), lambda b, c, t: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, K, d), lambda b, c, t: (b, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, d), x.dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvo_gather_rows_headless",
    )(block.astype(jnp.int32), offset.astype(jnp.int32), x)


def gather_rows_reference_host(x, block, offset):
    """``gather_rows_reference`` of an x in host memory inside a jit: XLA requires the indices in the
    operand's memory space, so they move to the host, XLA gathers there and only the rows move to
    the device. On a GPU XLA runs that gather as host (CPU) compute: slow, the fallback only."""
    at = jax.device_put(_row_index(x, block, offset), jax.memory.Space.Host)
    return _zero_outside(x, block, offset, jax.device_put(x[at], jax.memory.Space.Device))


# ---------------------------------------------------------------------------------------------
# refill: a row buffer's rows replaced in place by rows of a token space spread over extents
# ---------------------------------------------------------------------------------------------


def refill_rows_reference(buf, extents, tokens, blk: int, row_offset=None):
    """Pure-jnp refill of a row buffer (the kernel's semantics).

    buf [B, n_kv, K, d]; extents: per extent [E_e, n_kv, blk, d], consecutive in block-id order (extent e's
    first block id is the sum of the earlier ones' E); tokens [B, n_kv, K] int32: pool token ids (block id *
    blk + offset), -1 where the row keeps its value. Row (b, h, i) of the result is the token's row from its
    extent, buf's where tokens[b, h, i] < 0 (or past the last extent).

    row_offset ([] int32, traced): buf is [B, n_kv, R, d] holding several layers' buffers along its rows (a step
    looping over stacked layers), and tokens' row i goes to buf row row_offset + i (rows [row_offset,
    row_offset + K) must lie inside R); every other row is kept."""
    if row_offset is not None:
        K = tokens.shape[-1]
        part = jax.lax.dynamic_slice_in_dim(buf, row_offset, K, axis=2)
        return jax.lax.dynamic_update_slice_in_dim(buf, refill_rows_reference(part, extents, tokens, blk),
                                                   row_offset, axis=2)
    block, off = tokens // blk, tokens % blk
    out, start = buf, 0
    for x in extents:
        E = x.shape[0]
        inside = (tokens >= 0) & (block >= start) & (block < start + E)
        rows = gather_rows_reference(x, jnp.where(inside, block - start, -1), off)
        out = jnp.where(inside[..., None], rows.astype(buf.dtype), out)
        start += E
    return out


def _refill_tile(tok_ref, blk, K, block_k):
    """This program's rows of a refill, whether each is written (a token >= 0) and its block and offset."""
    rows = pl.program_id(2) * block_k + jnp.arange(block_k, dtype=jnp.int32)
    row_in = rows < K
    toks = load(tok_ref.at[rows], mask=row_in, other=-1)
    return rows, row_in & (toks >= 0), toks // blk, toks % blk


def _out_rows(refs, rows, offset: bool):
    """The output rows a refill program writes: rows, or rows + the row offset (the ref before buf's input)."""
    return rows + refs[-3][0] if offset else rows


def _refill_kernel(tok_ref, *refs, sizes, blk, d, dp, K, block_k, offset=False):
    # tok_ref [K] (this (b, h)); refs: the extents' refs [E_e, blk, d] (head h), with a row offset its ref [1],
    # buf's input ref (aliased to the output: never read, so a row the kernel does not store keeps its value),
    # o_ref [R, d] (R = K without an offset)
    from jax.experimental.pallas import triton as plgpu

    x_refs, o_ref = refs[:len(sizes)], refs[-1]
    rows, write, block, off = _refill_tile(tok_ref, blk, K, block_k)
    cols = jnp.arange(dp, dtype=jnp.int32)
    col_ok = cols < d
    vals = jnp.zeros((block_k, dp), o_ref.dtype)
    start = 0
    for x_ref, E in zip(x_refs, sizes):  # each row is read from the one extent that holds it (masked loads)
        ok = write & (block >= start) & (block < start + E)
        at = (jnp.clip(block - start, 0, E - 1)[:, None], jnp.clip(off, 0, blk - 1)[:, None], cols[None, :])
        got = load(x_ref.at[at], mask=ok[:, None] & col_ok[None, :], other=0)
        vals = jnp.where(ok[:, None], got.astype(o_ref.dtype), vals)
        start += E
    write = write & (block < start)
    out = _out_rows(refs, rows, offset)
    plgpu.store(o_ref.at[out[:, None], cols[None, :]], vals, mask=write[:, None] & col_ok[None, :])


def refill_rows_kernel(buf, extents, tokens, blk: int, *, interpret=False, block_k=None, num_warps=4, num_stages=1,
                       row_offset=None):
    """Pallas (Triton) refill, ``refill_rows_reference``'s semantics, writing buf in place (aliased: under a jit
    that donates buf no copy is made; otherwise XLA copies buf first). Extents may be in pinned_host memory
    (read in place, only the rows written cross PCIe) or device memory, in buf's dtype or another native one.
    One program per (request, head, tile of block_k rows); a tile of a head that keeps every row (a cache hit:
    tokens all -1) loads its tokens and stores nothing. row_offset: as in the reference (buf [B, n_kv, R, d],
    tokens' row i written to buf row row_offset + i, in place; the other rows untouched)."""
    B, n_kv, K, d = _refill_shapes(buf, tokens, row_offset)
    for x in extents:
        if x.ndim != 4 or x.shape[1] != n_kv or x.shape[2] != blk or x.shape[3] != d:
            raise ValueError(f"extent {x.shape} must be [E, n_kv={n_kv}, blk={blk}, d={d}]")
    block_k, dp = gather_tiles(K, d, block_k)
    sizes = tuple(int(x.shape[0]) for x in extents)
    kernel = functools.partial(_refill_kernel, sizes=sizes, blk=blk, d=d, dp=dp, K=K, block_k=block_k,
                               offset=row_offset is not None)
    return _refill_call(kernel, buf, tokens, list(extents), blk, block_k, "kvo_refill_rows", interpret=interpret,
                        num_warps=num_warps, num_stages=num_stages, row_offset=row_offset)


def _refill_shapes(buf, tokens, row_offset):
    """(B, n_kv, K, d) of a refill, checking tokens [B, n_kv, K] against buf [B, n_kv, K (R with an offset), d]."""
    B, n_kv, R, d = buf.shape
    K = tokens.shape[-1] if row_offset is not None else R
    if tokens.shape != (B, n_kv, K) or K > R:
        raise ValueError(f"tokens {tokens.shape} must be [B, n_kv, K] = {(B, n_kv, K)}"
                         + (f" with K <= the buffer's {R} rows" if row_offset is not None else ""))
    return B, n_kv, K, d


def _refill_call(kernel, buf, tokens, arrays, blk, block_k, name, row_offset=None, **kw):
    """A refill kernel's call: one program per (request, head, tile of block_k rows), each array [E, n_kv, blk, c]
    seen as its head's [E, blk, c], buf aliased to the output (written in place where the caller donates it);
    with a row offset, its [1] array before buf."""
    B, n_kv, R, d = buf.shape
    K = tokens.shape[-1]
    extra = [] if row_offset is None else [jnp.reshape(row_offset, (1,)).astype(jnp.int32)]
    return pallas_call(
        kernel,
        grid=(B, n_kv, cdiv(K, block_k)),
        in_specs=[pl.BlockSpec((None, None, K), lambda b, h, t: (b, h, 0))]
        + [pl.BlockSpec((a.shape[0], None, blk, a.shape[-1]), lambda b, h, t: (0, h, 0, 0)) for a in arrays]
        + [pl.BlockSpec((1,), lambda b, h, t: (0,)) for _ in extra]
        + [pl.BlockSpec((None, None, R, d), lambda b, h, t: (b, h, 0, 0))],
        out_specs=pl.BlockSpec((None, None, R, d), lambda b, h, t: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(buf.shape, buf.dtype),
        input_output_aliases={1 + len(arrays) + len(extra): 0},
        compiler_params=triton_params(num_warps=kw["num_warps"], num_stages=kw["num_stages"]),
        interpret=kw["interpret"],
        name=name,
    )(tokens.astype(jnp.int32), *arrays, *extra, buf)


def _refill_int_kernel(tok_ref, *refs, sizes, blk, d, width, K, block_k, bits, group_size, offset=False):
    # tok_ref [K] (this (b, h)); refs: per extent its codes [E_e, blk, d or d / 2], step and min [E_e, blk, G] refs
    # (head h), buf's input ref (aliased, never read), o_ref [K, d]. A row's value is codes * step + min of its
    # group (`quant.dequantize`), in float32, cast to the buffer's dtype. Each row's bytes are read once: its
    # codes as one tile of `width` columns (int4: the packed half, whose low nibbles are columns [0, d / 2) and
    # high nibbles [d / 2, d), stored as two tiles) and its G steps and mins as G vectors
    from jax.experimental.pallas import triton as plgpu

    x_refs, o_ref = refs[:3 * len(sizes)], refs[-1]
    rows, write, block, off = _refill_tile(tok_ref, blk, K, block_k)
    cols = jnp.arange(width, dtype=jnp.int32)
    n_codes = d // 2 if bits == 4 else d
    code_ok = cols < n_codes
    parts = ((0, lambda c: c & 15), (d // 2, lambda c: c >> 4)) if bits == 4 else ((0, lambda c: c),)
    groups = [(cols + first) // group_size for first, _ in parts]  # each output column's group
    vals = [jnp.zeros((block_k, width), jnp.float32) for _ in parts]
    start = 0
    for e, E in enumerate(sizes):  # each row is read from the one extent that holds it (masked loads)
        codes_ref, step_ref, min_ref = x_refs[3 * e: 3 * e + 3]
        ok = write & (block >= start) & (block < start + E)
        b_, o_ = jnp.clip(block - start, 0, E - 1), jnp.clip(off, 0, blk - 1)
        codes = load(codes_ref.at[b_[:, None], o_[:, None], cols[None, :]], mask=ok[:, None] & code_ok[None, :],
                     other=0)
        steps = [load(step_ref.at[b_, o_, g], mask=ok, other=0.0) for g in range(d // group_size)]
        mins = [load(min_ref.at[b_, o_, g], mask=ok, other=0.0) for g in range(d // group_size)]
        for i, (_, nibble) in enumerate(parts):
            step, mn = steps[0][:, None], mins[0][:, None]
            for g in range(1, d // group_size):  # each column's group's step and min
                at_g = groups[i][None, :] == g
                step, mn = jnp.where(at_g, steps[g][:, None], step), jnp.where(at_g, mins[g][:, None], mn)
            got = nibble(codes).astype(jnp.float32) * step + mn
            vals[i] = jnp.where(ok[:, None], got, vals[i])
        start += E
    write = write & (block < start)
    out = _out_rows(refs, rows, offset)
    for (first, _), v in zip(parts, vals):
        plgpu.store(o_ref.at[out[:, None], (cols + first)[None, :]], v.astype(o_ref.dtype),
                    mask=write[:, None] & code_ok[None, :])


def refill_rows_int_kernel(buf, extents, tokens, blk: int, *, interpret=False, block_k=None, num_warps=4,
                           num_stages=1, row_offset=None):
    """``refill_rows_kernel`` for group-quantized extents (``QuantizedInt``, int4 or int8 codes, per-token group
    scales): one kernel reads a replaced row's codes, step and min from the extent that holds it (pinned_host:
    in place), dequantizes them and writes the row into buf in place; a kept row (token -1) is neither read nor
    written. Where int rows were gathered per array and extent, dequantized whole and merged with a ``where``
    over the buffer (the reference, ``ops.refill_block_rows`` with impl="reference"), this moves the same bytes
    over PCIe and touches only the replaced rows in GPU memory. row_offset: as ``refill_rows_kernel``'s."""
    B, n_kv, K, d = _refill_shapes(buf, tokens, row_offset)
    bits, gs = extents[0].bits, extents[0].group_size
    for x in extents:
        if x.scales != "token" or (x.bits, x.group_size) != (bits, gs):
            raise ValueError("refill_rows_int_kernel takes extents of one form with per-token group scales, got "
                             f"{[(x.bits, x.group_size, x.scales) for x in extents]}")
        if x.codes.ndim != 4 or x.codes.shape[1:3] != (n_kv, blk) or x.shape[-1] != d:
            raise ValueError(f"extent {x.shape} must be [E, n_kv={n_kv}, blk={blk}, d={d}]")
    block_k, width = gather_tiles(K, d // 2 if bits == 4 else d, block_k)
    sizes = tuple(int(x.codes.shape[0]) for x in extents)
    kernel = functools.partial(_refill_int_kernel, sizes=sizes, blk=blk, d=d, width=width, K=K, block_k=block_k,
                               bits=bits, group_size=gs, offset=row_offset is not None)
    arrays = [a for x in extents for a in (x.codes, x.step, x.mn)]
    return _refill_call(kernel, buf, tokens, arrays, blk, block_k, "kvo_refill_rows_int", interpret=interpret,
                        num_warps=num_warps, num_stages=num_stages, row_offset=row_offset)
