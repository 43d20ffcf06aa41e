"""ops.gather_block_rows: rows of one block extent (device or host memory) into device memory, and its
use by ops.gather_pool_rows (kv=split's V rows, clo's K/V rows). The kernel-vs-NumPy sweep is
testing/rows.py's check_gather (tests/test_kernels.py, benchmarks/check_kernels.py on the GPU)."""

import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.device import memory as M
from kvoffload.pallas import common as _c
from kvoffload.pallas import gather as _ga


def _extent(rng, shape=(5, 2, 24, 80), dtype=jnp.float32):
    x = rng.standard_normal(shape)
    return jnp.asarray(np.where(np.abs(x) < 1e-3, 1e-3, x), dtype)


def _rows(rng, E, n_kv, blk, B=2, K=37):
    block = rng.integers(-2, E + 3, (B, n_kv, K)).astype(np.int32)
    block[0, 0, 0], block[-1, -1, -1] = E - 1, E
    return block, rng.integers(0, blk, (B, n_kv, K)).astype(np.int32)


def _np_gather(x, block, offset):
    x = np.asarray(jnp.asarray(x).astype(jnp.float32))
    E, n_kv = x.shape[:2]
    rows = x[np.clip(block, 0, E - 1), np.arange(n_kv)[None, :, None], offset]
    return np.where(((block >= 0) & (block < E))[..., None], rows, 0.0)


def test_paths_eager_and_jitted_device_and_host():
    """Every path gives NumPy's rows (0 outside the extent) in device memory, eagerly and under jit, and
    gather_block_rows_path() names it: a host extent on this CPU is gathered where it lives (the
    fallback), or copied whole for the interpret-mode kernel; the zero-copy kernel only on a GPU."""
    rng = np.random.default_rng(0)
    x = _extent(rng, dtype=jnp.bfloat16)
    block, offset = _rows(rng, *x.shape[:3])
    want = _np_gather(x, block, offset)
    on_gpu = ops.kernel_default()
    xh = M.to_host(x)
    assert M.memory_kind_of(xh) == "pinned_host"
    cases = [(x, {}, "kernel" if on_gpu else "reference"), (x, dict(impl="reference"), "reference"),
             (x, dict(impl="kernel", interpret=True), "kernel"),
             (xh, {}, "kernel_zero_copy" if on_gpu else "reference_host_gather"),
             (xh, dict(impl="reference"), "reference_host_gather"),
             (xh, dict(impl="kernel", interpret=True), "kernel_device_copy")]
    for arr, kw, path in cases:
        for call in (lambda a: ops.gather_block_rows(a, block, offset, **kw),
                     jax.jit(lambda a: ops.gather_block_rows(a, jnp.asarray(block), jnp.asarray(offset), **kw))):
            out = call(arr)
            assert ops.gather_block_rows_path() == path, (kw, ops.gather_block_rows_path())
            assert out.dtype == x.dtype and M.memory_kind_of(out) == "device"
            np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)


def test_int4_extent_gathers_codes_and_scales():
    """A QuantizedInt extent: codes and group scales gathered alike, dequantized on the device = the
    dequantized extent's rows (host extent, interpret-mode kernel and reference)."""
    rng = np.random.default_rng(1)
    xq = ops.quantize_int4(_extent(rng, (6, 3, 16, 128)), 64)
    block, offset = _rows(rng, 6, 3, 16, K=45)
    want = _np_gather(ops.dequantize(xq), block, offset)
    for arr, kw in [(xq, dict(impl="kernel", interpret=True)), (M.to_host(xq), {})]:
        rows = ops.gather_block_rows(arr, block, offset, **kw)
        assert isinstance(rows, ops.QuantizedInt) and rows.codes.dtype == jnp.uint8
        got = np.asarray(ops.dequantize(rows))
        inside = ((block >= 0) & (block < 6))
        np.testing.assert_array_equal(got[inside], want[inside])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a real GPU compiles the probe: nothing to fall back from")
