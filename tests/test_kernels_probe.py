"""``--quantize auto`` on a build measured on the user's CPU (kernels/probe.py): the ARM build, which no ARM CPU has
run here, is taken where one measurement on this CPU finds its int4 kernels faster than float32, and that verdict is
kept. The ARM CPU is simulated (its machine name and features); the timings are fixed where the verdict is tested, and
real (on this CPU's build) where the measurement itself is. No test here can fail by chance: none compares timings."""

from __future__ import annotations

import json

import pytest
from torch import nn

from jointspec.backends.loading import quantize_choice
from jointspec.drafts.eagle import chosen_head_weights
from jointspec.kernels import grouped, probe
from jointspec.kernels.grouped import selected_isa, use_isa


@pytest.fixture
def arm(monkeypatch, tmp_path):
    """An ARM CPU with the dot-product instructions, a fresh cache, and no build needed to decide."""
    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(probe.PROBE_ENV, raising=False)
    monkeypatch.setattr(grouped.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(grouped, "cpu_flags", lambda: frozenset({"asimd", "asimddp", "atomics"}))
    monkeypatch.setattr(grouped, "unavailable_reason", lambda *args, **kwargs: None)
    monkeypatch.setattr(probe, "_measured", {})  # (this process's measurements: none yet)
    measured = []

    def fixed(int4_ms):
        def measure(isa, *args, **kwargs):
            measured.append(isa)
            return probe.Probe(isa, 10.0, int4_ms, 2)
        monkeypatch.setattr(probe, "measure", measure)
    return fixed, measured


def test_auto_takes_the_arm_build_where_measured_faster_and_keeps_the_verdict(arm):
    fixed, measured = arm
    fixed(4.0)
    with use_isa("neondot"):
        mode, why = quantize_choice("auto", None)
        assert (mode, measured) == ("int4", ["neondot"])
        assert "neondot kernels faster: 4.00 ms against 10.00 ms for float32" in why and "on this CPU" in why
        fixed(20.0)  # a second run (a new process: nothing in memory) reads the kept verdict and measures nothing
        probe._measured.clear()
        assert quantize_choice("auto", None)[0] == "int4" and measured == ["neondot"]
        kept = json.loads(probe._path("neondot").read_text())
        assert kept == {"isa": "neondot", "float32_ms": 10.0, "int4_ms": 4.0, "threads": 2}


def test_auto_keeps_float32_where_the_arm_build_is_not_faster_enough(arm):
    fixed, measured = arm
    fixed(9.5)  # faster, but not by the margin a whole step needs
    with use_isa("neondot"):
        mode, why = quantize_choice("auto", None)
        assert mode == "none" and "not faster enough" in why and "--quantize int4 runs them anyway" in why
        assert quantize_choice("int4", None)[0] == "int4"  # asked for: run, not measured
        assert chosen_head_weights(nn.Linear(64, 64), "auto") == "float32"  # the head follows the verdict
    assert measured == ["neondot"]


def test_the_measurement_can_be_turned_off(arm, monkeypatch):
    fixed, measured = arm
    fixed(1.0)
    monkeypatch.setenv(probe.PROBE_ENV, "off")
    with use_isa("neondot"):
        mode, why = quantize_choice("auto", None)
    assert mode == "none" and f"${probe.PROBE_ENV}=off" in why and measured == []


def test_x86_and_portable_builds_are_never_measured(monkeypatch, tmp_path):
    """The x86 builds were measured here and are taken; the portable build is not taken and not measured."""
    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path / "cache"))

    def never(*args, **kwargs):
        raise AssertionError("measured")
    monkeypatch.setattr(probe, "measure", never)
    with use_isa("portable"):
        assert quantize_choice("auto", None)[0] == "none"
    if selected_isa() in grouped.AUTO_ISAS:
        assert quantize_choice("auto", None)[0] == "int4"
    assert not (tmp_path / "cache" / "kernel-probe").exists()


