"""The host store: per layer, K/V (and for KVPR the attention-input activations X) in host memory.

Layout per layer: a list of segments, each a contiguous range of slots held as whole host arrays
(K, V ``[B, n_kv, n, d]``, X ``[B, n, H]``; any of them may be absent), so that every transfer is one
eager device_put of a whole array (a sliced fetch would need a jitted program, whose copy runs on
the compute stream and does not overlap compute):

* prompt segments (slot j of sequence b valid if j < prompt_len[b]): `offload` keeps the prompt as
  one segment of K/V; `kvpr` ('both') keeps chunks of ``split_bucket`` slots with X and K/V each, so
  the split point can move to any chunk boundary per step; `kvpr` ('split') keeps X of [0, l0) and
  K/V of [l0, t_pad) only (half the host memory, l fixed at prefill);
* generated segments: ``flush_block`` tokens each (all valid).

The newest generated tokens sit in a small per-layer GPU tail (``flush_block`` slots) that the layer's
jitted compute writes in place (donated); when it is full it is copied to the host as a new segment
with an asynchronous device->host transfer (it runs beside the next host->device fetches). So host
memory is written once per token, never read back to the GPU twice for the same token per step,
and nothing blocks. Slots are positions in key order; attention is order-free, so segments are
attended separately and merged by log-sum-exp (no concatenation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvoffload.offload import memory as M


@dataclasses.dataclass
class Segment:
    k: Any  # [B, n_kv, n, d] host
    v: Any
    x: Any  # [B, n, H] host, or None (no activations stored)
    n: int  # slots
    start: int  # first slot index (prompt: 0; generated: t_pad + j * flush_block)


@dataclasses.dataclass
class SubBatch:
    """One GPU batch's share of the store and its GPU tail."""

    rows: slice  # rows of the full batch
    prompt_lens: Any  # device [b] int32
    t_pad: int
    segs: list  # per layer: list[Segment]
    tail_k: list  # per layer device [b, n_kv, C, d]
    tail_v: list
    tail_x: list  # per layer device [b, C, H] or None
    tail_len: int = 0  # valid tail slots (same for every sequence)
    n_flushed: int = 0  # generated tokens already in host segments

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def host_slots(self) -> int:
        return self.t_pad + self.n_flushed

    @property
    def n_gen(self) -> int:
        return self.n_flushed + self.tail_len


def new_tail(cfg, b: int, block: int, dtype, store_activations: bool):
    k = jnp.zeros((b, cfg.num_kv_heads, block, cfg.head_dim), dtype)
    v = jnp.zeros_like(k)
    x = jnp.zeros((b, block, cfg.hidden_size), dtype) if store_activations else None
    return k, v, x


def flush_tail(sb: SubBatch, layer: int, store_activations: bool, block: int) -> None:
    """Copies layer's full tail to a new host segment (asynchronous) and gives the layer a fresh tail."""
    k, v, x = sb.tail_k[layer], sb.tail_v[layer], sb.tail_x[layer]
    start = sb.t_pad + sb.n_flushed
    hk, hv = M.to_host(k), M.to_host(v)
    hx = M.to_host(x) if store_activations else None
    sb.segs[layer].append(Segment(k=hk, v=hv, x=hx, n=block, start=start))
    sb.tail_k[layer] = jnp.zeros_like(k)
    sb.tail_v[layer] = jnp.zeros_like(v)
    sb.tail_x[layer] = jnp.zeros_like(x) if x is not None else None


def store_bytes(sb: SubBatch) -> int:
    tot = 0
    for segs in sb.segs:
        for s in segs:
            for a in (s.k, s.v, s.x):
                if a is not None:
                    tot += a.size * a.dtype.itemsize
    return tot
