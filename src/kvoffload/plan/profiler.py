"""The profiler: measures this machine and writes a JSON profile the cost model reads.

Measured: host->GPU and GPU->host copy time over transfer sizes (pinned_host <-> device), the matmul
time of K/V recomputation at the recompute shapes (X [B, T, H] @ [W_K W_V]), decode attention time
per layer over context lengths, and the per-layer projections + MLP time at the planned batch. Each
is fitted with a line t = a + b * x (x = bytes or flops); the fits (and the raw points) go to JSON.

With tensor_parallel=N (a mesh of N devices, device/sharding.py) the profile is one device's as a
tensor-parallel run sees it: transfers with all N links busy at once (each device moving its own shard),
compute (per flop and byte, measured at the whole model's shapes on one device), and the all-gather of an activation split along H
(fitted as `all_gather`, seconds vs bytes received per device: the cost model prices every collective between
the devices on it, the all-reduces and the exchange of partial softmaxes too).
On one device the all-gather fit is the platform's default (`plan.cost.DEFAULT_ALL_GATHER`), recorded
with all_gather_devices 0.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from kvoffload.config import ModelConfig
from kvoffload.device import memory as M
from kvoffload.device import sharding as S
from kvoffload.plan.cost import (DEFAULT_ALL_GATHER, CostModel, Linear, _platform_kind, dense_flops_per_token,
                                 recompute_flops_per_token)

MODEL_SHAPES = {
    "opt-6.7b": dict(model_type="opt", vocab_size=50272, hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                     num_attention_heads=32, max_position_embeddings=2048, do_layer_norm_before=True,
                     word_embed_proj_dim=4096, activation_function="relu", bos_token_id=2, eos_token_id=2),
    "opt-13b": dict(model_type="opt", vocab_size=50272, hidden_size=5120, ffn_dim=20480, num_hidden_layers=40,
                    num_attention_heads=40, max_position_embeddings=2048, do_layer_norm_before=True,
                    word_embed_proj_dim=5120, activation_function="relu", bos_token_id=2, eos_token_id=2),
    "opt-30b": dict(model_type="opt", vocab_size=50272, hidden_size=7168, ffn_dim=28672, num_hidden_layers=48,
                    num_attention_heads=56, max_position_embeddings=2048, do_layer_norm_before=True,
                    word_embed_proj_dim=7168, activation_function="relu", bos_token_id=2, eos_token_id=2),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False),
    # the selection benchmarks' second GQA shape: 7 query heads per KV head, q/k/v biases
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False),
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    "tiny-opt": dict(model_type="opt", vocab_size=258, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=512, do_layer_norm_before=True,
                     word_embed_proj_dim=64, activation_function="relu"),
}


def model_shape(name_or_path: str) -> ModelConfig:
    """A named shape (opt-6.7b, opt-13b, opt-30b, llama-3-8b, llama-2-7b, qwen2.5-7b, tiny-opt) or an HF
    config.json / directory."""
    if name_or_path in MODEL_SHAPES:
        return ModelConfig.from_hf_dict(MODEL_SHAPES[name_or_path])
    return ModelConfig.from_json(name_or_path)


def _timeit(fn: Callable, *args, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn(*args) (the arguments are passed, not closed over, so a caller can
    free them right after)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _log(progress, msg):
    if progress:
        progress(msg)


def default_progress(msg: str):
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


def measure_transfers(sizes_mb, reps=5, progress=None, queue=8, mesh=None) -> dict:
    """Seconds per transfer when `queue` copies are issued back to back and waited for once (as the
    runtime issues them: the per-copy host sync of a one-at-a-time timing is not paid there). With a
    mesh, each device moves its own `mb` shard of every array at once (as the tensor-parallel pool
    does, each over its own link): the seconds and bytes are one device's with every link busy."""
    n_dev = S.size(mesh)
    where = M.default_device() if mesh is None else NamedSharding(mesh, P(S.MODEL))
    h2d, d2h = [], []
    for mb in sizes_mb:
        n = max(1, int(mb * 1e6 / 2))
        x_dev = [M.to_device(jax.random.normal(jax.random.key(i), (n_dev * n,), jnp.bfloat16), where)
                 for i in range(queue)]
        x_host = jax.block_until_ready(M.to_host(x_dev, where))
        th = _timeit(lambda xs: [M.to_device(a, where) for a in xs], x_host, reps=reps) / queue
        td = _timeit(lambda xs: [M.to_host(a, where) for a in xs], x_dev, reps=reps) / queue
        nbytes = n * 2
        h2d.append((nbytes, th))
        d2h.append((nbytes, td))
        _log(progress, f"transfer {nbytes / 1e6:8.1f} MB{f' per device, {n_dev} at once' if mesh else ''}: "
                       f"host->GPU {nbytes / th / 1e9:6.1f} GB/s, GPU->host {nbytes / td / 1e9:6.1f} GB/s")
        del x_dev, x_host
    return {"h2d": h2d, "d2h": d2h}


