"""The entry scripts let idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE), set before torch
loads libgomp, unless the user chose a policy."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_SECONDS

REPO = Path(__file__).resolve().parents[1]
CHECK = """
import os, runpy, sys
runpy.run_path("train.py")  # its module code (imports, settings), not main()
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


def run(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_SECONDS, env={**env, **env_extra})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split("\n")[-2]


@pytest.mark.slow
def test_train_py_sets_passive_waiting_before_torch_unless_the_user_chose():
    assert run({}) == "PASSIVE True"  # set, and torch was loaded after it
    assert run({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE True"


@pytest.mark.parametrize("script", ["train.py", "generate.py", "evaluate.py"])
def test_entry_scripts_call_it_before_importing_anything_that_loads_torch(script):
    body = ast.parse((REPO / script).read_text()).body
    calls = [i for i, node in enumerate(body) if isinstance(node, ast.Expr)
             and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "")
             == "sleep_when_idle"]
    imports = [i for i, node in enumerate(body) if isinstance(node, ast.ImportFrom)
               and node.module != "gptmini.threads"]
    assert calls and imports and calls[0] < min(imports)


def test_sleep_when_idle_leaves_a_users_choice_and_an_imported_torch_alone(monkeypatch):
    from gptmini.threads import sleep_when_idle

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert not sleep_when_idle() and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert not sleep_when_idle()  # torch is loaded in this process: too late to matter
    assert "OMP_WAIT_POLICY" not in os.environ
