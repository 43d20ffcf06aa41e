"""Tensor-parallel cases run in a fresh process with several (virtual CPU) devices: each case generates
with a policy on an N-way mesh and with `full` on one device (an int4 case: the same policy on one device), and prints one JSON line per case (tokens
equal, largest logit difference, where the pool and tails live, compilations after the warm-up).

Not a test module: tests/test_tensor_parallel.py launches it with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (set before jax starts), or under jax.distributed
(--process-id/--num-processes/--coordinator: one CPU device per process)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

PROMPTS = [list(range(1, 30)), list(range(40, 51)), list(range(60, 100))]
NEW = 10
BASE = dict(block_tokens=4, extent_mb=3 * 4 * 2 * 16 * 4 / 2**20)  # 3-block extents of the tiny models
# GQA llama for the 4-way mesh: 8 query heads, 4 KV heads (the default tiny llama has 2 KV heads)
MODELS = {"opt": dict(), "llama": dict(num_attention_heads=8, num_key_value_heads=4)}
APPROXIMATE = ("clo", "tokenselect")  # policies whose reference is their own single-device run


def model_of(arch):
    from kvoffload.models import tiny_random_model

    return tiny_random_model(arch, seed=1, **MODELS[arch])


def run_case(case, refs):
    import numpy as np

    from kvoffload.compile_count import count_compilations
    from kvoffload.engine import generate
    from kvoffload.errors import KVOffloadError
    from kvoffload.policies import make_policy

    arch, policy, n, opts = case["arch"], case["policy"], case["tp"], case.get("opts", {})
    model = model_of(arch)
    # the reference: `full` on one device; a lossy store (int4) or an approximate policy (a top-k selection:
    # clo, tokenselect) is compared with itself on one device
    lossy = opts.get("host_dtype", "native") != "native" or policy in APPROXIMATE
    key = (arch, policy, json.dumps(opts, sort_keys=True)) if lossy else arch
    if key not in refs:
        refs[key] = generate(model, PROMPTS, NEW, policy=policy if lossy else "full",
                             policy_options={**BASE, **opts} if lossy else BASE, return_logits=True)
    want, want_logits = refs[key]
    out = dict(case=case)
    try:
        pol = make_policy(policy, **{**BASE, **opts, "tensor_parallel": n})
        seen = {}

        class Spy:  # records where the state lives after the first step and counts later compilations
            name = policy

            def prefill(self, *a):
                return pol.prefill(*a)

            def decode_step(self, model, state, tokens):
                logits, state = pol.decode_step(model, state, tokens)
                seen["steps"] = seen.get("steps", 0) + 1
                if seen["steps"] == 2:
                    gr = state.groups[0]
                    specs = lambda t: sorted({str(getattr(a.sharding, "spec", None)) + "@" + str(a.sharding.memory_kind)  # noqa: E731
                                              for a in jax.tree.leaves(t)})
                    seen.update(pool_k=specs(gr.pool_k), pool_x=specs(gr.pool_x), tail_k=specs(gr.tail_k),
                                tail_x=specs(gr.tail_x), logits=specs(logits))
                    seen.update(pool_v=specs(gr.pool_v), slots=specs(gr.slots))
                    seen["compiles_at_2"] = counter.count
                # what the policy says of the last step (kvpr on a mesh: the all-gather of X it predicts)
                seen["describe"] = {k: v for k, v in pol.describe(state).items() if k in ("tensor_parallel", "last_step")}
                if policy in APPROXIMATE:  # selection-cache hits so far (per request and KV head)
                    d = pol.describe(state)
                    seen["hit_rate"] = (d.get("clo") or d["selection"])["hit_rate"]
                return logits, state

        import jax

        from kvoffload.policies.base import Policy

        spy = type("SpyPolicy", (Policy,), dict(Spy.__dict__))()
        with count_compilations() as counter:
            got, logits = generate(model, PROMPTS, NEW, policy=spy, return_logits=True)
        out.update(tokens_equal=got == want, max_abs=float(np.abs(logits - want_logits).max()),
                   later_compiles=counter.names[seen["compiles_at_2"]:], tokens=got,
                   **{k: v for k, v in seen.items() if k not in ("steps", "compiles_at_2")})
    except KVOffloadError as e:
        out.update(error=type(e).__name__, message=str(e))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", help="JSON list of {arch, policy, tp, opts}")
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--coordinator")
    args = ap.parse_args()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    refs = {}
    for case in json.loads(args.cases):
        print("CASE " + json.dumps(run_case(case, refs)), flush=True)


if __name__ == "__main__":
    main()
