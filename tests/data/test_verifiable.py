"""Verifiable tasks: the shipped ones drawn from a seed and checked right, a task of your own
by a prompts file and a reward function's import path, and every failure of that function
named with the record and the fix."""

import json

import pytest

from gptmini.data.verifiable import (
    TASKS,
    Addition,
    CountLetters,
    Problem,
    ReverseWord,
    RewardError,
    load_task,
    split_problems,
)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_shipped_task_is_drawn_from_its_seed_and_its_answers_check(name):
    task = load_task(name)
    problems = task.problems(50, seed=1)
    assert problems == task.problems(50, seed=1) != task.problems(50, seed=2)
    assert len({p.key for p in problems}) == 50
    for problem in problems:
        answer = problem.record["answer"]
        assert task.answer_reward(problem, answer) == 1.0
        assert task.answer_reward(problem, f" {answer}.") == 1.0
        assert task.answer_reward(problem, answer + "9") == 0.0
        assert task.answer_reward(problem, "") == 0.0
    records = task.worked_from(problems[:3])
    assert records[0]["messages"][-1] == {"role": "assistant",
                                          "content": problems[0].record["answer"]}


def test_the_shipped_checkers_by_hand():
    add = Problem(({"role": "user", "content": "What is 47 + 385?"},), {"answer": "432"})
    assert Addition().answer_reward(add, "432") == 1.0
    assert Addition().answer_reward(add, "It is 432, I think") == 1.0  # the first number
    assert Addition().answer_reward(add, "4320") == 0.0
    rev = Problem((), {"answer": "aqzk"})
    assert ReverseWord().answer_reward(rev, "aqzk") == 1.0
    assert ReverseWord().answer_reward(rev, "kzqa") == 0.0
    count = CountLetters()
    problem = count.problems(1, seed=0)[0]
    text = problem.messages[0]["content"].rsplit(": ", 1)[1].rstrip("?")
    letter = problem.messages[0]["content"].split("letter ")[1][0]
    assert problem.record["answer"] == str(text.count(letter))


def test_the_format_reward_is_optional_and_needs_the_stop():
    task, problem = Addition(), Problem((), {"answer": "12"})
    assert task.reward(problem, "12", stopped=True) == 1.0  # format off by default
    assert task.reward(problem, "12", stopped=True, format_weight=0.2) == 1.2
    assert task.reward(problem, "12", stopped=False, format_weight=0.2) == 1.0
    assert task.reward(problem, "12 apples", stopped=True, format_weight=0.2) == 1.0
    assert task.reward(problem, "13", stopped=True, format_weight=0.2) == pytest.approx(0.2)


def test_held_out_prompts_never_train():
    train, heldout = split_problems(Addition(2), 300, 100, seed=0)
    assert len(train) == 300 and len(heldout) == 100
    assert not {p.key for p in train} & {p.key for p in heldout}
    assert len(ReverseWord(1).problems(200, seed=0)) == 26  # every one letter, no more
    with pytest.raises(ValueError, match="'reverse' has 26 distinct prompts, none left to "
                                         "train on after the 26 held out: lower --data.rl.held"):
        split_problems(ReverseWord(1), 10, 26, seed=0)


