"""K and V recomputed from stored attention-input activations (``recompute_kv``)."""

from __future__ import annotations

import functools

import jax

from kvoffload.device import sharding as _sh
from kvoffload.ops.dispatch import use_kernel
from kvoffload.ops.matmul import few_rows_ok, matmul_f32
from kvoffload.pallas import common as _c
from kvoffload.pallas import recompute as _rc


RECOMPUTE_KERNEL_MIN_TOKENS = 64  # tokens per sequence below which "auto" recompute uses XLA


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
    if impl == "auto" and _c.on_gpu() and few_rows_ok(x, w_v):
        # a decode step's few tokens: W_K and W_V read by the few-row linear (XLA's matmul reads a b1 W_K at
        # 0.5 TB/s); bias and RoPE as the reference
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
