"""--model.compile: the compiled model trains as the eager one does (the same loss and
gradients, to float32's precision), with the same parameter names in its checkpoints."""

import copy

import pytest
import torch

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
    compiled.configure_model()  # what Lightning calls: model.compile() in place
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 257, (4, 17), generator=gen) for _ in range(2)]
    for batch in batches:  # the second call runs the compiled graph as compiled
        losses = []
        for module in (eager, compiled):
            module.zero_grad(set_to_none=True)
            loss = module.model(batch[:, :-1], targets=batch[:, 1:])
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
