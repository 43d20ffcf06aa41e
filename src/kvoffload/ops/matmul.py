"""Linear layers: ``matmul_f32`` (a model's linears and logits, fp32 accumulation) and ``stacked_linear`` (a
layer's weight read in place from a stacked [L, K, N] array by layer index)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvoffload.device import sharding as _sh
from kvoffload.ops.dispatch import use_kernel
from kvoffload.pallas import stacked_linear as _sl


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


def few_rows_ok(x, w) -> bool:
    """Whether "auto" may take the few-row kernel for x @ w (`matmul_f32`, `recompute_kv`): a [K, N] weight,
    at most FEW_ROWS_MAX rows of x in w's 16-bit dtype, one device."""
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
    different orders: the last bits of a bf16 result can differ, so every policy goes through this one function."""
    if use_kernel(impl, few_rows_ok(x, w)):
        return _matmul_f32_kernel(x, w, interpret)
    return _matmul_f32_reference(x, w)
