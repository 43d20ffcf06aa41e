"""Head-importance training loop (flax train state + optax AdamW, jit-compiled, orbax checkpoints).

    cfg = TrainConfig(steps=200, max_length=4096, out_dir="runs/smollm2")
    result = train_importance(model, cfg)         # resumes from out_dir if a checkpoint is there
    result.alpha                                  # [L, n_kv] (or [L, n_heads]) in [0, 1]

Output directory layout::

    out_dir/train_config.json     the settings (a resume must match them)
    out_dir/checkpoints/<step>/   orbax checkpoints of the train state (periodic, last 2 kept)
    out_dir/log.jsonl             one line per logged step
    out_dir/scores/               orbax checkpoint {"alpha": [L, n]} of the final gates
    out_dir/head_scores.json      the same gates, readable: alpha[layer][head] plus metadata

Data: sample `i` of step `s` is passkey sample (seed, "train", s * batch + i), its length drawn from
[min_length, max_length] by (seed, step), padded to a multiple of `pad_multiple`: a resumed run sees
exactly the samples an uninterrupted run would have.
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

from kvoffload.errors import check_finite_result, check_range
from kvoffload.importance import gating
from kvoffload.importance.data import PasskeyData, bucket
from kvoffload.plan.deploy import SCORES_JSON



@dataclasses.dataclass
class TrainConfig:
    steps: int = 500
    batch_size: int = 1
    min_length: int = 1024
    max_length: int = 8192  # clipped to the model's context
    pad_multiple: int = 1024  # padded lengths are multiples of this (one compilation per multiple)
    sink: int = 128
    recent: int = 256
    granularity: str = "kv"  # "kv": alpha per layer x KV head; "query": per layer x query head
    lr: float = 0.02
    l1: float = 0.05
    warmup_frac: float = 0.2
    decay_frac: float = 0.2
    num_passkeys: int = 3
    words_per_key: int = 3
    seed: int = 0
    out_dir: str | None = None
    checkpoint_every: int = 25
    log_every: int = 1
    text_path: str | None = None  # haystack text file; None = RULER's essays

    def __post_init__(self):
        # before any work: a NaN learning rate trains all-NaN gates (a scores file clo would then read)
        for name in ("steps", "batch_size", "min_length", "max_length", "pad_multiple", "checkpoint_every",
                     "log_every", "num_passkeys", "words_per_key"):
            check_range(name, getattr(self, name), 1, integer=True)
        for name in ("sink", "recent", "seed"):
            check_range(name, getattr(self, name), 0, integer=True)
        check_range("lr", self.lr, 0, low_open=True)
        check_range("l1", self.l1, 0)
        check_range("warmup_frac", self.warmup_frac, 0, 1)
        check_range("decay_frac", self.decay_frac, 0, 1)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# fields that may differ between a run and its resume without changing what it computes
_RESUME_FREE = {"steps", "out_dir", "checkpoint_every", "log_every"}


class AlphaState(train_state.TrainState):
    """Flax train state whose params are {"alpha": [L, n]}."""


@dataclasses.dataclass
class TrainResult:
    alpha: np.ndarray
    losses: list
    state: Any
    out_dir: str | None
    seconds: float


def lr_schedule(lr: float, steps: int, warmup_frac: float = 0.2, decay_frac: float = 0.2):
    """Linear warm-up from 0.1 lr over the first warmup_frac of steps, flat, linear decay to 0.1 lr
    over the last decay_frac."""
    w = max(1, int(round(warmup_frac * steps)))
    d = max(1, int(round(decay_frac * steps)))
    flat = max(0, steps - w - d)
    return optax.join_schedules(
        [optax.linear_schedule(0.1 * lr, lr, w), optax.constant_schedule(lr),
         optax.linear_schedule(lr, 0.1 * lr, d)],
        [w, w + flat],
    )


def alpha_shape(model_cfg, granularity: str) -> tuple[int, int]:
    if granularity == "kv":
        return (model_cfg.num_layers, model_cfg.num_kv_heads)
    if granularity == "query":
        return (model_cfg.num_layers, model_cfg.num_heads)
    raise ValueError(f"granularity must be 'kv' or 'query', got {granularity!r}")


@functools.lru_cache(maxsize=32)
def _optimizer(lr: float, steps: int, warmup_frac: float, decay_frac: float):
    # cached: the same settings give the same (static) tx object, so the jitted step is not retraced
    return optax.adamw(lr_schedule(lr, steps, warmup_frac, decay_frac), weight_decay=0.0)


def create_state(model_cfg, tcfg: TrainConfig) -> AlphaState:
    alpha = jnp.ones(alpha_shape(model_cfg, tcfg.granularity), jnp.float32)
    tx = _optimizer(float(tcfg.lr), int(tcfg.steps), float(tcfg.warmup_frac), float(tcfg.decay_frac))
    return AlphaState.create(apply_fn=None, params={"alpha": alpha}, tx=tx)


@functools.lru_cache(maxsize=16)
def make_train_step(model_cfg, sink: int, recent: int, l1: float):
    """The jit-compiled step: (state, model params, stacked layers, batch) -> (state, metrics).
    Only alpha is differentiated; it is projected to [0, 1] after the update."""

    def loss_fn(alpha, params, stacked, tokens, lengths, mask, target):
        return gating.distillation_loss(model_cfg, params, stacked, alpha, tokens, lengths, mask, target,
                                        sink=sink, recent=recent, l1=l1)

    @jax.jit
    def step(state: AlphaState, params, stacked, tokens, lengths, mask):
        target = gating.teacher_hidden(model_cfg, params, stacked, tokens, lengths)
        (loss, (mse, reg)), g = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params["alpha"], params, stacked, tokens, lengths, mask, target)
        state = state.apply_gradients(grads={"alpha": g})
        state = state.replace(params={"alpha": jnp.clip(state.params["alpha"], 0.0, 1.0)})
        return state, {"loss": loss, "mse": mse, "mean_alpha": reg, "grad_norm": jnp.linalg.norm(g)}

    return step


# ------------------------------------------------------------------------------ checkpoints
def _manager(out_dir: str, keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        os.path.join(os.path.abspath(out_dir), "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )


def save_checkpoint(mgr, state: AlphaState):
    import orbax.checkpoint as ocp

    mgr.save(int(state.step), args=ocp.args.StandardSave(state), force=True)
    mgr.wait_until_finished()


def restore_checkpoint(mgr, template: AlphaState, step: int | None = None) -> AlphaState:
    import orbax.checkpoint as ocp

    step = mgr.latest_step() if step is None else step
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), template)
    return mgr.restore(step, args=ocp.args.StandardRestore(abstract))


def _check_resume_config(out_dir: str, tcfg: TrainConfig):
    path = os.path.join(out_dir, "train_config.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        new = tcfg.to_json()
        diff = {k: (old.get(k), v) for k, v in new.items() if k not in _RESUME_FREE and old.get(k) != v}
        if diff:
            raise ValueError(f"{out_dir} holds a run with different settings {diff}; use another --out "
                             f"or the same settings to resume")
        if old.get("steps") != new["steps"]:
            raise ValueError(f"{out_dir}: the run was started with steps={old.get('steps')} (the learning "
                             f"rate schedule depends on it); resume with the same --steps")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(tcfg.to_json(), f, indent=1)


# ------------------------------------------------------------------------------- scores file
def save_scores(out_dir: str, alpha, model_cfg, tcfg: TrainConfig, extra: dict | None = None):
    """Writes out_dir/scores (orbax) and out_dir/head_scores.json."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    alpha = np.asarray(alpha, np.float32)
    check_finite_result(f"the head scores for {out_dir}", alpha)
    ck = ocp.StandardCheckpointer()
    ck.save(os.path.join(out_dir, "scores"), {"alpha": alpha}, force=True)
    ck.wait_until_finished()
    doc = {
        "format": "kvoffload.head_scores/1",
        "granularity": tcfg.granularity,
        "num_layers": int(model_cfg.num_layers),
        "num_heads": int(model_cfg.num_heads),
        "num_kv_heads": int(model_cfg.num_kv_heads),
        "model_type": model_cfg.model_type,
        "sink": tcfg.sink,
        "recent": tcfg.recent,
        "steps": tcfg.steps,
        "alpha": [[round(float(x), 6) for x in row] for row in alpha],
    }
    if extra:
        doc.update(extra)
    with open(os.path.join(out_dir, SCORES_JSON), "w") as f:
        json.dump(doc, f, indent=1)


