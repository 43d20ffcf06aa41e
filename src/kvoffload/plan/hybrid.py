"""HybridServe's planning: the block-level cost model, host block allocation (the paper's
Algorithm 1), per-request block classes and mini-batch packing.

Units. A block id means the same `block_tokens` positions in every layer, so counts are block ids and
times are per layer of one decode step (every layer does the same work). A KV block moves K and V
(``kv_bytes`` per layer), an ACT block moves the activation X (``act_bytes``: half a KV block for MHA,
h / (2 n_kv d) of it in general, larger than a KV block with GQA) and has its K/V regenerated on the
GPU. With weights offloaded, each layer's weights cross PCIe once per step (``load_w``), the GPU is
otherwise idle unless it recomputes: that idle time is what ACT blocks fill. Under tensor parallelism
everything is one device's (its heads' K/V, its 1/N of X, its weight shard; an ACT block's regeneration
includes the all-gather of its X over the mesh), so the same block ids hold every device's share.

The lines come from the machine's profile (`plan.cost.CostModel`: host->GPU copy time over bytes,
K/V recomputation over flops, attention over K/V bytes; `kvoffload profile` measures and fits them);
`BlockRates` expresses them per block (a change of units of the same fitted points) and is saved in
the profile JSON by `kvoffload profile` beside the raw fits.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvoffload.plan.cost import CostModel, LayerShape, Linear


@dataclasses.dataclass(frozen=True)
class BlockRates:
    """Per-layer times of one decode step as lines in block counts (HybridServe's cost model)."""

    block_tokens: int
    load_kv: Linear  # T_load_kv(#KV blocks moved)
    load_act: Linear  # T_load_act(#ACT blocks moved)
    kv_gen: Linear  # T_kv_gen(#ACT blocks recomputed)
    attention: Linear  # attention over #blocks (either kind)
    load_w: float  # one layer's weights over PCIe (0 when weights stay on the GPU)
    dense_s: float  # projections + MLP of the batch (one layer)
    kv_bytes: float  # one host KV block of one layer (K and V), as the host pool stores it (int4: codes + scales)
    act_bytes: float  # one host ACT block of one layer, as stored
    # a GPU-resident block of one layer: the model's dtype (it never crosses PCIe, so it stays native);
    # None: as the host's
    kv_gpu_bytes: float | None = None
    act_gpu_bytes: float | None = None
    # tensor parallelism (per device of `tensor_parallel`): the all-gather of an ACT block's X before its
    # recompute (each device holds 1/N of X along H), already part of kv_gen; 0 on one device
    x_gather: Linear = Linear(0.0, 0.0)
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.kv_gpu_bytes is None:
            object.__setattr__(self, "kv_gpu_bytes", self.kv_bytes)
        if self.act_gpu_bytes is None:
            object.__setattr__(self, "act_gpu_bytes", self.act_bytes)

    @classmethod
    def of(cls, cost: CostModel, shape: LayerShape, block_tokens: int, *, offload_weights: bool,
           batch: int = 1, weight_share: float = 1.0) -> "BlockRates":
        """weight_share: the fraction of layers whose weights stream (resident layers move none); the
        per-layer weight time is its average over the layers.
        shape: one device's (`LayerShape.of(..., tensor_parallel=N)`, as `LayerPipeline.shape` gives it):
        its heads' K/V per block over its own link, its 1/N of each X, its weight shard; the layer's two
        all-reduces of [batch, h] join the dense time, and so, with X split by token, do the merge of the
        partial softmaxes and a streamed W_K / W_V's all-gather; with X split along H regenerating an ACT
        block all-gathers its X first (the terms `predict_layers` prices)."""
        blk = int(block_tokens)
        # loads and host memory at the bytes the host pool stores (int4 host blocks: ~1/4 of bf16's)
        kv_b, act_b = blk * shape.kv_host_tok, blk * shape.x_host_tok
        per_block = lambda line, x: Linear(line.intercept, line.slope * x)  # noqa: E731
        dense = max(cost.dense(batch * shape.dense_flops_tok), shape.w_layer / cost.hbm_bw)
        dense += 2 * cost.all_gather(batch * shape.allreduce_row)  # 0 on one device
        # X split by token (the pipeline's layout for hybrid on a mesh): each layer merges the devices' partial
        # softmaxes over its ACT blocks and gathers streamed W_K / W_V shards (0 on one device)
        dense += cost.all_gather(batch * shape.act_merge_row) + (cost.all_gather(shape.w_kv_gather) if offload_weights
                                                                  else 0.0)
        gen = per_block(cost.recompute, blk * shape.recompute_flops_tok)
        gather = per_block(cost.all_gather, blk * shape.x_gather_tok) if shape.x_gather_tok > 0 else Linear(0.0, 0.0)
        return cls(block_tokens=blk, load_kv=per_block(cost.h2d, kv_b), load_act=per_block(cost.h2d, act_b),
                   kv_gen=Linear(gen.intercept + gather.intercept, gen.slope + gather.slope),
                   attention=per_block(cost.attention, blk * shape.kv_tok),
                   load_w=cost.h2d(shape.w_layer) * weight_share if offload_weights else 0.0, dense_s=dense,
                   kv_bytes=kv_b, act_bytes=act_b, kv_gpu_bytes=blk * shape.kv_tok, act_gpu_bytes=blk * shape.x_tok,
                   x_gather=gather, tensor_parallel=shape.tensor_parallel)

    def to_json(self) -> dict:
        return {"block_tokens": self.block_tokens, "load_kv": self.load_kv.to_json(),
                "load_act": self.load_act.to_json(), "kv_gen": self.kv_gen.to_json(),
                "attention": self.attention.to_json(), "load_w_s": self.load_w, "dense_s": self.dense_s,
                "kv_bytes": self.kv_bytes, "act_bytes": self.act_bytes, "kv_gpu_bytes": self.kv_gpu_bytes,
                "act_gpu_bytes": self.act_gpu_bytes, "x_gather": self.x_gather.to_json(),
                "tensor_parallel": self.tensor_parallel}

    # -- one layer of a step -------------------------------------------------------------------
    def pcie_s(self, kv_host: float, act_host: float) -> float:
        return self.load_w + self.load_kv(kv_host) + self.load_act(act_host)

    def gpu_s(self, kv: float, act: float) -> float:
        """act: every ACT block (host and GPU-resident) is recomputed; all blocks are attended."""
        return self.kv_gen(act) + self.attention(kv + act) + self.dense_s

    def layer_s(self, kv_host: float, act_host: float, act_gpu: float = 0.0, kv_gpu: float = 0.0) -> float:
        """Transfers of layer i+1 overlap compute of layer i: a layer costs the larger of the two."""
        return max(self.pcie_s(kv_host, act_host), self.gpu_s(kv_host + kv_gpu, act_host + act_gpu))


@dataclasses.dataclass(frozen=True)
class BlockAllocation:
    """Blocks of each class for the host and GPU budgets (block ids; each spans every layer)."""

    kv_host: int
    act_host: int
    gpu: int  # GPU-resident blocks (never moved)
    gpu_kind: str  # "act" (recomputed every step) or "kv"
    reason: str
    act_init: int = 0  # Algorithm 1, step 1
    kv_init: int = 0

    @property
    def total(self) -> int:
        return self.kv_host + self.act_host + self.gpu

    @property
    def act_share_host(self) -> float:
        """ACT blocks among the host blocks (0: KV-only, 1: ACT-only)."""
        n = self.kv_host + self.act_host
        return self.act_host / n if n else 0.0

    def classes(self):
        """The pool's block classes with this allocation's shares (see runtime/pool.py)."""
        from kvoffload.runtime.pool import BlockClass

        out = []
        if self.gpu:
            out.append(BlockClass(self.gpu_kind, device=True, share=self.gpu / self.total))
        if self.act_host:
            out.append(BlockClass("act", share=self.act_host / self.total))
        if self.kv_host:
            out.append(BlockClass("kv", share=self.kv_host / self.total))
        return tuple(out)

    def predicted_layer_s(self, rates: BlockRates) -> float:
        act_gpu = self.gpu if self.gpu_kind == "act" else 0
        kv_gpu = self.gpu if self.gpu_kind == "kv" else 0
        return rates.layer_s(self.kv_host, self.act_host, act_gpu, kv_gpu)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "act_share_host": self.act_share_host, "total": self.total}


