"""The kit's checks as pytest test cases, one per property, for the modules named on the
command line:

    pytest -p gptmini.testing.pytest_plugin --attention mypkg.mod:MyAttention

(or `pytest_plugins = ["gptmini.testing.pytest_plugin"]` in a conftest.py). The cases join
the collected tests, marked `attention`: add `-m attention` to run only them. A failed
check fails with its counterexample; a check that does not apply is skipped, saying why.
Options: --attention-spec MODULE:NAME (an AttentionSpec), --attention-device,
--attention-dtype. torch is imported only when --attention is given.
"""

import os
import sys

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("attention", "gptmini attention conformance kit")
    group.addoption("--attention", action="append", default=[], metavar="MODULE:NAME",
                    help="check this attention class or factory (repeatable)")
    group.addoption("--attention-spec", default=None, metavar="MODULE:NAME",
                    help="an AttentionSpec for the checked modules (padding, window, KV cache)")
    group.addoption("--attention-device", default="cpu", help="device to run the checks on")
    group.addoption("--attention-dtype", default="float64",
                    choices=["float64", "float32", "bfloat16", "float16"])


def pytest_configure(config):
    config.addinivalue_line("markers", "attention: a gptmini.testing conformance check")


class AttentionCheck(pytest.Item):
    """One property of one target."""

    def __init__(self, *, target: str, check: str, **kwargs):
        super().__init__(**kwargs)
        self.target, self.check = target, check
        self.add_marker("attention")

    def runtest(self):
        from gptmini.testing.kit import run_check

        subject = _subject(self.config, self.target)
        result = run_check(subject, self.check)
        if result.status == "not applicable":
            pytest.skip(result.detail)
        if result.status == "failed":
            raise CheckFailed(result.detail)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, CheckFailed | _TargetError):
            return f"{self.check}: {excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.target}::{self.check}"


class CheckFailed(Exception):
    """A property that does not hold; the message is the counterexample."""


class _TargetError(Exception):
    """The target cannot be imported, built or run."""


_subjects: dict = {}


def _subject(config, target: str):
    if target not in _subjects:
        import torch

        from gptmini.testing.kit import load_target, prepare

        try:
            spec_path = config.getoption("attention_spec")
            spec = load_target(spec_path) if spec_path else None
            dtype = getattr(torch, config.getoption("attention_dtype"))
            _subjects[target] = prepare(target, spec, device=config.getoption("attention_device"),
                                        dtype=dtype)[1]
        except ValueError as err:
            _subjects[target] = _TargetError(str(err))
    subject = _subjects[target]
    if isinstance(subject, Exception):
        raise subject
    return subject


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect
def pytest_collection_modifyitems(session, config, items):
    targets = config.getoption("attention")
    if not targets:
        return
    if os.getcwd() not in sys.path:  # as `python -m pytest` would: the project's modules import
        sys.path.insert(0, os.getcwd())
    from gptmini.testing.checks import CHECKS

    for target in targets:
        for check, _ in CHECKS:
            items.append(AttentionCheck.from_parent(session, name=f"attention[{target}::{check}]",
                                                    target=target, check=check))
