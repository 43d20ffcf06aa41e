"""Kernel and reference checks against float64 NumPy (CPU: kernels in interpret mode).

Default run: a covering subset (each GQA group 1/3/4/7/8, head_dim 64/80/96/128, fp32 and
bf16, ragged lengths, length 1 and 0). ``-m slow`` adds the exhaustive sweeps.
"""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.pallas.scores import hata_scores_kernel
from kvoffload.testing import cases, oracles
from kvoffload.testing.attention import check_decode

_run = cases.run_case  # kernel checks take a mode; reference-only checks do not


def _assert(r):
    assert r["ok"], r


_REF = cases.reference_cases()
_KER = cases.kernel_cases()


@pytest.mark.parametrize("fn,kw", _REF, ids=[cases.case_id(f, k) for f, k in _REF])
def test_reference(fn, kw):
    _assert(_run(fn, kw, "reference"))


@pytest.mark.parametrize("fn,kw", _KER, ids=[cases.case_id(f, k) for f, k in _KER])
def test_kernel_interpret(fn, kw):
    _assert(_run(fn, kw, "interpret"))


def test_coverage_of_shapes():
    """The default subset covers every group size and head dim for decode attention."""
    dec = [kw for f, kw in _KER if f is check_decode]
    assert {kw.get("G", 4) for kw in dec} >= {1, 3, 4, 7, 8}
    assert {kw.get("d", 128) for kw in dec} >= {64, 80, 96, 128}
    assert {kw.get("dtype", "float32") for kw in dec} == {"float32", "bfloat16"}


def _inputs(B=2, n_kv=2, G=3, S=64, d=64, seed=1):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, n_kv, S, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, n_kv, S, d)), jnp.float32)
    return q, k, v


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _runs_kernel(call):
    """Whether call() (an ops function) runs a Pallas kernel: its program holds a pallas_call."""
    return "pallas_call" in str(jax.make_jaxpr(call)())


def _assert_matches(res, o64, l64, tol=1e-5):
    out, lse = res
    assert oracles.rel_err(out, o64) < tol and oracles.lse_err(lse, l64) < tol


def test_ops_dispatch_and_jit():
    """"auto" runs the kernel exactly where kernel_default() says (GPU), the reference elsewhere;
    every implementation, eager or jitted, matches float64 NumPy."""
    q, k, v = _inputs()
    L = jnp.array([64, 5], jnp.int32)
    assert ops.kernel_default() == (jax.default_backend() == "gpu")
    assert _runs_kernel(lambda: ops.decode_attention(q, k, v, L)) == ops.kernel_default()
    assert _runs_kernel(lambda: ops.decode_attention(q, k, v, L, impl="kernel", interpret=True))
    assert not _runs_kernel(lambda: ops.decode_attention(q, k, v, L, impl="reference"))
    valid = np.broadcast_to(np.arange(64)[None, None] < np.asarray(L)[:, None, None], (2, 2, 64))
    o64, l64 = oracles.np_attend(_f64(q), _f64(k), _f64(v), valid, 64 ** -0.5)
    for res in (ops.decode_attention(q, k, v, L),
                ops.decode_attention(q, k, v, L, impl="kernel", interpret=True),
                ops.decode_attention(q, k, v, L, impl="reference"),
                jax.jit(lambda *a: ops.decode_attention(*a))(q, k, v, L)):
        _assert_matches(res, o64, l64)
    with pytest.raises(ValueError):
        ops.decode_attention(q, k, v, L, impl="bogus")


def test_merge_kernel_sources():
    """Kernel partials over two disjoint sources merge to the full attention."""
    q, k, v = _inputs(S=96)
    L = jnp.array([96, 50], jnp.int32)
    full = ops.decode_attention(q, k, v, L)
    a = ops.decode_attention(q, k[:, :, :32], v[:, :, :32], jnp.minimum(L, 32), impl="kernel",
                             interpret=True)
    b = ops.decode_attention(q, k[:, :, 32:], v[:, :, 32:], L - 32, impl="kernel",
                             interpret=True)
    o, l = ops.merge_attention([a, b])
    np.testing.assert_allclose(np.asarray(o), np.asarray(full[0]), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(l), np.asarray(full[1]), rtol=2e-5, atol=2e-6)


