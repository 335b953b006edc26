import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from gptmini.convert import export_hf
from gptmini.model import GPTConfig, GPTModel, lm_loss
from gptmini.train.module import GPTLitModule
from gptmini.train.optim import lr_factor, warmup_for

REPO = Path(__file__).resolve().parents[2]
TINY = dict(context_length=16, emb_dim=16, n_heads=2, n_layers=2,
            drop_rate=0.0, peak_flops=1e9)


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    warmup, total, floor = 10, 110, 0.1
    factors = [lr_factor(s, warmup, total, floor) for s in range(130)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(factors[:10], factors[1:10], strict=False))
    assert all(a >= b for a, b in zip(factors[10:110], factors[11:111], strict=False))
    assert factors[60] == pytest.approx(floor + (1 - floor) * 0.5)  # halfway: cos(pi/2)
    assert factors[110] == pytest.approx(floor) and factors[129] == pytest.approx(floor)


def test_weight_decay_only_on_parameters_with_two_or_more_dimensions():
    module = GPTLitModule(**TINY)
    module.trainer = SimpleNamespace(max_steps=100, estimated_stepping_batches=100,
                                     is_global_zero=True)
    groups = module.configure_optimizers()["optimizer"].param_groups
    decayed, plain = groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"])
    assert all(p.dim() < 2 for p in plain["params"])
    n_params = sum(p.numel() for g in groups for p in g["params"])
    assert n_params == sum(p.numel() for p in module.parameters())  # tied head counted once


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"learning_rate": -1e-3}, r"--model.learning_rate -0.001 is invalid: use a positive"),
        ({"learning_rate": float("inf")}, r"--model.learning_rate inf is invalid"),
        ({"muon_learning_rate": float("nan")}, r"--model.muon_learning_rate nan is invalid"),
        ({"warmup_steps": -5}, r"--model.warmup_steps -5 is invalid: use an integer, 0 or"),
        ({"warmup_steps": 2.5}, r"--model.warmup_steps 2.5 is invalid"),
        ({"min_lr_ratio": 2.0}, r"--model.min_lr_ratio 2.0 is invalid: use a number in \[0, 1\]"),
        ({"weight_decay": -0.1}, r"--model.weight_decay -0.1 is invalid"),
        ({"weight_decay": float("inf")}, r"--model.weight_decay inf is invalid"),
        ({"beta1": 1.5}, r"--model.beta1 1.5 is invalid: use a number in \[0, 1\), such as 0.9"),
        ({"beta1": 1.0}, r"--model.beta1 1.0 is invalid"),
        ({"beta2": -0.5}, r"--model.beta2 -0.5 is invalid"),
        ({"beta2": "0.9"}, r"--model.beta2 '0.9' is invalid"),
        ({"peak_flops": 0.0}, r"--model.peak_flops 0.0 is invalid"),
        ({"loss_chunk_size": 0}, r"--model.loss_chunk_size 0 is invalid"),
        ({"n_heads": 3}, r"--model.n_heads 3 is invalid: it must divide the width \(16\)"),
        ({"norm_eps": float("inf")}, r"--model.norm_eps inf is invalid: use a small positive"),
        ({"attn_softcap": float("inf")}, r"--model.attn_softcap inf is invalid: use a finite"),
        ({"rope_theta": float("nan")}, r"--model.rope_theta nan is invalid"),
        ({"drop_rate": float("nan")}, r"--model.drop_rate nan is invalid"),
    ],
)


def test_invalid_hyperparameters_name_the_flag(override, message):
    with pytest.raises(ValueError, match=message):
        GPTLitModule(**{**TINY, **override})


def test_the_edges_of_the_ranges_are_taken():
    GPTLitModule(**{**TINY, "beta1": 0.0, "beta2": 0.999, "min_lr_ratio": 1.0,
                    "weight_decay": 0.0, "warmup_steps": 0, "peak_flops": 1e12,
                    "loss_chunk_size": 1})