def algorithm1(rates: BlockRates, host_bytes: float, layers: int, gpu_blocks: int = 0, gpu_kind: str = "act",
               act_share: float | None = None) -> BlockAllocation:
    """The paper's Algorithm 1: how many host KV and ACT blocks to allocate in `host_bytes` of host
    memory (every layer's blocks), given `gpu_blocks` GPU-resident blocks of `gpu_kind`.

    Step 1 (fill the idle side first): with the GPU-resident blocks' GPU time C0 against the weights'
    loading time T_w: if T_w > C0 the GPU idles while weights load, so ACT_init host ACT blocks are
    allocated whose recomputation fills that time (each also adds its own load time); otherwise PCIe
    idles while the GPU works, so KV_init host KV blocks are allocated to fill it.
    Step 2: the host memory left is split into #ACT and #KV blocks by the two linear equations
        act_bytes #ACT + kv_bytes #KV = memory left                        (every byte used)
        load(#ACT, #KV) = kv_gen(#ACT) + attention(#ACT + #KV)             (PCIe time added = GPU time added)
    When no non-negative solution exists one kind is PCIe-heavier per block than it is GPU-heavy on
    both sides: the step is PCIe-bound whatever the split, moves all host memory either way, and the
    kind with fewer bytes per block holds the most tokens, so the memory goes to that kind.
    act_share (0..1) forces the host ACT:KV split instead (KV-only 0, ACT-only 1)."""
    per_kv, per_act = layers * rates.kv_bytes, layers * rates.act_bytes
    l_kv, l_act = rates.load_kv.slope, rates.load_act.slope
    g, att = rates.kv_gen.slope, rates.attention.slope
    act_gpu = gpu_blocks if gpu_kind == "act" else 0
    kv_gpu = gpu_blocks if gpu_kind == "kv" else 0
    if host_bytes <= 0:
        return BlockAllocation(0, 0, gpu_blocks, gpu_kind, "no host memory for blocks")
    if act_share is not None:
        a_frac = float(act_share)
        per = a_frac * per_act + (1 - a_frac) * per_kv
        n = host_bytes / per
        act = int(math.floor(n * a_frac))
        kv = int(math.floor((host_bytes - act * per_act) / per_kv)) if a_frac < 1 else 0
        return BlockAllocation(kv, act, gpu_blocks, gpu_kind, f"forced host ACT share {a_frac:.3f}")
    # step 1
    c0 = rates.gpu_s(kv_gpu, act_gpu)
    t_w = rates.load_w
    act_init = kv_init = 0.0
    if t_w > c0 and g + att > l_act:
        act_init = min((t_w - c0) / (g + att - l_act), host_bytes / per_act)
        step1 = f"step 1: weights load {t_w * 1e3:.3f} ms > GPU work {c0 * 1e3:.3f} ms: {act_init:.0f} ACT blocks fill it"
    elif c0 > t_w and l_kv > att:
        kv_init = min((c0 - t_w) / (l_kv - att), host_bytes / per_kv)
        step1 = f"step 1: GPU work {c0 * 1e3:.3f} ms >= weights load {t_w * 1e3:.3f} ms: {kv_init:.0f} KV blocks fill PCIe"
    else:
        step1 = f"step 1: nothing to fill (weights {t_w * 1e3:.3f} ms, GPU {c0 * 1e3:.3f} ms)"
    left = host_bytes - act_init * per_act - kv_init * per_kv
    # step 2: a (l_act - g - att) + k (l_kv - att) = 0 with per_act a + per_kv k = left
    ca, ck = l_act - g - att, l_kv - att
    if ca < 0 < ck:  # an ACT block adds more GPU than PCIe time, a KV block the reverse: balance
        ratio = -ca / ck  # KV blocks per ACT block
        a = left / (per_act + ratio * per_kv)
        k = ratio * a
        step2 = (f"step 2: balanced, {ratio:.3f} KV blocks per ACT block (ACT: load {l_act * 1e6:.2f} us < "
                 f"regenerate {g * 1e6:.2f} us per block)")
    elif per_act <= per_kv:
        a, k = left / per_act, 0.0
        step2 = (f"step 2: every block costs more PCIe than GPU time (ACT load {l_act * 1e6:.2f} us >= regenerate "
                 f"{(g + att) * 1e6:.2f} us): PCIe-bound at any split, all memory to ACT blocks "
                 f"({per_act / per_kv:.2f}x the bytes of a KV block: most tokens)")
    else:
        a, k = 0.0, left / per_kv
        step2 = (f"step 2: an ACT block ({per_act / per_kv:.2f}x a KV block, GQA) moves more bytes than its K/V: "
                 "all memory to KV blocks")
    act = int(math.floor(act_init + a))
    kv = int(math.floor(kv_init + k))
    while act * per_act + kv * per_kv > host_bytes and (act or kv):  # floor rounding never overshoots; be sure
        if kv:
            kv -= 1
        else:
            act -= 1
    return BlockAllocation(kv, act, gpu_blocks, gpu_kind, f"{step1}; {step2}",
                           act_init=int(act_init), kv_init=int(kv_init))


