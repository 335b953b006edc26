"""The GPU path: `pytest -m gpu` on a machine with CUDA (skipped everywhere else).

bf16-mixed and 16-mixed training (compiled), the flash kernel on the plain causal path,
the KV cache against recompute, no host sync between logging steps (also under FSDP2 with
Muon), and a checkpoint trained on the GPU generating on the CPU.
"""

import pytest
import torch
from helpers import column, read_metrics, tiny_args
from lightning.pytorch import Callback

from gptmini.attention import MultiHeadAttention
from gptmini.checkpoint import load_checkpoint
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel
from gptmini.train.command import build_cli, fit, main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def gpu_args(tmp_path, corpus, *extra: str) -> list[str]:
    args = tiny_args(tmp_path, corpus, *extra)
    i = args.index("--trainer.accelerator")
    args[i + 1] = "gpu"
    return [*args, "--trainer.devices", "1"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_compiled_mixed_precision_run_lowers_the_loss(tmp_path, corpus, precision):
    args = gpu_args(tmp_path, corpus, "--trainer.precision", precision, "--model.compile",
                    "true", "--trainer.max_steps", "60", "--trainer.val_check_interval", "20")
    assert main(args) == 0
    rows = read_metrics(tmp_path / "runs" / "tiny")
    train, val = column(rows, "train/loss"), column(rows, "val/loss")
    assert train[-1] < train[0] - 3.0 and val[-1] < val[0] - 1.0


@pytest.mark.parametrize("model", ["attention", "gpt"])
def test_the_plain_causal_path_takes_the_flash_kernel(model):
    """sdpa_kernel(FLASH_ATTENTION) raises when flash is not eligible (an explicit mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    if model == "attention":
        module = MultiHeadAttention(256, 256, 1024, 0.0, num_heads=4)
        x = torch.randn(2, 1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    else:
        module = GPTModel(GPTConfig(vocab_size=50257, context_length=1024, emb_dim=256,
                                    n_heads=4, n_layers=2, drop_rate=0.0))
        x = torch.randint(0, 50257, (2, 1024), device="cuda")
    module = module.to("cuda", torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = module(x)
        out.float().pow(2).mean().backward()


def test_kv_cache_greedy_equals_recompute_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=50257, context_length=64, emb_dim=128, n_heads=4,
                               n_layers=3, drop_rate=0.0)).cuda().eval()
    prompt = torch.randint(0, 50257, (3, 7), device="cuda")
    assert torch.equal(generate(model, prompt, 80, use_cache=True), generate(model, prompt, 80))


class SyncsAreErrors(Callback):
    """torch.cuda.set_sync_debug_mode('error') for every batch that ends between logging
    steps (the logging steps themselves read the logged values once)."""

    def on_train_batch_start(self, trainer, *args):
        logging = (trainer.global_step + 1) % trainer.log_every_n_steps == 0
        torch.cuda.set_sync_debug_mode("default" if logging else "error")

    def on_train_end(self, trainer, *args):
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer, *args):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_training_steps_between_logging_steps_never_wait_on_the_gpu(tmp_path, corpus,
                                                                    precision):
    args = gpu_args(tmp_path, corpus, "--trainer.precision", precision, "--trainer.max_steps",
                    "24", "--trainer.log_every_n_steps", "8", "--checkpoint_every", "1000",
                    "--trainer.val_check_interval", "1000", "--trainer.enable_progress_bar",
                    "true")
    cli = build_cli(args)
    cli.trainer.callbacks.insert(0, SyncsAreErrors())
    fit(cli)
    assert cli.trainer.global_step == 24


def test_a_non_finite_step_is_skipped_on_the_gpu_and_named(tmp_path, corpus):
    class InfGradientAt(Callback):
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 3:
                pl_module.model.out_head.weight.grad.fill_(float("inf"))

    args = gpu_args(tmp_path, corpus, "--trainer.precision", "bf16-mixed",
                    "--trainer.log_every_n_steps", "5", "--checkpoint_every", "1000")
    cli = build_cli(args)
    cli.trainer.callbacks.append(InfGradientAt())
    with pytest.raises(FloatingPointError, match="not finite at step 3 .1 step.s. up to step 5"):
        fit(cli)
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())


def test_a_checkpoint_trained_on_the_gpu_generates_on_the_cpu(tmp_path, corpus):
    assert main(gpu_args(tmp_path, corpus, "--trainer.precision", "bf16-mixed")) == 0
    path = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    model, tok, _ = load_checkpoint(path, map_location="cpu")
    assert next(model.parameters()).device.type == "cpu"
    out = generate(model, torch.tensor([tok.encode("Romeo said")]), 10)
    assert out.shape == (1, len(tok.encode("Romeo said")) + 10)


def test_fsdp2_steps_with_muon_never_wait_on_the_gpu(tmp_path, corpus):
    """--trainer.strategy fsdp2 on one GPU (NCCL): FSDP2's bf16 gathers, Muon's all-to-alls
    of whole matrices and the skip of a non-finite step, all without a host sync between
    logging steps; then a sharded checkpoint. Last in the file: its process group stays."""
    args = gpu_args(tmp_path, corpus, "--trainer.precision", "bf16-mixed",
                    "--trainer.strategy", "fsdp2", "--model.optimizer", "muon",
                    "--trainer.max_steps", "24", "--trainer.log_every_n_steps", "8",
                    "--checkpoint_every", "24", "--trainer.val_check_interval", "1000")
    cli = build_cli(args)
    cli.trainer.callbacks.insert(0, SyncsAreErrors())
    fit(cli)
    assert cli.trainer.global_step == 24
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and load_checkpoint(last).model.cfg.n_layers == 2
