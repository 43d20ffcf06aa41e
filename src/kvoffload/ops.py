"""Public jit-able building blocks of kvoffload.

Every op takes ``impl="auto" | "kernel" | "reference"``: "auto" runs the Pallas
(Triton) kernel on GPU when the shapes are supported and the pure-jnp reference
otherwise (CPU, TPU, unsupported shapes); "kernel" forces the Pallas kernel (with
``interpret=True`` it runs anywhere, for tests); "reference" forces the reference.
All functions can be called inside ``jax.jit``.

Conventions
-----------
* KV cache layout: k, v [B, n_kv, S, d]. Query heads n_heads = n_kv * group; query
  head h uses kv head h // group (HF GQA convention).
* Attention returns (out [B, n_heads, d] in q.dtype, lse [B, n_heads] float32); an
  empty key set gives out = 0, lse = -inf. ``merge_attention`` combines partial
  results over disjoint key sets exactly (never concatenate K/V copies).
* Paged K/V: an extent of E token blocks, k_blocks, v_blocks [E, n_kv, blk, d]; row b owns
  the blocks block_table[b, :num_blocks[b]] in sequence order (``paged_decode_attention``).
  Results over several extents fold left to right into an fp32 accumulator that starts as
  ``empty_attention(q)``, with ``merge_attention_into`` (exact no-op for an empty part).
* Top-k: score functions return [B, n_kv, N] float32 (higher = better, -inf invalid);
  ``select_topk`` returns (indices [B, n_kv, K] int32, num_valid [B, n_kv] int32)
  for ``sparse_attention``.
* HATA packed sign codes: r bits (r % 32 == 0) packed into uint32 words, code shape
  [..., r // 32]; bit j = 1 where (x @ W)_j > 0, stored in word j // 32 at bit
  position j % 32 (LSB first): word_w = sum_i bit_{32w+i} << i. ``hata_encode``
  writes this format; codes produced elsewhere (the HATA trainer) must match it.
* Row gather: ``gather_block_rows(x, block, offset)`` takes rows x[block, head, offset] of one extent
  x [E, n_kv, blk, d] (device or host memory) into [B, n_kv, K, d] device memory; 0 where block is
  outside [0, E). A headless extent x [E, blk, H] (activations) takes block, offset [B, K] -> [B, K, H].
* int4: group-wise asymmetric (FlexGen) along the last dim, group 64 by default, or per channel over
  axis -2 (``scales="channel"``: a K block's tokens, KIVI); packed split-half: byte j = code[j] | code[j + D//2] << 4. See ``quantize_int4``.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import jax
import jax.numpy as jnp

from kvoffload.device import sharding as _sh
from kvoffload.pallas import common as _c
from kvoffload.pallas import decode_attention as _da
from kvoffload.pallas import gather as _ga
from kvoffload.pallas import paged_attention as _pa
from kvoffload.pallas import prefill_attention as _pf
from kvoffload.pallas import quant as _q
from kvoffload.pallas import recompute as _rc
from kvoffload.pallas import sparse_attention as _sa
from kvoffload.pallas import stacked_linear as _sl
from kvoffload.pallas import topk as _tk
from kvoffload.pallas.decode_attention import merge_attention  # noqa: F401  (public)
from kvoffload.pallas.quant import SCALES as INT4_SCALES  # noqa: F401  (public)
from kvoffload.pallas.quant import (  # noqa: F401  (public)
    QuantizedInt,
    dequantize,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from kvoffload.pallas.topk import (  # noqa: F401  (public)
    TOPK_METHODS,
    hamming_distance,
    hata_encode,
    quest_page_minmax,
)

__all__ = [
    "decode_attention", "merge_attention", "paged_decode_attention", "merge_attention_into",
    "empty_attention", "sparse_attention", "sparse_attention_path", "prefill_attention_chunk_kernel",
    "prefill_attention_chunk_cudnn", "PREFILL_IMPLS",
    "recompute_kv", "topk_scores_exact", "quest_page_minmax", "quest_page_scores", "quest_block_bounds",
    "hata_encode", "hata_scores", "hamming_distance", "tokenselect_scores", "select_topk", "TOPK_METHODS",
    "topk_indices", "quantize_int4", "quantize_int8", "dequantize", "pack_int4", "unpack_int4",
    "QuantizedInt", "INT4_SCALES", "decode_attention_int4", "kernel_default", "gather_block_rows",
    "gather_pool_rows", "refill_block_rows",
    "gather_block_rows_path", "zero_copy_gather_supported", "IMPLS", "use_kernel",
]

IMPLS = ("auto", "kernel", "reference")
# refill_block_rows' dequantizing kernel for int4 / int8 extents under impl="auto" on a GPU: on (it matched its
# reference on an H200, check_kernels' "refill ... int4 / int8 host" cases, and took a 128K clo step with int8 K /
# int4 V rows from 1.23-1.24x `full` to 1.15-1.16x: BENCHMARKS 'clo at 128K b1'). KVOFFLOAD_INT_REFILL_KERNEL=0
# turns it off (the gathers + dequantize + where it replaced), to time one against the other.
INT_REFILL_KERNEL = os.environ.get("KVOFFLOAD_INT_REFILL_KERNEL", "1") != "0"
# a prefill chunk's attention also has cuDNN's flash attention ("auto" on a GPU, for 16-bit inputs)
PREFILL_IMPLS = ("auto", "cudnn", "kernel", "reference")
RECOMPUTE_KERNEL_MIN_TOKENS = 64  # tokens per sequence below which "auto" recompute uses XLA


def kernel_default() -> bool:
    """Whether impl="auto" picks the Pallas kernels here (True on GPU)."""
    return _c.on_gpu()


def use_kernel(impl: str, supported: bool = True) -> bool:
    """Whether impl ("auto", "kernel", "reference") runs the Pallas kernel here: "auto" where supported on a GPU."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    if impl == "kernel":
        return True
    return supported and _c.on_gpu()


# ----------------------------------------------------------------------------
# a linear layer's weight read from a stacked [L, K, N] array by layer index
# ----------------------------------------------------------------------------


