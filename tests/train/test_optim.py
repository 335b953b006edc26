"""The optimizers: Muon for the hidden matrices beside AdamW, as one optimizer, against
torch's two optimizers stepped separately; its checkpoints, schedule and errors."""

import copy
import io
import math
import re
from dataclasses import FrozenInstanceError, replace
from types import SimpleNamespace

import pytest
import torch
from helpers import HostReads, make_model

from gptmini.model import lm_loss
from gptmini.train.module import GPTLitModule
from gptmini.train.muon import (
    NS_COEFFICIENTS,
    NS_SET,
    NS_STEPS,
    BatchedMuon,
    MuonAdamW,
    muon_adamw,
    newton_schulz_dtype,
    orthogonalize,
)
from gptmini.train.optim import (
    OptimizerSettings,
    apply_changed_settings,
    lr_factor,
    make_optimizer,
    skips_on_device,
    warmup_cosine,
)

RATES = dict(learning_rate=3e-3, muon_learning_rate=5e-3, weight_decay=0.1, betas=(0.9, 0.95))
MUON = OptimizerSettings("muon", learning_rate=3e-3, muon_learning_rate=5e-3, weight_decay=0.1,
                         beta1=0.9, beta2=0.95, warmup_steps=0, min_lr_ratio=0.1)
CPU = torch.device("cpu")


def model_and_batches(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = make_model(qkv_bias=True, **overrides).train()
    batches = [torch.randint(0, 64, (2, 9)) for _ in range(4)]
    return model, batches


def backward(model, batch):
    lm_loss(model, batch[:, :-1], batch[:, 1:]).backward()


def test_muon_takes_the_blocks_matrices_and_adamw_everything_else():
    model, _ = model_and_batches(tie_weights=False)
    optimizer = muon_adamw(model, **RATES, device=CPU)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in optimizer.muon.param_groups[0]["params"]}
    # written out from the model's layout, not from the rule in optim.py
    want = {f"trf_blocks.{i}.{w}.weight" for i in range(2) for w in (
        "att.W_query", "att.W_key", "att.W_value", "att.out_proj", "ff.layers.0", "ff.layers.2")}
    assert muon == want
    decayed, plain = ({names[id(p)] for p in g["params"]} for g in optimizer.adamw.param_groups)
    assert decayed == {"tok_emb.weight", "pos_emb.weight", "out_head.weight"}
    assert plain == set(names.values()) - want - decayed
    assert all("norm" in n or n.endswith("bias") for n in plain)


@pytest.fixture
def bf16_newton_schulz(monkeypatch):
    """torch.optim.Muon iterates in bf16 on any device; ours does where the device has bf16
    units (this CPU may not): the comparisons with torch's pin it."""
    monkeypatch.setattr("gptmini.train.muon.newton_schulz_dtype", lambda device: torch.bfloat16)


def test_one_optimizer_steps_as_torchs_muon_and_adamw_stepped_apart(bf16_newton_schulz):
    """The oracle is torch's documented use: two optimizers, each stepped, with the rates a
    warmup/cosine schedule gives (each from its own base).

    Like is compared with like: the oracle's AdamW is built with the implementation flags of
    ours (fused, foreach). Before, ours was fused and the oracle torch's default per-tensor
    loop, whose rounding differs from the fused kernel's by a CPU's vector units (it passed
    on a Xeon, not on an AMD Zen 4 with AVX-512 bf16). The same kernels on the same inputs
    give the same bits, so the tolerance is float32's default, not a margin for another
    implementation's rounding."""
    model, batches = model_and_batches()
    twin = copy.deepcopy(model)
    ours = muon_adamw(model, **RATES, device=CPU)
    schedule = warmup_cosine(ours, warmup_steps=2, total_steps=4, min_ratio=0.1)
    hidden = [p for p in twin.trf_blocks.parameters() if p.dim() == 2]
    rest = [p for p in twin.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=RATES["muon_learning_rate"], weight_decay=0.1,
                            adjust_lr_fn="match_rms_adamw")
    flags = {k: ours.adamw.defaults[k] for k in ("fused", "foreach")}
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2]},
                               {"params": [p for p in rest if p.dim() < 2],
                                "weight_decay": 0.0}],
                              lr=RATES["learning_rate"], betas=(0.9, 0.95), weight_decay=0.1,
                              **flags)
    for step, batch in enumerate(batches):
        for m in (model, twin):
            backward(m, batch)
        factor = lr_factor(step, 2, 4, 0.1)
        for opt, base in ((muon, RATES["muon_learning_rate"]), (adamw, RATES["learning_rate"])):
            for group in opt.param_groups:
                group["lr"] = base * factor
        ours.step(), muon.step(), adamw.step(), schedule.step()
        for opt in (ours, muon, adamw):
            opt.zero_grad()
    for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, want, msg=name)
    assert ours.param_groups[-1]["lr"] == pytest.approx(5e-3 * lr_factor(4, 2, 4, 0.1))


