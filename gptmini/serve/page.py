"""The web page serve.py serves at `/` (gptmini/serve/web/: plain HTML, CSS and JavaScript, no
build step, nothing fetched from elsewhere) and the gptmini endpoints it reads beside
OpenAI's:

- GET /gptmini/checkpoint: the checkpoint's settings, parameter count, training steps,
  tokenizer, validation bits per byte and, when its run directory is there, loss curves (JSON
  has no NaN: a logged value that is not finite, a NaN loss, is left out of its curve and
  its step listed in `non_finite_steps`; as `val_loss` or `val_bpb` it is null);
- POST /gptmini/attention: every layer's and head's attention weights of a text (the
  explicit path), its mask and the next-token candidates at every position (see
  `gptmini.analysis.inspection.pack`); a text longer than the limit is a 400;
- GET /gptmini/heads: every head's previous-token, induction and sink scores
  (`gptmini.analysis.heads`), computed at the first call; a 422 for a model whose context
  is too short to measure them (under 5 tokens).

A model whose forward pass gives values that are not finite (its weights overflow in the
served dtype) is answered a 500 saying so, not a bare one.

The data endpoints follow the API key rule of /v1; the page and its files need no key (the
page asks for the key when a call answers 401). The model runs in a worker thread beside
the engine's, so a long forward pass never holds up the event loop.
"""

import asyncio
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from gptmini.analysis.curves import load_metrics
from gptmini.analysis.heads import HeadRoles, head_roles
from gptmini.analysis.inspection import ENCODINGS, inspect_text, pack
from gptmini.checkpoint import training_steps
from gptmini.generate.sampling import MAX_LOGPROBS, json_type
from gptmini.model.flops import num_parameters
from gptmini.serve.schema import APIError
from gptmini.tokenizer import encode_prompt

__all__ = ["WEB", "PageState", "checkpoint_panel", "json_safe", "parameter_parts", "router"]

WEB = Path(__file__).parent / "web"
"""The page's files, shipped in the package."""
CURVES = ("train/loss", "val/loss", "val/bpb")
MIN_ROLES_CONTEXT = 5
"""Head roles need [first] + r + r with len(r) >= 2 (`gptmini.analysis.heads`)."""


@dataclass(eq=False)
class PageState:
    """What the page's endpoints share (on `app.state.page`)."""

    checkpoint: dict
    attention_tokens: int
    roles: dict | None = None
    roles_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def parameter_parts(model) -> dict[str, int]:
    """Where a `GPTModel`'s parameters are, each counted once: the token embedding, the
    position embedding (0 where positions are not embedded), the output head (0 when it is
    the token embedding, tied) and everything else (the blocks and the final norm)."""
    total = sum(p.numel() for p in model.parameters())  # a shared tensor is listed once
    embedding = model.position_scheme.embedding
    parts = {"token_embedding": model.tok_emb.weight.numel(),
             "position_embedding": 0 if embedding is None
             else sum(p.numel() for p in embedding.parameters()),
             "output_head": 0 if model.out_head.weight is model.tok_emb.weight
             else model.out_head.weight.numel()}
    return {"blocks": total - sum(parts.values()), **parts}


def checkpoint_panel(model, tokenizer, path: str | Path | None = None,
                     hparams: dict | None = None) -> dict:
    """What the page's checkpoint panel shows (GET /gptmini/checkpoint).

    `parameters` counts a tied head once; `non_embedding_parameters` is nanoGPT's count
    (a tied token embedding stays, being also the head); `parameter_parts` splits the
    total, and `tied_weights` says whether the head is the token embedding.
    Values that are not finite are None (JSON has none).
    """
    return json_safe(_panel(model, tokenizer, path, hparams or {}))


def _curve(steps: list[int], values: list[float]) -> dict:
    """One curve's finite points, and the steps whose value was not (a NaN loss): JSON has
    no NaN, and a line drawn through null would not be a line."""
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
    return {"steps": [s for s, _ in kept], "values": [v for _, v in kept],
            "non_finite_steps": [s for s, v in zip(steps, values, strict=True)
                                 if not math.isfinite(v)]}


