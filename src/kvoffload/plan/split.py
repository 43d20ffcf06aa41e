"""KVPR's split-point scheduler.

For one layer of one decode step with s host slots per sequence, recompute K/V of the first l slots
from their stored activations X and fetch K/V of the rest. Three objectives:

* ``pipelined`` (default; what the runtime executes): layer i+1's transfers run under layer i's
  compute, so a layer costs max(PCIe time, GPU time) with PCIe = X(l) + KV(s-l) (+ weights) and
  GPU = recompute(l) + attention(s) + projections/MLP.
* ``row`` (KVPR Eq. 10, weights resident): t(l) = M_X(l)/v + max(t_recomp(l), M_KV(l)/v).
* ``column`` (Eq. 10 with weights streamed, W_K/W_V first so recomputation starts before the rest):
  t(l) = (W_KV + M_X(l))/v + max(t_recomp(l), (M_KV(l) + W_rest)/v), summed over the GPU batches.

l is restricted to candidate values (bucket multiples), so few compilations happen. Every objective
is convex and piecewise linear in l on the open range (0, s), with jumps at 0 and s (per-transfer
latency), so the minimum over candidates is at 0, at s, at the first / last interior candidate, or at
the candidates around a breakpoint: `choose_split` evaluates only those; `brute_force` evaluates
all (tests check that both agree).

With GQA, when an activation is at least as large as its K/V (h >= 2 n_kv d), recomputing can only
add PCIe bytes: the scheduler returns l = 0 and says why.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

from kvoffload.plan.cost import CostModel, LayerShape, layer_terms

OBJECTIVES = ("pipelined", "row", "column")


@dataclasses.dataclass(frozen=True)
class SplitProblem:
    shape: LayerShape
    batch: int  # sequences per GPU batch
    s: int  # host slots per sequence
    candidates: tuple  # allowed l values, sorted, including 0 and s
    tail: int = 1  # tokens attended on the GPU without transfer
    offload_weights: bool = False
    gpu_batches: int = 1


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    l: int
    predicted_s: float  # objective value per layer
    objective: str
    reason: str


def bucket_candidates(s: int, bucket: int, boundaries: Sequence[int] = ()) -> tuple:
    """0, s and every multiple of bucket in between (plus extra boundaries)."""
    c = set(range(0, s, max(1, bucket))) | {0, s} | {b for b in boundaries if 0 <= b <= s}
    return tuple(sorted(c))


def objective_value(problem: SplitProblem, cost: CostModel, l: int, objective: str = "pipelined") -> float:
    p = problem
    if objective == "pipelined":
        t = layer_terms(cost, p.shape, p.batch, p.s, l, tail=p.tail, offload_weights=p.offload_weights,
                        gpu_batches=p.gpu_batches)
        return t["layer_s"]
    g = p.gpu_batches
    sh = p.shape
    m_x = cost.h2d(p.batch * l * sh.x_tok)
    m_kv = cost.h2d(p.batch * (p.s - l) * sh.kv_tok)
    rec = cost.recompute(p.batch * l * sh.recompute_flops_tok)
    if objective == "row":
        return g * (m_x + max(rec, m_kv))
    if objective == "column":
        w_kv = cost.h2d(sh.w_kv) if p.offload_weights else 0.0
        w_rest = cost.h2d(sh.w_layer - sh.w_kv) if p.offload_weights else 0.0
        return w_kv + g * m_x + max(g * rec, g * m_kv + w_rest)
    raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")


def _pick(problem, cost, ls, objective):
    best_l, best_v = None, None
    for l in sorted(set(ls)):
        v = objective_value(problem, cost, l, objective)
        if best_v is None or v < best_v * (1 - 1e-12):
            best_l, best_v = l, v
    return best_l, best_v


def brute_force(problem: SplitProblem, cost: CostModel, objective: str = "pipelined") -> tuple[int, float]:
    """(l, value) minimising the objective over every candidate (smallest l on ties)."""
    return _pick(problem, cost, problem.candidates, objective)


def _line(problem, cost, objective, la, lb):
    """The objective's two inner linear pieces through interior points la < lb: returns the
    breakpoints where they cross (at most a few)."""
    # Evaluate each piece by finite differences of its terms: pieces are linear on (0, s).
    p, sh = problem, problem.shape
    g = p.gpu_batches

    def pieces(l):
        if objective == "pipelined":
            t = layer_terms(cost, sh, p.batch, p.s, l, tail=p.tail, offload_weights=p.offload_weights,
                            gpu_batches=g)
            return t["transfer_s"], t["gpu_s"]
        m_kv = cost.h2d(p.batch * (p.s - l) * sh.kv_tok)
        rec = cost.recompute(p.batch * l * sh.recompute_flops_tok)
        w_rest = cost.h2d(sh.w_layer - sh.w_kv) if (objective == "column" and p.offload_weights) else 0.0
        return g * rec, g * m_kv + w_rest

    (a1, b1), (a2, b2) = pieces(la), pieces(lb)
    s1 = (a2 - a1) / (lb - la)
    s2 = (b2 - b1) / (lb - la)
    if s1 == s2:
        return []
    # a1 + s1 (l - la) = b1 + s2 (l - la)
    return [la + (b1 - a1) / (s1 - s2)]


def choose_split(problem: SplitProblem, cost: CostModel, objective: str = "pipelined") -> SplitPlan:
    """The split point minimising the objective, from a handful of evaluations."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    sh, c = problem.shape, list(problem.candidates)
    if sh.x_tok >= sh.kv_tok:
        v = objective_value(problem, cost, 0, objective)
        return SplitPlan(0, v, objective,
                         f"no recompute: an activation ({sh.x_tok:.0f} B/token) is at least as large as its K/V "
                         f"({sh.kv_tok:.0f} B/token, GQA), so recomputing can only add PCIe bytes")
    ls = {c[0], c[-1]}
    interior = [l for l in c if 0 < l < problem.s]
    if interior:
        ls |= {interior[0], interior[-1]}
        if len(interior) >= 2:
            for x in _line(problem, cost, objective, interior[0], interior[-1]):
                i = bisect.bisect_left(interior, x)
                ls |= {interior[j] for j in (i - 1, i) if 0 <= j < len(interior)}
    l, v = _pick(problem, cost, ls, objective)
    v0 = objective_value(problem, cost, 0, objective)
    if l == 0:
        reason = "no recompute: the GPU time (or transfer latency) dominates, recomputing would not shorten the layer"
    else:
        reason = (f"recompute {l} of {problem.s} slots from X: predicted {v * 1e3:.3f} ms/layer vs "
                  f"{v0 * 1e3:.3f} ms fetching all K/V")
    return SplitPlan(l, v, objective, reason)
