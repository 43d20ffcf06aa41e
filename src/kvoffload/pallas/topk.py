"""Top-k selection for sparse attention: the top entries of each KV head's scores (`pallas.scores`), with
forced sink / recent windows.

``select_topk`` turns scores float32 [B, n_kv, N] (N = tokens or pages, higher = more relevant, -inf invalid)
into (indices [B, n_kv, K] int32 sorted ascending, num_valid [B, n_kv] int32) ready for
:func:`kvoffload.ops.sparse_attention`. Under it ``top_count_ascending`` takes a count per row and one of three
exact methods, the same indices: XLA's sort, a radix select and compaction in XLA (`kth_largest_key`,
`prefix_count`), or the Pallas kernels of `pallas/select.py` over `orderable_keys`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvoffload.pallas.common import NEG_INF, on_gpu


def orderable_keys(x):
    """float32 -> uint32 keys with the same order (larger float, larger key; -inf lowest, +inf highest;
    -0.0 and 0.0 one key: equal values tie)."""
    x = x.astype(jnp.float32)
    u = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where((u >> 31) == 1, ~u, u | jnp.uint32(0x80000000))


def kth_largest_key(keys, k, *, digit_bits=4):
    """Radix select, most significant digit first: (T [R] uint32, take [R] int32) such that the k-th largest
    of keys [R, N] (uint32) is T and the top k are every key > T plus the first `take` keys == T (in index
    order). k [R] int32 in [1, N]. Each of the 32 / digit_bits rounds counts, for every candidate digit, the
    keys that share the prefix found so far and have a digit at least as large: one fused compare-and-sum
    over the row, no sort and no atomics. A row with k outside [1, N] gives an unspecified T (callers mask)."""
    assert 32 % digit_bits == 0, digit_bits
    R, N = keys.shape
    width = 1 << digit_bits
    cands = jnp.arange(1, width, dtype=jnp.uint32)
    prefix = jnp.zeros((R,), jnp.uint32)
    remaining = k.astype(jnp.int32)
    for shift in range(32 - digit_bits, -1, -digit_bits):
        above = shift + digit_bits
        digit = (keys >> shift) & jnp.uint32(width - 1)
        if above < 32:
            match = (keys >> above) == (prefix >> above)[:, None]
        else:
            match = jnp.ones_like(keys, dtype=bool)
        # counts[:, c - 1] = #(match & digit >= c), c = 1..width-1: non-increasing in c. Candidates major and
        # the row minor: a row reduction per (row, candidate), which XLA spreads over the GPU's SMs (candidates
        # minor measured 1.6x slower on an H100)
        counts = jnp.sum(match[:, None, :] & (digit[:, None, :] >= cands[None, :, None]), axis=2,
                         dtype=jnp.int32)
        d = jnp.sum(counts >= remaining[:, None], axis=1, dtype=jnp.int32)  # the largest c still holding k
        higher = jnp.take_along_axis(jnp.pad(counts, ((0, 0), (0, 1))), d[:, None], axis=1)[:, 0]  # > d
        remaining = remaining - higher
        prefix = prefix | (d.astype(jnp.uint32) << shift)
    return prefix, remaining


def prefix_count(mask, chunk=128):
    """Inclusive running count of True along the last axis of mask [R, N], as int32. Within chunks of
    `chunk` a 0/1 matmul with a triangular matrix (exact: bf16 0/1 inputs, fp32 sums <= chunk), across chunks
    a cumsum over N / chunk totals: a long cumsum is XLA's reduce-window scan, slow on the GPU at 1M."""
    R, N = mask.shape
    n_chunks = -(-N // chunk)
    m = jnp.pad(mask, ((0, 0), (0, n_chunks * chunk - N))).reshape(R, n_chunks, chunk)
    tri = jnp.triu(jnp.ones((chunk, chunk), jnp.bfloat16))  # tri[i, j] = 1 for i <= j
    within = jnp.einsum("rnc,cj->rnj", m.astype(jnp.bfloat16), tri,
                        preferred_element_type=jnp.float32).astype(jnp.int32)
    before = jnp.cumsum(within[:, :, -1], axis=1) - within[:, :, -1]  # exclusive, over chunks
    return (within + before[:, :, None]).reshape(R, n_chunks * chunk)[:, :N]


TOPK_METHODS = ("auto", "sort", "radix", "kernel")
# Off the GPU "auto" takes the XLA radix select from this many candidates per row, the sort below (on the CPU
# the Pallas kernels would run interpreted). A clo decode step on an H100 at 128K: radix 22.45 vs sort 25.68 ms
# per 32-layer step (2026-11-27).
RADIX_MIN_CANDIDATES = 1 << 17
# On the GPU "auto" takes the Pallas select ("kernel") from this many candidates: at 8 x 128K with one row
# selecting (a clo layer at a hit rate of ~0.86) 87 us against the XLA radix's 206 and the sort's 318, in a
# jit of 10 calls; the 128K clo step 18.7-19.8 ms against radix's 22.9. At 32K the sort's step was faster
# (19.7 vs 22.8 ms), so the sort below 128K (H100, BENCHMARKS 'Kernel timings') ...
KERNEL_MIN_CANDIDATES = 1 << 17
# ... except for short rows (page-level votes: a clo head's 128K tokens in pages of 32 are 4096 candidates), where
# the kernel's launches are short and the sort's are not: H200, 8 x 4096 44.6-53 us against the sort's 65-80,
# 8 x 16384 46.5 against 107-118, 512 x 256 (b64) 22-36 against 34-38 (2026-11-28)
KERNEL_MAX_SHORT = 1 << 14


def resolve_topk_method(method: str, n_candidates: int, gpu: bool | None = None) -> str:
    """The method `top_count_ascending` runs for `method` over rows of n_candidates (static) entries; gpu: the
    default backend is a GPU (None: ask JAX)."""
    if method not in TOPK_METHODS:
        raise ValueError(f"top-k method must be one of {TOPK_METHODS}, got {method!r}")
    if method == "auto":
        if on_gpu() if gpu is None else gpu:
            return "kernel" if n_candidates >= KERNEL_MIN_CANDIDATES or n_candidates <= KERNEL_MAX_SHORT else "sort"
        return "radix" if n_candidates >= RADIX_MIN_CANDIDATES else "sort"
    return method


def top_count_ascending(pri, counts, k, *, method="auto", digit_bits=4):
    """The top counts[r] entries of each row of pri [R, N] float32 (-inf = never), as (indices [R, k] int32
    ascending, then 0; num_valid [R] = min(counts, entries > -inf, k)). Ties go to the lower index; +inf
    entries (forced) come first. Two exact methods, the same indices:

    * "sort": ``jax.lax.top_k`` of k (XLA sorts each row), the first counts[r] kept, then sorted ascending.
    * "radix": the k-th largest value by a radix select (`kth_largest_key`), then an order-keeping compaction
      (`prefix_count` and a scatter of unique slots), all in XLA: no sort, but ~40 kernels, each over every row.
    * "kernel": the same radix select and compaction as Pallas kernels (`pallas/select.py`: 8 count launches
      and one compaction, many programs per row; rows of up to 16K keys one launch, a program a row; a row of
      count 0 exits at once). On an H100, 8 x 128K with
      one row selecting: 87 us against radix's 206 and the sort's 318. Off the GPU it runs interpreted (slow).
    * "auto" (the default): on the GPU "kernel" from KERNEL_MIN_CANDIDATES (128K) per row and up to
      KERNEL_MAX_SHORT (16K), else the sort; off it
      radix from RADIX_MIN_CANDIDATES (128K), else the sort."""
    R, N = pri.shape
    method = resolve_topk_method(method, N)
    k = int(min(k, N))
    pri = jnp.where(pri == 0, jnp.float32(0), pri.astype(jnp.float32))  # -0.0 ties 0.0 (lax.top_k orders them)
    n_ok = jnp.sum(pri > NEG_INF, axis=1, dtype=jnp.int32)
    want = jnp.clip(jnp.minimum(counts.astype(jnp.int32), n_ok), 0, k)
    if method == "kernel":
        from kvoffload.pallas.select import select_rows_kernel

        return select_rows_kernel(orderable_keys(pri), want, k, interpret=not on_gpu()), want
    if method == "sort":
        _, idx = jax.lax.top_k(pri, k)
        big = jnp.int32(2 ** 30)
        key = jnp.sort(jnp.where(jnp.arange(k)[None] < want[:, None], idx, big), axis=-1)
        return jnp.where(key < big, key, 0).astype(jnp.int32), want
    keys = orderable_keys(pri)
    T, take = kth_largest_key(keys, jnp.maximum(want, 1), digit_bits=digit_bits)
    gt = keys > T[:, None]
    eq = keys == T[:, None]
    eq_rank = prefix_count(eq)
    chosen = (gt | (eq & (eq_rank <= take[:, None]))) & (want > 0)[:, None]
    slot = prefix_count(chosen) - 1
    slot = jnp.where(chosen, slot, k)  # k: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], (R, N))
    idx = jnp.zeros((R, k), jnp.int32).at[rows, slot].set(
        jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (R, N)), mode="drop", unique_indices=True)
    return idx, want


