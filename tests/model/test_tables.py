"""The model's tables: a feed-forward or token mixer of your own plugs in by its import path
with no file of gptmini touched, a new built-in is its own file and one table entry, and
the auxiliary losses a layer computes reach lm_loss's `aux_losses` (also compiled, in one
graph)."""

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from gptmini.model import (
    MIXERS,
    MLPS,
    ConfigError,
    FeedForwardKind,
    GPTConfig,
    GPTModel,
    add_aux_loss,
    cross_entropy,
    lm_loss,
)
from gptmini.model.mixers import Attention


class NoisyMLP(nn.Module):
    """A GELU MLP that also reports `weight` times its output's mean square, an auxiliary
    loss, and keeps what it reported (for the test's own sum)."""

    def __init__(self, emb_dim: int, weight: float):
        super().__init__()
        self.up, self.down, self.weight = nn.Linear(emb_dim, 32), nn.Linear(32, emb_dim), weight
        self.reported: list[torch.Tensor] = []

    @property
    def proj_out(self) -> nn.Linear:
        return self.down

    def forward(self, x, aux_losses=None):
        out = self.down(torch.nn.functional.gelu(self.up(x)))
        loss = self.weight * out.square().mean()
        if not torch.compiler.is_compiling():
            self.reported.append(loss.detach())
        add_aux_loss(aux_losses, "noise", loss)
        return out


@dataclass(frozen=True)
class Noisy(FeedForwardKind):
    """The test's own feed-forward, with one option and an auxiliary loss."""

    options: ClassVar[tuple[str, ...]] = ("weight",)
    aux_loss: ClassVar[bool] = True
    emb_dim: int
    weight: float

    @classmethod
    def from_config(cls, cfg: Any) -> "Noisy":
        weight = (cfg.mlp_options or {}).get("weight", 0.1)
        if not isinstance(weight, float) or weight < 0:
            raise ConfigError("mlp_options", cfg.mlp_options, "weight: use a number >= 0")
        return cls(cfg.emb_dim, weight)

    def make_module(self) -> NoisyMLP:
        return NoisyMLP(self.emb_dim, self.weight)

    def flops_per_token(self) -> float:
        return 6 * 2 * 32 * self.emb_dim


NOISY = f"{Noisy.__module__}:{Noisy.__qualname__}"


def noisy_model(tiny_config, **options) -> GPTModel:
    cfg = GPTConfig(**{**tiny_config.to_dict(), "mlp": NOISY, "mlp_options": options or None})
    return GPTModel(cfg).double()


def batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (2, 12), generator=gen), torch.randint(0, 64, (2, 12),
                                                                        generator=gen)


def test_a_feed_forward_of_your_own_plugs_in_by_its_import_path(tiny_config):
    assert NOISY not in MLPS and MLPS.accepts(NOISY)
    model = noisy_model(tiny_config, weight=0.5)
    assert all(type(block.ff) is NoisyMLP and block.ff.weight == 0.5
               for block in model.trf_blocks)
    from gptmini.model.flops import flops_per_token  # its own FLOPs are counted
    assert flops_per_token(model.cfg) - flops_per_token(tiny_config) == 2 * (
        6 * 2 * 32 * 16 - 6 * 2 * 16 * 64)


def test_the_layers_auxiliary_losses_are_the_parts_the_task_adds(tiny_config):
    model = noisy_model(tiny_config, weight=0.5)
    idx, targets = batch()
    for block in model.trf_blocks:
        block.ff.reported.clear()
    parts = {}
    lm = lm_loss(model, idx, targets, aux_losses=parts)  # the language model's loss alone
    reported = sum(r for block in model.trf_blocks for r in block.ff.reported)
    assert list(parts) == ["noise"] and len(model.trf_blocks[0].ff.reported) == 1
    torch.testing.assert_close(parts["noise"].detach(), reported, rtol=0, atol=1e-12)
    torch.testing.assert_close(lm, cross_entropy(model(idx), targets), rtol=0, atol=1e-12)
    from gptmini.train.tasks import LanguageModelling  # the task trains on their sum
    task = LanguageModelling(tokenizer=None)
    loss, metrics = task.loss(model, (idx, targets))
    torch.testing.assert_close(loss, lm + parts["noise"], rtol=0, atol=1e-12)
    torch.testing.assert_close(metrics["loss"], lm, rtol=0, atol=1e-12)
    loss.backward()  # the auxiliary loss trains the layers that computed it
    assert model.trf_blocks[0].ff.up.weight.grad.abs().sum() > 0


def test_a_model_without_auxiliary_losses_has_no_parts(tiny_config):
    model = GPTModel(tiny_config).double()
    idx, targets = batch()
    for reduction, chunk_size in (("mean", None), ("mean", 5), ("none", None)):
        parts = {}
        lm_loss(model, idx, targets, reduction, chunk_size=chunk_size, aux_losses=parts)
        assert parts == {}


