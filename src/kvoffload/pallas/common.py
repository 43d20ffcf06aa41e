"""Shared helpers for the Pallas kernels (Triton lowering) and their references."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvoffload.errors import KVOffloadError

NEG_INF = float("-inf")
# A large finite negative used inside kernels instead of -inf so that
# exp(s - m) never evaluates (-inf) - (-inf) = nan.
MASK_VALUE = -1e30


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cdiv_traced(a, b: int):
    """cdiv of a traced a by a static b."""
    return (a + (b - 1)) // b


def default_scale(d: int, scale):
    return float(d) ** -0.5 if scale is None else float(scale)


def on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except Exception:  # pragma: no cover
        return False


@functools.lru_cache(maxsize=None)
def _compiler_params_cls():
    """The Triton compiler-params class; its name changed across JAX versions."""
    try:
        from jax.experimental.pallas import triton as plgpu
    except Exception:  # pragma: no cover
        return None
    for name in ("CompilerParams", "TritonCompilerParams"):
        cls = getattr(plgpu, name, None)
        if cls is not None:
            return cls
    return None


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """compiler_params for pl.pallas_call on the Triton backend (None if unavailable)."""
    cls = _compiler_params_cls()
    if cls is None:
        return None
    try:
        return cls(num_warps=num_warps, num_stages=num_stages)
    except TypeError:  # pragma: no cover - very old signature
        return dict(triton=dict(num_warps=num_warps, num_stages=num_stages))


def memory_kind(x) -> str | None:
    """Memory kind of a concrete jax.Array ('device', 'pinned_host', ...) or None for tracers."""
    try:
        sh = x.sharding
    except Exception:
        return None
    return getattr(sh, "memory_kind", None)


def to_device_memory(x):
    """Copy an array that lives in a host memory kind to device memory (eager)."""
    mk = memory_kind(x)
    if mk is None or mk == "device":
        return x
    return jax.device_put(x, x.sharding.with_memory_kind("device"))


def online_softmax_init(rows: int):
    """(running max, running sum) before the first key block of an online softmax."""
    return jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)


def online_softmax_step(m, l, s, row_ok):
    """One key block of the online softmax (flash attention's update). s [R, block] scores,
    row_ok [block] valid keys (or [R, block]: per row, e.g. a causal mask). Returns (m_new, l_new, p,
    alpha): p are the block's unnormalised probabilities (0 on invalid keys), alpha rescales what was
    accumulated so far."""
    ok = row_ok if row_ok.ndim == 2 else row_ok[None, :]
    s = jnp.where(ok, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
    return m_new, l * alpha + jnp.sum(p, axis=1), p, alpha


def decode_tiles(d: int, G: int, S: int, block_s: int | None = None):
    """Power-of-two tile sizes of the decode-style kernels: (padded head dim, padded group rows,
    key block). H200 sweep (BENCHMARKS.md): key block 128 was best for head dims up to 128."""
    dp = max(16, next_pow2(d))
    Gp = max(16, next_pow2(G))
    if block_s is None:
        block_s = 128 if dp <= 128 else 64
    return dp, Gp, min(block_s, max(16, next_pow2(S)))


def softmax_stats_to_out(acc, l, m):
    """acc/l with l == 0 -> 0; lse = m + log(l), -inf where l == 0."""
    safe_l = jnp.where(l > 0, l, 1.0)
    out = acc / safe_l[..., None]
    lse = jnp.where(l > 0, m + jnp.log(safe_l), NEG_INF)
    return out, lse


def load(ref, mask=None, other=None):
    """Masked load from a (possibly indexed, ``ref.at[...]``) ref inside a Triton kernel."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref, mask=mask, other=other)


def dot(a, b, trans_b=False):
    """2-D matmul with fp32 accumulation; fp32 operands use IEEE (not tf32) precision."""
    contract_b = 1 if trans_b else 0
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())),
        precision=prec, preferred_element_type=jnp.float32,
    )


class KernelAddressingError(KVOffloadError, ValueError):
    """An operand the Triton lowering would address past its end (see `check_triton_offsets`)."""


def check_triton_offsets(name: str, arrays) -> None:
    """Refuse an operand that JAX's Triton lowering would address wrongly. It computes element offsets in
    32-bit signed integers unless the operand is larger than 4 GiB (jax/_src/pallas/triton/lowering.py,
    `_compute_offsets_from_indices`, JAX 0.10.2 and 0.11.2), so a 1-byte array (uint8 int4 / int8 codes) of
    more than 2 GiB and at most 4 GiB reaches its elements past 2**31 - 1 at negative offsets: an illegal
    address on an H200, or a silent read of whatever lies below the array. Wider dtypes stay under 2**31
    elements at 4 GiB, and larger arrays get 64-bit offsets. arrays: anything with .shape and .dtype."""
    for i, a in enumerate(x for x in jax.tree.leaves(arrays) if hasattr(x, "shape") and hasattr(x, "dtype")):
        n = math.prod(int(s) for s in a.shape)
        if jnp.dtype(a.dtype).itemsize == 1 and 2**31 < n <= 2**32:
            raise KernelAddressingError(
                f"kernel {name}: operand {i} ({jnp.dtype(a.dtype).name} {tuple(a.shape)}, {n:,} bytes) is a "
                f"1-byte array of more than 2 GiB and at most 4 GiB, which JAX's Triton lowering addresses with "
                f"32-bit offsets that wrap past 2 GiB; keep such arrays (an extent's int4 / int8 codes) under 2 GiB, "
                f"e.g. with a smaller extent_mb")


