"""The selection's top-k as Pallas kernels: a radix select of each row's k-th largest score, spread over many
programs per row, and the order-keeping compaction of the entries above it.

Why kernels: `topk.top_count_ascending`'s XLA radix select runs ~40 kernels per call, each over every row, and
in a `clo` step most rows are heads that reuse their selection (count 0: a hit rate of 0.86 leaves ~1 of 8
heads to select). Here a row of count 0 costs a program that exits at once, and the whole selection is
32 / 4 + 1 launches.

Layout: each row of N keys (`topk.orderable_keys`) is split into P chunks of C keys, one program per (row,
chunk). Round r (32 / 4 of them, most significant digit first) counts, in its chunk, the keys that share the
prefix found so far and have a 4-bit digit of at least c, for c = 0..15, and stores those 16 counts
([R, P, 16] per round). No atomics and no reduction kernel: each program of the next round sums the previous
rounds' counts over the row's chunks itself (P x 16 integers a round) to rebuild the prefix and the count
still wanted. The compaction (one launch, the same grid) rebuilds the threshold T and `take` (how many keys
equal to T are taken, lowest index first) the same way, and with them each chunk's count of keys above T and
equal to T: exclusive sums over the chunks before its own give every program its first output slot. It
then writes the index of every key above T, and of the first `take` keys equal to it, at its running
position (a running sum, `jnp.cumsum`: Triton's scan), and zeros past the row's count in its share of the
output. Semantics and output equal `top_count_ascending`'s (ties to the lower index).

Rows of up to `FUSED_MAX_KEYS` keys (page-level votes) take one launch instead: one program a row, the row in its
registers (`_fused_kernel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import cdiv, load, next_pow2, triton_params

DIGIT_BITS = 4
WIDTH = 1 << DIGIT_BITS
ROUNDS = 32 // DIGIT_BITS
MAX_CHUNKS = 64  # programs per row at most: each program sums P x 16 counts per earlier round


SHORT_ROW_KEYS = 1 << 14  # rows up to this many keys are split into 1024-key chunks by default (more programs)


def chunking(N: int, chunk: int | None = None) -> tuple[int, int]:
    """(C, P): keys per program (a power of two, >= chunk) and programs per row for rows of N keys. chunk None:
    2048 keys, 1024 for rows of up to SHORT_ROW_KEYS (H200, 8 rows of 4096 with every row selecting: 44.6 us
    against 52.3 with 2048-key chunks; of 16384, one row selecting: 46.5 against 55.5; 2026-11-28)."""
    chunk = (1024 if N <= SHORT_ROW_KEYS else 2048) if chunk is None else chunk
    C = max(int(chunk), next_pow2(cdiv(N, MAX_CHUNKS)))
    return C, cdiv(N, C)


def _chunk_counts(ref, P, Pp):
    """[Pp, WIDTH] int32: one round's counts of this row's chunks (rows >= P read as 0)."""
    rows = jnp.arange(Pp, dtype=jnp.int32)
    cand = jnp.arange(WIDTH, dtype=jnp.int32)
    return load(ref.at[rows[:, None], cand[None, :]], mask=(rows < P)[:, None], other=0)


def _digit_of(counts, remaining):
    """(d, higher): the largest digit c >= 1 with counts[c] >= remaining (else 0), and counts[d + 1] (0 past
    the last digit): the keys of the row above the prefix extended by d. counts [WIDTH] non-increasing."""
    cand = jnp.arange(WIDTH, dtype=jnp.int32)
    d = jnp.sum(((counts >= remaining) & (cand >= 1)).astype(jnp.int32))
    higher = jnp.sum(jnp.where(cand == d + 1, counts, 0))
    return d, higher


def _rebuild(round_refs, want, P, Pp, per_chunk=False):
    """Replay the rounds done so far from their stored counts: (prefix uint32, remaining int32) and, with
    per_chunk, each chunk's keys above the prefix [Pp] and the last round's counts [Pp, WIDTH] with its digit.
    Every round's counts are loaded before the replay, so the loads overlap instead of waiting on the chain."""
    cand = jnp.arange(WIDTH, dtype=jnp.int32)
    cnts = [_chunk_counts(ref, P, Pp) for ref in round_refs]
    totals = [jnp.sum(c, axis=0) for c in cnts]
    prefix = jnp.zeros((), jnp.uint32)
    remaining = jnp.maximum(want, 1)
    above = jnp.zeros((Pp,), jnp.int32)
    cnt, d = None, None
    for j, (cnt, total) in enumerate(zip(cnts, totals)):
        d, higher = _digit_of(total, remaining)
        remaining = remaining - higher
        prefix = prefix | (d.astype(jnp.uint32) << (32 - DIGIT_BITS * (j + 1)))
        if per_chunk:  # a key is above T at the first round where its digit beats T's
            above = above + jnp.sum(jnp.where(cand[None, :] == d + 1, cnt, 0), axis=1)
    return prefix, remaining, above, cnt, d


