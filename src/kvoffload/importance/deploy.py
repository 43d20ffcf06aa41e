"""Deployment helpers: learned head-importance scores -> what the runtime uses.

* :func:`binarize` — full/streaming head mask keeping a target fraction of heads full (a global
  quantile over all layers and heads).
* :func:`clo_thresholds` — CLO's per-head cache-reuse thresholds: with an upper bound eta on the
  cosine similarity threshold and lambda_i = s_i^p,
  theta* = arccos(eta), theta_i = lambda_i theta* + (1 - lambda_i) pi, tau_i = cos(theta_i).
  An important head (s_i = 1) gets tau_i = eta (reuse only when queries are very similar); an
  unimportant one (s_i = 0) gets tau_i = cos(pi) = -1 (always reuse).
* :func:`group_similarity` — the importance-weighted harmonic mean of the per-query-head cosine
  similarities inside a GQA group, the number CLO compares with the group's threshold:
  sim_g = sum_i w_i / sum_i (w_i / sim_i), w_i = importance of query head i.
* :func:`group_scores` — per-query-head scores -> per-KV-head (mean over the group), and
  :func:`query_scores` the other way (repeat).
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp


def binarize(scores, full_fraction: float):
    """Boolean mask (same shape as scores), True = keep full attention, for the ceil(fraction * n)
    highest-scoring heads over all layers (ties broken by position, deterministic)."""
    s = np.asarray(scores, np.float64)
    if not 0.0 <= full_fraction <= 1.0:
        raise ValueError(f"full_fraction must be in [0, 1], got {full_fraction}")
    n = s.size
    k = int(np.ceil(full_fraction * n - 1e-9))
    order = np.argsort(-s.reshape(-1), kind="stable")
    mask = np.zeros(n, bool)
    mask[order[:k]] = True
    return mask.reshape(s.shape)


def lowest_mask(scores, fraction: float):
    """Boolean mask of the ceil(fraction * n) lowest-scoring heads (True = switch to streaming)."""
    s = np.asarray(scores, np.float64)
    k = int(np.ceil(fraction * s.size - 1e-9))
    order = np.argsort(s.reshape(-1), kind="stable")
    mask = np.zeros(s.size, bool)
    mask[order[:k]] = True
    return mask.reshape(s.shape)


def highest_mask(scores, fraction: float):
    """Boolean mask of the ceil(fraction * n) highest-scoring heads."""
    return binarize(scores, fraction)


def clo_lambda(scores, p: float = 1.0):
    """lambda_i = s_i ** p, with s clipped to [0, 1]."""
    s = jnp.clip(jnp.asarray(scores, jnp.float32), 0.0, 1.0)
    return s**p


def clo_thresholds(scores, eta: float, p: float = 1.0):
    """Per-head reuse thresholds tau_i = cos(lambda_i arccos(eta) + (1 - lambda_i) pi)."""
    if not -1.0 <= eta <= 1.0:
        raise ValueError(f"eta must be a cosine in [-1, 1], got {eta}")
    lam = clo_lambda(scores, p)
    theta_star = jnp.arccos(jnp.float32(eta))
    theta = lam * theta_star + (1.0 - lam) * jnp.pi
    return jnp.cos(theta)


def group_similarity(cos_sims, weights, eps: float = 1e-6):
    """Importance-weighted harmonic mean over the last axis (the query heads of a GQA group).

    cos_sims [..., G] (cosine similarities of each query head's new query to its cached one),
    weights [..., G] (importance, >= 0). sim = sum w / sum (w / sim). A similarity <= 0 in a head
    with positive weight makes the group's similarity <= eps-small (no reuse): the harmonic mean is
    dominated by its smallest member, which is the point. All-zero weights fall back to equal weights.
    """
    c = jnp.asarray(cos_sims, jnp.float32)
    w = jnp.maximum(jnp.asarray(weights, jnp.float32), 0.0)
    w = jnp.broadcast_to(w, c.shape)
    wsum = jnp.sum(w, axis=-1, keepdims=True)
    w = jnp.where(wsum > 0, w, 1.0)
    wsum = jnp.sum(w, axis=-1)
    inv = jnp.sum(jnp.where(w > 0, w / jnp.maximum(c, eps), 0.0), axis=-1)
    return wsum / inv


def group_scores(scores_q, group_size: int):
    """[L, n_heads] -> [L, n_kv]: mean score over each GQA group."""
    s = jnp.asarray(scores_q)
    return s.reshape(*s.shape[:-1], s.shape[-1] // group_size, group_size).mean(-1)


def query_scores(scores_kv, group_size: int):
    """[L, n_kv] -> [L, n_heads]: each query head takes its group's score."""
    return jnp.repeat(jnp.asarray(scores_kv), group_size, axis=-1)