def test_a_saved_and_loaded_state_continues_exactly():
    model, batches = model_and_batches()
    optimizer = muon_adamw(model, **RATES, device=CPU)
    for batch in batches[:2]:
        backward(model, batch), optimizer.step(), optimizer.zero_grad()
    copied = copy.deepcopy(model)
    loaded = muon_adamw(copied, **RATES, device=CPU)
    saved = io.BytesIO()  # a checkpoint's round trip (in memory, both would share tensors)
    torch.save(optimizer.state_dict(), saved)
    loaded.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert set(optimizer.state_dict()["state"]) == set(range(len(list(model.parameters()))))
    for m, opt in ((model, optimizer), (copied, loaded)):
        for batch in batches[2:]:
            backward(m, batch), opt.step(), opt.zero_grad()
    for got, want in zip(copied.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)


def test_a_non_finite_muon_step_is_skipped_on_the_device_and_never_updates_the_weights():
    """Found on an H200: the skip read `bool(bad)` off the GPU every step, a sync that
    tests/test_gpu.py caught. Now MuonAdamW skips on the device as fused AdamW does: the
    module's clipping and the step read nothing off the device (HostReads), the weights do
    not move, and the next finite step is the first step of an optimizer that never saw
    the bad one, bit for bit."""
    module = GPTLitModule(context_length=16, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0,
                          peak_flops=1e9, optimizer="muon")
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(model=module),
                                     precision="32-true", global_step=3)
    module.log = lambda *args, **kwargs: None
    twin = copy.deepcopy(module.model)
    optimizer = make_optimizer(module.model, MUON, CPU)
    assert skips_on_device(optimizer)
    batch = torch.randint(0, 50257, (2, 9))
    backward(module.model, batch)
    module.model.trf_blocks[1].ff.layers[0].weight.grad[0, 0] = math.inf
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with HostReads() as reads:
        module.configure_gradient_clipping(optimizer, 1.0, gradient_clip_algorithm="norm")
        optimizer.step()
    assert reads.seen == []
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    with pytest.raises(FloatingPointError, match="not finite at step 3"):
        module.on_save_checkpoint({})  # the next check: no checkpoint of a non-finite run
    fresh = make_optimizer(twin, MUON, CPU)
    for model, opt in ((module.model, optimizer), (twin, fresh)):
        opt.zero_grad()
        backward(model, batch)
        opt.found_inf = torch.zeros(())
        opt.step()
    for (name, got), want in zip(module.model.named_parameters(), twin.parameters(),
                                 strict=True):
        assert torch.equal(got, want), name


def test_a_skipped_step_leaves_every_optimizer_state_as_it_was():
    """NaN gradients with found_inf set: the momentum buffers, Adam's moments and its step
    count stay as they were after the good step before."""
    model, batches = model_and_batches()
    optimizer = muon_adamw(model, **RATES, device=CPU)
    backward(model, batches[0])
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict()["state"])
    weights = [p.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    state = optimizer.state_dict()["state"]
    for index, entries in saved.items():
        for key, value in entries.items():
            assert torch.equal(state[index][key], value), (index, key)


def test_a_changed_muon_rate_applies_on_resume_from_the_step_reached():
    model, batches = model_and_batches()
    optimizer = muon_adamw(model, **RATES, device=CPU)
    schedule = warmup_cosine(optimizer, warmup_steps=2, total_steps=10, min_ratio=0.1)
    for batch in batches[:3]:
        backward(model, batch), optimizer.step(), schedule.step()
    checkpoint = {"hyper_parameters": {"optimizer": "muon", "muon_learning_rate": 5e-3,
                                       "learning_rate": 3e-3},
                  "optimizer_states": [optimizer.state_dict()],
                  "lr_schedulers": [schedule.state_dict()]}
    hp = replace(MUON, muon_learning_rate=1e-2)
    changed = apply_changed_settings(checkpoint, hp, warmup_steps=2, total_steps=10,
                                     announce=False)
    assert changed == ["muon_learning_rate"]
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    factor = lr_factor(3, 2, 10, 0.1)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
        [3e-3 * factor, 3e-3 * factor, 1e-2 * factor])
    assert checkpoint["lr_schedulers"][0]["base_lrs"] == [3e-3, 3e-3, 1e-2]