def balance_batch(rates: BlockRates, n_blocks: int, layers: int, host_bytes: float, gpu_blocks: int = 0,
                  gpu_kind: str = "act", act_share: float | None = None) -> BlockAllocation:
    """The split of one batch's `n_blocks` blocks (every request's, at the end of its generation) into
    GPU-resident blocks g <= gpu_blocks, host ACT blocks a and host KV blocks k = n - g - a that
    minimises the predicted layer time max(PCIe, GPU) within host_bytes: a linear program in (g, a)
    (both terms are linear), solved exactly by evaluating the feasible polygon's vertices and the
    points where PCIe time equals GPU time on its edges, then rounded to whole blocks. act_share
    forces a / (a + k) (every GPU-resident block is used first).
    Algorithm 1 sizes the blocks a host budget holds (capacity); this picks how a given batch's blocks
    are split (equal to Algorithm 1's ratio when the batch fills the budget and the balance is interior,
    better otherwise: e.g. with GQA, where an ACT block is the larger, or when the GPU-resident blocks
    alone keep the GPU busy)."""
    n = int(n_blocks)
    per_kv, per_act = layers * rates.kv_bytes, layers * rates.act_bytes
    g_max = min(int(gpu_blocks), n)
    act_gpu = 1.0 if gpu_kind == "act" else 0.0

    def layer_s(g, a):
        k = n - g - a
        return rates.layer_s(k, a, act_gpu * g, (1 - act_gpu) * g)

    def feasible(g, a, tol=1e-6):
        k = n - g - a
        return (-tol <= g <= g_max + tol and a >= -tol and k >= -tol
                and per_act * a + per_kv * k <= host_bytes * (1 + 1e-12) + tol)

    if act_share is not None:
        g = g_max
        a = int(math.floor((n - g) * float(act_share) + 1e-9))
        if not feasible(g, a):
            raise ValueError(f"{n - g} host blocks at ACT share {act_share} need "
                             f"{(per_act * a + per_kv * (n - g - a)) / 1e9:.2f} GB of host memory, "
                             f"the budget is {host_bytes / 1e9:.2f} GB")
        return BlockAllocation(n - g - a, a, g, gpu_kind, f"forced host ACT share {float(act_share):.3f}")
    # constraints as lines c0 * g + c1 * a = rhs (the polygon's edges)
    lines = [(1.0, 0.0, 0.0), (1.0, 0.0, float(g_max)), (0.0, 1.0, 0.0), (1.0, 1.0, float(n)),
             (-per_kv, per_act - per_kv, host_bytes - per_kv * n)]  # memory: per_act a + per_kv (n - g - a)
    # PCIe - GPU is linear in (g, a) once it is known which lines' intercepts apply (a line costs
    # nothing at zero): one zero line per combination, each intersected with every edge
    lk, la, lg = rates.load_kv, rates.load_act, rates.kv_gen
    eqs = []
    for on_k in (0, 1):
        for on_a in (0, 1):
            for on_gen in (0, 1):
                c = (rates.load_w + on_k * lk.intercept + on_a * la.intercept + lk.slope * n
                     - on_gen * lg.intercept - rates.attention(n) - rates.dense_s)
                eqs.append((-lk.slope - lg.slope * act_gpu, la.slope - lk.slope - lg.slope, -c))
    pts = []
    cands = lines + eqs
    for i in range(len(lines)):  # vertices (edge x edge) and balance points (edge x zero line)
        for j in range(i + 1, len(cands)):
            (a1, b1, c1), (a2, b2, c2) = cands[i], cands[j]
            det = a1 * b2 - a2 * b1
            if abs(det) > 1e-15 * max(1.0, abs(a1 * b2), abs(a2 * b1)):
                pts.append(((c1 * b2 - c2 * b1) / det, (a1 * c2 - a2 * c1) / det))
    best = None
    for g, a in pts:
        if not feasible(g, a):
            continue
        for gi in {math.floor(g + 1e-9), math.ceil(g - 1e-9)}:
            for ai in {math.floor(a + 1e-9), math.ceil(a - 1e-9)}:
                gi2, ai2 = min(max(gi, 0), g_max), max(ai, 0)
                if not feasible(gi2, ai2):
                    continue
                t = layer_s(gi2, ai2)
                if best is None or (t, -gi2) < (best[0], -best[1]):
                    best = (t, gi2, ai2)
    if best is None:
        raise ValueError(f"{n} blocks do not fit: {n - g_max} host blocks need at least "
                         f"{(n - g_max) * min(per_act, per_kv) / 1e9:.2f} GB of host memory, the budget is "
                         f"{host_bytes / 1e9:.2f} GB")
    t, g, a = best
    k = n - g - a
    why = (f"balanced split of {n} blocks: {g} GPU-resident ({gpu_kind}), {a} host ACT, {k} host KV; predicted "
           f"{t * 1e3:.3f} ms/layer (PCIe {rates.pcie_s(k, a) * 1e3:.3f}, GPU "
           f"{rates.gpu_s(k + (1 - act_gpu) * g, a + act_gpu * g) * 1e3:.3f})")
    return BlockAllocation(k, a, g, gpu_kind, why)


