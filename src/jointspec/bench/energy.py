"""Energy used while decoding, from hardware counters, or ``None`` ("unavailable") — never an estimate.

* CPU: Intel RAPL through the powercap sysfs tree (``/sys/class/powercap/intel-rapl:N/energy_uj``, one per
  package). Only top-level package zones are summed: their sub-zones (``intel-rapl:N:M``, cores/uncore/dram) are
  already inside the package count. Counters wrap at ``max_energy_range_uj``; a reading lower than the start is
  one wrap. Files that are missing or unreadable (recent kernels make ``energy_uj`` root-only) give ``None``.
* CUDA: NVML's total energy counter (millijoules since driver load) via ``pynvml`` when it is importable and the
  GPU supports it (Volta and newer).

The MTAD authors' reference code (arXiv 2407.09722) integrated ``nvidia-smi power.draw`` sampled once a second over
every visible GPU; counters are both cheaper and exact.

Usage::

    meter = meter_for_device("cpu")
    meter.start()
    ...decode...
    joules = meter.stop()            # float, or None when unavailable
    per_token = energy_per_token(joules, num_new_tokens)
"""

from __future__ import annotations

import glob
import logging
import os
import re
from typing import Protocol

logger = logging.getLogger(__name__)

POWERCAP_ROOT = "/sys/class/powercap"


def energy_per_token(joules: float | None, num_tokens: int) -> float | None:
    """Joules per generated token; None when energy is unavailable or nothing was generated."""
    if joules is None or num_tokens <= 0:
        return None
    return joules / num_tokens


class EnergyMeter(Protocol):
    source: str

    def start(self) -> None: ...

    def stop(self) -> float | None:
        """Joules since ``start``, or None when the counter could not be read."""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


class RaplMeter:
    """Sum of the package-level RAPL counters under ``root``."""

    source = "rapl"

    def __init__(self, root: str | None = None) -> None:
        zones = glob.glob(os.path.join(root or POWERCAP_ROOT, "intel-rapl:*"))  # read when called: tests move it
        self.zones = sorted(z for z in zones if re.fullmatch(r"intel-rapl:\d+", os.path.basename(z)))
        self._start: list[int | None] = []

    def _read(self) -> list[int | None]:
        return [_read_int(os.path.join(zone, "energy_uj")) for zone in self.zones]

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> float | None:
        if not self.zones or not self._start:
            return None
        end = self._read()
        total_uj = 0
        for zone, before, after in zip(self.zones, self._start, end):
            if before is None or after is None:
                logger.debug("RAPL counter %s is unreadable; energy unavailable", zone)
                return None
            delta = after - before
            if delta < 0:  # the counter wrapped (at most once per reading, given its range of hours at full power)
                max_range = _read_int(os.path.join(zone, "max_energy_range_uj"))
                if max_range is None:
                    return None
                delta += max_range + 1
            total_uj += delta
        return total_uj / 1e6


class NvmlMeter:
    """NVML's total-energy counter of one CUDA device."""

    source = "nvml"

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._handle = None
        self._start_mj: int | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as error:  # noqa: BLE001 - any NVML failure just means "no reading"
            logger.debug("NVML unavailable: %s", error)

    def _read(self) -> int | None:
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as error:  # noqa: BLE001
            logger.debug("NVML energy counter unreadable: %s", error)
            return None

    def start(self) -> None:
        self._start_mj = self._read()

    def stop(self) -> float | None:
        end = self._read()
        if self._start_mj is None or end is None:
            return None
        return (end - self._start_mj) / 1e3


class UnavailableMeter:
    source = "unavailable"

    def start(self) -> None:
        pass

    def stop(self) -> float | None:
        return None


def meter_for_device(device: str) -> EnergyMeter:
    """RAPL for CPU runs, NVML for ``cuda[:i]`` runs, otherwise a meter that always reports None."""
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        meter = NvmlMeter(index)
        return meter if meter._handle is not None else UnavailableMeter()
    if device == "cpu":
        meter = RaplMeter()
        return meter if meter.zones else UnavailableMeter()
    return UnavailableMeter()
