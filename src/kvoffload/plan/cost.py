"""Cost model: linear fits of measured times, and the per-layer / per-step predictions every
offloading policy shares (DESIGN.md, cost model).

Per layer, with layer i+1's transfers overlapping layer i's compute, a decode step costs about
max(PCIe time, GPU time): PCIe = weights (if offloaded) + activations X fetched + K/V fetched, GPU =
recomputation + attention + projections and MLP. A step is num_layers such layers plus the head.

Tensor parallelism over N devices (device/sharding.py) is priced per device: `LayerShape.of(...,
tensor_parallel=N)` counts one device's heads (its K/V bytes, recompute and attention are 1/N), its 1/N
of each activation (each device fetches its share over its own link), the layer's two all-reduces of
[batch, h] (mostly latency at decode; the same for every split), and what recomputing costs between the
devices, on the GPU's time (`CostModel.all_gather`'s links and fit: it runs inside the layer program).
With X split by token (``x_split="token"``: kvpr, hybrid) each device recomputes every head of its 1/N
of the tokens: the same flops, and only each recomputing layer program's merge of the partial softmaxes
(one all-to-all of [batch, heads, d + 1] fp32, all its extents folded first) plus, for streamed weights,
the all-gather of the W_K / W_V shards (once per layer). With X split along H (``"hidden"``) each device receives the other (N-1)/N of every recomputed
token's X first.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from kvoffload.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Linear:
    """t = intercept + slope * x for x > 0, and 0 for x <= 0 (nothing to do costs nothing)."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return 0.0 if x <= 0 else self.intercept + self.slope * float(x)

    @classmethod
    def fit(cls, xs, ys) -> "Linear":
        """Least squares with intercept >= 0 and slope > 0."""
        xs = np.asarray(xs, np.float64)
        ys = np.asarray(ys, np.float64)
        if len(xs) >= 2 and np.ptp(xs) > 0:
            a = np.stack([np.ones_like(xs), xs], 1)
            (c, m), *_ = np.linalg.lstsq(a, ys, rcond=None)
        else:
            c, m = 0.0, float(ys.mean() / max(xs.mean(), 1e-30))
        if c < 0 or m <= 0:  # refit through the origin
            c = 0.0
            m = float((xs @ ys) / max(xs @ xs, 1e-30))
        return cls(float(max(c, 0.0)), float(max(m, 1e-30)))

    def to_json(self):
        return [self.intercept, self.slope]

    @classmethod
    def from_json(cls, v):
        return cls(float(v[0]), float(v[1]))


# seconds vs bytes each device receives in an all-gather over the mesh, when no profile measured one:
# NVLink between H100s (NCCL's all-gather reaches ~350 GB/s bus bandwidth; XLA's, issued per extent, less),
# and a CPU's virtual devices (memory copies)
DEFAULT_ALL_GATHER = {"gpu": Linear(3e-5, 1 / 200e9), "cpu": Linear(1e-5, 1 / 10e9)}