def test_resuming_with_another_optimizer_is_refused_naming_the_checkpoints():
    hp = replace(MUON, muon_learning_rate=1e-2)
    with pytest.raises(ValueError, match="trained with --model.optimizer adamw and this run "
                                         "asks for muon; resume with --model.optimizer adamw"):
        apply_changed_settings({"hyper_parameters": {"learning_rate": 3e-3}}, hp,
                               warmup_steps=2, total_steps=10, announce=False)


def test_a_torch_without_muon_is_named_with_the_version_that_has_it(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ValueError, match=rf"torch 2\.9 first ships; this is torch "
                                         rf"{re.escape(torch.__version__)}.*optimizer adamw"):
        GPTLitModule(context_length=16, emb_dim=16, n_heads=2, n_layers=2, optimizer="muon")


def test_bad_optimizer_choices_name_the_setting_and_the_fix():
    with pytest.raises(ValueError, match="model.optimizer='sgd': use one of adamw, muon"):
        replace(MUON, optimizer="sgd")


def test_muon_adamw_is_one_torch_optimizer():
    model, _ = model_and_batches()
    optimizer = muon_adamw(model, **RATES, device=CPU)
    assert isinstance(optimizer, torch.optim.Optimizer) and isinstance(optimizer, MuonAdamW)
    counted = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    assert counted == sum(p.numel() for p in model.parameters())


def test_batched_muon_is_torchs_muon_bit_for_bit(bf16_newton_schulz):
    """Stacking same-shape matrices (the tall ones transposed) changes no bit: the default
    keeps torch's Muon's trajectory, and exact resume with it."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 32), (32, 32), (88, 32), (88, 32), (32, 88), (16, 48)]
    theirs = [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    settings = dict(lr=2e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    torch_muon, batched = torch.optim.Muon(theirs, **settings), BatchedMuon(ours, **settings)
    for _ in range(3):
        for a, b in zip(theirs, ours, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        torch_muon.step(), batched.step()
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))
    assert batched.state_dict()["param_groups"][0].keys() == \
        torch_muon.state_dict()["param_groups"][0].keys()


@pytest.mark.parametrize(("coefficients", "steps", "band"), [
    ("jordan", 5, (0.6, 1.25)),  # torch's: S' in about [0.7, 1.2] (Jordan's post: "0.5-1.5")
    ("polar_express", 5, (0.8, 1.2)),  # the paper's 5-step design: about [0.87, 1.14]
])
@pytest.mark.parametrize("shape", [(64, 64), (64, 176), (176, 64)])
def test_orthogonalized_singular_values_lie_in_the_known_band(coefficients, steps, band, shape):
    """The singular values of U S' V^T (computed independently, by an SVD in float32) are
    near 1; the smallest tenth of a Gaussian matrix's are left out: they start near 0,
    where no 5-step polynomial reaches 1. The singular vectors are the input's."""
    gen = torch.Generator().manual_seed(1)
    updates = torch.randn(3, *shape, generator=gen)
    out = orthogonalize(updates, coefficients, steps).float()
    values = torch.linalg.svdvals(out)  # (3, short), descending
    kept = values[:, : int(0.9 * values.shape[-1])]
    assert band[0] <= kept.min() and values.max() <= band[1]
    # same singular vectors: U^T out V is diagonal (to bf16's precision)
    u, _, vh = torch.linalg.svd(updates, full_matrices=False)
    core = u.mT @ out @ vh.mT  # (3, short, short)
    off = core - torch.diag_embed(torch.diagonal(core, dim1=-2, dim2=-1))
    assert off.abs().max() < 0.05


def test_polar_express_is_closer_to_orthogonal_than_jordans_in_the_same_steps():
    updates = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(2))
    spread = {name: torch.linalg.svdvals(orthogonalize(updates, name, 5).float())[:, :57]
              for name in NS_COEFFICIENTS}
    worst = {name: (v - 1).abs().max().item() for name, v in spread.items()}
    assert worst["polar_express"] < worst["jordan"]


