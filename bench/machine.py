"""What machine a benchmark ran on, read once for every script in bench/."""

import platform
from pathlib import Path

from gptmini.runtime import CPU_BF16_FLAGS


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what platform knows of it elsewhere."""
    names = [ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")]
    return names[0] if names else (platform.processor() or platform.machine())


def cpu_description() -> str:
    """The CPU's name and the vector units that set its speed, e.g. "... (avx2 avx512f)"."""
    flags = next((ln.split(":", 1)[1].split() for ln in _cpuinfo() if ln.startswith("flags")),
                 [])
    simd = [f for f in flags if f in ("avx2", "avx512f", *CPU_BF16_FLAGS, "amx_tile")]
    return f"{cpu_name()} ({' '.join(simd) or 'no AVX2'})"