def _platform_kind(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm", "tpu") else "cpu"


@dataclasses.dataclass(frozen=True)
class CostModel:
    h2d: Linear  # seconds vs bytes moved host -> GPU (one transfer)
    d2h: Linear  # seconds vs bytes moved GPU -> host
    recompute: Linear  # seconds vs flops of K/V recomputation (X @ [W_K W_V])
    attention: Linear  # seconds vs K/V bytes read by decode attention
    dense: Linear  # seconds vs flops of a layer's projections + MLP at decode
    hbm_bw: float  # bytes/s: floor for reading the layer's weights at decode
    device: str = "unknown"
    source: str = "default"
    # seconds vs bytes each device receives in an all-gather over the tensor-parallel mesh (X before
    # recomputation); all_gather_devices: the mesh size it was measured on (0: DEFAULT_ALL_GATHER, not measured)
    all_gather: Linear = DEFAULT_ALL_GATHER["gpu"]
    all_gather_devices: int = 0

    @property
    def pcie_bw(self) -> float:
        return 1.0 / self.h2d.slope

    # -- (de)serialisation -------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"h2d": self.h2d.to_json(), "d2h": self.d2h.to_json(), "recompute": self.recompute.to_json(),
                "attention": self.attention.to_json(), "dense": self.dense.to_json(), "hbm_bw": self.hbm_bw,
                "all_gather": self.all_gather.to_json(), "all_gather_devices": self.all_gather_devices,
                "device": self.device}

    @classmethod
    def from_fits(cls, fits: dict, device="unknown", source="profile", platform: str = "gpu") -> "CostModel":
        """From a profile's fits; one without an all-gather fit (written on one device, or before there
        was one) gets the platform's DEFAULT_ALL_GATHER."""
        gather = fits.get("all_gather")
        return cls(h2d=Linear.from_json(fits["h2d"]), d2h=Linear.from_json(fits["d2h"]),
                   recompute=Linear.from_json(fits["recompute"]), attention=Linear.from_json(fits["attention"]),
                   dense=Linear.from_json(fits["dense"]), hbm_bw=float(fits["hbm_bw"]), device=device, source=source,
                   all_gather=(DEFAULT_ALL_GATHER[_platform_kind(platform)] if gather is None
                               else Linear.from_json(gather)),
                   all_gather_devices=int(fits.get("all_gather_devices", 0)) if gather is not None else 0)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        """From a profile JSON written by `kvoffload profile`."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"profile not found: {path} (write one with `kvoffload profile --out {path}`)")
        with open(path) as f:
            prof = json.load(f)
        if "fits" not in prof:
            raise ValueError(f"{path} is not a kvoffload profile (no 'fits')")
        return cls.from_fits(prof["fits"], prof.get("device", "unknown"), source=path,
                             platform=prof.get("platform", "gpu"))

    @classmethod
    def default(cls, platform: str = "gpu") -> "CostModel":
        """Rough numbers used when no profile is given (H100-class GPU, or a CPU)."""
        if platform in ("gpu", "cuda", "rocm"):
            return cls(h2d=Linear(2e-5, 1 / 50e9), d2h=Linear(2e-5, 1 / 50e9), recompute=Linear(2e-5, 1 / 400e12),
                       attention=Linear(1e-5, 1 / 2.5e12), dense=Linear(3e-5, 1 / 500e12), hbm_bw=2.5e12,
                       device="default-gpu", source="default", all_gather=DEFAULT_ALL_GATHER["gpu"])
        return cls(h2d=Linear(1e-5, 1 / 10e9), d2h=Linear(1e-5, 1 / 10e9), recompute=Linear(1e-5, 1 / 50e9),
                   attention=Linear(1e-5, 1 / 20e9), dense=Linear(1e-5, 1 / 50e9), hbm_bw=20e9,
                   device="default-cpu", source="default", all_gather=DEFAULT_ALL_GATHER["cpu"])

    def describe_all_gather(self) -> str:
        bw = 1 / self.all_gather.slope / 1e9
        where = (f"measured on {self.all_gather_devices} devices" if self.all_gather_devices else
                 "default, not measured")
        return f"all-gather {bw:.3g} GB/s received per device + {self.all_gather.intercept * 1e6:.0f} us ({where})"


def dense_flops_per_token(cfg: ModelConfig) -> float:
    """Projections (q, k, v, o) and MLP matmul flops per token per layer."""
    h, d = cfg.hidden_size, cfg.head_dim
    proj = h * (cfg.num_heads * d) * 2 + h * (cfg.num_kv_heads * d) * 2
    mlp = h * cfg.intermediate_size * (3 if cfg.family == "llama" else 2)
    return 2.0 * (proj + mlp)


def recompute_flops_per_token(cfg: ModelConfig) -> float:
    return 2.0 * cfg.hidden_size * 2 * cfg.num_kv_heads * cfg.head_dim


HOST_DTYPES = ("native", "int4")
# how K is stored when host_dtype="int4": int4 with per-token group scales, int4 with per-channel scales of a
# block, int8 codes in per-token groups, or "native": kept in the model's dtype beside int4 V and X (a gathered
# row's keys exact, its V int4)
INT4_K_QUANTS = ("token", "channel", "int8", "native")


def stored_bytes(values: int, dtype_bytes: int, host_dtype: str = "native", group_size: int = 64,
                 scales: str = "token", block_tokens: int = 64) -> float:
    """Bytes of `values` numbers of one token as a pool stores them: the model's dtype ("native"), or int4
    quantization (pallas/quant.py): half a byte of packed code per value plus a float32 step and min per
    group of group_size along the last axis (scales="token"), or per value's channel and block of
    block_tokens tokens (scales="channel": 8 / block_tokens bytes of scales per value and token); scales="int8": a
    byte of code per value plus the groups' step and min (int4_k_quant="int8"); scales="native": not quantized
    (int4_k_quant="native": K in the model's dtype in an int4 pool)."""
    if host_dtype == "native" or scales == "native":
        return float(values * dtype_bytes)
    if host_dtype == "int4" and scales == "int8":
        return float(values + 2 * 4 * (values // group_size))
    if host_dtype == "int4" and scales == "channel":
        return float(values // 2 + 2 * 4 * values / block_tokens)
    if host_dtype == "int4":
        return float(values // 2 + 2 * 4 * (values // group_size))
    raise ValueError(f"host_dtype must be one of {HOST_DTYPES}, got {host_dtype!r}")


def stored_kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, host_dtype: str = "native",
                              group_size: int = 64, k_quant: str = "token", block_tokens: int = 64) -> float:
    """Bytes of one token's K and V of one layer as a pool stores them (`stored_bytes`; int4 groups run
    along each head's d, or for K with k_quant="channel" along each block's tokens; k_quant="native": K native)."""
    values = cfg.num_kv_heads * cfg.head_dim
    return (stored_bytes(values, dtype_bytes, host_dtype, group_size, k_quant, block_tokens)
            + stored_bytes(values, dtype_bytes, host_dtype, group_size))


def stored_x_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, host_dtype: str = "native",
                             group_size: int = 64) -> float:
    """Bytes of one token's activation X of one layer as a pool stores it (`stored_bytes`; int4 groups
    run along the hidden size H)."""
    return stored_bytes(cfg.hidden_size, dtype_bytes, host_dtype, group_size)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What one layer of one decode step moves and computes on one device (bytes per token etc.): with
    tensor parallelism, that device's heads and its share of each activation (`of`)."""

    x_tok: float  # bytes of one stored activation (h * p; a device's 1/N of it under tensor parallelism)
    kv_tok: float  # bytes of one token's K and V in the compute dtype (2 * n_kv * d * p): what attention reads
    recompute_flops_tok: float
    dense_flops_tok: float
    w_layer: float  # bytes of the layer's weights
    w_kv: float  # of which W_K, W_V
    # bytes of one token's K and V as the host pool stores them (what a fetch moves; int4: codes + scales);
    # None: kv_tok
    kv_host_tok: float | None = None
    # bytes of one token's activation as the host pool stores it (what a fetch of X moves); None: x_tok
    x_host_tok: float | None = None
    # tensor parallelism, X split along H: bytes of one recomputed token's X each device receives from the
    # others before its recompute (the all-gather, in the compute dtype: (N-1)/N * h * p); 0 on one device or by token
    x_gather_tok: float = 0.0
    # tensor parallelism: bytes each device receives per batch row in each of the layer's two all-reduces
    # (attention output and MLP down projection, Megatron's row-parallel partial sums: 2 (N-1)/N * h * p)
    allreduce_row: float = 0.0
    tensor_parallel: int = 1  # devices the heads are split over
    # X split by token: bytes each device receives per batch row when a layer's recomputed partial softmaxes
    # are merged ((N-1)/N * heads * (d + 1) * 4), and per layer when streamed W_K / W_V shards are gathered
    act_merge_row: float = 0.0
    w_kv_gather: float = 0.0

    def __post_init__(self):
        if self.kv_host_tok is None:
            object.__setattr__(self, "kv_host_tok", self.kv_tok)
        if self.x_host_tok is None:
            object.__setattr__(self, "x_host_tok", self.x_tok)

    @classmethod
    def of(cls, cfg: ModelConfig, dtype_bytes: int, w_layer: float = 0.0, w_kv: float = 0.0,
           host_dtype: str = "native", int4_group_size: int = 64, tensor_parallel: int = 1,
           int4_k_quant: str = "token", block_tokens: int = 64, x_split: str = "hidden") -> "LayerShape":
        """cfg: the whole model's config; w_layer, w_kv: one device's weight bytes. With tensor_parallel=N
        the shape is one device's (device/sharding.py): its n_kv / N heads' K/V (stored, fetched over its
        own link, attended, recomputed: 1/N of the flops), 1/N of each activation X, and what recomputing
        costs between devices: x_split "hidden" (X along H) the (N-1)/N of X each device receives before
        recomputing; "token" the merge of the partial softmaxes and the W_K / W_V shards' all-gather (the
        latter paid only where weights stream)."""
        from kvoffload.device.sharding import device_config

        if x_split not in ("hidden", "token"):
            raise ValueError(f"x_split must be 'hidden' or 'token', got {x_split!r}")
        n = int(tensor_parallel)
        dev = device_config(cfg, n)
        by_token = x_split == "token"
        share = (n - 1) / n
        return cls(x_tok=cfg.hidden_size * dtype_bytes / n, kv_tok=dev.kv_bytes_per_token * dtype_bytes,
                   recompute_flops_tok=recompute_flops_per_token(dev), dense_flops_tok=dense_flops_per_token(dev),
                   w_layer=w_layer, w_kv=w_kv,
                   kv_host_tok=stored_kv_bytes_per_token(dev, dtype_bytes, host_dtype, int4_group_size,
                                                         int4_k_quant, block_tokens),
                   x_host_tok=stored_x_bytes_per_token(cfg, dtype_bytes, host_dtype, int4_group_size) / n,
                   x_gather_tok=0.0 if by_token else cfg.hidden_size * dtype_bytes * share,
                   allreduce_row=2 * cfg.hidden_size * dtype_bytes * share, tensor_parallel=n,
                   act_merge_row=cfg.num_heads * (cfg.head_dim + 1) * 4 * share if by_token else 0.0,
                   w_kv_gather=w_kv * (n - 1) if by_token else 0.0)


@dataclasses.dataclass(frozen=True)
class LayerWork:
    """One GPU batch's share of one layer of a decode step, as the policy plans it: what crosses PCIe
    (bytes and how many arrays: each pays the transfer intercept) and what the GPU does."""

    batch: int
    bytes_kv: float = 0.0  # K/V fetched
    bytes_x: float = 0.0  # activations fetched (to recompute from)
    transfers: int = 0  # arrays moved
    recompute_tokens: int = 0  # tokens whose K/V are recomputed from X
    attended_tokens: int = 0  # tokens attended per sequence, summed over the batch (every source)


def predict_layers(cost: CostModel, shape: LayerShape, works, *, offload_weights: bool = False,
                   layers: int = 1) -> dict:
    """Times of `layers` decode layers, each doing `works` (one LayerWork per GPU batch): transfers of
    layer i+1 overlap compute of layer i, so a layer costs max(PCIe time, GPU time). Per device (shape:
    `LayerShape.of`); GPU time includes what recomputing exchanges between devices under tensor parallelism.

    A GPU batch's layer is one program: its parts (recompute, exchange, attention, projections and MLP,
    all-reduces) each add their fit's slope term, and the program pays one intercept, the largest of its
    parts' (``launch_s``). The profile fits each part on its own jitted call, so its intercept is mostly
    that call's launch; summing them counted ~1 ms per layer the layer program never pays (measured with 4
    H100s: kvpr's split at 4/4 predicted 87.5 ms per step, run in 67.1)."""
    w_b = shape.w_layer if offload_weights else 0.0
    x_b = sum(w.bytes_x for w in works)
    kv_b = sum(w.bytes_kv for w in works)
    n = sum(w.transfers for w in works) + (2 if offload_weights else 0)
    moved = x_b + kv_b + w_b
    transfer = 0.0 if moved <= 0 else max(1, n) * cost.h2d.intercept + cost.h2d.slope * moved
    parts = {"recompute_s": 0.0, "gather_s": 0.0, "attention_s": 0.0, "dense_s": 0.0, "allreduce_s": 0.0}
    launch, gather_b = 0.0, 0.0
    # tensor parallel, inside each batch's layer program: X split along H is all-gathered before the
    # recompute; X split by token costs the merge of the partial softmaxes. A streamed W_K / W_V's head
    # shards are gathered whole once per layer, in a program of their own before the layer's first
    # (`sharding.gather_whole`): its bytes once, its own launch
    if offload_weights and shape.w_kv_gather > 0 and any(w.recompute_tokens > 0 for w in works):
        parts["gather_s"] += cost.all_gather(shape.w_kv_gather)
        gather_b += shape.w_kv_gather
    for w in works:
        rec = w.recompute_tokens > 0
        gathered = (w.recompute_tokens * shape.x_gather_tok + w.batch * shape.act_merge_row) if rec else 0.0
        gather_b += gathered
        terms = [("recompute_s", cost.recompute, w.recompute_tokens * shape.recompute_flops_tok),
                 ("gather_s", cost.all_gather, gathered),
                 ("attention_s", cost.attention, w.attended_tokens * shape.kv_tok),
                 # the layer's two all-reduces of [batch, h] (priced on the all-gather's links and fit)
                 ("allreduce_s", cost.all_gather, 2 * w.batch * shape.allreduce_row)]
        intercepts = [0.0]
        for key, line, x in terms:
            if x > 0:
                parts[key] += line.slope * float(x)
                intercepts.append(line.intercept)
        dense_x = w.batch * shape.dense_flops_tok
        if dense_x > 0:
            parts["dense_s"] += max(cost.dense.slope * dense_x, shape.w_layer / cost.hbm_bw)
            intercepts.append(cost.dense.intercept)
        launch += max(intercepts)
    gpu = sum(parts.values()) + launch
    t = {"transfer_s": transfer, "gpu_s": gpu, **parts, "launch_s": launch, "bytes_h2d": moved, "bytes_x": x_b,
         "bytes_kv": kv_b, "bytes_w": w_b, "bytes_gather": gather_b, "layer_s": max(transfer, gpu)}
    out = {k: v * layers for k, v in t.items()}
    out["step_s"] = out.pop("layer_s")
    out["bound"] = "pcie" if transfer >= gpu else "gpu"
    return out


def layer_terms(cost: CostModel, shape: LayerShape, batch: int, s: int, l: int, *, tail: int = 1,
                offload_weights: bool = False, gpu_batches: int = 1) -> dict:
    """Times of one layer of one decode step for gpu_batches batches of `batch` sequences with `s`
    host slots each, of which the first l are recomputed from X (l = 0: plain offload); the
    transfers of a layer are queued back to back (one latency)."""
    work = LayerWork(batch=batch, bytes_kv=batch * (s - l) * shape.kv_host_tok, bytes_x=batch * l * shape.x_host_tok,
                     transfers=0, recompute_tokens=batch * l, attended_tokens=batch * (s + tail))
    t = predict_layers(cost, shape, [work] * gpu_batches, offload_weights=offload_weights)
    t["layer_s"] = t.pop("step_s")
    return t


def predict_step(cost: CostModel, cfg: ModelConfig, shape: LayerShape, batch: int, s: int, l: int, *,
                 tail: int = 1, offload_weights: bool = False, gpu_batches: int = 1, policy: str = "kvpr") -> dict:
    """Predicted seconds of one decode step (all layers, all GPU batches). policy 'full': no
    transfers (K/V on the GPU); 'offload': l = 0; 'kvpr': the given l."""
    if policy == "full":
        t = layer_terms(cost, shape, batch, 0, 0, tail=s + tail, offload_weights=False, gpu_batches=gpu_batches)
        per_layer = t["gpu_s"]
        t = {**t, "transfer_s": 0.0, "bytes_h2d": 0.0, "bytes_kv": 0.0, "layer_s": per_layer}
    else:
        t = layer_terms(cost, shape, batch, s, 0 if policy == "offload" else l, tail=tail,
                        offload_weights=offload_weights, gpu_batches=gpu_batches)
    out = {k: v * cfg.num_layers for k, v in t.items()}
    out["step_s"] = t["layer_s"] * cfg.num_layers
    out["bound"] = "pcie" if t["transfer_s"] >= t["gpu_s"] else "gpu"
    return out
