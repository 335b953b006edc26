"""Tasks whose answers a program checks: the prompts and rewards of reinforcement learning with
verifiable rewards (GRPO), and worked examples for the short fine-tune before it.

Three ship, each generated from a seed and small enough for a CPU to learn in minutes:

    addition   "What is 47 + 385?" -> "432" (`size` digits at most per number, default 3)
    reverse    "Reverse the letters of: kzqa" -> "aqzk" (`size` letters, default 4)
    count      "How many times does the letter a appear in: abcaab?" -> "3" (`size` letters)

A task of your own is a prompts file (.jsonl, one record a line with "prompt": a string or
chat messages, and any fields your checker reads) and a reward function given by import
path ("my_module:reward", called as `reward(completion: str, record: dict) -> float`).

The reward of a completion is its answer's (1 right, 0 wrong; a function of your own returns
any finite number) plus, with `format_weight`, that weight when the completion is well formed
(a built-in task's answer alone, and ended by the stop token). A reward function that
cannot be imported, raises, or returns NaN or no number stops the run with an error naming
it, the record and the fix: a silently wrong reward would train the model on noise.
"""

import importlib
import json
import math
import random
import re
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

from gptmini.chat import check_messages


class Problem(NamedTuple):
    """One prompt of a task: the user's message(s), and what its checker reads (a tuple, so
    that a batch of them passes through Lightning's device transfer as it is)."""

    messages: tuple[dict, ...]
    record: Mapping = MappingProxyType({})
    """A built-in task's {"answer": ...}; a file's record as it was written."""
    where: str = ""
    """Where it came from ("FILE line N", or the task and seed), for errors."""

    @property
    def key(self) -> str:
        """What tells two prompts apart (held-out prompts never train)."""
        return json.dumps(self.messages, sort_keys=True)


class VerifiableTask(ABC):
    """Prompts and a checker (see the module docstring)."""

    name: str

    @abstractmethod
    def problems(self, count: int, seed: int) -> list[Problem]:
        """Up to `count` distinct prompts drawn from `seed` (the same ones for the same
        seed); fewer when the task has fewer."""

    @abstractmethod
    def answer_reward(self, problem: Problem, completion: str) -> float:
        """The answer's reward: 1.0 right, 0.0 wrong for a built-in task."""

    def well_formed(self, completion: str) -> bool:
        """Whether the completion is the answer alone, in the task's form."""
        return False

    def reward(self, problem: Problem, completion: str, stopped: bool,
               format_weight: float = 0.0) -> float:
        """The answer's reward plus `format_weight` if the completion is well formed and
        ended by the stop token (`stopped`)."""
        value = self.answer_reward(problem, completion)
        if format_weight and stopped and self.well_formed(completion):
            value += format_weight
        return value

    def worked_from(self, problems: list[Problem]) -> list[dict]:
        """`problems` as chat records answered right (the fine-tune before GRPO): a shipped
        task's answer; a file's record's "answer", which it must then have."""
        records = []
        for p in problems:
            if "answer" not in p.record:
                raise ValueError(f"{p.where}: no 'answer' to fine-tune on; give each record "
                                 "one, or fine-tune on chat records of your own")
            answer = {"role": "assistant", "content": str(p.record["answer"])}
            records.append({"messages": [*p.messages, answer]})
        return records


class _Generated(VerifiableTask):
    """A built-in task: prompts drawn one by one from a seeded stream, distinct."""

    default_size = 4
    limit = 100_000  # most prompts a size can ask for before draws repeat too often

    def __init__(self, size: int | None = None):
        self.size = self.default_size if size is None else size
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"--data.rl.size {size!r} for task {self.name!r}: use a positive "
                             f"integer (default {self.default_size})")

    @abstractmethod
    def draw(self, rng: random.Random) -> tuple[str, str]:
        """(the user's message, the answer) of one random prompt."""

    def problems(self, count: int, seed: int) -> list[Problem]:
        rng, seen, out = random.Random(f"{self.name}:{self.size}:{seed}"), set(), []
        misses = 0
        while len(out) < count and misses < 2000:  # 2,000 repeats in a row: (nearly) all seen
            message, answer = self.draw(rng)
            if message in seen:
                misses += 1
                continue
            seen.add(message)
            misses = 0
            out.append(Problem(({"role": "user", "content": message},), {"answer": answer},
                               f"{self.name} seed {seed}"))
        return out

    def answer_reward(self, problem: Problem, completion: str) -> float:
        return float(self.parse(completion) == problem.record["answer"])

    def parse(self, completion: str) -> str | None:
        """The answer a completion gives (its first word), or None."""
        words = completion.split()
        return words[0].rstrip(".") if words else None

    def well_formed(self, completion: str) -> bool:
        return re.fullmatch(r"\s*\S+?\.?\s*", completion) is not None


class Addition(_Generated):
    """Add two numbers of up to `size` digits each."""

    name, default_size = "addition", 3

    def draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = (rng.randrange(10 ** rng.randint(1, self.size)) for _ in range(2))
        return f"What is {a} + {b}?", str(a + b)

    def parse(self, completion: str) -> str | None:
        found = re.search(r"-?\d+", completion)
        return found.group() if found else None

    def well_formed(self, completion: str) -> bool:
        return re.fullmatch(r"\s*-?\d+\s*", completion) is not None


