"""How much of `full`'s attention a selective policy's retrieval keeps: per layer and KV head, the softmax mass
of the exact attention that falls on the tokens each retrieval selects, at the policy's own budget.

The model runs its full prompt once (no selection anywhere), so every retrieval is judged on the same queries
and keys: those of the last prompt token, which generates the answer's first token. Each retrieval scores
the prompt's keys with clo's own functions (`clo.key_metadata`, `clo.quest_bounds`, `clo.hata_token_scores`'
codes, `tokenselect.soft_vote`'s exact q.k) and selects with `selection.choose.choose_tokens` at the size
`selection.options.selection_size` gives (sinks and recent tokens forced in, whole pages for Quest), so what is
measured is what the policy would attend. ``mass`` is the mean over the query heads of the exact attention
probability on the selected tokens: 1.0 keeps everything; the exact top-k by max over the group of q.k is
the ceiling a page or hash retrieval can approach. ``vote`` is TokenSelect's soft vote over the keys it reads
(exact, or the quantized copy of `selection.vote_keys`); `topk_recall` says how much of one selection another
keeps (a vote over int8 keys against the exact vote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RetrievalSpec", "capture_queries_keys", "selection_mass", "selection_recall", "topk_recall"]


@dataclass(frozen=True)
class RetrievalSpec:
    """One retrieval at one budget: exact | quest | hata; ratio of the context with a floor of token_min tokens
    (clo's topk_ratio / topk_min); quest's page tokens; hata's projections W [L, n_kv, d, r] (None: random)."""

    retrieval: str = "exact"
    ratio: float = 0.1
    token_min: int = 0
    page: int = 16
    num_sink: int = 4
    num_recent: int = 64
    hata_bits: int = 128
    vote_keys: str = "native"  # vote: the keys it reads (`selection.vote_keys`)

    @property
    def label(self) -> str:
        extra = f",page={self.page}" if self.retrieval == "quest" else ""
        extra += f",keys={self.vote_keys}" if self.retrieval == "vote" else ""
        return f"{self.retrieval}:ratio={self.ratio:g},min={self.token_min}{extra}"


def capture_queries_keys(model, prompt_ids: Sequence[int], first_query: int | None = None,
                         unrotated: bool = False):
    """(q [L, H, d] of the last prompt token, k [L, n_kv, T, d]) from one full forward pass over the prompt.
    With ``first_query``: q [L, H, n, d] of every position from it on (the queries of the steps that decoded
    the tokens after it); ``unrotated``: q before RoPE (the llama family's projection), keys as stored."""
    from kvoffload.models.common import linear, prefill_attention, split_heads
    from kvoffload.models.transformer import family

    cfg, params = model.config, model.params
    if unrotated and cfg.family != "llama":
        raise ValueError(f"queries before RoPE are taken from the llama family's projection, not {cfg.family}'s")
    fam = family(cfg)
    tokens = jnp.asarray([list(prompt_ids)], jnp.int32)
    start = len(prompt_ids) - 1 if first_query is None else int(first_query)

    @jax.jit
    def run(tokens):
        t = tokens.shape[1]
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        h = fam.embed(cfg, params, tokens, pos)
        qs, ks = [], []
        for lp in params.layers:
            x = fam.attn_input(cfg, lp, h)
            q, k, v = fam.qkv(cfg, lp, x, pos)
            h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, prefill_attention(q, k, v, jnp.array([t]))))
            if unrotated:
                q = split_heads(linear(x, lp.wq, lp.bq), cfg.num_heads, cfg.head_dim)
            qs.append(q[0, :, start:])
            ks.append(k[0])
        return jnp.stack(qs), jnp.stack(ks)

    q, k = run(tokens)
    q = q[:, :, 0] if first_query is None else q
    return np.asarray(q, np.float32), np.asarray(k, np.float32)


