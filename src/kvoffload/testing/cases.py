"""The kernel case tables: (check, kwargs) for the default run, the full sweep (tests -m slow) and the GPU suite
(benchmarks/check_kernels.py), their ids, and how a case runs in a mode."""

from __future__ import annotations

from kvoffload.pallas import stacked_linear as _sl
from kvoffload.testing.attention import (
    check_decode,
    check_int4_decode,
    check_merge,
    check_merge_splits,
    check_paged,
    check_prefill,
    check_rows_attention,
    check_sparse,
)
from kvoffload.testing.linear import check_recompute, check_stacked_linear
from kvoffload.testing.rows import check_gather, check_quantize, check_refill
from kvoffload.testing.selection import (
    check_hata,
    check_popcount,
    check_quest,
    check_quest_blocks,
    check_scores_exact,
    check_select,
    check_select_rows,
    check_tokenselect,
)

GROUPS = (1, 3, 4, 7, 8)
HEAD_DIMS = (64, 80, 96, 128)
DTYPES = ("float32", "bfloat16")


def gather_cases(full=False):
    """Row gather: every head dim x K (1, 37, 300) x dtype over odd extents (E 5 / 13, blk 24 / 16),
    int4 codes and group scales, and a tile size other than the default."""
    shapes = [(d, K, dt) for d in HEAD_DIMS for K in (1, 37, 300) for dt in DTYPES]
    if not full:
        shapes = [(64, 1, "bfloat16"), (80, 37, "float32"), (96, 300, "bfloat16"), (128, 37, "bfloat16")]
    cases = [(check_gather, dict(d=d, K=K, dtype=dt, E=(5, 13)[i % 2], blk=(24, 16)[i % 2]))
             for i, (d, K, dt) in enumerate(shapes)]
    cases += [(check_gather, dict(d=64, K=37, dtype="uint8")),  # int4 codes [..., d / 2]
              (check_gather, dict(d=2, K=37, dtype="float32")),  # int4 group scales [..., d / group]
              (check_gather, dict(blk=1, d=64, K=37, dtype="float32")),  # int4 K per-channel scales [E, n_kv, 1, d]
              (check_gather, dict(B=1, n_kv=3, d=128, K=300, block_k=16))]
    return cases