def test_a_run_shorter_than_its_warmup_still_decays_and_gptmini_says_why(capsys):
    """Before: warmup_steps=200 in a 100-step run warmed up over all 100 steps and ended at
    the peak rate, and the warning was printed as Lightning's (its trainer/call.py)."""
    module = GPTLitModule(**{**TINY, "warmup_steps": 200, "min_lr_ratio": 0.1})
    module.trainer = SimpleNamespace(max_steps=100, estimated_stepping_batches=100,
                                     is_global_zero=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said as gptmini's own line, not a warning
        schedule = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    factors = [schedule.lr_lambdas[0](s) for s in range(100)]
    peak = factors.index(max(factors))
    assert factors[peak] == pytest.approx(1.0) and peak == 49  # warmed up over half the run
    assert all(a > b for a, b in zip(factors[peak + 1:], factors[peak + 2:], strict=False))
    assert factors[-1] < 0.11  # the last step is near the floor, not at the peak
    said = capsys.readouterr().out
    assert "--model.warmup_steps 200 is more than half of this run's 100 optimizer steps" in said
    assert "--trainer.max_steps" in said


def test_every_shipped_recipe_keeps_the_warmup_it_asks_for():
    """The cap only touches runs shorter than twice their warm-up: no shipped config is one."""
    configs = [REPO / "gptmini/configs/shakespeare-cpu.yaml", *sorted(REPO.glob("configs/*.yaml"))]
    for path in configs:
        config = yaml.safe_load(path.read_text())
        steps, warmup = config["trainer"]["max_steps"], config["model"]["warmup_steps"]
        assert warmup_for(warmup, steps) == warmup, path.name


def _module_after_backward(scale: float, poison: bool = False):
    """A module, its fused AdamW, and gradients of one batch (the loss times `scale`)."""
    module = GPTLitModule(**TINY)
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(model=module),
                                     precision="32-true", global_step=7)
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    if poison:  # a NaN weight makes the loss NaN
        with torch.no_grad():
            module.model.tok_emb.weight[3] = math.nan
    inputs = torch.randint(0, 50257, (2, 8))
    inputs[0, 0] = 3
    (lm_loss(module.model, inputs, torch.randint(0, 50257, (2, 8))) * scale).backward()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)
    return module, logged, optimizer


def _grad_norm(module: GPTLitModule) -> float:
    norms = [p.grad.norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item()


def test_clipping_logs_the_norm_before_clipping_and_clips_to_the_limit():
    module, logged, optimizer = _module_after_backward(scale=100.0)
    before = _grad_norm(module)
    module.configure_gradient_clipping(optimizer, gradient_clip_val=1.0,
                                       gradient_clip_algorithm="norm")
    assert logged["train/grad_norm"].item() == pytest.approx(before, rel=1e-5)
    assert before > 1.0 and _grad_norm(module) == pytest.approx(1.0, rel=1e-4)


def test_without_a_clip_value_the_norm_is_logged_and_gradients_are_untouched():
    module, logged, optimizer = _module_after_backward(scale=100.0)
    grads = [p.grad.clone() for p in module.parameters()]
    module.configure_gradient_clipping(optimizer, gradient_clip_val=None)
    assert logged["train/grad_norm"].item() == pytest.approx(_grad_norm(module), rel=1e-5)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, module.parameters(), strict=True))


@pytest.mark.parametrize("cause", ["inf gradient, clip by norm", "inf gradient, clip by value",
                                   "nan loss"])
def test_a_non_finite_step_never_updates_the_weights_and_stops_at_the_next_check(cause):
    module, _, optimizer = _module_after_backward(scale=1.0, poison=cause == "nan loss")
    if cause.startswith("inf"):
        module.model.out_head.weight.grad[0, 0] = math.inf
    before = {k: v.clone() for k, v in module.state_dict().items()}
    algorithm = "value" if cause.endswith("value") else "norm"
    module.configure_gradient_clipping(optimizer, 1.0, gradient_clip_algorithm=algorithm)
    optimizer.step()  # fused AdamW skips on the device: no weight, no moment, no step count
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]) or value.isnan().any() == before[key].isnan().any()
        assert torch.equal(value.nan_to_num(), before[key].nan_to_num()), key
    assert all(float(s["step"]) == 0 for s in optimizer.state.values())
    with pytest.raises(FloatingPointError, match="not finite at step 7 .1 step.s. up to step 7"):
        module.on_save_checkpoint({})  # the next check: no checkpoint of a non-finite run


def test_after_a_skipped_step_a_finite_one_updates_again():
    module, _, optimizer = _module_after_backward(scale=1.0)
    module.model.out_head.weight.grad[0, 0] = math.inf
    module.configure_gradient_clipping(optimizer, 1.0)
    optimizer.step()
    weight = module.model.trf_blocks[0].att.W_query.weight.clone()
    module.model.out_head.weight.grad[0, 0] = 0.0
    module.configure_gradient_clipping(optimizer, 1.0)
    optimizer.step()
    assert not torch.equal(weight, module.model.trf_blocks[0].att.W_query.weight)


PRETRAINED = dict(context_length=32, emb_dim=16, n_heads=2, n_layers=2,
                  drop_rate=0.0, qkv_bias=True, tie_weights=True)


def _exported_gpt2(tmp_path) -> GPTModel:
    """A small random GPT-2 written in the Hugging Face layout, as a downloaded one would be."""
    torch.manual_seed(5)
    model = GPTModel(GPTConfig(vocab_size=50257, **PRETRAINED)).eval()
    export_hf(model, tmp_path / "gpt2")
    return model