@pytest.fixture
def own_task(tmp_path, monkeypatch):
    """A prompts file and a rewards module beside it, importable as Python imports it."""
    (tmp_path / "my_rewards.py").write_text(
        "def exact(completion, record):\n    return float(completion.strip() == record['want'])\n"
        "def boom(completion, record):\n    raise KeyError('want')\n"
        "def nan(completion, record):\n    return float('nan')\n"
        "def text(completion, record):\n    return 'yes'\n"
        "NOT_A_FUNCTION = 3\n")
    (tmp_path / "broken_rewards.py").write_text("import does_not_exist\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Say {w}", "want": w})
                                 for w in ("yes", "no", "maybe")) + "\n"
                       + json.dumps({"prompt": [{"role": "user", "content": "Say so"}],
                                     "want": "so"}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return prompts


def test_a_task_of_your_own_by_prompts_file_and_import_path(own_task):
    task = load_task("file", prompts=str(own_task), reward="my_rewards:exact")
    problems = task.problems(4, seed=0)
    assert sorted(p.record["want"] for p in problems) == ["maybe", "no", "so", "yes"]
    for p in problems:
        assert task.answer_reward(p, p.record["want"]) == 1.0
        assert task.answer_reward(p, "nothing") == 0.0
    assert problems[0].where.startswith(f"{own_task} line ")


@pytest.mark.parametrize(("reward", "words"), [
    ("my_rewards", ["give 'module:function'"]),
    ("no_such_module:exact", ["module 'no_such_module' cannot be imported",
                              "ModuleNotFoundError", "put no_such_module.py where you run"]),
    ("broken_rewards:exact", ["module 'broken_rewards' cannot be imported", "does_not_exist"]),
    ("my_rewards:missing", ["has no function 'missing'", "reward(completion: str, record: dict)"]),
    ("my_rewards:NOT_A_FUNCTION", ["has no function 'NOT_A_FUNCTION'"]),
])
def test_a_reward_function_that_cannot_be_imported_is_named(own_task, reward, words):
    with pytest.raises(ValueError) as err:
        load_task("file", prompts=str(own_task), reward=reward)
    assert f"--data.rl.reward {reward!r}" in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(("reward", "words"), [
    ("my_rewards:boom", ["raised KeyError: 'want'", "fix the function"]),
    ("my_rewards:nan", ["returned nan", "must return a finite number"]),
    ("my_rewards:text", ["returned 'yes'", "must return a finite number"]),
])
def test_a_reward_function_that_raises_or_returns_no_number_stops_with_the_record(
        own_task, reward, words):
    task = load_task("file", prompts=str(own_task), reward=reward)
    problem = task.problems(1, seed=0)[0]
    with pytest.raises(RewardError) as err:
        task.answer_reward(problem, "hello")
    assert reward in str(err.value) and problem.where in str(err.value)
    assert "'hello'" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_bad_task_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="--data.rl.task 'sums': use one of addition, reverse"):
        load_task("sums")
    with pytest.raises(ValueError, match="needs --data.rl.prompts .* and --data.rl.reward"):
        load_task("file", prompts="x.jsonl")
    with pytest.raises(ValueError, match="--data.rl.size 0 for task 'addition'"):
        load_task("addition", size=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "hi"}\n')
    (tmp_path / "ok_rewards.py").write_text("def f(c, r):\n    return 0.0\n")
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=f"{bad} line 1: a prompt record needs 'prompt'"):
            load_task("file", prompts=str(bad), reward="ok_rewards:f")
        with pytest.raises(FileNotFoundError, match="--data.rl.prompts nope.jsonl: no such"):
            load_task("file", prompts="nope.jsonl", reward="ok_rewards:f")
    finally:
        sys.path.remove(str(tmp_path))


def test_a_tasks_worked_examples_fine_tune_without_its_held_out_prompts():
    """--data.chat.records task:addition: right answers, never a prompt an RL run of the
    task (its defaults) holds out."""
    from gptmini.data.chat import read_chat_records
    from gptmini.data.rl import RL

    records = read_chat_records("task:addition:2")
    task = RL(task="addition", size=2).load()
    _, heldout = split_problems(task, 100, RL().heldout, RL().seed)
    held = {p.messages[0]["content"] for p in heldout}
    for _, record in records:
        user, answer = (m["content"] for m in record["messages"])
        assert user not in held
        a, b = (int(x) for x in user.removeprefix("What is ").rstrip("?").split(" + "))
        assert answer == str(a + b)
    assert 9000 < len(records) <= 10 ** 4 - RL().heldout  # (nearly) every pair under 100
    with pytest.raises(ValueError, match="chat records task:sums: use task:NAME"):
        read_chat_records("task:sums")
