"""An OpenAI-compatible completions server over the engine (FastAPI and uvicorn).

Every HTTP request becomes engine requests (one per prompt and choice); one background
thread steps the engine whenever there is work, so concurrent clients share its batches.
Handlers only add requests and wait for their tokens, so a slow or vanished client never
holds up the others, and a client that disconnects mid-stream cancels its requests (their
blocks go back to the pool at the next step).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health.
A chat's messages are rendered by the model's chat template (`gptmini.finetune.chat`: the
one its checkpoint or model directory carries, gptmini's own when the tokenizer has its
tokens, else the book's instruction prompt, which any pretrained model can continue) and
the reply stops at the template's stop tokens. Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters, malformed
JSON or a call asking more completions (prompts x n) than the server holds, 401 for a
missing or wrong key, 404 for an unknown model or path, 429 when too many completions are
in flight, 503 for the requests still running when a shutdown's drain time is over
(`drain`), 504 when a request outlives its timeout. The command line, `serve.py`, is
`gptmini.serve.command.serve_main`.

The routes are plain functions on a module-level `router`; what they share (the engine,
its loop, the calls in flight, the settings) is one `ServerState` on `app.state.server`.
"""

import asyncio
import contextlib
import hmac
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from fastapi import APIRouter, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from gptmini.chat import (
    ChatDataError,
    ChatTemplate,
    ChatTemplateError,
    render_chat,
    template_for,
)
from gptmini.generate.engine import Engine, Request
from gptmini.generate.sampling import RequestError, held_back
from gptmini.serve.engine_thread import EngineLoop, Ticker
from gptmini.serve.page import PageState, checkpoint_panel
from gptmini.serve.page import router as page_router
from gptmini.serve.schema import (
    APIError,
    ChatLogprobsWriter,
    ChatRequest,
    CompletionRequest,
    LogprobsWriter,
    choice_seed,
    parse,
    parse_chat,
    refused,
)
from gptmini.tokenizer import encode_prompt

__all__ = ["APIError", "EngineLoop", "ServerState", "choice_seed", "create_app", "drain",
           "parse", "parse_chat", "router"]

@dataclass(eq=False)
class Job:
    """One /v1/completions or /v1/chat/completions call: its engine requests, choice by
    choice."""

    requests: list[Request]
    prompts: list[list[int]]
    """Each choice's prompt ids."""
    prompt_tokens: int
    stops: tuple[str, ...]
    writers: list[LogprobsWriter] | None = None
    """Each choice's logprobs, when asked."""
    token_ids: bool = False
    """Each choice carries its token ids (vLLM's `return_token_ids`)."""
    chat: bool = False
    """Answered in chat's shape (messages and deltas, not texts)."""
    batch_invariant: bool | None = None
    """A seeded call: whether its texts are independent of what else the engine batches
    (float64 weights); None for a call without a seed, which promises no text."""
    streaming: bool = False  # its stream is being sent
    closed: bool = False  # answered, cancelled or timed out

    @property
    def in_flight(self) -> bool:
        return self.streaming or not (self.closed or all(r.done for r in self.requests))


@dataclass(eq=False)
class ServerState:
    """What the routes share: the engine and its loop, the calls in flight, the settings."""

    engine: Engine
    model_name: str
    api_key: str | None
    max_pending: int
    timeout: float
    loop: EngineLoop
    chat_template: ChatTemplate | str
    """What renders a chat, or why this model cannot chat (a tokenizer with no template)."""
    ticker: Ticker = field(default_factory=Ticker)
    jobs: set = field(default_factory=set)
    created: int = field(default_factory=lambda: int(time.time()))
    drain_until: float = math.inf
    """When a shutdown's drain time ends (`drain`); the requests still running then get 503."""

    def overdue(self, deadline: float) -> APIError | None:
        """The APIError that ends a request now: past a shutdown's drain, or past its own
        deadline (--timeout); None while it may go on."""
        now = time.monotonic()
        if now > self.drain_until:
            return APIError(503, "the server is shutting down and its drain time (serve.py "
                            "--drain) is over; send the request again", kind="server_error")
        if now > deadline:
            return APIError(504, f"the request took longer than {self.timeout:g} s",
                            kind="timeout_error")
        return None

    def authorize(self, request: HTTPRequest) -> None:
        """Raise a 401 unless the call carries the key (when the server has one)."""
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                           kind="authentication_error")


router = APIRouter()


def state_of(request: HTTPRequest) -> ServerState:
    return request.app.state.server


async def read_json(request: HTTPRequest):
    """The body as JSON, a 400 naming the problem, or None when the client hung up."""
    try:
        return json.loads(await request.body())
    except ClientDisconnect:  # hung up mid-body: nobody to answer, nothing to log
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the body is not valid JSON: {err}") from None