def stacked_linear(x, w, layer, *, impl="auto", interpret=False, out_dtype=None):
    """x [..., K] @ w[layer] for w [L, K, N] and a (traced) layer index, fp32 accumulation, in x's dtype (or
    out_dtype). The kernel reads the layer's slice in place (`pallas.stacked_linear`): inside a loop over
    stacked layers XLA would write the slice out before its own matmul. The reference is that XLA form. One
    device only (a weight sharded over a mesh is not read by index here)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    layer = jnp.asarray(layer, jnp.int32)
    if use_kernel(impl):
        tiles = _sl.FEW_ROWS_TILES if x2.shape[0] <= FEW_ROWS_MAX else {}  # a decode step's: matmul_f32's tiles
        y = _sl.stacked_linear_kernel(x2, w, layer, interpret=interpret, out_dtype=out_dtype, **tiles)
    else:
        y = _sl.stacked_linear_reference(x2, w, layer, out_dtype=out_dtype)
    return y.reshape(*lead, w.shape[-1])


# A decode step's linears multiply batch x 1 rows by the whole weight: reading the weight is the work. XLA's
# fp32-result matmul streams a b1 weight at 2.4 TB/s (Llama-3-8B gate / up, H200) and a narrow one (W_K, W_V:
# N 1024) at 0.5; the stacked-linear kernel over the weight as a one-layer stack (FEW_ROWS_TILES) at 3.3-3.5
# and 2.3 TB/s (BENCHMARKS 'Kernel timings'). One row is XLA's weak case
# (a matrix-vector product); from 8 rows its GEMM is as fast or faster (8 rows: K|V 5.2 against 8.3 us, q 10.9
# against 12.3; 64 rows: q 14.1 against 18.2), so "auto" takes the kernel up to FEW_ROWS_MAX rows.
FEW_ROWS_MAX = 1


def _few_rows_ok(x, w) -> bool:
    return (w.ndim == 2 and math.prod(x.shape[:-1]) <= FEW_ROWS_MAX and x.dtype == w.dtype
            and x.dtype in (jnp.bfloat16, jnp.float16) and _sh.context_size() == 1)


def _matmul_f32_reference(x, w):
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)


# the kernel has no autodiff rule: a gradient through a few-row linear (a short training sequence on the GPU) is
# the reference's
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_f32_kernel(x, w, interpret):
    return stacked_linear(x, w[None], 0, impl="kernel", interpret=interpret, out_dtype=jnp.float32)


def _matmul_f32_kernel_fwd(x, w, interpret):
    return _matmul_f32_kernel(x, w, interpret), (x, w)


def _matmul_f32_kernel_bwd(interpret, residuals, cotangent):
    _, vjp = jax.vjp(_matmul_f32_reference, *residuals)
    return vjp(cotangent)


_matmul_f32_kernel.defvjp(_matmul_f32_kernel_fwd, _matmul_f32_kernel_bwd)


def matmul_f32(x, w, *, impl="auto", interpret=False):
    """x [..., K] @ w [K, N] accumulated and returned in fp32: a model's linear layers and its logits. "auto" on a
    GPU takes the stacked-linear kernel for up to FEW_ROWS_MAX rows of a 16-bit x and w on one device (a decode
    step; under a tensor-parallel mesh XLA partitions its own matmul), XLA's einsum elsewhere. The two sum in
    different orders: the last bits of a bf16 result can differ, so every policy goes through this one function.
    w may be a layer's weight inside a stacked array (`models.common.LayerSlice`: `stacked`, `index`), read in
    place by `stacked_linear` with the same tiles, so a loop over stacked layers gives the layer calls' bits."""
    if hasattr(w, "stacked"):
        return stacked_linear(x, w.stacked, w.index, impl=impl, interpret=interpret, out_dtype=jnp.float32)
    if use_kernel(impl, _few_rows_ok(x, w)):
        return _matmul_f32_kernel(x, w, interpret)
    return _matmul_f32_reference(x, w)


# ----------------------------------------------------------------------------
# decode attention
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_s", "num_splits"))
def _decode_kernel_jit(q, k, v, lengths, scale, interpret, block_s=None, num_splits=None, start=None):
    return _da.decode_attention_kernel(q, k, v, lengths, scale=scale, interpret=interpret,
                                       block_s=block_s, num_splits=num_splits, start=start)


@functools.partial(jax.jit, static_argnames=("scale",))
def _decode_ref_jit(q, k, v, lengths, scale, start=None):
    return _da.decode_attention_reference(q, k, v, lengths, scale=scale, start=start)


