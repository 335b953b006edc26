"""How the entry scripts share a CPU: OpenMP threads that sleep when idle.

torch's CPU build runs its intra-op work on GNU OpenMP, one thread per core. Left at
libgomp's default, a thread that finishes its share of a parallel region spins before it
sleeps; when another busy process holds a core, the thread the others wait for is off the
CPU and every region stalls. Measured 2026-11-25 on a 2-core Xeon (the default model's
fp32 training step, 2 threads, the machine loaded by other work, so figures are rough):
with one busy competitor, 852 tok/s at libgomp's default against 3,414 with
OMP_WAIT_POLICY=PASSIVE (1 thread: 3,399); alone, 6,951 against 6,130. PASSIVE gives up
about a tenth alone to keep the fair share when shared, so the entry scripts use it unless
the user set OMP_WAIT_POLICY. It changes how threads wait, not how work is split, so the
numbers (and exact resume) are the same.

This module imports nothing heavy: the setting must be in the environment before torch
loads libgomp, which reads it once.
"""

import os
import sys


def sleep_when_idle() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user chose a policy; process-wide, so only
    entry scripts call it, before importing torch. Returns whether it applies now (False:
    the user's choice stands, or torch was imported already)."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