@router.get("/health")
async def health(request: HTTPRequest):
    engine = state_of(request).engine
    return {"status": "ok", "running": len(engine.running), "waiting": len(engine.waiting),
            "free_blocks": engine.blocks.num_free}


@router.get("/v1/models")
async def models(request: HTTPRequest):
    state = state_of(request)
    state.authorize(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                        "created": state.created, "owned_by": "gptmini"}]}


@router.post("/v1/completions")
async def completions(request: HTTPRequest):
    state = state_of(request)
    state.authorize(request)
    body = await read_json(request)
    if body is None:
        return Response(status_code=499)
    call = parse(body, state.model_name)
    check_room(state, len(call.prompts), call.n)
    enc = state.engine.tokenizer
    encoded = [p if isinstance(p, list) else encode_prompt(enc, p) for p in call.prompts]
    job = submit(state, call, encoded, (enc.eot_token,), refused)
    if call.sampling.logprobs is not None:
        job.writers = [LogprobsWriter(enc, len(p) if isinstance(p, str) else len(enc.decode(p)))
                       for p in call.prompts for _ in range(call.n)]
    return await answer(state, job, call.stream, call.include_usage, request)


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest):
    state = state_of(request)
    state.authorize(request)
    body = await read_json(request)
    if body is None:
        return Response(status_code=499)
    call = parse_chat(body, state.model_name)
    check_room(state, 1, call.n)
    ids, stop_ids = render_messages(state, call)
    sampling = call.sampling
    if call.max_tokens_field is None:  # OpenAI's default: the reply may fill the context
        sampling = replace(sampling, max_new_tokens=state.engine.context - len(ids))
    job = submit(state, replace(call, sampling=sampling), [ids], stop_ids,
                 lambda err: refused(err, call.api_name), chat=True)
    if call.sampling.logprobs is not None:
        job.writers = [ChatLogprobsWriter(state.engine.tokenizer) for _ in range(call.n)]
    return await answer(state, job, call.stream, call.include_usage, request)


def render_messages(state: ServerState, call: ChatRequest) -> tuple[list[int], tuple[int, ...]]:
    """The conversation's ids, ending with the opening of the assistant's turn, and the ids
    its reply stops at, by the model's template; a 400 naming messages (or the max tokens
    field) when they cannot be rendered or leave no room for a reply, a 500 naming the
    template when it fails by itself."""
    template = state.chat_template
    if isinstance(template, str):
        raise APIError(400, template, "messages")
    enc = state.engine.tokenizer
    try:
        ids = render_chat(call.messages, enc, template, add_generation_prompt=True,
                          mask=False, where="request").ids
        stop_ids = tuple(template.stop_ids(enc))
    except ChatTemplateError as err:  # the server's template is at fault, not the request
        raise APIError(500, str(err), kind="server_error") from None
    except ChatDataError as err:
        raise APIError(400, str(err), "messages") from None
    context, asked = state.engine.context, call.sampling.max_new_tokens
    if len(ids) >= context:
        raise APIError(400, f"the messages render to {len(ids)} tokens with chat template "
                       f"{template.name!r}, leaving no room for a reply in the model's "
                       f"context_length of {context}; drop or shorten early messages",
                       "messages")
    if call.max_tokens_field is not None and len(ids) + asked > context:
        raise APIError(400, f"the messages render to {len(ids)} tokens and "
                       f"{call.max_tokens_field}={asked} more would pass the model's "
                       f"context_length of {context}; ask at most {context - len(ids)} or "
                       "leave it out (the reply may then fill the context)",
                       call.max_tokens_field)
    return ids, stop_ids


def check_room(state: ServerState, prompts: int, n: int) -> None:
    """A 400 for a call asking more completions than the server holds, a 429 when the
    completions in flight leave no room for it."""
    asked, limit = prompts * n, state.max_pending
    if asked > limit:
        raise APIError(400, f"this call asks for {asked} completions ({prompts} "
                       f"prompts x n={n}), more than the {limit} the "
                       "server holds at once (serve.py --max_pending); split it into "
                       "smaller calls", "prompt" if prompts > 1 else "n")
    state.jobs.intersection_update([j for j in state.jobs if j.in_flight])
    pending = sum(not r.done for j in state.jobs for r in j.requests)
    if pending + asked > limit:
        raise APIError(429, f"the server is busy ({pending} completions in flight, "
                       f"{asked} more asked, the limit is {limit}); retry later",
                       kind="rate_limit_error")


