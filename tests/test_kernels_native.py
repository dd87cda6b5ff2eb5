"""The ARM (neondot) kernel build held to the portable build's bits, on an x86 machine.

No ARM CPU runs the tests, and PyTorch's ARM wheel cannot load the kernels under an emulator in a test's time, so
tests/native/kernel_bits.cpp links the kernels' raw-pointer units (the layers' and the screen's integer products,
attention, every vector primitive) without PyTorch. It is compiled twice: natively as the portable build, and by a
cross compiler for 64-bit ARM as the neondot build, run under qemu's user-mode emulator with a CPU that has the
dot-product instructions. Each prints a hash of every output bit of each case; the lines must be equal. Seeded
inputs, integer hashes: the test has no false failures; a wrong lane, rounding or order anywhere in a case changes
its line (a changed bit gives a different 64-bit hash except with odds of 2^-64).

It needs ``aarch64-linux-gnu-g++`` and ``qemu-aarch64`` (Debian: ``g++-aarch64-linux-gnu qemu-user``; .ci/run installs
them where it can); where they are missing it skips and says so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from jointspec.kernels import grouped

HERE = Path(__file__).parent / "native"
CSRC = Path(grouped.__file__).with_name("csrc")
CROSS, EMULATOR = "aarch64-linux-gnu-g++", "qemu-aarch64"


def _command(compiler: str, flags: list[str], out: Path) -> list[str]:
    """The harness's build with the kernels' own compiler flags (grouped.BUILD_CFLAGS) and the build's."""
    return [compiler, "-std=c++17", *grouped.BUILD_CFLAGS, *flags, "-DJOINTSPEC_NS=bits", f"-I{HERE / 'shim'}",
            f"-I{CSRC}", str(HERE / "kernel_bits.cpp"), str(CSRC / "products.cpp"), str(CSRC / "attention.cpp"),
            "-o", str(out)]


def _lines(output: str) -> tuple[str, list[str]]:
    """(the build's name, the case lines)."""
    first, *cases = output.splitlines()
    assert first.startswith("build ") and len(cases) > 50, output[:500]
    return first.split()[1], cases


@pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which(EMULATOR) is None,
                    reason=f"needs {CROSS} and {EMULATOR} (Debian: apt install g++-aarch64-linux-gnu qemu-user)")
def test_the_arm_build_gives_the_portable_builds_bits(tmp_path):
    portable, neon = tmp_path / "portable", tmp_path / "neondot"
    builds = [subprocess.Popen(_command(shutil.which("g++") or "g++", [], portable), stderr=subprocess.PIPE, text=True),
              subprocess.Popen(_command(CROSS, ["-static", *grouped.ISA_FLAGS["neondot"][1]], neon),
                               stderr=subprocess.PIPE, text=True)]
    for build in builds:  # both compile at once (half a minute each)
        _, errors = build.communicate()
        assert build.returncode == 0, errors[-3000:]
        assert "warning" not in errors, errors[-3000:]
    expected = subprocess.run([str(portable)], capture_output=True, text=True, check=True).stdout
    # "max": the emulated CPU has every optional instruction, the dot product among them.
    got = subprocess.run([EMULATOR, "-cpu", "max", str(neon)], capture_output=True, text=True, check=True).stdout
    assert _lines(expected)[0] == "portable" and _lines(got)[0] == "neondot"
    differ = [line.split()[0] for line, other in zip(_lines(expected)[1], _lines(got)[1]) if line != other]
    assert len(_lines(expected)[1]) == len(_lines(got)[1]) and not differ, f"cases that differ: {differ}"
    assert "differs_from_pairs" not in expected + got  # attention's shared-load form equals its definition


def test_the_arm_build_compiles_its_own_instructions(tmp_path):
    """The neondot flags select NEON's dot product in the products, and the unit that needs PyTorch's headers (the
    compiled layers, the screened head's bookkeeping) compiles for ARM too (checked, not linked: no ARM PyTorch)."""
    if shutil.which(CROSS) is None:
        pytest.skip(f"needs {CROSS}")
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    headers = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"], str(CSRC)]]
    done = subprocess.run([CROSS, "-std=c++17", "-fsyntax-only", "-ffp-contract=off", *grouped.ISA_FLAGS["neondot"][1],
                           "-DTORCH_EXTENSION_NAME=probe", *headers, str(CSRC / "grouped_linear.cpp")],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "error" not in done.stderr, done.stderr[-3000:]
    source = tmp_path / "probe.cpp"
    source.write_text('#include "simd.h"\n'
                      'const char* probe_isa() { return JOINTSPEC_ISA_NAME; }\n'
                      'simd::V16 probe(const simd::L64& w, const simd::L64& q) { return simd::dot4_signed(w, q); }\n')
    done = subprocess.run([CROSS, "-std=c++17", "-O2", *grouped.ISA_FLAGS["neondot"][1], f"-I{CSRC}", "-S", "-o", "-",
                           str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"neondot"' in done.stdout and "sdot" in done.stdout
