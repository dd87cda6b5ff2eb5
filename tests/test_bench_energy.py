"""Energy counters (``jointspec.bench.energy``): RAPL package sums and wrap-around, and "unavailable" instead of a
guess where no counter can be read. The sysfs tree is faked in a temporary folder: deterministic, no false failures.
"""

from __future__ import annotations

import os

import pytest

from jointspec.bench.energy import RaplMeter, energy_per_token, meter_for_device


def _zone(root, name, energy_uj, max_uj=1_000_000):
    path = root / name
    path.mkdir()
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


def test_rapl_sums_packages_and_handles_wraparound(tmp_path):
    package0 = _zone(tmp_path, "intel-rapl:0", 999_000)
    package1 = _zone(tmp_path, "intel-rapl:1", 10)
    _zone(tmp_path, "intel-rapl:0:0", 5)  # a sub-zone, already inside package 0: must not be counted
    meter = RaplMeter(str(tmp_path))
    meter.start()
    (package0 / "energy_uj").write_text("2000\n")  # wrapped: 1_000_000 - 999_000 + 1 + 2000 µJ
    (package1 / "energy_uj").write_text("500010\n")
    (tmp_path / "intel-rapl:0:0" / "energy_uj").write_text("900000\n")
    assert meter.stop() == pytest.approx((1_000 + 1 + 2_000 + 500_000) / 1e6)
    assert energy_per_token(2.0, 4) == 0.5 and energy_per_token(None, 4) is None and energy_per_token(1.0, 0) is None


def test_unreadable_or_missing_counters_report_unavailable(tmp_path):
    package = _zone(tmp_path, "intel-rapl:0", 100)
    meter = RaplMeter(str(tmp_path))
    meter.start()
    (package / "energy_uj").unlink()  # as good as unreadable (root-only files raise the same OSError)
    assert meter.stop() is None
    assert RaplMeter(str(tmp_path / "nowhere")).stop() is None
    reading = meter_for_device("cpu")
    reading.start()
    assert reading.stop() is None or reading.stop() >= 0.0  # a real counter, or honestly unavailable
    assert meter_for_device("mps").stop() is None
    if not os.path.exists("/sys/class/powercap"):
        assert meter_for_device("cpu").source == "unavailable"
