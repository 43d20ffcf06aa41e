"""The continuous-batching scheduler (serve/scheduler.py) on the tiny random model: the greedy tokens of
requests arriving at different steps equal each request's own `generate`; prefix reuse gives the tokens of
no reuse; requests that do not fit wait, ones that never fit are refused naming the limit; cancelled ones
free what they held; other policies are refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.engine import generate
from kvoffload.errors import ServeError
from kvoffload.models import tiny_random_model
from kvoffload.serve.sampling import SamplingParams
from kvoffload.serve.scheduler import Request, Scheduler

N_BLOCKS, BATCH, SEQ = 24, 3, 256  # one shape for every scheduler here: its programs compile once


@pytest.fixture(scope="module")
def model():
    return tiny_random_model()


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def _ref(model, prompt, n):
    return generate(model, [prompt], n, policy="full", stop_on_eos=False)[0]


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _scheduler(model, **kw):
    return Scheduler(model, max_batch=BATCH, num_blocks=N_BLOCKS, max_seq_len=SEQ, **kw)


def test_arrivals_at_different_steps_match_generate(model):
    prompts = _prompts([5, 17, 33, 40, 16])
    arrive = [0, 0, 2, 3, 7]  # more requests than slots: the last ones wait for a slot
    s = _scheduler(model)
    reqs = []
    for step in range(40):
        for p, a in zip(prompts, arrive):
            if a == step:
                reqs.append(s.submit(Request(p, _greedy(10))))
        s.step()
        assert sum(r is not None for r in s.running) <= BATCH
        s.alloc.check([r.blocks for r in s.running if r is not None])
    s.run_until_done()
    for p, r in zip(prompts, reqs):
        assert r.output == _ref(model, p, 10) and r.finish_reason == "length"
        m = r.metrics()
        assert m["completion_tokens"] == 10 and m["time_to_first_token_s"] >= 0 and m["tokens_per_s"] > 0
    s.alloc.check()
    assert s.alloc.available() == N_BLOCKS


def test_prefix_reuse_gives_the_tokens_of_no_reuse(model):
    shared = _prompts([48], seed=1)[0]
    tails = _prompts([7, 12], seed=2)
    prompts = [shared + tails[0], shared + tails[1], shared]  # the last: wholly cached but its last block
    with_cache, without = _scheduler(model), _scheduler(model, prefix_cache_blocks=0)
    for s in (with_cache, without):
        outs = []
        for p in prompts:  # one after the other, so the second finds the first's blocks
            outs.append(s.submit(Request(p, _greedy(8))))
            s.run_until_done()
        s.alloc.check()
        s.outs = outs
    assert [r.cached_tokens for r in with_cache.outs] == [0, 48, 32]
    assert [r.cached_tokens for r in without.outs] == [0, 0, 0]
    for a, b, p in zip(with_cache.outs, without.outs, prompts):
        assert a.output == b.output == _ref(model, p, 8)
    assert with_cache.alloc.hits > 0


def test_requests_wait_for_memory_and_never_fitting_ones_are_refused(model):
    prompts = _prompts([40, 50, 60, 30], seed=3)
    s = _scheduler(model)  # each request reserves (len + 100 - 1) // 16 = 8 or 9 of 24 blocks: two run at once
    reqs = [s.submit(Request(p, _greedy(100))) for p in prompts]
    most, waited_with_free_slot = 0, False
    while s.has_work():
        s.step()
        n = sum(r is not None for r in s.running)
        most = max(most, n)
        waited_with_free_slot |= bool(s.waiting) and n < BATCH
        s.alloc.check([r.blocks for r in s.running if r is not None])
    assert most == 2 and waited_with_free_slot
    for p, r in zip(prompts, reqs):
        assert len(r.output) == 100 and r.output[:10] == _ref(model, p, 10)
    assert s.alloc.available() == N_BLOCKS
    with pytest.raises(ServeError, match="context length is 256") as e:
        s.submit(Request(prompts[0], _greedy(SEQ)))
    assert e.value.limit == "context_length"
    small = Scheduler(model, max_batch=BATCH, num_blocks=4, max_seq_len=SEQ)
    with pytest.raises(ServeError, match="needs 8 cache blocks .* holds 4") as e:
        small.submit(Request(prompts[3], _greedy(100)))
    assert e.value.limit == "kv_cache_blocks" and not small.has_work()


def test_cancel_frees_the_request(model):
    s = _scheduler(model)
    r = s.submit(Request(_prompts([20])[0], _greedy(50)))
    waiting = s.submit(Request(_prompts([20])[0], _greedy(50)))
    s.cancel(waiting)  # cancelled before it ran
    for _ in range(3):
        s.step()
    assert r.slot >= 0 and waiting.finish_reason == "cancelled"
    s.cancel(r)
    s.step()
    assert r.finish_reason == "cancelled" and not s.has_work()
    s.alloc.check()
    assert s.alloc.available() == N_BLOCKS


def test_sampling_is_per_request_and_validated(model):
    p1, p2 = _prompts([10, 30], seed=4)
    hot = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    s = _scheduler(model)
    alone = s.submit(Request(p1, hot))
    s.run_until_done()
    together = s.submit(Request(p1, hot))  # now beside a greedy neighbour: the same tokens
    greedy = s.submit(Request(p2, _greedy(8)))
    s.run_until_done()
    assert together.output == alone.output and greedy.output == _ref(model, p2, 8)
    stop_at = greedy.output[3]
    stopped = s.submit(Request(p2, SamplingParams(max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True)))
    s.run_until_done()
    assert stopped.output == greedy.output[:greedy.output.index(stop_at) + 1] and stopped.finish_reason == "stop"
    for bad, match in ((dict(temperature=-1.0), "temperature"), (dict(top_p=1.5), "top_p"),
                       (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop")):
        with pytest.raises(ServeError, match=match):
            s.submit(Request(p1, SamplingParams(**bad)))
    with pytest.raises(ServeError, match="empty"):
        s.submit(Request([], _greedy(4)))
    with pytest.raises(ServeError, match="vocabulary"):
        s.submit(Request([1, 999], _greedy(4)))


@pytest.mark.parametrize("policy", ["offload", "kvpr", "hybrid", "clo", "tokenselect"])
def test_other_policies_are_refused_with_the_reason(model, policy):
    with pytest.raises(ServeError, match=f"policy '{policy}' cannot run under the serving scheduler: it .*batch"):
        Scheduler(model, policy)


def test_options_are_checked(model):
    with pytest.raises(ServeError, match="split_point .*do not apply"):
        Scheduler(model, "full", {"split_point": 0})
    with pytest.raises(ServeError, match="block_tokens must be a power of two"):
        Scheduler(model, "full", {"block_tokens": 24})


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "opt"])
def test_sliding_window_and_learned_positions_match_generate(arch):
    """gemma3 (every other layer sliding, window 16: decode drops whole blocks before the window) and OPT
    (learned positions: a prefix-reusing prefill starts past position 0) give generate's tokens."""
    m = tiny_random_model(arch)
    prompts = _prompts([5, 40, 20], seed=5)
    prompts.append(prompts[1] + [3, 4])  # reuses the second one's two full blocks
    s = _scheduler(m)
    reqs = []
    for p in prompts:
        reqs.append(s.submit(Request(p, _greedy(30))))
        s.run_until_done()
    assert reqs[-1].cached_tokens == 32
    for p, r in zip(prompts, reqs):
        assert r.output == _ref(m, p, 30)


def test_serve_command_refuses_before_loading_the_model(capsys):
    from kvoffload.cli import main

    assert main(["serve", "--policy", "clo"]) == 2
    err = capsys.readouterr().err
    assert "policy 'clo' cannot run under the serving scheduler" in err and len(err.strip().splitlines()) == 1
    assert main(["serve", "--policy-option", "block_tokens=3"]) == 2
    assert "block_tokens must be a power of two" in capsys.readouterr().err
    assert main(["serve", "--kv-cache-gb", "0"]) == 2
    assert "--kv-cache-gb must be" in capsys.readouterr().err
