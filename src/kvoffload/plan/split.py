"""KVPR's split scheduler on the block pool.

For one layer of a decode step, each extent of the pool in use, [0, n), can be attended from K/V
fetched from host memory or from K/V recomputed on the GPU from its activations X (fetched instead of
the K/V: half the bytes for MHA). The split r recomputes extents [0, r) and fetches the K/V of [r, n).
Transfers of layer i+1 run under layer i's compute, so a layer costs max(PCIe time, GPU time), both
from the shared cost model (`plan.cost.predict_layers` over the `LayerWork` each r implies). Under
tensor parallelism the times are one device's (`LayerShape.of(..., tensor_parallel=N)`): its 1/N of X
and of the K/V over its own link, its share of the recompute, and what recomputing costs between the
devices (GPU time: with X split by token the merge of the partial softmaxes, with X split along H the
all-gather of the recomputed X), so the split that balances the two sides moves with N. The
candidates are few (the extents in use, plus one), so `choose_split` evaluates every one and keeps the
fastest, the smallest r on ties.

With GQA, when an activation is at least as large as its K/V (h >= 2 n_kv d; with the host pool's K/V
and X in int4, their stored bytes), recomputing can only add PCIe bytes: `no_recompute_reason` says so and the
policy stores no activations at all.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from kvoffload.plan.cost import CostModel, LayerShape, LayerWork, predict_layers


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    r: int  # extents recomputed from X
    predicted_s: float  # predicted seconds of one layer at r
    reason: str


def no_recompute_reason(shape: LayerShape) -> str | None:
    # the bytes a fetch moves: X and K/V as the host pool stores them (int4: both quantized alike, so
    # the comparison is h vs 2 n_kv d in either dtype, up to the scales)
    if shape.x_host_tok >= shape.kv_host_tok:
        why = "GQA" if shape.kv_host_tok == shape.kv_tok else "GQA, both stored in int4"
        return (f"no recompute: an activation ({shape.x_host_tok:.0f} B/token) is at least as large as its K/V "
                f"({shape.kv_host_tok:.0f} B/token, {why}), so recomputing can only add PCIe bytes; "
                "no activations stored")
    return None


def choose_split(cost: CostModel, shape: LayerShape, work_of: Callable[[int], Sequence[LayerWork]],
                 candidates: Sequence[int], *, offload_weights: bool = False) -> SplitPlan:
    """The r in candidates minimising the predicted layer time; work_of(r) is the layer's work (one
    LayerWork per GPU batch) when extents [0, r) are recomputed."""
    if not candidates:
        raise ValueError("choose_split needs at least one candidate")
    preds = {r: predict_layers(cost, shape, work_of(r), offload_weights=offload_weights) for r in candidates}
    times = {r: p["step_s"] for r, p in preds.items()}
    best = min(candidates, key=lambda r: (times[r], r))
    if best == 0:
        reason = "no recompute: the GPU time (or transfer latency) dominates, recomputing would not shorten the layer"
    else:
        reason = (f"recompute {best} extents from X: predicted {times[best] * 1e3:.3f} ms/layer vs "
                  f"{times[candidates[0]] * 1e3:.3f} ms at {candidates[0]}")
    if shape.tensor_parallel > 1:
        p = preds[best]
        what = "all-gather of X" if shape.x_gather_tok > 0 else "exchange of partial softmaxes (X split by token)"
        reason += (f" (per device of {shape.tensor_parallel}: transfer {p['transfer_s'] * 1e3:.3f} ms, GPU "
                   f"{p['gpu_s'] * 1e3:.3f} ms of which {what} {p['bytes_gather'] / 1e6:.4g} MB "
                   f"{p['gather_s'] * 1e3:.3f} ms; {cost.describe_all_gather()})")
    return SplitPlan(best, times[best], reason)


# ---------------------------------------------------------------------------------------------
# top-k over activations (clo, tokenselect kv=split with store=auto): per layer, K/V rows or X rows
# ---------------------------------------------------------------------------------------------


def expected_union(k: float, n: float, heads: int, forced: float = 0.0) -> float:
    """Expected tokens in the union of `heads` selections of k of n tokens each: the `forced` ones (sinks,
    recent tokens) common to every head, the rest drawn independently. Real heads agree more than
    independent ones, so this is an upper estimate of the X rows a re-selection reads."""
    n, k, forced = float(n), min(float(k), float(n)), min(float(forced), float(k))
    if n <= forced:
        return n
    return forced + (n - forced) * (1.0 - (1.0 - (k - forced) / (n - forced)) ** heads)


@dataclasses.dataclass(frozen=True)
class RowStorePlan:
    store: str  # "kv": the layer's host pool holds K/V (or V) rows; "act": activations X, K/V recomputed
    reason: str
    kv_s: float  # predicted seconds of one re-selection's rows fetched as K/V (V) rows
    act_s: float  # as X rows plus their recomputation (inf where X cannot pay)


def choose_row_store(cost: CostModel, shape: LayerShape, *, k_on_device: bool, kv_tokens: float,
                     x_tokens: float) -> RowStorePlan:
    """KV or ACT for one layer of a selective policy (clo, tokenselect kv=split), from the cost model's rates.

    A re-selection reads its rows inside the layer program (a zero-copy gather on the compute stream: no
    overlap), so the two ways cost transfer + compute, not their max: K/V rows of kv_tokens tokens (the
    heads' selected (token, head) rows / n_kv; V alone where K stays on the GPU for scoring), or X rows of
    the x_tokens tokens in the union of the heads' selections (X is per token, shared by every head) plus
    their K/V (V) recomputed. Per token an activation (h p) is half of its K/V (2 n_kv d p) for MHA, the
    size of its V alone, and larger than both for GQA with n_kv d < h / 2."""
    row_tok = shape.kv_host_tok / 2 if k_on_device else shape.kv_host_tok
    bytes_kv, bytes_x = kv_tokens * row_tok, x_tokens * shape.x_host_tok
    t_kv = cost.h2d(bytes_kv)
    if shape.x_host_tok >= row_tok:
        if not k_on_device:
            why = no_recompute_reason(shape)
        else:
            why = (f"no recompute: an activation ({shape.x_host_tok:.0f} B/token) is at least as large as the token's "
                   f"V rows of every head ({row_tok:.0f} B/token; K stays on the GPU for scoring, only V crosses"
                   f"{', GQA' if shape.x_tok > shape.kv_tok / 2 else ''}), so fetching X can only add PCIe bytes; "
                   "no activations stored")
        return RowStorePlan("kv", "kv: " + why, t_kv, float("inf"))
    t_rec = cost.recompute(x_tokens * shape.recompute_flops_tok * (0.5 if k_on_device else 1.0))
    t_act = cost.h2d(bytes_x) + t_rec
    what = "V rows" if k_on_device else "K/V rows"
    detail = (f"X rows of {x_tokens:.0f} tokens (the union of the heads' selections) {bytes_x / 1e6:.3f} MB + "
              f"recompute {t_rec * 1e3:.3f} ms = {t_act * 1e3:.3f} ms vs {what} of {kv_tokens:.0f} tokens "
              f"{bytes_kv / 1e6:.3f} MB = {t_kv * 1e3:.3f} ms per re-selection")
    store = "act" if t_act < t_kv else "kv"
    return RowStorePlan(store, f"{store}: {detail}", t_kv, t_act)