@pytest.mark.slow
def test_auxiliary_losses_compile_in_one_graph(tiny_config):
    model = noisy_model(tiny_config, weight=0.5).float()
    idx, targets = batch()

    def step(model, idx, targets):  # as the language task's
        parts = {}
        return lm_loss(model, idx, targets, aux_losses=parts), parts

    want_loss, want_parts = step(model, idx, targets)
    compiled = torch.compile(step, fullgraph=True)  # a graph break would raise here
    loss, parts = compiled(model, idx, targets)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(parts["noise"], want_parts["noise"])


@pytest.mark.parametrize(("fields", "message"), [
    ({"mlp": NOISY, "mlp_options": {"wieght": 0.5}},
     "GPTConfig.mlp_options=.*has no option wieght; it reads weight"),
    ({"mlp": NOISY, "mlp_options": {"weight": -1.0}}, "weight: use a number >= 0"),
    ({"mlp_options": {"weight": 0.5}}, "the gelu feed-forward has no option weight; it reads "
                                       "none: leave mlp_options None"),
    ({"mlp": "tests_nowhere.mlp:Missing"}, "GPTConfig.mlp=.*cannot import tests_nowhere.mlp"),
    ({"mlp": "reglu"}, "use one of gelu, swiglu, relu2, geglu, moe, oss_moe, or a "
                       "feed-forward of your own"),
    ({"layer_kinds": ["attention", "tests_nowhere:Mixer"]},
     "GPTConfig.layer_kinds=.*cannot import tests_nowhere"),
])
def test_a_part_that_does_not_fit_is_named(tiny_config, fields, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**{**tiny_config.to_dict(), **fields})


@dataclass(frozen=True)
class Unpaged(Attention):
    """The book's attention under another name, whose cache the engine may not page."""

    title: ClassVar[str] = "unpaged attention"
    pageable: ClassVar[bool] = False


def test_a_mixer_of_your_own_is_asked_what_it_is(tiny_config):
    from gptmini.generate.engine import Engine

    mine = f"{Unpaged.__module__}:{Unpaged.__qualname__}"
    assert mine not in MIXERS and MIXERS.accepts(mine)
    cfg = GPTConfig(**{**tiny_config.to_dict(), "layer_kinds": ["attention", mine]})
    model = GPTModel(cfg).eval()
    assert [m.title for m in model.mixers] == ["attention", "unpaged attention"]
    torch.manual_seed(0)
    same = GPTModel(tiny_config).eval()  # the same weights: it is the book's attention
    idx = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(model(idx), same(idx))
    with pytest.raises(ValueError, match=r"engine cannot serve unpaged attention layers yet "
                                         r"\(layers \[1\]\)"):
        Engine(model)


def test_a_new_built_in_feed_forward_is_its_own_file_and_one_table_entry(package_copy):
    """A contributor's feed-forward made a built-in: its file in variants/ and its entry in
    MLPS; then GPTConfig takes it by name, the model builds it and the FLOPs count it."""
    package_copy.write("variants/squared.py", '''
from dataclasses import dataclass

from torch import nn

from gptmini.model.feedforward import FeedForward, FeedForwardKind


class Square(nn.Module):
    def forward(self, x):
        return x * x


@dataclass(frozen=True)
class SquareMLP(FeedForwardKind):
    emb_dim: int

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.emb_dim)

    def make_module(self):
        return FeedForward(self.emb_dim, 2 * self.emb_dim, activation=Square())

    def flops_per_token(self):
        return 6 * 4 * self.emb_dim ** 2
''')
    package_copy.insert_after("model/feedforward.py", '"relu2": SquaredReluMLP,',
                              '    "square": "gptmini.variants.squared:SquareMLP",')
    assert package_copy.changed() == ["model/feedforward.py", "variants/squared.py"]
    out = package_copy.run(
        "import torch\nfrom gptmini.model import GPTConfig, GPTModel\n"
        "from gptmini.model.flops import flops_per_token\n"
        "cfg = GPTConfig(vocab_size=64, context_length=16, emb_dim=16, n_heads=2, n_layers=2,"
        " drop_rate=0.0, mlp='square')\n"
        "model = GPTModel(cfg).eval()\n"
        "x = torch.randn(3, 16)\nff = model.trf_blocks[0].ff\n"
        "want = ff.layers[2](ff.layers[0](x) ** 2)\n"
        "print(float((ff(x) - want).abs().max()), flops_per_token(cfg, 16))\n")
    gap, flops = out.split()
    assert float(gap) == 0.0 and float(flops) > 0
