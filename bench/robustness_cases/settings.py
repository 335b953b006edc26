"""Float settings (every GPTConfig and optimizer float, the trainer's clip and the stop
grace: non-finite, zero, negative, out of range, the wrong type), which must be refused
naming the flag; seeds that differ only above 32 bits, which must draw different text; and
checkpoints that would load into wrong numbers (a tokenizer that is not the model's,
weights holding NaN), which every loader must refuse by name."""

from robustness_cases.lab import Lab, last_line, outcome, trained
from robustness_cases.serve import TINY_CHECKPOINT


def flag_case(flag: str, value: str):
    """train.py with one bad float: an error that names `flag` is the answer."""

    def case(lab: Lab):
        where = lab.folder()
        proc = lab.run("train.py", *lab.args(where, flag, value), cwd=where, timeout=300)
        result, line = outcome(proc), last_line(proc)
        if result == "ok":
            result = "silent"  # trained with it
        elif result == "clear error" and flag.lstrip("-") not in proc.stderr:
            result = "silent"  # refused, but the user is not told which flag
        return result, line

    return case


FLOATS = {
    "--model.beta1 1.5": flag_case("--model.beta1", "1.5"),
    "--model.beta1 1.0": flag_case("--model.beta1", "1.0"),
    "--model.beta2 -0.1": flag_case("--model.beta2", "-0.1"),
    "--model.beta2 .nan": flag_case("--model.beta2", ".nan"),
    "--model.learning_rate .inf": flag_case("--model.learning_rate", ".inf"),
    "--model.learning_rate 0": flag_case("--model.learning_rate", "0"),
    "--model.muon_learning_rate -1": flag_case("--model.muon_learning_rate", "-1"),
    "--model.min_lr_ratio .nan": flag_case("--model.min_lr_ratio", ".nan"),
    "--model.weight_decay -0.1": flag_case("--model.weight_decay", "-0.1"),
    "--model.weight_decay .inf": flag_case("--model.weight_decay", ".inf"),
    "--model.warmup_steps -1": flag_case("--model.warmup_steps", "-1"),
    "--model.peak_flops 0": flag_case("--model.peak_flops", "0"),
    "--model.loss_chunk_size 0": flag_case("--model.loss_chunk_size", "0"),
    "--model.attn_softcap .inf": flag_case("--model.attn_softcap", ".inf"),
    "--model.attn_softcap 0": flag_case("--model.attn_softcap", "0"),
    "--model.norm_eps .inf": flag_case("--model.norm_eps", ".inf"),
    "--model.norm_eps 1e300": flag_case("--model.norm_eps", "1e300"),
    "--model.norm_eps 0": flag_case("--model.norm_eps", "0"),
    "--model.rope_theta .nan": flag_case("--model.rope_theta", ".nan"),
    "--model.rope_theta 0.5": flag_case("--model.rope_theta", "0.5"),
    "--model.drop_rate 1.0": flag_case("--model.drop_rate", "1.0"),
    "--model.drop_rate .nan": flag_case("--model.drop_rate", ".nan"),
    "--model.attn_drop_rate -0.5": flag_case("--model.attn_drop_rate", "-0.5"),
    "--model.norm_eps a string": flag_case("--model.norm_eps", "small"),
    "--trainer.gradient_clip_val -1": flag_case("--trainer.gradient_clip_val", "-1"),
    "--trainer.gradient_clip_val .nan": flag_case("--trainer.gradient_clip_val", ".nan"),
    "--stop_grace .nan": flag_case("--stop_grace", ".nan"),
    "--seed_everything 2**32+1": flag_case("--seed_everything", str(2**32 + 1)),
}