def kernel_cases(full=False):
    """(fn, kwargs) for every kernel check; full=True is the exhaustive sweep."""
    cases = []
    if full:
        dec = [(g, d, dt) for g in GROUPS for d in HEAD_DIMS for dt in DTYPES]
    else:
        dec = [(1, 64, "float32"), (3, 80, "bfloat16"), (4, 96, "float32"),
               (7, 128, "bfloat16"), (8, 80, "float32")]
    for g, d, dt in dec:
        cases.append((check_decode, dict(G=g, d=d, dtype=dt, S=200 if not full else 333)))
    cases.append((check_decode, dict(B=2, G=4, d=128, S=1, lengths=[1, 0])))
    cases.append((check_decode, dict(B=2, G=4, d=64, S=300, num_splits=2, block_s=32)))
    cases += paged_cases(full)
    sp = ([(g, d, dt, ps) for g in (1, 4, 7) for d in HEAD_DIMS for dt in DTYPES
           for ps in (1, 16)] if full else
          [(4, 128, "float32", 1), (3, 80, "bfloat16", 16), (8, 96, "float32", 4),
           (1, 64, "bfloat16", 1)])
    for g, d, dt, ps in sp:
        cases.append((check_sparse, dict(G=g, d=d, dtype=dt, page_size=ps,
                                         with_lengths=(ps > 1))))
    cases += [(check_rows_attention, dict()),
              (check_rows_attention, dict(G=7, d=80, K=100, layers=3, dtype="bfloat16")),
              (check_rows_attention, dict(B=1, n_kv=3, G=1, K=40, d=64, num_splits=3, block_n=16))]
    rc = ([(d, dt, b, r) for d in (64, 128) for dt in DTYPES for b in (True, False)
           for r in (True, False)] if full else
          [(64, "float32", True, True), (128, "bfloat16", False, False)])
    for d, dt, b, r in rc:
        cases.append((check_recompute, dict(d=d, dtype=dt, bias=b, rope=r, T=40 if not full else 77)))
    for g, d, dt, red in ([(4, 96, "float32", "sum"), (7, 64, "bfloat16", "max")] if not full
                          else [(g, d, dt, red) for g in GROUPS for d in HEAD_DIMS
                                for dt in DTYPES for red in ("sum", "max")]):
        cases.append((check_scores_exact, dict(G=g, d=d, dtype=dt, group_reduce=red)))
    cases.append((check_scores_exact, dict(G=4, d=128, dtype="bfloat16", group_reduce="max", per_head=True, S=256)))
    # pool blocks as a batch (S <= 128: several blocks per program, `SCORE_ITEMS`), a head of length 0
    cases.append((check_scores_exact, dict(B=19, n_kv=3, G=3, S=64, d=64, group_reduce="max", per_head=True)))
    if full:
        # every group x head dim x dtype (x code width x popcount for HATA); the other
        # options (reduction, page size, num_pages, norm, shared) cycle along
        reds = ("sum", "max", "mean")
        qu = [dict(G=g, d=d, dtype=dt, group_reduce=reds[i % 3], page_size=(16, 32)[i % 2],
                   with_num_pages=bool(i % 4 < 2))
              for i, (g, d, dt) in enumerate((g, d, dt) for g in GROUPS for d in HEAD_DIMS
                                             for dt in DTYPES)]
        ha = [dict(G=g, r=r, with_norm=bool(i % 2), group_reduce=reds[i % 3], popcount=pc)
              for i, (g, r, pc) in enumerate((g, r, pc) for g in GROUPS
                                             for r in (32, 64, 96, 128, 256)
                                             for pc in ("native", "swar"))]
        ts = [dict(G=g, d=d, dtype=dt, shared=bool(i % 2), S=333)
              for i, (g, d, dt) in enumerate((g, d, dt) for g in GROUPS for d in HEAD_DIMS
                                             for dt in DTYPES)]
    else:
        qu = [dict(), dict(G=1, d=128, page_size=32, dtype="bfloat16", group_reduce="max",
                           with_num_pages=False),
              dict(G=4, d=80, S=200, page_size=8, group_reduce="mean", block_p=16)]
        ha = [dict(), dict(G=7, r=64, with_norm=False, group_reduce="max"),
              dict(B=3, G=3, r=96, group_reduce="mean", lengths=[100, 0, 55], popcount="swar",
                   block_s=32),
              dict(G=1, r=32, popcount="swar")]
        ts = [dict(), dict(G=3, d=80, dtype="bfloat16", shared=True),
              dict(B=3, G=1, d=96, S=300, lengths=[300, 0, 57], block_s=32, num_splits=3,
                   block_v=64),
              dict(G=3, d=128, S=70, shared=True, block_s=16, num_splits=2)]
    cases += [(check_quest, kw) for kw in qu]
    cases += [(check_quest_blocks, dict()), (check_quest_blocks, dict(B=1, int8=False, d=80, G=4, P=4, rows=16)),
              (check_quest_blocks, dict(B=3, E=7, n_kv=1, G=1, P=1, d=16, dtype="bfloat16", rows=8)),
              (check_quest_blocks, dict(E=5, layers=3)), (check_quest_blocks, dict(E=6, layers=4, int8=False)),
              (check_quest_blocks, dict(B=3, E=9, n_kv=3, active=True)),
              (check_quest_blocks, dict(E=5, layers=3, active=True, int8=False))]
    cases += [(check_hata, kw) for kw in ha]
    cases += [(check_tokenselect, kw) for kw in ts]
    for d, gs, dt, g in ([(128, 64, "float32", 4), (64, 64, "bfloat16", 3)] if not full else
                         [(d, gs, dt, g) for d in (64, 128) for gs in (32, 64) for dt in DTYPES
                          for g in (1, 4, 7)]):
        cases.append((check_int4_decode, dict(d=d, group_size=gs, dtype=dt, G=g)))
    cases += gather_cases(full)
    cases += [(check_refill, dict()), (check_refill, dict(sizes=(3, 1, 4), blk=16, d=64, K=300, dtype="bfloat16")),
              (check_refill, dict(B=1, sizes=(2,), d=128, K=5, dtype="bfloat16", ext_dtype="float32", block_k=16)),
              (check_refill, dict(bits=4)), (check_refill, dict(bits=8, d=64, dtype="bfloat16", group_size=32)),
              (check_refill, dict(bits=4, sizes=(3, 1, 4), blk=16, d=128, K=300, dtype="bfloat16", group_size=64)),
              (check_refill, dict(layers=3, layer=1)), (check_refill, dict(layers=2, layer=1, K=20, d=64)),
              (check_refill, dict(bits=8, d=64, dtype="bfloat16", group_size=32, layers=3, layer=2))]
    pf = ([(g, d, dt) for g in (1, 4, 7) for d in HEAD_DIMS for dt in DTYPES] if full else
          [(4, 128, "bfloat16"), (3, 80, "float32"), (1, 64, "float32")])
    for i, (g, d, dt) in enumerate(pf):
        cases.append((check_prefill, dict(G=g, d=d, dtype=dt, T=(300, 129)[i % 2], Tc=(70, 33)[i % 2],
                                          q_start=(150, 96)[i % 2])))
    cases.append((check_prefill, dict(G=2, d=64, T=200, Tc=64, q_start=0, block_q=32, block_k=16)))
    cases += [(check_select_rows, dict(R=3, N=300, kind="normal")), (check_select_rows, dict(R=2, N=77, kind="ties")),
              (check_select_rows, dict(R=3, N=300, kind="normal", fused_max=0)),  # the multi-launch path
              (check_select_rows, dict(R=2, N=77, kind="ties", fused_max=0)),
              (check_select_rows, dict(R=3, N=200, ratio=0.3, chunk=32, count_piece=16, compact_piece=8, fused_max=0)),
              (check_select_rows, dict(R=3, N=200, ratio=0.3, fused_warps=8)),  # one launch: the row in registers
              (check_select_rows, dict(R=2, N=1500, ratio=0.2, kind="ties", fused_max=2048))]
    cases += [(check_merge_splits, dict()), (check_merge_splits, dict(B=1, n_kv=2, NS=4, G=4, d=64))]
    cases += [(check_stacked_linear, dict()), (check_stacked_linear, dict(M=5, K=1100, N=48, dtype="bfloat16")),
              (check_stacked_linear, dict(L=2, M=70, K=64, N=200, block_n=32, block_k=16))]
    return cases