def decode_attention(q, k, v, lengths, *, start=None, scale=None, impl="auto", interpret=False):
    """Decode attention of one query token per sequence over a KV cache.

    q [B, n_heads, d]; k, v [B, n_kv, S, d]; lengths [B] int32 (keys at positions
    < lengths[b] are valid; 0 allowed -> out 0, lse -inf); start [B] int32 or None: keys at positions
    < start[b] are masked too (a sliding window's; any value, negative or past lengths[b]). scale defaults
    to d**-0.5. Returns (out [B, n_heads, d] in q.dtype, lse [B, n_heads] float32).
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    start = None if start is None else jnp.asarray(start, jnp.int32)
    scale = None if scale is None else float(scale)
    if use_kernel(impl):  # per device on its heads under a tensor-parallel mesh (XLA cannot split a kernel)
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        if start is None:
            return _sh.per_shard(lambda q_, k_, v_, n_: _decode_kernel_jit(q_, k_, v_, n_, scale, interpret),
                                 (heads, heads, heads, rep), (heads, heads))(q, k, v, lengths)
        return _sh.per_shard(lambda q_, k_, v_, n_, s_: _decode_kernel_jit(q_, k_, v_, n_, scale, interpret,
                                                                           start=s_),
                             (heads, heads, heads, rep, rep), (heads, heads))(q, k, v, lengths, start)
    return _decode_ref_jit(q, k, v, lengths, scale, start)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _prefill_kernel_jit(q, k, v, q_start, lengths, scale, interpret):
    return _pf.prefill_attention_chunk_kernel(q, k, v, q_start, lengths, scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale",))
def _prefill_cudnn_jit(q, k, v, q_start, lengths, scale):
    return _pf.prefill_attention_chunk_cudnn(q, k, v, q_start, lengths, scale=scale)


def _prefill_chunk_per_head(run, q, k, v, q_start, lengths):
    """run(q, k, v, q_start, lengths) of a prefill chunk, per device on its heads under a tensor-parallel mesh."""
    heads, rep = _sh.KV_SPEC, _sh.REPLICATED
    return _sh.per_shard(run, (heads, heads, heads, rep, rep), heads)(q, k, v, jnp.asarray(q_start, jnp.int32),
                                                                      jnp.asarray(lengths, jnp.int32))


def prefill_attention_chunk_cudnn(q, k, v, q_start, lengths, *, scale=None):
    """cuDNN flash attention of a prefill chunk (`pallas.prefill_attention.prefill_attention_chunk_cudnn`):
    per device on its heads under a tensor-parallel mesh."""
    scale = None if scale is None else float(scale)
    return _prefill_chunk_per_head(lambda *a: _prefill_cudnn_jit(*a, scale), q, k, v, q_start, lengths)


def prefill_attention_chunk_kernel(q, k, v, q_start, lengths, *, scale=None):
    """The Pallas flash attention of a prefill chunk (`models.common.prefill_attention_chunk`'s kernel):
    per device on its heads under a tensor-parallel mesh; interpret mode off the GPU."""
    scale = None if scale is None else float(scale)
    interpret = not _c.on_gpu()
    return _prefill_chunk_per_head(lambda *a: _prefill_kernel_jit(*a, scale, interpret), q, k, v, q_start, lengths)


# ----------------------------------------------------------------------------
# paged decode attention and the fp32 accumulator merge
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _paged_kernel_jit(q, k_blocks, v_blocks, block_table, num_blocks, scale, interpret, first_pos=None, start=None):
    return _pa.paged_decode_attention_kernel(q, k_blocks, v_blocks, block_table, num_blocks,
                                             scale=scale, interpret=interpret, first_pos=first_pos, start=start)


@functools.partial(jax.jit, static_argnames=("scale",))
def _paged_ref_jit(q, k_blocks, v_blocks, block_table, num_blocks, scale, first_pos=None, start=None):
    return _pa.paged_decode_attention_reference(q, k_blocks, v_blocks, block_table, num_blocks,
                                                scale=scale, first_pos=first_pos, start=start)


def window_block_table(block_table, num_blocks, first_pos, start, blk: int):
    """(table, count) without each row's leading blocks that end before start[b] (a sliding window's first
    position): a row's blocks are in position order, so those are a prefix; the rest move to the front."""
    m = block_table.shape[1]
    j = jnp.arange(m, dtype=jnp.int32)[None]
    ends = first_pos[jnp.clip(block_table, 0, first_pos.shape[0] - 1)] + blk  # [B, M] one past each block
    gone = jnp.sum((j < num_blocks[:, None]) & (ends <= start[:, None]), axis=1).astype(jnp.int32)
    table = jnp.take_along_axis(block_table, jnp.clip(j + gone[:, None], 0, m - 1), axis=1)
    return table, num_blocks - gone


def paged_decode_attention(q, k_blocks, v_blocks, block_table, num_blocks, *, first_pos=None, start=None,
                           scale=None, impl="auto", interpret=False):
    """Decode attention over K/V kept in fixed-size token blocks of one extent.

    q [B, n_heads, d]; k_blocks, v_blocks [E, n_kv, blk, d]; block_table [B, M] int32 of block
    indices into the first axis of k_blocks; num_blocks [B] int32 in [0, M]: row b attends the
    blocks block_table[b, :num_blocks[b]] (every listed block holds blk valid keys; the other
    entries are never read). A sliding window: first_pos [E] int32 (each block's first token position) and
    start [B] int32: keys at positions < start[b] are masked (a row's blocks must then be in position order:
    the blocks wholly before start are dropped from its table first, `window_block_table`, so the kernel
    walks the window's blocks only). scale defaults to d**-0.5. Returns (out [B, n_heads, d] in q.dtype,
    lse [B, n_heads] float32); num_blocks[b] == 0 gives out 0, lse -inf.
    """
    block_table = jnp.asarray(block_table, jnp.int32)
    num_blocks = jnp.asarray(num_blocks, jnp.int32)
    scale = None if scale is None else float(scale)
    window = ()
    if start is not None:
        first_pos, start = jnp.asarray(first_pos, jnp.int32), jnp.asarray(start, jnp.int32)
        if block_table.shape[1]:
            block_table, num_blocks = window_block_table(block_table, num_blocks, first_pos, start,
                                                         k_blocks.shape[2])
        window = (first_pos, start)
    if use_kernel(impl):  # per device on its heads under a tensor-parallel mesh
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        if not window:
            return _sh.per_shard(lambda q_, k_, v_, t_, n_: _paged_kernel_jit(q_, k_, v_, t_, n_, scale, interpret),
                                 (heads, heads, heads, rep, rep), (heads, heads))(q, k_blocks, v_blocks, block_table,
                                                                                   num_blocks)
        return _sh.per_shard(lambda q_, k_, v_, t_, n_, f_, s_: _paged_kernel_jit(q_, k_, v_, t_, n_, scale, interpret,
                                                                                  f_, s_),
                             (heads, heads, heads, rep, rep, rep, rep), (heads, heads))(
            q, k_blocks, v_blocks, block_table, num_blocks, *window)
    return _paged_ref_jit(q, k_blocks, v_blocks, block_table, num_blocks, scale, *window)


def join_block_tables(tables, counts, sizes):
    """One block table over extents laid end to end: extent e's blocks [E_e, ...] concatenated on axis 0 in
    order (sizes: the E_e). tables [B, M_e], counts [B] per extent (row b attends tables[e][b, :counts[e][b]]).
    Returns (table [B, sum M_e], count [B]): row b's blocks of extent 0, then extent 1, ..., indices offset into
    the joined blocks, packed at the front (paged_decode_attention reads a row's first count entries; the
    rest are 0, never read). One paged attention over the joined extents then attends what one call per
    extent did, in the same block order."""
    if len(tables) == 1:
        return jnp.asarray(tables[0], jnp.int32), jnp.asarray(counts[0], jnp.int32)
    offsets = [0]
    for e in sizes[:-1]:
        offsets.append(offsets[-1] + int(e))
    tables = [jnp.asarray(t, jnp.int32) for t in tables]
    counts = [jnp.clip(jnp.asarray(c, jnp.int32), 0, t.shape[1]) for c, t in zip(counts, tables)]
    rows = tables[0].shape[0]
    width = sum(t.shape[1] for t in tables)
    start = jnp.zeros((rows,), jnp.int32)
    values, dest = [], []
    for t, c, off in zip(tables, counts, offsets):
        j = jnp.arange(t.shape[1], dtype=jnp.int32)[None]
        values.append(t + off)
        dest.append(jnp.where(j < c[:, None], start[:, None] + j, width))  # past the end: dropped
        start = start + c
    joined = jnp.zeros((rows, width), jnp.int32).at[jnp.arange(rows)[:, None], jnp.concatenate(dest, 1)].set(
        jnp.concatenate(values, 1), mode="drop")
    return joined, start


