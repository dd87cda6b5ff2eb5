"""``jointspec info``: what the installation runs on, read without building, loading or fetching anything; and the
CPU fields it reads on x86 and on ARM. Deterministic: no false-failure odds."""

from __future__ import annotations

import json

import pytest

from jointspec.kernels import cpu, grouped

from helpers import run_cli

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""


@pytest.fixture
def cpuinfo(monkeypatch, tmp_path):
    """Point the CPU reader at a file of the test's own (its fields are cached: cleared both ways)."""
    def use(text: str) -> None:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(cpu, "CPUINFO", str(path))
        cpu._cpuinfo_field.cache_clear()
    yield use
    cpu._cpuinfo_field.cache_clear()


def test_info_reports_the_build_and_the_quantisation_choice_without_building(capsys, monkeypatch, tmp_path):
    # A cache with no build in it: info says the build is not made, and makes none (a build would take a minute).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(grouped.ISA_ENV, "portable")
    code, out, err = run_cli(capsys, "info", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["kernels"]["selected"] == "portable" and report["kernels"]["chosen_by"] == f"${grouped.ISA_ENV}"
    assert report["kernels"]["built"] is False and report["kernels"]["runnable"] == list(grouped.runnable_isas())
    assert report["kernels"]["folder"].startswith(str(tmp_path / "xdg"))
    assert report["quantize_auto"]["mode"] == "none" and "portable build" in report["quantize_auto"]["why"]
    assert report["caches"] == {"jointspec": str(tmp_path / "cache"), "set_by": "$JOINTSPEC_CACHE",
                                "kernels": str(tmp_path / "xdg" / "jointspec" / "kernels")}
    assert report["embedded_model"]["prepared"] is False
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "cache").exists()  # nothing built, nothing fetched
    assert "building" not in err
    assert {item["package"] for item in report["optional"]} >= {"llguidance", "fastapi", "ninja"}
    assert report["cpu"]["usable_cores"] >= 1 and set(report["cpu"]["vector_flags"]) <= set(cpu.cpu_flags())


def test_info_in_text_and_with_a_refused_build_name(capsys, monkeypatch):
    monkeypatch.setenv(grouped.ISA_ENV, "avx9")
    code, out, err = run_cli(capsys, "info")
    assert code == 0, err
    assert "unknown instruction set 'avx9'" in out and "--quantize auto on the embedded model: none" in out
    monkeypatch.delenv(grouped.ISA_ENV)
    code, out, err = run_cli(capsys, "info")
    assert code == 0, err
    assert f"CPU kernels: the {grouped.selected_isa()} build (chosen by the CPU;" in out
    assert out.startswith("jointspec ") and "drafts shipped: smollm2-135m-instruct-corpus" in out
    for isa, tiles in (("avx2", "scored key by key) (the build)"), ("portable", "the CPU's vendor)")):
        if isa in grouped.runnable_isas():
            monkeypatch.setenv(grouped.ISA_ENV, isa)
            code, out, err = run_cli(capsys, "info")
            assert code == 0, err
            assert "attention's half-cache key tiles: " in out and tiles in out, (isa, out)


def test_auto_quantisation_on_the_portable_build_is_decided_without_building(monkeypatch):
    from jointspec.backends.loading import quantize_choice

    def no_build(*args, **kwargs):
        raise AssertionError("the kernels were built to decide")
    monkeypatch.setattr(grouped, "unavailable_reason", no_build)
    with grouped.use_isa("portable"):
        assert quantize_choice("auto", None)[0] == "none"


def test_an_arm_cpus_features_name_and_signature(cpuinfo):
    cpuinfo(ARM_CPUINFO)
    assert {"asimd", "asimddp", "fphp"} <= cpu.cpu_flags()
    assert cpu.cpu_name() == "ARM CPU implementer 0x41, part 0xd0c"
    assert "0xd0c" in cpu.cpu_signature() and "asimddp" in cpu.cpu_signature()
    assert "asimddp" not in cpu.cpu_signature().replace("0xd0c", "").split("|")[0]
    other = ARM_CPUINFO.replace("0xd0c", "0xd40")  # another core of the same features: another signature
    first = cpu.cpu_signature()
    cpuinfo(other)
    assert cpu.cpu_signature() != first
    cpuinfo("processor\t: 0\nmodel name\t: Some x86\nflags\t\t: fpu avx2 fma\n")
    assert cpu.cpu_flags() == {"fpu", "avx2", "fma"} and cpu.cpu_name() == "Some x86"


def test_info_reports_what_would_stop_a_run_instead_of_stopping(capsys, monkeypatch, tmp_path):
    # A vector build not made yet: auto's choice is said from the build alone (deciding would build it).
    vector = next((isa for isa in grouped.runnable_isas() if isa != "portable"), None)
    if vector is not None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        monkeypatch.setenv(grouped.ISA_ENV, vector)
        code, out, err = run_cli(capsys, "info", "--json")
        report = json.loads(out)
        assert code == 0 and report["kernels"]["built"] is False and not (tmp_path / "xdg").exists()
        assert report["quantize_auto"]["mode"] == "int4" and "once the first run has built them" in \
            report["quantize_auto"]["why"]
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.delenv(grouped.ISA_ENV)
    # A bad $JOINTSPEC_KERNEL_INPUTS, a package whose metadata cannot be read, CUDA failing: each is in the report.
    monkeypatch.setenv(grouped.INPUTS_ENV, "bad")
    from importlib import metadata

    import torch

    real_version = metadata.version

    def version(package):
        if package == "llguidance":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_version(package)
    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: (_ for _ in ()).throw(RuntimeError("no driver")))
    code, out, err = run_cli(capsys, "info")
    assert code == 0, err
    assert "quantised layers' inputs: JOINTSPEC_KERNEL_INPUTS='bad' is not one of" in out
    assert "llguidance: installed, but its metadata cannot be read (UnicodeDecodeError" in out
    assert "CUDA: CUDA fails: no driver" in out


def test_an_x86_cpus_signature_is_what_it_was(cpuinfo):
    # Per-CPU caches (cost curves) are keyed by it: reading ARM's fields must not move an x86 machine's key.
    cpuinfo("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\n"
            "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 fma\n")
    assert cpu.cpu_signature() == "Intel(R) Xeon(R) Processor|6|167|fpu avx2 fma"


def test_info_names_a_kept_model_copy_only_when_whole(capsys, monkeypatch, tmp_path):
    # A copy cut short (a full disk, a stopped copy) is not what a run converts: it fetches the wheel again.
    from jointspec.backends import embedded

    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "_find_installed_gguf", lambda: None)
    kept = embedded.default_gguf_file()
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF" + bytes(996))
    code, out, err = run_cli(capsys, "info")
    assert code == 0 and "the first run without --model fetches it with pip" in out, out
    monkeypatch.setattr(embedded, "_kept_gguf_whole", lambda path: path == kept)
    code, out, err = run_cli(capsys, "info")
    assert code == 0 and "from its copy in the cache, converted on first use" in out, out


def test_an_unexpected_fault_ends_with_its_traceback_and_what_a_report_needs(capsys, monkeypatch):
    from jointspec.cli import info

    def broken():
        raise RuntimeError("a fault no check names")
    monkeypatch.setattr(info, "environment", broken)
    code, out, err = run_cli(capsys, "info")
    assert code == 1
    assert "Traceback" in err and "RuntimeError: a fault no check names" in err
    assert err.strip().splitlines()[-1].startswith("jointspec: unexpected error in `jointspec info` (a bug")
    assert "`jointspec info`" in err.strip().splitlines()[-1]