def submit(state: ServerState, call: CompletionRequest | ChatRequest,
           encoded: list[list[int]], stop_ids: tuple[int, ...],
           refuse: Callable[[RequestError], APIError], chat: bool = False) -> Job:
    """Every choice of `call` (n per prompt of `encoded`) into the engine, or none: the
    engine checks them all first (`refuse` makes the 400 naming the request's field)."""
    choices = [(ids, call.choice_sampling(i, stop_ids))
               for ids in encoded for i in range(call.n)]
    try:
        for ids, params in choices:
            state.engine.check_request(ids, params)
    except RequestError as err:
        raise refuse(err) from None
    requests = [state.loop.add(ids, params) for ids, params in choices]
    # float32 and bfloat16 logits move in their last bits with the batch's shape, and a draw
    # that close to a boundary between two tokens flips: a client is told, per response.
    invariant = (None if call.sampling.seed is None
                 else next(state.engine.model.parameters()).dtype == torch.float64)
    job = Job(requests, [ids for ids, _ in choices], sum(map(len, encoded)),
              call.sampling.stop, token_ids=call.return_token_ids, chat=chat,
              batch_invariant=invariant)
    state.jobs.add(job)
    return job


async def answer(state: ServerState, job: Job, streaming: bool, include_usage: bool,
                 request: HTTPRequest):
    """The whole answer when it is there, or its stream of events."""
    if streaming:
        return StreamingResponse(stream(state, job, include_usage),
                                 media_type="text/event-stream")
    await wait(state, job, request)
    return respond(state, job)


def seeded(job: Job) -> dict:
    """The response's `batch_invariant` field, for a seeded call only."""
    return {} if job.batch_invariant is None else {"batch_invariant": job.batch_invariant}


async def wait(state: ServerState, job: Job, request: HTTPRequest) -> None:
    deadline = time.monotonic() + state.timeout
    while not all(r.done for r in job.requests):
        if await request.is_disconnected():
            cancel(state, job)
            return  # (nobody reads the answer)
        if error := state.overdue(deadline):
            cancel(state, job)
            raise error
        await state.ticker.next(0.05)


def cancel(state: ServerState, job: Job) -> None:
    job.closed = True
    for r in job.requests:
        if not r.done:
            state.engine.cancel(r)
    state.loop.wake()


def usage(job: Job) -> dict:
    completion = sum(len(r.tokens) for r in job.requests)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


def finish_reason(r: Request) -> str:
    return "length" if r.finish_reason == "length" else "stop"


KINDS = {False: ("cmpl", "text_completion", "text_completion"),
         True: ("chatcmpl", "chat.completion", "chat.completion.chunk")}
"""A job's id prefix, object and stream chunk object: a completion's, a chat's."""


def head(state: ServerState, job: Job, chunk: bool, ident: str | None = None) -> dict:
    """The fields an answer (or a stream's chunk) starts with."""
    prefix, whole, piece = KINDS[job.chat]
    return {"id": ident or f"{prefix}-{uuid.uuid4().hex}", "object": piece if chunk else whole,
            "created": int(time.time()), "model": state.model_name}


def respond(state: ServerState, job: Job) -> dict:
    job.closed = True
    if any(r.finish_reason == "error" for r in job.requests):
        raise APIError(500, f"the engine failed: {state.loop.error}", kind="server_error")
    choices = [{"index": i, **text_of(job, r.text, None), **tokens_of(job, i, 0, len(r.tokens)),
                "finish_reason": finish_reason(r)} for i, r in enumerate(job.requests)]
    return {**head(state, job, False), **prompt_ids_of(job, True), "choices": choices,
            "usage": usage(job), **seeded(job)}


def text_of(job: Job, text: str, first: bool | None) -> dict:
    """A choice's text: a completion's `text`, a chat's `message` (`first` None: the whole
    answer) or a stream's `delta` (the role in the first)."""
    if not job.chat:
        return {"text": text}
    if first is None:
        return {"message": {"role": "assistant", "content": text}}
    return {"delta": {"role": "assistant", "content": text} if first
            else {"content": text} if text else {}}


def prompt_ids_of(job: Job, first: bool) -> dict:
    """A chat's rendered conversation ids with return_token_ids, at the top of the answer
    or its first chunk, as vLLM places them (a completion's are in its choices)."""
    return {"prompt_token_ids": job.prompts[0]} if job.chat and job.token_ids and first else {}


def tokens_of(job: Job, i: int, start: int, end: int) -> dict:
    """Choice i's `logprobs` of its tokens start..end (None unless asked), and with
    return_token_ids their ids (and a completion's prompt's, with the first tokens)."""
    r = job.requests[i]
    out = {"logprobs": None if job.writers is None else job.writers[i].add(
        r.tokens[start:end], r.logprobs[start:end])}
    if job.token_ids:
        out["token_ids"] = r.tokens[start:end]
        if start == 0 and not job.chat:
            out["prompt_token_ids"] = job.prompts[i]
    return out


