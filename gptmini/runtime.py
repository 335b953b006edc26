"""The machine a process runs on: which device, in which precision, at how many FLOP/s.

The "auto" precision is bf16 wherever the hardware does it natively, float32 elsewhere.

bfloat16 halves the bytes every matmul moves and, where the hardware has bf16 units, runs
several times faster: on a GPU with bf16 (Ampere and later), and on a CPU with AVX512-BF16
or AMX (seen here: 584-608 GFLOP/s against 162-175 in float32, and the default run 2.1x
faster). Without them, a bf16 matmul on a CPU is emulated and can crawl (about 1 GFLOP/s on
an AVX2-only CPU), so there "auto" is float32.
"""

import argparse
import functools
import os
import platform
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

__all__ = ["AUTO", "DENSE_GPU_PEAKS", "add_device_options", "auto_dtype", "auto_precision",
           "compile_blocker", "cpu_has_bf16", "device_has_bf16", "measure_matmul_flops",
           "onednn_has_bf16", "peak_flops_of", "resolve_device"]

AUTO = "auto"
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 CPUs that compute bf16 natively."""


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic units (AVX512-BF16 or AMX), from /proc/cpuinfo,
    and oneDNN, which runs its matmuls, may use them (`onednn_has_bf16`).

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
    return any(flag in flags for flag in CPU_BF16_FLAGS) and onednn_has_bf16()


def onednn_has_bf16() -> bool:
    """Whether oneDNN computes bf16 natively here: False where it is held below the CPU's
    instructions (ONEDNN_MAX_CPU_ISA=AVX2, the stand-in for an AVX2-only CPU in
    docs/recipes.md), where a bf16 matmul is emulated (2 GFLOP/s against 720 on a Xeon)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


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
        return "32-true", ("the CPU has neither AVX512-BF16 nor AMX, or oneDNN may not use "
                           "them (ONEDNN_MAX_CPU_ISA)")
    return "32-true", f"accelerator {accelerator!r}"


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls run in under a Lightning precision ("bf16-mixed", "32-true")."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


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


def add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:1, mps, ... (default: %(default)s)")
    parser.add_argument("--dtype", default=AUTO,
                        choices=[AUTO, "float32", "bfloat16", "float64"],
                        help="compute in; auto = bfloat16 where the device has bf16 units "
                             "(default: %(default)s)")


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device name ({err}); try cpu") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if torch.version.cuda is None:
            raise ValueError(
                f"--device {name} is not available: this torch ({torch.__version__}) is a "
                "CPU-only build, without CUDA. Use --device cpu, or install a CUDA build "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu128, see "
                "https://pytorch.org/get-started/locally/)"
            )
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(
                f"--device {name} is not available: this machine has {count} CUDA device(s) "
                f"(torch {torch.__version__}); use --device cpu"
            )
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {name} is not available on this machine; use --device cpu")
        return device
    try:
        torch.empty(1, device=device)
    except Exception as err:  # backends report missing devices with different types
        raise ValueError(f"--device {name} is not available ({err}); use --device cpu") from None
    return device


def compile_blocker(device: torch.device | str) -> str | None:
    """Why `torch.compile` cannot build kernels for `device` here, or None if it can.

    On a CPU, inductor writes C++ and builds it with the machine's compiler (`$CXX`, else
    g++ or clang++; cl on Windows): a laptop without one would fail at the first training
    step, deep inside torch. CUDA GPUs compile through Triton, which ships with CUDA builds;
    inductor's Apple GPU backend is a prototype, so mps is answered with a reason too.
    """
    kind = torch.device(device).type
    if kind == "mps":  # the default run compiles, and an Apple GPU should still train it
        return ("torch.compile's Apple GPU (mps) backend is a prototype in torch 2.x; set "
                "--model.compile false there")
    if kind != "cpu":
        return None
    if os.environ.get("CXX"):
        names = (os.environ["CXX"],)
    else:
        names = ("cl",) if platform.system() == "Windows" else ("g++", "clang++", "c++")
    if any(shutil.which(name) for name in names):
        return None
    return (f"torch.compile on a CPU builds C++ kernels and found no compiler ({', '.join(names)}"
            " on PATH); install one (e.g. apt install g++, xcode-select --install) or set "
            "--model.compile false")


DENSE_GPU_PEAKS: Mapping[str, Mapping] = MappingProxyType({
    "h200 nvl": MappingProxyType({torch.bfloat16: 835.5e12, torch.float16: 835.5e12,
                                  "tfloat32": 417.5e12, torch.float32: 60e12}),
    "h200": MappingProxyType({torch.bfloat16: 989.4e12, torch.float16: 989.4e12,
                              "tfloat32": 494.7e12, torch.float32: 66.9e12}),
})
"""Dense peak FLOP/s of GPUs that Lightning's table (2.6) misses or overstates, matched by a
lower-cased substring of the device's name, first match first. NVIDIA's H200 datasheet
gives tensor rates with 2:4 sparsity; Lightning copies those (2.0e15 bf16 for "h200 sxm1",
twice the H100 SXM's dense 989.4e12 on the same chip) and does not match the name the SXM
part reports ("NVIDIA H200"), so MFU was either missing or halved. These are the
datasheet's figures halved (bench/gpu_proof.py reports MFU against them)."""


def peak_flops_of(device: torch.device, dtype: torch.dtype = torch.float32) -> float | None:
    """Peak FLOP/s of one device computing in `dtype`.

    GPUs from DENSE_GPU_PEAKS, else Lightning's table, which tells an H100 SXM from a PCIe
    card; both count TF32 for float32 when matmuls may use it. A CPU by measuring its
    matmul rate in `dtype`, once per process. None for a device neither knows.
    """
    if device.type == "cpu":
        return measure_matmul_flops(dtype=dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        table = next((t for chip, t in DENSE_GPU_PEAKS.items() if chip in name), None)
        if table is not None:
            tf32 = dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest"
            return table.get("tfloat32" if tf32 else dtype)
    from lightning.fabric.utilities.throughput import get_available_flops  # GPUs' table only

    flops = get_available_flops(device, dtype)
    return float(flops) if flops else None


@functools.cache
def measure_matmul_flops(size: int = 1024, seconds: float = 0.5,
                         dtype: torch.dtype = torch.float32) -> float:
    """The CPU's matmul rate in FLOP/s for `dtype`, measured over about `seconds` (cached)."""
    gen = torch.Generator().manual_seed(0)  # leaves the global generator (dropout) alone
    a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
    a @ b  # warm up threads and caches
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        runs += 1
    return 2 * size**3 * runs / elapsed