def select_topk(scores, k, *, lengths=None, num_sink=0, num_recent=0, page_size=1, counts=None, method="auto"):
    """Pick the top-k entries per KV head, forcing sink and recent windows in.

    scores [B, n_kv, N] float32 (-inf = invalid); N tokens (page_size=1) or pages.
    lengths [B] (tokens; with page_size>1 the valid page count is ceil(len/page_size));
    num_sink / num_recent are in tokens and are converted to the pages covering them.
    counts [B, n_kv] int32 (optional, each <= k): how many to pick per row instead of k.
    Returns (indices [B, n_kv, k] int32, num_valid [B, n_kv] int32). Valid indices come
    first, ascending, the rest are filled with 0 (in range, to be ignored via num_valid).
    If k exceeds the valid count, num_valid is the valid count. method: `top_count_ascending`'s.
    """
    B, n_kv, N = scores.shape
    k = int(min(k, N))
    scores = scores.astype(jnp.float32)
    pos = jnp.arange(N, dtype=jnp.int32)[None, None, :]
    if lengths is not None:
        L = lengths.astype(jnp.int32)[:, None, None]
        n_valid_entries = (L + page_size - 1) // page_size
        valid = pos < n_valid_entries
    else:
        L = jnp.full((B, 1, 1), N * page_size, jnp.int32)
        valid = jnp.ones((1, 1, N), bool)
    valid = valid & (scores > NEG_INF)
    force = jnp.zeros_like(valid)
    if num_sink:
        force = force | (pos * page_size < num_sink)
    if num_recent:
        force = force | ((pos + 1) * page_size > L - num_recent)
    force = force & (pos * page_size < L)
    pri = jnp.where(force, jnp.inf, scores)
    pri = jnp.where(valid | force, pri, NEG_INF)
    counts = jnp.full((B, n_kv), k, jnp.int32) if counts is None else jnp.minimum(counts, k)
    idx, nv = top_count_ascending(pri.reshape(B * n_kv, N), counts.reshape(B * n_kv), k, method=method)
    return idx.reshape(B, n_kv, k), nv.reshape(B, n_kv)