def seeds_differ(first: int, second: int, batch: bool = False):
    """generate.py (or a --batch_file record) with two seeds: the texts must differ."""

    def case(lab: Lab):
        where = lab.folder()
        lab.python(TINY_CHECKPOINT, str(where / "tiny.ckpt"), cwd=where)
        texts, line = [], ""
        for seed in (first, second):
            if batch:
                (where / "b.jsonl").write_text(f'{{"prompt": "a", "seed": {seed}}}\n')
                extra = ["--batch_file", str(where / "b.jsonl")]
            else:
                extra = ["--seed", str(seed), "--prompt", "a"]
            proc = lab.run("generate.py", "--checkpoint", str(where / "tiny.ckpt"),
                           "--temperature", "1.0", "--top_k", "0", "--max_new_tokens", "12",
                           "--dtype", "float32", *extra, cwd=where, timeout=120)
            if proc.returncode != 0:
                return outcome(proc), last_line(proc)
            texts.append(proc.stdout)
            line = proc.stdout.strip().splitlines()[-1][:60]
        same = texts[0] == texts[1]
        return ("silent" if same else "ok"), ("the same text: " if same else "differ: ") + line

    return case


SEEDS = {
    "generate.py --seed 1 vs 2**32+1": seeds_differ(1, 2**32 + 1),
    "generate.py --seed 0 vs 2**32": seeds_differ(0, 2**32),
    "generate.py --seed -1 vs 2**32-1": seeds_differ(-1, 2**32 - 1),
    "generate.py --seed 5 vs 2**63+5": seeds_differ(5, 2**63 + 5),
    "batch file seed 1 vs 2**32+1": seeds_differ(1, 2**32 + 1, batch=True),
    "batch file seed 7 vs -2**63+7": seeds_differ(7, -(2**63) + 7, batch=True),
}

SWAP_TOKENIZER = """
import sys, torch
from gptmini.tokenizer import get_tokenizer, tokenizer_to_dict, train_bpe
path, kind = sys.argv[1], sys.argv[2]
ckpt = torch.load(path, weights_only=True)
if kind == "nan":
    key = next(k for k in ckpt["state_dict"] if k.endswith("W_query.weight"))
    ckpt["state_dict"][key].view(-1)[:3] = float("nan")
else:  # the byte vocabulary beside a model trained on the gpt2 one: it once read as padding
    ckpt["tokenizer"] = tokenizer_to_dict(get_tokenizer("byte"))
torch.save(ckpt, path)
"""


def loaded_by(script: str, kind: str, *extra: str):
    """`script` on a trained checkpoint made wrong (`kind`): refusing it is the answer."""

    def case(lab: Lab):
        where = lab.folder()
        path = trained(lab, where)
        lab.python(SWAP_TOKENIZER, str(path), kind, cwd=where)
        args = [a.replace("{corpus}", str(lab.corpus)) for a in extra]
        proc = lab.run(script, "--checkpoint", str(path), *args, cwd=where, timeout=120)
        result = outcome(proc)
        return ("silent" if result == "ok" else result), last_line(proc)

    return case


def cuda_without_cuda(script: str, *extra: str):
    def case(lab: Lab):
        where = lab.folder()
        lab.python(TINY_CHECKPOINT, str(where / "tiny.ckpt"), cwd=where)
        args = [a.replace("{corpus}", str(lab.corpus)) for a in extra]
        proc = lab.run(script, "--checkpoint", str(where / "tiny.ckpt"), "--device", "cuda",
                       *args, cwd=where, timeout=120)
        result, line = outcome(proc), last_line(proc)
        if "corrupt" in line:
            result = "silent"  # blames the checkpoint for the machine
        return result, line

    return case


CHECKPOINTS = {
    "generate.py: a tokenizer that is not the model's": loaded_by(
        "generate.py", "tokenizer", "--max_new_tokens", "2"),
    "evaluate.py: a tokenizer that is not the model's": loaded_by(
        "evaluate.py", "tokenizer", "--data", "{corpus}"),
    "generate.py: NaN weights": loaded_by("generate.py", "nan", "--max_new_tokens", "2"),
    "evaluate.py: NaN weights": loaded_by("evaluate.py", "nan", "--data", "{corpus}"),
    "serve.py: NaN weights": loaded_by("serve.py", "nan", "--port", "0"),
    "evaluate.py --device cuda without CUDA": cuda_without_cuda("evaluate.py", "--data",
                                                                "{corpus}"),
    "serve.py --device cuda without CUDA": cuda_without_cuda("serve.py", "--port", "0"),
}

CASES = {**FLOATS, **SEEDS, **CHECKPOINTS}