def json_safe(value):
    """`value` with every float that is not finite replaced by None: JSON has no NaN or
    infinity (a run whose loss went NaN logged one), and a page draws null as a gap."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _panel(model, tokenizer, path: str | Path | None, hparams: dict) -> dict:
    panel = {"path": None if path is None else str(path),
             "settings": model.cfg.to_dict(), "parameters": num_parameters(model),
             "non_embedding_parameters": num_parameters(model, non_embedding=True),
             "parameter_parts": parameter_parts(model),
             "tied_weights": model.out_head.weight is model.tok_emb.weight,
             "tokenizer": {"name": str(hparams.get("tokenizer", tokenizer.name)),
                           "n_vocab": tokenizer.n_vocab},
             "steps": None, "val_bpb": None, "val_loss": None, "curves": {}, "run_dir": None}
    if path is None:
        return panel
    path = Path(path)
    if path.is_file():
        panel["steps"] = training_steps(path)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    try:
        metrics, _ = load_metrics(run_dir)  # rows it cannot read: skipped, with a warning
    except (FileNotFoundError, ValueError, KeyError, OSError):
        return panel  # no run directory beside the checkpoint: no curves
    panel["run_dir"] = str(run_dir)
    panel["curves"] = {name: _curve(*metrics[name]) for name in CURVES if name in metrics}
    for name, key in (("val/bpb", "val_bpb"), ("val/loss", "val_loss")):
        if name in metrics:
            panel[key] = metrics[name][1][-1]
    return panel


router = APIRouter()


@router.get("/", include_in_schema=False)
async def index():
    return FileResponse(WEB / "index.html", media_type="text/html")


@router.get("/web/{name}", include_in_schema=False)
async def web_file(name: str):
    files = {p.name: p for p in WEB.iterdir() if p.is_file()}
    if name not in files:
        raise APIError(404, f"GET /web/{name}: no such file; the page's files are "
                       f"{', '.join(sorted(files))}", kind="not_found_error")
    return FileResponse(files[name])


@router.get("/gptmini/checkpoint")
async def checkpoint(request: HTTPRequest):
    request.app.state.server.authorize(request)
    return {"model": request.app.state.server.model_name,
            **request.app.state.page.checkpoint}


@router.get("/gptmini/heads")
async def heads(request: HTTPRequest):
    request.app.state.server.authorize(request)
    page: PageState = request.app.state.page
    async with page.roles_lock:  # computed once, by the first caller
        if page.roles is None:
            model = request.app.state.server.engine.model
            context = model.cfg.context_length
            if context < MIN_ROLES_CONTEXT:
                raise APIError(422, f"head roles are measured on a random sequence repeated "
                               f"twice after one token (at least {MIN_ROLES_CONTEXT} tokens); "
                               f"this model's context_length is {context}")
            roles: HeadRoles = await run_in_threadpool(head_roles, model)
            finite_or_500([roles.previous_token, roles.induction, roles.sink], "head roles")
            page.roles = roles.to_dict()
    return page.roles


@router.post("/gptmini/attention")
async def attention(request: HTTPRequest):
    server, page = request.app.state.server, request.app.state.page
    server.authorize(request)
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object such as {\"prompt\": "
                       "\"ROMEO:\"}")
    unknown = sorted(set(body) - {"prompt", "top_logprobs", "encoding"})
    if unknown:
        raise APIError(400, f"unsupported field {unknown[0]!r}; /gptmini/attention takes "
                       "prompt, top_logprobs and encoding", unknown[0])
    ids = prompt_ids(body.get("prompt"), server.engine, page.attention_tokens)
    top = body.get("top_logprobs", 10)
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be an integer in 0..{MAX_LOGPROBS}, got "
                       f"{top!r} ({json_type(top)})", "top_logprobs")
    encoding = body.get("encoding", "float16")
    if encoding not in ENCODINGS:
        raise APIError(400, f"encoding must be one of {', '.join(ENCODINGS)}, got "
                       f"{encoding!r}", "encoding")
    model, enc = server.engine.model, server.engine.tokenizer
    seen = await run_in_threadpool(inspect_text, model, ids, top=top)
    finite_or_500([seen.weights, seen.top_logprobs], "attention weights and log-probabilities")
    return await run_in_threadpool(pack, seen, enc, encoding)


def finite_or_500(tensors: list[torch.Tensor], what: str) -> None:
    """A 500 that says why when the model computed values that are not finite (before: the
    JSON encoder's bare 500, "Out of range float values are not JSON compliant")."""
    if not all(bool(t.isfinite().all()) for t in tensors):
        raise APIError(500, f"the model's {what} are not finite (NaN or inf): its weights "
                       "hold NaN or overflow in the served dtype; serve another checkpoint, "
                       "or --dtype float32", kind="server_error")


def prompt_ids(prompt, engine, limit: int) -> list[int]:
    """The ids of /gptmini/attention's prompt (text, by `encode_prompt`, or ids), or a 400."""
    vocab, context = engine.model.cfg.vocab_size, engine.model.cfg.context_length
    if isinstance(prompt, str):
        ids = encode_prompt(engine.tokenizer, prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
        ids = prompt
    else:
        raise APIError(400, f"prompt must be a string or a non-empty list of token ids in "
                       f"[0, {vocab}), got {json_type(prompt)}", "prompt")
    most = min(limit, context)
    if len(ids) > most:
        why = ("the model's context_length" if most == context
               else "serve.py --attention_tokens")
        raise APIError(400, f"the text has {len(ids)} tokens; /gptmini/attention takes at "
                       f"most {most} ({why}); shorten it", "prompt")
    return ids
