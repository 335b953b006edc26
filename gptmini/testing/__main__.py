"""python -m gptmini.testing mypkg.mod:MyAttention: the report as a table; exit 1 on a failure.

Exit status: 0 every applicable check passed, 1 one failed, 2 the target could not be
imported, built or run (one line on stderr says why).
"""

import argparse
import sys

import torch

from gptmini.testing.kit import check_attention, load_target
from gptmini.testing.subject import AttentionSpec

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gptmini.testing",
        description="Check an attention module against the properties gptmini proves for its "
                    "own: causality, padding, windows, KV cache, the book's numbers and more.")
    parser.add_argument("target", help="package.module:Name of a class with the book's "
                        "constructor or a factory returning an nn.Module")
    parser.add_argument("--spec", metavar="MODULE:NAME",
                        help="an AttentionSpec declaring what the signature cannot tell "
                             "(bidirectional, padding mask, window, KV cache)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float64", choices=DTYPES,
                        help="float64 (the default) makes 'unchanged' mean unchanged to 1e-9")
    parser.add_argument("--time_budget", type=float, default=120.0,
                        help="seconds for all the checks; those not reached are reported "
                             "not applicable, with a warning (0: no limit)")
    args = parser.parse_args(argv)
    try:
        spec = load_target(args.spec) if args.spec else None
        if spec is not None and not isinstance(spec, AttentionSpec):
            raise ValueError(f"--spec {args.spec} is a {type(spec).__name__}, not an "
                             "AttentionSpec")
        report = check_attention(args.target, spec, device=args.device, dtype=DTYPES[args.dtype],
                                 time_budget=args.time_budget or None)
    except ValueError as err:
        print(f"gptmini.testing: error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
