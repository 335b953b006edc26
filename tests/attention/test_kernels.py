"""Kernels: the built-ins are a fixed table, and a kernel of your own (the docs' example)
is passed as a class or named by import path; it runs everywhere a built-in one does and
equals the explicit path. Which names are valid never depends on what was imported first."""

import functools
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS

from gptmini.attention import KVCache, MultiHeadAttention, kernels
from gptmini.model import GPTConfig, GPTModel, lm_loss
from gptmini.testing import AttentionSpec, check_attention

REPO = Path(__file__).resolve().parents[2]
README = REPO / "docs" / "attention.md"  # the page that holds the example kernel


def readme_code() -> str:
    text = README.read_text()
    section = text[text.index("**Kernels are a table.**"):]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.fixture
def readme_kernel(tmp_path, monkeypatch, capsys):
    """The docs' example backend, saved as a module of the reader's (`readme_kernels`,
    importable for the test's length) and imported; its class."""
    (tmp_path / "readme_kernels.py").write_text(readme_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("readme_kernels")
    assert capsys.readouterr().out == "torch.Size([2, 5, 8])\n"
    yield module.Float64Kernel
    sys.modules.pop("readme_kernels", None)


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_a_kernel_class_equals_the_explicit_path_with_padding_windows_and_gqa(
        readme_kernel, kv_heads):
    def make(backend):
        torch.manual_seed(0)
        return MultiHeadAttention(8, 8, 16, 0.0, 2, num_kv_heads=kv_heads, window_size=4,
                                  backend=backend)

    x = torch.randn(2, 9, 8)
    real = torch.ones(2, 9, dtype=torch.long)
    real[0, :3] = 0  # left padding: queries with no key at all
    got, want = make(readme_kernel)(x, real), make("explicit")(x, real)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (got[0, :3] == 0).all()


def test_a_kernel_by_import_path_builds_a_model_that_trains_and_decodes(readme_kernel,
                                                                        tiny_config):
    model = GPTModel(replace(tiny_config, attention_backend="readme_kernels:Float64Kernel"))
    assert all(isinstance(block.att.kernel, readme_kernel) for block in model.trf_blocks)
    idx = torch.randint(0, 64, (2, 12))
    loss = lm_loss(model, idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert model.tok_emb.weight.grad.abs().sum() > 0
    model.eval()
    caches = model.new_kv_caches()
    with torch.no_grad():
        steps = [model(idx[:, :6], kv_caches=caches)]
        steps += [model(idx[:, t:t + 1], kv_caches=caches) for t in range(6, 12)]
        torch.testing.assert_close(torch.cat(steps, 1), model(idx), atol=1e-5, rtol=1e-5)


def test_the_conformance_kit_passes_a_kernel_class(readme_kernel):
    def kv_step(module, x_new, cache):
        cache = cache or KVCache()
        return module(x_new, kv_cache=cache), cache

    spec = AttentionSpec(padding="attention_mask", padding_marks="real", window=4,
                         kv_step=kv_step)
    report = check_attention(functools.partial(MultiHeadAttention, backend=readme_kernel), spec,
                             time_budget=None)
    assert report.passed, str(report)


def test_unknown_and_malformed_kernels_are_named(readme_kernel):
    with pytest.raises(ValueError, match="backend must be one of sdpa, explicit, flex, tiled, "
                                         ".*'package.module:ClassName', got 'fast'"):
        kernels.make_kernel("fast")
    with pytest.raises(ValueError, match="backend 'no_such_package.kernels:Fast': cannot "
                                         "import no_such_package.kernels"):
        kernels.make_kernel("no_such_package.kernels:Fast")
    with pytest.raises(ValueError, match="readme_kernels has no Float32Kernel"):
        MultiHeadAttention(8, 8, 16, 0.0, 2, backend="readme_kernels:Float32Kernel")
    with pytest.raises(ValueError, match="not a class"):
        kernels.make_kernel("readme_kernels:torch")
    with pytest.raises(ValueError, match="GPTConfig.attention_backend='fast' is invalid: use "
                                         "one of sdpa, explicit, flex, tiled, or a kernel"):
        GPTConfig(attention_backend="fast")
    # an import path is a valid name as written; it is imported when the model is built
    cfg = GPTConfig(attention_backend="no_such_package.kernels:Fast", n_layers=1)
    with pytest.raises(ValueError, match="cannot import no_such_package.kernels"):
        GPTModel(cfg)


def test_the_built_in_table_is_read_only_and_the_only_registry():
    assert not hasattr(kernels, "register")
    with pytest.raises(TypeError):
        kernels.KERNELS["float64"] = object  # a kernel of your own is passed, not registered
    assert list(kernels.KERNELS) == ["sdpa", "explicit", "flex", "tiled"]


def test_which_names_are_valid_does_not_depend_on_what_was_imported_first(tmp_path):
    """Two processes ask GPTConfig about the same names, one after importing the docs'
    kernel module (which once registered "float64" as it was imported), one before."""
    (tmp_path / "readme_kernels.py").write_text(readme_code())
    ask = ("import json\nfrom gptmini.model import GPTConfig\n"
           "def valid(name):\n"
           "    try:\n        GPTConfig(attention_backend=name)\n        return True\n"
           "    except ValueError:\n        return False\n"
           "print(json.dumps({n: valid(n) for n in ('sdpa', 'float64', "
           "'readme_kernels:Float64Kernel')}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    def answers(first: str) -> dict:
        done = subprocess.run([sys.executable, "-c", first + ask], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=HANG_SECONDS)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    plain = answers("")
    assert plain == {"sdpa": True, "float64": False, "readme_kernels:Float64Kernel": True}
    assert answers("import readme_kernels\n") == plain


def test_a_new_built_in_kernel_is_one_file_and_its_name_in_the_table(package_copy):
    """The docs' kernel made a built-in: its file in kernels/ and one line in KERNELS (its
    import path, loaded when a model names it, as flex and tiled are); then GPTConfig, the
    model and the module take it."""
    kernel = re.search(r"class Float64Kernel:.*?\n(?=\S)", readme_code(), re.S).group(0)
    package_copy.write("attention/kernels/float64.py", f"import torch\n\n\n{kernel}")
    package_copy.insert_after("attention/kernels/__init__.py", '"tiled": "gptmini.attention',
                              '    "float64": "gptmini.attention.kernels.float64:Float64Kernel",')
    assert package_copy.changed() == ["attention/kernels/__init__.py",
                                      "attention/kernels/float64.py"]
    out = package_copy.run(
        "import torch\nfrom gptmini.model import GPTConfig, GPTModel\n"
        "cfg = GPTConfig(vocab_size=64, context_length=16, emb_dim=16, n_heads=2, n_layers=2,"
        " drop_rate=0.0, attention_backend='float64')\n"
        "torch.manual_seed(0)\nmodel = GPTModel(cfg).eval()\n"
        "for block in model.trf_blocks:\n    block.att.backend = 'explicit'\n"
        "idx = torch.randint(0, 64, (2, 10))\nwant = model(idx)\n"
        "for block in model.trf_blocks:\n    block.att.backend = 'float64'\n"
        "print(type(model.trf_blocks[0].att.kernel).__name__, "
        "float((model(idx) - want).abs().max()))\n")
    name, gap = out.split()
    assert name == "Float64Kernel" and float(gap) < 1e-5


def test_a_cached_call_on_a_gpu_keeps_sdpa_off_cudnn():
    """cuDNN's attention builds a graph per key length: with a cache, every decode step
    (measured 7-13x slower on an H200); training and a CPU keep torch's own choice."""
    from torch.nn.attention import SDPBackend

    from gptmini.attention.kernels.sdpa import backends_for

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert SDPBackend.CUDNN_ATTENTION not in backends_for(cuda, uses_cache=True)
    assert SDPBackend.FLASH_ATTENTION in backends_for(cuda, uses_cache=True)
    assert backends_for(cuda, uses_cache=False) is None
    assert backends_for(cpu, uses_cache=True) is None
