"""train.py after fine-tuning: DPO on pairs and GRPO on a verifiable task, from a checkpoint;
their metrics, their checkpoints loading wherever a checkpoint loads (generate, the engine,
evaluate.py, export), the reference kept across a resume, and a half-given run refused."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import column, read_metrics, save_checkpoint, tiny_args
from lightning.pytorch.callbacks import Callback

from gptmini.analysis.evaluate import evaluate_main
from gptmini.chat import GPTMINI, add_template_tokens
from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf
from gptmini.generate import generate
from gptmini.generate.engine import Engine
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer, save_tokenizer
from gptmini.train.command import build_cli, fit, main

WORDS = "one two three four five six seven eight nine ten eleven twelve".split()


@pytest.fixture
def source(tmp_path):
    """A tiny chat model of bytes (gptmini's template, its four tokens), as a .ckpt that
    --model.init_from takes: what an instruction-tuned checkpoint is."""
    torch.manual_seed(0)
    chat = add_template_tokens(get_tokenizer("byte"), GPTMINI)
    model = GPTModel(GPTConfig(vocab_size=chat.n_vocab, context_length=64, emb_dim=32,
                               n_heads=2, n_layers=2, drop_rate=0.0))
    path = save_checkpoint(model, tmp_path / "source.ckpt",
                           tokenizer=str(save_tokenizer(chat, tmp_path / "tokenizer.json")))
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, "chat_template": GPTMINI.to_dict()}, path)
    return path


@pytest.fixture
def pairs(tmp_path):
    """Pairs in the chat layout."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Say {w}.", "chosen": f"{w}, please.",
                                          "rejected": f"{w}, fool."})
                              for w in WORDS * 5) + "\n")
    return path


def run_args(tmp_path, corpus, source, *extra):
    return tiny_args(tmp_path, corpus, "--model.tokenizer", str(tmp_path / "tokenizer.json"),
                     "--model.init_from", str(source),
                     "--model.context_length", "64", "--model.optimizer", "adamw",
                     "--model.learning_rate", "3e-3", "--model.warmup_steps", "1",
                     "--trainer.max_steps", "8", "--trainer.val_check_interval", "4",
                     "--checkpoint_every", "4", *extra)


def test_dpo_from_a_checkpoint_ranks_the_chosen_first_and_its_checkpoint_loads_anywhere(
        tmp_path, corpus, source, pairs, capsys):
    assert main(run_args(tmp_path, corpus, source, "--data.preference.records", str(pairs))) == 0
    out = capsys.readouterr().out
    assert "template gptmini: 51 training pairs; 3 validation pairs" in out
    assert "validation   last  loss" in out and "accuracy" in out and "margin" in out
    run = tmp_path / "runs" / "tiny"
    rows = read_metrics(run)
    margins = column(rows, "val/margin")
    assert len(margins) == 2 and 0 < margins[0] < margins[1]  # the margin rises
    assert column(rows, "val/accuracy")[-1] == 1.0
    for name in ("loss", "chosen_reward", "rejected_reward", "margin", "accuracy"):
        assert column(rows, f"train/{name}"), name
    assert (run / "curves.png").is_file()

    checkpoint = run / "checkpoints" / "last.ckpt"
    model, tokenizer, hparams = load_checkpoint(checkpoint)
    assert hparams["dpo"] == {"beta": 0.1, "variant": "paper"}
    assert tokenizer.n_vocab == 257 + 4 and hparams["chat_template"]["name"] == "gptmini"
    ids = torch.tensor([tokenizer.encode("Say one.")])
    assert generate(model, ids, 3).shape == (1, ids.shape[1] + 3)
    assert len(Engine(model).generate([ids[0].tolist()], max_new_tokens=3)[0].tokens) == 3
    export_hf(model, tmp_path / "hf", tokenizer)
    assert load_checkpoint(tmp_path / "hf").model.cfg.n_layers == 2
    assert evaluate_main(["--checkpoint", str(checkpoint)]) == 0  # its held-out pairs
    said = capsys.readouterr().out
    assert f"the test split of {pairs} (6 pairs)" in said
    assert f"rewards against {source}, beta 0.1, paper" in said
    assert "preference accuracy 1.0000" in said


def test_dpo_with_lora_measures_against_the_base_and_saves_the_adapters(
        tmp_path, corpus, source, pairs, capsys):
    assert main(run_args(tmp_path, corpus, source, "--data.preference.records", str(pairs),
                         "--model.lora_rank", "4", "--model.dpo.variant", "book",
                         "--model.dpo.beta", "0.5")) == 0
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["lora"]["base"] == str(source)
    assert all("lora_" in k for k in saved["state_dict"])
    assert column(read_metrics(tmp_path / "runs" / "tiny"), "val/margin")[-1] > 0
    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(checkpoint), "--preference", str(pairs)]) == 0
    assert "beta 0.5, book" in capsys.readouterr().out


class StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.slow
def test_a_resumed_dpo_run_keeps_the_starting_weights_as_its_reference(
        tmp_path, corpus, source, pairs):
    """8 steps straight, and 4 + resume + 4, end on the same weights: the resumed run's
    reference is init_from's weights, not the checkpoint's (rewards would differ)."""
    def final(name: str, stop_at: int | None = None, resume: bool = False) -> dict:
        args = run_args(tmp_path, corpus, source, "--data.preference.records", str(pairs),
                        "--run_name", name, "--checkpoint_every", "1")
        cli = build_cli(args + (["--ckpt_path", "last"] if resume else []))
        if stop_at is not None:
            cli.trainer.callbacks.append(StopAt(stop_at))
        fit(cli)
        return {k: v.clone() for k, v in cli.model.state_dict().items()}

    straight = final("straight")
    final("resumed", stop_at=4)
    resumed = final("resumed", resume=True)
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)


def test_grpo_on_a_shipped_task_logs_its_metrics_and_scores_pass_at_1(
        tmp_path, corpus, source, capsys):
    assert main(run_args(tmp_path, corpus, source, "--data.rl.task", "addition",
                         "--data.rl.size", "1", "--data.rl.heldout", "12",
                         "--data.rl.train_prompts", "40", "--data.rl.inner_steps", "2",
                         "--model.grpo.group_size", "4", "--model.grpo.max_new_tokens", "4",
                         "--model.grpo.kl_weight", "0.05")) == 0
    out = capsys.readouterr().out
    assert "rl task addition, template gptmini: 40 training prompts in batches of 4 (2 inner" in out
    assert "validation   last  pass@1" in out
    run = tmp_path / "runs" / "tiny"
    rows = read_metrics(run)
    for name in ("reward", "response_length", "zero_variance", "clip_fraction", "kl",
                 "rollout_tokens_per_sec", "tokens_per_sec", "logprob_gap"):
        assert column(rows, f"train/{name}"), name
    assert max(column(rows, "train/logprob_gap")) < 1e-4
    assert len(column(rows, "val/pass_at_1")) == 2
    assert (run / "checkpoints" / "best.ckpt").is_file()
    assert evaluate_main(["--checkpoint", str(run / "checkpoints" / "last.ckpt")]) == 0
    said = capsys.readouterr().out
    assert "12 held-out prompts of addition, template gptmini" in said and "pass@1" in said
    assert "sampled reward" in said and "pass@8" in said


def test_sft_rollouts_and_evaluation_render_one_template(tmp_path, corpus, source, capsys):
    """A failure mode of GRPO (issue 56): the fine-tune before it taught one format, and the
    rollouts or the scoring ask in another, so every reward measures a model out of its
    format. The fine-tune here takes a template of its own (not gptmini's, its source's);
    GRPO from it, with "auto", samples in that one, and evaluate.py scores in it."""
    terse = replace(GPTMINI, name="terse", source=(
        "{%- for m in messages -%}{{ '<|' + m['role'] + '|>Q ' + m['content'] + '<|end|>' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"))
    (tmp_path / "terse.json").write_text(json.dumps(terse.to_dict()))
    assert main(run_args(tmp_path, corpus, source, "--data.chat.records", "task:addition:2",
                         "--data.chat.template", str(tmp_path / "terse.json"),
                         "--run_name", "sft", "--trainer.max_steps", "4")) == 0
    sft = tmp_path / "runs" / "sft" / "checkpoints" / "last.ckpt"
    capsys.readouterr()
    assert main(run_args(tmp_path, corpus, sft, "--data.rl.task", "addition",
                         "--data.rl.size", "1", "--data.rl.heldout", "8",
                         "--data.rl.train_prompts", "16", "--model.grpo.group_size", "2",
                         "--model.grpo.max_new_tokens", "4", "--run_name", "grpo",
                         "--trainer.max_steps", "4")) == 0
    assert "rl task addition, template terse:" in capsys.readouterr().out
    grpo = tmp_path / "runs" / "grpo" / "checkpoints" / "last.ckpt"
    tuned, rolled = (torch.load(path, weights_only=True)["chat_template"] for path in (sft, grpo))
    assert tuned["source"] == terse.source and rolled == tuned
    assert evaluate_main(["--checkpoint", str(grpo), "--samples", "2"]) == 0
    assert "held-out prompts of addition, template terse" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "words"), [
    (["--model.dpo.beta", "0.2"], "--model.dpo.* tunes on --data.preference.records"),
    (["--data.rl.task", "addition", "--data.preference.records", "book"],
     "--data.preference and --data.rl are different kinds of fine-tune"),
    (["--data.rl.task", "file", "--data.rl.prompts", "p.jsonl", "--data.rl.reward",
      "no_such_rewards:f"], "--data.rl.reward 'no_such_rewards:f': module 'no_such_rewards' "
                           "cannot be imported"),
    (["--model.dpo.beta", "0", "--data.preference.records", "book"],
     "--model.dpo.beta 0.0 is invalid: use a positive number"),
    (["--model.grpo.clip_eps", "2", "--data.rl.task", "count"],
     "--model.grpo.clip_eps 2.0 is invalid: use a number in (0, 1)"),
])
def test_a_half_given_or_bad_run_is_refused_by_name(tmp_path, corpus, source, capsys, extra,
                                                    words):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    assert main(run_args(tmp_path, corpus, source, *extra)) != 0
    assert words in capsys.readouterr().err


def test_preference_pairs_need_a_starting_checkpoint(tmp_path, corpus, pairs, capsys):
    assert main(tiny_args(tmp_path, corpus, "--data.preference.records", str(pairs))) != 0
    assert "DPO tunes a model against its own starting weights" in capsys.readouterr().err