def test_zero_copy_probe_failure_falls_back_inside_a_trace(monkeypatch):
    """Where the compiled kernel cannot take a host operand (here: a CPU claiming to be a GPU, so the
    probe's compile fails), the probe says so from inside a jit trace and the host gather runs instead."""
    ops.zero_copy_gather_supported.cache_clear()
    monkeypatch.setattr(_c, "on_gpu", lambda: True)
    try:
        rng = np.random.default_rng(2)
        ext = [_extent(rng, (s, 2, 4, 8)) for s in (3, 5)]
        idx = jnp.asarray(rng.integers(0, 32, size=(2, 2, 6)), jnp.int32)
        out = jax.jit(ops.gather_pool_rows, static_argnums=2)([M.to_host(e) for e in ext], idx, 4)
        assert ops.gather_block_rows_path() == "reference_host_gather"
        assert ops.zero_copy_gather_supported() is False
    finally:
        ops.zero_copy_gather_supported.cache_clear()
    flat = np.concatenate([np.asarray(e) for e in ext])
    i = np.asarray(idx)
    np.testing.assert_array_equal(np.asarray(out), flat[i // 4, np.arange(2)[None, :, None], i % 4])


def _host_compute(hlo: str) -> list[str]:
    """Lines of compiled HLO that compute on or move host memory: a gather, elementwise op or copy with
    an S(5) (host memory space) operand or result (the kernel's custom call and parameters may have
    one), or XLA's host compute marker. A copy of the whole extent to the device would show here."""
    bad = []
    for line in hlo.splitlines():
        if 'compute_type="host"' in line or re.search(r"\bhost_compute\b", line):  # not inside a longer name
            bad.append(line)
        elif re.search(r"S\(5\)", line) and re.search(r"\b(gather|select|add|compare|dynamic-slice|copy|copy-start)\(",
                                                     line):
            bad.append(line)
    return bad


@pytest.mark.gpu
def test_gpu_zero_copy_gather_inside_jit_no_host_compute(capfd):
    """On the GPU: ops.gather_pool_rows over pinned_host extents inside a jit takes the zero-copy kernel (path,
    Triton custom call in the compiled HLO), XLA converts nothing into host compute (no such log line,
    no host-space compute in the HLO), and the rows equal NumPy's; the old path is detected as host
    compute by the same checks (so they can fail)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    assert ops.zero_copy_gather_supported()
    rng = np.random.default_rng(3)
    ext = [_extent(rng, (s, 8, 64, 128), jnp.bfloat16) for s in (40, 13)]
    idx = jnp.asarray(rng.integers(0, 53 * 64, size=(2, 8, 700)), jnp.int32)
    host = [M.to_host(e) for e in ext]
    f = jax.jit(ops.gather_pool_rows, static_argnums=2)
    compiled = f.lower(host, idx, 64).compile()
    assert ops.gather_block_rows_path() == "kernel_zero_copy"
    out = f(host, idx, 64)
    hlo = compiled.as_text()
    err = capfd.readouterr().err
    assert "triton" in hlo.lower(), hlo[:3000]
    assert not _host_compute(hlo), _host_compute(hlo)[:5]
    assert "host compute" not in err, err[-3000:]
    assert M.memory_kind_of(out) == "device"
    flat = np.concatenate([np.asarray(e.astype(jnp.float32)) for e in ext])
    i = np.asarray(idx)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  flat[i // 64, np.arange(8)[None, :, None], i % 64])
    # the control: the fallback (XLA's gather of the host extent) is host compute by one check or both
    old = jax.jit(_ga.gather_rows_reference_host).lower(host[0], idx // 64, idx % 64).compile().as_text()
    err = capfd.readouterr().err
    assert _host_compute(old) or "host compute" in err, "the host-compute checks see nothing in the old path"


def test_refill_replaces_only_the_rows_named_from_every_extent():
    """ops.refill_block_rows: rows [0, count) of each (request, head) from the extents holding their tokens,
    the rest of the buffer (a hit head: every row) kept. Native host extents (the CPU's fallback: a gather per
    extent), the interpret-mode kernel (in place, the buffer donated) and int4 extents (gathered, dequantized,
    merged; and the int4 / int8 dequantizing kernel) against NumPy."""
    rng = np.random.default_rng(3)
    sizes, n_kv, blk, d, B, K = (3, 5, 2), 2, 8, 16, 2, 21
    ext = [_extent(rng, (s, n_kv, blk, d)) for s in sizes]
    buf = _extent(rng, (B, n_kv, K, d))
    N = sum(sizes) * blk
    count = np.asarray([[K, 7], [0, 13]])  # request 1 head 0: a hit, every row kept
    tokens = np.where(np.arange(K)[None, None] < count[..., None], rng.integers(0, N, (B, n_kv, K)), -1)
    flat = np.concatenate([np.asarray(e) for e in ext])

    def want_for(rows_from):
        w = np.asarray(buf).copy()
        for b, h, i in zip(*np.nonzero(tokens >= 0)):
            t = tokens[b, h, i]
            w[b, h, i] = rows_from[t // blk, h, t % blk]
        return w

    want = want_for(flat)
    tok = jnp.asarray(tokens, jnp.int32)
    host = [M.to_host(e) for e in ext]
    got = jax.jit(lambda b_, t_, xs: ops.refill_block_rows(b_, xs, t_, blk))(buf, tok, host)
    np.testing.assert_array_equal(np.asarray(got), want)
    fn = jax.jit(lambda b_, t_, xs: ops.refill_block_rows(b_, xs, t_, blk, impl="kernel", interpret=True),
                 donate_argnums=0)
    np.testing.assert_array_equal(np.asarray(fn(jnp.array(buf), tok, ext)), want)
    q = [ops.quantize_int4(e, 8) for e in ext]
    deq = np.concatenate([np.asarray(ops.dequantize(x)) for x in q])
    got = jax.jit(lambda b_, t_, xs: ops.refill_block_rows(b_, xs, t_, blk))(buf, tok, [M.to_host(x) for x in q])
    np.testing.assert_allclose(np.asarray(got), want_for(deq), rtol=0, atol=1e-6)  # dequantized in another fusion
    assert (np.asarray(got)[tokens < 0] == np.asarray(buf)[tokens < 0]).all()
    # int4 and int8 extents through the dequantizing kernel (in place, the buffer donated)
    for x in (q, [ops.quantize_int8(e, 8) for e in ext]):
        deq = np.concatenate([np.asarray(ops.dequantize(e)) for e in x])
        got = fn(jnp.array(buf), tok, x)
        np.testing.assert_allclose(np.asarray(got), want_for(deq), rtol=0, atol=1e-6)
        assert (np.asarray(got)[tokens < 0] == np.asarray(buf)[tokens < 0]).all()


def test_kernels_refuse_1_byte_operands_the_triton_lowering_would_wrap():
    """JAX's Triton lowering addresses operands of at most 4 GiB with 32-bit signed offsets: a uint8 array of
    (2 GiB, 4 GiB] reaches past 2 GiB at negative offsets (an illegal address on an H200). Compiled calls refuse
    it before lowering, with the kernel and operand named; shapes only, nothing allocated."""
    S = jax.ShapeDtypeStruct
    rows = S((1, 8, 16), jnp.int32)
    f = lambda x, b, o: _ga.gather_rows_kernel(x, b, o)  # noqa: E731
    with pytest.raises(_c.KernelAddressingError, match=r"kvo_gather_rows: operand 2 \(uint8 \(32769, 8, 64, 128\)"):
        jax.eval_shape(f, S((32769, 8, 64, 128), jnp.uint8), rows, rows)
    with pytest.raises(_c.KernelAddressingError, match="kvo_refill_rows"):
        jax.eval_shape(lambda b, x, t: _ga.refill_rows_kernel(b, [x], t, 64), S((1, 8, 16, 128), jnp.uint8),
                       S((65536, 8, 64, 128), jnp.uint8), rows)
    for ok in (S((32768, 8, 64, 128), jnp.uint8),  # 2 GiB: the last offset is 2**31 - 1
               S((65537, 8, 64, 128), jnp.uint8),  # past 4 GiB: 64-bit offsets
               S((65536, 8, 64, 128), jnp.bfloat16)):  # 4 GiB of bf16: 2**31 elements
        assert jax.eval_shape(f, ok, rows, rows).shape == (1, 8, 16, 128)
    # interpret mode has no Triton offsets
    jax.eval_shape(lambda x, b, o: _ga.gather_rows_kernel(x, b, o, interpret=True),
                   S((32769, 8, 64, 128), jnp.uint8), rows, rows)


def test_addressable_rows_takes_1_byte_arrays_of_2_to_4_gib_past_4_gib():
    """An extent of 1-byte codes is padded out of the band the Triton lowering addresses wrongly, and only then."""
    S = jax.ShapeDtypeStruct
    row = 8 * 64 * 128
    assert _c.addressable_rows(32768, row) == 32768  # 2 GiB exactly: fine as it is
    assert _c.addressable_rows(100, row) == 100
    assert _c.addressable_rows(65537, row) == 65537  # already past 4 GiB
    for rows in (32769, 63488, 65536):
        got = _c.addressable_rows(rows, row)
        assert got == 65537 and got * row > 2**32
        rows_ = S((1, 8, 16), jnp.int32)
        assert jax.eval_shape(lambda x, b, o: _ga.gather_rows_kernel(x, b, o), S((got, 8, 64, 128), jnp.uint8),
                              rows_, rows_).shape == (1, 8, 16, 128)
