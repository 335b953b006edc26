"""`visualize.py`: attention maps and training curves as PNGs (argparse main)."""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tiktoken import Encoding
from torch import nn

from gptmini.analysis.curves import plot_curves
from gptmini.analysis.plots import (
    attention_weights,
    check_index,
    plot_attention,
    require_matplotlib,
)
from gptmini.checkpoint import load_checkpoint


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
                        help="gptmini checkpoint (.ckpt), Hugging Face model directory, or a "
                        "model's name on the Hub (org/name)")
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
