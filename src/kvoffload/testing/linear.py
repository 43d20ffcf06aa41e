"""Checks of the linear kernels against float64 NumPy: K/V recomputed from the stored activation X (bias, RoPE),
and x @ w[layer] of a stacked weight."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from kvoffload.pallas import recompute as _rc
from kvoffload.pallas import stacked_linear as _sl
from kvoffload.testing.oracles import TOL, _dt, _rand, _result, np_recompute_kv, rel_err


def check_recompute(B=2, T=40, H=128, n_kv=2, d=64, dtype="float32", bias=True, rope=True,
                    mode="reference", seed=0, **kw):
    rng = np.random.default_rng(seed)
    x, x64 = _rand(rng, (B, T, H), dtype)
    wk, wk64 = _rand(rng, (H, n_kv * d), dtype, scale=H ** -0.5)
    wv, wv64 = _rand(rng, (H, n_kv * d), dtype, scale=H ** -0.5)
    if bias:
        bk, bk64 = _rand(rng, (n_kv * d,), dtype)
        bv, bv64 = _rand(rng, (n_kv * d,), dtype)
    else:
        bk = bv = None
        bk64 = bv64 = np.zeros(n_kv * d)
    if rope:
        ang = rng.uniform(0, 2 * np.pi, (B, T, d // 2))
        cos, cos64 = _rand(rng, (B, T, d // 2), dtype)
        cos = jnp.asarray(np.cos(ang), _dt(dtype))
        sin = jnp.asarray(np.sin(ang), _dt(dtype))
        cos64 = np.asarray(cos.astype(jnp.float32), np.float64)
        sin64 = np.asarray(sin.astype(jnp.float32), np.float64)
    else:
        cos = sin = None
    k64, v64 = np_recompute_kv(x64, wk64, bk64, wv64, bv64, cos64 if rope else None,
                               sin64 if rope else None, n_kv)
    args = (x, wk, bk, wv, bv, cos, sin)
    if mode == "reference":
        k, v = _rc.recompute_kv_reference(*args, n_kv=n_kv)
    else:
        k, v = _rc.recompute_kv_kernel(*args, n_kv=n_kv, interpret=(mode == "interpret"),
                                       poison=True, **kw)
    errs = dict(err_k=rel_err(k, k64), err_v=rel_err(v, v64))
    r = _result(f"recompute B{B} T{T} H{H} kv{n_kv} d{d} bias{int(bias)} rope{int(rope)} "
                f"{dtype}", mode, errs, TOL[dtype])
    r["ok"] = r["ok"] and k.dtype == x.dtype and v.dtype == x.dtype
    return r


def check_stacked_linear(L=3, M=1, K=300, N=130, dtype="float32", mode="reference", seed=0, **kw):
    """x @ w[layer] for every layer of a stacked w, the layer a traced index (as in a loop over layers), vs
    float64 NumPy: random x and w (never zeros), odd K and N (masked edges), several K splits."""
    rng = np.random.default_rng(seed)
    x, x64 = _rand(rng, (M, K), dtype)
    w, w64 = _rand(rng, (L, K, N), dtype, scale=K ** -0.5)
    if mode == "reference":
        fn = jax.jit(_sl.stacked_linear_reference)
    else:
        fn = jax.jit(lambda x, w, i: _sl.stacked_linear_kernel(x, w, i, interpret=(mode == "interpret"),
                                                               poison=True, **kw))
    errs, ok = {}, True
    for layer in range(L):
        out = fn(x, w, jnp.int32(layer))
        errs[f"err_layer{layer}"] = rel_err(out, x64 @ w64[layer])
        ok = ok and out.dtype == x.dtype and out.shape == (M, N)
    r = _result(f"stacked_linear L{L} M{M} K{K} N{N} {dtype}", mode, errs, TOL[dtype])
    r["ok"] = r["ok"] and ok
    return r