def paged_cases(full=False):
    """Paged decode attention: the default two shapes, or (full) every GQA group x head dim x
    block size x dtype, plus a non-power-of-two block, one split walking the whole table, and
    a long table over a large pool."""
    if not full:
        return [(check_paged, dict(G=3, d=80, blk=64, dtype="bfloat16")),
                (check_paged, dict(G=4, d=64, blk=16, num_splits=1))]
    cases = [(check_paged, dict(G=g, d=d, blk=blk, dtype=dt))
             for g in (1, 3, 4, 8) for d in HEAD_DIMS for blk in (16, 64) for dt in DTYPES]
    cases += [(check_paged, dict(G=4, d=128, blk=24, M=4)),
              (check_paged, dict(G=4, d=64, blk=16, num_splits=1)),
              (check_paged, dict(B=5, n_kv=8, G=4, d=128, blk=64, M=40, E=512, dtype="bfloat16",
                                 num_blocks=[40, 0, 1, 17, 33])),
              (check_paged, dict(B=3, n_kv=8, G=8, d=128, blk=16, M=200, E=700,
                                 num_blocks=[200, 3, 0]))]
    return cases


def reference_cases(full=False):
    launch = ("num_splits", "block_s", "block_p", "block_v", "popcount", "block_k")
    cases = [(fn, kw) for fn, kw in kernel_cases(full) if not any(a in kw for a in launch)]
    if not full:  # the default run: two shapes per reference (the kernels cover all)
        picked, count = [], {}
        for fn, kw in cases:
            if count.get(fn, 0) < 2:
                picked.append((fn, kw))
                count[fn] = count.get(fn, 0) + 1
        cases = picked
    cases += [
        (check_merge, dict(dtype="float32")), (check_merge, dict(dtype="bfloat16")),
        (check_popcount, dict()),
        (check_select, dict()), (check_select, dict(page_size=16, N=30, k=8)),
        (check_quantize, dict()), (check_quantize, dict(shape=(4, 96), group_size=32)),
        (check_quantize, dict(bits=8)),
        (check_int4_decode, dict(d=96, group_size=32)),
    ]
    return cases


def case_id(fn, kw):
    return fn.__name__.replace("check_", "") + "-" + "-".join(f"{k}{v}" for k, v in kw.items())


