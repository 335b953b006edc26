"""`serve.py`: the OpenAI-compatible server over the engine, with a drain on SIGTERM
(argparse main)."""

import argparse
import socket
from collections.abc import Sequence
from pathlib import Path

from gptmini.chat import ChatDataError, template_for
from gptmini.checkpoint import load_on_device
from gptmini.generate.engine import Engine
from gptmini.runtime import add_device_options, resolve_device


def serve_parser() -> argparse.ArgumentParser:
    """The `serve.py` command line."""
    parser = argparse.ArgumentParser(
        prog="serve.py",
        description="Serve a gptmini checkpoint or a Hugging Face directory with an "
                    "OpenAI-compatible API: completions, and chat completions rendered by "
                    "the model's chat template.",
    )
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="gptmini checkpoint (.ckpt), Hugging Face model directory, or a "
                        "model's name on the Hub (org/name)")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve the network")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model_name", default=None,
                        help="the name clients ask for (default: the checkpoint's stem)")
    parser.add_argument("--api_key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--max_batch", type=int, default=32, help="most requests decoded at once")
    parser.add_argument("--block_size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--num_blocks", type=int, default=None,
                        help="KV blocks in the pool (default: max_batch full contexts)")
    parser.add_argument("--max_step_tokens", type=int, default=None,
                        help="most tokens an engine step computes: decodes first, prompts "
                             "share the rest, a longer one over several steps (default: "
                             "512 or context_length if larger)")
    parser.add_argument("--max_pending", type=int, default=1024,
                        help="completions (prompts x n, over all calls) in flight before "
                             "answering 429; a call asking more is a 400")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--attention_tokens", type=int, default=512,
                        help="longest text the page's attention endpoint takes (memory: "
                             "layers x heads x tokens^2 weights)")
    parser.add_argument("--drain", type=float, default=30.0,
                        help="seconds to finish the requests in flight on SIGTERM or Ctrl-C; "
                             "those still running then are answered 503")
    add_device_options(parser)
    return parser


def check_serve_args(args: argparse.Namespace) -> None:
    """serve.py's numbers, each named with its fix (the engine would fail on them later:
    a block_size of 0 divided by zero, a max_batch of 0 blamed num_blocks)."""
    for name, low in (("max_batch", 1), ("block_size", 1), ("num_blocks", 1),
                      ("max_step_tokens", 1), ("max_pending", 1), ("attention_tokens", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name} {value} is invalid: use {low} or more")
    for name, positive in (("timeout", True), ("drain", False)):
        value = getattr(args, name)
        if value != value or value < 0 or (positive and value == 0):  # (NaN != NaN)
            raise ValueError(f"--{name} {value} is invalid: use a number of seconds "
                             + ("> 0" if positive else ">= 0"))


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Run `serve.py`: serve a checkpoint until SIGTERM or Ctrl-C, which stop taking
    connections and finish the requests in flight (up to --drain seconds). Bad arguments
    exit with status 2 and a message."""
    parser = serve_parser()
    args = parser.parse_args(argv)
    try:
        import uvicorn  # noqa: F401 (the serve extra is installed)

        from gptmini.serve.app import create_app
        from gptmini.serve.page import checkpoint_panel
    except ImportError:
        parser.error("the server needs its extra: pip install -e '.[serve]'")
    try:  # before the minutes a large checkpoint may take to load
        with socket.create_server((args.host, args.port)):
            pass
    except (OSError, OverflowError) as err:
        parser.error(f"cannot listen on {args.host}:{args.port} ({err}); pick another --port "
                     "(0..65535, free) or --host")
    try:
        check_serve_args(args)
        device = resolve_device(args.device)
        model, tokenizer, hparams = load_on_device(args.checkpoint, device, args.dtype)
        panel = checkpoint_panel(model, tokenizer, args.checkpoint, hparams)
        engine = Engine(model, tokenizer, block_size=args.block_size,
                        num_blocks=args.num_blocks, max_batch=args.max_batch,
                        max_step_tokens=args.max_step_tokens)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        parser.error(str(err))
    try:
        template = template_for(tokenizer, hparams)
    except ChatDataError:
        template = None  # (create_app says why the model cannot chat)
    name = args.model_name or args.checkpoint.stem
    app = create_app(engine, name, api_key=args.api_key, max_pending=args.max_pending,
                     timeout=args.timeout, checkpoint=panel,
                     attention_tokens=args.attention_tokens, chat_template=template)
    chat = ("" if template is None else
            f", POST /v1/chat/completions with chat template {template.name!r}")
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (POST /v1/completions{chat}); "
          f"the page: http://{args.host}:{args.port}/", flush=True)
    return _serve_draining(app, args.host, args.port, args.drain)


def _serve_draining(app, host: str, port: int, drain: float) -> int:
    """uvicorn.run, but a shutdown first tells the app its drain time (server.drain), so that
    requests still running after `drain` seconds are answered 503; uvicorn waits one second
    more for those answers before it drops connections."""
    import uvicorn

    from gptmini.serve.app import drain as begin_drain

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            begin_drain(app, drain)
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=drain + 1))
    server.run()
    return 0 if server.started else 3  # (uvicorn.run's exit status for a failed start)
