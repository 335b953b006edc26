"""The step is a task: the LightningModule logs what its task returns and branches on no
task and on no LoRA setting; language modelling backpropagates the model's auxiliary losses
(what `lm_loss(..., aux_losses=parts)` hands over) and logs each one beside the plain
train/loss."""

import ast
import inspect
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptmini.tokenizer import get_tokenizer
from gptmini.train.module import GPTLitModule
from gptmini.train.tasks import Classification, LanguageModelling, task_for

TINY = dict(tokenizer="byte", context_length=8, emb_dim=16, n_heads=2, n_layers=1,
            drop_rate=0.0, peak_flops=1.0)


class WithParts(nn.Module):
    """A test double of a model with an auxiliary loss (a mixture of experts' balance):
    0.5 * |w|^2, handed over as lm_loss asks for it: forward fills `aux_losses`."""

    def __init__(self, vocab: int = 257):
        super().__init__()
        self.emb = nn.Embedding(vocab, vocab)
        self.w = nn.Parameter(torch.tensor([3.0, 4.0]))

    def forward(self, x, document_ids=None, aux_losses=None):
        if aux_losses is not None:
            aux_losses["balance"] = 0.5 * self.w.square().sum()
        return self.emb(x)


def test_language_modelling_backpropagates_the_parts_and_logs_each_beside_the_plain_loss():
    torch.manual_seed(0)
    module = GPTLitModule(**TINY)
    module.model = WithParts()
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    x, y = torch.randint(0, 257, (2, 8)), torch.randint(0, 257, (2, 8))
    loss = module.training_step((x, y), 0)
    plain = F.cross_entropy(module.model.emb(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(logged["train/loss"], plain)  # train/loss: the LM's own
    torch.testing.assert_close(logged["train/balance"], torch.tensor(12.5))
    torch.testing.assert_close(loss, plain + 12.5)  # what is backpropagated includes it
    loss.backward()
    torch.testing.assert_close(module.model.w.grad, torch.tensor([3.0, 4.0]))
    module.validation_step((x, y), 0)
    assert set(logged) >= {"val/loss", "val/balance"}
    torch.testing.assert_close(logged["val/loss"], plain.detach())


def test_an_ordinary_model_has_no_parts_and_logs_train_loss_alone():
    module = GPTLitModule(**TINY)
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    x = torch.randint(0, 257, (2, 8))
    loss = module.training_step((x, x), 0)
    assert list(logged) == ["train/loss"] and logged["train/loss"] is loss


def test_the_settings_pick_the_task():
    enc = get_tokenizer("byte")
    assert isinstance(task_for(tokenizer=enc), LanguageModelling)
    task = task_for(tokenizer=enc, classes=["ham", "spam"])
    assert isinstance(task, Classification) and task.classes == ("ham", "spam")
    module = GPTLitModule(**TINY, classes=["ham", "spam"], lora_rank=0)
    assert module.model.out_head.out_features == 2
    assert module.task_keys == {"out_head.weight", "out_head.bias"}


def test_a_classifier_under_lora_trains_its_head_and_adapters_alone(tmp_path):
    module = GPTLitModule(**TINY, classes=["a", "b", "c"], lora_rank=2, init_from="somewhere")
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("out_head.") or n.endswith(("lora_A", "lora_B"))
                             for n in trainable)
    assert {"out_head.weight", "out_head.bias"} <= trainable
    with pytest.raises(ValueError, match="model.lora_rank=2 adapts a pretrained model"):
        GPTLitModule(**TINY, lora_rank=2)


BRANCH_NAMES = ("classes", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


def test_the_module_branches_on_no_task_and_no_lora_setting():
    """Its hooks ask the task and the trained weights; none reads these settings (the
    constructor hands them to `task_for` and `trained_weights`, once)."""
    source = textwrap.dedent(inspect.getsource(GPTLitModule))
    read = []
    for method in ast.parse(source).body[0].body:
        if not isinstance(method, ast.FunctionDef) or method.name == "__init__":
            continue
        read += [f"{method.name}: {node.attr}" for node in ast.walk(method)
                 if isinstance(node, ast.Attribute) and node.attr in BRANCH_NAMES]
        read += [f"{method.name}: {node.value}" for node in ast.walk(method)
                 if isinstance(node, ast.Constant) and node.value in BRANCH_NAMES]
    assert read == []
