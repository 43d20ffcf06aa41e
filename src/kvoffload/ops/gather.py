"""Rows of a pool's block extents (host or device memory, native or int4 / int8): gathered into device memory
(``gather_block_rows``, ``gather_pool_rows``) or refilled into a selection's buffers in place
(``refill_block_rows``)."""

from __future__ import annotations

import functools
import os
import threading

import jax
import jax.numpy as jnp

from kvoffload.device import sharding as _sh
from kvoffload.ops.dispatch import use_kernel
from kvoffload.pallas import common as _c
from kvoffload.pallas import gather as _ga
from kvoffload.pallas.quant import QuantizedInt, dequantize


# refill_block_rows' dequantizing kernel for int4 / int8 extents under impl="auto" on a GPU: on (it matched its
# reference on an H200, check_kernels' "refill ... int4 / int8 host" cases, and took a 128K clo step with int8 K /
# int4 V rows from 1.23-1.24x `full` to 1.15-1.16x: BENCHMARKS 'clo at 128K b1'). KVOFFLOAD_INT_REFILL_KERNEL=0
# turns it off (the gathers + dequantize + where it replaced), to time one against the other.
INT_REFILL_KERNEL = os.environ.get("KVOFFLOAD_INT_REFILL_KERNEL", "1") != "0"


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
