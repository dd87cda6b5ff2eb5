"""``jointspec build-corpus``: build the n-gram table ``corpus`` and ``default`` draft from.

The table is counted from a target's own answers:

    jointspec build-corpus --target default --prompts sharegpt-prompts:1500 --prompts train:default \\
        --num-prompts 1200 --out corpus/smollm2

Prompts come from the same sources as ``train-draft --prompts`` (train:default, sharegpt-prompts:N, sharegpt:N,
.txt / .jsonl files, builtin:NAME with a warning). Sources with their own answers (``sharegpt:N``: ChatGPT's) go in
whole, as given. The others are pooled, prompts over ``--max-prompt-tokens`` dropped, the rest shuffled with
``--seed`` and the first ``--num-prompts`` kept (so a smaller run is a prefix of a larger one), and the target
answers each one greedily; its answers are appended to ``DATA/answers.jsonl`` as they come, so an interrupted run
resumes where it stopped. ``--answers-from DIR`` (repeatable) adds the answers already in a ``train-draft`` data
folder (the target's own, or a quantised copy's: ``--answer-quantize``) for the same target, so answers generated
once for training a head are counted too (without ``--prompts``, only those: the target answers nothing). Then
the table is counted from all answers (:class:`jointspec.drafters.corpus.NgramTable`) and written to ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

# Test seam: tests replace load_target with a function returning a tiny in-process (CausalLM, tokenizer).
from jointspec.backends.loading import load_model as load_target
from jointspec.cli.commands import command_help
from jointspec.cli.options import check_output_folder, positive_int
from jointspec.core.files import cannot_write, replacing

log = logging.getLogger(__name__)

ANSWERS_FILE = "answers.jsonl"
# The settings the answers in a data folder were made with, so that a rerun resumes only what it would make again.
ANSWERS_SPEC_FILE = "answers.json"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "build-corpus", help=command_help("build-corpus"),
        description="Builds the n-gram table the `corpus` method and `default` draft from, counted from the "
                    "target's own greedy answers to --prompts (appended to DATA/answers.jsonl as they come, so an "
                    "interrupted run resumes), plus the answers of train-draft data folders (--answers-from).")
    parser.add_argument("--target", default="default", help="target model: 'default', a folder, a .gguf or a hub id")
    parser.add_argument("--prompts", action="append", default=None, metavar="SOURCE",
                        help="prompt source, repeatable (as train-draft: train:default, sharegpt-prompts:N, "
                             "sharegpt:N, a .txt or .jsonl file; default: train:default, or none with "
                             "--answers-from)")
    parser.add_argument("--answers-from", action="append", default=[], metavar="DIR",
                        help="also count the answers in a `train-draft` data folder built for this target "
                             "(repeatable; without --prompts, only these are counted)")
    parser.add_argument("--num-prompts", type=positive_int, default=None,
                        help="keep the first N prompts of the seeded shuffle (default: all)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=400,
                        help="drop prompts longer than this (their prefill costs more than their answer gives)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="answer length")
    parser.add_argument("--max-order", type=positive_int, default=4, help="longest n-gram in the table")
    parser.add_argument("--min-count", type=positive_int, default=2,
                        help="keep n-grams seen at least this often")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' shuffle")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", required=True, help="folder for the table (table.npz and corpus.json)")
    parser.add_argument("--data", default=None, help="folder for the target's answers (default: OUT/data)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from jointspec.api import GenerationConfig, Pipeline
    from jointspec.backends.tokens import eos_token_ids
    from jointspec.drafters.corpus import NgramTable, tokenizer_fingerprint
    from jointspec.drafts.artifact import target_fingerprint
    from jointspec.methods import MethodConfig
    from jointspec.train.sources import training_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    data = Path(args.data) if args.data else out / "data"
    check_output_folder(out, "--out")
    check_output_folder(data, "--data")
    target, tokenizer = load_target(args.target, quantize="auto")
    eos = eos_token_ids(target, tokenizer)
    # Read first, so a wrong folder is refused before any prompt is answered.
    folder_answers = [answer for folder in args.answers_from for answer in data_folder_answers(folder, target)]
    # Without --prompts the target answers train:default, unless answers of data folders are all that was asked for.
    sources = args.prompts or ([] if args.answers_from else ["train:default"])
    prompts, given = training_prompts(sources, tokenizer, target, eos, data, args.seed,
                                      progress=not args.no_progress) if sources else ([], [])
    given_answers = [list(answer) for answer in given if answer is not None]
    # A prompt the target's context cannot hold with a token to answer is dropped, as one over --max-prompt-tokens is
    # (it stopped the whole run; which prompts train:default's source code gives depends on the Python version).
    longest = min(args.max_prompt_tokens, target.max_context - 1)
    asked = [p for p, g in zip(prompts, given) if g is None]
    pool = [p for p in asked if len(p) <= longest]
    if len(pool) < len(asked) and longest < args.max_prompt_tokens:
        print(f"jointspec: {len(asked) - len(pool)} of {len(asked)} prompts left out: over {longest} tokens (the "
              f"model's context holds {target.max_context}, an answer needs a token of it)", file=sys.stderr)
    random.Random(args.seed).shuffle(pool)
    pool = pool[:args.num_prompts]
    # What decides the answers (not --num-prompts: a larger count extends the same seeded order).
    spec = {"target_fingerprint": target_fingerprint(target), "prompts": list(sources),
            "max_prompt_tokens": args.max_prompt_tokens, "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    target_answers = []
    if sources:
        pipeline = Pipeline(target, tokenizer, MethodConfig(name="default"))
        config = GenerationConfig(max_new_tokens=args.max_new_tokens)
        target_answers = _target_answers(pool, spec, data, pipeline, config, progress_bar=not args.no_progress)
    sequences = given_answers + folder_answers + target_answers
    table = NgramTable.build(sequences, target.vocab_size, args.max_order, args.min_count)
    table.save(out, {
        "kind": "corpus",
        "target": args.target,
        "target_fingerprint": target_fingerprint(target),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "num_given_answers": len(given_answers),
        "num_data_folder_answers": len(folder_answers),
        "num_target_answers": len(pool),
        "num_tokens": sum(len(s) for s in sequences),
        "settings": {key: value for key, value in vars(args).items()
                     if key not in {"run", "command", "out", "data", "threads", "no_progress", "log_level",
                                    "answers_from"}},
    })
    print(f"{len(sequences)} answers, {sum(len(s) for s in sequences)} tokens -> {table.num_entries} n-grams in {out}")
    return 0


def _target_answers(pool: list[list[int]], spec: dict, data: Path, pipeline, config,
                    progress_bar: bool) -> list[list[int]]:
    """The target's greedy answers to ``pool``, appended to ``data``/answers.jsonl as they come; an earlier run's
    answers there (made with ``spec``) are reused."""
    answers_path = data / ANSWERS_FILE
    done = _answers_so_far(data, spec)
    data.mkdir(parents=True, exist_ok=True)
    spec_path = data / ANSWERS_SPEC_FILE
    # The record goes with the answers: written afresh while there are none (an earlier run stopped before its first
    # answer may have left one for other settings, which the answers to come would then be filed under).
    if not _has_answers(answers_path):
        with replacing(spec_path, "the answers' record") as tmp:
            tmp.write_text(json.dumps(spec, indent=1))
    todo = [i for i in range(len(pool)) if i not in done]
    progress = None
    if progress_bar:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(pool), initial=len(pool) - len(todo), desc="answers", unit="prompt")
    # A write that fails (a full disk) ends the loop; closing the file then flushes again and fails too, so the guard
    # surrounds the file, and tells a failure to write from an OSError of the decoding or the progress bar.
    failed, writing = None, False
    try:
        with answers_path.open("a") as sink:
            for index in todo:
                answer = pipeline.generate_ids(pool[index], config).token_ids
                done[index] = list(answer)
                try:
                    sink.write(json.dumps({"index": index, "answer_ids": list(answer)}) + "\n")
                    sink.flush()  # a line per answer: an interrupted run loses at most the answer in progress
                except OSError as error:
                    failed = error
                    break
                if progress is not None:
                    progress.update()
            writing = True  # what fails from here on is the file's close
    except OSError as error:
        if failed is None and not writing:
            raise
        failed = failed or error
    if failed is not None:  # a line cut short is dropped when the run goes on
        raise cannot_write("the answers", answers_path, failed, "the answers before this one are kept: free some "
                           "room and run the same command again to go on from them") from failed
    if progress is not None:
        progress.close()
    return [done[i] for i in range(len(pool))]


def _answers_so_far(data: Path, spec: dict) -> dict[int, list[int]]:
    """The answers an earlier run left in ``data`` (by prompt index), if it was made with ``spec``; a last line cut
    short by an interruption is dropped from the file. Answers made with other settings are refused, not reused."""
    from jointspec.core.errors import UnsupportedOptionError

    answers_path, spec_path = data / ANSWERS_FILE, data / ANSWERS_SPEC_FILE
    if not _has_answers(answers_path):
        return {}
    try:
        existing = json.loads(spec_path.read_text())
    except (OSError, ValueError):
        existing = None
    if existing is None:
        raise UnsupportedOptionError(f"--data '{data}' holds answers with no record of the settings they were made "
                                     f"with ({ANSWERS_SPEC_FILE}: an older jointspec wrote them); use a new --data "
                                     "folder or delete this one")
    if existing != spec:
        differing = sorted(key for key in spec if existing.get(key) != spec[key])
        raise UnsupportedOptionError(
            f"--data '{data}' holds answers made with other settings (differing: {', '.join(differing)}); use a new "
            "--data folder or delete this one")
    from jointspec.train.server_answers import complete_lines

    done: dict[int, list[int]] = {}
    for number, line in enumerate(complete_lines(answers_path), start=1):
        try:
            record = json.loads(line)
            done[int(record["index"])] = [int(t) for t in record["answer_ids"]]
        except (ValueError, KeyError, TypeError):
            raise UnsupportedOptionError(f"'{answers_path}' line {number} is not an answer record; use a new --data "
                                         "folder or delete this one") from None
    return done


def _has_answers(path: Path) -> bool:
    """Whether the answers file holds anything (a run stopped before its first answer leaves it empty)."""
    return path.is_file() and path.stat().st_size > 0


def data_folder_answers(folder: str | Path, target) -> list[list[int]]:
    """The answers (token ids after each prompt) in a ``train-draft`` data folder built for ``target``."""
    from jointspec.core.errors import UnsupportedOptionError
    from jointspec.drafts.artifact import target_fingerprint
    from jointspec.train.data import load_shards, read_spec

    try:
        spec = read_spec(folder)
    except (OSError, ValueError) as error:
        raise UnsupportedOptionError(f"--answers-from '{folder}' is not a train-draft data folder ({error})") from error
    if spec.get("target_fingerprint") != target_fingerprint(target):
        raise UnsupportedOptionError(f"--answers-from '{folder}' holds answers of another target (fingerprint "
                                     f"{spec.get('target_fingerprint')}, this one {target_fingerprint(target)})")
    num_shards = -(-spec["num_prompts"] // spec["shard_size"])
    if len(list(Path(folder).glob("shard-*.pt"))) < num_shards:  # as train-draft --extra-data refuses it
        raise UnsupportedOptionError(f"--answers-from '{folder}' is unfinished (fewer than its {num_shards} shards); "
                                     "run the same train-draft --data-only command again to finish it")
    answers = []
    for shard in load_shards(folder):
        starts, answer_starts = shard["starts"].tolist(), shard["answer_starts"].tolist()
        tokens = shard["token_ids"]
        for s, offset in enumerate(answer_starts):
            answers.append(tokens[starts[s] + offset:starts[s + 1]].tolist())
    return answers