def _layer_choice(spec: RetrievalSpec, q, k, w, blk: int):
    """(chosen [n_kv, T] bool: one layer's selection, exact logits [n_kv, G, T]). q [H, d], k [n_kv, T, d] (T a
    multiple of blk, tokens past the context padded), w [n_kv, d, r] or None."""
    from kvoffload.policies import clo
    from kvoffload.policies.selection.choose import choose_tokens
    from kvoffload.policies.selection.options import selection_size

    H, d = q.shape
    n_kv, T, _ = k.shape
    G = H // n_kv
    context = jnp.asarray([T], jnp.int32)
    logits = jnp.einsum("kgd,ktd->kgt", q.reshape(n_kv, G, d), k) / np.sqrt(d)  # [n_kv, G, T]
    blocks = k.reshape(n_kv, T // blk, blk, d).transpose(1, 0, 2, 3)  # [E, n_kv, blk, d]
    E = blocks.shape[0]
    if spec.retrieval == "exact":
        scores = logits.max(1)
    elif spec.retrieval == "vote":  # TokenSelect's soft vote (`tokenselect.soft_vote`) over the keys it reads
        from kvoffload.policies.selection.vote_keys import vote_key_copy, vote_key_values

        kv = vote_key_values(vote_key_copy(k, spec.vote_keys), jnp.float32)
        scores = jax.nn.softmax(jnp.einsum("kgd,ktd->kgt", q.reshape(n_kv, G, d), kv) / np.sqrt(d), -1).sum(1)
    elif spec.retrieval == "quest":
        kmin, kmax = clo.key_metadata(blocks, None, "quest", spec.page)
        bounds = clo.quest_bounds(jnp.broadcast_to(q, (E, H, d)), kmin, kmax)  # [E, n_kv, blk/page]
        scores = jnp.repeat(bounds, spec.page, axis=-1).transpose(1, 0, 2).reshape(n_kv, T)
    elif spec.retrieval == "hata":
        from kvoffload import ops
        from kvoffload.plan.deploy import encode_keys, encode_queries

        codes = encode_keys(w, blocks)  # [E, n_kv, blk, r/32]
        qc = encode_queries(w, q[None], G).reshape(n_kv, G, 1, 1, -1)
        ham = jnp.min(ops.hamming_distance(qc, codes.transpose(1, 0, 2, 3)[:, None]), axis=1)  # [n_kv, E, blk]
        scores = (w.shape[-1] - ham).astype(jnp.float32).reshape(n_kv, T)
    else:
        raise ValueError(f"unknown retrieval {spec.retrieval!r}")
    page = spec.page if spec.retrieval == "quest" else 1
    n_select = selection_size(None, spec.ratio, spec.num_sink, spec.num_recent, page, T, context, spec.token_min)
    idx, nv = choose_tokens(scores[None], jnp.arange(T, dtype=jnp.int32), None, context, n_select, T,
                            spec.num_sink, spec.num_recent, page)
    kept = jnp.arange(T)[None] < nv[0][:, None]
    return jnp.zeros((n_kv, T), bool).at[jnp.arange(n_kv)[:, None], idx[0]].max(kept), logits


def _layer_mass(spec: RetrievalSpec, q, k, w, blk: int):
    """[n_kv]: the exact attention mass on one layer's selection (`_layer_choice`)."""
    chosen, logits = _layer_choice(spec, q, k, w, blk)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.mean(jnp.sum(jnp.where(chosen[:, None], p, 0.0), axis=-1), axis=1)


def selection_mass(spec: RetrievalSpec, q, k, hata_w=None, blk: int = 64) -> np.ndarray:
    """[L, n_kv] exact attention mass on each layer's selection (`_layer_mass`) for captured q [L, H, d] and
    k [L, n_kv, T, d]. The context is cut to whole blocks of blk tokens (the pool holds whole blocks)."""
    from kvoffload.plan.deploy import init_projection

    L, n_kv, T, d = k.shape
    T = T // blk * blk
    w = None
    if spec.retrieval == "hata":
        w = hata_w if hata_w is not None else np.asarray(
            init_projection(_Shape(L, n_kv, d), spec.hata_bits, seed=0))
    return np.stack([np.asarray(_layer_mass(spec, jnp.asarray(q[i]), jnp.asarray(k[i, :, :T]),
                                            None if w is None else jnp.asarray(w[i]), blk)) for i in range(L)])


@dataclass(frozen=True)
class _Shape:  # what init_projection reads of a config
    num_layers: int
    num_kv_heads: int
    head_dim: int


def selection_recall(model, prompts: Sequence[Sequence[int]], specs: Sequence[RetrievalSpec],
                     hata_w=None) -> dict[str, dict]:
    """Per retrieval: the mean mass over prompts, layers and heads, per layer [L], and the fraction of (prompt,
    layer, head) keeping less than half of the exact attention."""
    per = {s.label: [] for s in specs}
    for ids in prompts:
        q, k = capture_queries_keys(model, ids)
        for s in specs:
            per[s.label].append(selection_mass(s, q, k, hata_w))
    out = {}
    for label, masses in per.items():
        m = np.stack(masses)  # [P, L, n_kv]
        out[label] = {"mass": float(m.mean()), "per_layer": m.mean(axis=(0, 2)).tolist(),
                      "below_half": float((m < 0.5).mean())}
    return out


def topk_recall(model, prompts: Sequence[Sequence[int]], spec: RetrievalSpec, reference: RetrievalSpec,
                blk: int = 64) -> dict:
    """How much of reference's selection spec's keeps (e.g. a vote over int8 keys against the exact vote), at the
    same budget: per (prompt, layer, KV head) |chosen & reference's| / |reference's|, sinks and recent tokens
    included as both select them. Returns the mean, the minimum and the mean per layer [L]."""
    per = []
    for ids in prompts:
        q, k = capture_queries_keys(model, ids)
        T = k.shape[2] // blk * blk
        layers = []
        for i in range(k.shape[0]):
            qi, ki = jnp.asarray(q[i]), jnp.asarray(k[i, :, :T])
            got, want = (_layer_choice(s, qi, ki, None, blk)[0] for s in (spec, reference))
            layers.append(np.asarray(jnp.sum(got & want, -1) / jnp.maximum(jnp.sum(want, -1), 1)))
        per.append(np.stack(layers))
    r = np.stack(per)  # [P, L, n_kv]
    return {"recall": float(r.mean()), "min": float(r.min()), "per_layer": r.mean(axis=(0, 2)).tolist()}