def test_muon_takes_its_newton_schulz_settings():
    model, batches = model_and_batches()
    settings = replace(MUON, muon_ns_steps=3, muon_ns_coefficients="polar_express")
    optimizer = make_optimizer(model, settings, CPU)
    assert {(g["ns_steps"], g["ns_coefficients"]) for g in optimizer.muon.param_groups} == \
        {(3, "polar_express")}
    backward(model, batches[0])
    optimizer.step()  # runs


@pytest.mark.parametrize(("steps", "coefficients", "message"), [
    (0, "jordan", r"model.muon_ns_steps=0: use an integer from 1 to 20"),
    (5, "newton", r"model.muon_ns_coefficients='newton': use one of jordan, polar_express"),
])
def test_bad_newton_schulz_settings_name_the_field(steps, coefficients, message):
    with pytest.raises(ValueError, match=message):  # the typed settings check when made
        replace(MUON, muon_ns_steps=steps, muon_ns_coefficients=coefficients)


def test_changed_newton_schulz_settings_apply_on_resume():
    model, batches = model_and_batches()
    optimizer = muon_adamw(model, **RATES, device=CPU)
    schedule = warmup_cosine(optimizer, warmup_steps=2, total_steps=10, min_ratio=0.1)
    backward(model, batches[0]), optimizer.step(), schedule.step()
    checkpoint = {"hyper_parameters": {"optimizer": "muon", "muon_ns_steps": 5,
                                       "muon_ns_coefficients": "jordan"},
                  "optimizer_states": [optimizer.state_dict()],
                  "lr_schedulers": [schedule.state_dict()]}
    hp = replace(MUON, muon_ns_steps=4, muon_ns_coefficients="polar_express")
    changed = apply_changed_settings(checkpoint, hp, warmup_steps=2, total_steps=10,
                                     announce=False)
    assert changed == ["muon_ns_steps", "muon_ns_coefficients"]
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert (optimizer.muon.param_groups[0]["ns_steps"],
            optimizer.muon.param_groups[0]["ns_coefficients"]) == (4, "polar_express")


@pytest.mark.parametrize("has_bf16", [True, False])
def test_newton_schulz_runs_in_float32_on_a_cpu_without_bf16_units(monkeypatch, has_bf16):
    """Issue 48: on an AVX2-only CPU a bf16 matmul is emulated (1 GFLOP/s against 170 in
    float32, AVX2 forced on an EPYC), and Muon's bf16 iterations made the default run's
    float32 step 4.3 s. Where the CPU has no bf16 units they run in float32, to the same
    orthogonal update (within bf16's rounding)."""
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: has_bf16)
    updates = torch.randn(3, 32, 88, generator=torch.Generator().manual_seed(0))
    out = orthogonalize(updates)
    assert out.dtype == (torch.bfloat16 if has_bf16 else torch.float32)
    assert newton_schulz_dtype("cpu") == out.dtype
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: True)
    torch.testing.assert_close(out.float(), orthogonalize(updates).float(), atol=0.02, rtol=0)
    gen = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.randn(32, 88, generator=gen))
    param.grad = torch.randn(32, 88, generator=gen)
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: has_bf16)
    BatchedMuon([param], lr=1e-3).step()  # the optimizer's step takes the same dtype
    assert param.dtype == torch.float32 and torch.isfinite(param).all()


def test_a_module_reads_its_optimizer_settings_once_typed_and_checked():
    """Issue 53: one typed object, not untyped hyperparameters read at each use."""
    module = GPTLitModule(tokenizer="byte", context_length=8, emb_dim=16, n_heads=2,
                          n_layers=1, optimizer="muon", learning_rate=2e-3)
    settings = module.optimization
    assert isinstance(settings, OptimizerSettings)
    assert (settings.optimizer, settings.learning_rate, settings.betas) == (
        "muon", 2e-3, (module.hparams.beta1, module.hparams.beta2))
    with pytest.raises(FrozenInstanceError):
        settings.learning_rate = 1.0
    # a checkpoint's hyperparameters from before Muon's Newton-Schulz settings: the defaults
    old = {k: v for k, v in module.hparams.items() if not k.startswith("muon_ns")}
    assert (OptimizerSettings.of(old).muon_ns_steps,
            OptimizerSettings.of(old).muon_ns_coefficients) == (NS_STEPS, NS_SET)
    with pytest.raises(ValueError, match=r"--model.beta2 1.0 is invalid"):
        GPTLitModule(tokenizer="byte", context_length=8, emb_dim=16, n_heads=2, n_layers=1,
                     beta2=1.0)