def _count_kernel(want_ref, keys_ref, *rest, r, N, C, S, P, Pp):
    # rest: the counts of rounds 0..r-1 ([P, WIDTH] each: this row), then this round's out [WIDTH]
    round_refs, out_ref = rest[:r], rest[r]
    want = want_ref[0]
    p = pl.program_id(1)
    shift = 32 - DIGIT_BITS * (r + 1)
    above = shift + DIGIT_BITS
    lanes = jnp.arange(S, dtype=jnp.int32)
    cand = jnp.arange(WIDTH, dtype=jnp.int32)

    @pl.when(want > 0)
    def _():
        prefix, _, _, _, _ = _rebuild(round_refs, want, P, Pp)

        def count(i, acc):  # per-lane counts, reduced once after the loop
            pos = p * C + i * S + lanes
            keys = load(keys_ref.at[pos], mask=pos < N, other=0)  # key 0: below every selectable one
            digit = ((keys >> shift) & (WIDTH - 1)).astype(jnp.int32)
            hit = digit[None, :] >= cand[:, None]  # [WIDTH, S]
            if above < 32:
                hit = hit & ((keys >> above) == (prefix >> above))[None, :]
            return acc + hit.astype(jnp.int32)

        acc = jax.lax.fori_loop(0, C // S, count, jnp.zeros((WIDTH, S), jnp.int32))
        out_ref[...] = jnp.sum(acc, axis=1)

    @pl.when(want <= 0)
    def _():
        out_ref[...] = jnp.zeros((WIDTH,), jnp.int32)


def _compact_kernel(want_ref, keys_ref, *rest, N, K, C, S, P, Pp, Z, Zp):
    # rest: the counts of every round ([P, WIDTH] each: this row), then idx_ref [K]: this row's output
    from jax.experimental.pallas import triton as plgpu

    round_refs, idx_ref = rest[:ROUNDS], rest[ROUNDS]
    want = want_ref[0]
    p = pl.program_id(1)
    # zeros past the count in this program's share of the output (chosen slots are all < want: no overlap)
    zpos = p * Z + jnp.arange(Zp, dtype=jnp.int32)
    plgpu.store(idx_ref.at[zpos], jnp.zeros((Zp,), jnp.int32),
                mask=(zpos < jnp.minimum((p + 1) * Z, K)) & (zpos >= jnp.maximum(want, 0)))

    @pl.when(want > 0)
    def _():
        T, take, above, cnt, d = _rebuild(round_refs, want, P, Pp, per_chunk=True)
        cand = jnp.arange(WIDTH, dtype=jnp.int32)
        chunks = jnp.arange(Pp, dtype=jnp.int32)
        equal = jnp.sum(jnp.where(cand[None, :] == d, cnt, 0), axis=1) - jnp.sum(
            jnp.where(cand[None, :] == d + 1, cnt, 0), axis=1)  # [Pp]: keys == T per chunk
        eq_before = jnp.cumsum(equal) - equal  # [Pp], exclusive
        taken = jnp.clip(take - eq_before, 0, equal)
        written0 = jnp.sum(jnp.where(chunks < p, above + taken, 0))
        eq_seen0 = jnp.sum(jnp.where(chunks == p, eq_before, 0))
        lanes = jnp.arange(S, dtype=jnp.int32)

        def compact(i, carry):
            written, eq_seen = carry
            pos = p * C + i * S + lanes
            keys = load(keys_ref.at[pos], mask=pos < N, other=0)
            gt = keys > T
            eq = (keys == T) & (pos < N)
            eq_rank = eq_seen + jnp.cumsum(eq.astype(jnp.int32))  # inclusive
            chosen = gt | (eq & (eq_rank <= take))
            ch = chosen.astype(jnp.int32)
            slot = written + jnp.cumsum(ch) - 1
            # lanes not chosen get distinct slots past the end: masked out on the GPU, and never aliasing a
            # chosen lane's slot (interpret mode writes a masked scatter as read, select, write)
            slot = jnp.where(chosen, slot, K + lanes)
            plgpu.store(idx_ref.at[slot], pos, mask=chosen & (slot < K))
            return written + jnp.sum(ch), eq_seen + jnp.sum(eq.astype(jnp.int32))

        jax.lax.fori_loop(0, C // S, compact, (written0, eq_seen0))


def _fused_kernel(want_ref, keys_ref, idx_ref, *, N, Np, K, Kp):
    # one program per row, the whole row loaded once and kept in registers: the want-th largest key T found bit by
    # bit, most significant first (the largest T with at least want keys >= T: 32 counts over the row, no global
    # memory between them), then the compaction of `_compact_kernel` in one pass (two running sums). This
    # kernel's first form reloaded the row for each of 8 rounds of 16 counts (8 x 4096: 52-74 us, slower than the
    # 9 launches); 2 or 4 bits a round (3 or 15 counts side by side) were slower than 1 (H200, 2026-11-29)
    from jax.experimental.pallas import triton as plgpu

    want = want_ref[0]
    zpos = jnp.arange(Kp, dtype=jnp.int32)
    plgpu.store(idx_ref.at[zpos], jnp.zeros((Kp,), jnp.int32), mask=(zpos < K) & (zpos >= jnp.maximum(want, 0)))

    @pl.when(want > 0)
    def _():
        pos = jnp.arange(Np, dtype=jnp.int32)
        ok = pos < N
        keys = load(keys_ref.at[pos], mask=ok, other=0)  # key 0: below every selectable one
        T = jnp.zeros((), jnp.uint32)
        for b in range(31, -1, -1):
            cand = T | jnp.uint32(1 << b)
            T = jnp.where(jnp.sum((keys >= cand).astype(jnp.int32)) >= want, cand, T)
        take = want - jnp.sum((keys > T).astype(jnp.int32))  # keys == T taken, lowest index first
        eq = (keys == T) & ok
        chosen = (keys > T) | (eq & (jnp.cumsum(eq.astype(jnp.int32)) <= take))
        # lanes not chosen get distinct slots past the end (see `_compact_kernel`)
        slot = jnp.where(chosen, jnp.cumsum(chosen.astype(jnp.int32)) - 1, K + pos)
        plgpu.store(idx_ref.at[slot], pos, mask=chosen & (slot < K))


# rows up to this many keys: one launch, one program per row (`_fused_kernel`), `fused_num_warps` warps. H200,
# 2026-11-29, 10 calls in a jit, per call (one row of 8 selecting / every row): 8 x 4096 (a clo layer's
# pages of 32 at 128K) 26.2 / 30.7-33.8 us against 43.3 / 58.2 for the 9 launches; 8 x 16384 42.8 / 38.0 against
# 60.9 / 50.4; 512 x 256 (b64 x 8 heads at 8K) 32.8 / 20.3 against 49.6 / 57.2
FUSED_MAX_KEYS = 1 << 14


def fused_num_warps(N: int) -> int:
    """Warps of the one-launch kernel's program for rows of N keys (the row lives in their registers): the sweep's
    pick (fewer warps for 4096 keys took 40 us, for 16384 82-100)."""
    return 4 if N <= 1024 else (8 if N <= 4096 else 16)


def select_rows_kernel(keys, want, k, *, chunk=None, count_piece=512, compact_piece=1024, num_warps=4,
                       interpret=False, fused_max=FUSED_MAX_KEYS, fused_warps=None):
    """(indices [R, k] int32 ascending, then 0) of the want[r] largest keys of each row of keys [R, N]
    (uint32, `topk.orderable_keys`); want [R] int32, each <= k and <= the row's keys above the floor
    (`topk.top_count_ascending` clips it; 0 skips the row). Grid (R, P) per launch: `chunking`. The defaults
    (2048-key chunks, 512-key count pieces, 4 warps) were the fastest of a sweep on an H100 at 8 x 128K with
    one row and with every row selecting (2026-11-27); shorter rows take 1024-key chunks (`chunking`). Rows of
    at most fused_max keys take one launch of one program per row instead (`_fused_kernel`, fused_warps warps:
    default `fused_num_warps`; 9 launches of a few programs cost more than the work there)."""
    R, N = keys.shape
    k = int(k)
    if N <= fused_max:
        kernel = functools.partial(_fused_kernel, N=N, Np=next_pow2(N), K=k, Kp=next_pow2(k))
        num_warps = fused_warps or fused_num_warps(N)
        return pl.pallas_call(
            kernel, grid=(R,),
            in_specs=[pl.BlockSpec((1,), lambda r: (r,)), pl.BlockSpec((None, N), lambda r: (r, 0))],
            out_specs=pl.BlockSpec((None, k), lambda r: (r, 0)),
            out_shape=jax.ShapeDtypeStruct((R, k), jnp.int32),
            compiler_params=triton_params(num_warps=num_warps, num_stages=1), interpret=interpret,
            name="kvo_select_fused",
        )(want.astype(jnp.int32), keys)
    C, P = chunking(N, chunk)
    S = min(int(count_piece), C)
    Pp = next_pow2(P)
    want = want.astype(jnp.int32)
    want_spec = pl.BlockSpec((1,), lambda r, p: (r,))
    keys_spec = pl.BlockSpec((None, N), lambda r, p: (r, 0))
    counts_spec = pl.BlockSpec((None, P, WIDTH), lambda r, p: (r, 0, 0))  # the row's chunks, read by every program
    params = triton_params(num_warps=num_warps, num_stages=1)
    rounds = []
    for r in range(ROUNDS):
        kernel = functools.partial(_count_kernel, r=r, N=N, C=C, S=S, P=P, Pp=Pp)
        rounds.append(pl.pallas_call(
            kernel, grid=(R, P),
            in_specs=[want_spec, keys_spec] + [counts_spec] * r,
            out_specs=pl.BlockSpec((None, None, WIDTH), lambda r, p: (r, p, 0)),
            out_shape=jax.ShapeDtypeStruct((R, P, WIDTH), jnp.int32),
            compiler_params=params, interpret=interpret, name="kvo_select_count",
        )(want, keys, *rounds))
    Z = cdiv(k, P)
    kernel = functools.partial(_compact_kernel, N=N, K=k, C=C, S=min(int(compact_piece), C), P=P, Pp=Pp, Z=Z,
                               Zp=next_pow2(Z))
    return pl.pallas_call(
        kernel, grid=(R, P),
        in_specs=[want_spec, keys_spec] + [counts_spec] * ROUNDS,
        out_specs=pl.BlockSpec((None, k), lambda r, p: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((R, k), jnp.int32),
        compiler_params=params, interpret=interpret, name="kvo_select_compact",
    )(want, keys, *rounds)