def test_sparse_paths_and_pinned_host():
    """sparse_attention_path() names the path each call took, as the backend implies; every
    path matches float64 NumPy."""
    q, k, v = _inputs(S=128)
    idx = jnp.asarray(np.random.default_rng(2).permutation(128)[:16].reshape(1, 1, 16)
                      .repeat(2, 0).repeat(2, 1), jnp.int32)
    pos, ok = oracles.np_positions(np.asarray(idx), None, 1, 128)
    valid = np.zeros((2, 2, 128), bool)
    for b in range(2):
        for h in range(2):
            valid[b, h, pos[b, h][ok[b, h]]] = True
    o64, l64 = oracles.np_attend(_f64(q), _f64(k), _f64(v), valid, 64 ** -0.5)
    on_gpu = ops.kernel_default()

    def check(k, v, paths, **kw):
        _assert_matches(ops.sparse_attention(q, k, v, idx, **kw), o64, l64)
        assert ops.sparse_attention_path() in paths, (kw, ops.sparse_attention_path())

    check(k, v, {"kernel" if on_gpu else "reference"})
    check(k, v, {"reference"}, impl="reference")
    check(k, v, {"kernel"}, impl="kernel", interpret=True)
    dev = jax.devices()[0]
    if "pinned_host" in {m.kind for m in dev.addressable_memories()}:
        sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        kh, vh = jax.device_put(k, sh), jax.device_put(v, sh)
        assert kh.sharding.memory_kind == "pinned_host"
        # GPU: the compiled kernel reads host memory directly, or, where the runtime refuses host
        # operands, copies K/V to the device first (the documented fallback); elsewhere the
        # reference after a copy. Interpret mode never tries the zero-copy path.
        check(kh, vh, {"kernel_zero_copy", "kernel_device_copy"} if on_gpu
              else {"reference_device_copy"})
        check(kh, vh, {"reference_device_copy"}, impl="reference")
        check(kh, vh, {"kernel_device_copy"}, impl="kernel", interpret=True)
    # under jit the choice is by platform
    call = lambda: jax.jit(lambda *a: ops.sparse_attention(*a))(q, k, v, idx)  # noqa: E731
    _assert_matches(call(), o64, l64)
    assert ops.sparse_attention_path() == "traced"
    assert _runs_kernel(call) == on_gpu


def test_topk_pipeline_to_sparse_attention():
    """scores -> select_topk (sink/recent forced) -> sparse attention equals dense
    attention restricted to the selection."""
    q, k, v = _inputs(S=200, G=4)
    L = jnp.array([200, 70], jnp.int32)
    sc = ops.topk_scores_exact(q, k, L)
    idx, nv = ops.topk_indices(sc, 32, lengths=L, num_sink=4, num_recent=8)
    assert np.all(np.asarray(nv) == 32)
    out, lse = ops.sparse_attention(q, k, v, idx, num_valid=nv)
    # dense with a mask
    mask = np.zeros((2, 2, 200), bool)
    for b in range(2):
        for h in range(2):
            mask[b, h, np.asarray(idx[b, h, : nv[b, h]])] = True
            assert mask[b, h, :4].all() and mask[b, h, int(L[b]) - 8: int(L[b])].all()
    o64, l64 = oracles.np_attend(np.asarray(q, np.float64), np.asarray(k, np.float64),
                           np.asarray(v, np.float64), mask, 64 ** -0.5)
    assert oracles.rel_err(out, o64) < 1e-5
    assert oracles.lse_err(lse, l64) < 1e-5


