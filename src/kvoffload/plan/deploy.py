"""Deployment: the trained components (head-importance scores, HATA projections; trained by
`kvoffload.importance`) -> what the planners and policies use.

* :func:`load_scores` / :func:`load_projections` read the trained files; :func:`init_projection` is the untrained
  (SimHash) baseline; :func:`encode_keys` / :func:`encode_queries` give the HATA codes of keys / queries.
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

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.errors import check_finite_result

SCORES_JSON = "head_scores.json"


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


def load_scores(path: str) -> np.ndarray:
    """alpha [L, n] from a head_scores.json file, its directory, or an orbax `scores` directory."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path) and os.path.exists(os.path.join(path, SCORES_JSON)):
        path = os.path.join(path, SCORES_JSON)
    if path.endswith(".json"):
        with open(path) as f:
            alpha = np.asarray(json.load(f)["alpha"], np.float32)
    else:
        import orbax.checkpoint as ocp

        alpha = np.asarray(ocp.StandardCheckpointer().restore(path)["alpha"], np.float32)
    check_finite_result(f"head scores file {path}", alpha, "not used (train the scores again)")  # NaN scores would rank heads at random
    return alpha


def init_projection(cfg, bits: int, seed: int):
    """Gaussian W [L, n_kv, d, r] with entries N(0, 1/d) (SimHash; the untrained baseline)."""
    if bits % 32:
        raise ValueError(f"bits must be a multiple of 32 (packed uint32 words), got {bits}")
    d = cfg.head_dim
    shape = (cfg.num_layers, cfg.num_kv_heads, d, bits)
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) / np.sqrt(d)


def load_projections(path: str) -> np.ndarray:
    """W [L, n_kv, d, r] from an output directory (or its `hata` orbax directory)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(os.path.join(path, "hata")):
        path = os.path.join(path, "hata")
    return np.asarray(ocp.StandardCheckpointer().restore(path)["w"], np.float32)


def encode_keys(w_layer, k):
    """Packed codes of k [B, n_kv, S, d] with w_layer [n_kv, d, r] -> uint32 [B, n_kv, S, r // 32]."""
    return jax.vmap(ops.hata_encode, in_axes=(1, 0), out_axes=1)(k, w_layer)


def encode_queries(w_layer, q, group_size: int):
    """Packed codes of q [B, n_heads, d] (query head h uses W of KV head h // G) -> [B, n_heads, r // 32]."""
    w_q = jnp.repeat(w_layer, group_size, axis=0)  # [n_heads, d, r]
    return jax.vmap(ops.hata_encode, in_axes=(1, 0), out_axes=1)(q, w_q)