def _setup_for_fit(module: GPTLitModule, resuming=False) -> GPTLitModule:
    module.trainer = SimpleNamespace(world_size=1, global_rank=0)
    module.resuming = resuming
    module.setup("fit")
    return module.eval()


def test_init_from_starts_the_run_from_the_pretrained_weights(tmp_path):
    pretrained = _exported_gpt2(tmp_path)
    module = _setup_for_fit(GPTLitModule(**PRETRAINED, peak_flops=1.0,
                                         init_from=str(tmp_path / "gpt2")))
    for name, tensor in pretrained.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], tensor), name


def test_init_from_with_a_shorter_context_computes_what_the_pretrained_model_does(tmp_path):
    pretrained = _exported_gpt2(tmp_path)
    module = _setup_for_fit(GPTLitModule(**{**PRETRAINED, "context_length": 8}, peak_flops=1.0,
                                         init_from=str(tmp_path / "gpt2")))
    idx = torch.randint(0, 50257, (2, 8))
    torch.testing.assert_close(module.model(idx), pretrained(idx))


def test_init_from_is_skipped_when_resuming(tmp_path):
    _exported_gpt2(tmp_path)
    module = GPTLitModule(**PRETRAINED, peak_flops=1.0, init_from=str(tmp_path / "gpt2"))
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    _setup_for_fit(module, resuming=True)
    assert all(torch.equal(before[k], v) for k, v in module.model.state_dict().items())


def test_init_from_a_different_shape_names_the_fields_and_the_fix(tmp_path):
    _exported_gpt2(tmp_path)
    module = GPTLitModule(**{**PRETRAINED, "n_layers": 3, "context_length": 64},
                          peak_flops=1.0, init_from=str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match=r"n_layers=2, context_length=32\); set "
                                         r"--model.n_layers 2 --model.context_length 32"):
        _setup_for_fit(module)


def test_bits_per_byte_is_the_nats_of_text_targets_over_their_bytes():
    """A hand computation, independent of the module's: float64 log-softmax of the model's
    logits, each target's byte length from tiktoken, <|endoftext|> targets left out."""
    import lightning as L

    from gptmini.tokenizer import get_tokenizer

    enc = get_tokenizer("gpt2")
    module = GPTLitModule(tokenizer="gpt2", context_length=8, emb_dim=16, n_heads=2,
                          n_layers=1, drop_rate=0.0)
    ids = enc.encode("Hello world, what light through yonder window<|endoftext|> breaks",
                     allowed_special="all")
    rows = torch.tensor([ids[:9], ids[2:11]])  # 11 ids; <|endoftext|> is the 10th
    batches = [(rows[:, :-1], rows[:, 1:]), (rows[:1, 1:], rows[:1, :-1])]
    nats = num_bytes = 0.0
    with torch.no_grad():
        for inputs, targets in batches:
            logp = module.model(inputs).double().log_softmax(-1)
            for b, t in zip(*torch.nonzero(targets >= 0, as_tuple=True), strict=True):
                token = int(targets[b, t])
                if token == enc.eot_token:
                    continue
                nats -= float(logp[b, t, token])
                num_bytes += len(enc.decode_single_token_bytes(token))
    assert enc.eot_token in rows  # the special target is there, and must be dropped
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # the batches as they are
    trainer.validate(module, dataloaders=loader, verbose=False)
    bpb = float(trainer.callback_metrics["val/bpb"])
    assert bpb == pytest.approx(nats / num_bytes / math.log(2), rel=1e-5)


def test_a_training_step_reaches_the_model_through_at_most_three_files():
    """Issue 53: a reader follows one step from GPTLitModule.training_step through the
    task's loss to model(...) in at most three files of gptmini (sharding, compiling and
    Lightning's internals to the side): the gptmini files on the stack when the model's
    forward is entered."""
    import sys

    module = GPTLitModule(**TINY)
    module.log = lambda *args, **kwargs: None  # (Lightning's logging needs a trainer)
    module.throughput.count = lambda tokens: None
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    package = Path(__file__).resolve().parents[2] / "gptmini"
    seen = []

    def on_call(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "forward" and not seen and \
                code.co_filename.endswith("gptmini/model/gpt.py"):
            stack, f = [], frame
            while f is not None:
                if f.f_code.co_filename.startswith(str(package)):
                    stack.append(str(Path(f.f_code.co_filename).relative_to(package.parent)))
                f = f.f_back
            seen.append(list(dict.fromkeys(reversed(stack))))

    sys.setprofile(on_call)
    try:
        module.training_step(batch, 0)
    finally:
        sys.setprofile(None)
    assert seen == [["gptmini/train/module.py", "gptmini/train/tasks/language.py",
                     "gptmini/model/gpt.py"]]
