"""How often TokenSelect's selection cache could be reused on the real model, under two reuse criteria.

The question: `tokenselect` replays a hit rate of 0.22 in its speed runs, measured with this library's
criterion (per request and KV head: min over the group's query heads of cos(q_t, q_cached) >= 0.9, on the
rotated queries the attention uses). pzs19/TokenSelect (patcher/token_retrieval.py, `QUERY_CACHE`) reuses per
*layer*: the cosine of the whole layer's query (every head, concatenated) against the one the layer last
selected with, threshold 0.9; its queries are taken before RoPE (the FlashInfer kernel applies RoPE itself),
and one selection serves every head of the layer. Here both criteria run on the same decode trajectory, with
and without RoPE, and the hit rate is reported per layer.

Method: `full` generates the answer greedily (fp32); one forward pass over prompt + answer captures each
layer's query at every decode position; each criterion is replayed along that sequence (a miss re-selects and
caches the query; the first step always selects). The queries are `full`'s, not those of a run attending only
the selected tokens, and the pool's growth by a block (which this library's cache also treats as a miss) is
left out: both make the rates upper bounds of a little.

    PYTHONPATH=src python experiments/tokenselect_reuse.py --lengths 2048,4096 --tasks niah_single_2,qa_1 \\
        --new-tokens 32 --out /tmp/reuse.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def decode_queries(model, prompt_ids, new_tokens):
    """(pre-RoPE q, post-RoPE q), each [L, steps, H, d]: the queries of the decode steps that generated the
    greedy answer (the prompt's last position first)."""
    from kvoffload.engine import generate
    from kvoffload.eval.selection_recall import capture_queries_keys

    answer = generate(model, [list(prompt_ids)], new_tokens, policy="full", stop_on_eos=False)[0]
    ids = list(prompt_ids) + list(answer)[:-1]  # the last generated token is never a query
    first = len(prompt_ids) - 1
    raw, _ = capture_queries_keys(model, ids, first, unrotated=True)
    rot, _ = capture_queries_keys(model, ids, first)
    return raw.transpose(0, 2, 1, 3), rot.transpose(0, 2, 1, 3)  # [L, H, steps, d] -> [L, steps, H, d]


def _cos(a, b, axis=-1):
    na, nb = np.linalg.norm(a, axis=axis), np.linalg.norm(b, axis=axis)
    return np.sum(a * b, axis=axis) / np.maximum(na * nb, 1e-30)


def replay(q, n_kv: int, threshold: float, per_layer: bool) -> np.ndarray:
    """Hit rate per layer [L] of a selection cache replayed along q [L, steps, H, d]: per layer (the whole
    query concatenated; one decision for every head) or per KV head (min over its group's query heads)."""
    L, steps, H, d = q.shape
    hits = np.zeros(L)
    for l in range(L):
        if per_layer:
            cached, h = q[l, 0].reshape(-1), 0
            for t in range(1, steps):
                cur = q[l, t].reshape(-1)
                if _cos(cur, cached) >= threshold:
                    h += 1
                else:
                    cached = cur
            hits[l] = h / max(steps - 1, 1)
        else:
            cached, h = q[l, 0].copy(), 0
            for t in range(1, steps):
                sim = _cos(q[l, t], cached).reshape(n_kv, H // n_kv).min(-1)  # [n_kv]
                hit = sim >= threshold
                h += hit.sum()
                grp = q[l, t].reshape(n_kv, H // n_kv, d)
                c = cached.reshape(n_kv, H // n_kv, d)
                c[~hit] = grp[~hit]
                cached = c.reshape(H, d)
            hits[l] = h / max((steps - 1) * n_kv, 1)
    return hits


CRITERIA = {  # name: (rotated queries?, per layer?)
    "per KV head, rotated (this library)": (True, False),
    "per KV head, before RoPE": (False, False),
    "per layer, before RoPE (pzs19/TokenSelect)": (False, True),
    "per layer, rotated": (True, True),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--tasks", default="niah_single_2,niah_multikey_1,qa_1,vt")
    ap.add_argument("--template", choices=("plain", "chat"), default="plain")
    ap.add_argument("--seed", type=int, default=42, help="RULER generator seed (42: the development set)")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--out", default=None, help="the rates as JSON")
    ap.add_argument("--plot", default=None, help="hit rate per layer under each criterion, as a PNG")
    a = ap.parse_args(argv)
    from kvoffload.eval import ruler
    from kvoffload.models import load_model

    model = load_model(None, quiet=True)
    cfg = model.config
    chat = ruler.ChatWrapper.from_tokenizer(model.tokenizer, a.template == "chat")
    rates = {name: [] for name in CRITERIA}
    for length in map(int, a.lengths.split(",")):
        for task in a.tasks.split(","):
            for s in ruler.generate_samples(model.tokenizer, task, length, a.samples, seed=a.seed, chat=chat):
                t0 = time.time()
                raw, rot = decode_queries(model, s.prompt_ids, a.new_tokens)
                for name, (rotated, per_layer) in CRITERIA.items():
                    rates[name].append(replay(rot if rotated else raw, cfg.num_kv_heads, a.threshold, per_layer))
                print(f"{task} {length} #{s.index}: {len(s.prompt_ids)} tokens, {time.time() - t0:.0f}s; " +
                      ", ".join(f"{n.split(' (')[0]} {rates[n][-1].mean():.3f}" for n in CRITERIA),
                      file=sys.stderr, flush=True)
    out = {"model": "SmolLM2-135M-Instruct (fp32, CPU)", "threshold": a.threshold, "template": a.template,
           "seed": a.seed, "lengths": a.lengths, "tasks": a.tasks, "new_tokens": a.new_tokens,
           "criteria": {n: {"mean": float(np.mean(r)), "per_layer": np.mean(r, axis=0).round(3).tolist()}
                        for n, r in rates.items()}}
    print("| criterion | hit rate | per layer (min / median / max) |\n|---|--:|---|")
    for n, r in out["criteria"].items():
        pl = np.asarray(r["per_layer"])
        print(f"| {n} | {r['mean']:.3f} | {pl.min():.2f} / {np.median(pl):.2f} / {pl.max():.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        plot(out, a.plot)
    return 0


def plot(out: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, r in out["criteria"].items():
        ax.plot(r["per_layer"], marker="o", ms=3, label=f"{name}: {r['mean']:.3f}")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"selection reused (cos >= {out['threshold']:g})")
    ax.set_title(f"{out['model']}, RULER {out['tasks']} at {out['lengths']}, {out['template']} template, "
                 f"{out['new_tokens']} tokens", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