merge_attention_into = jax.jit(_pa.merge_attention_into)
empty_attention = jax.jit(_pa.empty_attention)


# ----------------------------------------------------------------------------
# sparse attention
# ----------------------------------------------------------------------------

_LAST_SPARSE_PATH = {"path": None}


def sparse_attention_path():
    """Which path the last eager ``sparse_attention`` call took:
    'kernel_zero_copy' (Pallas kernel reading K/V in pinned_host memory directly),
    'kernel' (Pallas kernel, K/V in device memory), 'reference',
    'reference_device_copy' (K/V were in host memory and copied to the device first),
    'traced' (called under jit: kernel/reference chosen by platform), or None."""
    return _LAST_SPARSE_PATH["path"]


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "interpret"))
def _sparse_kernel_jit(q, k, v, indices, num_valid, lengths, page_size, scale, interpret):
    return _sa.sparse_attention_kernel(q, k, v, indices, num_valid=num_valid,
                                       page_size=page_size, scale=scale, lengths=lengths,
                                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=("page_size", "scale"))
def _sparse_ref_jit(q, k, v, indices, num_valid, lengths, page_size, scale):
    return _sa.sparse_attention_reference(q, k, v, indices, num_valid=num_valid,
                                          page_size=page_size, scale=scale, lengths=lengths)


# whether the zero-copy (pinned_host -> Triton kernel) path works here; None = untested
_ZERO_COPY_OK = {"ok": None}


def sparse_attention(q, k, v, indices, *, num_valid=None, page_size=1, scale=None,
                     lengths=None, impl="auto", interpret=False):
    """Attention over selected positions / pages only.

    q [B, n_heads, d]; k, v [B, n_kv, S, d]; indices [B, n_kv, K] int32 per KV head:
    token positions (page_size=1) or page indices (page_size>1: page p covers positions
    p*page_size ... p*page_size+page_size-1). num_valid [B, n_kv] (optional): only the
    first num_valid entries count. lengths [B] (optional): positions >= lengths[b] are
    ignored (partial last page). Returns (out [B, n_heads, d] in q.dtype, lse [B, n_heads]).

    k, v may live in ``pinned_host`` memory. On GPU the Pallas kernel then reads the
    selected rows straight from host memory (zero-copy); where that fails (or on CPU)
    the arrays are copied to device memory first. ``sparse_attention_path()`` tells
    which path ran.
    """
    scale = None if scale is None else float(scale)
    page_size = int(page_size)
    indices = jnp.asarray(indices, jnp.int32)
    if num_valid is not None:
        num_valid = jnp.asarray(num_valid, jnp.int32)
    if lengths is not None:
        lengths = jnp.asarray(lengths, jnp.int32)
    traced = isinstance(k, jax.core.Tracer)
    host = (not traced) and _c.memory_kind(k) not in (None, "device")
    kernel = use_kernel(impl)
    if traced:
        _LAST_SPARSE_PATH["path"] = "traced"
        if kernel:  # per device on its heads under a tensor-parallel mesh (clo, tokenselect)
            heads, rep = _sh.KV_SPEC, _sh.REPLICATED
            return _sh.per_shard(
                lambda q_, k_, v_, i_, n_, l_: _sa.sparse_attention_kernel(q_, k_, v_, i_, num_valid=n_,
                                                                           page_size=page_size, scale=scale,
                                                                           lengths=l_, interpret=interpret),
                (heads, heads, heads, heads, heads, rep), (heads, heads))(q, k, v, indices, num_valid, lengths)
        return _sa.sparse_attention_reference(q, k, v, indices, num_valid=num_valid,
                                              page_size=page_size, scale=scale,
                                              lengths=lengths)
    if kernel and host and not interpret and _ZERO_COPY_OK["ok"] is not False:
        try:
            res = _sparse_kernel_jit(q, k, v, indices, num_valid, lengths, page_size,
                                     scale, False)
            _ZERO_COPY_OK["ok"] = True
            _LAST_SPARSE_PATH["path"] = "kernel_zero_copy"
            return res
        except Exception:  # lowering/runtime refused host operands: fall back
            _ZERO_COPY_OK["ok"] = False
    if host:
        k = _c.to_device_memory(k)
        v = _c.to_device_memory(v)
    if kernel:
        _LAST_SPARSE_PATH["path"] = "kernel_device_copy" if host else "kernel"
        return _sparse_kernel_jit(q, k, v, indices, num_valid, lengths, page_size, scale,
                                  interpret)
    _LAST_SPARSE_PATH["path"] = "reference_device_copy" if host else "reference"
    return _sparse_ref_jit(q, k, v, indices, num_valid, lengths, page_size, scale)


def rows_attention(q, k, v, num_valid, rows: int, *, row_offset=None, impl="auto", interpret=False):
    """Attention over row buffers (a selection's rows, gathered into device memory): each (request, KV head)'s
    first num_valid [B, n_kv] rows of k, v [B, n_kv, R, d], at rows [row_offset, row_offset + rows) (row_offset
    [] int32 or None: 0 and R = rows; several layers' buffers stacked along the rows). Returns (out [B, H, d],
    lse [B, H]). The kernel reads the rows in place and consecutively (`sparse_attention`'s gather form loads
    each block's indices first); per device on its heads under a tensor-parallel mesh."""
    rows = int(rows)
    num_valid = jnp.asarray(num_valid, jnp.int32)
    off = None if row_offset is None else jnp.asarray(row_offset, jnp.int32)
    if use_kernel(impl):
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        return _sh.per_shard(
            lambda q_, k_, v_, n_, o_: _sa.rows_attention_kernel(q_, k_, v_, n_, rows, row_offset=o_,
                                                                 interpret=interpret),
            (heads, heads, heads, heads, rep), (heads, heads))(q, k, v, num_valid, off)
    return _sa.rows_attention_reference(q, k, v, num_valid, rows, row_offset=off)


