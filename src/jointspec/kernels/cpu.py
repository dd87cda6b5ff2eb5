"""What the CPU is, read from /proc/cpuinfo without importing torch: its flags choose the kernel build
(:mod:`jointspec.kernels.grouped`), its vendor the float32 kernels (:mod:`jointspec.kernels.fp32`), and its signature
keys per-CPU caches. Importing nothing heavy lets a first run start compiling the kernels before transformers is
imported (:func:`jointspec.kernels.grouped.prebuild`)."""

from __future__ import annotations

import functools
import os

CPUINFO = "/proc/cpuinfo"


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The first ``name`` field of /proc/cpuinfo ("" where it cannot be read)."""
    try:
        with open(CPUINFO, encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string ("AuthenticAMD", "GenuineIntel", ...; "" where it cannot be read)."""
    return _cpuinfo_field("vendor_id")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("avx2", "amx_int8", ...; on ARM its "Features": "asimd", "asimddp", ...; empty where
    they cannot be read)."""
    return frozenset((_cpuinfo_field("flags") or _cpuinfo_field("Features")).split())


def cpu_name() -> str:
    """The CPU's model name as the OS reports it (on ARM, which reports none, its implementer and part numbers)."""
    name = _cpuinfo_field("model name")
    if name:
        return name
    implementer, part = _cpuinfo_field("CPU implementer"), _cpuinfo_field("CPU part")
    return f"ARM CPU implementer {implementer}, part {part}" if implementer else ""


def cpu_signature() -> str:
    """What tells this CPU type from another: model name, family, model and flags, or an ARM CPU's implementer, part
    and features (for keys of per-CPU caches)."""
    fields = ("model name", "cpu family", "model", "flags")
    if not _cpuinfo_field("flags") and _cpuinfo_field("Features"):
        fields = ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")
    return "|".join(_cpuinfo_field(name) for name in fields)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