# ------------------------------------------------------------------------------------ loop
def _step_bar(label: str, start: int, end: int, total: int, quiet: bool):
    """A tqdm bar over training steps (rate, ETA), starting at the resumed step; None when quiet."""
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True)


def _log(msg: str, quiet: bool):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def step_batch(data: PasskeyData, tcfg: TrainConfig, step: int, max_length: int):
    rng = np.random.default_rng([tcfg.seed, 2, int(step)])
    lengths = rng.integers(tcfg.min_length, max_length + 1, size=tcfg.batch_size)
    pad = min(bucket(int(lengths.max()), tcfg.pad_multiple), max_length)
    idx = [step * tcfg.batch_size + i for i in range(tcfg.batch_size)]
    return data.batch(idx, lengths.tolist(), "train", pad_to=pad)


def train_importance(model, tcfg: TrainConfig, *, data: PasskeyData | None = None, quiet: bool = False,
                     stop_after: int | None = None) -> TrainResult:
    """Trains the gates; resumes from tcfg.out_dir's latest checkpoint when there is one.
    stop_after: stop (with a checkpoint) once this global step is reached (tests, time-boxed runs)."""
    mcfg = model.config
    gating.check_trainable(mcfg, "train-importance")
    max_length = min(int(tcfg.max_length), int(mcfg.max_position_embeddings))
    if tcfg.min_length > max_length:
        raise ValueError(f"min_length {tcfg.min_length} > max_length {max_length}")
    if data is None:
        from kvoffload.importance.data import text_from_file

        text = text_from_file(tcfg.text_path) if tcfg.text_path else None
        data = PasskeyData(model.tokenizer, text, num_passkeys=tcfg.num_passkeys,
                           words_per_key=tcfg.words_per_key, seed=tcfg.seed)
    state = create_state(mcfg, tcfg)
    mgr = None
    if tcfg.out_dir:
        _check_resume_config(tcfg.out_dir, tcfg)
        mgr = _manager(tcfg.out_dir)
        if mgr.latest_step() is not None:
            state = restore_checkpoint(mgr, state)
            _log(f"resumed from step {int(state.step)} ({tcfg.out_dir})", quiet)
    stacked = gating.stack_layers(model.params)
    step_fn = make_train_step(mcfg, tcfg.sink, tcfg.recent, tcfg.l1)
    losses = []
    log_f = open(os.path.join(tcfg.out_dir, "log.jsonl"), "a") if tcfg.out_dir else None
    t_start = time.time()
    start = int(state.step)
    end = tcfg.steps if stop_after is None else min(tcfg.steps, int(stop_after))
    bar = _step_bar("importance", start, end, tcfg.steps, quiet)
    try:
        for s in range(start, end):
            b = step_batch(data, tcfg, s, max_length)
            state, m = step_fn(state, model.params, stacked, jnp.asarray(b.tokens), jnp.asarray(b.lengths),
                               jnp.asarray(b.answer_mask))
            m = {k: float(v) for k, v in m.items()}
            check_finite_result(f"the training loss and gradient at step {s + 1}", [m["loss"], m["grad_norm"]],
                                "training stopped, no checkpoint or scores written (a lower --lr?)")
            losses.append(m["loss"])
            now = time.time()
            if log_f is not None:
                log_f.write(json.dumps({"step": s + 1, "tokens": int(b.tokens.shape[1]),
                                        "seconds": round(now - t_start, 2), **m}) + "\n")
                log_f.flush()
            if bar is not None and ((s + 1) % tcfg.log_every == 0 or s + 1 == end):
                bar.set_postfix_str(f"loss {m['loss']:.6f} mse {m['mse']:.3e} mean alpha {m['mean_alpha']:.4f} "
                                    f"T={b.tokens.shape[1]}", refresh=False)
            if bar is not None:
                bar.update(1)
            if mgr is not None and ((s + 1) % tcfg.checkpoint_every == 0 or s + 1 == end):
                save_checkpoint(mgr, state)
    finally:
        if bar is not None:
            bar.close()
        if log_f is not None:
            log_f.close()
    alpha = np.asarray(state.params["alpha"])
    if tcfg.out_dir and int(state.step) >= tcfg.steps:
        from kvoffload.provenance import make_provenance

        prov = make_provenance(model, same={"settings": tcfg.to_json()}, info={"seed": tcfg.seed})
        save_scores(tcfg.out_dir, alpha, mcfg, tcfg, {"final_loss": losses[-1] if losses else None, "provenance": prov})
        _log(f"scores written to {os.path.join(tcfg.out_dir, SCORES_JSON)}", quiet)
    return TrainResult(alpha, losses, state, tcfg.out_dir, time.time() - t_start)