# ----------------------------------------------------------------------------
# recompute
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("n_kv", "interpret"))
def _recompute_kernel_jit(x, w_k, b_k, w_v, b_v, cos, sin, n_kv, interpret):
    return _rc.recompute_kv_kernel(x, w_k, b_k, w_v, b_v, cos, sin, n_kv=n_kv,
                                   interpret=interpret)


@functools.partial(jax.jit, static_argnames=("n_kv",))
def _recompute_ref_jit(x, w_k, b_k, w_v, b_v, cos, sin, n_kv):
    return _rc.recompute_kv_reference(x, w_k, b_k, w_v, b_v, cos, sin, n_kv=n_kv)


# The kernel has no autodiff rule; training (head importance, HATA) differentiates through the
# model's K/V projection, so the kernel's backward pass is the reference's.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _recompute_kernel_diff(x, w_k, b_k, w_v, b_v, cos, sin, n_kv, interpret):
    return _recompute_kernel_jit(x, w_k, b_k, w_v, b_v, cos, sin, n_kv, interpret)


def _recompute_kernel_fwd(x, w_k, b_k, w_v, b_v, cos, sin, n_kv, interpret):
    out = _recompute_kernel_jit(x, w_k, b_k, w_v, b_v, cos, sin, n_kv, interpret)
    return out, (x, w_k, b_k, w_v, b_v, cos, sin)


def _recompute_kernel_bwd(n_kv, interpret, residuals, cotangent):
    _, vjp = jax.vjp(lambda *a: _recompute_ref_jit(*a, n_kv), *residuals)
    return vjp(cotangent)


_recompute_kernel_diff.defvjp(_recompute_kernel_fwd, _recompute_kernel_bwd)


def recompute_kv(x, w_k, b_k, w_v, b_v, cos=None, sin=None, *, n_kv, impl="auto",
                 interpret=False):
    """Recompute K, V from stored attention-input activations.

    x [B, T, H]; w_k, w_v [H, n_kv*d]; b_k, b_v [n_kv*d] or None; cos, sin [B, T, d//2]
    or None (no RoPE). RoPE is HF split-half: rot = [x1*cos - x2*sin, x2*cos + x1*sin].
    Returns k, v each [B, n_kv, T, d] (cache layout) in x.dtype, fp32 accumulation. w_k None: V alone
    (k None; the reference's matmul: no family puts RoPE on V), where K is at hand already.
    """
    n_kv = int(n_kv)
    if impl == "auto" and (hasattr(w_v, "stacked") or (_c.on_gpu() and _few_rows_ok(x, w_v))):
        # a decode step's few tokens: W_K and W_V read by the few-row linear (XLA's matmul reads a b1 W_K at
        # 0.5 TB/s), or in place from stacked layers (`matmul_f32`); bias and RoPE as the reference
        return _rc.recompute_kv_reference(x, w_k, b_k, w_v, b_v, cos, sin, n_kv=n_kv,
                                          matmul=lambda a, w: matmul_f32(a, w, interpret=interpret))
    if w_k is None:
        return _recompute_ref_jit(x, None, None, w_v, b_v, None, None, n_kv)
    ok = _rc.recompute_kv_supported(x, w_k, n_kv)
    # "auto" takes the kernel only for blocks of stored tokens: it tiles over tokens, so with a few
    # tokens per sequence (a decode step's new token) it re-reads W_K/W_V per sequence; measured on
    # an H200 at OPT-6.7B b64 T=1 that cost ~13 ms of a 22 ms step, where XLA's matmul reads W once.
    profitable = x.shape[1] >= RECOMPUTE_KERNEL_MIN_TOKENS
    if use_kernel(impl, ok and profitable) and (ok or impl == "kernel"):
        # under a tensor-parallel mesh each device recomputes its heads from the whole x (W_K, W_V split
        # by column, i.e. by head)
        n = _sh.context_size()
        col, bias, rep, heads = _sh.P(None, _sh.MODEL), _sh.P(_sh.MODEL), _sh.REPLICATED, _sh.KV_SPEC
        return _sh.per_shard(
            lambda x_, wk_, bk_, wv_, bv_, c_, s_: _recompute_kernel_diff(x_, wk_, bk_, wv_, bv_, c_, s_, n_kv // n,
                                                                           interpret),
            (rep, col, None if b_k is None else bias, col, None if b_v is None else bias,
             None if cos is None else rep, None if sin is None else rep), (heads, heads),
        )(x, w_k, b_k, w_v, b_v, cos, sin)
    return _recompute_ref_jit(x, w_k, b_k, w_v, b_v, cos, sin, n_kv)


# ----------------------------------------------------------------------------
# top-k selection
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "group_reduce", "interpret"))
def _scores_kernel_jit(q, k, lengths, scale, group_reduce, interpret):
    return _tk.topk_scores_exact_kernel(q, k, lengths, scale=scale,
                                        group_reduce=group_reduce, interpret=interpret)


def topk_scores_exact(q, k, lengths=None, *, scale=None, group_reduce="sum", impl="auto",
                      interpret=False):
    """Exact scores scale*q.K per KV head, aggregated over the GQA group
    (group_reduce 'sum' | 'max' | 'mean'). q [B, n_heads, d], k [B, n_kv, S, d],
    lengths [B], [B, n_kv] (per KV head; 0: the head is not scored, its keys not read) or None.
    Returns [B, n_kv, S] float32, -inf past lengths."""
    scale = None if scale is None else float(scale)
    if use_kernel(impl):
        if lengths is not None:
            lengths = jnp.asarray(lengths, jnp.int32)
        # per device on its heads under a tensor-parallel mesh; per-head lengths [B, n_kv] split with them
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        return _sh.per_shard(lambda q_, k_, n_: _scores_kernel_jit(q_, k_, n_, scale, group_reduce, interpret),
                             (heads, heads, heads if lengths is not None and lengths.ndim == 2 else rep),
                             heads)(q, k, lengths)
    return _tk.topk_scores_exact_reference(q, k, lengths, scale=scale,
                                           group_reduce=group_reduce)


