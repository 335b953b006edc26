"""train.py's inputs: corpora a new user points it at (missing, empty, mis-encoded,
compressed, JSON with other fields) and command lines with wrong values."""

import gzip
import json
import random

from robustness_cases.lab import Lab, last_line, outcome


def train_case(files: dict, *extra: str, source: str | None = None, expect_error=True):
    """A train.py run on files written first; an error is what is wanted (or not)."""

    def case(lab: Lab):
        where = lab.folder()
        for name, content in files.items():
            path = where / name
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        src = None if source is None else source.replace("{d}", str(where))
        proc = lab.run("train.py", *lab.args(where, *extra, source=src), cwd=where)
        result = outcome(proc)
        if result == "ok" and expect_error:
            result = "silent"
        return result, last_line(proc)

    return case


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def random_words() -> bytes:
    """Text that compresses to ~7 kB, not ~100 B: a gzip cut at 4 kB is truncated."""
    rng = random.Random(0)
    return " ".join(rng.choice(["to", "be", "or", "not", "that", "is"])
                    for _ in range(20000)).encode()


GOOD = [{"text": f"Romeo said {w} to the moon, and Juliet answered."} for w in range(60)]


def missing_text(skip: bool):
    def case(lab: Lab):
        where = lab.folder()
        records = [r if i % 2 else {"body": r["text"]} for i, r in enumerate(GOOD)]
        (where / "d.jsonl").write_text(jsonl(records))
        extra = ["--data.corpus.skip_missing_text", "true"] if skip else []
        proc = lab.run("train.py", *lab.args(where, *extra, source=where / "d.jsonl"),
                       cwd=where)
        result = outcome(proc)
        said = "30 of 60" in proc.stderr + proc.stdout
        if result == "ok" and not said:
            result = "silent"  # half the records gone without a word
        return result, last_line(proc)

    return case


def full_disk(lab: Lab):
    """No room for the token cache (a file-size limit: EFBIG, as ENOSPC): the error must
    name the cache, which the OS error does not."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    where = lab.folder()
    proc = lab.run("train.py", *lab.args(where, "--model.tokenizer", "gpt2"), cwd=where,
                   preexec_fn=limit)
    result = outcome(proc)
    if result == "clear error" and "token cache" not in proc.stderr:
        result = "silent"  # refused, but no file named
    return result, last_line(proc)


CORPUS = {
    "the default tiny run": train_case({}, expect_error=False),
    "a missing file": train_case({}, source="{d}/missing.txt"),
    "a typo'd local name (taken for a hub dataset)":
        train_case({"small.txt": "x " * 400}, source="smal"),
    "a hub dataset, offline": train_case({}, source="someone/corpus"),
    "a folder with no corpus files": train_case({"a.csv": "1,2"}, source="{d}"),
    "a glob matching nothing": train_case({}, source="{d}/*.txt"),
    "an unsupported extension": train_case({"a.csv": "1,2"}, source="{d}/a.csv"),
    "an empty file": train_case({"e.txt": ""}, source="{d}/e.txt"),
    "a corpus shorter than the context": train_case({"s.txt": "To be."}, source="{d}/s.txt"),
    "Latin-1 bytes": train_case({"l.txt": "caf\u00e9 ".encode("latin-1") * 300},
                                source="{d}/l.txt"),
    "Latin-1 bytes, with encoding_errors replace": train_case(
        {"l.txt": "caf\u00e9 ".encode("latin-1") * 300}, "--data.corpus.encoding_errors", "replace",
        source="{d}/l.txt", expect_error=False),
    "UTF-16 text": train_case({"w.txt": ("\ufeff" + "wide text " * 300).encode("utf-16-le")},
                              source="{d}/w.txt"),
    "UTF-32 text": train_case({"w.txt": ("wider text " * 300).encode("utf-32")},
                              source="{d}/w.txt"),
    "a .gz that is not gzip": train_case({"p.txt.gz": "plain " * 300}, source="{d}/p.txt.gz"),
    "a truncated .gz": train_case({"t.txt.gz": gzip.compress(random_words())[:4000]},
                                  source="{d}/t.txt.gz"),
    "a jsonl cut off mid-line": train_case({"d.jsonl": jsonl(GOOD) + '{"text": "cut off'},
                                           source="{d}/d.jsonl"),
    "jsonl records without the text field": missing_text(skip=False),
    "the same, skipping them on purpose": missing_text(skip=True),
    "a text_field that no record has": train_case(
        {"d.jsonl": jsonl(GOOD)}, "--data.corpus.text_field", "body", source="{d}/d.jsonl"),
    "a text_field holding numbers": train_case(
        {"d.jsonl": jsonl([{"text": 1} for _ in range(50)])}, source="{d}/d.jsonl"),
    "json files whose fields differ": train_case(
        {"a.jsonl": jsonl(GOOD), "b.jsonl": jsonl([{**r, "id": i} for i, r in enumerate(GOOD)])},
        source="{d}/*.jsonl", expect_error=False),
    "val_fraction 1.5": train_case({}, "--data.corpus.val_fraction", "1.5"),
    "batch_size 0": train_case({}, "--data.loader.batch_size", "0"),
    "num_workers -1": train_case({}, "--data.loader.num_workers", "-1"),
}

COMMAND_LINE = {
    "max_steps -5": train_case({}, "--trainer.max_steps", "-5"),
    "accelerator gpu without a GPU": train_case({}, "--trainer.accelerator", "gpu"),
    "checkpoint_every -1": train_case({}, "--checkpoint_every", "-1"),
    "checkpoint_every 0": train_case({}, "--checkpoint_every", "0"),
    "sample_every -1": train_case({}, "--sample_every", "-1"),
    "an unknown option": train_case({}, "--model.n_layer", "2"),
    "n_heads that do not divide emb_dim": train_case({}, "--model.n_heads", "3"),
    "a negative learning rate": train_case({}, "--model.learning_rate", "-1"),
    "a tiktoken encoding, offline": train_case({}, "--model.tokenizer", "cl100k_base"),
    "an unknown tokenizer": train_case({}, "--model.tokenizer", "nope"),
    "fast_dev_run": train_case({}, "--trainer.fast_dev_run", "true", expect_error=False),
    "validation inside a gradient accumulation": train_case(
        {}, "--trainer.accumulate_grad_batches", "4", "--trainer.val_check_interval", "6"),
    "a missing --config": train_case({}, "--config", "missing.yaml"),
    "a --config that is not YAML": train_case({"c.yaml": "model: [unclosed"}, "--config",
                                              "c.yaml"),
    "init_from a missing folder": train_case({}, "--model.init_from", "nowhere"),
    "a missing --ckpt_path": train_case({}, "--ckpt_path", "nope.ckpt"),
    "a text file as --ckpt_path": train_case({"n.ckpt": "my notes"}, "--ckpt_path", "n.ckpt"),
    "a truncated --ckpt_path": train_case({"t.ckpt": b"PK\x03\x04" + b"\0" * 500},
                                          "--ckpt_path", "t.ckpt"),
    "an MLA kv_lora_rank of 1000 on a 32-wide model": train_case(
        {}, "--model.layer_kinds", "[mla, mla, mla, mla]", "--model.mixer_options",
        "{mla: {kv_lora_rank: 1000}}", "--model.n_kv_heads", "null", "--model.qk_norm",
        "false"),
    "a window on a Gated DeltaNet layer": train_case(
        {}, "--model.layer_kinds", "[deltanet, attention]", "--model.window_size", "8"),
    "a full disk under the token cache": full_disk,
}

CASES = {**CORPUS, **COMMAND_LINE}
