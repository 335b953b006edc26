"""`generate.py`: text from a checkpoint, one prompt at a time, a batch file through the
engine, or a conversation in the terminal (`--chat`) (argparse main)."""

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from gptmini.chat import ChatTemplateError, template_for
from gptmini.checkpoint import load_on_device
from gptmini.generate.batch_file import BATCH_SETTINGS, generate_batch
from gptmini.generate.chat import ChatSession, chat_loop
from gptmini.generate.engine import Engine
from gptmini.generate.loop import stream_text
from gptmini.generate.sampling import SEED_RANGE, SamplingParams, seeded_generator
from gptmini.runtime import add_device_options, resolve_device


def generate_parser() -> argparse.ArgumentParser:
    """The `generate.py` command line."""
    parser = argparse.ArgumentParser(
        prog="generate.py",
        description="Generate text from a gptmini checkpoint, a Hugging Face model "
                    "directory, or a model named on the Hub.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path,
                        help="gptmini checkpoint (.ckpt), Hugging Face model directory, or a "
                        "model's name on the Hub (org/name)")
    source.add_argument("--hf", type=Path, help="the same as --checkpoint (kept for scripts)")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--prompt", default="", help="text to continue; empty = <|endoftext|>")
    text.add_argument("--prompt_file", type=Path, help="read the prompt from this file")
    text.add_argument("--batch_file", type=Path,
                      help="many prompts, batched by the engine: one per line, or .jsonl "
                           "records with \"prompt\" (and optional "
                           f"{', '.join(BATCH_SETTINGS)}); one JSON result per prompt, in "
                           "order, to --output")
    text.add_argument("--chat", action="store_true",
                      help="a conversation: each line of stdin is your message, the reply is "
                           "printed as it comes, rendered by the model's chat template; /reset "
                           "starts over, /exit or end of input (Ctrl-D) ends")
    parser.add_argument("--system", default=None, help="with --chat: the system prompt")
    parser.add_argument("--output", type=Path, default=None,
                        help="with --batch_file: write the results here (default: stdout)")
    parser.add_argument("--max_batch", type=int, default=32,
                        help="with --batch_file: most requests decoded at once "
                             "(default: %(default)s)")
    parser.add_argument("--max_new_tokens", type=int, default=200,
                        help="most tokens to add to each prompt (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top_k", type=int, default=200,
                        help="0 or less = off (default: %(default)s)")
    parser.add_argument("--top_p", type=float, default=None,
                        help="nucleus threshold in (0, 1] (default: off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="fix the random draws (default: new draws every run)")
    parser.add_argument("--num_samples", type=int, default=1,
                        help="continuations of the prompt, drawn one after another "
                             "(default: %(default)s)")
    parser.add_argument("--stream", action="store_true", help="print tokens as they come")
    add_device_options(parser)
    return parser


def generate_main(argv: Sequence[str] | None = None) -> int:
    """Run `generate.py` with `argv` (default `sys.argv[1:]`); print the samples.

    Samples are drawn one after another from one generator, so the output is the same
    with and without `--stream`. Bad arguments exit with status 2 and a message.
    """
    parser = generate_parser()
    args = parser.parse_args(argv)
    top_k = args.top_k if args.top_k is not None and args.top_k > 0 else None
    try:
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=top_k,
                                  top_p=args.top_p)  # checks them, naming the bad one
        if args.num_samples < 1 or args.max_batch < 1:
            raise ValueError(f"--num_samples >= 1 and --max_batch >= 1 are needed, got "
                             f"--num_samples {args.num_samples} --max_batch {args.max_batch}")
        if args.seed is not None and not SEED_RANGE[0] <= args.seed < SEED_RANGE[1] - 2**32:
            raise ValueError(f"--seed {args.seed} is out of range: use an integer of 64 bits, "
                             f"from {SEED_RANGE[0]} to {SEED_RANGE[1] - 2**32 - 1}")
        device = resolve_device(args.device)
        prompt = read_prompt(args)
        if args.system is not None and not args.chat:
            raise ValueError("--system is the system prompt of --chat; add --chat")
        model, tokenizer, hparams = load_on_device(args.checkpoint or args.hf, device,
                                                   args.dtype)
        if args.batch_file is not None:
            return generate_batch(model, tokenizer, args, top_k)
        if args.chat:
            session = ChatSession(Engine(model, tokenizer, max_batch=1),
                                  template_for(tokenizer, hparams),
                                  replace(sampling, seed=args.seed), args.system)
    except (ValueError, FileNotFoundError, RuntimeError) as err:  # ChatDataError included
        parser.error(str(err))
    if args.chat:
        return chat_main(session, carried=bool((hparams or {}).get("chat_template")))

    generator = None
    if args.seed is not None:
        generator = seeded_generator(args.seed, device)  # every bit of the seed counts
    out, drawn = sys.stdout, []
    start = time.perf_counter()
    for i in range(args.num_samples):
        if args.num_samples > 1:
            out.write(f"--- sample {i + 1}/{args.num_samples} ---\n")
        out.write(prompt)
        out.flush()
        pieces = stream_text(model, tokenizer, prompt, args.max_new_tokens, sampling=sampling,
                             generator=generator, on_token=drawn.append)
        if args.stream:
            for piece in pieces:
                out.write(piece)
                out.flush()
        else:
            out.write("".join(pieces))
        out.write("\n")
        out.flush()
    seconds = time.perf_counter() - start
    # to stderr: stdout is the text alone, for a pipe or a file
    print(f"generate.py: {len(drawn):,} tokens in {seconds:.2f} s "
          f"({len(drawn) / max(seconds, 1e-9):,.1f} tokens/s, model load not counted)",
          file=sys.stderr, flush=True)
    return 0


def read_prompt(args) -> str:
    """--prompt, or the text of --prompt_file.

    Raises:
        ValueError: the file is missing or not UTF-8, naming it and the fix.
    """
    if args.prompt_file is None:
        return args.prompt
    if not args.prompt_file.is_file():
        raise ValueError(f"--prompt_file {args.prompt_file} does not exist")
    try:
        return args.prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt_file {args.prompt_file} is not UTF-8 text (byte "
                         f"{err.start}); convert it first, e.g. iconv -t utf-8") from None


def chat_main(session: ChatSession, *, carried: bool) -> int:
    """`generate.py --chat`: converse over stdin. What the template is goes to stderr, so
    that stdout holds the replies alone (one line each) when stdin is piped. `carried`: the
    checkpoint carries its template (a chat fine-tune's), whatever its name."""
    interactive = sys.stdin.isatty()
    name = session.template.name
    print(f"chat template {name!r}{template_note(name, carried)}; /reset starts over, "
          "/exit or Ctrl-D ends", file=sys.stderr, flush=True)
    try:
        return chat_loop(session, sys.stdin, sys.stdout, "> " if interactive else "")
    except ChatTemplateError as err:  # every message would fail alike: end, naming it
        print(f"generate.py: error: {err}", file=sys.stderr, flush=True)
        return 1


def template_note(name: str, carried: bool) -> str:
    """Where the chat template came from, decided by what the checkpoint carries, not by the
    template's name: a fine-tune on the book's records carries "book" and was tuned on it."""
    if carried:
        return " (the one this checkpoint was fine-tuned with)"
    if name == "book":
        return (" (the book's instruction prompt: this checkpoint has no chat template of its "
                "own; a model never tuned on it will just continue the text)")
    return " (gptmini's own)" if name == "gptmini" else ""
