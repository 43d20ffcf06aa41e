"""CLO's persistent-head planning and its profiling pre-run.

CLO keeps the whole KV on the host and, per decode step and KV head, reuses the head's GPU cache of
the last fetched top-k while the new query stays close to the cached one (cosine >= tau_i). A head
whose queries drift faster than its threshold allows misses often, so its top-k must be fetched
often; speculative prefetch hides only so many such fetches under a layer's compute. The rest keep
their whole KV on the GPU ("persistent heads"):

* reuse difficulty  D_i = tau_i - (s_hat_i - epsilon)          [L, n_kv], dimensionless (cosines)
  (s_hat_i: the head's profiled mean adjacent-query cosine; epsilon: a safety margin; D_i > 0 means
  the head's typical similarity, less the margin, is below its threshold: it will usually miss.)
* prefetchable heads N_p = floor(T_comp / (mem_head / B_pcie))  per layer, a count
  (T_comp [s] the layer's compute time, mem_head [bytes] one KV head's top-k K/V for the batch,
  B_pcie [bytes/s]: mem_head / B_pcie is the seconds one head's fetch takes.)
* persistent heads  N_persist = max(N_d - N_p, 0), N_d = #{i : D_i > 0}, the N_persist highest-D_i
  heads of the layer; every head of layer 0 (no layer before it to prefetch from); when the GPU
  budget is short the lowest-D_i heads go first, over all layers.

The pre-run (:func:`profile_query_similarity`) measures s_hat on a real model, teacher-forced: a
forward pass over given token sequences yields every layer's RoPE'd query at every position, exactly
the queries greedy decoding of those tokens would produce.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.config import ModelConfig
from kvoffload.errors import KVOffloadError
from kvoffload.plan.deploy import clo_thresholds, group_scores, group_similarity
from kvoffload.models.transformer import family, layer_prefill
from kvoffload.plan.cost import CostModel, LayerShape, LayerWork, predict_layers

PROFILE_FORMAT = "kvoffload.clo_profile/1"


class CloPlanError(KVOffloadError, ValueError):
    """Bad input to CLO's planning (shapes, budgets, a damaged profile)."""


# -- thresholds and reuse difficulty ---------------------------------------------------------------

