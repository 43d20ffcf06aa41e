"""What several benchmarks and experiments share and the `kvoffload bench` command does not: JSON output,
--option parsing, a random prompt's prefilled state, the host-speed gauge, windowed decode timing, a median
timer and the random-K/V prefill stand-in. Imported by name: a script's own folder is on sys.path when run
as `python benchmarks/NAME.py`; experiments put benchmarks/ there."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from kvoffload.offload.bench import _greedy, make_model, on_host  # noqa: E402


def write_json(path, record) -> None:
    """A benchmark's record as indented JSON at path (its folder made as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def parse_options(pairs) -> dict:
    """Command-line KEY=VALUE policy options ({key: value}; VALUE parsed as JSON, else kept a string)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--option takes key=value, got {pair!r}")
        k, v = pair.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def add_random_prompt_args(ap, policy: str, shape: str, batch: int, prompt: int) -> None:
    """The command-line arguments of `random_prompt_state` (--policy, --shape, --batch, --prompt, --dtype,
    --option KEY=VALUE, repeated) with these defaults."""
    ap.add_argument("--policy", default=policy)
    ap.add_argument("--shape", default=shape, help="a named shape (plan.profiler.model_shape) or config.json")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--prompt", type=int, default=prompt)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a policy option")


_GAUGE_PROGRAM = None


def host_gauge(dispatches: int = 200, loop: int = 100_000) -> dict:
    """The host's speed now, by two fixed pieces of work: us per dispatch of a trivial jitted program on the
    default device (back to back, waited for once at the end: the host's cost, the device idle) and ns per turn
    of a fixed Python loop. A lent GPU host's speed moves ~2x over stretches of steps (BENCHMARKS, host
    cost); read before and after timed steps, these say whether a slow run had a slow host (both slower: the
    CPU; only the dispatch: the driver or the runtime)."""
    import jax
    import jax.numpy as jnp

    global _GAUGE_PROGRAM
    if _GAUGE_PROGRAM is None:
        _GAUGE_PROGRAM = jax.jit(lambda x: x + 1)
    x = jax.block_until_ready(_GAUGE_PROGRAM(jnp.zeros((8,), jnp.float32)))
    t = time.perf_counter()
    for _ in range(dispatches):
        x = _GAUGE_PROGRAM(x)
    jax.block_until_ready(x)
    dispatch_us = (time.perf_counter() - t) / dispatches * 1e6
    t = time.perf_counter()
    acc = 0
    for i in range(loop):
        acc += i & 7
    loop_ns = (time.perf_counter() - t) / loop * 1e9
    return {"dispatch_us": dispatch_us, "python_loop_ns": loop_ns}


def random_prompt_state(shape: str, policy: str, options: dict, batch: int, prompt: int, extra_tokens: int,
                        dtype="bfloat16", tensor_parallel: int = 1, seed: int = 0, model=None):
    """(model, policy, state, next tokens): random weights in the named shape (`make_model`; or `model`, one
    made before, so that two states share its weights), `policy` with `options` prefilled with a random prompt
    of `prompt` tokens per request, room for `extra_tokens` more."""
    import jax.numpy as jnp

    from kvoffload.policies import make_policy

    if model is None:
        model = make_model(shape, jnp.dtype(dtype), bool(options.get("offload_weights")))
    tokens = jnp.asarray(np.random.default_rng(seed).integers(4, model.config.vocab_size - 1, (batch, prompt)),
                         jnp.int32)
    pol = make_policy(policy, tensor_parallel=tensor_parallel, **options)
    logits, state = pol.prefill(model, tokens, jnp.full((batch,), prompt, jnp.int32), prompt + extra_tokens + 1)
    nxt = _greedy(logits)
    on_host(nxt)
    return model, pol, state, nxt


def decode_windows(pol, model, state, nxt, n_windows: int, window: int):
    """n_windows windows of `window` greedy decode steps each, as `engine.generate` decodes (the host reads the
    device once a window, `engine.SYNC_EVERY` steps: it dispatches step t + 1 while the device runs step t, so a
    step costs the larger of its host and device times, not their sum up to the first program's dispatch).
    Returns (per-step seconds of each window: its wall time / window, state, the last tokens)."""
    from kvoffload.engine import frozen_gc

    per_step = []
    with frozen_gc():
        for _ in range(n_windows):
            t = time.perf_counter()
            for _ in range(window):
                logits, state = pol.decode_step(model, state, nxt)
                nxt = _greedy(logits)
            on_host(nxt)
            per_step.append((time.perf_counter() - t) / window)
    return per_step, state, nxt


def median_time(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() until its outputs are ready (after warm-up calls)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


# ------------------------------------------------------------------------------------------------
# a prefill stand-in for decode benchmarks (bench_selection.py, bench_long_context.py)
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _random_kv_layer():
    import jax

    @functools.partial(jax.jit, static_argnames=("cfg", "keep_x", "chunk_tokens"))
    def layer(cfg, lp, h, positions, lengths, keep_x, chunk_tokens=None):
        b, t, hidden = h.shape
        dtype = lp.wk.dtype
        kk, kv, kx = jax.random.split(jax.random.fold_in(jax.random.key(7), t), 3)
        shape = (b, cfg.num_kv_heads, t, cfg.head_dim)
        k = jax.random.normal(kk, shape, dtype)
        v = jax.random.normal(kv, shape, dtype)
        x = jax.random.normal(kx, (b, t, hidden), dtype) if keep_x else None
        return h, k, v, x

    return layer


@contextlib.contextmanager
def random_kv_prefill(mesh=None):
    """Within: the pipeline's prefill computes no layer; each layer's K/V (and X) are random, of the shapes
    and dtype the layer program would give, and the hidden state passes through: the decode step of a long
    context measured without minutes of prefill attention (everything else is the runtime's own prefill:
    memory plan, pool layout, extents, tails, retrieval metadata from the keys). On a
    tensor-parallel mesh the outputs are placed as the real program's are (K/V by head, X along H, h replicated)."""
    import jax

    from kvoffload.device import memory as M
    from kvoffload.runtime import prefill as pipeline

    layer = _random_kv_layer()
    dev = M.default_device()

    def committed(cfg, lp, h, positions, lengths, keep_x, chunk_tokens=None, attention_impl=None):
        # the prefill's _layer_prefill signature; committed to the device, as the real program's outputs are
        # (it reads the committed weights): the tails made from them then enter the first decode step as
        # later steps' do (one compilation)
        out = layer(cfg, lp, h, positions, lengths, keep_x, chunk_tokens)
        if mesh is None:
            return jax.device_put(out, dev)
        from kvoffload.device import sharding as S

        h, k, v, x = out
        return (jax.device_put(h, S.replicated(mesh)), *jax.device_put((k, v), S.kv_sharding(mesh)),
                None if x is None else jax.device_put(x, S.x_shardings(x, mesh)))

    real = pipeline._layer_prefill
    pipeline._layer_prefill = committed
    try:
        yield
    finally:
        pipeline._layer_prefill = real
