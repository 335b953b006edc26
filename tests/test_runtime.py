"""The "auto" precision: bf16 where the hardware has bf16 units, float32 elsewhere."""

import os
import platform
import subprocess
import sys

import pytest
import torch

import gptmini.runtime as precision
from gptmini.model import lm_loss
from gptmini.runtime import auto_dtype, auto_precision, cpu_has_bf16, peak_flops_of

CPUINFO = "processor\t: 0\nflags\t\t: fpu vme sse sse2 avx2 {extra}\nbugs\t\t: none\n"


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU with the given extra flags (Linux, no GPU)."""

    def with_flags(extra: str):
        monkeypatch.setattr(precision.platform, "system", lambda: "Linux")
        monkeypatch.setattr(precision.Path, "read_text",
                            lambda self: CPUINFO.format(extra=extra))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(precision, "onednn_has_bf16", lambda: True)
        cpu_has_bf16.cache_clear()

    yield with_flags
    cpu_has_bf16.cache_clear()


@pytest.mark.parametrize(("flags", "expected"), [
    ("avx512f avx512_bf16", "bf16-mixed"),  # e.g. AMD Zen 4/5, Intel Cooper Lake
    ("avx512f amx_tile amx_bf16", "bf16-mixed"),  # Intel Sapphire Rapids and later
    ("avx512f", "32-true"),  # AVX-512 without bf16
    ("", "32-true"),  # AVX2 only: a bf16 matmul would crawl
])
def test_auto_is_bf16_only_on_cpus_with_bf16_units(cpu, flags, expected):
    cpu(flags)
    assert auto_precision("auto")[0] == expected == auto_precision("cpu")[0]
    assert auto_dtype("auto", "cpu") == (torch.bfloat16 if expected == "bf16-mixed"
                                         else torch.float32)


def test_auto_is_float32_where_onednn_is_held_below_the_cpus_bf16(cpu, monkeypatch):
    """bf16 flags, but oneDNN limited to AVX2 (the docs' stand-in for an AVX2-only CPU):
    its bf16 matmuls would be emulated, so float32."""
    cpu("avx512f amx_tile amx_bf16")
    monkeypatch.setattr(precision, "onednn_has_bf16", lambda: False)
    assert auto_precision("cpu")[0] == "32-true"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="ONEDNN_MAX_CPU_ISA=AVX2 names an x86 instruction set")
def test_onednn_held_to_avx2_has_no_bf16():
    """On any x86 CPU: ONEDNN_MAX_CPU_ISA=AVX2 (read when oneDNN starts) leaves no bf16."""
    code = "from gptmini.runtime import onednn_has_bf16; print(onednn_has_bf16())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}, check=True)
    assert out.stdout.strip() == "False"


def test_auto_on_a_gpu_asks_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    for bf16, expected in ((True, "bf16-mixed"), (False, "32-true")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda bf16=bf16: bf16)
        assert auto_precision("auto")[0] == expected == auto_precision("gpu")[0]


def test_explicit_choices_and_bad_names():
    assert auto_dtype("float32", "cpu") == torch.float32
    assert auto_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'half' is not one of auto, float32, bfloat16"):
        auto_dtype("half", "cpu")



@pytest.fixture
def matmul_precision():
    """Set torch's float32 matmul precision for a test, and put it back."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(("name", "bf16"), [
    ("NVIDIA H200", 989.4e12),  # the SXM part's name: Lightning 2.6 knows no such chip
    ("NVIDIA H200 NVL", 835.5e12),
    ("NVIDIA H100 80GB HBM3", 989.4e12),  # Lightning's table, dense
])
def test_a_gpus_peak_is_its_dense_rate(monkeypatch, matmul_precision, name, bf16):
    """MFU divides by the dense peak: an H200 is an H100's chip, so never twice its rate."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    cuda = torch.device("cuda")
    assert peak_flops_of(cuda, torch.bfloat16) == pytest.approx(bf16)
    if "H200" in name:
        matmul_precision("highest")
        fp32 = peak_flops_of(cuda, torch.float32)
        matmul_precision("high")  # float32 matmuls may use TF32
        assert fp32 < peak_flops_of(cuda, torch.float32) < bf16


def test_compile_needs_a_cpp_compiler_on_a_cpu(monkeypatch, tmp_path):
    """No compiler on PATH: the reason names the fix; $CXX or g++ found, or a GPU: None."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, clang++, c++
    reason = precision.compile_blocker("cpu")
    assert reason is not None and "--model.compile false" in reason and "g++" in reason
    assert precision.compile_blocker("cuda") is None  # Triton, not a C++ compiler
    assert "prototype" in precision.compile_blocker("mps")
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert precision.compile_blocker("cpu") is None
    fake.unlink()
    monkeypatch.setenv("CXX", str(tmp_path / "my-cxx"))
    assert "my-cxx" in precision.compile_blocker("cpu")


def test_a_compiled_run_without_a_compiler_warns_and_trains_eagerly(monkeypatch, tmp_path):
    from gptmini.train.module import GPTLitModule

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    module = GPTLitModule(tokenizer="byte", context_length=8, emb_dim=16, n_heads=2,
                          n_layers=1, compile=True)
    with pytest.warns(UserWarning, match="no compiler.*training eagerly"):
        module.configure_model()
    batch = torch.randint(0, 257, (2, 9))
    loss = lm_loss(module.model, batch[:, :-1], batch[:, 1:])  # eager: no C++ is built
    assert torch.isfinite(loss)