# ---------------------------------------------------------------------------------------------
# mini-batches
# ---------------------------------------------------------------------------------------------


def balance_factor(rates: BlockRates, kv_host: float, act_host: float, act_all: float) -> float:
    """F_b = max(balance, 1 / balance), balance = T_kv_gen(#ACT) / T_load(#KV, #ACT moved): 1 when
    the mini-batch's recomputation exactly hides under its transfers. Marginal rates (slopes): the
    lines' intercepts are per transfer or per program, not per request."""
    gen = rates.kv_gen.slope * act_all
    load = rates.load_kv.slope * kv_host + rates.load_act.slope * act_host
    if gen <= 0 and load <= 0:
        return 1.0
    if gen <= 0 or load <= 0:
        return math.inf
    b = gen / load
    return max(b, 1.0 / b)


def pack_mini_batches(req_kv, req_act_host, req_act_all, kv_max: float, act_max: float, rates: BlockRates,
                      tolerance: float = 0.02):
    """Greedy bin packing of requests (in order) into mini-batches: a request joins the current
    mini-batch if the mini-batch still fits (#KV <= kv_max, host #ACT <= act_max: the GPU buffer) and its
    F_b does not rise (by more than `tolerance`: requests that follow one global ratio differ only by a
    block of rounding); otherwise a new mini-batch starts. Returns [(start, stop)] contiguous ranges
    (the pipeline's GPU batches; a request too large for a bin alone gets one to itself)."""
    n = len(req_kv)
    if n == 0:
        return []
    bins, start = [], 0
    kv, ah, aa = float(req_kv[0]), float(req_act_host[0]), float(req_act_all[0])
    for r in range(1, n):
        nkv, nah, naa = kv + req_kv[r], ah + req_act_host[r], aa + req_act_all[r]
        fits = nkv <= kv_max and nah <= act_max
        if fits and balance_factor(rates, nkv, nah, naa) <= balance_factor(rates, kv, ah, aa) * (1 + tolerance):
            kv, ah, aa = nkv, nah, naa
            continue
        bins.append((start, r))
        start, kv, ah, aa = r, float(req_kv[r]), float(req_act_host[r]), float(req_act_all[r])
    bins.append((start, n))
    return bins


