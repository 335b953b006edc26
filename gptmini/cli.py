"""The command lines behind generate.py, visualize.py and serve.py (argparse mains)."""

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tiktoken import Encoding
from torch import nn

from gptmini.api import SEED_RANGE
from gptmini.batch import generate_batch
from gptmini.checkpoint import load_checkpoint
from gptmini.engine import Engine
from gptmini.generation import stream_text
from gptmini.plots import (
    attention_weights,
    check_index,
    plot_attention,
    plot_curves,
    require_matplotlib,
)
from gptmini.precision import AUTO, auto_dtype
from gptmini.sampling import SamplingParams


def generate_parser() -> argparse.ArgumentParser:
    """The `generate.py` command line."""
    parser = argparse.ArgumentParser(
        prog="generate.py",
        description="Generate text from a gptmini checkpoint or a Hugging Face GPT-2 directory.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path,
                        help="gptmini checkpoint (.ckpt) or Hugging Face GPT-2 directory")
    source.add_argument("--hf", type=Path, help="the same as --checkpoint (kept for scripts)")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--prompt", default="", help="text to continue; empty = <|endoftext|>")
    text.add_argument("--prompt_file", type=Path, help="read the prompt from this file")
    text.add_argument("--batch_file", type=Path,
                      help="many prompts, batched by the engine: one per line, or .jsonl "
                           "records with \"prompt\" (and optional max_new_tokens, "
                           "temperature, top_k, top_p, seed, stop); one JSON result per "
                           "prompt, in order, to --output")
    parser.add_argument("--output", type=Path, default=None,
                        help="with --batch_file: write the results here (default: stdout)")
    parser.add_argument("--max_batch", type=int, default=32,
                        help="with --batch_file: most requests decoded at once")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=200, help="0 or less = off")
    parser.add_argument("--top_p", type=float, default=None, help="nucleus threshold in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="fix the random draws")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="print tokens as they come")
    _add_device_options(parser)
    return parser


def _add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ...")
    parser.add_argument("--dtype", default=AUTO,
                        choices=[AUTO, "float32", "bfloat16", "float64"],
                        help="compute in; auto = bfloat16 where the device has bf16 units")


def _load_on_device(path: Path, device: torch.device, dtype: str) -> tuple[nn.Module, Encoding]:
    """The model and tokenizer at `path`, on `device` in `dtype` (--device, --dtype)."""
    model, tokenizer, _ = load_checkpoint(path, map_location=device)
    return model.to(auto_dtype(dtype, device)), tokenizer


def generate_main(argv: Sequence[str] | None = None) -> int:
    """Run `generate.py` with `argv` (default `sys.argv[1:]`); print the samples.

    Samples are drawn one after another from one generator, so the output is the same
    with and without `--stream`. Bad arguments exit with status 2 and a message.
    """
    parser = generate_parser()
    args = parser.parse_args(argv)
    top_k = args.top_k if args.top_k is not None and args.top_k > 0 else None
    try:
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=top_k, top_p=args.top_p)  # checks them, naming the bad one
        if args.num_samples < 1 or args.max_batch < 1:
            raise ValueError(f"--num_samples >= 1 and --max_batch >= 1 are needed, got "
                             f"--num_samples {args.num_samples} --max_batch {args.max_batch}")
        if args.seed is not None and not SEED_RANGE[0] <= args.seed < SEED_RANGE[1] - 2**32:
            raise ValueError(f"--seed {args.seed} is out of range: use an integer of 64 bits, "
                             f"from {SEED_RANGE[0]} to {SEED_RANGE[1] - 2**32 - 1}")
        device = _resolve_device(args.device)
        if args.prompt_file is not None:
            if not args.prompt_file.is_file():
                raise ValueError(f"--prompt_file {args.prompt_file} does not exist")
            try:
                prompt = args.prompt_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"--prompt_file {args.prompt_file} is not UTF-8 text (byte "
                                 f"{err.start}); convert it first, e.g. iconv -t utf-8") from None
        else:
            prompt = args.prompt
        model, tokenizer = _load_on_device(args.checkpoint or args.hf, device, args.dtype)
        if args.batch_file is not None:
            return generate_batch(model, tokenizer, args, top_k)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        parser.error(str(err))

    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=device).manual_seed(args.seed)
    out = sys.stdout
    for i in range(args.num_samples):
        if args.num_samples > 1:
            out.write(f"--- sample {i + 1}/{args.num_samples} ---\n")
        out.write(prompt)
        out.flush()
        pieces = stream_text(
            model, tokenizer, prompt, args.max_new_tokens, temperature=args.temperature,
            top_k=top_k, top_p=args.top_p, generator=generator,
        )
        if args.stream:
            for piece in pieces:
                out.write(piece)
                out.flush()
        else:
            out.write("".join(pieces))
        out.write("\n")
        out.flush()
    return 0


def _resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device name ({err}); try cpu") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(
                f"--device {name} is not available: this machine has {count} CUDA device(s) "
                f"(torch {torch.__version__}); use --device cpu"
            )
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {name} is not available on this machine; use --device cpu")
        return device
    try:
        torch.empty(1, device=device)
    except Exception as err:  # backends report missing devices with different types
        raise ValueError(f"--device {name} is not available ({err}); use --device cpu") from None
    return device


