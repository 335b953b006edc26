"""python -m gptmini.checkpoint consolidate DIR [OUT]: a sharded checkpoint (the directory
an --trainer.strategy fsdp2 run saves) as one file (gptmini.checkpoint.sharded.consolidate).

Exit status: 0 written, 1 the directory could not be read or the file written (one line on
stderr says why).
"""

import argparse
import sys

from gptmini.checkpoint.sharded import consolidate, consolidated_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptmini.checkpoint",
                                     description="Work on gptmini checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    whole = commands.add_parser(
        "consolidate", help="write a sharded checkpoint (a directory) as one .ckpt file",
        description="Write a sharded checkpoint (the directory an --trainer.strategy fsdp2 "
                    "run saves) as the one file generate.py, serve.py, evaluate.py, the "
                    "Hugging Face export and an unsharded resume read.")
    whole.add_argument("directory", help="the sharded checkpoint, e.g. "
                                         "runs/NAME/checkpoints/last.ckpt")
    whole.add_argument("out", nargs="?", help="the file to write (default: beside it, "
                                              f"{consolidated_path('last.ckpt')} for last.ckpt)")
    opts = parser.parse_args(argv)
    try:
        written = consolidate(opts.directory, opts.out)
    except (ValueError, OSError) as err:
        print(f"python -m gptmini.checkpoint: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