def buffer_capacities(rates: BlockRates, buffer_bytes: float, act_share_host: float) -> tuple[float, float]:
    """#KV_max and host #ACT_max of one mini-batch: the per-layer transfer buffer split between the
    kinds in the proportion of the host allocation (so both fill together at the global ratio)."""
    kv_frac_bytes = (1 - act_share_host) * rates.kv_bytes
    act_frac_bytes = act_share_host * rates.act_bytes
    tot = kv_frac_bytes + act_frac_bytes
    if tot <= 0:
        return math.inf, math.inf
    kv_max = buffer_bytes * (kv_frac_bytes / tot) / rates.kv_bytes
    act_max = buffer_bytes * (act_frac_bytes / tot) / rates.act_bytes
    return kv_max, act_max


# ---------------------------------------------------------------------------------------------
# the pool layout of one mini-batch
# ---------------------------------------------------------------------------------------------


def hybrid_layouts(cfg, dtype, group_lengths, capacity: int, classes, *, block_tokens: int,
                   extent_mb: float) -> list:
    """The classed PoolLayout of each GPU batch (mini-batch): `full`'s own extents (`plan_pool`: the
    same sizes in the same order, so the allocator puts every block exactly where `full`'s does and
    attention merges each request's partial sums over the same groups of blocks in the same order: fp32
    logits bit-identical to full's at every split), each extent tagged with one class.

    The tags (`tag_extents`) keep the shares per request at extent granularity (HybridServe's
    per-request ratio, which the old block-by-block classes held to one block): prompt extents hold
    position-major slices of every request's prompt, generated extents whole flushes (the same number
    of blocks of every request). With W the most blocks one request has in one extent of its
    mini-batch (one extent's slice), at every length a request's context reaches its blocks of each
    class differ from share x its blocks by at most W / 2 for one request and two classes, and by at
    most 2 W in general (ragged prompts end in different extents and extents may hold only some
    requests' blocks, so requests sharing an extent can pull different ways; measured <= 1.8 W on
    random ragged batches with three classes; tests/test_hybrid.py holds it to 2 W). The batch's
    totals follow the shares to about one extent per mini-batch."""
    from kvoffload.plan.memory import plan_pool

    pool = plan_pool(cfg, dtype, group_lengths, capacity, block_tokens=block_tokens, extent_mb=extent_mb)
    fulls = pool.layouts
    slices = [extent_slices(lay, lens, pool.flushes) for lay, lens in zip(fulls, group_lengths)]
    tags = tag_extents(slices, [c.share for c in classes])
    return [dataclasses.replace(lay, kv_extents=(0, 0), act_extents=(0, 0), classes=tuple(classes), extent_class=t,
                                extent_sizes=tuple(lay.size(e) for e in range(lay.num_extents)))
            for lay, t in zip(fulls, tags)]