def test_a_measurement_times_both_stacks_on_the_build_asked_for(monkeypatch, tmp_path):
    """A real measurement (short, on the build this CPU runs): both medians positive, at torch's threads."""
    import torch

    result = probe.measure(selected_isa(), layers=4, repeats=3)
    assert result.isa == selected_isa() and result.threads == torch.get_num_threads()
    assert result.float32_ms > 0 and result.int4_ms > 0
    assert result.int4_faster == (result.int4_ms <= probe.MARGIN * result.float32_ms)


def test_a_draft_head_follows_the_verdict(arm, monkeypatch):
    """--quantize auto's measurement decides a head's weights too: int8 where it found the kernels faster, float32
    where nothing was measured or the measurement is turned off."""
    from jointspec.drafts import eagle

    fixed, measured = arm
    monkeypatch.setattr(eagle, "int8_head_misfit", lambda *args: None)  # (a head the int8 kernels take)
    with use_isa("neondot"):
        assert chosen_head_weights(nn.Linear(64, 64), "auto") == "float32"  # nothing measured
        fixed(4.0)
        assert quantize_choice("auto", None)[0] == "int4"
        assert chosen_head_weights(nn.Linear(64, 64), "auto") == "int8"
        monkeypatch.setenv(probe.PROBE_ENV, "off")  # a kept verdict is disregarded too
        assert chosen_head_weights(nn.Linear(64, 64), "auto") == "float32"
        assert quantize_choice("auto", None)[0] == "none"


def test_a_verdict_holds_for_its_threads_inputs_and_torch_and_a_bad_file_is_measured_again(arm, monkeypatch):
    import torch

    from jointspec.kernels import grouped as kernels

    fixed, measured = arm
    fixed(9.0)  # exactly the margin: taken
    with use_isa("neondot"):
        assert quantize_choice("auto", None)[0] == "int4" and len(measured) == 1
        path, threads = probe._path("neondot"), torch.get_num_threads()
        from jointspec.kernels.cpu import cpu_signature

        assert probe.key("neondot")[:6] == ["neondot", cpu_signature(), kernels.source_digest(), threads,
                                            kernels.inputs_setting(), torch.__version__]
        monkeypatch.setenv(kernels.INPUTS_ENV, "float")
        assert probe._path("neondot") != path
        monkeypatch.delenv(kernels.INPUTS_ENV)
        torch.set_num_threads(threads + 1)
        try:
            assert probe._path("neondot") != path
        finally:
            torch.set_num_threads(threads)
        probe._measured.clear()  # (a new process)
        for bad in ('{"isa": "neondot", "float32_ms": "ten", "int4_ms": 1, "threads": 2}', "null", "[1, 2]",
                    '{"isa": "neondot", "float32_ms": 10, "int4_ms": -1, "threads": 2}', "{"):
            path.write_text(bad)
            assert probe.cached("neondot") is None, bad
        assert quantize_choice("auto", None)[0] == "int4" and len(measured) == 2  # measured again, no crash


def test_one_measurement_serves_a_process_whose_cache_cannot_be_written(arm, monkeypatch, tmp_path):
    fixed, measured = arm
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("JOINTSPEC_CACHE", str(blocked))  # (its folders cannot be made)
    fixed(4.0)
    with use_isa("neondot"):
        assert [quantize_choice("auto", None)[0] for _ in range(3)] == ["int4"] * 3
    assert measured == ["neondot"]


def test_info_reports_the_verdict_without_measuring(arm, monkeypatch):
    from jointspec.cli.info import _auto_quantize

    fixed, measured = arm
    with use_isa("neondot"):
        assert _auto_quantize("neondot", built=False)["mode"] == "to be measured" and measured == []
        fixed(4.0)
        quantize_choice("auto", None)
        report = _auto_quantize("neondot", built=True)
        assert report["mode"] == "int4" and "4.00 ms against 10.00 ms" in report["why"]
        monkeypatch.setenv(probe.PROBE_ENV, "off")
        assert _auto_quantize("neondot", built=True)["mode"] == "none"
    assert measured == ["neondot"]
