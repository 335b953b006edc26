"""bf16 wherever the hardware does it natively, float32 elsewhere: the "auto" precision.

bfloat16 halves the bytes every matmul moves and, where the hardware has bf16 units, runs
several times faster: on a GPU with bf16 (Ampere and later), and on a CPU with AVX512-BF16
or AMX (seen here: 584-608 GFLOP/s against 162-175 in float32, and the default run 2.1x
faster). Without them, a bf16 matmul on a CPU is emulated and can crawl (about 1 GFLOP/s on
an AVX2-only CPU), so there "auto" is float32.
"""

import functools
import platform
from pathlib import Path

import torch

__all__ = ["AUTO", "auto_precision", "auto_dtype", "cpu_has_bf16", "device_has_bf16"]

AUTO = "auto"
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 CPUs that compute bf16 natively."""


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic units (AVX512-BF16 or AMX), from /proc/cpuinfo.

    Linux's flags are the public record; elsewhere (macOS, Windows) the answer is False, the
    safe side: float32 is never slow.
    """
    if platform.system() != "Linux":
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def device_has_bf16(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()


def auto_precision(accelerator: str | None) -> tuple[str, str]:
    """Lightning precision for `accelerator` ("auto", "cpu", "gpu", "cuda", ...), and why.

    Returns:
        ("bf16-mixed" or "32-true", a short reason to print).
    """
    accelerator = str(accelerator or "auto")
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto"
                                                and torch.cuda.is_available())
    if on_gpu:
        if device_has_bf16("cuda"):
            return "bf16-mixed", f"the GPU ({torch.cuda.get_device_name()}) has bf16"
        return "32-true", "the GPU has no bf16"
    if accelerator in ("auto", "cpu"):
        if cpu_has_bf16():
            return "bf16-mixed", "the CPU has AVX512-BF16 or AMX"
        return "32-true", "the CPU has neither AVX512-BF16 nor AMX"
    return "32-true", f"accelerator {accelerator!r}"


def auto_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The dtype to generate in: "float32", "bfloat16", "float64" (exact comparisons), or
    "auto" (bf16 where native).

    Raises:
        ValueError: an unknown name.
    """
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
    if name == AUTO:
        return torch.bfloat16 if device_has_bf16(device) else torch.float32
    if name not in choices:
        raise ValueError(f"dtype {name!r} is not one of auto, float32, bfloat16, float64")
    return choices[name]