def extent_slices(layout, lengths, flushes: int) -> np.ndarray:
    """[num_extents, B]: each request's blocks in each extent after its prompt and `flushes` lockstep
    flushes (the end of its generation), where the pool's allocator puts them (prompts position-major,
    the prompt extents' spare slots reserved, then one block per request per flush; one free list,
    lowest id first, whatever the classes)."""
    from kvoffload.runtime.pool import BlockAllocator, allocate_prompts_aligned

    lens = np.asarray(lengths, np.int64)
    alloc = BlockAllocator(layout.num_blocks, len(lens), layout.block_tokens)
    allocate_prompts_aligned(alloc, layout, lens)
    for _ in range(flushes):
        for r in range(len(lens)):
            alloc.allocate(r)
    used = np.flatnonzero(alloc.owner >= 0)
    out = np.zeros((layout.num_extents, len(lens)), np.int64)
    np.add.at(out, (layout.locate(used)[0], alloc.owner[used]), 1)
    return out


def tag_extents(slices, shares) -> list:
    """A class per extent of each mini-batch (slices: per mini-batch, [num_extents, B] blocks of each
    request per extent, extents in allocation order). Greedy, extent by extent, HybridServe's per-request
    rule at extent granularity: each extent goes to the class its requests are furthest behind on,
    weighted by their blocks there: argmax over c of sum_r w_r (share_c (n_r + w_r) - count_{r,c}),
    n_r and count_{r,c} the request's blocks (of class c) so far. For one request, or requests with the
    same slices, it is the classic largest-deficit rule, which keeps two classes within half a slice
    of their shares. Ties go to the class furthest behind over every mini-batch's blocks so far, then
    the lowest class. (A rule on the batch's totals alone would let a request that always sits in
    every other extent drift without bound.)"""
    s = np.asarray(shares, np.float64)
    s = s / s.sum()
    total, count = 0.0, np.zeros(len(s))
    out = []
    for w in slices:
        w = np.asarray(w, np.float64)
        have = np.zeros((w.shape[1], len(s)))  # blocks of each request of each class so far
        tags = []
        for row in w:
            deficit = s[None, :] * (have.sum(1) + row)[:, None] - have  # [B, classes]
            key = row @ deficit
            behind = s * (total + row.sum()) - count
            c = int(np.lexsort((-np.arange(len(s)), behind, np.round(key, 9)))[-1])
            have[:, c] += row
            total += row.sum()
            count[c] += row.sum()
            tags.append(c)
        out.append(tuple(tags))
    return out


def request_blocks(layouts, group_lengths, flushes: int) -> np.ndarray:
    """[B, n_classes]: each request's blocks of each class after its prompt and `flushes` flushes (the
    GPU batches' requests in order), as the classed layouts hold them."""
    parts = []
    for lay, lens in zip(layouts, group_lengths):
        w = extent_slices(lay, lens, flushes)
        cls = np.asarray(lay.extent_class, np.int64)
        parts.append(np.stack([w[cls == c].sum(0) for c in range(len(lay.classes))], 1))
    return np.concatenate(parts, 0) if parts else np.zeros((0, 0), np.int64)
