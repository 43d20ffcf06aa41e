"""How an evaluation runs its prompts: the prompt format (chat or plain), greedy generation in batches of equal
answer budgets through the engine (or a given generate_fn), and the selection-cache statistics read from the
policy's last state."""

from __future__ import annotations

import time
from typing import Callable

from kvoffload.policies import Policy, make_policy

from .parse import PolicySpec

__all__ = ["TEMPLATES", "resolve_chat", "template_name", "selection_stats", "generate_group", "engine_generate",
           "engine_logprobs"]


def engine_generate():
    from kvoffload.engine import generate

    return generate


def engine_logprobs():
    from kvoffload.engine import teacher_forced_logprobs

    return teacher_forced_logprobs


TEMPLATES = ("auto", "chat", "plain")


def resolve_chat(tok, template: str | bool | None):
    """The prompt format: ``chat`` wraps each prompt in the model's chat template (an error where it has none),
    ``plain`` is the task's own template with its answer prefix (as for base models), ``auto`` chat where the
    tokenizer has a template. The older spellings on / off / True / False / None are accepted."""
    from .ruler import ChatWrapper

    modes = {"auto": None, "chat": True, "plain": False, "on": True, "off": False, None: None, True: True,
             False: False}
    if isinstance(template, str) and template not in modes or not isinstance(template, (str, bool, type(None))):
        raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    return ChatWrapper.from_tokenizer(tok, modes[template])


def template_name(chat) -> str:
    """The prompt format a run used, as its records and summaries name it: chat or plain."""
    return "chat" if chat.enabled else "plain"


def selection_stats(described: dict) -> dict | None:
    """The selection-cache reuse in a policy's ``describe(state)`` (clo, tokenselect), in short; None for a
    policy that reports none. ``hit_rate``: the fraction of (step, layer, KV head) looks that reused the
    cached selection, over the run's decode steps; ``hit_rate_per_layer``; ``hit_rate_cached_heads`` (clo:
    without its persistent heads); ``guess_hit_rate`` (clo with speculative prefetch: the fraction of the
    fresh selections' rows its guesses had fetched); ``bytes_fetched_per_step`` (K and V rows gathered
    from the host, per decode step, where the policy counts them). Rates are None when nothing was decoded
    past the prefill (no selection ran)."""
    sel = next((v for v in described.values() if isinstance(v, dict) and "hit_rate" in v), None)
    if sel is None:
        return None
    steps = int(described.get("last_step", {}).get("step", -1)) + 1  # the decode steps the state went through
    out = {"decode_steps": steps, "hit_rate": sel["hit_rate"] if steps else None,
           "hit_rate_per_layer": sel["hit_rate_per_layer"] if steps else None}
    if "hit_rate_cached_heads" in sel:
        out["hit_rate_cached_heads"] = sel["hit_rate_cached_heads"] if steps else None
    if "speculative_prefetch" in sel:
        out["guess_hit_rate"] = sel["speculative_prefetch"]["guess_hit_rate"]
    fetched = [sel[k] for k in ("v_bytes_fetched", "k_bytes_fetched") if k in sel]
    if fetched:
        out["bytes_fetched_per_step"] = sum(fetched) / steps if steps else None
    return out


class _KeepsLastState(Policy):
    """A built policy that keeps the state its last prefill or decode step returned, so that what the run
    did (``describe(state)``: selection-cache hits, bytes fetched) can be read after ``generate`` returns.
    Everything else (``extrapolates``, ``release``, ...) is the policy's own."""

    def __init__(self, policy: Policy):
        self.policy, self.name, self.state = policy, policy.name, None

    def __getattr__(self, attr):
        if attr == "policy":  # not set yet: no recursion
            raise AttributeError(attr)
        return getattr(self.policy, attr)

    def prefill(self, model, tokens, lengths, capacity):
        logits, self.state = self.policy.prefill(model, tokens, lengths, capacity)
        return logits, self.state

    def decode_step(self, model, state, tokens):
        logits, self.state = self.policy.decode_step(model, state, tokens)
        return logits, self.state

    def describe(self, state=None) -> dict:
        return self.policy.describe(state)

    def selection_stats(self) -> dict | None:
        """:func:`selection_stats` of the last run; lets its state (the KV cache) go."""
        state, self.state = self.state, None
        return None if state is None else selection_stats(self.policy.describe(state))


def generate_group(model, items: list[dict], spec: PolicySpec, generate_fn, batch_size: int,
                    on_done: Callable[[dict, list[int], float, dict], None]):
    """Greedy generation for items (dicts with prompt_ids, max_new_tokens), batched by max_new_tokens (items of
    equal budgets grouped, in their order). on_done(item, new_ids, seconds, extra): extra holds the batch's
    ``selection`` statistics (the same for every item of the batch; :func:`selection_stats`) where the policy
    reports them."""
    budgets = list(dict.fromkeys(it["max_new_tokens"] for it in items))
    items = sorted(items, key=lambda it: budgets.index(it["max_new_tokens"]))
    i = 0
    while i < len(items):
        batch = [items[i]]
        while (len(batch) < batch_size and i + len(batch) < len(items)
               and items[i + len(batch)]["max_new_tokens"] == batch[0]["max_new_tokens"]):
            batch.append(items[i + len(batch)])
        # built here, as generate would from the name, and kept, to read its state after the run
        pol = _KeepsLastState(make_policy(spec.name, **spec.options_dict))
        t0 = time.time()
        outs = generate_fn(model, [b["prompt_ids"] for b in batch], batch[0]["max_new_tokens"], policy=pol,
                           temperature=0.0, stop_on_eos=True)
        dt = (time.time() - t0) / len(batch)
        stats = pol.selection_stats()
        extra = {"selection": stats} if stats else {}
        for b, o in zip(batch, outs):
            on_done(b, [int(t) for t in o], dt, extra)
        i += len(batch)
