"""Whether jointspec's int4 kernels beat float32 linears on this CPU: measured once, kept, and read by
``--quantize auto`` for the builds no CPU of their kind has been measured on here (:data:`PROBED_ISAS`).

The x86 builds were measured on real CPUs, and ``auto`` takes them (docs/kernels.md). The ARM build (``neondot``) is
exact (held to the portable build's bits under an emulator) but no ARM CPU has run it here, so instead of assuming
it is faster, ``auto`` measures it on the user's CPU the first time it is asked: a stack of the embedded model's MLP
projections (576 <-> 1,536, float32 weights about 85 MB, more than a laptop's last-level cache, as a decoding step's
weights are), one input row through all of them, float32 ``nn.Linear`` against the same layers on the 4-bit kernels,
alternating, medians of :data:`REPEATS`. The kernels win where their median is at most :data:`MARGIN` of float32's
(a whole int4 step has more than the products in it). The verdict is kept per CPU type, kernel build, sources,
thread count, inputs setting and PyTorch version in jointspec's cache folder, so later runs read it (and within a
process one measurement serves every caller, even where the folder cannot be written); ``JOINTSPEC_KERNEL_PROBE=off``
keeps float32 without measuring, and disregards a kept verdict.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from jointspec.core.files import WriteError, cache_root, replacing

log = logging.getLogger(__name__)

PROBED_ISAS = frozenset({"neondot"})
PROBE_ENV = "JOINTSPEC_KERNEL_PROBE"
LAYERS = 24  # twelve up and down projections of the embedded model's MLP shape
SHAPE = (576, 1536)
REPEATS = 15
MARGIN = 0.9


@dataclass(frozen=True)
class Probe:
    """One measurement: milliseconds for one input row through the stack, float32 and int4, and the verdict."""

    isa: str
    float32_ms: float
    int4_ms: float
    threads: int

    @property
    def int4_faster(self) -> bool:
        return self.int4_ms <= MARGIN * self.float32_ms

    def describe(self) -> str:
        return (f"{self.int4_ms:.2f} ms against {self.float32_ms:.2f} ms for float32 over {LAYERS} layers of the "
                f"model's shape at {self.threads} threads, measured on this CPU")


_measured: dict[Path, Probe] = {}  # this process's measurements, by where they are kept


def key(isa: str) -> list:
    """What a verdict holds for: the build, the CPU type, the kernels' sources, the threads, the layers' inputs
    setting, PyTorch (the float32 side) and the measurement's own settings."""
    from jointspec.kernels.cpu import cpu_signature
    from jointspec.kernels.grouped import inputs_setting, source_digest

    return [isa, cpu_signature(), source_digest(), torch.get_num_threads(), inputs_setting(), torch.__version__,
            LAYERS, list(SHAPE), MARGIN]


def _path(isa: str) -> Path:
    digest = hashlib.sha256(json.dumps(key(isa)).encode()).hexdigest()[:16]
    return cache_root() / "kernel-probe" / f"{isa}-{digest}.json"


def disabled() -> bool:
    """Whether ``$JOINTSPEC_KERNEL_PROBE`` turns the measurement off."""
    return os.environ.get(PROBE_ENV, "").strip().lower() in ("off", "0", "no", "false")


def cached(isa: str) -> Probe | None:
    """The measurement of ``isa`` on this CPU made in this process or kept (None: none yet, a kept file unreadable or
    not a measurement, or the measurement turned off)."""
    if disabled():
        return None
    path = _path(isa)
    if path in _measured:
        return _measured[path]
    try:
        data = json.loads(path.read_text())
        probe = Probe(str(data["isa"]), float(data["float32_ms"]), float(data["int4_ms"]), int(data["threads"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    finite = all(math.isfinite(value) and value > 0 for value in (probe.float32_ms, probe.int4_ms))
    return probe if finite and probe.isa == isa else None


def measure(isa: str, layers: int = LAYERS, repeats: int = REPEATS) -> Probe:
    """Time one row through ``layers`` float32 linears and through the same layers on the ``isa`` build's 4-bit
    kernels (built here if need be), alternating, ``repeats`` times each after a warm-up; medians."""
    from jointspec.kernels.grouped import GroupedInt4Linear, use_isa

    generator = torch.Generator().manual_seed(0)
    floats = []
    for index in range(layers):
        in_features, out_features = SHAPE if index % 2 == 0 else SHAPE[::-1]
        layer = nn.Linear(in_features, out_features, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out_features, in_features, generator=generator) * 0.05)
        floats.append(layer)
    with use_isa(isa):
        int4 = [GroupedInt4Linear(layer) for layer in floats]
        x = torch.randn(1, SHAPE[0], generator=generator)

        def run(stack) -> float:
            start = time.perf_counter()
            y = x
            for layer in stack:
                y = layer(y)
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"float32": [], "int4": []}
        with torch.no_grad():
            run(floats), run(int4)  # warm-up: first calls, the kernels' loading
            for _ in range(repeats):
                times["float32"].append(run(floats))
                times["int4"].append(run(int4))
    return Probe(isa, 1e3 * statistics.median(times["float32"]), 1e3 * statistics.median(times["int4"]),
                 torch.get_num_threads())


def int4_measured_faster(isa: str) -> tuple[bool, str]:
    """(whether the ``isa`` build's int4 kernels beat float32 here, why): the kept measurement, else one made now
    and kept (a failure to keep it is logged, not raised); never measured where ``$JOINTSPEC_KERNEL_PROBE=off``."""
    if disabled():
        return False, f"${PROBE_ENV}=off: the {isa} kernels are not measured against float32 here"
    probe = cached(isa)
    if probe is None:
        probe = measure(isa)
        path = _path(isa)
        _measured[path] = probe
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with replacing(path, "the kernel measurement") as temporary:
                temporary.write_text(json.dumps(asdict(probe)))
        except (OSError, WriteError) as error:
            log.warning("could not keep the kernel measurement at %s (%s); it is made again next time", path, error)
    verdict = "faster" if probe.int4_faster else "not faster enough"
    return probe.int4_faster, f"the {isa} kernels {verdict}: {probe.describe()}"
