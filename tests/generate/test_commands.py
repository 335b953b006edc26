"""The command lines behind generate.py and visualize.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS, PROMPT, make_model, png_size, save_checkpoint, tiny

from gptmini.analysis.visualize import visualize_main
from gptmini.checkpoint import load_checkpoint
from gptmini.generate.command import generate_main
from gptmini.generate.loop import generate, stream_text
from gptmini.model import GPTModel
from gptmini.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model = make_model(vocab_size=50257, context_length=32)
    return save_checkpoint(model, tmp_path / "tiny.ckpt")


def run_main(capsys, *argv) -> str:
    assert generate_main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def test_cli_greedy_continues_the_prompt(checkpoint, capsys):
    out = run_main(capsys, "--checkpoint", checkpoint, "--prompt", "ROMEO:",
                   "--max_new_tokens", 8, "--temperature", 0)
    model = make_model(vocab_size=50257, context_length=32)
    model.load_state_dict({k[6:]: v for k, v in torch.load(checkpoint)["state_dict"].items()})
    expected = "".join(stream_text(model, get_tokenizer("gpt2"), "ROMEO:", 8))
    assert out == "ROMEO:" + expected + "\n"


def test_cli_stream_prints_the_same_samples_as_no_stream(checkpoint, capsys):
    argv = ["--checkpoint", checkpoint, "--prompt", "ROMEO:", "--max_new_tokens", 10,
            "--seed", 5, "--num_samples", 2, "--top_p", 0.95]
    printed = run_main(capsys, *argv)
    assert printed == run_main(capsys, *argv, "--stream")
    assert printed.count("--- sample") == 2
    assert printed != run_main(capsys, *argv[:-4], "--seed", 6, *argv[-4:])
    # torch keeps 32 bits of a CPU seed: 5 + 2**32 drew seed 5's text before it was mixed
    assert printed != run_main(capsys, *argv[:-4], "--seed", 5 + 2**32, *argv[-4:])


def test_cli_empty_prompt_starts_from_end_of_text_and_prompt_file_is_read(
    checkpoint, tmp_path, capsys
):
    model, tok, _ = load_checkpoint(checkpoint)
    out = run_main(capsys, "--checkpoint", checkpoint, "--max_new_tokens", 3, "--seed", 0)
    gen = torch.Generator().manual_seed(0)  # generate.py's defaults: temperature 0.8, top_k 200
    expected = generate(model, torch.tensor([[tok.eot_token]]), 3, temperature=0.8, top_k=200,
                        generator=gen)
    assert out == tok.decode(expected[0, 1:].tolist()) + "\n"
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("JULIET:")
    out = run_main(capsys, "--checkpoint", checkpoint, "--prompt_file", prompt_file,
                   "--max_new_tokens", 3, "--temperature", 0)
    ids = tok.encode("JULIET:")
    greedy = generate(model, torch.tensor([ids]), 3)
    assert out == "JULIET:" + tok.decode(greedy[0, len(ids):].tolist()) + "\n"


def test_cli_reads_a_hugging_face_directory_as_transformers_does(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from gptmini.convert import export_hf

    directory = export_hf(make_model(vocab_size=50257, context_length=32, qkv_bias=True,
                                     tie_weights=True), tmp_path / "hf")
    out = run_main(capsys, "--hf", directory, "--prompt", "Hi", "--max_new_tokens", 4,
                   "--temperature", 0)
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    ids = torch.tensor([get_tokenizer("gpt2").encode("Hi")])
    greedy = hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    assert out == "Hi" + get_tokenizer("gpt2").decode(greedy[0, ids.shape[1]:].tolist()) + "\n"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--device", "cuda"], "not available"),
        (["--device", "nonsense"], "not a device"),
        (["--temperature", "-1"], "temperature"),
        (["--top_p", "2"], "top_p"),
        (["--prompt_file", "/no/such/prompt.txt"], "does not exist"),
    ],
)


def test_cli_bad_arguments_exit_with_a_message(checkpoint, capsys, extra, match):
    with pytest.raises(SystemExit) as exc:
        generate_main(["--checkpoint", str(checkpoint), *extra])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        generate_main(["--checkpoint", str(tmp_path / "nope.ckpt")])
    assert "no checkpoint at" in capsys.readouterr().err


def test_generate_py_script_end_to_end(checkpoint):
    result = subprocess.run(
        [sys.executable, "generate.py", "--checkpoint", str(checkpoint), "--prompt", "ROMEO:",
         "--max_new_tokens", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_SECONDS,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:")


def test_curves_command_and_its_errors(run_dir, tmp_path, capsys):
    assert visualize_main(["curves", str(run_dir), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").is_file()
    assert visualize_main(["curves", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics under" in err


def test_attention_command(checkpoint, tmp_path, capsys):
    out = tmp_path / "att.png"
    args = ["attention", "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--out", str(out)]
    assert visualize_main([*args, "--layer", "1", "--head", "1"]) == 0
    assert "layer 1, head 1" in capsys.readouterr().out
    single = png_size(out)
    assert visualize_main([*args, "--all_heads", "--left_pad", "2"]) == 0
    assert png_size(out) != single
    assert visualize_main([*args, "--head", "5"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head 5 is out of range" in err
    assert visualize_main([*args, "--layer", "7"]) == 1
    assert "valid: 0 to 1" in capsys.readouterr().err


def test_attention_command_on_a_hugging_face_directory(tmp_path, capsys):
    from gptmini.convert import export_hf

    model = GPTModel(tiny(qkv_bias=True, tie_weights=True))
    export_hf(model, tmp_path / "hf")
    out = tmp_path / "hf.png"
    assert visualize_main(["attention", "--hf", str(tmp_path / "hf"), "--prompt", PROMPT,
                           "--layer", "0", "--all_heads", "--out", str(out)]) == 0
    assert png_size(out)[0] > 0 and "layer 0, all heads" in capsys.readouterr().out


def test_a_padded_vocabulary_never_samples_an_id_the_tokenizer_lacks(tmp_path, capsys):
    """The defect: --model.vocab_size 50304 let generate.py draw id 50300 (a KeyError)."""
    model = make_model(vocab_size=50304, context_length=32)  # saved as old configs did
    with torch.no_grad():
        model.out_head.weight[50257:] = 50.0 * model.out_head.weight[50257:].sign()
    path = save_checkpoint(model, tmp_path / "wide.ckpt")
    out = run_main(capsys, "--checkpoint", path, "--temperature", 5, "--num_samples", 64,
                   "--max_new_tokens", 4, "--seed", 0)
    assert out.count("--- sample") == 64


def test_batch_file_writes_one_result_per_prompt_in_order(tmp_path, capsys):
    """Each result is what its prompt generates alone (greedy, float64), whatever the batch;
    jsonl records carry their own settings."""
    model = make_model(vocab_size=257, context_length=32)
    ckpt = save_checkpoint(model, tmp_path / "byte.ckpt", tokenizer="byte")
    enc, model = get_tokenizer("byte"), model.double()
    prompts = ["ROMEO:", "JULIET: O", "x", "<|endoftext|>", "What light"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n\n")
    common = ["--checkpoint", str(ckpt), "--temperature", "0", "--dtype", "float64"]
    assert generate_main([*common, "--batch_file", str(tmp_path / "prompts.txt"),
                          "--max_new_tokens", "6", "--max_batch", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in lines] == prompts and [r["index"] for r in lines] == [*range(5)]
    for line in lines:
        ids = enc.encode(line["prompt"], allowed_special="all")
        alone = generate(model, torch.tensor([ids]), 6, eos_id=enc.eot_token, use_cache=True)
        assert line["text"] == enc.decode(alone[0, len(ids):].tolist())
        assert line["finish_reason"] == ("length" if line["tokens"] == 6 else "stop")

    text = lines[0]["text"]  # random bytes: stop at the first new ASCII character after one
    k = next(k for k in range(1, len(text)) if text[k].isascii() and text[k] not in text[:k])
    (tmp_path / "prompts.jsonl").write_text(
        json.dumps({"prompt": "ROMEO:", "max_new_tokens": 3}) + "\n"
        + json.dumps({"prompt": "ROMEO:", "max_new_tokens": 6, "stop": text[k]}) + "\n")
    assert generate_main([*common, "--batch_file", str(tmp_path / "prompts.jsonl"),
                          "--output", str(tmp_path / "out.jsonl")]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out[0]["tokens"] == 3
    assert out[1]["text"] == text[:k] and out[1]["finish_reason"] == "stop"


def test_batch_file_bar_counts_generated_tokens(tmp_path, capsys, monkeypatch):
    """Before: the bar counted finished prompts and sat at 0/4 until the end; now it moves
    with every token, and a prompt that stops early adds its unused budget."""
    import tqdm

    seen = []

    class Bar(tqdm.tqdm):
        def update(self, n=1):
            super().update(n)
            seen.append((self.n, self.total))

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    ckpt = save_checkpoint(make_model(vocab_size=257), tmp_path / "byte.ckpt", tokenizer="byte")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "max_new_tokens": 5}) + "\n"
                                      + json.dumps({"prompt": "b", "max_new_tokens": 7}) + "\n")
    assert generate_main(["--checkpoint", str(ckpt), "--batch_file", str(tmp_path / "p.jsonl"),
                          "--temperature", "0"]) == 0
    assert {total for _, total in seen} == {12}
    positions = [n for n, _ in seen]
    assert positions == sorted(positions) and positions[-1] == 12
    assert len(set(positions)) >= 5  # token by token, not prompt by prompt
    assert "generating" in capsys.readouterr().err


def test_batch_file_errors_name_the_line(tmp_path, capsys):
    ckpt = save_checkpoint(make_model(vocab_size=257), tmp_path / "byte.ckpt", tokenizer="byte")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"promt": "b"}\n')
    with pytest.raises(SystemExit):
        generate_main(["--checkpoint", str(ckpt), "--batch_file", str(tmp_path / "bad.jsonl")])
    assert 'bad.jsonl:2 needs a "prompt" string' in capsys.readouterr().err


@pytest.mark.parametrize(("content", "extra", "match"), [
    # Before: each of these ended in a Python traceback or a message naming no file.
    ('{"prompt": "a", "stop": 5}\n', [], 'bad.jsonl:1: stop must be non-empty strings'),
    ('{"prompt": "a", "temperature": true}\n', [], 'temperature must be a number, any finite '
     'number >= 0, got True (a boolean)'),
    ('{"prompt": "a", "max_new_tokens": "5"}\n', [], 'max_new_tokens must be an integer'),
    ('{"prompt": "a", "seed": 1180591620717411303424}\n', [], 'seed must be an integer of 64'),
    ('{"prompt": "a", "top_k": 2.5}\n', [], 'bad.jsonl:1: top_k must be an integer >= 1'),
    ('{"prompt": "a", "logprobs": 2}\n', [], "unknown field(s) ['logprobs']"),
    (b"\xff\xfe\x00binary", [], "is not UTF-8 text (byte 0 is 0xff)"),
    ('{"prompt": "a"}\n', ["--output", "{dir}"], "is a directory; name a file"),
    ('{"prompt": "a"}\n', ["--output", "{dir}/missing/out.jsonl"], "cannot write there"),
    ('{"prompt": "a"}\n', ["--max_batch", "0"], "--max_batch >= 1"),
    ('{"prompt": "a"}\n', ["--seed", str(2**70)], "--seed 1180591620717411303424 is out of"),
])
def test_batch_file_and_flag_errors_name_the_input(tmp_path, capsys, content, extra, match):
    ckpt = save_checkpoint(make_model(vocab_size=257), tmp_path / "byte.ckpt", tokenizer="byte")
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    extra = [e.replace("{dir}", str(tmp_path)) for e in extra]
    with pytest.raises(SystemExit) as exc:
        generate_main(["--checkpoint", str(ckpt), "--batch_file", str(path), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_a_binary_prompt_file_is_named(tmp_path, capsys, checkpoint):
    (tmp_path / "p.txt").write_bytes(b"\x80\x81")
    with pytest.raises(SystemExit):
        generate_main(["--checkpoint", str(checkpoint), "--prompt_file", str(tmp_path / "p.txt")])
    assert "p.txt is not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "match"), [
    ("--block_size", "0", "--block_size 0 is invalid: use 1 or more"),
    ("--max_batch", "0", "--max_batch 0 is invalid: use 1 or more"),
    ("--max_step_tokens", "0", "--max_step_tokens 0 is invalid: use 1 or more"),
    ("--num_blocks", "-3", "--num_blocks -3 is invalid"),
    ("--timeout", "nan", "--timeout nan is invalid"),
    ("--drain", "-1", "--drain -1.0 is invalid"),
])
def test_serve_py_numbers_are_checked_before_the_engine(checkpoint, capsys, flag, value, match):
    """Before: --block_size 0 was a ZeroDivisionError, --max_batch 0 blamed num_blocks."""
    from gptmini.serve.command import serve_main

    pytest.importorskip("uvicorn")
    with pytest.raises(SystemExit) as exc:
        serve_main(["--checkpoint", str(checkpoint), "--port", "0", flag, value])
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_generate_py_says_its_defaults_and_its_speed_apart_from_the_text(checkpoint, capsys):
    """Before: --help showed no defaults and no run said how fast it generated."""
    with pytest.raises(SystemExit):
        generate_main(["--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 200)", "(default: 0.8)", "(default: 1)", "(default: cpu)"):
        assert default in helptext
    assert generate_main(["--checkpoint", str(checkpoint), "--prompt", "ROMEO:",
                          "--max_new_tokens", "6", "--temperature", "0", "--num_samples",
                          "2"]) == 0
    out, err = capsys.readouterr()
    assert "tokens/s" not in out  # the text alone on stdout, for a pipe or a file
    assert err.startswith("generate.py: 12 tokens in ") and "tokens/s" in err
