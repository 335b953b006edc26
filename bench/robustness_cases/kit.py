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
class Book(torch.nn.Module):  # Listing 3.5 as the book prints it
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = torch.nn.Linear(d_out, d_out)
        self.dropout = torch.nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))
    def forward(self, x):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        keys, queries, values = split(self.W_key(x)), split(self.W_query(x)), split(self.W_value(x))
        scores = queries @ keys.transpose(2, 3)
        scores.masked_fill_(self.mask.bool()[:n, :n], -torch.inf)
        weights = self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1))
        return self.out_proj((weights @ values).transpose(1, 2).contiguous().view(b, n, self.d_out))
"""


def kit_case(name: str, expected: str, *extra: str, status: int | None = None):
    """python -m gptmini.testing on a module (`name`, or none: the device check): the report
    or the error must say `expected`, and with `status` the exit status must be that."""

    def case(lab: Lab):
        where = lab.folder()
        (where / "mods.py").write_text(KIT_MODULES)
        start = time.monotonic()
        target = [f"mods:{name}"] if name else []
        proc = subprocess.run([sys.executable, "-m", "gptmini.testing", *target, *extra],
                              cwd=where, env={**lab.env, "PYTHONPATH": f"{lab.tree}:{where}"},
                              capture_output=True, text=True, timeout=300)
        took = time.monotonic() - start
        if "Traceback (most recent call last)" in proc.stderr:
            return "traceback", last_line(proc)
        if expected not in proc.stdout + proc.stderr:
            return "silent", f"no {expected!r} in the report ({took:.0f} s)"
        if status is not None and proc.returncode != status:
            return "silent", f"exit {proc.returncode}, wanted {status} ({took:.0f} s)"
        return ("clear error" if proc.returncode == 2 else "ok"), (
            f"said {expected!r}, exit {proc.returncode} ({took:.0f} s)")

    return case


CASES = {
    "kit: a module returning NaN": kit_case("NaNs", "returns non-finite values"),
    "kit: a module changing its input": kit_case("Mutates", "changed its input tensor"),
    "kit: a slow module, 5 s budget": kit_case("Slow", "time budget of 5 s ran out",
                                               "--time_budget", "5", status=1),
    "kit: --time_budget -1": kit_case("Book", "--time_budget -1 must be 0", "--time_budget",
                                      "-1", status=2),
    "kit: --time_budget nan": kit_case("Book", "--time_budget nan must be 0", "--time_budget",
                                       "nan", status=2),
    "kit: the book's attention in float16": kit_case(
        "Book", "ok   large_inputs_finite", "--dtype", "float16", status=0),
    "kit: the book's attention in bfloat16": kit_case(
        "Book", "ok   large_inputs_finite", "--dtype", "bfloat16", status=0),
    "device check: --device meta": kit_case("", "--device meta is not available", "--device",
                                            "meta", status=2),
    "device check: --backends ''": kit_case("", "names no attention kernel", "--backends", "",
                                            status=2),
    "device check: --backends nope": kit_case("", "unknown attention backend 'nope'",
                                              "--backends", "nope", status=2),
    "device check: --backends flex on CPU": kit_case("", "skip float32   flex", "--backends",
                                                     "flex", "--dtype", "float32", status=2),
}
