"""--model.compile: the compiled model trains as the eager one does (the same loss and
gradients, to float32's precision), with the same parameter names in its checkpoints, and
a compiled run repeats and resumes to the bit on two threads (issue 48)."""

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import REPO, tiny_args, write_corpus
from lightning.pytorch import Callback

from gptmini.model import lm_loss
from gptmini.train.module import GPTLitModule

DEFAULT_BLOCKS = dict(position="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu",
                      qk_norm=True, bias=False, tie_weights=True, drop_rate=0.0)


@pytest.mark.slow
def test_compiled_and_eager_steps_give_the_same_loss_and_gradients():
    """float32, where the two differ only by the order of fused sums (bf16-mixed compiles
    another graph: a second minute of compiling on a 2-core CI machine)."""
    torch.manual_seed(0)
    eager = GPTLitModule(tokenizer="byte", context_length=16, emb_dim=32, n_heads=2,
                         n_layers=2, **DEFAULT_BLOCKS)
    compiled = copy.deepcopy(eager)
    compiled.hparams.compile = True
    compiled.configure_model()  # what Lightning calls: the task compiles the loss's pass
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    assert eager.task.lm_loss is lm_loss and compiled.task.lm_loss is not lm_loss
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 257, (4, 17), generator=gen) for _ in range(2)]
    for batch in batches:  # the second call runs the compiled graph as compiled
        losses = []
        for module in (eager, compiled):
            module.zero_grad(set_to_none=True)
            loss, _ = module.task.loss(module.model, (batch[:, :-1], batch[:, 1:]))
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for (name, a), b in zip(eager.model.named_parameters(), compiled.model.parameters(),
                                strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_compiled_train_py_run_trains_validates_and_its_checkpoint_loads(tmp_path):
    """train.py's own path (the default run compiles): Lightning's configure_model compiles
    on the trainer's device, validation runs eagerly beside it, the checkpoint is plain."""
    from helpers import tiny_args

    from gptmini.checkpoint import load_checkpoint
    from gptmini.runtime import compile_blocker
    from gptmini.train.command import main

    if compile_blocker("cpu"):
        pytest.skip(compile_blocker("cpu"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 40)
    args = tiny_args(tmp_path, corpus, "--trainer.max_steps", "4",
                     "--trainer.val_check_interval", "2", "--checkpoint_every", "4",
                     "--model.compile", "true")
    assert main(args) == 0
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=True)["hyper_parameters"]["compile"] is True
    model = load_checkpoint(checkpoint).model  # no compiled wrapper's names in the weights
    assert model(torch.tensor([[1, 2, 3]])).shape[-1] == model.cfg.vocab_size


def test_deterministic_kernels_hold_torchs_switch_on_a_cpu_and_give_back_what_was_there():
    """The switch inductor reads when it lowers a graph (its scatter-adds then add in order),
    for the block only: on a CPU, not on a GPU (which would want CUBLAS_WORKSPACE_CONFIG),
    and not when the model is not compiled."""
    from gptmini.train.compiling import deterministic_kernels

    def state():
        return (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.utils.deterministic.fill_uninitialized_memory)

    before = state()
    with deterministic_kernels("cpu"):
        assert state() == (True, True, False)  # warn, never stop a run; no NaN filling
    assert state() == before
    for device, enabled in (("cuda", True), ("cpu", False)):
        with deterministic_kernels(device, enabled):
            assert state() == before
    torch.use_deterministic_algorithms(True)  # a user's strict choice stays strict
    try:
        with deterministic_kernels("cpu"):
            assert state()[:2] == (True, False)
        assert state()[:2] == (True, False)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


COMPILED_DEFAULT = ("--model.compile", "true", "--model.tokenizer", "byte",
                    "--model.n_layers", "1", "--model.context_length", "32",
                    "--data.loader.batch_size", "16", "--trainer.max_steps", "12",
                    "--trainer.val_check_interval", "6", "--checkpoint_every", "4")
"""The default recipe (its blocks, Muon, clipping; float32 as tests pin it), compiled, on
tiny shapes: one layer, bytes, 16 x 32 tokens a step (batches where many positions share a
token, whose embedding rows the backward adds into)."""

KILLED_AFTER_FIRST_SAVE = textwrap.dedent("""
    import os, sys
    import gptmini.checkpoint.atomic as io
    from gptmini.train.command import main

    real = io.atomic_save
    def atomic_save(obj, path):
        real(obj, path)
        os._exit(9)  # SIGKILL's effect: gone right after the save, nothing flushed or closed
    io.atomic_save = atomic_save
    main(sys.argv[1:])
""")


class SigtermAt(Callback):
    """A SIGTERM to this process after optimizer step `step`, as a scheduler would send."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def two_threads():
    """A 2-core machine's default thread count (CI pins 1 thread, where no two can race)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def weights(cli) -> dict:
    return {k: v.detach().clone() for k, v in cli.model.state_dict().items()}


def assert_bit_equal(a: dict, b: dict):
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"{len(different)} of {len(a)} tensors differ: {different}"


@pytest.mark.slow
def test_compiled_runs_stopped_by_sigterm_or_killed_resume_to_a_straight_runs_weights(
        tmp_path, two_threads):
    """Before (issue 48): on two threads the compiled embedding backward added in a racing
    order, and a resumed run (or any second run) differed from the straight one in every
    tensor; with the same seed, command and thread count each must give the same bits."""
    from gptmini.runtime import compile_blocker
    from gptmini.train.callbacks import RunInterrupted
    from gptmini.train.command import build_cli, fit

    if compile_blocker("cpu"):
        pytest.skip(compile_blocker("cpu"))
    corpus = write_corpus(tmp_path / "corpus.txt", repeats=12)

    def run(name: str, *extra: str, callback: Callback | None = None):
        cli = build_cli(tiny_args(tmp_path, corpus, *COMPILED_DEFAULT, "--run_name", name,
                                  *extra))
        if callback is not None:
            cli.trainer.callbacks.insert(0, callback)
        fit(cli, own_signals=True)  # as train.py: the SIGTERM is not handed on to pytest
        return cli

    straight = weights(run("straight"))
    with pytest.raises(RunInterrupted) as stopped:  # mid-run: no periodic save at step 5
        run("sigterm", callback=SigtermAt(5))
    assert stopped.value.step == 5
    resumed = run("sigterm", "--ckpt_path", "last")
    assert resumed.trainer.global_step == 12
    assert_bit_equal(straight, weights(resumed))

    # A process killed right after its save at step 4 (train.py's own path, 2 threads).
    args = tiny_args(tmp_path, corpus, *COMPILED_DEFAULT, "--run_name", "killed")
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_FIRST_SAVE, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 9, proc.stderr[-2000:]
    resumed = run("killed", "--ckpt_path", "last")
    assert resumed.trainer.global_step == 12
    assert_bit_equal(straight, weights(resumed))
