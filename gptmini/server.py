"""An OpenAI-compatible completions server over the engine (FastAPI and uvicorn).

Every HTTP request becomes engine requests (one per prompt and choice); one background
thread steps the engine whenever there is work, so concurrent clients share its batches.
Handlers only add requests and wait for their tokens, so a slow or vanished client never
holds up the others, and a client that disconnects mid-stream cancels its requests (their
blocks go back to the pool at the next step).

Endpoints: POST /v1/completions, GET /v1/models, GET /health. Chat completions are out of
scope: a base model has no chat template. Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters, malformed
JSON or a call asking more completions (prompts x n) than the server holds, 401 for a
missing or wrong key, 404 for an unknown model or path, 429 when too many completions are
in flight, 503 for the requests still running when a shutdown's drain time is over
(`drain`), 504 when a request outlives its timeout. The command line, `serve.py`, is
`gptmini.cli.serve_main`.
"""

import asyncio
import contextlib
import hmac
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gptmini.api import APIError, choice_seed, parse
from gptmini.engine import Engine, Request
from gptmini.sampling import SamplingParams

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["APIError", "EngineLoop", "choice_seed", "create_app", "drain", "parse"]

class EngineLoop:
    """Steps the engine on one background thread while it has work, and tells the event
    loop after each step (`on_step`), so handlers wake when their tokens are there."""

    def __init__(self, engine: Engine):
        self.engine, self._wake, self._stop = engine, threading.Event(), False
        self.error: BaseException | None = None
        self.on_step = lambda: None
        self._thread = threading.Thread(target=self._run, name="gptmini-engine", daemon=True)
        self._thread.start()

    def add(self, prompt: list[int], params: SamplingParams) -> Request:
        request = self.engine.add_request(prompt, params)
        self.wake()
        return request

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except BaseException as err:  # keep serving: fail the requests in flight
                self.error = err
                self.engine.abort("error")
            self.on_step()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


class Ticker:
    """An asyncio event set at every engine step: handlers await the next one."""

    def __init__(self):
        self._event = asyncio.Event()

    def tick(self) -> None:  # on the event loop, through call_soon_threadsafe
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def next(self, seconds: float) -> None:
        """Return at the next step, or after `seconds` at most."""
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), seconds)


@dataclass(eq=False)
class Job:
    """One /v1/completions call: its engine requests, choice by choice."""

    requests: list[Request]
    prompt_tokens: int
    stops: tuple[str, ...]
    streaming: bool = False  # its stream is being sent
    closed: bool = False  # answered, cancelled or timed out

    @property
    def in_flight(self) -> bool:
        return self.streaming or not (self.closed or all(r.done for r in self.requests))


def held_back(text: str, stops: tuple[str, ...], final: bool) -> int:
    """Characters at the end of `text` a stream must not send yet: the start of a stop
    string that the next tokens may complete. (The engine's text never ends in half a
    character: it keeps a character's bytes until it is whole.)"""
    if final:
        return 0
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
               default=0)


def drain(app: "FastAPI", seconds: float) -> None:
    """Begin a shutdown: the requests in flight go on for `seconds`, then each still running
    is answered 503 (a stream: an error event) instead of having its connection dropped."""
    app.state.drain_until = time.monotonic() + seconds


def overdue(app: "FastAPI", deadline: float, timeout: float) -> APIError | None:
    """The APIError that ends a request now: past the drain of a shutdown, or past its own
    `deadline` (--timeout); None while it may go on."""
    now = time.monotonic()
    if now > app.state.drain_until:
        return APIError(503, "the server is shutting down and its drain time (serve.py "
                        "--drain) is over; send the request again", kind="server_error")
    if now > deadline:
        return APIError(504, f"the request took longer than {timeout:g} s",
                        kind="timeout_error")
    return None


