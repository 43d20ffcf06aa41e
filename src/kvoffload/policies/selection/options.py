"""The options the selective policies share (`tokenselect`, `clo`: the same meaning in both) and their checks:
sinks and recent tokens, the store, the replay, conditionals, the top-k method (`SELECTION_WINDOW_OPTIONS`,
`SELECTION_RUN_OPTIONS`, `check_store`, `check_topk_method`); the budget, a count or a ratio of the context
(`selection_budget`), and the tokens it selects per request inside the layer program (`selection_size`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.policies.options import Option, PolicyOptionError


STORES = ("kv", "act", "auto")

# options tokenselect and clo share (their meaning is the same in both)
SELECTION_WINDOW_OPTIONS = (
    Option("num_sink", "int", "first tokens always attended", low=0),
    Option("num_recent", "int", "most recent tokens always attended", low=0),
)
SELECTION_RUN_OPTIONS = (
    Option("store", "choice", "kv: K/V (V) rows in the host pool; act: activations, the selected K/V recomputed; "
           "auto: per layer by the cost model", choices=STORES),
    Option("replay_hit_rate", "floats", "replay this reuse rate (one number, or one per layer) instead of the rule",
           low=0, high=1),
    Option("conditionals", "bool", "skip a layer's selection work under lax.cond when every head reuses; "
           "none: only off the GPU"),
    Option("topk_method", "choice", "the top-k implementation", choices=ops.TOPK_METHODS),
)


def check_store(store, error):
    """store=kv|act|auto, or one clear error (tokenselect, clo)."""
    if store not in STORES:
        raise error(f"store must be one of {STORES} (kv: K/V (V) rows in the host pool; act: activations X, the "
                    f"selected tokens' K/V recomputed on the GPU; auto: per layer by the cost model), got {store!r}")


def selection_budget(budget, ratio, num_sink, num_recent, *, default_budget=None, default_ratio=None,
                     names=("token_budget", "token_ratio"), error=PolicyOptionError, token_min=0,
                     min_name="token_min"):
    """A selection policy's checked (budget, ratio, num_sink, num_recent, token_min): a token count or a ratio of
    the context (not both; the default when neither is given), sinks and recent tokens >= 0, a count that holds
    them, and with a ratio the fewest tokens to select (token_min >= 0; a ratio of a short context is a handful
    of tokens). names / min_name / error: how the policy calls the options and what it raises (tokenselect,
    clo)."""
    b_name, r_name = names
    if isinstance(token_min, bool) or not isinstance(token_min, (int, np.integer)) or token_min < 0:
        raise error(f"{min_name} must be a whole number of tokens >= 0, got {token_min!r}")
    token_min = int(token_min)
    if budget is not None and ratio is not None:
        raise error(f"give {b_name} (tokens) or {r_name} (of the context), not both")
    if budget is None and ratio is None:
        budget, ratio = default_budget, default_ratio
    num_sink, num_recent = int(num_sink), int(num_recent)
    if num_sink < 0 or num_recent < 0:
        raise error(f"num_sink and num_recent must be >= 0, got {num_sink}, {num_recent}")
    if budget is not None:
        budget = int(budget)
        if budget < max(1, num_sink + num_recent):
            raise error(f"{b_name} ({budget}) must be at least num_sink + num_recent ({num_sink} + {num_recent}) "
                        f"and >= 1")
        if token_min:
            raise error(f"{min_name} is the floor of a {r_name} selection; with {b_name} (a fixed count) leave it out")
    else:
        ratio = float(ratio)
        if not 0 < ratio <= 1:
            raise error(f"{r_name} must be in (0, 1], got {ratio}")
    return budget, ratio, num_sink, num_recent, token_min


def check_topk_method(method, error):
    if method not in ops.TOPK_METHODS:
        raise error(f"topk_method must be one of {ops.TOPK_METHODS}, got {method!r}")


def selection_size(token_budget, token_ratio, num_sink, num_recent, page_size, K, context, token_min=0):
    """[B] int32: the tokens to select per request: token_budget (then K, the slots' static size), or
    token_ratio of the request's context (at least num_sink + num_recent and token_min), in whole pages,
    capped by K."""
    if token_budget is not None:
        want = jnp.full(context.shape, K, jnp.int32)
    else:
        want = jnp.ceil(token_ratio * context.astype(jnp.float32)).astype(jnp.int32)
        want = jnp.maximum(want, max(num_sink + num_recent, token_min))
    return jnp.minimum(-(-want // page_size) * page_size, K)
