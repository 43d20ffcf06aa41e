"""HATA hash-code training: per layer and KV head a projection W [head_dim, r] whose sign codes rank keys
for a query the way q.k does (Hamming similarity r - hamming(code(q), code(k))).

Codes are produced by :func:`kvoffload.ops.hata_encode` (r bits packed into uint32 words, LSB first) and
scored by :func:`kvoffload.ops.hata_scores` / :func:`kvoffload.ops.hamming_distance`: the trainer only
learns W; the one encoder lives in ops.

Training data (`data`): queries and post-RoPE keys of the model on long prompts, gathered per layer by a
forward built from the family's layer functions. Two sources:

* ``essays``: windows of essay text, queries at random positions of each window's second half;
* ``ruler``: RULER prompts (`kvoffload.eval.ruler`, the tasks of ``ruler_tasks`` in turn, seeds other
  than the benchmark's 42) followed by their gold answer, queries at the last `queries_per_prompt`
  positions: the question, the answer prefix and the answer tokens, i.e. the queries that retrieve the
  needles at answer time (where a top-k selection decides the task), over a haystack holding the needles;
* ``mixed``: half of the prompts of each.

For each query, the causal keys' true scores q.k pick the top `top_frac` (10%) keys: those get graded
positive weights (2 for the best, falling linearly to 1 at the cut-off; the true top `boost_frac` (1%)
keys' weights times `top_boost`), rescaled so the positives' total weight equals the negatives', the
other keys weight -1. The loss per (layer, KV head) is

    sum_ij w_ij * dist(c(q_i), c(k_j)) / sum_ij |w_ij|              (weighted code distance)
  + balance * mean_bits(mean_keys c(k))^2 (+ the same over queries)  (each bit half on)
  + ortho * ||W W^T / (r/d) - I||_F^2 / d                           (decorrelated bits)

with the relaxed code c(x) = 2 sigmoid(scale * sqrt(d) * (x/|x|) W) - 1 and dist = (1 - c.c'/r) / 2
(the relaxed normalised Hamming distance). Optimiser: SGD with momentum (optax). The queries of a GQA
group share their KV head's W (a query code is compared with that head's key codes).

Defaults (held-out top-10% recall on RULER needle queries / essays, SmolLM2-135M, 1K prompts, 120 steps;
BENCHMARKS "HATA: data and code width"): 256 bits, mixed data: 0.644 / 0.658 (128 bits mixed 0.615 / 0.626,
128 bits essays 0.581 / 0.631; random projections 0.536 / 0.535 at 256). 512 bits mixed reach 0.670 / 0.688 for
twice the GPU metadata (half of a bf16 key at head dim 64), where random projections already give 0.631 and keep
more of the true top 1% (0.96 vs 0.91). top_boost 4 trades top-10% recall (0.628 at 256) for the top-1% keys'
(0.922 vs 0.900).

Output (same style as the importance trainer): out_dir/checkpoints/<step>/ (orbax train state),
out_dir/hata/ (orbax {"w": [L, n_kv, d, r]}) and out_dir/hata.json (settings and recall numbers).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from kvoffload import ops
from kvoffload.errors import check_finite_result, check_range
from kvoffload.importance import gating
from kvoffload.models.common import prefill_attention
from kvoffload.models.transformer import family
from kvoffload.plan.deploy import init_projection

HATA_JSON = "hata.json"
DATA_SOURCES = ("essays", "ruler", "mixed")
# RULER tasks whose answer is retrieved from the haystack (needles, chains, a paragraph); cwe / fwe
# (counting over the whole context) are left out
RULER_TRAIN_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                     "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "qa_1", "qa_2")
# the held-out needle check: the eight niah tasks
RULER_EVAL_TASKS = RULER_TRAIN_TASKS[:8]
_RULER_SEED = {"train": 1000, "eval": 2000}  # + HataConfig.seed; RULER's benchmark seed is 42


@dataclasses.dataclass
class HataConfig:
    bits: int = 256  # 128 ranks needle queries' top 10% clearly worse (BENCHMARKS "HATA: data and code width")
    top_frac: float = 0.1
    steps: int = 300
    lr: float = 0.5
    momentum: float = 0.9
    scale: float = 3.0
    balance: float = 0.1
    ortho: float = 0.1
    num_prompts: int = 8  # training prompts
    eval_prompts: int = 2  # held-out prompts (the eval text split)
    prompt_length: int = 2048
    queries_per_prompt: int = 64  # query positions sampled per prompt (from its second half)
    seed: int = 0
    out_dir: str | None = None
    checkpoint_every: int = 50
    log_every: int = 10
    text_path: str | None = None
    data: str = "mixed"  # essays | ruler | mixed (DATA_SOURCES)
    ruler_tasks: tuple = ()  # () = RULER_TRAIN_TASKS
    top_boost: float = 1.0  # weight factor of the true top boost_frac keys among the positives
    boost_frac: float = 0.01

    def __post_init__(self):
        # before any work: top_frac 2 or a NaN lr would train and report recall 0.000 as if it were a result
        for name in ("steps", "num_prompts", "eval_prompts", "prompt_length", "queries_per_prompt",
                     "checkpoint_every", "log_every"):
            check_range(name, getattr(self, name), 1, integer=True)
        check_range("seed", self.seed, 0, integer=True)
        check_range("top_frac", self.top_frac, 0, 1, low_open=True)
        check_range("boost_frac", self.boost_frac, 0, 1, low_open=True)
        check_range("lr", self.lr, 0, low_open=True)
        check_range("momentum", self.momentum, 0, 1)
        check_range("scale", self.scale, 0, low_open=True)
        for name in ("balance", "ortho"):
            check_range(name, getattr(self, name), 0)
        if self.data not in DATA_SOURCES:
            raise ValueError(f"data must be one of {DATA_SOURCES}, got {self.data!r}")
        if self.bits < 32 or self.bits % 32:
            raise ValueError(f"bits must be a positive multiple of 32 (packed uint32 words), got {self.bits}")
        if self.top_boost < 1.0:
            raise ValueError(f"top_boost must be >= 1 (1 = no boost), got {self.top_boost}")
        self.ruler_tasks = tuple(self.ruler_tasks)
        from kvoffload.eval.ruler import RULER_TASKS

        unknown = [t for t in self.ruler_tasks if t not in RULER_TASKS]
        if unknown:
            raise ValueError(f"unknown RULER tasks {unknown}; known: {', '.join(RULER_TASKS)}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_RESUME_FREE = {"steps", "out_dir", "checkpoint_every", "log_every", "eval_prompts"}
# (data, ruler_tasks, top_boost, boost_frac change the run: a resume with other values is refused)


class HataState(train_state.TrainState):
    """Flax train state whose params are {"w": [L, n_kv, d, r]}."""


@dataclasses.dataclass
class QKSet:
    """Queries grouped by KV head and all keys, per prompt and layer."""

    q: np.ndarray  # [P, L, n_kv, G*Qp, d]
    k: np.ndarray  # [P, L, n_kv, T, d]
    qpos: np.ndarray  # [P, G*Qp] int32: each query's position (keys <= it are its candidates)


# ------------------------------------------------------------------------------------- data
@functools.partial(jax.jit, static_argnames=("cfg",))
def _collect(cfg, params, stacked, tokens, qpos):
    """tokens [B, T], qpos [Qp] -> q [L, B, nh, Qp, d] at qpos, k [L, B, nkv, T, d] (post-RoPE)."""
    fam = family(cfg)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    lengths = jnp.full((b,), t, jnp.int32)
    h = fam.embed(cfg, params, tokens, positions)

    def body(h, lp):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        o = prefill_attention(q, k, v, lengths)
        return fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o)), (q[:, :, qpos], k)

    _, (qs, ks) = jax.lax.scan(body, h, stacked)
    return qs, ks


def prompt_tokens(data, split: str, count: int, length: int, seed: int) -> np.ndarray:
    """count windows of `length` tokens of the text split (train / eval), [count, length]."""
    ids, _ = data._splits[split]
    if len(ids) <= length:
        raise ValueError(f"the {split} text has {len(ids)} tokens; prompts need {length}")
    rng = np.random.default_rng([seed, 3, 0 if split == "train" else 1])
    starts = rng.integers(0, len(ids) - length, size=count)
    return np.stack([ids[s:s + length] for s in starts]).astype(np.int32)


def ruler_prompt_tokens(tokenizer, split: str, count: int, length: int, seed: int,
                        tasks: tuple = RULER_TRAIN_TASKS) -> tuple[np.ndarray, np.ndarray]:
    """count RULER prompts, each followed by its gold answer, right-padded to `length` tokens:
    (tokens [count, length] int32, ends [count] int32 = prompt + answer tokens). Prompt i is a sample of
    tasks[i % len(tasks)]; the train and eval splits use different RULER seeds (neither is the benchmark's 42)."""
    from kvoffload.eval import ruler

    if split not in _RULER_SEED:
        raise ValueError(f"split must be one of {tuple(_RULER_SEED)}, got {split!r}")
    tasks = tuple(tasks) or RULER_TRAIN_TASKS
    fits, too_short = [], []
    for t in tasks:  # a task whose minimal context exceeds `length` (qa at 1K) is left out, with a warning
        try:
            ruler.generate_samples(tokenizer, t, length, 1, seed=_RULER_SEED[split] + seed)
            fits.append(t)
        except ValueError:
            too_short.append(t)
    if not fits:
        raise ValueError(f"no RULER task of {list(tasks)} fits {length} tokens; use a longer --prompt-length")
    if too_short:
        import warnings

        warnings.warn(f"RULER tasks {too_short} do not fit {length} tokens; HATA prompts use {fits}", stacklevel=2)
    tasks = tuple(fits)
    per_task = {t: -(-count // len(tasks)) if i < count else 0 for i, t in enumerate(tasks)}
    samples = {t: ruler.generate_samples(tokenizer, t, length, n, seed=_RULER_SEED[split] + seed)
               for t, n in per_task.items() if n}
    rows, ends = [], []
    for i in range(count):
        task = tasks[i % len(tasks)]
        smp = samples[task][i // len(tasks)]
        answer = tokenizer.encode(" " + ", ".join(smp.outputs), add_special_tokens=False)
        ids = (list(smp.prompt_ids) + list(answer))[:length]  # RULER keeps prompt + answer budget <= length
        rows.append(np.pad(np.asarray(ids, np.int32), (0, length - len(ids))))  # padding: future keys only
        ends.append(len(ids))
    return np.stack(rows), np.asarray(ends, np.int32)


def end_positions(ends: np.ndarray, count: int) -> np.ndarray:
    """The last `count` positions before each end: [P] -> [P, count] int32 (the question, answer prefix
    and answer tokens of a RULER prompt)."""
    ends = np.asarray(ends, np.int32)
    if int(ends.min()) < count:
        raise ValueError(f"a prompt has {int(ends.min())} tokens, fewer than the {count} query positions")
    return ends[:, None] - count + np.arange(count, dtype=np.int32)[None, :]


def random_positions(p: int, t: int, count: int, seed: int) -> np.ndarray:
    """count sorted random positions from the second half of each of p prompts of t tokens: [p, count]."""
    rng = np.random.default_rng([seed, 4, t])
    count = min(count, t - t // 2)
    return np.stack([np.sort(rng.choice(np.arange(t // 2, t), size=count, replace=False)) for _ in range(p)])


def collect_qk(model, tokens: np.ndarray, queries_per_prompt: int, seed: int = 0,
               positions: np.ndarray | None = None) -> QKSet:
    """Runs the model on each prompt and keeps the queries at `positions` [P, Qp] (default: random
    positions of the second half, `random_positions`) and all keys."""
    cfg = model.config
    p, t = tokens.shape
    if positions is None:
        positions = random_positions(p, t, queries_per_prompt, seed)
    stacked = gating.stack_layers(model.params)
    qs, ks, qpos_all = [], [], []
    for i in range(p):
        pos = np.asarray(positions[i], np.int32)
        q, k = _collect(cfg, model.params, stacked, jnp.asarray(tokens[i:i + 1]), jnp.asarray(pos, jnp.int32))
        q = np.asarray(q[:, 0])  # [L, nh, Qp, d]
        L, nh, qp, d = q.shape
        g = cfg.group_size
        qs.append(q.reshape(L, cfg.num_kv_heads, g * qp, d))  # query head h = kv * G + j
        ks.append(np.asarray(k[:, 0]))
        qpos_all.append(np.tile(pos, g).astype(np.int32))
    return QKSet(np.stack(qs), np.stack(ks), np.stack(qpos_all))


def concat_qk(*sets: QKSet) -> QKSet:
    """One QKSet of several (same prompt length and queries per prompt)."""
    return QKSet(*(np.concatenate([getattr(x, f) for x in sets]) for f in ("q", "k", "qpos")))


def collect_data(model, hcfg: HataConfig, split: str, count: int, source: str | None = None,
                 data=None, quiet: bool = True) -> QKSet:
    """The queries / keys of `count` prompts of hcfg's (or `source`'s) data, train or eval split."""
    from kvoffload.importance.data import PasskeyData, text_from_file

    gating.check_trainable(model.config, "train-hata")
    source = source or hcfg.data
    length = min(hcfg.prompt_length, model.config.max_position_embeddings)
    qseed = hcfg.seed + (0 if split == "train" else 1)
    parts = {"essays": count, "ruler": 0} if source == "essays" else (
        {"essays": 0, "ruler": count} if source == "ruler" else {"essays": count // 2, "ruler": count - count // 2})
    sets = []
    if parts["essays"]:
        if data is None:
            text = text_from_file(hcfg.text_path) if hcfg.text_path else None
            data = PasskeyData(model.tokenizer, text, seed=hcfg.seed)
        _log(f"collecting {split} queries/keys from {parts['essays']} essay prompts of {length} tokens", quiet)
        sets.append(collect_qk(model, prompt_tokens(data, split, parts["essays"], length, hcfg.seed),
                               hcfg.queries_per_prompt, qseed))
    if parts["ruler"]:
        tasks = (hcfg.ruler_tasks or RULER_TRAIN_TASKS) if split == "train" else RULER_EVAL_TASKS
        _log(f"collecting {split} queries/keys from {parts['ruler']} RULER prompts of {length} tokens", quiet)
        toks, ends = ruler_prompt_tokens(model.tokenizer, split, parts["ruler"], length, hcfg.seed, tasks)
        sets.append(collect_qk(model, toks, hcfg.queries_per_prompt,
                               positions=end_positions(ends, hcfg.queries_per_prompt)))
    return concat_qk(*sets)


# ------------------------------------------------------------------------------------- loss
def relaxed_code(x, w, scale):
    """2 sigmoid(scale * sqrt(d) * (x / |x|) W) - 1 in (-1, 1)^r; its sign is hata_encode's bit."""
    d = x.shape[-1]
    xn = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
    z = jnp.sqrt(jnp.float32(d)) * (xn @ w)
    return 2.0 * jax.nn.sigmoid(scale * z) - 1.0


def pair_weights(q, k, qpos, top_frac, top_boost=1.0, boost_frac=0.01):
    """Label weights [Q, T]: graded positive (2 -> 1) on each query's true top ceil(top_frac * n) causal
    keys, those of its true top ceil(boost_frac * n) times top_boost, all rescaled to the negatives' total;
    -1 on the other causal keys; 0 on future keys."""
    t = k.shape[0]
    kpos = jnp.arange(t)
    valid = kpos[None, :] <= qpos[:, None]
    s = jnp.where(valid, q @ k.T, -jnp.inf)
    n = jnp.sum(valid, axis=-1)
    kq = jnp.maximum(1, jnp.ceil(top_frac * n)).astype(jnp.int32)
    order = jnp.argsort(-s, axis=-1)
    rank = jnp.put_along_axis(jnp.zeros_like(order), order, jnp.broadcast_to(jnp.arange(t), order.shape), axis=-1,
                              inplace=False)  # 0 = best (the inverse permutation of the sort)
    top = valid & (rank < kq[:, None])
    graded = 2.0 - rank.astype(jnp.float32) / kq[:, None].astype(jnp.float32)
    kb = jnp.maximum(1, jnp.ceil(boost_frac * n)).astype(jnp.int32)
    graded = jnp.where(rank < kb[:, None], top_boost * graded, graded)
    pos = jnp.where(top, graded, 0.0)
    neg = jnp.where(valid & ~top, 1.0, 0.0)
    ratio = jnp.sum(neg, -1, keepdims=True) / jnp.maximum(jnp.sum(pos, -1, keepdims=True), 1e-6)
    ratio = jnp.where(jnp.sum(neg, -1, keepdims=True) > 0, ratio, 1.0)
    return jax.lax.stop_gradient(pos * ratio - neg)


def head_loss(w, q, k, wts, *, scale, balance, ortho):
    """Loss of one (layer, KV head): w [d, r], q [Q, d], k [T, d], wts [Q, T] (pair_weights: labels
    depend only on q and k, so they are computed once per prompt, not per step)."""
    d, r = w.shape
    cq = relaxed_code(q, w, scale)
    ck = relaxed_code(k, w, scale)
    dist = 0.5 * (1.0 - (cq @ ck.T) / r)
    sim_loss = jnp.sum(wts * dist) / jnp.maximum(jnp.sum(jnp.abs(wts)), 1e-6)
    bal = jnp.mean(jnp.square(jnp.mean(ck, axis=0))) + jnp.mean(jnp.square(jnp.mean(cq, axis=0)))
    gram = (w @ w.T) / (r / d)
    orth = jnp.sum(jnp.square(gram - jnp.eye(d))) / d
    total = sim_loss + balance * bal + ortho * orth
    return total, (sim_loss, bal, orth)


def make_hata_step(hcfg: HataConfig):
    return _hata_step(hcfg.top_frac, hcfg.scale, hcfg.balance, hcfg.ortho)


@functools.partial(jax.jit, static_argnames=("top_frac", "top_boost", "boost_frac"))
def prompt_weights(q, k, qpos, top_frac, top_boost=1.0, boost_frac=0.01):
    """pair_weights for every layer and KV head of one prompt: q [L, nkv, Q, d], k [L, nkv, T, d],
    qpos [Q] -> [L, nkv, Q, T]."""
    f = functools.partial(pair_weights, qpos=qpos, top_frac=top_frac, top_boost=top_boost, boost_frac=boost_frac)
    return jax.vmap(jax.vmap(f))(q, k)


@functools.lru_cache(maxsize=16)
def _hata_step(top_frac, scale, balance, ortho):
    del top_frac  # the labels come precomputed (prompt_weights)
    hl = functools.partial(head_loss, scale=scale, balance=balance, ortho=ortho)
    all_heads = jax.vmap(jax.vmap(hl))  # over layers, then KV heads

    def loss_fn(w, q, k, wts):
        tot, (s, b, o) = all_heads(w, q, k, wts)
        return jnp.sum(tot), (jnp.mean(s), jnp.mean(b), jnp.mean(o))

    @jax.jit
    def step(state: HataState, q, k, wts):
        (loss, (s, b, o)), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params["w"], q, k, wts)
        state = state.apply_gradients(grads={"w": g})
        n = q.shape[0] * q.shape[1]
        return state, {"loss": loss / n, "sim": s, "balance": b, "ortho": o}

    return step


@functools.lru_cache(maxsize=16)
def _sgd(lr: float, momentum: float):
    return optax.sgd(lr, momentum=momentum)


def create_state(cfg, hcfg: HataConfig) -> HataState:
    w = init_projection(cfg, hcfg.bits, hcfg.seed)
    tx = _sgd(float(hcfg.lr), float(hcfg.momentum))
    return HataState.create(apply_fn=None, params={"w": w}, tx=tx)


# ------------------------------------------------------------------------------------- recall
def _top_mask(s, kq):
    """[Q, T] True on each row's kq largest entries of s (kq [Q, 1]; one sort, ties kept together)."""
    srt = -jnp.sort(-s, axis=-1)
    return s >= jnp.take_along_axis(srt, kq - 1, axis=-1)


@functools.partial(jax.jit, static_argnames=("top_frac", "true_fracs"))
def _recall_layer(w, q, k, qpos, key, top_frac, true_fracs):
    """Recall of the true top-`true_frac` keys (for each of true_fracs) by the code top-`top_frac` keys
    for one layer: w [nkv, d, r], q [nkv, Q, d], k [nkv, T, d] -> [nkv, len(true_fracs)] mean recall.
    Codes via ops.hata_encode, distances via ops.hamming_distance; integer ties broken at random."""
    r = w.shape[-1]

    def one(w, q, k, key):
        t = k.shape[0]
        kpos = jnp.arange(t)
        valid = kpos[None, :] <= qpos[:, None]
        n = jnp.sum(valid, -1)
        kq = jnp.maximum(1, jnp.ceil(top_frac * n)).astype(jnp.int32)[:, None]
        true = jnp.where(valid, q @ k.T, -jnp.inf)
        qc = ops.hata_encode(q, w)  # [Q, W] uint32
        kc = ops.hata_encode(k, w)  # [T, W]
        ham = ops.hamming_distance(qc[:, None, :], kc[None, :, :])  # [Q, T]
        jitter = jax.random.uniform(key, ham.shape, maxval=0.5)
        hs = jnp.where(valid, (r - ham).astype(jnp.float32) + jitter, -jnp.inf)
        rh = _top_mask(hs, kq) & valid
        out = []
        for f in true_fracs:
            kt = jnp.maximum(1, jnp.ceil(f * n)).astype(jnp.int32)[:, None]
            rt = _top_mask(true, kt) & valid
            out.append(jnp.mean(jnp.sum(rt & rh, -1) / kt[:, 0]))
        return jnp.stack(out)

    keys = jax.random.split(key, w.shape[0])
    return jax.vmap(one)(w, q, k, keys)


def recall_per_layer(w, qk: QKSet, top_frac: float = 0.1, seed: int = 0,
                     true_frac: float | tuple | None = None) -> np.ndarray:
    """Mean recall [L] of the true top-`true_frac` (default `top_frac`) keys by the codes' top-`top_frac`,
    over prompts, KV heads and queries; a tuple of true_frac gives [L, len(true_frac)]."""
    true_frac = top_frac if true_frac is None else true_frac
    fracs = tuple(true_frac) if isinstance(true_frac, (tuple, list)) else (true_frac,)
    w = jnp.asarray(w)
    P, L = qk.q.shape[:2]
    out = np.zeros((P, L, len(fracs)))
    key = jax.random.key(seed + 17)
    for p in range(P):
        for l in range(L):
            key, sub = jax.random.split(key)
            rec = _recall_layer(w[l], jnp.asarray(qk.q[p, l]), jnp.asarray(qk.k[p, l]),
                                jnp.asarray(qk.qpos[p]), sub, top_frac, fracs)
            out[p, l] = np.asarray(jnp.mean(rec, axis=0))
    out = out.mean(0)
    return out if isinstance(true_frac, (tuple, list)) else out[:, 0]


# ---------------------------------------------------------------------------- checkpoints
def _manager(out_dir: str, keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.join(os.path.abspath(out_dir), "checkpoints"),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save_projections(out_dir: str, w, cfg, hcfg: HataConfig, extra: dict | None = None):
    """out_dir/hata (orbax {"w"}) and out_dir/hata.json."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    check_finite_result(f"the HATA projections for {out_dir}", w)
    ck = ocp.StandardCheckpointer()
    ck.save(os.path.join(out_dir, "hata"), {"w": np.asarray(w, np.float32)}, force=True)
    ck.wait_until_finished()
    doc = {"format": "kvoffload.hata/1", "bits": hcfg.bits, "num_layers": int(cfg.num_layers),
           "num_kv_heads": int(cfg.num_kv_heads), "head_dim": int(cfg.head_dim),
           "model_type": cfg.model_type, "settings": hcfg.to_json(),
           "packing": "ops.hata_encode: bit j = (x @ W)_j > 0 in uint32 word j // 32 at bit j % 32"}
    if extra:
        doc.update(extra)
    with open(os.path.join(out_dir, HATA_JSON), "w") as f:
        json.dump(doc, f, indent=1)


# ------------------------------------------------------------------------------------ loop
@dataclasses.dataclass
class HataResult:
    w: np.ndarray
    losses: list
    state: Any
    recall_trained: np.ndarray | None  # [L] on the first held-out set
    recall_random: np.ndarray | None
    seconds: float
    recalls: dict | None = None  # held-out set -> evaluate_recall's numbers


def _log(msg, quiet):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def evaluate_recall(w, eval_sets: dict, cfg, hcfg: HataConfig) -> dict:
    """Per held-out set: recall [L] of the true top-top_frac keys by the code top-top_frac (trained W and
    random projections of the same width), and of the true top-boost_frac keys (the keys that carry most
    of a needle query's attention) in the same code selection."""
    rand = np.asarray(init_projection(cfg, hcfg.bits, hcfg.seed + 1000))
    out = {}
    fracs = (hcfg.top_frac, hcfg.boost_frac)
    for name, qk in eval_sets.items():
        t = recall_per_layer(w, qk, hcfg.top_frac, true_frac=fracs)
        r = recall_per_layer(rand, qk, hcfg.top_frac, true_frac=fracs)
        out[name] = {"trained": t[:, 0], "random": r[:, 0], "trained_top": t[:, 1], "random_top": r[:, 1]}
    return out


def _check_resume(hcfg: HataConfig):
    cpath = os.path.join(hcfg.out_dir, "hata_config.json")
    if os.path.exists(cpath):
        with open(cpath) as f:
            old = json.load(f)
        default = HataConfig().to_json()  # settings added later read as their defaults in older runs
        new = hcfg.to_json()
        diff = {k: (old.get(k, default.get(k)), v) for k, v in new.items()
                if k not in _RESUME_FREE and not _json_eq(old.get(k, default.get(k)), v)}
        if diff:
            raise ValueError(f"{hcfg.out_dir} holds a HATA run with different settings {diff}")
    with open(cpath, "w") as f:
        json.dump(hcfg.to_json(), f, indent=1)


def _json_eq(a, b) -> bool:
    return json.loads(json.dumps(a)) == json.loads(json.dumps(b))  # tuples and lists compare alike


def train_hata(model, hcfg: HataConfig, *, data=None, train_qk: QKSet | None = None,
               eval_qk: QKSet | dict | None = None, evaluate: bool = True, quiet: bool = False,
               stop_after: int | None = None) -> HataResult:
    """Trains W for every layer and KV head; resumes from hcfg.out_dir's latest checkpoint.
    eval_qk: one held-out QKSet, or {name: QKSet}; default: held-out essays and RULER needle prompts
    (hcfg.eval_prompts each, at least one per RULER_EVAL_TASKS task for RULER)."""
    cfg = model.config
    t_start = time.time()
    if train_qk is None:
        train_qk = collect_data(model, hcfg, "train", hcfg.num_prompts, data=data, quiet=quiet)
    state = create_state(cfg, hcfg)
    mgr = None
    if hcfg.out_dir:
        os.makedirs(hcfg.out_dir, exist_ok=True)
        _check_resume(hcfg)
        mgr = _manager(hcfg.out_dir)
        if mgr.latest_step() is not None:
            import orbax.checkpoint as ocp

            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), state)
            state = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract))
            _log(f"resumed HATA training from step {int(state.step)}", quiet)
    step_fn = make_hata_step(hcfg)
    P = train_qk.q.shape[0]
    weights = [prompt_weights(jnp.asarray(train_qk.q[p]), jnp.asarray(train_qk.k[p]), jnp.asarray(train_qk.qpos[p]),
                              hcfg.top_frac, float(hcfg.top_boost), hcfg.boost_frac) for p in range(P)]
    losses = []
    end = hcfg.steps if stop_after is None else min(hcfg.steps, int(stop_after))
    from kvoffload.importance.train import _step_bar

    bar = _step_bar("hata", int(state.step), end, hcfg.steps, quiet)
    for s in range(int(state.step), end):
        p = int(np.random.default_rng([hcfg.seed, 5, s]).integers(P))  # deterministic prompt order
        state, m = step_fn(state, jnp.asarray(train_qk.q[p]), jnp.asarray(train_qk.k[p]), weights[p])
        m = {k: float(v) for k, v in m.items()}
        check_finite_result(f"the HATA training loss at step {s + 1}", [m["loss"]],
                            "training stopped, no checkpoint or projections written (a lower --lr?)")
        losses.append(m["loss"])
        if bar is not None and ((s + 1) % hcfg.log_every == 0 or s + 1 == end):
            bar.set_postfix_str(f"loss {m['loss']:.5f} code-dist {m['sim']:.5f} balance {m['balance']:.4f} "
                                f"ortho {m['ortho']:.4f}", refresh=False)
        if bar is not None:
            bar.update(1)
        if mgr is not None and ((s + 1) % hcfg.checkpoint_every == 0 or s + 1 == end):
            import orbax.checkpoint as ocp

            mgr.save(int(state.step), args=ocp.args.StandardSave(state), force=True)
            mgr.wait_until_finished()
    if bar is not None:
        bar.close()
    w = np.asarray(state.params["w"])
    recalls = None
    if evaluate and int(state.step) >= hcfg.steps:
        if eval_qk is None:
            eval_qk = {"essays": collect_data(model, hcfg, "eval", hcfg.eval_prompts, "essays", data, quiet)}
            try:
                eval_qk["ruler_needles"] = collect_data(model, hcfg, "eval", max(hcfg.eval_prompts, len(RULER_EVAL_TASKS)),
                                                        "ruler", quiet=quiet)
            except ValueError as e:  # prompts too short for RULER's niah tasks: the essay check only
                _log(f"no held-out RULER needle check: {e}", quiet)
        eval_sets = eval_qk if isinstance(eval_qk, dict) else {"heldout": eval_qk}
        recalls = evaluate_recall(w, eval_sets, cfg, hcfg)
        for name, r in recalls.items():
            _log(f"held-out recall ({name}) of the true top-{hcfg.top_frac:.0%} keys [and of the true top-"
                 f"{hcfg.boost_frac:.0%}] in the top-{hcfg.top_frac:.0%} by code, trained vs random projections:", quiet)
            for l in range(len(r["trained"])):
                _log(f"  layer {l:2d}: trained {r['trained'][l]:.3f} [{r['trained_top'][l]:.3f}]  "
                     f"random {r['random'][l]:.3f} [{r['random_top'][l]:.3f}]", quiet)
            _log(f"  mean: trained {r['trained'].mean():.3f} [{r['trained_top'].mean():.3f}]  "
                 f"random {r['random'].mean():.3f} [{r['random_top'].mean():.3f}]", quiet)
    if hcfg.out_dir and int(state.step) >= hcfg.steps:
        from kvoffload.provenance import make_provenance

        extra = {"final_loss": losses[-1] if losses else None,
                 "provenance": make_provenance(model, same={"settings": hcfg.to_json()}, info={"seed": hcfg.seed})}
        if recalls is not None:
            first = next(iter(recalls.values()))
            extra.update(recall_trained=[round(float(x), 4) for x in first["trained"]],
                         recall_random=[round(float(x), 4) for x in first["random"]],
                         recall_trained_mean=round(float(first["trained"].mean()), 4),
                         recall_random_mean=round(float(first["random"].mean()), 4),
                         recall={name: {k: {"mean": round(float(v.mean()), 4), "per_layer": [round(float(x), 4) for x in v]}
                                        for k, v in r.items()} for name, r in recalls.items()})
        save_projections(hcfg.out_dir, w, cfg, hcfg, extra)
        _log(f"projections written to {os.path.join(hcfg.out_dir, 'hata')}", quiet)
    first = next(iter(recalls.values())) if recalls else None
    return HataResult(w, losses, state, None if first is None else first["trained"],
                      None if first is None else first["random"], time.time() - t_start, recalls)