class ReverseWord(_Generated):
    """Write a random word of `size` lowercase letters backwards."""

    name, default_size = "reverse", 4

    def draw(self, rng: random.Random) -> tuple[str, str]:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.size))
        return f"Reverse the letters of: {word}", word[::-1]


class CountLetters(_Generated):
    """Count one letter in a random string of `size` letters drawn from a, b and c."""

    name, default_size = "count", 8

    def draw(self, rng: random.Random) -> tuple[str, str]:
        text = "".join(rng.choice("abc") for _ in range(self.size))
        letter = rng.choice("abc")
        return (f"How many times does the letter {letter} appear in: {text}?",
                str(text.count(letter)))


TASKS = {task.name: task for task in (Addition, ReverseWord, CountLetters)}
"""The built-in tasks by name."""


class FileTask(VerifiableTask):
    """A task of your own: prompts from a .jsonl file, a reward function by import path.

    Args:
        prompts: the file (see the module docstring).
        reward: "module:function"; the module is imported as Python imports it (a file
            beside where you run, or an installed package).
    """

    name = "file"

    def __init__(self, prompts: str | Path, reward: str):
        self.path, self.reward_path = Path(prompts), reward
        self.function = import_reward(reward)
        self.all = read_prompts(self.path)

    def problems(self, count: int, seed: int) -> list[Problem]:
        """The file's prompts in a seeded order (the first `count`)."""
        order = list(self.all)
        random.Random(seed).shuffle(order)
        return order[:count]

    def answer_reward(self, problem: Problem, completion: str) -> float:
        try:
            value = self.function(completion, dict(problem.record))
        except Exception as err:  # the user's code: name it, the record, and what it raised
            raise RewardError(f"reward function {self.reward_path} raised {type(err).__name__}:"
                              f" {err}, for {problem.where} and the completion "
                              f"{completion[:80]!r}; fix the function (it must return a "
                              "number for any text the model writes)") from err
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value):
            raise RewardError(f"reward function {self.reward_path} returned {value!r} for "
                              f"{problem.where} and the completion {completion[:80]!r}; it "
                              "must return a finite number (e.g. 1.0 right, 0.0 wrong)")
        return float(value)


class RewardError(RuntimeError):
    """A reward function that failed on a completion (the message names it and the record)."""


def import_reward(path: str) -> Callable[[str, dict], float]:
    """The function "module:function" names.

    Raises:
        ValueError: not "module:function", a module that cannot be imported, or no such
            callable in it (naming --data.rl.reward and the fix).
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--data.rl.reward {path!r}: give 'module:function', e.g. "
                         "'my_rewards:exact_match' for my_rewards.py beside where you run")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raised while importing
        raise ValueError(f"--data.rl.reward {path!r}: module {module_name!r} cannot be imported"
                         f" ({type(err).__name__}: {err}); put {module_name}.py where you run "
                         "train.py, or install the package that holds it") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"--data.rl.reward {path!r}: module {module_name!r} has no function "
                         f"{attr!r}; define reward(completion: str, record: dict) -> float")
    return function


def read_prompts(path: Path) -> list[Problem]:
    """The records of a prompts file, each a `Problem` (see the module docstring)."""
    if not path.is_file():
        raise FileNotFoundError(f"--data.rl.prompts {path}: no such file; give a .jsonl file "
                                "of records with a 'prompt'")
    problems = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg}); each line must be one record"
                             ) from None
        prompt = record.get("prompt") if isinstance(record, Mapping) else None
        if isinstance(prompt, str) and prompt.strip():
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = check_messages(prompt, f"{where}: 'prompt'")
        else:
            raise ValueError(f"{where}: a prompt record needs 'prompt', a non-empty string or "
                             f"a list of chat messages; got {prompt!r}")
        problems.append(Problem(tuple(messages), record, where))
    if not problems:
        raise ValueError(f"--data.rl.prompts {path} holds no records")
    return problems


def load_task(task: str, *, size: int | None = None, prompts: str | None = None,
              reward: str | None = None) -> VerifiableTask:
    """A built-in task by name, or "file" (your prompts and reward function).

    Raises:
        ValueError: an unknown name, or a file task without its prompts or reward.
    """
    if task in TASKS:
        return TASKS[task](size)
    if task == "file":
        if not prompts or not reward:
            raise ValueError("--data.rl.task file needs --data.rl.prompts (a .jsonl file) and "
                             "--data.rl.reward ('module:function')")
        return FileTask(prompts, reward)
    raise ValueError(f"--data.rl.task {task!r}: use one of {', '.join(TASKS)}, or 'file' "
                     "with --data.rl.prompts and --data.rl.reward")


def split_problems(task: VerifiableTask, train: int, heldout: int, seed: int
                   ) -> tuple[list[Problem], list[Problem]]:
    """(training prompts, held-out prompts): disjoint, both drawn from `seed`; the held-out
    ones are the first `heldout` drawn, whatever `train` is.

    Raises:
        ValueError: the task has no prompt left to train on after those held out.
    """
    drawn = task.problems(train + heldout, seed)
    if len(drawn) <= heldout:
        raise ValueError(f"task {task.name!r} has {len(drawn)} distinct prompts, none left to "
                         f"train on after the {heldout} held out: lower --data.rl.heldout, or "
                         "raise --data.rl.size (a shipped task)")
    return drawn[heldout:heldout + train], drawn[:heldout]
