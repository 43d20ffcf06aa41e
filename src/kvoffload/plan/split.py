"""KVPR's split scheduler on the block pool.

For one layer of a decode step, each extent of the pool in use, [0, n), can be attended from K/V
fetched from host memory or from K/V recomputed on the GPU from its activations X (fetched instead of
the K/V: half the bytes for MHA). The split r recomputes extents [0, r) and fetches the K/V of [r, n).
Transfers of layer i+1 run under layer i's compute, so a layer costs max(PCIe time, GPU time), both
from the shared cost model (`plan.cost.predict_layers` over the `LayerWork` each r implies). The
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
    times = {r: predict_layers(cost, shape, work_of(r), offload_weights=offload_weights)["step_s"] for r in candidates}
    best = min(candidates, key=lambda r: (times[r], r))
    if best == 0:
        reason = "no recompute: the GPU time (or transfer latency) dominates, recomputing would not shorten the layer"
    else:
        reason = (f"recompute {best} extents from X: predicted {times[best] * 1e3:.3f} ms/layer vs "
                  f"{times[candidates[0]] * 1e3:.3f} ms at {candidates[0]}")
    return SplitPlan(best, times[best], reason)