@functools.partial(jax.jit, static_argnames=("group_reduce", "interpret"))
def _quest_kernel_jit(q, kmin, kmax, num_pages, group_reduce, interpret):
    return _tk.quest_page_scores_kernel(q, kmin, kmax, num_pages, group_reduce=group_reduce,
                                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _quest_blocks_kernel_jit(q, owner, kmin, kmax, scale, interpret, block_offset=0, active=None):
    return _tk.quest_block_bounds_kernel(q, owner, kmin, kmax, scale, block_offset=block_offset, active=active,
                                         interpret=interpret)


def _layer_stacks(arrays):
    """Where every array given is a `models.common.LayerSlice` of one layer of [n, E, ...] stacks: (the stacks as
    [n E, ...] (a reshape, no copy), the layer's first row, index x E); else None."""
    if not all(hasattr(a, "stacked") for a in arrays if a is not None):
        return None
    E = arrays[0].stacked.shape[1]
    return (tuple(None if a is None else a.stacked.reshape((-1,) + a.stacked.shape[2:]) for a in arrays),
            jnp.asarray(arrays[0].index, jnp.int32) * E)


def quest_block_bounds(q, owner, kmin, kmax, scale=None, *, active=None, impl="auto", interpret=False):
    """Quest's page bounds of pool blocks, each against its owner's query (`pallas.topk.quest_block_bounds_reference`):
    q [B, H, d]; owner [E]; kmin, kmax [E, n_kv, P, d] (int8 with scale [E, n_kv, P], or the keys' dtype);
    active [B, n_kv] or None: an inactive (request, head)'s bounds are -inf and its pages are not read.
    Returns [E, n_kv, P] f32. The kernel on the GPU, per device on its heads under a tensor-parallel mesh.
    The pages may be a looped layer's `models.common.LayerSlice`s (all alike): on one device read in place at
    the layer's row of their stacks; under a mesh sliced out."""
    stacks = _layer_stacks((kmin, kmax, scale))
    if stacks is not None and _sh.context_size() == 1:
        (lo, hi, sc), offset = stacks
        if use_kernel(impl):
            return _quest_blocks_kernel_jit(q, owner, lo, hi, sc, interpret, block_offset=offset, active=active)
        return _tk.quest_block_bounds_reference(q, owner, lo, hi, sc, block_offset=offset, active=active)
    kmin, kmax, scale = (None if a is None else jnp.asarray(a) for a in (kmin, kmax, scale))
    if use_kernel(impl):
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        return _sh.per_shard(
            lambda q_, o_, lo_, hi_, s_, a_: _quest_blocks_kernel_jit(q_, o_, lo_, hi_, s_, interpret, active=a_),
            (heads, rep, heads, heads, heads, heads), heads)(q, owner, kmin, kmax, scale, active)
    return _tk.quest_block_bounds_reference(q, owner, kmin, kmax, scale, active=active)


def quest_page_scores(q, kmin, kmax, num_pages=None, *, group_reduce="sum", impl="auto",
                      interpret=False):
    """Quest page upper bounds sum_c max(q_c min_c, q_c max_c) from per-page
    channel-wise min/max keys (see ``quest_page_minmax``), per query head, aggregated
    over the GQA group. q [B, n_heads, d]; kmin, kmax [B, n_kv, P, d]; num_pages [B]
    (valid pages) or None. Returns [B, n_kv, P] float32, -inf for empty pages
    (kmin > kmax) and pages >= num_pages."""
    if use_kernel(impl):
        if num_pages is not None:
            num_pages = jnp.asarray(num_pages, jnp.int32)
        return _quest_kernel_jit(q, kmin, kmax, num_pages, group_reduce, interpret)
    return _tk.quest_page_scores_reference(q, kmin, kmax, num_pages, group_reduce=group_reduce)


@functools.partial(jax.jit, static_argnames=("group_reduce", "interpret"))
def _hata_kernel_jit(q_codes, k_codes, lengths, k_norm, group_reduce, interpret):
    return _tk.hata_scores_kernel(q_codes, k_codes, lengths, k_norm=k_norm,
                                  group_reduce=group_reduce, interpret=interpret)


def hata_scores(q_codes, k_codes, lengths=None, *, k_norm=None, group_reduce="sum",
                impl="auto", interpret=False):
    """HATA similarity r - hamming(q_code, k_code) (optionally times key norm), per KV head
    aggregated over the group. q_codes [B, n_heads, r//32] uint32, k_codes [B, n_kv, S,
    r//32] uint32 (packing convention in the module docstring); k_norm [B, n_kv, S] or
    None; lengths [B] or None. Returns [B, n_kv, S] float32, -inf past lengths."""
    if use_kernel(impl):
        if lengths is not None:
            lengths = jnp.asarray(lengths, jnp.int32)
        return _hata_kernel_jit(q_codes, k_codes, lengths, k_norm, group_reduce, interpret)
    return _tk.hata_scores_reference(q_codes, k_codes, lengths, k_norm=k_norm,
                                     group_reduce=group_reduce)


@functools.partial(jax.jit, static_argnames=("scale", "shared", "interpret"))
def _tokenselect_kernel_jit(q, k, lengths, scale, shared, interpret):
    return _tk.tokenselect_scores_kernel(q, k, lengths, scale=scale, shared=shared,
                                         interpret=interpret)


def tokenselect_scores(q, k, lengths=None, *, scale=None, shared=False, impl="auto",
                       interpret=False):
    """TokenSelect soft vote: per-head softmax of scale*q.K over the valid keys, summed
    over the heads of each GQA group (shared=True: over all heads, same selection for
    every KV head). q [B, n_heads, d] (cast to k.dtype by the kernel), k [B, n_kv, S, d],
    lengths [B] or None. Returns [B, n_kv, S] float32, -inf past lengths. The kernel is
    exact (two passes: logits + per-head softmax statistics, then normalised sums)."""
    scale = None if scale is None else float(scale)
    shared = bool(shared)
    if use_kernel(impl):
        if lengths is not None:
            lengths = jnp.asarray(lengths, jnp.int32)
        return _tokenselect_kernel_jit(q, k, lengths, scale, shared, interpret)
    return _tk.tokenselect_scores_reference(q, k, lengths, scale=scale, shared=shared)


def select_topk(scores, k, *, lengths=None, num_sink=0, num_recent=0, page_size=1, counts=None, method="auto"):
    """`pallas.topk.select_topk` (the top-k per KV head, ascending, per-row counts); where the method resolves
    to "kernel" ("auto" on the GPU from 128K entries) its Pallas kernels run per device on its heads under a
    tensor-parallel mesh."""
    method = _tk.resolve_topk_method(method, scores.shape[-1])

    def run(s, n, c):
        return _tk.select_topk(s, k, lengths=n, num_sink=num_sink, num_recent=num_recent, page_size=page_size,
                               counts=c, method=method)

    if method != "kernel":
        return run(scores, lengths, counts)
    heads, rep = _sh.KV_SPEC, _sh.REPLICATED
    return _sh.per_shard(run, (heads, rep, heads), (heads, heads))(scores, lengths, counts)


def topk_indices(scores, k, *, lengths=None, num_sink=4, num_recent=64, page_size=1):
    """``select_topk`` with the library's default sink (4) / recent (64) windows."""
    return select_topk(scores, k, lengths=lengths, num_sink=num_sink,
                       num_recent=num_recent, page_size=page_size)


# ----------------------------------------------------------------------------
# int4
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _int4_kernel_jit(q, kq, vq, lengths, scale, interpret):
    return _q.decode_attention_int4_kernel(q, kq, vq, lengths, scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale",))
def _int4_ref_jit(q, kq, vq, lengths, scale):
    return _q.decode_attention_int4_reference(q, kq, vq, lengths, scale=scale)


def decode_attention_int4(q, kq: QuantizedInt, vq: QuantizedInt, lengths, *, scale=None,
                          impl="auto", interpret=False):
    """Decode attention reading int4 K/V (``quantize_int4`` of [B, n_kv, S, d] caches)
    without dequantising the cache in memory. Same returns as ``decode_attention``. The kernel reads
    per-token group scales only: K or V quantized per channel (``scales="channel"``) is dequantized and
    attended by the reference (impl="kernel" refuses it)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    scale = None if scale is None else float(scale)
    d = q.shape[-1]
    if 8 in (kq.bits, vq.bits):
        raise ValueError("decode_attention_int4 attends int4 K/V; an int8 QuantizedInt (quantize_int8) is "
                         "dequantized (ops.dequantize) and attended with decode_attention")
    per_channel = "channel" in (kq.scales, vq.scales)
    if per_channel and impl == "kernel":
        raise ValueError("decode_attention_int4's kernel reads per-token int4 scales only; K/V quantized with "
                         "scales='channel' runs with impl='reference' or 'auto' (dequantize, then attend)")
    ok = _q.int4_kernel_supported(d, kq.group_size) and not per_channel
    if use_kernel(impl, ok) and (ok or impl == "kernel"):
        return _int4_kernel_jit(q, kq, vq, lengths, scale, interpret)
    return _int4_ref_jit(q, kq, vq, lengths, scale)


# ----------------------------------------------------------------------------
# row gather from an extent (host or device memory)
# ----------------------------------------------------------------------------

_LAST_GATHER_PATH = {"path": None}


def gather_block_rows_path():
    """Which path the last ``gather_block_rows`` call (or trace) took: 'kernel_zero_copy' (Pallas
    kernel reading a host extent in place), 'kernel' (device extent), 'kernel_device_copy' (interpret
    mode: the host extent copied to the device first), 'reference', 'reference_host_gather' (XLA's
    gather run where the host extent lives: host compute on a GPU), or None."""
    return _LAST_GATHER_PATH["path"]


@functools.lru_cache(maxsize=None)
def zero_copy_gather_supported() -> bool:
    """Whether the compiled gather kernel reads a pinned_host operand here (GPU only): one small
    gather run once, checked against the reference, the answer cached. Safe to call while tracing."""
    dev = jax.devices()[0]
    if not _c.on_gpu() or "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
        return False

    def probe():
        try:
            x = jnp.arange(3 * 2 * 16 * 80, dtype=jnp.float32).reshape(3, 2, 16, 80)
            block = jnp.array([[[2, 0, -1, 3, 1]] * 2], jnp.int32)
            offset = jnp.array([[[15, 3, 0, 0, 7]] * 2], jnp.int32)
            want = _ga.gather_rows_reference(x, block, offset)
            xh = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
            got = jax.jit(_ga.gather_rows_kernel)(xh, block, offset)
            answer.append(bool(jnp.array_equal(got, want)))
        except Exception:  # the lowering or the runtime refused a host operand: XLA's gather instead
            answer.append(False)

    # JAX's trace state is per thread: a fresh thread runs the probe eagerly even when the caller is
    # tracing a jit (ensure_compile_time_eval would evaluate the kernel's program_id eagerly and fail)
    answer: list[bool] = []
    worker = threading.Thread(target=probe)
    worker.start()
    worker.join()
    return bool(answer and answer[0])


def _gather_path(x, kernel, interpret) -> str:
    kind = _c.memory_kind(x)  # None while tracing: the aval's memory space says
    if jax.typeof(x).memory_space != jax.memory.Space.Host and kind not in ("pinned_host", "unpinned_host"):
        return "kernel" if kernel else "reference"
    # a traced host operand is taken as pinned (the pool's kind on a GPU); the GPU cannot read pageable memory
    pinned = kind in (None, "pinned_host")
    if kernel and not interpret and pinned and zero_copy_gather_supported():
        return "kernel_zero_copy"
    # interpret mode cannot index host memory: the whole extent moves to the device (tests only)
    return "kernel_device_copy" if kernel and interpret else "reference_host_gather"


def _gather_block_rows(x, block, offset, path, interpret, block_k):
    if path == "reference":
        return _ga.gather_rows_reference(x, block, offset)
    if path == "reference_host_gather":
        return _ga.gather_rows_reference_host(x, block, offset)
    if path == "kernel_device_copy":
        x = jax.device_put(x, jax.memory.Space.Device)
    return _ga.gather_rows_kernel(x, block, offset, interpret=interpret, block_k=block_k)


_gather_jit = jax.jit(_gather_block_rows, static_argnames=("path", "interpret", "block_k"))


def gather_block_rows(x, block, offset, *, impl="auto", interpret=False, block_k=None):
    """Rows of one block extent: out[b, h, i] = x[block[b, h, i], h, offset[b, h, i]].

    x [E, n_kv, blk, d] (device or host memory; any dtype), a headless extent x [E, blk, d] (an
    activation extent: block, offset [B, K], rows [B, K, d]), or a ``QuantizedInt`` extent (its codes and group scales gathered alike: a QuantizedInt of rows
    comes back, ``dequantize`` it on the device; per-channel scales [E, n_kv, 1, d]: each row gets
    its block's, [B, n_kv, K, d]); block, offset [B, n_kv, K] int32. Returns
    [B, n_kv, K, d] in device memory; rows whose block is outside [0, E) or offset outside
    [0, blk) are 0. A pinned_host extent on the GPU is read in place by the kernel (only the K rows
    cross PCIe; ``zero_copy_gather_supported``); elsewhere XLA gathers where the extent lives and moves
    the rows. Works eagerly and under jit; ``gather_block_rows_path()`` tells which path ran.
    """
    block = jnp.asarray(block, jnp.int32)
    offset = jnp.asarray(offset, jnp.int32)
    if isinstance(x, QuantizedInt):
        rows = lambda a, off: gather_block_rows(a, block, off, impl=impl, interpret=interpret, block_k=block_k)  # noqa: E731
        # per-channel scales [E, n_kv, 1, d]: each row takes its block's (row 0), a row outside reads 0
        blk = x.codes.shape[-2]
        s_off = offset if x.scales == "token" else jnp.where((offset >= 0) & (offset < blk), 0, -1)
        return QuantizedInt(rows(x.codes, offset), rows(x.step, s_off), rows(x.mn, s_off), x.group_size, x.scales,
                            x.bits)
    path = _gather_path(x, use_kernel(impl), interpret)
    _LAST_GATHER_PATH["path"] = path
    call = _gather_block_rows if isinstance(x, jax.core.Tracer) else _gather_jit
    if path.startswith("kernel"):  # per device on its shard under a tensor-parallel mesh: a K/V extent's heads
        # (block, offset split with them), an activation extent's slice of H (every device the same tokens)
        rows = _sh.KV_SPEC if x.ndim == 4 else _sh.X_SPEC
        idx = _sh.KV_SPEC if x.ndim == 4 else _sh.REPLICATED
        return _sh.per_shard(lambda x_, b_, o_: call(x_, b_, o_, path, bool(interpret), block_k), (rows, idx, idx),
                             rows)(x, block, offset)
    return call(x, block, offset, path, bool(interpret), block_k)


def gather_pool_rows(extents, tokens, blk: int):
    """[B, n_kv, K, d] in device memory: rows of a pool's token space (tokens [B, n_kv, K]: block id * blk +
    offset) from its extents [E_e, n_kv, blk, d] (consecutive in block-id order), one ``gather_block_rows``
    per extent, each row taken from its own (0 where no extent holds it, e.g. a token of -1). Activation
    extents [E_e, blk, H] take tokens [B, T] and give [B, T, H]. A host extent is read in place by the kernel
    on the GPU; a device extent through XLA's gather. An int4 extent (``QuantizedInt``) gives the rows as
    stored (a QuantizedInt of rows): dequantize only those."""
    block, off = tokens // blk, tokens % blk
    out, start = None, 0
    for x in extents:
        E = jax.tree.leaves(x)[0].shape[0]
        host = jax.typeof(jax.tree.leaves(x)[0]).memory_space == jax.memory.Space.Host
        rows = gather_block_rows(x, block - start, off, impl="auto" if host else "reference")
        inside = ((block >= start) & (block < start + E))[..., None]
        out = rows if out is None else jax.tree.map(lambda r, o: jnp.where(inside, r, o), rows, out)
        start += E
    return out


def refill_block_rows(buf, extents, tokens, blk: int, *, impl="auto", interpret=False, block_k=None, row_offset=None):
    """buf [B, n_kv, K, d] with the rows of tokens [B, n_kv, K] (pool token ids; -1: the row keeps its value)
    read from the pool's extents [E_e, n_kv, blk, d] (consecutive in block-id order; host or device memory;
    native or int4). A selection cache's refill: a missed head's rows replaced, a hit head's (all -1) kept.

    On the GPU one Pallas kernel reads every extent and writes only the rows replaced, in place (aliased: no
    copy where the caller's jit donates buf): ``refill_rows_kernel`` for native extents, ``refill_rows_int_kernel``
    for int4 / int8 extents with per-token group scales (codes, step and min read, dequantized in the kernel;
    under impl="auto" unless ``INT_REFILL_KERNEL`` is off). Elsewhere (impl="reference", per-channel int4 scales)
    the rows are gathered per extent (``gather_pool_rows``), dequantized and merged with a ``where``.

    row_offset ([] int32, traced): buf [B, n_kv, R, d] holds several layers' buffers along its rows and tokens'
    row i goes to row row_offset + i (a step looping over stacked layers; the kernel writes them in place)."""
    tokens = tokens.astype(jnp.int32)
    quantized = [isinstance(x, QuantizedInt) for x in extents]
    # one kernel: native extents, or quantized ones of one form with per-token group scales (dequantized in it)
    one_kernel = not any(quantized) or (all(quantized) and all(x.scales == "token" for x in extents)
                                        and len({(x.bits, x.group_size) for x in extents}) == 1
                                        and (impl == "kernel" or INT_REFILL_KERNEL))
    paths = {_gather_path(x.codes if q else x, True, interpret) for x, q in zip(extents, quantized)}
    if one_kernel and use_kernel(impl) and paths <= {"kernel", "kernel_zero_copy", "kernel_device_copy"}:
        refill = _ga.refill_rows_int_kernel if any(quantized) else _ga.refill_rows_kernel

        def run(b_, t_, *xs):
            if interpret:  # interpret mode cannot index host memory (tests only)
                xs = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), xs)
            return refill(b_, xs, t_, blk, interpret=interpret, block_k=block_k, row_offset=row_offset)
        spec = _sh.KV_SPEC
        return _sh.per_shard(run, (spec, spec) + (spec,) * len(extents), spec)(buf, tokens, *extents)
    if row_offset is not None:  # the reference on the layer's rows, written back
        part = jax.lax.dynamic_slice_in_dim(buf, row_offset, tokens.shape[-1], axis=2)
        return jax.lax.dynamic_update_slice_in_dim(
            buf, refill_block_rows(part, extents, tokens, blk, impl="reference"), row_offset, axis=2)
    rows = gather_pool_rows(extents, tokens, blk)
    rows = dequantize(rows, buf.dtype) if isinstance(rows, QuantizedInt) else rows
    block = tokens // blk
    held = (tokens >= 0) & (block < sum(jax.tree.leaves(x)[0].shape[0] for x in extents))
    return jnp.where(held[..., None], rows.astype(buf.dtype), buf)