def gpu_cases():
    """The GPU suite: the default subset, the full decode sweep (every group x head dim x
    dtype), every head dim for the other kernels, and larger sequences (many splits)."""
    cases = list(kernel_cases(full=False))
    seen = {(f, repr(sorted(k.items()))) for f, k in cases}

    def add(f, kw):
        key = (f, repr(sorted(kw.items())))
        if key not in seen:
            seen.add(key)
            cases.append((f, kw))

    for g in GROUPS:
        for d in HEAD_DIMS:
            for dt in DTYPES:
                add(check_decode, dict(G=g, d=d, dtype=dt, S=333))
    for d in HEAD_DIMS:
        for dt in DTYPES:
            add(check_sparse, dict(G=4, d=d, dtype=dt, page_size=1))
            add(check_sparse, dict(G=7, d=d, dtype=dt, page_size=16, with_lengths=True))
            add(check_scores_exact, dict(G=3, d=d, dtype=dt))
            add(check_scores_exact, dict(G=4, d=d, dtype=dt, group_reduce="max", per_head=True, S=256))
            add(check_scores_exact, dict(B=37, n_kv=8, G=4, d=d, dtype=dt, group_reduce="max", per_head=True, S=64))
    for d in (64, 128):
        for dt in DTYPES:
            for b in (True, False):
                add(check_recompute, dict(d=d, dtype=dt, bias=b, rope=True, T=77, H=256))
            add(check_int4_decode, dict(d=d, dtype=dt, G=8, group_size=64))
            add(check_int4_decode, dict(d=d, dtype=dt, G=1, group_size=32))
    for d in HEAD_DIMS:
        for dt in DTYPES:
            add(check_quest, dict(G=4, d=d, dtype=dt, S=1000, page_size=16))
            add(check_tokenselect, dict(G=4, d=d, dtype=dt, S=333))
            add(check_tokenselect, dict(G=7, d=d, dtype=dt, S=333, shared=True))
    for r in (32, 64, 96, 128, 256):
        for pc in ("native", "swar"):
            add(check_hata, dict(G=4, r=r, S=333, popcount=pc))
    for fn, kw in paged_cases(full=True):
        add(fn, kw)
    # long sequences / many splits / batch
    add(check_decode, dict(B=4, n_kv=8, G=4, d=128, dtype="bfloat16", S=5000,
                           lengths=[5000, 1, 4097, 63]))
    add(check_decode, dict(B=2, n_kv=2, G=8, d=96, dtype="float32", S=3000))
    add(check_sparse, dict(B=2, n_kv=8, G=4, d=128, dtype="bfloat16", S=8192, K=900))
    add(check_sparse, dict(B=1, n_kv=4, G=4, d=128, dtype="bfloat16", S=8192, K=64,
                           page_size=16, with_lengths=True))
    add(check_recompute, dict(B=2, T=300, H=1024, n_kv=4, d=128, dtype="bfloat16"))
    add(check_int4_decode, dict(B=2, n_kv=8, G=4, d=128, dtype="bfloat16", S=4000))
    add(check_quest, dict(B=2, n_kv=8, G=4, d=128, S=8192, page_size=16))
    add(check_quest_blocks, dict(B=1, E=2048, n_kv=8, G=4, P=2, d=128, dtype="bfloat16"))  # 128K, pages of 32
    add(check_quest_blocks, dict(B=64, E=8192, n_kv=8, G=4, P=2, d=128, dtype="bfloat16"))  # b64 at 8K
    add(check_quest_blocks, dict(B=1, E=2048, n_kv=8, G=4, P=2, d=128, dtype="bfloat16", layers=31))  # the loop's
    add(check_quest_blocks, dict(B=1, E=2048, n_kv=4, G=7, P=2, d=128, dtype="bfloat16", layers=27, active=True))
    add(check_quest_blocks, dict(B=2, E=100, n_kv=4, G=7, P=4, d=80, dtype="bfloat16", int8=False))
    add(check_hata, dict(B=2, n_kv=8, G=4, S=8192, r=128, lengths=[8192, 5000]))
    add(check_hata, dict(B=2, n_kv=8, G=4, S=8192, r=128, lengths=[8192, 5000],
                         popcount="swar"))
    add(check_tokenselect, dict(B=4, n_kv=8, G=4, d=128, dtype="bfloat16", S=5000,
                                lengths=[5000, 1, 4097, 0]))
    add(check_tokenselect, dict(B=1, n_kv=8, G=4, d=128, dtype="bfloat16", S=8192,
                                shared=True))
    for fn, kw in gather_cases(full=True):
        add(fn, kw)
    for d in HEAD_DIMS:  # the extent in pinned_host memory: the kernel reads it in place
        add(check_gather, dict(d=d, K=300, dtype="bfloat16", E=13, blk=16, host=True))
    add(check_gather, dict(B=2, n_kv=8, E=40, blk=64, d=128, K=2000, dtype="bfloat16", host=True))
    add(check_gather, dict(n_kv=8, E=40, blk=1, d=128, K=2000, dtype="float32", host=True))  # per-channel K scales
    for d in HEAD_DIMS:  # the extents in pinned_host memory, and a clo-sized buffer (13K rows of 8 heads)
        add(check_refill, dict(d=d, K=300, dtype="bfloat16", sizes=(13, 5, 7), blk=16, host=True))
        for bits in (4, 8):  # int4 / int8 extents, dequantized in the kernel
            add(check_refill, dict(d=d, K=300, dtype="bfloat16", sizes=(13, 5, 7), blk=16, host=True, bits=bits))
    add(check_refill, dict(B=1, n_kv=8, sizes=(2048,), blk=64, d=128, K=13107, dtype="bfloat16", host=True, bits=8,
                           group_size=64))
    add(check_refill, dict(B=1, n_kv=8, sizes=(256, 256, 256, 256), blk=128, d=128, K=13107, dtype="bfloat16",
                           host=True))
    for bits in (None, 4, 8):  # one layer's rows of a buffer holding several layers' (a loop over stacked layers)
        add(check_refill, dict(d=128, K=300, dtype="bfloat16", sizes=(13, 5), blk=16, host=True, bits=bits,
                               layers=4, layer=3, group_size=64))
    add(check_prefill, dict(B=1, n_kv=8, G=4, d=128, dtype="bfloat16", T=6000, Tc=1024, q_start=4500))
    for d, T, Tc, start in ((128, 6000, 1024, 4500), (64, 300, 70, 150), (80, 129, 33, 96), (128, 200, 64, 0)):
        add(check_prefill, dict(B=2, n_kv=2, G=4, d=d, dtype="bfloat16", T=T, Tc=Tc, q_start=start, impl="cudnn"))
    for n_kv, g, K, layers in ((4, 7, 13107, 27), (8, 4, 13107, 31), (8, 4, 1638, 1)):  # 128K and 16K at 10%
        add(check_rows_attention, dict(B=1, n_kv=n_kv, G=g, K=K, layers=layers, dtype="bfloat16"))
    add(check_rows_attention, dict(B=4, n_kv=2, G=8, K=500, d=64, dtype="float32"))
    for ns, g, d in ((66, 7, 128), (128, 4, 128), (33, 8, 80), (1, 1, 64)):  # Qwen2.5-7B's and Llama-3-8B's at 128K
        add(check_merge_splits, dict(B=1, n_kv=4, NS=ns, G=g, d=d))
    add(check_select_rows, dict(R=8, N=131072))
    add(check_select_rows, dict(R=8, N=131072, kind="ties"))
    add(check_select_rows, dict(R=8, N=4096))  # a clo head's 128K tokens in pages of 32
    add(check_select_rows, dict(R=8, N=4096, kind="ties"))
    for n, w in ((4096, 4), (16384, 8)):  # the one launch with other warps than `fused_num_warps`
        add(check_select_rows, dict(R=8, N=n, fused_warps=w))
    add(check_select_rows, dict(R=512, N=256, ratio=0.2))  # fused: b64 x 8 heads at 8K in pages of 32
    add(check_select_rows, dict(R=8, N=16384, ratio=0.05))
    add(check_select_rows, dict(R=16, N=20000, ratio=0.5))
    add(check_select_rows, dict(R=8, N=1048576))  # 64 programs of 16K keys per row
    for M in (1, 64):  # Llama-3-8B's q / K / V, o, gate / up and down shapes, decode batch 1 and 64
        for K, N in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)):
            add(check_stacked_linear, dict(L=3, M=M, K=K, N=N, dtype="bfloat16"))
    for M in (1, 16):  # the few-row linear's tiles (ops.matmul_f32: decode at batch 1), K|V to a wide lm_head
        for K, N in ((4096, 1024), (4096, 2048), (4096, 14336), (14336, 4096), (4096, 32768)):
            add(check_stacked_linear, dict(L=1, M=M, K=K, N=N, dtype="bfloat16", **_sl.FEW_ROWS_TILES))
    return cases


KERNEL_FNS = (check_decode, check_paged, check_sparse, check_recompute, check_scores_exact,
              check_int4_decode, check_quest, check_quest_blocks, check_hata, check_tokenselect, check_gather, check_prefill,
              check_select_rows, check_refill, check_stacked_linear, check_merge_splits, check_rows_attention)


def run_case(fn, kw, mode):
    return fn(mode=mode, **kw) if fn in KERNEL_FNS else fn(**kw)
