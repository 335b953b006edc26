"""The conformance kit (python -m gptmini.testing) on broken attention modules: the report
must name what is wrong."""

import subprocess
import sys
import time

from robustness_cases.lab import Lab, last_line

KIT_MODULES = """
import time, torch
from gptmini.attention import MultiHeadAttention
class NaNs(MultiHeadAttention):
    def forward(self, x): return super().forward(x) * float("nan")
class Mutates(MultiHeadAttention):
    def forward(self, x):
        out = super().forward(x); x.mul_(2); return out
class Slow(MultiHeadAttention):
    def forward(self, x):
        time.sleep(0.5); return super().forward(x)
"""


def kit_case(name: str, expected: str, *extra: str):
    """python -m gptmini.testing on a broken module: the report must say `expected`."""

    def case(lab: Lab):
        where = lab.folder()
        (where / "mods.py").write_text(KIT_MODULES)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "gptmini.testing", f"mods:{name}", *extra],
                              cwd=where, env={**lab.env, "PYTHONPATH": f"{lab.tree}:{where}"},
                              capture_output=True, text=True, timeout=300)
        took = time.monotonic() - start
        if "Traceback (most recent call last)" in proc.stderr:
            return "traceback", last_line(proc)
        if expected not in proc.stdout:
            return "silent", f"no {expected!r} in the report ({took:.0f} s)"
        return "ok", f"said {expected!r} ({took:.0f} s)"

    return case


CASES = {
    "kit: a module returning NaN": kit_case("NaNs", "returns non-finite values"),
    "kit: a module changing its input": kit_case("Mutates", "changed its input tensor"),
    "kit: a slow module, 5 s budget": kit_case("Slow", "time budget of 5 s ran out",
                                               "--time_budget", "5"),
}
