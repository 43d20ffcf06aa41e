"""The falsifiable check of learned head scores: passkey accuracy with some heads on streaming attention.

A question counts as correct when the model's greedy next token equals the answer token at every answer
position (teacher-forced). That is exactly "greedy decoding reproduces the passkey": if every argmax
along the answer matches, greedy generation emits those tokens, and conversely.

    acc = passkey_accuracy(model, data, streaming_mask=None)            # full attention
    low = passkey_accuracy(model, data, lowest_mask(alpha, 0.5))         # 50% lowest -> streaming
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.importance import gating
from kvoffload.importance.data import PasskeyData, collate


@functools.partial(jax.jit, static_argnames=("cfg", "sink", "recent"))
def _answer_argmax(cfg, params, stacked, gates, tokens, lengths, idx, sink, recent):
    h = gating.student_hidden(cfg, params, stacked, gates, tokens, lengths, sink=sink, recent=recent,
                              remat=False)
    hs = jnp.take_along_axis(h, idx[..., None], axis=1)  # [B, P, H]
    if cfg.family == "llama":
        head = params.embed.T if params.lm_head is None else params.lm_head
        lg = jnp.einsum("bph,hv->bpv", hs, head, preferred_element_type=jnp.float32)
    else:
        lg = jnp.einsum("bph,vh->bpv", hs, params.embed, preferred_element_type=jnp.float32)
    nxt = jnp.take_along_axis(tokens, jnp.minimum(idx + 1, tokens.shape[1] - 1), axis=1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(lg, axis=-1), nxt[..., None], axis=-1)[..., 0]
    return jnp.argmax(lg, axis=-1).astype(jnp.int32), logp


def passkey_accuracy(model, data: PasskeyData, streaming_mask=None, *, num_samples: int = 16,
                     length: int = 1024, sink: int = 128, recent: int = 256, split: str = "eval",
                     start_index: int = 0, batch_size: int = 1, quiet: bool = True) -> dict:
    """Accuracy over num_samples held-out samples (every question of each sample).

    streaming_mask: bool [L, n_kv] or [L, n_heads], True = that head uses streaming attention
    (sink + recent) instead of full; None = all full. Returns {"accuracy", "correct", "questions",
    "token_accuracy" (teacher-forced argmax hits over answer tokens), "answer_logprob" (mean log-prob
    of the answer tokens), "per_sample", "seconds"}.
    """
    cfg = model.config
    if streaming_mask is None:
        gates = jnp.ones((cfg.num_layers, cfg.num_kv_heads), jnp.float32)
    else:
        gates = jnp.asarray(~np.asarray(streaming_mask, bool), jnp.float32)
    stacked = gating.stack_layers(model.params)
    correct = total = tok_ok = tok_n = 0
    logp_sum = 0.0
    per_sample = []
    t0 = time.time()
    for b0 in range(0, num_samples, batch_size):
        samples = [data.sample(start_index + i, length, split) for i in range(b0, min(b0 + batch_size, num_samples))]
        batch = collate(samples, pad_to=length)
        pos = [np.flatnonzero(s.answer_mask) for s in samples]
        p = max(len(x) for x in pos)
        idx = np.zeros((len(samples), p), np.int32)
        for i, x in enumerate(pos):
            idx[i, :len(x)] = x
        pred, logp = _answer_argmax(cfg, model.params, stacked, gates, jnp.asarray(batch.tokens),
                                    jnp.asarray(batch.lengths), jnp.asarray(idx), sink, recent)
        pred, logp = np.asarray(pred), np.asarray(logp)
        for i, s in enumerate(samples):
            got = dict(zip(pos[i].tolist(), pred[i, :len(pos[i])].tolist()))
            ok = []
            for a, e in s.answer_spans:
                ok.append(all(got[t - 1] == int(s.tokens[t]) for t in range(a, e)))
            per_sample.append(ok)
            correct += sum(ok)
            total += len(ok)
            n = len(pos[i])
            tok_ok += int(np.sum(pred[i, :n] == s.tokens[pos[i] + 1]))
            tok_n += n
            logp_sum += float(np.sum(logp[i, :n]))
        if not quiet:
            print(f"  {b0 + len(samples)}/{num_samples} samples: {correct}/{total} correct", flush=True)
    return {"accuracy": correct / max(total, 1), "correct": correct, "questions": total,
            "token_accuracy": tok_ok / max(tok_n, 1), "answer_logprob": logp_sum / max(tok_n, 1),
            "per_sample": per_sample, "seconds": time.time() - t0}