def addressable_rows(rows: int, row_bytes_1byte: int) -> int:
    """The fewest rows >= rows for which an array of 1-byte rows of row_bytes_1byte bytes each is addressed right by
    the Triton lowering (`check_triton_offsets`): rows unchanged at 2 GiB or less, else more than 4 GiB (64-bit
    offsets). For arrays that must hold many layers' blocks in one extent (a step looping over stacked layers reads
    them at offset ids), where splitting the extent would need a branch per layer; the padding stays unread."""
    n = int(rows) * int(row_bytes_1byte)
    if 2**31 < n <= 2**32:
        return 2**32 // int(row_bytes_1byte) + 1
    return int(rows)


def pallas_call(kernel, *, out_shape, in_specs, out_specs, poison=False, **kwargs):
    """pl.pallas_call wrapper; with poison=True the outputs start as NaN (floats) /
    min-int buffers aliased in, so elements the kernel never writes show up in checks. Compiled (not
    interpreted) calls refuse operands `check_triton_offsets` refuses, before lowering."""
    from jax.experimental import pallas as pl

    call = _pallas_call(pl, kernel, out_shape, in_specs, out_specs, poison, kwargs)
    if kwargs.get("interpret", False):
        return call
    name = kwargs.get("name") or getattr(kernel, "__name__", "pallas kernel")

    def checked(*args):
        check_triton_offsets(name, [args, out_shape])
        return call(*args)

    return checked


def _pallas_call(pl, kernel, out_shape, in_specs, out_specs, poison, kwargs):
    if not poison:
        return pl.pallas_call(kernel, out_shape=out_shape, in_specs=in_specs,
                              out_specs=out_specs, **kwargs)
    outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
    ospecs = list(out_specs) if isinstance(out_specs, (list, tuple)) else [out_specs]
    n_out = len(outs)

    def call(*args):
        n_in = len(args)

        def wrapped(*refs):
            kernel(*refs[:n_in], *refs[n_in + n_out:])

        inits = []
        for o in outs:
            if jnp.issubdtype(o.dtype, jnp.floating):
                inits.append(jnp.full(o.shape, jnp.nan, o.dtype))
            else:
                inits.append(jnp.full(o.shape, jnp.iinfo(o.dtype).min, o.dtype))
        aliases = {n_in + i: i for i in range(n_out)}
        return pl.pallas_call(
            wrapped, out_shape=out_shape, in_specs=list(in_specs) + ospecs,
            out_specs=out_specs, input_output_aliases=aliases, **kwargs,
        )(*args, *inits)

    return call


def bf16_head(x):
    """float32 x with the low 16 bits of its significand cleared: a value bf16 holds exactly,
    and x - bf16_head(x) is exact. Cleared by a bit mask, not rounded through bf16, because XLA
    on GPU (xla_allow_excess_precision, on by default) deletes an f32 -> bf16 -> f32 convert
    pair, which made the split's remainder 0 in interpret mode there."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)


def dot_split(a, b, n_terms=3, trans_b=False):
    """a (float32) @ b (bf16-exact values, e.g. int4 codes) on bf16 tensor cores with a
    split into n_terms bf16 pieces (each takes the next >= 8 significant bits, so 3 terms
    reproduce a float32 a exactly); fp32 accumulation."""
    bb = b.astype(jnp.bfloat16)
    rest = a.astype(jnp.float32)
    acc = None
    for i in range(n_terms):
        head = bf16_head(rest)
        t = dot(head.astype(jnp.bfloat16), bb, trans_b=trans_b)
        acc = t if acc is None else acc + t
        if i + 1 < n_terms:
            rest = rest - head
    return acc


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the first device (132 on H100/H200 if unknown)."""
    try:
        n = int(getattr(jax.devices()[0], "core_count", 0) or 0)
    except Exception:  # pragma: no cover
        n = 0
    return n if n > 0 else 132


def split_blocks(B, n_kv, n_blocks, num_splits=None, programs_per_sm=2):
    """(blocks_per_split, num_splits) of a flash-decoding grid (B, n_kv, splits) over n_blocks blocks a head:
    num_splits (default `choose_splits`) equalised so that every split holds blocks_per_split blocks but the
    last, and none is empty."""
    if num_splits is None:
        num_splits = choose_splits(B, n_kv, n_blocks, programs_per_sm)
    per = cdiv(n_blocks, num_splits)
    return per, cdiv(n_blocks, per)


def choose_splits(B, n_kv, n_blocks, programs_per_sm=2, max_splits=128):
    """Number of sequence splits so that B*n_kv*splits ~ programs_per_sm * SMs (one
    wave, no tail); any integer (chunks stay block-aligned)."""
    target = programs_per_sm * num_sms()
    splits = max(1, min(cdiv(target, B * n_kv), n_blocks, max_splits))
    # equalise the chunks: the same number of blocks per split
    per = cdiv(n_blocks, splits)
    return cdiv(n_blocks, per)
