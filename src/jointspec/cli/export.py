"""``jointspec export-draft``: write a trained draft in a format another engine loads.

    jointspec export-draft HEAD_DIR --format speculators --out OUT --target default \\
        --verifier HuggingFaceTB/SmolLM2-135M-Instruct

Only formats that hold a kind of draft *faithfully* are written, so that the exported checkpoint drafts what the
draft drafts here (docs/interop.md). The target is loaded to check that the draft belongs to it:

- ``speculators``: EAGLE-3 heads (``train-draft --head eagle3``, or a checkpoint read back) as the speculators
  package and vLLM's EAGLE-3 load them, with the target's input embedding written
  in, as speculators' own checkpoints carry it;
- ``eagle3``: EAGLE-3 heads in EAGLE-3's original layout (``midlayer.*``, a Llama config naming
  ``LlamaForCausalLMEagle3``), what SGLang's EAGLE-3 loads (vLLM's too);
- ``medusa``: Medusa heads (``--head medusa``) in vLLM's Medusa layout, the target's LM head rows as the heads'
  shared LM head;
- ``vllm-eagle`` / ``sglang-eagle``: EAGLE-1 heads (``--head eagle1``) in the EAGLE-1 layout each engine loads.

Refused, with the reason: jointspec's EAGLE-style head (``--head eagle``) in vLLM's or SGLang's EAGLE-1 layout (their
layer has no input norm and no final norm; ours has both), and Hydra heads and distilled drafts (not written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Test seam: tests replace load_target with a function returning a tiny in-process (CausalLM, tokenizer).
from jointspec.backends.loading import load_model as load_target
from jointspec.cli.commands import command_help
from jointspec.cli.options import check_output_folder
from jointspec.core.errors import UnsupportedOptionError

FORMATS = ("speculators", "eagle3", "vllm-eagle", "sglang-eagle", "medusa")

# Why a kind cannot go into a format (kind, format) -> reason; "*" stands for every format.
_EAGLE1_NORMS = ("vLLM's and SGLang's EAGLE-1 layer has no input norm and no final norm, jointspec's EAGLE-style "
                 "head has both: the checkpoint would draft differently; train-draft --head eagle1 trains a head "
                 "in their layout")
REFUSALS = {
    ("eagle", "vllm-eagle"): _EAGLE1_NORMS,
    ("eagle", "sglang-eagle"): _EAGLE1_NORMS,
    ("eagle", "speculators"): "the speculators format holds EAGLE-3 heads; this is an EAGLE-style (EAGLE-1) head",
    ("eagle", "eagle3"): "the eagle3 layout holds EAGLE-3 heads; this is an EAGLE-style (EAGLE-1) head",
    ("eagle", "medusa"): "the medusa format holds Medusa heads; this is an EAGLE-style (EAGLE-1) head",
    ("medusa", "speculators"): "the speculators format holds EAGLE-3 heads; Medusa heads go as --format medusa",
    ("medusa", "eagle3"): "the eagle3 layout holds EAGLE-3 heads; Medusa heads go as --format medusa",
    ("medusa", "vllm-eagle"): "that is the EAGLE-1 layout; Medusa heads go as --format medusa",
    ("medusa", "sglang-eagle"): "that is the EAGLE-1 layout; Medusa heads go as --format medusa",
    ("hydra", "*"): "no engine loads Hydra heads",
    ("distill", "*"): "a distilled draft is a small model of its own: vLLM and SGLang load it from a model folder, "
                      "which export-draft does not write yet",
    ("eagle3", "vllm-eagle"): "that is the EAGLE-1 layout; an EAGLE-3 head goes as --format speculators (vLLM) or "
                              "--format eagle3 (SGLang)",
    ("eagle3", "sglang-eagle"): "that is the EAGLE-1 layout; an EAGLE-3 head goes as --format eagle3 (SGLang) or "
                                "--format speculators (vLLM)",
    ("eagle3", "medusa"): "an EAGLE-3 head is not a Medusa head",
    ("eagle1", "speculators"): "the speculators format holds EAGLE-3 heads; an EAGLE-1 head goes as --format "
                               "vllm-eagle or sglang-eagle",
    ("eagle1", "eagle3"): "the eagle3 layout holds EAGLE-3 heads; an EAGLE-1 head goes as --format vllm-eagle or "
                          "sglang-eagle",
    ("eagle1", "medusa"): "an EAGLE-1 head is not a Medusa head",
}
# What each format is written from; any other kind is refused (REFUSALS says why where it is known).
WRITES = {"medusa": {"medusa"}, "speculators": {"eagle3"}, "eagle3": {"eagle3"}, "vllm-eagle": {"eagle1"},
          "sglang-eagle": {"eagle1"}}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export-draft", help=command_help("export-draft"),
        description="Writes a trained draft in a format another engine loads, only where that format holds its kind "
                    "faithfully: EAGLE-3 heads as speculators (vLLM) or EAGLE-3's own layout (SGLang), Medusa heads "
                    "as vLLM's Medusa, EAGLE-1 heads as vLLM's or SGLang's EAGLE-1. Other kinds are refused with "
                    "the reason. The target is loaded to check that the draft belongs to it (docs/interop.md).")
    parser.add_argument("draft", type=Path, help="the draft's folder (from train-draft, or a speculators checkpoint)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the format to write")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the checkpoint")
    parser.add_argument("--target", default="default",
                        help="the target the draft belongs to: 'default', a folder, a .gguf or a hub id")
    parser.add_argument("--verifier", default=None,
                        help="--format speculators: the target's name as the serving engine finds it (a hub id or a "
                             "path; default: --target's own path or id, the hub id for the embedded default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr (model loading's too)")
    parser.set_defaults(run=run)


def _verifier_name(given_target: str, target) -> str:
    """The name a speculators checkpoint gives its verifier where --verifier is not given: the embedded default's hub
    id (its local copy is this machine's), else the target's own id or path, with a warning where that is a path
    here (an engine on another machine will not find it)."""
    import logging

    from jointspec.backends.embedded import HUB_ID

    if given_target == "default":
        return HUB_ID
    name = str(getattr(target.model.config, "_name_or_path", "") or given_target)
    if Path(name).expanduser().exists():
        logging.getLogger(__name__).warning(
            "the checkpoint names its verifier by this machine's path '%s'; pass --verifier with the name the serving "
            "engine finds the target by (a hub id) where it runs elsewhere", name)
    return name


def _kind(folder: Path) -> str:
    from jointspec.core.errors import ModelLoadError
    from jointspec.drafts.artifact import (
        artifact_kind,
        is_eagle1_checkpoint,
        is_eagle3_checkpoint,
        is_medusa_checkpoint,
    )

    if is_eagle3_checkpoint(folder):
        return "eagle3"
    if is_eagle1_checkpoint(folder):
        raise ModelLoadError(f"'{folder}' is an EAGLE-1 checkpoint for another engine already (vLLM's and SGLang's "
                             "layout); --draft reads it as it is, and export-draft converts drafts that "
                             "`jointspec train-draft` saved")
    if is_medusa_checkpoint(folder):
        raise ModelLoadError(f"'{folder}' is a Medusa checkpoint for another engine already (vLLM's layout or the "
                             "Medusa project's); --draft reads it as it is, and export-draft converts drafts that "
                             "`jointspec train-draft` saved")
    kind = artifact_kind(folder)
    if kind is None:
        raise ModelLoadError(f"'{folder}' holds no draft (no readable draft.json, no speculators config.json); pass "
                             "a folder written by `jointspec train-draft`")
    return kind


def run(args: argparse.Namespace) -> int:
    from jointspec.drafts.eagle3 import bind_eagle3, save_eagle3_layout, save_speculators

    kind = _kind(args.draft)
    reason = REFUSALS.get((kind, args.format)) or REFUSALS.get((kind, "*"))
    if not reason and kind not in WRITES.get(args.format, ()):
        kinds = sorted(WRITES.get(args.format, ()))
        reason = f"it is written from {' or '.join(kinds)} drafts only" if kinds else "no kind of draft goes into it"
    if reason:
        raise UnsupportedOptionError(f"cannot export the '{kind}' draft in '{args.draft}' as {args.format}: {reason}")
    if args.out.exists():
        raise UnsupportedOptionError(f"--out '{args.out}' exists; export-draft writes a new folder")
    check_output_folder(args.out, "--out")
    target, _ = load_target(args.target)
    if kind == "medusa":
        from jointspec.drafts.artifact import float_lm_weight
        from jointspec.drafts.medusa import bind_medusa, save_vllm_medusa

        heads = bind_medusa(args.draft, target).heads  # refuses heads trained for another target
        save_vllm_medusa(heads, args.out, float_lm_weight(target.model))
        print(json.dumps({"out": str(args.out), "format": args.format, "kind": kind,
                          "num_heads": heads.config.num_heads}))
        return 0
    if kind == "eagle1":
        from jointspec.drafts.eagle1 import bind_eagle1, save_eagle1_layout

        head = bind_eagle1(args.draft, target, "float32").head  # refuses a head trained for another target
        save_eagle1_layout(head, args.out, args.format)
        print(json.dumps({"out": str(args.out), "format": args.format, "kind": kind,
                          "num_layers": head.config.num_layers}))
        return 0
    # Bound only to check it against the target (refusing one trained for another), in float32: auto would swap its
    # linears for int8 copies, and the checkpoint must carry the weights as trained.
    draft = bind_eagle3(args.draft, target, "float32")
    verifier = args.verifier or _verifier_name(args.target, target)
    if args.format == "speculators":
        save_speculators(draft.head, args.out, verifier, target.model.get_input_embeddings().weight)
    else:
        save_eagle3_layout(draft.head, args.out)
    summary = {"out": str(args.out), "format": args.format, "kind": kind,
               "aux_layers": list(draft.head.config.aux_layers)}
    print(json.dumps(summary | ({"verifier": verifier} if args.format == "speculators" else {})))
    return 0
