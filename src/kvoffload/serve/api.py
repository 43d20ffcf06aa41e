"""An OpenAI-compatible HTTP API over the scheduler: /v1/completions, /v1/chat/completions (stream: true as
server-sent events), /v1/models, /health.

One background thread steps the scheduler; handlers submit requests and await their tokens, which the thread
hands over through each request's asyncio queue. A bad request gets a 4xx with one message (OpenAI's error
shape) and the server goes on; a client that goes away mid-request cancels it, which frees its slot and
blocks at the next step. FastAPI is imported when the app is built, so the rest of the package does not need it
(and annotations stay evaluated: FastAPI reads the handlers' parameter types).
"""


import asyncio
import json
import logging
import secrets
import threading
import time
import uuid

from kvoffload.errors import KVOffloadError, ServeError
from kvoffload.serve.sampling import SamplingParams
from kvoffload.serve.scheduler import Request, Scheduler

log = logging.getLogger("kvoffload.serve")


class EngineThread:
    """Steps the scheduler on one thread while there is work; sleeps on its wake event otherwise."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvoffload-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.scheduler.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        s = self.scheduler
        while not self._stop.is_set():
            if not s.has_work():
                s.wake.wait(0.05)
                s.wake.clear()
                continue
            try:
                s.step()
            except Exception as e:  # a fault in a step: end every request with it, keep serving
                log.exception("a scheduler step failed")
                self.error = e
                s.fail_all("error")


def _error(status: int, message: str, param: str | None = None, code: str | None = None):
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _render_chat(tokenizer, messages) -> str:
    """The model's chat template; a plain 'role: content' transcript for a model without one."""
    if not isinstance(messages, list) or not messages:
        raise ServeError("messages must be a non-empty list of {role, content} objects")
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ServeError(f"messages[{i}] must be an object with role system, user, assistant or developer")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text ones only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ServeError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ServeError(f"messages[{i}].content must be a string or a list of text parts")
        norm.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    rendered = tokenizer.apply_chat_template(norm)
    if rendered is None:
        rendered = "".join(f"{m['role']}: {m['content']}\n" for m in norm) + "assistant:"
    return rendered


def _sampling(body: dict, chat: bool) -> SamplingParams:
    for bad, why in (("n", "only n=1 is supported"), ("best_of", "only best_of=1 is supported")):
        if body.get(bad) not in (None, 1):
            raise ServeError(f"{bad}={body[bad]!r}: {why}")
    for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "logit_bias"):
        if body.get(unsupported) not in (None, False, [], {}):
            raise ServeError(f"{unsupported} is not supported by this server")
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    seed = body.get("seed")
    return SamplingParams(
        max_tokens=16 if max_tokens is None else max_tokens,
        temperature=1.0 if body.get("temperature") is None else body["temperature"],
        top_p=1.0 if body.get("top_p") is None else body["top_p"],
        top_k=0 if body.get("top_k") in (None, -1) else body["top_k"],
        seed=secrets.randbelow(2**32) if seed is None else seed,  # no seed: a fresh draw, as OpenAI's API
        stop=[] if body.get("stop") is None else body["stop"],
        stop_token_ids=body.get("stop_token_ids") or [],
        ignore_eos=bool(body.get("ignore_eos", False)))


