"""python -m gptmini.testing mypkg.mod:MyAttention: the report as a table; exit 1 on a failure.
python -m gptmini.testing --device mps: the device parity check (gptmini.testing.device).

Exit status: 0 every applicable check passed, 1 one failed (or the time budget ran out
before every check ran), 2 the target could not be imported, built or run, or an option is
out of range (one line on stderr says why).
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
    parser.add_argument("target", nargs="?",
                        help="package.module:Name of a class with the book's constructor or a "
                             "factory returning an nn.Module; none: check the --device instead "
                             "(gptmini's model against CPU float64)")
    parser.add_argument("--spec", metavar="MODULE:NAME",
                        help="an AttentionSpec declaring what the signature cannot tell "
                             "(bidirectional, padding mask, window, KV cache)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="with a target: float64 (the default) makes 'unchanged' mean "
                             "unchanged to 1e-9; without: the one dtype to check the device in "
                             "(default float32 and bfloat16)")
    parser.add_argument("--backends", default="sdpa,explicit,tiled",
                        help="without a target: the attention kernels to check the device with")
    parser.add_argument("--time_budget", type=float, default=120.0,
                        help="seconds for all the checks; those not reached are reported "
                             "not applicable, with a warning (0: no limit)")
    args = parser.parse_args(argv)
    if args.target is None:
        return device_main(args)
    try:
        if not args.time_budget >= 0:  # NaN too: a gate must not pass by checking nothing
            raise ValueError(f"--time_budget {args.time_budget:g} must be 0 (no limit) or a "
                             "positive number of seconds")
        spec = load_target(args.spec) if args.spec else None
        if spec is not None and not isinstance(spec, AttentionSpec):
            raise ValueError(f"--spec {args.spec} is a {type(spec).__name__}, not an "
                             "AttentionSpec")
        report = check_attention(args.target, spec, device=args.device,
                                 dtype=DTYPES[args.dtype or "float64"],
                                 time_budget=args.time_budget or None)
    except ValueError as err:
        print(f"gptmini.testing: error: {err}", file=sys.stderr)
        return 2
    print(report)
    if report.passed and not report.finished:  # a CI gate must not pass on checks not run
        print("gptmini.testing: the time budget ran out before every check ran: not a pass; "
              "give a larger --time_budget (0: no limit)", file=sys.stderr)
        return 1
    return 0 if report.passed else 1


def device_main(args: argparse.Namespace) -> int:
    """The device parity check: 0 all within tolerance, 1 a drift, 2 no such device, no
    backend named, or nothing that could run on it."""
    from gptmini.testing.device import check_device, usable_device

    dtypes = (DTYPES[args.dtype],) if args.dtype else (torch.float32, torch.bfloat16)
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    try:
        device = usable_device(args.device, "--device")
        if not backends:
            raise ValueError(f"--backends {args.backends!r} names no attention kernel: give "
                             "a comma-separated list such as sdpa,explicit,tiled")
        try:
            report = check_device(device, dtypes, backends)
        except ValueError as err:  # the device is known good: the backends are at fault
            raise ValueError(f"--backends {args.backends}: {err}") from None
    except ValueError as err:
        print(f"gptmini.testing: error: {err}", file=sys.stderr)
        return 2
    print(report)
    if not report.checked:
        return 2
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
