"""Checks of the kernels that move rows: int4 / int8 group quantization, the row gather from one extent and the
refill of a row buffer from several (exactly, or within a rounding where the extents are quantized)."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from kvoffload.pallas import gather as _ga
from kvoffload.pallas import quant as _q
from kvoffload.testing.oracles import _dt, _np_dequantize, _rand, _result, rel_err


def check_quantize(shape=(2, 3, 50, 128), group_size=64, bits=4, seed=0):
    """quantize_int4 / quantize_int8 against NumPy: codes (15 or 255 steps a group), step and min, and every
    dequantized value within half a step of its input; int4's split-half packing round trip and layout."""
    rng = np.random.default_rng(seed)
    x, x64 = _rand(rng, shape, "float32", scale=2.0)
    top = 15 if bits == 4 else 255
    qx = (_q.quantize_int4 if bits == 4 else _q.quantize_int8)(x, group_size)
    D = shape[-1]
    xg = x64.reshape(*shape[:-1], D // group_size, group_size)
    mn = xg.min(-1)
    step = (xg.max(-1) - mn) / top
    codes_ref = np.clip(np.round((xg - mn[..., None]) / step[..., None]), 0, top).reshape(shape)
    codes = np.asarray(_q.unpack_int4(qx.codes) if bits == 4 else qx.codes).astype(np.float64)
    mism = np.abs(codes - codes_ref)
    codes_ok = bool(qx.bits == bits and codes.shape == shape and mism.max() <= 1 and (mism > 0).mean() < 1e-3)
    deq = np.asarray(_q.dequantize(qx), np.float64)
    bound = np.repeat(step, group_size, axis=-1).reshape(shape) * 0.5 * (1 + 1e-4) + 1e-6
    deq_ok = bool(np.all(np.abs(deq - x64) <= bound))
    packing_ok = True
    if bits == 4:  # pack/unpack round trip and layout (byte j = code j | code j+D/2 << 4)
        c = jnp.asarray(rng.integers(0, 16, shape), jnp.uint8)
        pk = _q.pack_int4(c)
        packing_ok = bool(np.array_equal(np.asarray(_q.unpack_int4(pk)), np.asarray(c))
                          and np.array_equal(np.asarray(pk) & 15, np.asarray(c)[..., : D // 2]))
    errs = dict(err_step=rel_err(qx.step, step), err_min=rel_err(qx.mn, mn))
    r = _result(f"quantize_int{bits} {shape} g{group_size}", "reference", errs, 1e-5)
    r["ok"] = r["ok"] and codes_ok and deq_ok and packing_ok
    return r


def check_gather(B=2, n_kv=2, E=5, blk=24, d=80, K=37, dtype="float32", mode="reference", seed=0,
                 host=False, **kw):
    """Rows x[block, head, offset] of one extent vs NumPy indexing, exactly (a gather does no
    arithmetic): random x (never zeros; dtype uint8: int4 codes 1..255), blocks drawn from
    [-2, E + 3) so some rows are outside the extent (must come back 0), random offsets.
    host=True: the extent in pinned_host memory, gathered inside a jit (the zero-copy path)."""
    rng = np.random.default_rng(seed)
    if dtype == "uint8":
        x64 = rng.integers(1, 256, (E, n_kv, blk, d)).astype(np.float64)
        x = jnp.asarray(x64, jnp.uint8)
    else:
        x, x64 = _rand(rng, (E, n_kv, blk, d), dtype)
    block = rng.integers(-2, E + 3, (B, n_kv, K)).astype(np.int32)
    block[0, 0, 0] = E - 1  # the last block and (below) a row outside, whatever the draw
    block[-1, -1, -1] = E
    offset = rng.integers(0, blk, (B, n_kv, K)).astype(np.int32)
    inside = (block >= 0) & (block < E)
    want = np.where(inside[..., None],
                    x64[np.clip(block, 0, E - 1), np.arange(n_kv)[None, :, None], offset], 0.0)
    if host:
        dev = jax.devices()[0]
        x = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    args = (x, jnp.asarray(block), jnp.asarray(offset))
    if mode == "reference":
        fn = _ga.gather_rows_reference_host if host else _ga.gather_rows_reference
        out = jax.jit(fn)(*args)
    else:
        out = jax.jit(lambda *a: _ga.gather_rows_kernel(*a, interpret=(mode == "interpret"),
                                                       poison=True, **kw))(*args)
    got = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    bad = float(np.mean(got != want)) if got.shape == want.shape else float("inf")
    r = _result(f"gather E{E} blk{blk} B{B} kv{n_kv} K{K} d{d} {dtype}{' host' if host else ''}", mode,
                dict(err_mismatch=bad), 1e-12)
    r["ok"] = r["ok"] and out.dtype == x.dtype and str(getattr(out.sharding, "memory_kind", "device")) == "device"
    return r


def check_refill(B=2, n_kv=2, sizes=(5, 3), blk=24, d=80, K=37, dtype="float32", mode="reference", seed=0,
                 host=False, ext_dtype=None, bits=None, group_size=16, layers=1, layer=0, **kw):
    """A row buffer refilled from extents (``refill_rows_kernel``) vs NumPy, exactly: random buffer and extents
    (never zeros), per (request, head) a random count of rows replaced by random pool tokens spread over every
    extent (-1 past the count, and one head keeping all its rows: a hit), a few tokens past the last extent
    (kept). host=True: the extents in pinned_host memory (read in place). ext_dtype: the extents' dtype when
    it differs from the buffer's (cast on the way). bits 4 / 8: the extents group-quantized (``QuantizedInt``,
    per-token groups of group_size; ``refill_rows_int_kernel``), against their dequantized values in NumPy
    (codes * step + min in float32, as ``quant.dequantize``): within one rounding of the buffer's dtype, since
    the kernel may fuse the multiply-add. layers > 1: the buffer holds that many layers' K rows a head and
    layer `layer`'s are refilled (the row offset layer x K, traced); every other row must stay as it was."""
    rng = np.random.default_rng(seed)
    buf, full64 = _rand(rng, (B, n_kv, layers * K, d), dtype)
    rows_at = slice(layer * K, (layer + 1) * K)
    buf64 = full64[:, :, rows_at]
    row_offset = None if layers == 1 else jnp.int32(layer * K)
    exts, exts64 = zip(*[_rand(rng, (E, n_kv, blk, d), ext_dtype or dtype) for E in sizes])
    if bits:
        quantize = _q.quantize_int4 if bits == 4 else _q.quantize_int8
        exts = tuple(quantize(jnp.asarray(x, jnp.float32), group_size) for x in exts64)
        exts64 = tuple(_np_dequantize(x) for x in exts)
    N = sum(sizes) * blk
    tokens = rng.integers(0, N + 2 * blk, (B, n_kv, K)).astype(np.int32)  # some past the last extent
    count = rng.integers(0, K + 1, (B, n_kv))
    count[0, 0] = K
    count[-1, -1] = 0  # a hit: every row kept
    tokens = np.where(np.arange(K)[None, None] < count[..., None], tokens, -1).astype(np.int32)
    flat = np.concatenate(exts64)  # [sum E, n_kv, blk, d]: block-id order
    blocks, offs = tokens // blk, tokens % blk
    inside = (tokens >= 0) & (blocks < sum(sizes))
    got_rows = flat[np.clip(blocks, 0, sum(sizes) - 1), np.arange(n_kv)[None, :, None], offs]
    want = np.where(inside[..., None], got_rows, buf64)
    if ext_dtype or bits:  # the extents' (dequantized) values as the buffer's dtype holds them
        want = np.asarray(jnp.asarray(want, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)
    want = np.concatenate([full64[:, :, :rows_at.start], want, full64[:, :, rows_at.stop:]], axis=2)
    if host:
        dev = jax.devices()[0]
        exts = jax.device_put(exts, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    if mode == "reference":  # host or quantized extents: the op's fallback (a gather per extent, dequantized)
        from kvoffload import ops

        ref = (lambda b_, t_, o_, *xs: ops.refill_block_rows(b_, xs, t_, blk, impl="reference", row_offset=o_)) if (
            host or bits) else (lambda b_, t_, o_, *xs: _ga.refill_rows_reference(b_, xs, t_, blk, row_offset=o_))
        out = jax.jit(ref)(buf, jnp.asarray(tokens), row_offset, *exts)
    else:
        refill = _ga.refill_rows_int_kernel if bits else _ga.refill_rows_kernel
        out = jax.jit(lambda b_, t_, o_, *xs: refill(b_, xs, t_, blk, interpret=(mode == "interpret"), row_offset=o_,
                                                     **kw), donate_argnums=0)(buf, jnp.asarray(tokens), row_offset, *exts)
    got = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    if bits:  # within a rounding of the buffer's dtype (a bf16 ulp is up to 2**-7 of a value), relative to the
        # values' scale; a wrong row, nibble or group scale is off by a quantization step (~1/15 of a range) or more
        ulp = 2.0 ** -6 if jnp.dtype(_dt(dtype)) == jnp.bfloat16 else 2.0 ** -20
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want))) if got.shape == want.shape else float("inf")
        errs, tol = dict(err_rel=err), ulp
    else:
        errs, tol = dict(err_mismatch=float(np.mean(got != want)) if got.shape == want.shape else float("inf")), 1e-12
    r = _result(f"refill E{sizes} blk{blk} B{B} kv{n_kv} K{K} d{d} {dtype}{f' int{bits}' if bits else ''}"
                f"{' host' if host else ''}{f' layer {layer}/{layers}' if layers > 1 else ''}", mode, errs, tol)
    r["ok"] = r["ok"] and out.dtype == buf.dtype
    return r
