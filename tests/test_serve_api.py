"""The HTTP server (serve/api.py) driven by the official openai client against uvicorn on a free port: plain and
streamed completions and chat give the scheduler's tokens; 16 concurrent requests each get their own; a client
that disconnects mid-stream frees its request; bad input gets a 4xx naming the problem and the server stays up."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from kvoffload.models import tiny_random_model  # noqa: E402
from kvoffload.serve.api import _render_chat, build_app  # noqa: E402
from kvoffload.serve.sampling import SamplingParams  # noqa: E402
from kvoffload.serve.scheduler import Request, Scheduler  # noqa: E402

NAME, BATCH, BLOCKS = "tiny", 4, 16  # 16 concurrent requests queue for the 4 slots


@pytest.fixture(scope="module")
def server():
    model = tiny_random_model()
    scheduler = Scheduler(model, max_batch=BATCH, num_blocks=BLOCKS, max_seq_len=256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(model, scheduler, NAME), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    yield model, scheduler, base, client
    srv.should_exit = True
    thread.join(timeout=30)


def _direct(model, ids, n):
    """The tokens the scheduler gives alone (the same programs the server runs)."""
    s = Scheduler(model, max_batch=BATCH, num_blocks=BLOCKS, max_seq_len=256)
    r = s.submit(Request(ids, SamplingParams(max_tokens=n)))
    s.run_until_done()
    return r


def _idle(scheduler, base):
    for _ in range(200):
        h = httpx.get(base + "/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the server did not go idle: {h}")


def test_completions_plain_and_streamed(server):
    model, scheduler, base, client = server
    assert [m.id for m in client.models.list().data] == [NAME]
    prompt = "The capital of France is"
    want = _direct(model, model.tokenizer.encode(prompt), 12)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
    assert out.usage.completion_tokens == len(want.output)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 16  # the first request's full block
    assert again.choices[0].text == want.text
    pieces = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == want.text
    assert pieces[-1].usage.completion_tokens == len(want.output)
    _idle(scheduler, base)


def test_chat_plain_and_streamed(server):
    model, scheduler, base, client = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = model.tokenizer.encode(_render_chat(model.tokenizer, messages), add_special_tokens=False)
    want = _direct(model, ids, 10)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == want.text and out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_sixteen_concurrent_requests_each_get_their_own_tokens(server):
    model, scheduler, base, client = server
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(5, 30, 16)]
    want = []
    s = Scheduler(model, max_batch=BATCH, num_blocks=BLOCKS, max_seq_len=256)
    for p in prompts:
        want.append(s.submit(Request(p, SamplingParams(max_tokens=16, ignore_eos=True))))
    s.run_until_done()

    def one(i):
        kw = dict(model=NAME, prompt=prompts[i], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        return client.completions.create(**kw).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [w.text for w in want]
    h = _idle(scheduler, base)
    assert h["free_blocks"] == BLOCKS
    scheduler.alloc.check()


def test_a_client_that_disconnects_frees_its_request(server):
    model, scheduler, base, client = server
    before = scheduler.finished["cancelled"]
    body = {"model": NAME, "prompt": "x" * 20, "max_tokens": 230, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one event, then hang up
    h = _idle(scheduler, base)
    assert h["free_blocks"] == BLOCKS and scheduler.finished["cancelled"] == before + 1
    scheduler.alloc.check()


@pytest.mark.parametrize("body, status, match", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' is not served here"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 1000}, 400, "context length is 256"),
    ({"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "n": 3}, 400, "n=3"),
    ({"model": NAME, "prompt": 5}, 400, "prompt must be"),
    ({"model": NAME, "prompt": [1, 99999]}, 400, "vocabulary"),
    ({"model": NAME, "prompt": "hi", "stream": "yes"}, 400, "stream must be"),
])
def test_bad_input_gets_a_4xx_and_the_server_stays_up(server, body, status, match):
    model, scheduler, base, client = server
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status and match in r.json()["error"]["message"], r.text
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_bad_chat_input_through_the_client(server):
    model, scheduler, base, client = server
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], temperature=-3)


def test_a_failing_step_ends_its_requests_with_a_500_and_the_server_goes_on(server):
    model, scheduler, base, client = server
    real = scheduler.step

    def broken():
        scheduler.step = real  # fails once
        raise RuntimeError("injected fault")

    scheduler.step = broken
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        client.completions.create(model=NAME, prompt="hello", max_tokens=4, temperature=0)
    assert scheduler.step == real
    out = client.completions.create(model=NAME, prompt="hello", max_tokens=4, temperature=0)
    assert out.choices[0].text == _direct(model, model.tokenizer.encode("hello"), 4).text
    assert _idle(scheduler, base)["free_blocks"] == BLOCKS
