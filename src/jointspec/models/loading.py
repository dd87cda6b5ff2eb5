"""Turning a model source string into a loaded Hugging Face model and tokenizer.

Sources, in the order they are tried:
- ``default`` (or nothing): the embedded SmolLM2-135M-Instruct, prepared once into a local cache;
- a ``.gguf`` file: loaded (dequantised) by transformers;
- a local folder with a ``config.json``;
- a hub id such as ``org/name``: only from this machine's Hugging Face cache, unless ``JOINTSPEC_ALLOW_DOWNLOAD=1``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..errors import ModelLoadError
from . import embedded
from .adapter import CausalLM

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        # fp32 on CPU: bf16 is not faster on CPUs without AMX, and fp32 keeps greedy equivalence exact.
        return torch.float32 if device == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype '{dtype}'; choose one of: auto, {', '.join(table)}")
    return table[dtype]


def check_device(device: str) -> None:
    """Refuse a device torch cannot name or this machine does not have, before anything is loaded."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ModelLoadError(f"unknown device '{device}'; use cpu or cuda (cuda:N for a given GPU)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device '{device}' asked for, but CUDA is not available on this machine; use cpu")


def _looks_like_path(source: str) -> bool:
    return source.endswith(".gguf") or source.startswith((".", "/", "~")) or os.sep + os.sep in source


def load_model(source: str | None = DEFAULT_MODEL, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
               name: str | None = None) -> tuple[CausalLM, object]:
    """Load ``source`` as (adapter, tokenizer). Raises :class:`ModelLoadError` with what to do on failure."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = source or DEFAULT_MODEL
    check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict = {}
    if source == DEFAULT_MODEL:
        folder, label = str(embedded.prepare_default_model()), "SmolLM2-135M-Instruct (embedded default)"
    else:
        path = Path(source).expanduser()
        label = source
        if path.is_file() and path.suffix == ".gguf":
            folder, kwargs["gguf_file"] = str(path.parent), path.name
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"model folder '{source}' has no config.json; pass a Hugging Face model folder, "
                                     "a .gguf file, or 'default'")
            folder = str(path)
        elif path.exists() or _looks_like_path(source):
            raise ModelLoadError(f"model path '{source}' does not exist (or is not a folder or .gguf file); "
                                 "check the path, or pass 'default' for the embedded SmolLM2")
        else:
            folder = source
            kwargs["local_files_only"] = os.environ.get("JOINTSPEC_ALLOW_DOWNLOAD") != "1"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        hint = (" (hub ids load only from this machine's cache; set JOINTSPEC_ALLOW_DOWNLOAD=1 to fetch)"
                if kwargs.get("local_files_only") else "")
        raise ModelLoadError(f"could not load model '{source}': {str(error).splitlines()[0]}{hint}") from error
    model.to(device)
    return CausalLM(model, name=name or label), tokenizer
