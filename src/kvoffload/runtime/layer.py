"""The layer program: one decode layer as one jitted program (`layer_body`, `layer_step`), the new token's
K/V written into the GPU tail (`put_rows`), and the donated slots kept distinct (`distinct_arrays`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.models.common import attention_window
from kvoffload.models.transformer import family


def put_rows(tail, new, at, axis):
    """tail[r] with new[r] written at index at[r] along axis (of the per-row array)."""
    return jax.vmap(lambda t, n, i: jax.lax.dynamic_update_slice_in_dim(t, n, i, axis))(tail, new.astype(tail.dtype), at)


def layer_body(cfg, lp, h, positions, tail_k, tail_v, tail_x, tail_len, sources, tables, slots, slots_fixed, attend,
               options):
    """One decode layer (`layer_step`'s program): the new token's q/k/v (k/v and x written into the GPU tail at
    each request's tail_len), the policy's attention over its sources (`attend`, a pure function
    folding sources into an fp32 accumulator and updating the layer's slots), the tail folded last,
    output projection and MLP. slots_fixed: the slots' part the program never writes (`split_slots`), or None.
    Returns (h, tail_k, tail_v, tail_x, slots), slots without that part."""
    if slots_fixed is not None:
        slots = attend.join_slots(slots, slots_fixed)
    fam = family(cfg)
    # named scopes: a profile's kernels map to these parts (`kvoffload.profile`; the policy's attend names its
    # own parts inside "pool_attention")
    with jax.named_scope("qkv"):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        tail_k = put_rows(tail_k, k, tail_len, 1)
        tail_v = put_rows(tail_v, v, tail_len, 1)
        if tail_x is not None:
            tail_x = put_rows(tail_x, x, tail_len, 0)
        q = q[:, :, 0]
    recompute_impl, attention_impl = options
    window = attention_window(cfg, lp)
    if window is not None:  # a sliding layer: keys at positions > p - window (the pool's attention masks the rest)
        sources = sources.windowed(positions[:, 0] - window + 1)
    with jax.named_scope("pool_attention"):
        acc, slots = attend(cfg, lp, q, ops.empty_attention(q), sources, tables, slots, recompute_impl,
                            attention_impl)
    with jax.named_scope("tail_attention"):
        # tail slot j holds position p - tail_len + j (the new token at j = tail_len)
        tail_start = None if window is None else tail_len - window + 1
        o, _ = ops.merge_attention_into(acc, ops.decode_attention(q, tail_k, tail_v, tail_len + 1, start=tail_start,
                                                                  impl=attention_impl))
    with jax.named_scope("out_mlp"):
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o.astype(h.dtype)[:, :, None]))
    if slots_fixed is not None:
        slots = attend.split_slots(slots)[0]
    return h, tail_k, tail_v, tail_x, slots


# One decode layer, one program (`layer_body`): the tails and the slots are donated; the slots' fixed part is
# read only, and not returned: each output costs the host a few us a call (~2.3 us on a CPU); in one selective
# policy's layer 15 of 32 outputs were fixed (docs/ARCHITECTURE.md "Facts measured on the GPU").
layer_step = functools.partial(jax.jit, static_argnames=("cfg", "attend", "options"),
                               donate_argnames=("tail_k", "tail_v", "tail_x", "slots"))(layer_body)


@functools.lru_cache(maxsize=16)
def sliding_layers(cfg) -> tuple:
    """Per layer whether it attends a sliding window."""
    return tuple(cfg.layer_window(i) is not None for i in range(cfg.num_layers))


def distinct_arrays(tree):
    """tree with every array that appears more than once replaced by copies after its first appearance: the
    layer programs donate the slots, so two layers (or two fields) sharing one array would see it deleted."""
    seen = set()

    def one(a):
        if not isinstance(a, jax.Array):
            return a
        if id(a) in seen:
            return jnp.copy(a)
        seen.add(id(a))
        return a
    return jax.tree.map(one, tree)