def visualize_parser() -> argparse.ArgumentParser:
    """The `visualize.py` command line."""
    parser = argparse.ArgumentParser(
        prog="visualize.py", description="Draw attention maps and training curves as PNGs."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    att = commands.add_parser(
        "attention", help="heatmap of one layer's attention weights on a prompt",
        description="Heatmap of the attention weights a model gives a prompt's tokens.",
    )
    source = att.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path,
                        help="gptmini checkpoint (.ckpt) or Hugging Face GPT-2 directory")
    source.add_argument("--hf", type=Path, help="the same as --checkpoint (kept for scripts)")
    att.add_argument("--prompt", default="", help="text to look at; empty = <|endoftext|>")
    att.add_argument("--layer", type=int, default=-1, help="layer from 0; -1 = the last")
    heads = att.add_mutually_exclusive_group()
    heads.add_argument("--head", type=int, default=0, help="head from 0 (default 0)")
    heads.add_argument("--all_heads", action="store_true", help="a grid of every head")
    att.add_argument("--left_pad", type=int, default=0,
                     help="padding positions before the prompt, to see the padding mask")
    att.add_argument("--out", type=Path, default=Path("attention.png"))
    att.add_argument("--dpi", type=int, default=100)
    att.add_argument("--device", default="cpu", help="cpu, cuda, mps, ...")

    curves = commands.add_parser(
        "curves", help="loss and learning rate of a training run",
        description="Train/val loss and learning rate against steps, from the CSV logs.",
    )
    curves.add_argument("run_dir", type=Path, help="the run's folder, e.g. runs/shakespeare-cpu")
    curves.add_argument("--out", type=Path, default=Path("curves.png"))
    curves.add_argument("--dpi", type=int, default=100)
    return parser


def _load_model(args: argparse.Namespace) -> tuple[nn.Module, Encoding]:
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise ValueError(f"--device {args.device!r} is not a device name ({err})") from None
    model, tokenizer, _ = load_checkpoint(args.checkpoint or args.hf, map_location="cpu")
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as err:  # a build without CUDA asserts
        raise ValueError(f"--device {args.device} is not available ({err}); use cpu") from None
    return model, tokenizer


def _attention_command(args: argparse.Namespace) -> str:
    require_matplotlib()  # before loading a model that cannot be drawn
    model, tokenizer = _load_model(args)
    head = None if args.all_heads else args.head
    if head is not None:
        check_index("head", head, model.cfg.n_heads, "heads per layer")
    layer = check_index("layer", args.layer, model.cfg.n_layers, "layers")
    weights, labels = attention_weights(
        model, tokenizer, args.prompt, layer, left_pad=args.left_pad
    )
    out = plot_attention(weights, labels, args.out, layer=layer, head=head, dpi=args.dpi)
    which = "all heads" if head is None else f"head {head % model.cfg.n_heads}"
    return f"wrote {out} (layer {layer}, {which}, {len(labels)} tokens)"


def visualize_main(argv: Sequence[str] | None = None) -> int:
    """Run `visualize.py` with `argv` (default `sys.argv[1:]`); returns the exit code.

    Errors a user can fix print one line instead of a traceback; set GPTMINI_TRACEBACK=1
    to see the traceback anyway.
    """
    args = visualize_parser().parse_args(argv)
    try:
        if args.command == "attention":
            message = _attention_command(args)
        else:
            message = f"wrote {plot_curves(args.run_dir, args.out, dpi=args.dpi)}"
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as err:
        if os.environ.get("GPTMINI_TRACEBACK"):
            raise
        print(f"visualize.py {args.command}: error: {err}", file=sys.stderr)
        return 1
    print(message)
    return 0


def serve_parser() -> argparse.ArgumentParser:
    """The `serve.py` command line."""
    parser = argparse.ArgumentParser(
        prog="serve.py",
        description="Serve a gptmini checkpoint or a Hugging Face GPT-2 directory with an "
                    "OpenAI-compatible completions API.",
    )
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="gptmini checkpoint (.ckpt) or Hugging Face GPT-2 directory")
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
    _add_device_options(parser)
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

        from gptmini.page import checkpoint_panel
        from gptmini.server import create_app
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
        device = _resolve_device(args.device)
        model, tokenizer, hparams = load_checkpoint(args.checkpoint, map_location=device)
        model = model.to(auto_dtype(args.dtype, device))
        panel = checkpoint_panel(model, tokenizer, args.checkpoint, hparams)
        engine = Engine(model, tokenizer, block_size=args.block_size,
                        num_blocks=args.num_blocks, max_batch=args.max_batch,
                        max_step_tokens=args.max_step_tokens)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        parser.error(str(err))
    name = args.model_name or args.checkpoint.stem
    app = create_app(engine, name, api_key=args.api_key, max_pending=args.max_pending,
                     timeout=args.timeout, checkpoint=panel,
                     attention_tokens=args.attention_tokens)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (POST /v1/completions); "
          f"the page: http://{args.host}:{args.port}/", flush=True)
    return _serve_draining(app, args.host, args.port, args.drain)


def _serve_draining(app, host: str, port: int, drain: float) -> int:
    """uvicorn.run, but a shutdown first tells the app its drain time (server.drain), so that
    requests still running after `drain` seconds are answered 503; uvicorn waits one second
    more for those answers before it drops connections."""
    import uvicorn

    from gptmini.server import drain as begin_drain

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            begin_drain(app, drain)
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=drain + 1))
    server.run()
    return 0 if server.started else 3  # (uvicorn.run's exit status for a failed start)