def create_app(engine: Engine, model_name: str = "gptmini", *, api_key: str | None = None,
               max_pending: int = 1024, timeout: float = 600.0):
    """The FastAPI application serving `engine` (which needs its tokenizer)."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    if engine.tokenizer is None:
        raise ValueError("the server needs the engine's tokenizer: Engine(model, tokenizer)")
    loop, jobs, enc, created = EngineLoop(engine), set(), engine.tokenizer, int(time.time())
    ticker = Ticker()

    @contextlib.asynccontextmanager
    async def lifespan(_):
        events = asyncio.get_running_loop()
        loop.on_step = lambda: events.call_soon_threadsafe(ticker.tick)
        yield
        loop.on_step = lambda: None
        loop.close()  # after uvicorn has drained the requests in flight

    app = FastAPI(title="gptmini", lifespan=lifespan)
    app.state.loop, app.state.drain_until = loop, math.inf

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, err: HTTPException):
        message = f"{request.method} {request.url.path}: {err.detail}"
        if request.url.path.endswith("/chat/completions"):
            message = ("chat completions are not served: a base model has no chat template; "
                       "POST /v1/completions with a prompt")
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(err.status_code, message, kind=kind).body(),
                            status_code=err.status_code, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        return JSONResponse(APIError(400, f"invalid request: {err.errors()[:1]}").body(),
                            status_code=400)

    def authorize(request: HTTPRequest) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 api_key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                           kind="authentication_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(engine.running), "waiting": len(engine.waiting),
                "free_blocks": engine.blocks.num_free}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "gptmini"}]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        authorize(request)
        try:
            body = json.loads(await request.body())
        except ClientDisconnect:  # hung up mid-body: nobody to answer, nothing to log
            return Response(status_code=499)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the body is not valid JSON: {err}") from None
        prompts, settings = parse(body, model_name)
        asked = len(prompts) * settings["n"]
        if asked > max_pending:
            raise APIError(400, f"this call asks for {asked} completions ({len(prompts)} "
                           f"prompts x n={settings['n']}), more than the {max_pending} the "
                           "server holds at once (serve.py --max_pending); split it into "
                           "smaller calls", "prompt")
        jobs.intersection_update([j for j in jobs if j.in_flight])
        pending = sum(not r.done for j in jobs for r in j.requests)
        if pending + asked > max_pending:
            raise APIError(429, f"the server is busy ({pending} completions in flight, "
                           f"{asked} more asked, the limit is {max_pending}); retry later",
                           kind="rate_limit_error")
        job = submit(prompts, settings)
        jobs.add(job)
        if settings["stream"]:
            return StreamingResponse(stream(job, settings), media_type="text/event-stream")
        await wait(job, request)
        return respond(job)

    def submit(prompts, settings) -> Job:
        requests, prompt_tokens = [], 0
        for p in prompts:
            ids = p if isinstance(p, list) else enc.encode(p, allowed_special="all")
            prompt_tokens += len(ids)
            for i in range(settings["n"]):
                seed = None if settings["seed"] is None else choice_seed(settings["seed"], i)
                try:
                    params = SamplingParams(
                        max_new_tokens=settings["max_new_tokens"],
                        temperature=settings["temperature"], top_k=settings["top_k"],
                        top_p=settings["top_p"], seed=seed, stop_ids=(enc.eot_token,),
                        stop=settings["stop"])
                    requests.append(loop.add(ids or [enc.eot_token], params))
                except (ValueError, TypeError) as err:
                    for r in requests:
                        engine.cancel(r)
                    # the settings name their field; the engine's other refusals are the prompt's
                    raise APIError(400, str(err), getattr(err, "field", "prompt")) from None
        return Job(requests, prompt_tokens, settings["stop"])

    async def wait(job: Job, request: HTTPRequest) -> None:
        deadline = time.monotonic() + timeout
        while not all(r.done for r in job.requests):
            if await request.is_disconnected():
                cancel(job)
                return  # (nobody reads the answer)
            if error := overdue(app, deadline, timeout):
                cancel(job)
                raise error
            await ticker.next(0.05)

    def cancel(job: Job) -> None:
        job.closed = True
        for r in job.requests:
            if not r.done:
                engine.cancel(r)
        loop.wake()

    def usage(job: Job) -> dict:
        completion = sum(len(r.tokens) for r in job.requests)
        return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
                "total_tokens": job.prompt_tokens + completion}

    def finish_reason(r: Request) -> str:
        return "length" if r.finish_reason == "length" else "stop"

    def respond(job: Job) -> dict:
        job.closed = True
        if any(r.finish_reason == "error" for r in job.requests):
            raise APIError(500, f"the engine failed: {loop.error}", kind="server_error")
        choices = [{"index": i, "text": r.text, "logprobs": None,
                    "finish_reason": finish_reason(r)} for i, r in enumerate(job.requests)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model_name, "choices": choices,
                "usage": usage(job)}

    async def stream(job: Job, settings: dict):
        ident, sent = f"cmpl-{uuid.uuid4().hex}", [0] * len(job.requests)
        reported = [False] * len(job.requests)

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(i: int, text: str, reason: str | None) -> str:
            return event({"id": ident, "object": "text_completion", "created": int(time.time()),
                          "model": model_name, "choices": [{"index": i, "text": text,
                          "logprobs": None, "finish_reason": reason}]})
        job.streaming = True
        try:
            deadline = time.monotonic() + timeout
            while not all(reported):
                for i, r in enumerate(job.requests):
                    if reported[i]:
                        continue
                    done, text = r.done, r.text
                    ready = len(text) - held_back(text, job.stops, done)
                    if ready > sent[i]:
                        yield chunk(i, text[sent[i]:ready], None)
                        sent[i] = ready
                    if done and r.finish_reason == "error":
                        yield event(APIError(500, f"the engine failed: {loop.error}",
                                             kind="server_error").body())
                        return
                    if done:
                        yield chunk(i, "", finish_reason(r))
                        reported[i] = True
                if error := overdue(app, deadline, timeout):  # (a disconnect cancels this)
                    yield event(error.body())
                    return
                if not all(reported):
                    await ticker.next(0.05)
            if settings["include_usage"]:
                yield event({"id": ident, "object": "text_completion",
                             "created": int(time.time()), "model": model_name, "choices": [],
                             "usage": usage(job)})
            yield "data: [DONE]\n\n"
        finally:
            cancel(job)  # a client gone mid-stream: its blocks go back at the next step
            job.streaming = False

    return app