def ready_tokens(job: Job, r: Request) -> int:
    """Tokens of `r` a stream may send now: those whose every field is there (the engine
    thread appends them); none before the text when no token field was asked."""
    if job.writers is None:
        return len(r.tokens) if job.token_ids else 0
    return min(len(r.tokens), len(r.logprobs))


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def stream(state: ServerState, job: Job, include_usage: bool):
    ident, sent = head(state, job, True)["id"], [0] * len(job.requests)
    reported, tokens_sent = [False] * len(job.requests), [0] * len(job.requests)
    chunks = [0] * len(job.requests)

    def chunk(i: int, text: str, reason: str | None, end: int) -> str:
        start, tokens_sent[i] = tokens_sent[i], end
        chunks[i] += 1
        return event({**head(state, job, True, ident), **prompt_ids_of(job, sum(chunks) == 1),
                      "choices": [{"index": i, **text_of(job, text, chunks[i] == 1),
                                   **tokens_of(job, i, start, end), "finish_reason": reason}],
                      **seeded(job)})
    job.streaming = True
    try:
        deadline = time.monotonic() + state.timeout
        while not all(reported):
            for i, r in enumerate(job.requests):
                if reported[i]:
                    continue
                done, text, count = r.done, r.text, ready_tokens(job, r)
                ready = len(text) - held_back(text, job.stops, done)
                if ready > sent[i] or count > tokens_sent[i]:
                    yield chunk(i, text[sent[i]:ready], None, count)
                    sent[i] = ready
                if done and r.finish_reason == "error":
                    yield event(APIError(500, f"the engine failed: {state.loop.error}",
                                         kind="server_error").body())
                    return
                if done:
                    yield chunk(i, "", finish_reason(r), ready_tokens(job, r))
                    reported[i] = True
            if error := state.overdue(deadline):  # (a disconnect cancels this generator)
                yield event(error.body())
                return
            if not all(reported):
                await state.ticker.next(0.05)
        if include_usage:
            yield event({**head(state, job, True, ident), "choices": [], "usage": usage(job)})
        yield "data: [DONE]\n\n"
    finally:
        cancel(state, job)  # a client gone mid-stream: its blocks go back at the next step
        job.streaming = False


async def api_error(_, err: APIError):
    return JSONResponse(err.body(), status_code=err.status)


async def http_error(request: HTTPRequest, err: HTTPException):
    message = f"{request.method} {request.url.path}: {err.detail}"
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(err.status_code, message, kind=kind).body(),
                        status_code=err.status_code, headers=err.headers)


async def invalid(_, err: RequestValidationError):
    return JSONResponse(APIError(400, f"invalid request: {err.errors()[:1]}").body(),
                        status_code=400)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    state: ServerState = app.state.server
    events = asyncio.get_running_loop()
    state.loop.on_step = lambda: events.call_soon_threadsafe(state.ticker.tick)
    yield
    state.loop.on_step = lambda: None
    state.loop.close()  # after uvicorn has drained the requests in flight


def drain(app: FastAPI, seconds: float) -> None:
    """Begin a shutdown: the requests in flight go on for `seconds`, then each still running
    is answered 503 (a stream: an error event) instead of having its connection dropped."""
    app.state.server.drain_until = time.monotonic() + seconds


def create_app(engine: Engine, model_name: str = "gptmini", *, api_key: str | None = None,
               max_pending: int = 1024, timeout: float = 600.0,
               checkpoint: dict | None = None, attention_tokens: int = 512,
               chat_template: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI application serving `engine` (which needs its tokenizer), with the page
    at / (gptmini.serve.page): `checkpoint` is its panel (`checkpoint_panel`; default: the
    model's settings alone), `attention_tokens` the longest text /gptmini/attention takes,
    `chat_template` what renders a chat (default: `template_for` the tokenizer; serve.py
    passes the checkpoint's)."""
    if engine.tokenizer is None:
        raise ValueError("the server needs the engine's tokenizer: Engine(model, tokenizer)")
    if isinstance(attention_tokens, bool) or not isinstance(attention_tokens, int) or (
            attention_tokens < 1):
        raise ValueError(f"attention_tokens must be an integer >= 1, got {attention_tokens!r}")
    app = FastAPI(title="gptmini", lifespan=lifespan)
    if chat_template is None:
        try:
            chat_template = template_for(engine.tokenizer)
        except ChatDataError as err:
            chat_template = f"this model cannot chat: {err}"
    app.state.server = ServerState(engine, model_name, api_key, max_pending, timeout,
                                   EngineLoop(engine), chat_template)
    app.state.loop = app.state.server.loop
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.state.page = PageState(checkpoint or checkpoint_panel(engine.model, engine.tokenizer),
                               attention_tokens)
    app.include_router(router)
    app.include_router(page_router)
    return app
