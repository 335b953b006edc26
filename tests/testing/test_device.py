"""The device parity check (gptmini.testing.device), on CPU: float32 and bfloat16 "devices"
against float64, and planted wrong operations it must find and name."""

import subprocess
import sys

import pytest
import torch
from helpers import HANG_SECONDS
from torch import nn

from gptmini.testing.device import check_device


def test_float32_and_bfloat16_on_cpu_pass_within_tolerance():
    report = check_device("cpu", (torch.float32, torch.bfloat16), ("sdpa", "explicit"))
    assert report.passed, report
    assert f"torch {torch.__version__}" in str(report)
    assert [c.backend for c in report.cases] == ["sdpa", "explicit"] * 2
    assert all(0 < c.worst < c.tolerance for c in report.cases)


def middle_linear(model: nn.Module) -> tuple[str, nn.Module]:
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linears[len(linears) // 2]


def test_a_wrong_operation_is_named_with_its_module():
    """A kernel 0.1% off in one layer (a forward hook plants it): the report names that
    module as the first to drift, not a later one, nor the loss."""
    planted = []

    def alter(model):
        name, module = middle_linear(model)
        planted.append(name)
        module.register_forward_hook(lambda mod, args, out: out * 1.001)

    report = check_device("cpu", (torch.float32,), ("sdpa",), alter=alter)
    case = report.cases[0]
    assert not report.passed and case.drift.phase == "forward"
    assert case.drift.where == f"{planted[0]} (Linear)"
    assert "FAIL float32   sdpa      forward: " in str(report)


def test_a_wrong_gradient_is_found_in_the_backward_pass():
    def alter(model):
        _, module = middle_linear(model)
        module.register_full_backward_hook(lambda mod, grad_in, grad_out: (grad_in[0] * 1.01,))

    case = check_device("cpu", (torch.float32,), ("sdpa",), alter=alter).cases[0]
    assert case.drift is not None and case.drift.phase == "backward", case.line()


@pytest.mark.slow
def test_command_line_reports_and_refuses_a_missing_device():
    ok = subprocess.run([sys.executable, "-m", "gptmini.testing", "--device", "cpu", "--dtype",
                         "float32", "--backends", "sdpa"], capture_output=True, text=True,
                        timeout=HANG_SECONDS)
    assert ok.returncode == 0 and "ok   float32   sdpa" in ok.stdout, ok.stderr
    missing = subprocess.run([sys.executable, "-m", "gptmini.testing", "--device", "nosuch"],
                             capture_output=True, text=True, timeout=HANG_SECONDS)
    assert missing.returncode == 2 and "--device nosuch is not available" in missing.stderr


@pytest.mark.parametrize("flags, said", [
    (["--device", "meta"], "error: --device meta is not available"),
    (["--backends", ""], "error: --backends '' names no attention kernel"),
    (["--backends", ","], "names no attention kernel"),
    (["--backends", "nope"], "error: --backends nope: unknown attention backend 'nope'"),
    (["--backends", "flex"], "nothing was checked"),
])
def test_command_line_says_what_cannot_be_checked_in_one_line(flags, said, capsys):
    """Before: each of these raised a traceback (flex: in the CPU reference's backward)."""
    from gptmini.testing.__main__ import main

    assert main(["--dtype", "float32", *flags]) == 2
    out = capsys.readouterr()
    assert said in out.err + out.out


@pytest.mark.parametrize("device, backends, said", [
    ("meta", ("sdpa",), "the meta device holds shapes, not numbers"),
    ("nosuch", ("sdpa",), "nosuch is not available here"),
    ("cpu", ("nope",), "unknown attention backend 'nope'"),
    ("cpu", (), "no attention backend to check"),
])
def test_a_device_or_backend_that_cannot_be_checked_is_refused_by_name(device, backends, said):
    """Before: meta raised NotImplementedError deep in the comparison, an unknown or empty
    backend a GPTConfig traceback."""
    with pytest.raises(ValueError, match=said):
        check_device(device, (torch.float32,), backends)


def test_flex_on_cpu_is_skipped_with_its_reason_and_skips_alone_do_not_pass():
    report = check_device("cpu", (torch.float32,), ("flex",))
    assert report.cases[0].skipped and "no backward pass on CPU" in report.cases[0].line()
    assert report.checked == 0 and not report.passed
    assert "nothing was checked" in str(report)
    both = check_device("cpu", (torch.float32,), ("flex", "sdpa"))
    assert both.passed and both.checked == 1 and "1 skipped" in str(both)
