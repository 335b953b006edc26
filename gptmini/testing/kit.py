"""check_attention: run the checks on a target and report, one row per property."""

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gptmini.testing.checks import CHECKS
from gptmini.testing.subject import (
    AttentionSpec,
    NotApplicable,
    OutOfTime,
    Subject,
    one_line,
)


@dataclass
class CheckResult:
    name: str
    status: str
    """"passed", "failed" or "not applicable"."""
    detail: str = ""
    loud: bool = False
    """A not-applicable row whose absence leaves a class of bugs unseen: the report warns."""
    out_of_time: bool = False
    """Not run because the time budget ran out first."""


@dataclass
class Report:
    """One row per property: passed, failed with the smallest input that shows it, or not
    applicable and why."""

    target: str
    tested: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def finished(self) -> bool:
        """Every check ran or was not applicable by design (none left for lack of time)."""
        return not any(r.out_of_time for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        return next(r for r in self.results if r.name == name)

    def __str__(self) -> str:
        width = max(len(r.name) for r in self.results)
        marks = {"passed": "ok  ", "failed": "FAIL", "not applicable": "n/a "}
        lines = [f"attention conformance: {self.target}", f"tested: {self.tested}", ""]
        for r in self.results:
            mark = "n/a!" if r.loud else marks[r.status]
            lines.append(f"{mark} {r.name:<{width}}  {r.detail}".rstrip())
        counts = {s: sum(r.status == s for r in self.results) for s in marks}
        lines.append("")
        lines.append(f"{counts['passed']} passed, {counts['failed']} failed, "
                     f"{counts['not applicable']} not applicable")
        lines += [f"WARNING: {r.name} not tested: {r.detail}" for r in self.results if r.loud]
        return "\n".join(lines)


def load_target(path: str) -> Callable:
    """"package.module:Name" to the object it names.

    Raises:
        ValueError: not of that form, it does not import, or nothing of that name.
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{path!r} is not 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - whatever the import raised, one line says it
        raise ValueError(f"cannot import {module_name!r}: {one_line(err)}") from None
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{module_name} has no {attribute!r}")
        target = getattr(target, part)
    return target


def prepare(target: Callable[..., nn.Module] | str, spec: AttentionSpec | None = None, *,
            device: str | torch.device = "cpu", dtype: torch.dtype = torch.float64
            ) -> tuple[str, Subject]:
    """The target's name and a Subject that builds it, after one trial build and call.

    Raises:
        ValueError: the target cannot be imported, built or run at all.
    """
    name = target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))
    target = load_target(target) if isinstance(target, str) else target
    if not callable(target):
        raise ValueError(f"{name} is a {type(target).__name__}, not a class or factory")
    subject = Subject(target, spec or AttentionSpec(), dtype, device)
    try:
        start = time.monotonic()
        out = subject.call(subject.build(), subject.inputs(1, 3), trial=True)
        subject.call_seconds = time.monotonic() - start
    except Exception as err:  # noqa: BLE001 - the user's code: any error, reported in one line
        raise ValueError(f"cannot build and run {name}: {one_line(err)}"
                         f"{_factory_hint(name, subject)}") from err
    if not isinstance(out, Tensor):
        raise ValueError(f"{name} returned a {type(out).__name__}, not a tensor")
    return name, subject


def _factory_hint(name: str, subject: Subject) -> str:
    """A constructor without the book's arguments was built with what it accepts, and its
    own sizes rarely match the kit's inputs ("mat1 and mat2 shapes cannot be multiplied"):
    say how it was built and that a factory fixes it."""
    if subject.book_constructor:
        return ""
    given = ", ".join(f"{k}={v}" for k, v in subject.constructor_kwargs().items())
    short = name.rsplit(".", 1)[-1].rsplit(":", 1)[-1]
    return (f". It was built as {short}({given}) and given inputs of width "
            f"d_in={subject.d_in}: for a constructor that does not take the book's (d_in, "
            "d_out, context_length, dropout, num_heads), pass a factory that builds it at the "
            f"kit's sizes, e.g. check_attention(lambda: {short}(<its width>={subject.d_in}, "
            f"<its heads>={subject.num_heads}), AttentionSpec(d_in={subject.d_in}, "
            f"num_heads={subject.num_heads}))")


def describe(subject: Subject) -> str:
    """What the report tested, in one line."""
    s = subject.spec
    constructor = "the book's constructor" if subject.book_constructor else "a factory"
    heads = subject.num_heads if subject.heads_known else "unknown"
    declared = [f"padding mask {s.padding!r} (True = {s.padding_marks})"] if s.padding else []
    if s.window is not None:
        declared.append(f"window {s.window} via {s.window_kwarg!r}")
    if s.kv_step is not None:
        declared.append("KV cache")
    if s.positions is not None:
        declared.append(f"positions via {s.positions!r}")
    if not s.softmax:
        declared.append("linear attention (no softmax)")
    return (f"{constructor}, d_in={subject.d_in}, d_out={subject.d_out}, num_heads={heads}, "
            f"context_length={subject.context_length}, "
            f"{str(subject.dtype).removeprefix('torch.')} on {subject.device}; "
            f"{'causal' if s.causal else 'attends both ways'}; "
            f"declared: {', '.join(declared) or 'no padding mask, window or KV cache'}")


def run_check(subject: Subject, name: str) -> CheckResult:
    """One check by name: passed, failed, or not applicable (never an exception)."""
    check = dict(CHECKS)[name]
    try:
        status, detail = check(subject)
    except NotApplicable as why:
        return CheckResult(name, "not applicable", str(why), loud=why.loud,
                           out_of_time=isinstance(why, OutOfTime))
    except Exception as err:  # noqa: BLE001 - the module broke on this check's input: a failure
        return CheckResult(name, "failed", one_line(err))
    return CheckResult(name, status, detail)


def check_attention(target: Callable[..., nn.Module] | str, spec: AttentionSpec | None = None,
                    *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float64,
                    time_budget: float | None = 120.0) -> Report:
    """Run every check that applies to `target`; returns the report (also when it fails).

    Args:
        target: a class with the book's constructor (d_in, d_out, context_length, dropout,
            num_heads, qkv_bias=False), a factory returning an nn.Module that maps
            (b, num_tokens, d_in) to (b, num_tokens, d_out) (called with whichever of the
            book's arguments it takes), or "package.module:Name".
        spec: what the signature cannot reveal (causal or not, padding, window, KV cache,
            positions).
        device: where to run.
        dtype: float64 by default, so that "unchanged" means unchanged to 1e-9.
        time_budget: seconds for all the checks (None: no limit); a check the budget does
            not reach is reported not applicable, with a warning (a correct module takes
            well under a second in all; a slow one would otherwise run for minutes).

    Raises:
        ValueError: the target cannot be imported, built or run at all, or `time_budget` is
            not a positive number of seconds (a budget of none would pass by checking nothing).
    """
    if time_budget is not None and (isinstance(time_budget, bool) or not time_budget > 0):
        raise ValueError(f"time_budget must be a positive number of seconds (None: no limit), "
                         f"got {time_budget!r}")
    name, subject = prepare(target, spec, device=device, dtype=dtype)
    report = Report(name, describe(subject))
    if time_budget is not None:
        subject.time_budget = time_budget
        subject.deadline = time.monotonic() + time_budget
    report.results = [run_check(subject, check_name) for check_name, _ in CHECKS]
    return report


def assert_attention(target: Callable[..., nn.Module] | str, spec: AttentionSpec | None = None,
                     **options) -> Report:
    """`check_attention`, raising AssertionError with the report when a check fails."""
    report = check_attention(target, spec, **options)
    if not report.passed:
        raise AssertionError("\n" + str(report))
    return report