def kv_thresholds(scores, num_kv_heads: int, eta: float = 0.8, p: float = 3.0) -> np.ndarray:
    """Per-KV-head reuse thresholds tau [L, n_kv] from head-importance scores.

    scores [L, n_kv] (the shipped / `train-importance` granularity) are used as they are; scores
    [L, n_heads] per query head are first averaged over each GQA group (`group_scores`): a KV head's
    cache is shared by its group, so it gets one threshold, that of the group's mean importance.
    Then tau = cos(lambda arccos(eta) + (1 - lambda) pi), lambda = s^p (`clo_thresholds`).
    """
    s = np.asarray(scores, np.float64)
    if s.ndim != 2:
        raise CloPlanError(f"head scores must be [layers, heads], got shape {s.shape}")
    if s.shape[1] != num_kv_heads:
        if s.shape[1] % num_kv_heads:
            raise CloPlanError(f"{s.shape[1]} head scores per layer do not group into {num_kv_heads} KV heads")
        s = np.asarray(group_scores(s, s.shape[1] // num_kv_heads), np.float64)
    return np.asarray(clo_thresholds(s, eta, p), np.float64)


def reuse_difficulty(tau, s_hat, epsilon: float) -> np.ndarray:
    """D = tau - (s_hat - epsilon) per KV head, [L, n_kv] (cosine units)."""
    tau = np.asarray(tau, np.float64)
    s_hat = np.asarray(s_hat, np.float64)
    if tau.shape != s_hat.shape or tau.ndim != 2:
        raise CloPlanError(f"tau {tau.shape} and s_hat {s_hat.shape} must both be [layers, kv_heads]")
    if not (np.all(np.isfinite(tau)) and np.all(np.isfinite(s_hat)) and math.isfinite(epsilon)):
        raise CloPlanError("tau, s_hat and epsilon must be finite")
    return tau - (s_hat - epsilon)


# -- how many heads' fetches hide under a layer's compute ------------------------------------------

def topk_head_bytes(head_dim: int, k_tokens: int, batch: int, dtype_bytes: int) -> float:
    """mem_head: bytes of one KV head's fetched top-k K and V for the whole batch (2 k d p B)."""
    return 2.0 * batch * k_tokens * head_dim * dtype_bytes


def full_head_bytes(head_dim: int, context: int, batch: int, dtype_bytes: int) -> float:
    """Bytes one persistent KV head keeps on the GPU: its whole K and V for the batch (2 S d p B)."""
    return 2.0 * batch * context * head_dim * dtype_bytes


def layer_compute_s(cost: CostModel, shape: LayerShape, batch: int, tokens: int) -> float:
    """T_comp [s]: GPU time of one decode layer for `batch` sequences each attending `tokens` tokens
    (CLO: top-k + sink + recent), nothing transferred: the cost model's projections + MLP +
    attention terms of a LayerWork with no bytes to move."""
    if batch < 1 or tokens < 0:
        raise CloPlanError(f"batch must be >= 1 and tokens >= 0, got batch={batch}, tokens={tokens}")
    return predict_layers(cost, shape, [LayerWork(batch=batch, attended_tokens=batch * tokens)])["gpu_s"]


def prefetchable_heads(t_comp_s, pcie_bw: float, head_bytes: float) -> np.ndarray:
    """N_p = floor(T_comp / (mem_head / B_pcie)) per layer: how many KV heads' top-k fetches hide
    under one layer's compute.

    t_comp_s: seconds, scalar or [L]; pcie_bw: bytes/s; head_bytes (mem_head): bytes. The paper
    writes N_p = T_comp / (B_pcie * mem_head), which has units s^2/bytes^2; the count meant is
    compute time over the time of one head's fetch, mem_head / B_pcie seconds, i.e.
    T_comp * B_pcie / mem_head (dimensionless). Returns int64 with the shape of t_comp_s.
    """
    t = np.asarray(t_comp_s, np.float64)
    if pcie_bw <= 0 or head_bytes <= 0 or np.any(t < 0) or not np.all(np.isfinite(t)):
        raise CloPlanError(f"need T_comp >= 0, B_pcie > 0, mem_head > 0; got T_comp={t_comp_s}, "
                           f"B_pcie={pcie_bw}, mem_head={head_bytes}")
    # the 1e-9 keeps an exact quotient (3.0 computed as 2.9999999) from losing a head
    return np.floor(t * pcie_bw / head_bytes + 1e-9).astype(np.int64)


# -- which heads keep their whole KV on the GPU ----------------------------------------------------

def persistent_heads(D, n_p, gpu_budget_bytes: float | None, full_head_bytes) -> tuple[np.ndarray, dict]:
    """Persistent-head mask [L, n_kv] (True = whole KV on the GPU) and a report.

    Per layer l >= 1: N_d = #{D > 0}, N_persist = max(N_d - N_p, 0), the N_persist highest-D heads
    (ties: lower head index first). Layer 0: every head. Then, while the chosen heads' bytes exceed
    gpu_budget_bytes (None: no limit), the chosen head with the lowest D over all layers is dropped
    (ties: earlier layer, then lower head, first); layer 0's heads go only once no other is left.

    D [L, n_kv]; n_p int, scalar or [L]; full_head_bytes: bytes of one head's whole KV, scalar or
    [L, n_kv]. Report: per layer lists n_d, n_p, n_persist (wanted), n_kept (after the budget),
    bytes (kept); dropped: [(layer, head, D)] in drop order; total_bytes; budget_bytes.
    """
    D = np.asarray(D, np.float64)
    if D.ndim != 2 or D.shape[0] < 1 or not np.all(np.isfinite(D)):
        raise CloPlanError(f"D must be a finite [layers, kv_heads] array, got shape {D.shape}")
    L, n_kv = D.shape
    n_p = np.asarray(n_p, np.int64)
    if n_p.shape not in ((), (L,)) or np.any(n_p < 0):
        raise CloPlanError(f"N_p must be >= 0, a scalar or one per layer ({L}), got {n_p.tolist()}")
    n_p = np.broadcast_to(n_p, (L,))
    hb = np.asarray(full_head_bytes, np.float64)
    if hb.shape not in ((), D.shape) or np.any(hb <= 0):
        raise CloPlanError(f"full_head_bytes must be > 0, a scalar or [layers, kv_heads], got shape {hb.shape}")
    hb = np.broadcast_to(hb, D.shape)
    if gpu_budget_bytes is not None and gpu_budget_bytes < 0:
        raise CloPlanError(f"gpu_budget_bytes must be >= 0, got {gpu_budget_bytes}")

    n_d = (D > 0).sum(axis=1)
    n_persist = np.maximum(n_d - n_p, 0)
    n_persist[0] = n_kv
    mask = np.zeros(D.shape, bool)
    mask[0] = True
    for l in range(1, L):
        order = np.argsort(-D[l], kind="stable")  # highest D first, ties by head index
        mask[l, order[:n_persist[l]]] = True  # n_persist <= n_d, so only heads with D > 0

    dropped = []
    if gpu_budget_bytes is not None:
        total = float(hb[mask].sum())
        # candidates in drop order: layers >= 1 before layer 0, then D ascending, then position
        layer_idx, head_idx = np.nonzero(mask)
        order = np.lexsort((head_idx, layer_idx, D[layer_idx, head_idx], layer_idx == 0))
        for i in order:
            if total <= gpu_budget_bytes:
                break
            l, h = int(layer_idx[i]), int(head_idx[i])
            mask[l, h] = False
            total -= float(hb[l, h])
            dropped.append((l, h, float(D[l, h])))

    bytes_per_layer = (hb * mask).sum(axis=1)
    report = {"n_d": n_d.tolist(), "n_p": n_p.tolist(), "n_persist": n_persist.tolist(),
              "n_kept": mask.sum(axis=1).tolist(), "bytes": bytes_per_layer.tolist(),
              "dropped": dropped, "total_bytes": float(bytes_per_layer.sum()), "budget_bytes": gpu_budget_bytes}
    return mask, report


def plan_persistent_heads(cfg: ModelConfig, cost: CostModel, shape: LayerShape, s_hat, scores, *, batch: int,
                          context: int, k_tokens: int, sink: int = 4, recent: int = 64, dtype_bytes: int = 2,
                          gpu_budget_bytes: float | None = None, eta: float = 0.8, p: float = 3.0,
                          epsilon: float = 0.05, devices: int = 1) -> tuple[np.ndarray, dict]:
    """The whole item: thresholds from `scores` (`kv_thresholds`), D from the profiled s_hat [L, n_kv],
    T_comp of a layer attending k_tokens + sink + recent tokens per sequence (`layer_compute_s`),
    N_p with mem_head = one head's top-k K/V for the batch and B_pcie = the cost model's H2D
    bandwidth, then `persistent_heads` with each head's whole KV (context tokens) as its size.
    Returns (mask, report); the report also carries tau, D, t_comp_s, mem_head_bytes.

    devices > 1 (tensor parallelism over heads: device i holds KV heads [i n_kv / N, (i + 1) n_kv / N), its own
    PCIe link and its share of the compute; `shape` is one device's): each device's heads are planned on their
    own (N_p heads of it hide under its layer time, its D ranks its heads; gpu_budget_bytes is per device), and
    the masks are joined. Devices may then keep different counts: the policy's buffers are whole-capacity for
    every head of a layer with a persistent one, so shapes stay equal per device."""
    tau = kv_thresholds(scores, cfg.num_kv_heads, eta, p)
    s_hat = np.asarray(s_hat, np.float64)
    if s_hat.shape != (cfg.num_layers, cfg.num_kv_heads):
        raise CloPlanError(f"s_hat must be [{cfg.num_layers}, {cfg.num_kv_heads}] for this model, got {s_hat.shape}")
    D = reuse_difficulty(tau, s_hat, epsilon)
    t_comp = layer_compute_s(cost, shape, batch, k_tokens + sink + recent)
    mem_head = topk_head_bytes(cfg.head_dim, k_tokens, batch, dtype_bytes)
    n_p = prefetchable_heads(np.full(cfg.num_layers, t_comp), cost.pcie_bw, mem_head)
    whole = full_head_bytes(cfg.head_dim, context, batch, dtype_bytes)
    if cfg.num_kv_heads % devices:
        raise CloPlanError(f"{cfg.num_kv_heads} KV heads do not split over {devices} devices")
    per = cfg.num_kv_heads // devices
    parts = [persistent_heads(D[:, i * per:(i + 1) * per], n_p, gpu_budget_bytes, whole) for i in range(devices)]
    mask = np.concatenate([m for m, _ in parts], axis=1)
    if devices == 1:
        report = parts[0][1]
    else:  # counts and bytes summed over the devices; dropped heads by their model-wide index
        reps = [r for _, r in parts]
        report = {k: np.sum([r[k] for r in reps], axis=0).tolist() for k in ("n_d", "n_persist", "n_kept", "bytes")}
        report.update(n_p=reps[0]["n_p"], dropped=[(l, i * per + h, dd) for i, r in enumerate(reps) for l, h, dd in r["dropped"]],
                      total_bytes=float(sum(r["total_bytes"] for r in reps)), budget_bytes=gpu_budget_bytes,
                      devices=devices, n_kept_per_device=[r["n_kept"] for r in reps])
    report.update(tau=tau.tolist(), D=D.tolist(), t_comp_s=t_comp, mem_head_bytes=mem_head)
    return mask, report


# -- the profiling pre-run: s_hat on a real model --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CloProfile:
    """What the pre-run measured: mean adjacent-query cosines per query head and per KV head."""

    model: str
    date: str
    s_hat_q: np.ndarray  # [L, n_heads]: mean over adjacent position pairs of cos(q_t, q_t+1)
    s_hat: np.ndarray  # [L, n_kv]: s_hat_q aggregated over each GQA group (see `aggregation`)
    aggregation: str  # "mean" or "importance-harmonic"
    num_sequences: int
    num_pairs: int  # adjacent pairs averaged per head
    skip: int  # positions < skip were left out (the query at position skip starts the first pair)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _adjacent_query_cosines(cfg: ModelConfig, params, tokens, lengths):
    """Per layer cos(q_t, q_{t+1}) of every query head: [L, B, n_heads, T-1] (float32), teacher-forced
    over tokens [B, T] right-padded to lengths [B]; q is the layer's RoPE'd query (`family(cfg).qkv`)."""
    fam = family(cfg)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = fam.embed(cfg, params, tokens, positions)
    out = []
    for lp in params.layers:
        q, _, _ = fam.qkv(cfg, lp, fam.attn_input(cfg, lp, h), positions)
        q = q.astype(jnp.float32)
        dot = jnp.sum(q[:, :, 1:] * q[:, :, :-1], axis=-1)
        norm = jnp.linalg.norm(q[:, :, 1:], axis=-1) * jnp.linalg.norm(q[:, :, :-1], axis=-1)
        out.append(dot / jnp.maximum(norm, 1e-30))
        h, _, _, _ = layer_prefill(cfg, lp, h, positions, lengths)
    return jnp.stack(out)


def _token_ids(model, prompt) -> list[int]:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise CloPlanError("a text prompt needs a model with a tokenizer; pass token ids instead")
        return list(model.tokenizer.encode(prompt))
    return [int(t) for t in prompt]


def profile_query_similarity(model, prompts, *, weights=None, skip: int = 0, model_name: str | None = None
                             ) -> CloProfile:
    """The pre-run: s_hat per query head and per KV head from teacher-forced passes over `prompts`
    (texts or token-id sequences, one pass each, so no padding enters).

    s_hat_q[l, i] = mean over every adjacent pair (t, t+1), t >= skip, of every sequence of
    cos(q_t, q_{t+1}) of query head i in layer l. Aggregated to KV heads, per group g:
    weights None -> plain mean of the group's s_hat_q ("mean"); weights [L, n_heads] or [L, n_kv]
    (head importance; per KV head means one weight for the whole group, i.e. the plain mean) -> the
    importance-weighted harmonic mean sum w / sum (w / s_hat_q) (`group_similarity`, the aggregation
    CLO's cache lookup applies to per-step similarities; "importance-harmonic").
    """
    cfg = model.config
    seqs = [_token_ids(model, p) for p in prompts]
    if not seqs or any(len(s) < skip + 2 for s in seqs):
        raise CloPlanError(f"need at least one prompt, each of at least skip + 2 = {skip + 2} tokens")
    total = np.zeros((cfg.num_layers, cfg.num_heads))
    pairs = 0
    for s in seqs:
        tokens = jnp.asarray([s], jnp.int32)
        cos = np.asarray(_adjacent_query_cosines(cfg, model.params, tokens, jnp.asarray([len(s)], jnp.int32)))
        total += cos[:, 0, :, skip:].sum(axis=-1)
        pairs += len(s) - 1 - skip
    s_hat_q = total / pairs
    g = cfg.group_size
    grouped = s_hat_q.reshape(cfg.num_layers, cfg.num_kv_heads, g)
    if weights is None:
        s_hat, aggregation = grouped.mean(-1), "mean"
    else:
        w = np.asarray(weights, np.float64)
        if w.shape == (cfg.num_layers, cfg.num_kv_heads):
            w = np.repeat(w, g, axis=-1)
        if w.shape != (cfg.num_layers, cfg.num_heads):
            raise CloPlanError(f"weights must be [{cfg.num_layers}, {cfg.num_heads}] or "
                               f"[{cfg.num_layers}, {cfg.num_kv_heads}], got {w.shape}")
        s_hat = np.asarray(group_similarity(grouped, w.reshape(grouped.shape)), np.float64)
        aggregation = "importance-harmonic"
    name = model_name or f"{cfg.model_type} L{cfg.num_layers} H{cfg.num_heads}/{cfg.num_kv_heads}"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return CloProfile(model=name, date=date, s_hat_q=s_hat_q, s_hat=s_hat, aggregation=aggregation,
                      num_sequences=len(seqs), num_pairs=pairs, skip=skip)


def save_clo_profile(path: str, profile: CloProfile) -> None:
    d = {"format": PROFILE_FORMAT, **dataclasses.asdict(profile)}
    d["s_hat_q"] = np.asarray(profile.s_hat_q).tolist()
    d["s_hat"] = np.asarray(profile.s_hat).tolist()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(d, f, indent=1)


def load_clo_profile(path: str) -> CloProfile:
    if not os.path.exists(path):
        raise CloPlanError(f"CLO profile not found: {path} (write one with save_clo_profile)")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise CloPlanError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
        raise CloPlanError(f"{path} is not a CLO profile (format {PROFILE_FORMAT!r})")
    fields = {f.name for f in dataclasses.fields(CloProfile)}
    missing = fields - d.keys()
    if missing:
        raise CloPlanError(f"{path} lacks {sorted(missing)}")
    kw = {k: d[k] for k in fields}
    kw["s_hat_q"] = np.asarray(d["s_hat_q"], np.float64)
    kw["s_hat"] = np.asarray(d["s_hat"], np.float64)
    if kw["s_hat"].ndim != 2 or kw["s_hat_q"].ndim != 2 or kw["s_hat"].shape[0] != kw["s_hat_q"].shape[0]:
        raise CloPlanError(f"{path}: s_hat {kw['s_hat'].shape} / s_hat_q {kw['s_hat_q'].shape} are not [layers, heads]")
    return CloProfile(**kw)