def build_app(model, scheduler: Scheduler, model_name: str, engine: EngineThread | None = None):
    """The FastAPI app serving `model` as `model_name`; its lifespan starts and stops the engine thread."""
    import contextlib

    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import StreamingResponse

    engine = engine or EngineThread(scheduler)
    tok = model.tokenizer
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kvoffload", lifespan=lifespan)
    app.state.scheduler, app.state.engine = scheduler, engine

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "running": sum(r is not None for r in scheduler.running),
                "waiting": len(scheduler.waiting), "free_blocks": scheduler.alloc.available(),
                "finished": dict(scheduler.finished)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kvoffload", "max_model_len": scheduler.max_seq_len}]}

    async def parse(http: HTTPRequest) -> dict:
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ServeError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ServeError("the request body must be a JSON object")
        if body.get("model") != model_name:
            raise ServeError(f"model {body.get('model')!r} is not served here; this server serves {model_name!r} "
                             "(GET /v1/models)", limit="model_not_found", status=404)
        if not isinstance(body.get("stream", False), bool):
            raise ServeError(f"stream must be true or false, got {body['stream']!r}")
        return body

    def prompt_ids(body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            return tok.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        raise ServeError("prompt must be a string, a list of one string, or a non-empty list of token ids",
                         limit="prompt")

    async def run(http: HTTPRequest, chat: bool):
        try:
            body = await parse(http)
            if chat:
                ids = tok.encode(_render_chat(tok, body.get("messages")), add_special_tokens=False)
            else:
                ids = prompt_ids(body)
            params = _sampling(body, chat)
            loop, queue = asyncio.get_running_loop(), asyncio.Queue()

            def hand_over(_, delta, finished):  # on the engine thread
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (delta, finished))
                except RuntimeError:  # the loop is gone (server shutting down): nobody to hand over to
                    pass

            req = Request(ids, params, on_update=hand_over)
            scheduler.submit(req)
        except KVOffloadError as e:  # ServeError, and the tokenizer's refusal of undecodable text
            return _error(getattr(e, "status", 400), str(e), code=getattr(e, "limit", None))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if chat else "text_completion"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if body.get("stream") else True

        def usage():
            m = req.metrics()
            return {"prompt_tokens": len(ids), "completion_tokens": len(req.output),
                    "total_tokens": len(ids) + len(req.output),
                    "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
                    "metrics": {k: v for k, v in m.items() if k.endswith("_s")}}

        def finish_reason():
            return {"length": "length", "stop": "stop"}.get(req.finish_reason, req.finish_reason)

        if body.get("stream"):
            async def events():
                finished = False
                try:
                    if chat:
                        yield _sse(rid, obj + ".chunk", created, model_name,
                                   [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}])
                    while not finished:
                        delta, finished = await queue.get()
                        if delta or finished:
                            piece = {"delta": {"content": delta} if delta else {}} if chat else {"text": delta}
                            yield _sse(rid, obj + ".chunk" if chat else obj, created, model_name,
                                       [{"index": 0, **piece, "finish_reason": finish_reason() if finished else None,
                                         **({} if chat else {"logprobs": None})}])
                    if include_usage:
                        yield _sse(rid, obj + ".chunk" if chat else obj, created, model_name, [], usage())
                    yield "data: [DONE]\n\n"
                finally:
                    if not finished:  # the client went away: free its slot and blocks
                        scheduler.cancel(req)

            return StreamingResponse(events(), media_type="text/event-stream")

        finished = False
        try:
            while not finished:
                try:
                    _, finished = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return None
        finally:
            if not finished:
                scheduler.cancel(req)
        if req.finish_reason == "error":
            return _error(500, f"the engine failed while generating: {engine.error!r}")
        choice = ({"index": 0, "message": {"role": "assistant", "content": req.text}} if chat else
                  {"index": 0, "text": req.text, "logprobs": None})
        return {"id": rid, "object": obj, "created": created, "model": model_name,
                "choices": [{**choice, "finish_reason": finish_reason()}], "usage": usage()}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await run(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await run(http, chat=True)

    return app


def _sse(rid, obj, created, model, choices, usage=None) -> str:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return f"data: {json.dumps(out)}\n\n"


def serve(model, model_name: str, host: str = "127.0.0.1", port: int = 8000, kv_cache_gb: float = 1.0,
          prefix_cache_gb: float | None = None, **scheduler_args) -> None:
    """Builds the scheduler (its cache sized from kv_cache_gb; prefix_cache_gb of it may hold unreferenced
    prefix blocks, default all of it) and the app, and runs uvicorn until interrupted."""
    import uvicorn

    scheduler = Scheduler(model, **scheduler_args, **cache_blocks(model, scheduler_args.get("policy_options"),
                                                                  kv_cache_gb, prefix_cache_gb))
    log.warning("serving %s on http://%s:%d: %d cache blocks of %d tokens, batch %d", model_name, host, port,
                scheduler.alloc.num_blocks, scheduler.blk, scheduler.slots)
    uvicorn.run(build_app(model, scheduler, model_name), host=host, port=port, log_level="info")


def cache_blocks(model, policy_options, kv_cache_gb: float, prefix_cache_gb: float | None) -> dict:
    """num_blocks and prefix_cache_blocks for byte budgets in GiB."""
    from kvoffload.serve.cache import block_bytes, kv_dtype

    blk = int((policy_options or {}).get("block_tokens", 16))
    per = block_bytes(model.config, kv_dtype(model), blk)
    n = int(kv_cache_gb * 2**30 // per)
    if n < 1:
        raise ServeError(f"--kv-cache-gb {kv_cache_gb} holds no block ({per} bytes each)", limit="kv_cache_gb")
    cached = n if prefix_cache_gb is None else int(prefix_cache_gb * 2**30 // per)
    return {"num_blocks": n, "prefix_cache_blocks": min(cached, n)}
