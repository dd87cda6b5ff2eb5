"""Energy counters (``jointspec.bench.energy``): RAPL package sums and wrap-around, and "unavailable" instead of a
guess where no counter can be read. The sysfs tree is faked in a temporary folder: deterministic, no false failures.
"""

from __future__ import annotations

import os

import pytest

from jointspec.bench import energy
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


def test_a_cpu_run_reads_the_rapl_counters_where_there_are_some_and_says_unavailable_elsewhere(tmp_path,
                                                                                                 monkeypatch):
    """``meter_for_device("cpu")`` on a powercap tree (faked here through the meter it builds): joules from the
    package counters where there are zones, "unavailable" (None, never a number) where there are none; other devices
    without a counter are "unavailable" too. The check can fail: a meter that always said "unavailable", or that
    returned 0.0, would not give the 0.25 J written below."""
    if not os.path.exists("/sys/class/powercap"):  # this machine has no counters at all
        assert meter_for_device("cpu").source == "unavailable"
    monkeypatch.setattr(energy, "POWERCAP_ROOT", str(tmp_path))  # the tree meter_for_device's meter reads
    empty = meter_for_device("cpu")
    empty.start()
    assert empty.source == "unavailable" and empty.stop() is None  # a tree without zones
    package = _zone(tmp_path, "intel-rapl:0", 1_000)
    meter = meter_for_device("cpu")
    assert meter.source == "rapl" and meter.zones == [str(package)]
    meter.start()
    (package / "energy_uj").write_text("251000\n")  # 250,000 µJ while "decoding"
    assert meter.stop() == 0.25
    other = meter_for_device("mps")
    other.start()
    assert other.source == "unavailable" and other.stop() is None