def measure_all_gather(mesh, hidden_size: int, sizes_mb, dtype, reps=5, progress=None) -> list:
    """(bytes each device receives, seconds) of all-gathering an activation block [T, H] stored split
    along H over the mesh, as the layer program does before recomputing (sharding.constrain_replicated
    inside a jitted program), for T giving about `mb` MB of X in all."""
    n = S.size(mesh)
    p = jnp.dtype(dtype).itemsize
    split = NamedSharding(mesh, P(None, S.MODEL))
    with S.context(mesh):
        gather = jax.jit(S.constrain_replicated)
        points = []
        for mb in sizes_mb:
            t = max(1, int(mb * 1e6 / (hidden_size * p)))
            x = jax.device_put(jnp.ones((t, hidden_size), dtype), split)
            sec = _timeit(gather, x, reps=reps)
            received = t * hidden_size * p * (n - 1) / n
            points.append((received, sec))
            _log(progress, f"all-gather over {n} devices of {t * hidden_size * p / 1e6:8.1f} MB of X: "
                           f"{sec * 1e3:8.3f} ms ({received / sec / 1e9:6.1f} GB/s received per device)")
            del x
    return points


def measure_compute(cfg: ModelConfig, batch: int, dtype, tokens=(64, 256, 1024), contexts=(256, 1024, 4096),
                    batches=None, reps=5, progress=None) -> dict:
    from kvoffload import ops
    from kvoffload.models.transformer import family, init_params

    fam = family(cfg)
    one = ModelConfig(**{**cfg.__dict__, "num_layers": 1})
    params = init_params(one, jax.random.key(1), dtype)
    lp = params.layers[0]
    key = jax.random.key(2)
    out = {"recompute": [], "attention": [], "dense": []}

    # what the pipeline runs (PipelineOptions.recompute_impl: XLA's matmuls), and the Pallas kernel beside it
    rec = jax.jit(lambda x, pos: fam.recompute_kv(cfg, lp, x, pos, impl="reference"))
    rec_ops = jax.jit(lambda x, pos: fam.recompute_kv(cfg, lp, x, pos))
    out["recompute_ops"] = []
    for t in tokens:
        x = jax.random.normal(key, (batch, t, cfg.hidden_size), dtype)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
        sec = _timeit(rec, x, pos, reps=reps)
        sec_ops = _timeit(rec_ops, x, pos, reps=reps)
        flops = batch * t * recompute_flops_per_token(cfg)
        out["recompute"].append((flops, sec))
        out["recompute_ops"].append((flops, sec_ops))
        _log(progress, f"recompute B={batch} T={t:5d}: {sec * 1e3:8.3f} ms ({flops / sec / 1e12:6.1f} TFLOP/s); "
                       f"Pallas kernel (impl auto) {sec_ops * 1e3:8.3f} ms")
        del x

    att = jax.jit(lambda q, k, v, n: ops.decode_attention(q, k, v, n))
    for s in contexts:
        q = jax.random.normal(key, (batch, cfg.num_heads, cfg.head_dim), dtype)
        k = jax.random.normal(key, (batch, cfg.num_kv_heads, s, cfg.head_dim), dtype)
        n = jnp.full((batch,), s, jnp.int32)
        sec = _timeit(att, q, k, k, n, reps=reps)
        nbytes = batch * s * cfg.kv_bytes_per_token * jnp.dtype(dtype).itemsize
        out["attention"].append((nbytes, sec))
        _log(progress, f"attention B={batch} S={s:5d}: {sec * 1e3:8.3f} ms ({nbytes / sec / 1e9:7.1f} GB/s of K/V)")
        del k

    def dense_layer(h, lp):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, jnp.zeros(h.shape[:2], jnp.int32))
        return fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, q[:, : cfg.num_heads]))

    dense = jax.jit(dense_layer)
    for b in batches or sorted({max(1, batch // 4), max(1, batch // 2), batch}):
        h = jax.random.normal(key, (b, 1, cfg.hidden_size), dtype)
        sec = _timeit(dense, h, lp, reps=reps)
        flops = b * dense_flops_per_token(cfg)
        out["dense"].append((flops, sec))
        _log(progress, f"projections+MLP B={b:4d}: {sec * 1e3:8.3f} ms")
    # HBM bandwidth: a large on-device copy (read + write)
    n = 64 * 2**20 if M.default_device().platform != "cpu" else 2**20
    big = jax.random.normal(key, (n,), dtype)
    cp = jax.jit(lambda a: a * 2)
    sec = _timeit(cp, big, reps=reps)
    out["hbm_bw"] = 2 * n * jnp.dtype(dtype).itemsize / sec
    _log(progress, f"device memory copy: {out['hbm_bw'] / 1e9:.0f} GB/s")
    return out


def fit_profile(raw: dict, all_gather_devices: int = 0, platform: str = "gpu") -> dict:
    """The linear fits of the raw points; all_gather: fitted where raw has points (measured on
    all_gather_devices devices), else the platform's default (all_gather_devices 0)."""
    def fit(points):
        xs, ys = zip(*points)
        return Linear.fit(xs, ys).to_json()

    fits = {"h2d": fit(raw["h2d"]), "d2h": fit(raw["d2h"]), "recompute": fit(raw["recompute"]),
            "attention": fit(raw["attention"]), "dense": fit(raw["dense"]), "hbm_bw": float(raw["hbm_bw"])}
    measured = bool(raw.get("all_gather")) and all_gather_devices > 1
    fits["all_gather"] = fit(raw["all_gather"]) if measured else DEFAULT_ALL_GATHER[_platform_kind(platform)].to_json()
    fits["all_gather_devices"] = int(all_gather_devices) if measured else 0
    return fits


def run_profile(cfg: ModelConfig, batch: int, dtype="bfloat16", quick: bool = False, progress=default_progress,
                sizes_mb=None, tokens=None, contexts=None, tensor_parallel: int = 1) -> dict:
    """Measures, fits, returns the profile dict (see module docstring); tensor_parallel=N: one device's
    profile on a mesh of the first N devices (cfg is the whole model's)."""
    dtype = jnp.dtype(dtype)
    dev = M.default_device()
    cpu = dev.platform == "cpu"
    mesh = S.resolve_mesh(tensor_parallel)
    n = S.size(mesh)
    if sizes_mb is None:
        sizes_mb = ([0.25, 1, 4] if cpu else [1, 16, 64]) if quick else ([0.25, 1, 4, 16] if cpu else
                                                                           [1, 4, 16, 64, 256])
    tokens = tokens or ((32, 128) if cpu else ((128, 512) if quick else (64, 256, 1024)))
    contexts = contexts or ((128, 512) if cpu else ((512, 2048) if quick else (256, 1024, 4096)))
    reps = 3 if quick else 5
    _log(progress, f"device {dev.device_kind} ({dev.platform}); {M.host_memory_kind(dev)[1]}"
                   + (f"; one of {n} devices (tensor parallel)" if mesh is not None else ""))
    # transfers at 5 repetitions even when quick: the PCIe slope comes mostly from the largest size, and on a
    # 4-GPU H100 host one slow repetition in 3 made a quick profile's 2-GPU fit 27 GB/s where links ran at 50
    raw = measure_transfers(sizes_mb, max(reps, 5), progress, mesh=mesh)
    # compute on one device at the whole model's shapes: the fits are per flop / byte, which prices a
    # device's heads (1/N of them) as well
    raw.update(measure_compute(cfg, batch, dtype, tokens, contexts, reps=reps, progress=progress))
    if mesh is not None:
        raw["all_gather"] = measure_all_gather(mesh, cfg.hidden_size, sizes_mb, dtype, reps, progress)
    fits = fit_profile(raw, n, dev.platform)
    cm = CostModel.from_fits(fits, dev.device_kind, platform=dev.platform)
    _log(progress, f"fits: PCIe host->GPU {cm.pcie_bw / 1e9:.1f} GB/s + {cm.h2d.intercept * 1e6:.0f} us, "
                   f"recompute {1 / cm.recompute.slope / 1e12:.1f} TFLOP/s, attention {1 / cm.attention.slope / 1e9:.0f} GB/s, "
                   f"{cm.describe_all_gather()}")
    return {"version": 1, "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": {"family": cfg.family, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                      "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "layers": cfg.num_layers},
            "tensor_parallel": n, "batch": batch, "dtype": str(dtype),
            "raw": {k: (v if k == "hbm_bw" else [list(p) for p in v]) for k, v in raw.items()},
            "fits": fits}


def write_profile(prof: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)


__all__ = ["run_profile", "write_profile", "model_shape", "MODEL_SHAPES", "fit_profile", "measure_all_gather"]