def test_int4_ops():
    """int4 decode: "auto" runs the kernel on GPU for supported shapes (d 128, group 64) and the
    reference for others (d 96, group 32); every path matches float64 NumPy attention over the
    dequantised cache."""
    for d, gs, supported in ((128, 64, True), (96, 32, False)):
        q, k, v = _inputs(S=80, d=d)
        kq, vq = ops.quantize_int4(k, gs), ops.quantize_int4(v, gs)
        assert kq.codes.dtype == jnp.uint8 and kq.codes.shape == (2, 2, 80, d // 2)
        L = jnp.array([80, 3], jnp.int32)
        valid = np.broadcast_to(np.arange(80)[None, None] < np.asarray(L)[:, None, None],
                                (2, 2, 80))
        o64, l64 = oracles.np_attend(_f64(q), _f64(ops.dequantize(kq)),
                               _f64(ops.dequantize(vq)), valid, d ** -0.5)
        auto = lambda: ops.decode_attention_int4(q, kq, vq, L)  # noqa: E731
        assert _runs_kernel(auto) == (ops.kernel_default() and supported)
        results = [auto(), ops.decode_attention_int4(q, kq, vq, L, impl="reference"),
                   ops.decode_attention(q, ops.dequantize(kq), ops.dequantize(vq), L)]
        if supported:
            results.append(ops.decode_attention_int4(q, kq, vq, L, impl="kernel", interpret=True))
        for res in results:
            _assert_matches(res, o64, l64)


@pytest.mark.parametrize("d,T,rope,bias", [(80, 9, True, True), (64, 9, False, True),
                                           (64, 64, True, False)])
def test_recompute_ops(d, T, rope, bias):
    """recompute_kv equals float64 NumPy (x W + b, RoPE on K). "auto" takes the kernel only on
    GPU, for a supported head dim (d 80 is not) and blocks of >= 64 tokens."""
    rng = np.random.default_rng(d + T)
    B, H, n_kv = 2, 64, 2
    x = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    wk, wv = (jnp.asarray(rng.standard_normal((H, n_kv * d)) * H ** -0.5, jnp.float32)
              for _ in range(2))
    bk, bv = ((jnp.asarray(rng.standard_normal(n_kv * d), jnp.float32) for _ in range(2))
              if bias else (None, None))
    if rope:
        ang = rng.uniform(0, 2 * np.pi, (B, T, d // 2))
        cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    else:
        cos = sin = None
    f = (lambda a: None if a is None else _f64(a))  # noqa: E731
    zero = np.zeros(n_kv * d)
    k64, v64 = oracles.np_recompute_kv(f(x), f(wk), zero if bk is None else f(bk), f(wv),
                                 zero if bv is None else f(bv), f(cos), f(sin), n_kv)
    call = lambda **o: ops.recompute_kv(x, wk, bk, wv, bv, cos, sin, n_kv=n_kv, **o)  # noqa: E731
    kernel_ok = d != 80 and T >= ops.RECOMPUTE_KERNEL_MIN_TOKENS
    assert _runs_kernel(call) == (ops.kernel_default() and kernel_ok)
    results = [call(), call(impl="reference")]
    if d != 80:
        results.append(call(impl="kernel", interpret=True))
    for kk, vv in results:
        assert kk.shape == vv.shape == (B, n_kv, T, d) and kk.dtype == jnp.float32
        assert oracles.rel_err(kk, k64) < 1e-5 and oracles.rel_err(vv, v64) < 1e-5


def test_few_row_linear_dispatch_values_and_gradient():
    """ops.matmul_f32 (every model linear and the logits): "auto" takes the stacked-linear kernel on a GPU for up
    to FEW_ROWS_MAX rows of a bf16 x and w, XLA's einsum for more rows or fp32; both equal float64 NumPy up to fp32
    summation order, in fp32; the kernel's gradient is the einsum's. A decode step's K/V recompute goes through it."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((300, 70)) * 300 ** -0.5, jnp.bfloat16)
    for rows, dtype in ((ops.FEW_ROWS_MAX, jnp.bfloat16), (ops.FEW_ROWS_MAX + 1, jnp.bfloat16), (1, jnp.float32)):
        x = jnp.asarray(rng.standard_normal((rows, 1, 300)), dtype)
        ww = w.astype(dtype)
        want = _f64(x).reshape(rows, 300) @ _f64(ww)
        assert _runs_kernel(lambda: ops.matmul_f32(x, ww)) == (
            ops.kernel_default() and rows <= ops.FEW_ROWS_MAX and dtype == jnp.bfloat16)
        for got in (ops.matmul_f32(x, ww), ops.matmul_f32(x, ww, impl="kernel", interpret=True),
                    ops.matmul_f32(x, ww, impl="reference")):
            assert got.shape == (rows, 1, 70) and got.dtype == jnp.float32
            assert np.abs(want).max() > 1 and oracles.rel_err(got.reshape(rows, 70), want) < 1e-5

    x = jnp.asarray(rng.standard_normal((2, 1, 300)), jnp.bfloat16)
    tgt = jnp.asarray(rng.standard_normal((2, 1, 70)), jnp.float32)

    def grads(impl):
        return jax.grad(lambda x, w: jnp.sum(ops.matmul_f32(x, w, impl=impl, interpret=True) * tgt),
                        argnums=(0, 1))(x, w)

    for got, want in zip(grads("kernel"), grads("reference")):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))

    # the K/V recompute of a decode step with the few-row linear as its matmul: the reference's values
    from kvoffload.pallas import recompute as _rc

    wk, wv = (jnp.asarray(rng.standard_normal((300, 2 * 16)) * 0.06, jnp.bfloat16) for _ in range(2))
    bk = jnp.asarray(rng.standard_normal(32), jnp.bfloat16)
    ang = jnp.asarray(rng.uniform(0, 6, (2, 1, 8)), jnp.float32)
    kern = _rc.recompute_kv_reference(x, wk, bk, wv, None, jnp.cos(ang), jnp.sin(ang), n_kv=2,
                                      matmul=lambda a, w: ops.matmul_f32(a, w, impl="kernel", interpret=True))
    ref = _rc.recompute_kv_reference(x, wk, bk, wv, None, jnp.cos(ang), jnp.sin(ang), n_kv=2)
    for a, b in zip(kern, ref):
        assert a.shape == (2, 2, 1, 16) and a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                   rtol=0, atol=2e-2)


def test_topk_score_ops_dispatch():
    """quest / hata / tokenselect ops: impl="kernel" (interpret) == "reference" == "auto"
    (the reference on CPU); bad impl / group_reduce / popcount raise."""
    q, k, _ = _inputs(B=2, n_kv=2, G=3, S=48, d=64)
    L = jnp.array([48, 21], jnp.int32)
    kmin, kmax = ops.quest_page_minmax(k, 16, L)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((64, 64)), jnp.float32)
    qc, kc = ops.hata_encode(q, w), ops.hata_encode(k, w)
    kn = jnp.linalg.norm(k, axis=-1)
    calls = {
        "quest": lambda **o: ops.quest_page_scores(q, kmin, kmax, jnp.array([3, 2]), **o),
        "hata": lambda **o: ops.hata_scores(qc, kc, L, k_norm=kn, group_reduce="max", **o),
        "tokenselect": lambda **o: ops.tokenselect_scores(q, k, L, shared=True, **o),
    }
    for name, f in calls.items():
        ref = np.asarray(f(impl="reference"))
        fin = np.isfinite(ref)
        assert fin.any() and (~fin).any(), name  # both valid and -inf entries exercised
        outs = [f(), f(impl="kernel", interpret=True)]  # the kernel path runs under jit
        for o in outs:
            o = np.asarray(o)
            assert o.shape == ref.shape and o.dtype == np.float32, name
            np.testing.assert_array_equal(np.isneginf(o), ~fin, err_msg=name)
            np.testing.assert_allclose(o[fin], ref[fin], rtol=2e-6, atol=1e-6, err_msg=name)
        with pytest.raises(ValueError):
            f(impl="bogus")
    with pytest.raises(ValueError):
        ops.quest_page_scores(q, kmin, kmax, impl="kernel", interpret=True, group_reduce="min")

    with pytest.raises(ValueError):
        hata_scores_kernel(qc, kc, L, interpret=True, popcount="table")


_REF_FULL = cases.reference_cases(full=True)
_KER_FULL = cases.kernel_cases(full=True)


@pytest.mark.slow
@pytest.mark.parametrize("fn,kw", _REF_FULL, ids=[cases.case_id(f, k) for f, k in _REF_FULL])
def test_reference_full(fn, kw):
    _assert(_run(fn, kw, "reference"))


@pytest.mark.slow
@pytest.mark.parametrize("fn,kw", _KER_FULL, ids=[cases.case_id(f, k) for f, k in _KER_FULL])
def test_kernel_interpret_full(fn, kw):
    _assert(_run(fn, kw, "interpret"))


_GPU = cases.gpu_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("fn,kw", _GPU, ids=[cases.case_id(f, k) for f, k in _GPU])
def test_kernel_compiled_gpu(fn, kw):
    """Compiled Triton kernels on a GPU (pytest -m gpu); same suite as benchmarks/check_kernels.py."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _assert(_run(fn, kw, "kernel"))


@pytest.mark.parametrize("rope,bias", [(True, True), (False, False)])
def test_recompute_kernel_gradient_is_reference_gradient(rope, bias):
    """Training differentiates through ops.recompute_kv; the kernel path must give the
    reference's gradients (its backward pass is the reference's vjp)."""
    from kvoffload import ops

    rng = np.random.default_rng(7)
    B, T, H, n_kv, d = 1, 64, 32, 2, 32
    x = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    wk, wv = (jnp.asarray(rng.standard_normal((H, n_kv * d)) * 0.2, jnp.float32) for _ in range(2))
    bk, bv = ((jnp.asarray(rng.standard_normal(n_kv * d), jnp.float32) for _ in range(2)) if bias else (None, None))
    if rope:
        ang = jnp.asarray(rng.uniform(0, 6, (B, T, d // 2)), jnp.float32)
        cos, sin = jnp.cos(ang), jnp.sin(ang)
    else:
        cos = sin = None
    tgt = jnp.asarray(rng.standard_normal((2, B, n_kv, T, d)), jnp.float32)

    def loss(impl):
        def f(x, wk):
            k, v = ops.recompute_kv(x, wk, bk, wv, bv, cos, sin, n_kv=n_kv, impl=impl, interpret=True)
            return jnp.sum(k * tgt[0]) + jnp.sum(v * v * tgt[1])
        return jax.grad(f, argnums=(0, 1))(x, wk)

    for got, want in zip(loss("kernel"), loss("reference")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# "normal" slow: [ties], [infinities], [signed_zeros] stay in the default run
@pytest.mark.parametrize("kind", [pytest.param("normal", marks=pytest.mark.slow), "ties", "infinities", "signed_zeros"])
def test_top_count_ascending_methods_against_numpy(kind):
    """The selection's top-k methods (sort; radix select + compaction in XLA, 4- and 2-bit digits) against a stable
    NumPy argsort: per-row counts, ties to the lower index, -inf never chosen, +inf first, -0.0 == 0.0. The Pallas
    select is checked against the sort in `test_kernel_interpret` (select_rows: normal, ties, +/-inf, a count-0
    row, small launch pieces)."""
    from kvoffload.pallas import topk as tk

    rng = np.random.default_rng(["normal", "ties", "infinities", "signed_zeros"].index(kind))
    for R, N, k in ((3, 257, 40), (2, 64, 64)):  # fixed shapes: one compilation each per method
        pri = rng.standard_normal((R, N)).astype(np.float32)
        if kind == "ties":
            pri = rng.integers(0, 5, (R, N)).astype(np.float32)
        elif kind == "infinities":
            pri[rng.random((R, N)) < 0.3] = -np.inf
            pri[rng.random((R, N)) < 0.05] = np.inf
        elif kind == "signed_zeros":
            pri = (pri * 1e-30).astype(np.float32)
            pri[:, ::3], pri[:, 1::7] = -0.0, 0.0
        counts = rng.integers(0, k + 3, R).astype(np.int32)
        want_idx, want_nv = np.zeros((R, k), np.int32), np.zeros(R, np.int32)
        for r in range(R):
            n = min(counts[r], int(np.sum(pri[r] > -np.inf)), k)
            want_idx[r, :n] = np.sort(np.argsort(-pri[r], kind="stable")[:n])
            want_nv[r] = n
        methods = [("sort", 4), ("radix", 4 if kind != "ties" else 2)]
        for method, bits in methods:
            idx, nv = tk.top_count_ascending(jnp.asarray(pri), jnp.asarray(counts), k, method=method,
                                             digit_bits=bits)
            np.testing.assert_array_equal(np.asarray(nv), want_nv)
            np.testing.assert_array_equal(np.asarray(idx), want_idx, err_msg=f"{method} {bits}")


def test_prefix_count_against_cumsum():
    from kvoffload.pallas import topk as tk

    m = np.random.default_rng(0).random((3, 1000)) < 0.4
    np.testing.assert_array_equal(np.asarray(tk.prefix_count(jnp.asarray(m))), np.cumsum(m, axis=1))
