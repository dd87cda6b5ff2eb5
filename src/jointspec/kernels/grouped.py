"""Grouped int4 / int8 weight-only linear layers with a CPU kernel of our own, for ``--quantize int4``.

Why a kernel of our own. PyTorch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) wants bfloat16 activations,
which move the model away from its float32 self, and on some CPUs its cost grew about linearly with the rows of a
forward, so verifying draft tokens cost almost as much as decoding them one by one; MKL's float32 GEMM reads 4x the
bytes and its cost jumps between 3 and 4 rows. ``csrc/grouped_linear.cpp`` (built once with the machine's own
compiler) dequantises each weight row into an L1-resident float32 buffer and takes its dot product with every input
row, so weights are read once per forward and each extra row costs only arithmetic. Timed alone, its layers cost a
fraction of MKL's float32 ones at every row count; inside a whole forward each call pays more, and it came out level
with PyTorch's int4 kernel where both were timed (docs/kernels.md has both measurements). What it buys is fidelity,
next.

Why these formats. The embedded SmolLM2 GGUF stores its body as Q4_1 (4-bit levels in blocks of 32 inputs, a scale
and a minimum per block) and its output head as Q8_0 (signed 8-bit levels in blocks of 32, a scale per block);
jointspec's float32 model is those weights dequantised. Quantising that float model again in the same blocks
(4-bit asymmetric g32 for the body, 8-bit symmetric g32 for the head) recovers the GGUF's own levels, scales and
minima up to float rounding, so this int4 model is the float32 model up to float rounding, not a second rounding
of it (``tests/test_kernels_grouped.py`` checks the round trip; ``docs/lab/benchmarks.md`` has the agreement on real
prompts).
For a model that was never quantised it is an ordinary 4-bit quantisation.

Inputs. 4- and 5-bit layers round each input row to signed 8-bit levels per group of 32 (a step of max |x| / 127,
as llama.cpp's Q8_0) and take each group's product as an exact integer sum, scaled once: on a model whose weights do
not fit in cache that halves the instructions per weight, which is what a decoding step is short of
(docs/kernels.md, "8-bit inputs"). 8- and 6-bit projections (Q8_0, Q6_K) do the same with signed levels. llama.cpp
rounds its inputs to 8 bits too (per 32 for Q4_0 to Q8_0, per 256 for the K-quants), so the model moves towards
llama.cpp's and away from the float32 model of the dequantised weights; :func:`float_inputs` switches back for a block,
and ``$JOINTSPEC_KERNEL_INPUTS=float`` for a whole run. The screened output head keeps float32 inputs.

Exactness. Every output row is computed by the same instructions whatever the batch (bit-equal rows, tested), and
quantised models use row-wise attention (:func:`jointspec.kernels.quantize.rowwise_sdpa`), so speculative decoding on
this target is exactly its plain decoding.

The same extension holds two more kernels for the int4 model. ``attention``: row-wise attention (each query row and
head computed alone, by construction) in one call per layer, which :func:`jointspec.kernels.quantize.rowwise_sdpa`
uses instead of one PyTorch SDPA call per row. ``decoder_layer``: a whole Llama decoder layer on these 4-bit weights
(norms, fused q/k/v, rotary embedding, cache write, attention, output projection, gated MLP, residuals), which the
lean forward (backends/lean_forward.py) runs instead of about fifty PyTorch operations per layer, for a much cheaper
plain int4 step (docs/kernels.md). Both treat every row alone, so speculative decoding stays exactly plain decoding of
the int4 model; neither is bit for bit the operation-by-operation forward (float sums in another order), which is why
plain and speculative decoding both run them.

One source, four builds (``csrc/simd.h``): AVX-512, AVX2 + FMA (each taking VNNI's integer dot product for the
screened head where the CPU has it), NEON with the dot-product instructions for 64-bit ARM CPUs that have them
(``neondot``), and portable C++ for any other CPU. They compute every float
operation in the same order with the same single roundings, so they give the same bits (the rest of a forward is
PyTorch's, whose bits may vary between CPUs: docs/kernels.md), and tests hold each build this CPU runs against the
portable one. :func:`selected_isa` picks the fastest build the CPU runs (``$JOINTSPEC_KERNEL_ISA`` or :func:`use_isa`
pick another). Where no build can be made (no C++ compiler, no ninja) the layers fall back to PyTorch's int4 / int8
kernels of :mod:`jointspec.kernels.quantize`, with one warning that says why; layers whose in_features is not a
multiple of 64 stay float.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import use_row_kernels
from jointspec.kernels.cpu import cpu_flags, cpu_vendor, usable_cores
from jointspec.kernels.heap import release_freed_memory

log = logging.getLogger(__name__)

GROUP_SIZE = 32
_SOURCES = tuple(Path(__file__).with_name("csrc") / name
                 for name in ("simd.h", "rows.h", "attention.h", "grouped_linear.cpp", "attention.cpp", "products.cpp"))
# The translation units a build compiles; the headers are in _SOURCES for the hash. ninja starts them in this order, a
# job a core: the longest is grouped_linear.cpp on the vector builds and attention.cpp on the portable one (its scalar
# loops unrolled), so those two go first and the product takes whichever core frees first (docs/kernels.md).
_UNITS = tuple(source for source in _SOURCES if source.suffix == ".cpp")
_TINY = 1e-12

# The instruction sets the kernels are built for, fastest first: the CPU flags each needs and its compiler flags.
# Explicit flags, never -march=native, so a build runs on every CPU that has those flags and a cache copied to
# another CPU is never run on instructions it lacks (the build's name carries the instruction set). "avx512vnni" is the
# avx512 build with VNNI's integer dot product for every 8-bit-input product (the same integers in fewer
# instructions; what the 6-bit layers' products need most: docs/kernels.md); the avx512 and avx2 builds still take it
# at run time for the screened head where the CPU has it. "avx2vnni" is the avx2 build with AVX-VNNI's 256-bit form
# of that instruction (the laptops and desktops that have it without AVX-512). "neondot" is for 64-bit ARM CPUs with
# the dot-product instructions (ARMv8.2's optional, ARMv8.4's required ones: the "asimddp" flag), whose 128-bit
# registers take the AVX2 build's shapes. "portable" is plain C++ for any CPU.
_AVX512 = (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
           ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
            "-DJOINTSPEC_ISA_AVX512"])
_AVX2 = (frozenset({"avx2", "fma", "f16c"}), ["-mavx2", "-mfma", "-mf16c", "-DJOINTSPEC_ISA_AVX2"])
ISA_FLAGS = {
    "avx512vnni": (_AVX512[0] | {"avx512_vnni"}, [*_AVX512[1], "-mavx512vnni"]),
    "avx512": _AVX512,
    "avx2vnni": (_AVX2[0] | {"avx_vnni"}, [*_AVX2[1], "-mavxvnni"]),
    "avx2": _AVX2,
    # ("atomics": ARMv8.1's, which -march=armv8.2-a lets the compiler use, as every CPU with asimddp has them)
    "neondot": (frozenset({"asimd", "asimddp", "atomics"}), ["-march=armv8.2-a+dotprod", "-DJOINTSPEC_ISA_NEON"]),
    "portable": (frozenset(), []),
}
ISAS = tuple(ISA_FLAGS)
# Every build's compiler flags besides its own (tests/test_kernels_native.py compiles with them too).
# -ffp-contract=off: the compiler may not fuse a * b + c on its own (simd.h: every build, the same bits).
BUILD_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
# The builds that ``--quantize auto`` takes (backends/loading.py): those measured faster than the float32 model on real
# CPUs. The neondot build is exact (tests hold it to the portable build's bits under an emulator) but has not run on
# an ARM CPU here: auto measures it on the user's CPU (kernels/probe.py). The portable one was slower than float32
# where measured. --quantize int4 runs either.
AUTO_ISAS = frozenset({"avx512vnni", "avx512", "avx2vnni", "avx2"})
# The machine types each build compiles for (platform.machine()'s names); the portable build, every one.
ISA_MACHINES = {"neondot": frozenset({"aarch64", "arm64"}),
                **{isa: frozenset({"x86_64", "amd64"}) for isa in ISAS if isa.startswith("avx")}}
# Set to one of ISAS to run that build instead of the fastest this CPU can run (tests, comparisons).
ISA_ENV = "JOINTSPEC_KERNEL_ISA"
_override: list[str] = []  # use_isa()'s stack
# Set to "float" for quantised layers on float32 inputs (closer to the float32 model of the same weights, slower on
# models that do not fit in cache); "q8" (the default) rounds inputs to 8 bits, as llama.cpp does.
INPUTS_ENV = "JOINTSPEC_KERNEL_INPUTS"
INPUT_CHOICES = ("q8", "float")


def inputs_setting() -> str:
    """What $JOINTSPEC_KERNEL_INPUTS asks for (``q8`` unless set); an unknown value is refused by name."""
    value = os.environ.get(INPUTS_ENV, "q8").strip().lower() or "q8"
    if value not in INPUT_CHOICES:
        raise UnsupportedOptionError(f"{INPUTS_ENV}={value!r} is not one of: {', '.join(INPUT_CHOICES)} (q8: inputs "
                                     "rounded to 8 bits, as llama.cpp does; float: float32 inputs)")
    return value


# Attention over a half cache widens each tile of keys once for a key head's many pairs (a verification's rows) where
# that was measured faster: on the vendors named here; elsewhere each pair reads the tile in place, as before the
# widening was built (docs/kernels.md, "Halves widened once for many pairs"). The bits are the same either way.
# $JOINTSPEC_KERNEL_WIDEN_KEYS (on, off) overrides the choice.
WIDEN_KEYS_ENV = "JOINTSPEC_KERNEL_WIDEN_KEYS"
WIDEN_KEYS_VENDORS = frozenset({"GenuineIntel"})


# The builds whose attention scores a shared prefix key by key for many pairs at once (attention.cpp's
# g_score_by_key, compiled in): each key widened once for all the pairs in registers, which there takes the place of
# widened tiles (docs/kernels.md, "Keys scored once for every pair on AVX2").
SCORES_BY_KEY_ISAS = frozenset({"avx2", "avx2vnni"})


def widen_keys_setting() -> bool:
    """Whether attention widens a half cache's key tiles once for many pairs here: $JOINTSPEC_KERNEL_WIDEN_KEYS, or
    by the CPU's vendor; an unknown value is refused by name."""
    value = os.environ.get(WIDEN_KEYS_ENV, "").strip().lower()
    if not value:
        return cpu_vendor() in WIDEN_KEYS_VENDORS
    if value not in ("on", "off"):
        raise UnsupportedOptionError(f"{WIDEN_KEYS_ENV}={value!r} is not one of: on, off (whether attention over a "
                                     "half cache widens key tiles once for many pairs; the same results either way)")
    return value == "on"


def _build_directory(tag: str) -> Path:
    """Where a build lives: ``$XDG_CACHE_HOME/jointspec/kernels`` (default ``~/.cache``). Not ``$JOINTSPEC_CACHE``,
    which tests point at empty folders: the kernels load once a process, and a build there would take minutes."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "jointspec" / "kernels" / tag


def runnable_isas() -> tuple[str, ...]:
    """The builds this CPU can run, fastest first ("portable" always among them)."""
    flags, machine = cpu_flags(), platform.machine().lower()
    return tuple(isa for isa, (needs, _) in ISA_FLAGS.items()
                 if isa not in ISA_MACHINES or (machine in ISA_MACHINES[isa] and needs <= flags))


def selected_isa() -> str:
    """The build the kernels run here: :func:`use_isa`'s, else $JOINTSPEC_KERNEL_ISA's, else the fastest runnable."""
    if _override:
        return _override[-1]
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    return _checked_env_isa(wanted) if wanted else _fastest_isa()


# Both asked on every kernel call: the CPU's flags are read once (a refused name raises again, uncached).
@functools.cache
def _fastest_isa() -> str:
    return runnable_isas()[0]


@functools.cache
def _checked_env_isa(wanted: str) -> str:
    _check_isa(wanted, f"${ISA_ENV}")
    return wanted


def _check_isa(isa: str, where: str) -> None:
    if isa not in ISA_FLAGS:
        raise UnsupportedOptionError(f"{where}: unknown instruction set '{isa}'; choose one of: {', '.join(ISAS)}")
    if isa not in runnable_isas():
        machine = platform.machine()
        if machine.lower() not in ISA_MACHINES.get(isa, {machine.lower()}):
            lacks = f"they are for {' or '.join(sorted(ISA_MACHINES[isa]))} CPUs, this one is {machine or 'unknown'}"
        elif not cpu_flags():
            lacks = "its features cannot be read here: no /proc/cpuinfo, as on macOS"
        else:
            lacks = f"it lacks {', '.join(sorted(ISA_FLAGS[isa][0] - cpu_flags()))}"
        raise UnsupportedOptionError(f"{where}: this CPU cannot run the '{isa}' kernels ({lacks}); it runs: "
                                     f"{', '.join(runnable_isas())}")


@contextlib.contextmanager
def use_isa(isa: str) -> Iterator[None]:
    """Run the kernels of the ``isa`` build inside the block (for layers that look the kernels up when called;
    a compiled layer stack keeps the build it was made with)."""
    _check_isa(isa, "use_isa")
    _override.append(isa)
    try:
        yield
    finally:
        _override.pop()


@contextlib.contextmanager
def float_inputs(isa: str | None = None) -> Iterator[None]:
    """The quantised layers of the ``isa`` build (default: the selected one) multiply float32 inputs inside the block,
    as before the kernels rounded inputs to 8 bits: for comparing the two, and for tests that hold two forward paths
    (compiled and operation by operation) to float rounding, which an 8-bit rounding of the inputs would turn into
    flipped levels."""
    module = kernels(isa)
    if module is None:
        raise RuntimeError(f"the grouped kernels cannot run here: {unavailable_reason(isa)}")
    module.use_q8_inputs(False)
    try:
        yield
    finally:
        module.use_q8_inputs(inputs_setting() == "q8")  # what $JOINTSPEC_KERNEL_INPUTS set


_FORCED: list = []  # builds forced_build() stands in for the selected one, innermost last


@contextlib.contextmanager
def forced_build(module) -> Iterator[None]:
    """Inside, :func:`kernels` and :func:`loaded_kernels` return ``module``: another build of these kernels that the
    caller loaded itself. For comparing two builds on whole models in one process
    (``benchmarks/kernel_builds_ab.py --model``): a model loaded inside keeps that build's compiled layers, and each of
    its forwards runs inside the same block so that its head calls that build too."""
    _FORCED.append(module)
    try:
        yield
    finally:
        _FORCED.pop()


def kernels(isa: str | None = None):
    """The compiled extension for ``isa`` (default: :func:`selected_isa`), or None where it cannot run here (see
    :func:`unavailable_reason`)."""
    if _FORCED:
        return _FORCED[-1]
    return _load(isa or selected_isa())[0]


def loaded_kernels():
    """The selected build's extension if it is already loaded in this process, else None (never builds)."""
    if _FORCED:
        return _FORCED[-1]
    try:
        return _RESULTS.get(selected_isa(), (None, None))[0]
    except UnsupportedOptionError:
        return None


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why the grouped kernels cannot run here (None: they can). Builds them on first call (once: a minute or more
    on two cores)."""
    return _load(isa or selected_isa())[1]


_RESULTS: dict[str, tuple] = {}  # _load()'s answer by instruction set: (extension, None) or (None, why not)
_LOAD_LOCK = threading.Lock()  # one build at a time: a call made while prebuild()'s thread builds waits for it
_PREBUILDS: list[threading.Thread] = []  # prebuild()'s threads
_COMPILING = threading.Event()  # set while _build() runs the compiler


def _load(isa: str):
    """(extension, None) or (None, why not), once per instruction set; the reason is logged once."""
    found = _RESULTS.get(isa)  # every kernel call asks: no lock once answered
    if found is not None:
        return found
    with _LOAD_LOCK:
        if isa not in _RESULTS:
            module, reason = _build(isa)
            if reason == _INTERRUPTED:  # nothing to say, and the next call (a library that goes on) tries again
                return None, reason
            if module is not None:
                module.use_q8_inputs(inputs_setting() == "q8")
                module.use_widened_keys(widen_keys_setting())
                use_row_kernels(module, preferred=isa == _fastest_isa())
            if reason is not None:
                log.warning("int4: %s; --quantize auto keeps the float32 model (several times slower than int4 "
                            "where the kernels run) and --quantize int4 uses PyTorch's int4/int8 kernels (bfloat16 "
                            "activations: close to the float model, not equal to it)", reason)
            _RESULTS[isa] = (module, reason)
        return _RESULTS[isa]


def prebuild(isa: str | None = None) -> threading.Thread | None:
    """Build (or load) the kernels for ``isa`` (default: :func:`selected_isa`) on a thread of their own, so that a
    first run's compiling (a minute or more) overlaps the caller's imports and model loading instead of following
    them; the compiler runs in a child process, so the thread holds Python's lock only to start and load it. A
    :func:`kernels` call made meanwhile waits for that build; a failure is the same warning and fallback as without
    it. Returns the thread, or None where there is nothing to do (already loaded, or an instruction set this CPU
    refuses: the caller's own :func:`kernels` call then says why)."""
    try:
        isa = isa or selected_isa()
    except UnsupportedOptionError:
        return None
    if isa in _RESULTS or _FORCED:
        return None
    # What the thread imports is imported here, in the caller's thread: torch's extension builder brings setuptools,
    # which patches the import system for distutils, and a thread importing it while the caller imports transformers
    # is the likeliest cause of one first run, in a fresh clone, that failed inside transformers' own import ("cannot
    # import name ... from partially initialized module", 2026-12-03; not reproduced since). The thread then only
    # compiles or loads the library.
    with contextlib.suppress(ImportError):  # _build says what is missing
        import ninja  # noqa: F401
        import torch.utils.cpp_extension  # noqa: F401
    # Not a daemon: interrupted, the compiler (in the terminal's process group) stops too, and the thread then
    # returns through torch's cleanup, which removes the build folder's lock instead of leaving it to the next run.
    thread = threading.Thread(target=_load_quietly, args=(isa,), name=f"jointspec kernels ({isa})")
    thread.start()
    _PREBUILDS.append(thread)
    return thread


def prebuild_compiling() -> bool:
    """Whether a thread prebuild() started is compiling now (a process that ends then waits for it: see prebuild);
    loading a build already made is not counted (a second or so)."""
    return _COMPILING.is_set() and any(thread.is_alive() for thread in _PREBUILDS)


def _load_quietly(isa: str) -> None:
    """prebuild()'s thread: an error (a bad $JOINTSPEC_KERNEL_INPUTS, say) is left for the caller's own kernels()
    call to raise with its message, not printed here as a thread's traceback."""
    try:
        _load(isa)
    except Exception:  # noqa: BLE001 - raised again, by name, where the caller asks for the kernels
        log.debug("prebuilding the %s kernels failed; the next kernels() call tries again", isa, exc_info=True)


@functools.cache
def source_digest() -> str:
    """A hash of the kernels' sources and the torch version they build against (what a kernel build is made of
    besides its instruction set)."""
    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()


# A build that holds its folder's lock longer than this is taken for a process that died building (torch's own wait
# would last for ever): a build takes a minute or two on two cores. Where the lock's owner is known (``_OWNER``) and
# gone, the lock goes at once.
STALE_LOCK_SECONDS = 600
_OWNER = "owner"  # beside torch's lock: "host pid start" of the process that calls torch's build
_STOP = threading.Event()  # set by stop_builds(): the waits for another process's build begun before it end
_INTERRUPTED = "the command was interrupted before the kernels were built"


def stop_builds() -> None:
    """End the waits for another process's kernel build begun so far (an interrupted command: its build thread is
    not a daemon, and the process would otherwise linger until that other build finished). Later builds (a library
    that goes on, a test run) wait as before."""
    global _STOP
    stopping, _STOP = _STOP, threading.Event()
    stopping.set()


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (``/proc``'s clock ticks since boot: a reused pid has another), "" where this
    system has no ``/proc``, None where no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else ""
    except (OSError, IndexError):
        return ""


def _owner_line() -> str:
    return f"{platform.node()} {os.getpid()} {_process_start(os.getpid()) or '-'}"


def _owner_gone(directory: Path) -> bool:
    """Whether the process that last called torch's build in ``directory`` has ended (known only on this host)."""
    try:
        host, pid, start = (directory / _OWNER).read_text().split()
    except (OSError, ValueError):
        return False
    if host != platform.node():
        return False
    now = _process_start(int(pid))
    if now == "":  # no /proc: whether the pid runs at all
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    return now is None or (start != "-" and now != start)


def _wait_for_other_build(directory: Path) -> bool:
    """Wait while another process builds into ``directory`` (torch's lock file there), saying so once. A lock left by
    a process that died while building (its owner gone, or the lock older than :data:`STALE_LOCK_SECONDS`) is
    removed, with a warning. False where :func:`stop_builds` ended the wait."""
    lock = directory / "lock"
    said, stop = False, _STOP
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return True
        gone = _owner_gone(directory)
        if gone or age > STALE_LOCK_SECONDS:
            why = "whose process has ended" if gone else f"{age:.0f} s ago"
            log.warning("removing %s, left by a kernel build that did not finish (%s)", lock, why)
            lock.unlink(missing_ok=True)
            return True
        if not said:
            print(f"jointspec: waiting for another process building the CPU kernels (its lock: {lock}; if no "
                  "jointspec process is running, remove that file)", file=sys.stderr, flush=True)
            said = True
        if stop.wait(1.0):
            return False


def own_ninja_directory() -> str | None:
    """The folder of the ninja installed with this Python (the ``ninja`` package jointspec depends on), or None."""
    try:
        import ninja

        candidates = [getattr(ninja, "BIN_DIR", None), os.path.dirname(sys.executable)]
    except ImportError:
        candidates = [os.path.dirname(sys.executable)]
    return next((folder for folder in candidates
                 if folder and os.access(os.path.join(folder, "ninja"), os.X_OK)), None)


@contextlib.contextmanager
def _environment_variable(name: str, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` inside the block (None: left alone), and as it was again after it."""
    previous = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous


def build_folder(isa: str) -> Path:
    """Where the ``isa`` build of these sources lives (named by the sources, the machine type and the flags, so a
    library in it is of these sources); its library is ``<folder>/<folder name>.so``."""
    flags = ISA_FLAGS[isa][1]
    digest = hashlib.sha256(" ".join([source_digest(), platform.machine(), *flags]).encode())
    return _build_directory(f"jointspec_kernels_{isa}_{digest.hexdigest()[:12]}")


def build_finished(isa: str) -> bool:
    """Whether the ``isa`` build of these sources is made and checked (loading it takes a second; nothing is built)."""
    folder = build_folder(isa)
    return _finished(folder / f"{folder.name}.so")


def _build(isa: str):
    directory = build_folder(isa)
    name, flags = directory.name, ISA_FLAGS[isa][1]
    if directory.is_dir():
        if not _wait_for_other_build(directory):
            return None, _INTERRUPTED
        library = directory / f"{name}.so"
        if _finished(library):
            try:  # a finished build, checked: imported as torch's load would, without its lock or ninja's check
                return _checked(_import_library(name, library), isa, directory, library)
            except ImportError as error:
                log.debug("importing %s failed (%s); building it again", library, error)
        elif library.exists() and (directory / _FINISHED).exists():
            # Not the library the build finished (damaged since, or a link stopped midway after an earlier one):
            # loading it could crash the process. Without a record at all, ninja's own log judges it (below).
            try:
                library.unlink()
            except OSError as error:
                return None, (f"jointspec's {isa} CPU kernels at {library} are damaged and cannot be removed "
                              f"({error}); delete that folder and run again")
    # torch runs whichever ninja PATH names first. Two ninja versions (the environment's and the system's, as in an
    # activated shell and a script that calls .venv/bin/python) keep the build log in formats each reads as stale,
    # so every switch between them rebuilt the kernels (20 s and more on two cores): always this Python's own.
    own = own_ninja_directory()
    with _environment_variable("PATH", None if own is None else own + os.pathsep + os.environ.get("PATH", "")):
        try:
            from torch.utils.cpp_extension import load, verify_ninja_availability

            verify_ninja_availability()
        except (ImportError, RuntimeError) as error:
            return None, f"jointspec's CPU kernels cannot be built ({error}; pip install ninja)"
        compiling = not any(directory.glob("*.so"))
        if compiling:
            print(f"jointspec: building the {isa} CPU kernels, once for this CPU type (a minute or two on two cores) "
                  "...", file=sys.stderr, flush=True)
            _prune_builds(directory, isa)
        directory.mkdir(parents=True, exist_ok=True)
        if not _wait_for_other_build(directory):
            return None, _INTERRUPTED
        with contextlib.suppress(OSError):
            (directory / _OWNER).write_text(_owner_line())
        if compiling:
            _COMPILING.set()
        # ninja's default runs every unit at once (cores + 2 jobs): on two cores the longest unit then shares them with
        # the others from its start. A job a core, in _UNITS' order, ends sooner (docs/kernels.md). MAX_JOBS, torch's
        # setting for this, is left as the user set it.
        jobs = None if "MAX_JOBS" in os.environ else str(usable_cores())
        try:
            with _environment_variable("MAX_JOBS", jobs):
                module = load(name=name, sources=[str(unit) for unit in _UNITS], build_directory=str(directory),
                              extra_cflags=[*BUILD_CFLAGS, *flags],
                              extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as error:  # a compiler error or a missing toolchain: say which, and fall back
            if "interrupted by user" in str(error):  # Ctrl-C reached the compiler too: the command says it stopped
                return None, _INTERRUPTED
            lines = str(error).splitlines()
            first = next((line for line in lines if "error:" in line), lines[0] if lines else type(error).__name__)
            return None, f"jointspec's {isa} CPU kernels failed to build ({first.strip()[:300]})"
        finally:
            _COMPILING.clear()
    return _checked(module, isa, directory, directory / f"{name}.so", record=True)


_FINISHED = ".finished"  # "size sha256" of the library a build finished and loaded


def _finished(library: Path) -> bool:
    """Whether ``library`` is what a build finished and loaded (its size and hash as recorded then): a link stopped
    midway, or a file damaged since, is not, and is never loaded (a truncated library crashes the process that maps
    it)."""
    try:
        size, digest = (library.parent / _FINISHED).read_text().split()
        if library.stat().st_size != int(size):
            return False
        return _digest(library) == digest
    except (OSError, ValueError):
        return False


def _digest(library: Path) -> str:
    with open(library, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _import_library(name: str, library: Path):
    """The built extension module, imported as torch's ``load`` imports it once built."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checked(module, isa: str, directory: Path, library: Path, record: bool = False):
    """``_build``'s answer for a loaded ``module``; ``record``: note the library as finished (just built or
    checked by torch's load)."""
    if module.isa() != isa:
        return None, f"jointspec's {isa} CPU kernels were built as '{module.isa()}'"
    if record and library.is_file():
        with contextlib.suppress(OSError):  # a read-only cache: checked again by torch's load next time
            staged = directory / f"{_FINISHED}.{os.getpid()}"
            staged.write_text(f"{library.stat().st_size} {_digest(library)}\n")
            os.replace(staged, directory / _FINISHED)
    if record:
        with contextlib.suppress(OSError):
            owner = directory / _OWNER
            if owner.read_text() == _owner_line():
                owner.unlink()
    _mark_used(directory)
    return module, None


# Finished builds of other sources kept per ISA, the most recently used first: two checkouts (or versions) used in
# turn on one machine removed each other's build when only the newest was kept, and rebuilt at every switch.
KEPT_BUILDS = 4
_USED = ".last_used"


def _mark_used(directory: Path) -> None:
    try:
        (directory / _USED).touch()
    except OSError:  # a read-only cache: pruning then goes by the folders' own times
        pass


def _last_used(directory: Path) -> float:
    try:
        return (directory / _USED).stat().st_mtime
    except OSError:
        pass
    try:
        return directory.stat().st_mtime
    except OSError:  # gone meanwhile: another process's prune removed it
        return 0.0


def _prune_builds(directory: Path, isa: str) -> None:
    """Before building into ``directory``, remove the finished builds of ``isa`` for other sources beyond the
    :data:`KEPT_BUILDS` - 1 most recently used (a folder without a library may be another process's build in
    progress: left alone)."""
    others = [other for other in directory.parent.glob(f"jointspec_kernels_{isa}_*")
              if other != directory and any(other.glob("*.so"))]
    others.sort(key=_last_used, reverse=True)
    for stale in others[KEPT_BUILDS - 1:]:
        shutil.rmtree(stale, ignore_errors=True)


def grouped_misfit(linear: nn.Linear) -> str | None:
    """Why the grouped kernels cannot take ``linear`` (None if they can, once built)."""
    # A meta weight is a layer built without storage, whose levels come from a file (gguf_blocks.model_from_blocks).
    if linear.weight.device.type not in ("cpu", "meta"):
        return "not on the CPU"
    if linear.in_features % 64:
        return f"in_features {linear.in_features} is not a multiple of 64"
    return None


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    return x.reshape(-1, in_features).to(torch.float32).contiguous()


# Forwards longer than this (long prefills) take one-call GEMMs and transformers' one-call SDPA: the same prompt is
# prefilled the same way by plain and speculative decoding, so only the rows after it need to be batch-independent.
ROWWISE_MAX_ROWS = 256


def _long(x: torch.Tensor) -> bool:
    """Whether a forward is long enough to be a prompt prefill (``ROWWISE_MAX_ROWS``): then the kernel runs the
    product as one float32 GEMM, whose rows are not computed alone, as row-wise attention runs one SDPA.

    ``x``: [..., rows, in]. The rows counted are one sequence's: a padded batch of several (the ragged engine's) is
    long only where its sequences are, as row-wise attention counts them, so a decode round of many sequences still
    gives each the bits it gets alone."""
    return x.dim() >= 2 and x.shape[-2] > ROWWISE_MAX_ROWS


def _scales_as_stored(scale: torch.Tensor, minimum: torch.Tensor, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4- or 5-bit layer's scales and minima as float16 where every one of them is a float16 (a file's own: GGUF's
    Q4_0, Q4_1, Q5_0, Q5_1), else float32. The kernels widen halves exactly, so the layer computes the same bits and
    reads a sixth fewer bytes (20 a group of 32 weights instead of 24). Where every minimum is also ``offset`` times
    its scale (the symmetric Q4_0 and Q5_0: -8 d, -16 d), the minima are that offset alone, one half a row
    ([out, 1]): the kernels form offset * scale, exact for a power of two, and read 18 bytes a group, as the file."""
    if minimum.shape[-1] == 1 and scale.shape[-1] > 1:  # already the offset form (gguf_blocks)
        if not bool((minimum == offset).all()):
            raise ValueError(f"minima given as one offset a row must all be {offset:g} for this layer; got "
                             f"{sorted(set(minimum.flatten().tolist()))[:4]}")
        return scale, minimum
    if scale.dtype != torch.float16 or minimum.dtype != torch.float16:
        scale, minimum = scale.float(), minimum.float()
        halves = scale.half(), minimum.half()
        if not all(torch.equal(half.float(), value) for half, value in zip(halves, (scale, minimum))):
            return scale, minimum
        scale, minimum = halves
    if torch.equal(minimum.float(), offset * scale.float()):
        return scale, torch.full((scale.shape[0], 1), offset, dtype=torch.float16)
    return scale, minimum


def _check_scales(out_features: int, in_features: int, scale: torch.Tensor, minimum: torch.Tensor) -> None:
    """A 4- or 5-bit layer's scales: float [out, in / 32] each, or the K form: float32 [out, 2, in / 256] (each
    super-block's d, then its dmin) and uint8 [out, 2, in / 32] (each group's 6-bit sc, then its m), the group's
    scale being d * sc and its minimum -(dmin * m), as GGUF's Q4_K and Q5_K dequantise."""
    groups = in_features // GROUP_SIZE
    if minimum.dtype == torch.uint8:
        if (in_features % 256 or scale.dtype != torch.float32 or tuple(scale.shape) != (out_features, 2, groups // 8)
                or tuple(minimum.shape) != (out_features, 2, groups)):
            raise ValueError(f"K-quant scales come as float32 [out, 2, in / 256] and uint8 [out, 2, in / 32]; got "
                             f"{tuple(scale.shape)} {scale.dtype} and {tuple(minimum.shape)} for {in_features} inputs")
    elif tuple(scale.shape) != (out_features, groups) or tuple(minimum.shape) not in (
            (out_features, groups), *([(out_features, 1)] if scale.dtype == minimum.dtype == torch.float16 else [])):
        raise ValueError(f"scales and minima must be [out, in / {GROUP_SIZE}] = {(out_features, groups)} (halves: the "
                         f"minima may be one offset a row, [out, 1]); got {tuple(scale.shape)} and "
                         f"{tuple(minimum.shape)}")


# A K-quant layer's scales as the kernels read them: one stream a row, a block of 40 bytes per sixteen groups (two
# super-blocks of 256 inputs): each group's sc (16 bytes), each group's m (16), the two super-blocks' d as halves (4),
# their dmin as halves (4); zero past the row. Read as four streams a row (sc, m, d and dmin apart), the scales made a
# layer read from memory a fifth to a quarter slower (docs/kernels.md, "K-quant scales as one stream").
K_BLOCK_GROUPS, K_BLOCK_BYTES = 16, 40


def _k_stream(super_scales: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """K-quant scales in their :func:`_check_scales` form (d and dmin float32 [out, 2, in / 256], sc and m uint8
    [out, 2, in / 32]) -> the stream the kernels read, uint8 [out, blocks, 40]. d and dmin must be halves, as GGUF
    stores them (the stream keeps them so)."""
    halves = super_scales.half()
    off_grid = halves.float() != super_scales
    if off_grid.any():
        raise ValueError(f"K-quant super-block scales (d, dmin) must be float16 values, as GGUF's Q4_K and Q5_K store "
                         f"them; {int(off_grid.sum())} are not (e.g. {super_scales[off_grid][0].item()!r})")
    out_features, _, groups = sub.shape
    blocks = -(-groups // K_BLOCK_GROUPS)
    padded_sub = torch.zeros(out_features, 2, blocks * K_BLOCK_GROUPS, dtype=torch.uint8)
    padded_sub[..., :groups] = sub
    padded_halves = torch.zeros(out_features, 2, blocks * 2, dtype=torch.float16)
    padded_halves[..., :groups // 8] = halves
    stream = torch.empty(out_features, blocks, K_BLOCK_BYTES, dtype=torch.uint8)
    for plane in (0, 1):  # sc and d, then m and dmin
        stream[..., 16 * plane:16 * plane + 16] = padded_sub[:, plane].reshape(out_features, blocks, 16)
        stream[..., 32 + 4 * plane:36 + 4 * plane] = (
            padded_halves[:, plane].reshape(out_features, blocks, 2).contiguous().view(torch.uint8))
    return stream


def _k_unstream(stream: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_k_stream`'s inverse: (d and dmin float32 [out, 2, groups / 8], sc and m uint8 [out, 2, groups])."""
    out_features = stream.shape[0]
    sub = torch.stack([stream[..., 16 * plane:16 * plane + 16].reshape(out_features, -1)[:, :groups]
                       for plane in (0, 1)], dim=1)
    halves = torch.stack([stream[..., 32 + 4 * plane:36 + 4 * plane].contiguous().view(torch.float16)
                          .reshape(out_features, -1)[:, :groups // 8] for plane in (0, 1)], dim=1)
    return halves.float(), sub


def _group_scales(scale: torch.Tensor, minimum: torch.Tensor | None, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 [out, groups] scales and minima from any of their forms (:func:`_check_scales`, the offset form of
    :func:`_scales_as_stored`, and the K-quant stream, ``minimum`` None)."""
    if minimum is None:
        scale, minimum = _k_unstream(scale, groups)
    if minimum.dtype != torch.uint8:
        if minimum.shape[-1] == 1 and scale.shape[-1] > 1:  # the offset form: every minimum offset * scale
            return scale.float(), scale.float() * minimum.float()
        return scale.float(), minimum.float()
    d, dmin = (scale[:, i].repeat_interleave(8, dim=1) for i in (0, 1))
    return d * minimum[:, 0].float(), -(dmin * minimum[:, 1].float())


def _k_unit_scales(scale: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """Q6_K's scale of each group of 16 inputs, float32 [out, in / 16]: each super-block's d (``scale`` [out, in / 256])
    times the group's signed sub-scale (``sub`` int8 [out, in / 16]), as the kernels form it."""
    return scale.repeat_interleave(16, dim=1) * sub.float()


def _nibble_levels(packed: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit levels [out, in / 2] -> [out, in / 32, 32] (byte i of a group: level i low, level i + 16 high)."""
    groups = packed.reshape(packed.shape[0], -1, GROUP_SIZE // 2)
    return torch.cat([groups & 15, groups >> 4], dim=-1)


class _GroupedLinear(nn.Module):
    """What the int4 and int8 layers share: float32 rows in, one kernel call, the bias, the input's shape back."""

    bits: int
    BUFFERS: tuple[str, ...]  # what the kernel reads, in its argument order (an instance may name more)
    q8_inputs = True

    def _multiply(self, rows: torch.Tensor, gemm: bool) -> torch.Tensor:  # [m, in] float32 -> [m, out] float32
        return kernels().linear(rows, [getattr(self, name) for name in self.BUFFERS], gemm, self.q8_inputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        rows = _rows(x, self.in_features)
        out = self._multiply(rows, _long(x))
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @property
    def k_form(self) -> bool:
        """Whether the scales are kept as K-quants keep them (a small integer per group, a float per 256 inputs)."""
        raise NotImplementedError

    def layout(self) -> tuple:
        """What a kernel call needs the same across layers it takes at once (:func:`stack_storage`)."""
        return (type(self), self.in_features, self.BUFFERS,
                *((getattr(self, name).dtype, tuple(getattr(self, name).shape[1:])) for name in self.BUFFERS[1:]))

    def extra_repr(self) -> str:
        form = (", K-quant scales" if self.k_form else "" if self.scale.dtype != torch.float16
                else ", half scales, symmetric" if getattr(self, "minimum", self.scale).shape[-1] == 1
                else ", half scales")
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} weights in groups "
                f"of {self.group_size}{form}, jointspec's CPU kernel")


class _GroupedNibbles(_GroupedLinear):
    """What the 4- and 5-bit layers share: groups of 32 inputs, a scale and a minimum per group in any of their forms
    (float32, halves, K-quant sub-scales: :func:`_check_scales`)."""

    group_size = GROUP_SIZE
    SYMMETRIC_OFFSET: float  # the minimum of a symmetric group, in scales: -8 at 4 bits (Q4_0), -16 at 5 (Q5_0)

    def _register_scales(self, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        if minimum.dtype == torch.uint8:  # the K form: one stream (K_BLOCK_BYTES), no minima apart
            self.register_buffer("scale", _k_stream(scale, minimum))
            self.register_buffer("minimum", None)
            self.BUFFERS = tuple(name for name in type(self).BUFFERS if name != "minimum")
            return
        scale, minimum = _scales_as_stored(scale.reshape(self.out_features, -1),
                                           minimum.reshape(self.out_features, -1), self.SYMMETRIC_OFFSET)
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("minimum", minimum.contiguous())

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only stand-in [out, in] (as :class:`~jointspec.kernels.quantize.Int4Linear` has), for code that
        reads ``.weight.shape``; :meth:`dequantized` gives the values."""
        return torch.empty(self.out_features, self.in_features, dtype=torch.uint8, device="meta")

    @property
    def k_form(self) -> bool:
        return self.minimum is None

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale and minimum, float32 [out, in / 32], whatever form they are kept in."""
        return _group_scales(self.scale, self.minimum, self.in_features // GROUP_SIZE)

    def _weight_of(self, levels: torch.Tensor) -> torch.Tensor:
        """[out, groups, 32] float levels -> the weight the kernel multiplies by, [out, in] float32."""
        scale, minimum = self.group_scales()
        return (levels * scale[..., None] + minimum[..., None]).reshape(self.out_features, -1)


class GroupedInt4Linear(_GroupedNibbles):
    """``y = x W^T + b``: W in 4-bit asymmetric groups of 32 inputs (scale and minimum per group), x float32. Built
    from a float ``nn.Linear`` (rounded onto the grid) or, with :meth:`from_levels`, from levels a file stores. The
    scales and minima are kept as halves where every one is a half (a file's Q4_0 / Q4_1, and this class's own
    rounding), in the K form for a file's K-quants (:func:`_check_scales`), else float32: the same floats, fewer bytes
    a step reads (:meth:`group_scales` gives them as float32)."""

    bits = 4
    SYMMETRIC_OFFSET = -8.0
    BUFFERS = ("packed", "scale", "minimum")

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, groups]
        scale = ((high - low) / 15).clamp_min(_TINY)
        # Scales and minima on the float16 grid, as llama.cpp's files keep them (so the layer reads them as halves),
        # unless a value would leave that grid's normal range (float32 then).
        half_scale, half_low = scale.half().float(), low.half().float()
        if (half_scale >= 2 ** -14).all() and torch.isfinite(half_scale).all() and torch.isfinite(half_low).all():
            scale, low = half_scale, half_low
        levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        self._set(levels.reshape(out_features, in_features), scale, low,
                  None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_levels(cls, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None = None) -> GroupedInt4Linear:
        """W = levels * scale + minimum: ``packed`` uint8 [out, in / 2] (byte i of a group of 32: level i in the low
        nibble, level i + 16 in the high one; kept as given, not copied), ``scale`` and ``minimum`` [out, in / 32];
        or, in the K form (:func:`_check_scales`), a K-quant's scales as the file keeps them."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        if packed.dim() != 2 or packed.dtype != torch.uint8:
            raise ValueError(f"4-bit levels must come packed, uint8 [out, in / 2]; got {tuple(packed.shape)} "
                             f"{packed.dtype}")
        _check_scales(packed.shape[0], 2 * packed.shape[1], scale, minimum)
        layer._set_packed(packed, scale, minimum, bias)
        return layer

    def _set(self, levels: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None):
        out_features, in_features = levels.shape
        groups = levels.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        half = GROUP_SIZE // 2
        # Byte i of a group: level i in the low nibble, level i + 16 in the high one (what the kernel unpacks).
        packed = (groups[..., :half] | (groups[..., half:] << 4)).reshape(out_features, in_features // 2)
        self._set_packed(packed, scale, minimum, bias)

    def _set_packed(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
        self.in_features, self.out_features = 2 * packed.shape[1], packed.shape[0]
        self.register_buffer("packed", packed.contiguous())
        self._register_scales(scale, minimum)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32."""
        return self._weight_of(_nibble_levels(self.packed).float())  # levels [out, groups, 32]


class GroupedInt5Linear(_GroupedNibbles):
    """``y = x W^T + b``: W in 5-bit asymmetric groups of 32 inputs (scale and minimum per group), x float32: GGUF's
    Q5_0, Q5_1 and Q5_K blocks as stored. The low four bits of each level are packed as
    :class:`GroupedInt4Linear`'s, the fifth bits of a group's 32 levels make one 32-bit word (bit i: level i). Built
    only from a file's levels (:meth:`from_levels`); jointspec's own quantiser writes 4 or 8 bits."""

    bits = 5
    SYMMETRIC_OFFSET = -16.0
    BUFFERS = ("packed", "fifth", "scale", "minimum")

    @classmethod
    def from_levels(cls, packed: torch.Tensor, fifth: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None = None) -> GroupedInt5Linear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        out_features, in_features = packed.shape[0], 2 * packed.shape[1]
        groups = in_features // GROUP_SIZE
        if packed.dtype != torch.uint8 or fifth.shape != (out_features, groups) or fifth.dtype != torch.int32:
            raise ValueError(f"5-bit levels come as packed uint8 [out, in / 2] with int32 fifth bits [out, in / "
                             f"{GROUP_SIZE}]")
        _check_scales(out_features, in_features, scale, minimum)
        layer.in_features, layer.out_features = in_features, out_features
        layer.register_buffer("packed", packed.contiguous())
        layer.register_buffer("fifth", fifth.contiguous())
        layer._register_scales(scale, minimum)
        layer.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        return layer

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32."""
        bits = (self.fifth.long()[..., None] >> torch.arange(GROUP_SIZE)) & 1  # [out, groups, 32]
        return self._weight_of((_nibble_levels(self.packed).long() + 16 * bits).float())


class GroupedInt8Linear(_GroupedLinear):
    """``y = x W^T + b``: W in signed 8-bit symmetric groups of 32 inputs (a scale per group), x rounded to 8 bits per
    group as for the 4-bit layers (``q8_inputs``; the screened head keeps float inputs). Built from a float
    ``nn.Linear`` or, with :meth:`from_levels`, from levels a file stores (groups of 32 or 16: GGUF's Q6_K keeps a
    scale per 16 inputs)."""

    bits = 8
    BUFFERS = ("levels", "scale")  # and "sub" in the K form (the instance's BUFFERS say so)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        scale = (groups.abs().amax(dim=-1) / 127).clamp_min(_TINY)  # [out, groups]
        levels = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
        self._set(levels.reshape(out_features, in_features), scale,
                  None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_levels(cls, levels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    sub: torch.Tensor | None = None) -> GroupedInt8Linear:
        """W = levels * scale: ``levels`` [out, in] int8, ``scale`` [out, in / 32] or [out, in / 16]; or, with
        ``sub``, the K form (GGUF's Q6_K as the file keeps it): ``scale`` float32 [out, in / 256] and ``sub`` int8
        [out, in / 16], the scale of inputs 16u .. 16u + 15 being scale[u / 16] * sub[u]."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        if sub is not None:
            out_features, in_features = levels.shape
            if (in_features % 256 or sub.dtype != torch.int8 or tuple(sub.shape) != (out_features, in_features // 16)
                    or scale.dtype != torch.float32 or tuple(scale.shape) != (out_features, in_features // 256)):
                raise ValueError(f"K-quant 8-bit scales come as float32 [out, in / 256] and int8 [out, in / 16]; "
                                 f"got {tuple(scale.shape)} {scale.dtype} and {tuple(sub.shape)} {sub.dtype}")
            layer._set(levels.to(torch.int8), scale, bias)
            layer.register_buffer("sub", sub.contiguous())
            layer.BUFFERS = ("levels", "scale", "sub")
            return layer
        if levels.dim() != 2 or scale.dim() != 2 or levels.shape[1] not in (16 * scale.shape[1], 32 * scale.shape[1]):
            raise ValueError(f"8-bit levels [out, in] need scales [out, in / 32] or [out, in / 16], got "
                             f"{tuple(levels.shape)} and {tuple(scale.shape)}")
        layer._set(levels.to(torch.int8), scale, bias)
        return layer

    def _set(self, levels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = levels.shape
        self.register_buffer("levels", levels.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @property
    def k_form(self) -> bool:
        return "sub" in self.BUFFERS

    @property
    def group_size(self) -> int:
        return 16 if self.k_form else self.in_features // self.scale.shape[1]

    def unit_scales(self, rows: slice = slice(None)) -> torch.Tensor:
        """The scale of each group of ``group_size`` inputs, float32 [out, in / group_size] (only ``rows``)."""
        if not self.k_form:
            return self.scale[rows]
        return _k_unit_scales(self.scale[rows], self.sub[rows])

    @property
    def weight(self) -> torch.Tensor:
        """The int8 levels [out, in] (as :class:`~jointspec.kernels.quantize.Int8Linear` has): code that reads
        ``.weight.shape`` works, code that wants floats sees ints; :meth:`dequantized` gives the values."""
        return self.levels

    def dequantized(self, rows: slice = slice(None)) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32 (only ``rows`` of it, if given)."""
        return eight_weight(self.levels[rows], self.scale[rows], self.sub[rows] if self.k_form else None)



def pack_six(levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed 6-bit levels (-32..31) int8 [out, in] -> (packed uint8 [out, in / 2], plane uint8 [out, in / 4]): the
    kernel's 6-bit storage (``csrc/simd.h``, ``pair_levels6``). Each level is stored plus 32 (0..63): its low four bits
    packed as a 4-bit layer's, its top two in the plane, whose byte j of a pair of groups (64 inputs) holds those of
    group 0's input j, group 1's input j, group 0's input j + 16 and group 1's input j + 16 (bits 0-1, 2-3, 4-5,
    6-7)."""
    out_features, in_features = levels.shape
    if levels.dtype != torch.int8 or in_features % 64:
        raise ValueError(f"6-bit levels must be int8 [out, in] with in a multiple of 64, got {tuple(levels.shape)} "
                         f"{levels.dtype}")
    if int(levels.min()) < -32 or int(levels.max()) > 31:
        raise ValueError(f"6-bit levels must lie in -32..31, got {int(levels.min())}..{int(levels.max())}")
    # [out, pairs, group of the pair, input]: each level plus 32
    stored = (levels.to(torch.int16) + 32).to(torch.uint8).reshape(out_features, -1, 2, GROUP_SIZE)
    packed = (stored[..., :16] & 15) | ((stored[..., 16:] & 15) << 4)
    top = stored >> 4
    plane = top[..., 0, :16] | (top[..., 1, :16] << 2) | (top[..., 0, 16:] << 4) | (top[..., 1, 16:] << 6)
    return packed.reshape(out_features, in_features // 2), plane.reshape(out_features, in_features // 4)


def unpack_six(packed: torch.Tensor, plane: torch.Tensor) -> torch.Tensor:
    """:func:`pack_six`'s inverse: the signed levels, int8 [out, in]."""
    out_features, pairs = packed.shape[0], packed.shape[1] // 32  # sizes, not -1: zero rows are a valid lookup
    nibbles = packed.reshape(out_features, pairs, 2, 16)
    top = plane.reshape(out_features, pairs, 1, 16)
    low = (nibbles & 15) | (((top >> torch.tensor([[0], [2]], dtype=torch.uint8)) & 3) << 4)   # inputs 0-15
    high = (nibbles >> 4) | (((top >> torch.tensor([[4], [6]], dtype=torch.uint8)) & 3) << 4)  # inputs 16-31
    stored = torch.cat([low, high], dim=-1).reshape(out_features, 64 * pairs)
    return (stored.to(torch.int16) - 32).to(torch.int8)


def eight_weight(levels: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [out, in] of signed 8-bit levels (int8 [out, in]) with a float32 scale per group (``scale``
    [out, groups]) or in the K form (``scale`` float32 [out, in / 256], ``sub`` int8 [out, in / 16]): what
    :class:`GroupedInt8Linear` multiplies by, without building one (an embedding looks up a few rows every step)."""
    unit_scales = scale if sub is None else _k_unit_scales(scale, sub)  # [out, in / group size]
    out_features, in_features = levels.shape
    groups = unit_scales.shape[1]
    levels = levels.reshape(out_features, groups, in_features // groups).float()  # sizes, not -1: no rows is [0, in]
    return levels.mul_(unit_scales[..., None]).reshape(out_features, in_features)  # in place: one copy


def six_weight(packed: torch.Tensor, plane: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] of 6-bit levels (:func:`pack_six`) with Q6_K's scales (``scale`` float32 [out,
    in / 256], ``sub`` int8 [out, in / 16]): what :class:`GroupedInt6Linear` multiplies by, without building one (an
    embedding looks up a few rows of it every step)."""
    levels = unpack_six(packed, plane)
    out_features, in_features = levels.shape
    unit_scales = _k_unit_scales(scale, sub)  # [out, in / 16]
    levels = levels.reshape(out_features, in_features // 16, 16).float()  # sizes, not -1, as unpack_six
    return levels.mul_(unit_scales[..., None]).reshape(out_features, in_features)


class GroupedInt6Linear(_GroupedLinear):
    """``y = x W^T + b``: GGUF's Q6_K at its own size. W = level * scale with signed 6-bit levels and Q6_K's scales
    (:class:`GroupedInt8Linear`'s K form: a signed sub-scale per 16 inputs, a float32 per 256), the levels stored in
    6 bits (:func:`pack_six`) rather than 8: 6.6 bits a weight instead of 8.6, for the same products bit for bit
    (the kernel takes the same integers and scales through the same operations). Built from a file's levels
    (:meth:`from_levels`) or from an 8-bit K-form layer's (:meth:`from_int8`)."""

    bits = 6
    group_size = 16
    BUFFERS = ("packed", "plane", "scale", "sub")

    @classmethod
    def from_levels(cls, packed: torch.Tensor, plane: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor,
                    bias: torch.Tensor | None = None) -> GroupedInt6Linear:
        """``packed`` uint8 [out, in / 2] and ``plane`` uint8 [out, in / 4] (:func:`pack_six`; kept as given, not
        copied), ``scale`` float32 [out, in / 256], ``sub`` int8 [out, in / 16]."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        out_features, in_features = packed.shape[0], 2 * packed.shape[1]
        shapes = {"packed": (packed, torch.uint8, (out_features, in_features // 2)),
                  "plane": (plane, torch.uint8, (out_features, in_features // 4)),
                  "scale": (scale, torch.float32, (out_features, in_features // 256)),
                  "sub": (sub, torch.int8, (out_features, in_features // 16))}
        for name, (tensor, dtype, shape) in shapes.items():
            if in_features % 256 or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"6-bit {name} must be {dtype} {shape} for {in_features} inputs (a multiple of "
                                 f"256), got {tensor.dtype} {tuple(tensor.shape)}")
        layer.out_features, layer.in_features = out_features, in_features
        for name, (tensor, _, _) in shapes.items():
            layer.register_buffer(name, tensor.contiguous())
        layer.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        return layer

    @classmethod
    def from_int8(cls, layer: GroupedInt8Linear) -> GroupedInt6Linear:
        """The same weights as a K-form 8-bit layer whose levels fit in 6 bits (GGUF's Q6_K), in 6 bits."""
        if not layer.k_form:
            raise ValueError("only a K-form 8-bit layer (GGUF's Q6_K scales) has a 6-bit form")
        return cls.from_levels(*pack_six(layer.levels), layer.scale, layer.sub, layer.bias)

    @property
    def k_form(self) -> bool:
        return True

    def signed_levels(self, rows: slice = slice(None)) -> torch.Tensor:
        """The levels, int8 [out, in] (only ``rows``)."""
        return unpack_six(self.packed[rows], self.plane[rows])

    def unit_scales(self, rows: slice = slice(None)) -> torch.Tensor:
        """The scale of each group of 16 inputs, float32 [out, in / 16] (only ``rows``)."""
        return _k_unit_scales(self.scale[rows], self.sub[rows])

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only stand-in [out, in] (as the 4-bit layers have), for code that reads ``.weight.shape``;
        :meth:`dequantized` gives the values."""
        return torch.empty(self.out_features, self.in_features, dtype=torch.int8, device="meta")

    def dequantized(self, rows: slice = slice(None)) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32 (only ``rows`` of it, if given)."""
        return six_weight(self.packed[rows], self.plane[rows], self.scale[rows], self.sub[rows])


# The grouped layer classes the kernels take as projections (fused calls, the compiled decoder layer).
GROUPED_LINEARS = (GroupedInt4Linear, GroupedInt5Linear, GroupedInt6Linear, GroupedInt8Linear)


# The greedy screen's margin, in logits: every token whose 4-bit score is within this of the row's best score gets
# its exact logit. On SmolLM2-135M the screen's error is about 1 logit (one standard deviation), and teacher-forced
# on bench answers and ShareGPT text no exact argmax was screened out at this margin, while a row keeps a few dozen
# exact logits on average (docs/kernels.md, "The screened head", has the counts per margin). Tokens 6 logits under
# the best have under 1/400 of its probability: only near-ties are ever in question.
SCREEN_MARGIN = 6.0
# At most this many exact logits a row (the best scores within the margin): a flat row, as random tokens give, would
# otherwise have thousands (and the cost curve, timed on random tokens, would price verification far too high). On
# the same positions caps down to half this changed no argmax; smaller ones did (docs/kernels.md).
SCREEN_MAX_EXACT = 128
# Sampling with top-k reads each row's k largest logits only (core/sampling.py): the screen then completes the exact
# logit of every token within SCREEN_MARGIN of the row's k-th best score, at most SCREEN_EXACT_PER_RANK * k of them (the
# best scores). Past the k-th best the scores crowd, so the cap, not the margin, decides what is kept; at this cap the
# exact top k was kept whole at every position measured, and at half of it not (docs/kernels.md, "Sampling with a
# top-k reads the screen too"). Up to SCREEN_TOP_K_MAX; a larger k reads the exact head.
SCREEN_EXACT_PER_RANK = 32
SCREEN_TOP_K_MAX = 64
# The screen is built from the exact weights this many at a time (rows x inputs, float32: 4 MB a block).
SCREEN_BLOCK_ELEMENTS = 1 << 20


def _largest_magnitude(values: torch.Tensor, dim: int) -> torch.Tensor:
    """``values.abs().amax(dim)`` without the absolute values' copy: the larger of max and -min (the same numbers)."""
    return torch.maximum(values.amax(dim=dim), values.amin(dim=dim).neg_())


class ScreenedInt8Head(GroupedInt8Linear):
    """An int8 output head (:class:`GroupedInt8Linear`, same weights, same logits) that greedy decoding can read
    through a 4-bit screen: :meth:`argmax_logits` scores the whole vocabulary from a 4-bit copy of the weights (half
    the bytes, integer products; ``csrc/grouped_linear.cpp``, ``screened_head``) and computes the exact int8 logit
    only for tokens within :data:`SCREEN_MARGIN` of each row's best score (at most :data:`SCREEN_MAX_EXACT`, the
    best-scoring).

    Why: on the int4 SmolLM2 the head's 32 MB are read from memory on every step, evicted by the layers' weights,
    and cost a large share of a step, which the screen's half-size integer pass cuts (docs/kernels.md). Its rows'
    argmax is the exact head's wherever that token's score is within the margin of the best (every position
    measured; not guaranteed), and each row's result depends on that row alone, so plain and speculative greedy
    decoding read the same tokens. Sampling with a top-k of at most :data:`SCREEN_TOP_K_MAX` reads
    :meth:`top_k_logits` likewise, exact for the tokens near the row's k-th best score; sampling with temperature
    alone draws its token through the screen (:meth:`draw_tokens`, the Gumbel-max trick); other sampling, perplexity
    and every other caller use :meth:`forward`: the exact logits.
    """

    # The logits greedy decoding's screen completes are computed on float inputs; the head's own logits are too, so
    # that they are the same numbers (sampling and perplexity read these).
    q8_inputs = False
    # Exact logits a row per rank of a top-k (top_k_logits); an instance may narrow it (tests make the screen miss).
    exact_per_rank = SCREEN_EXACT_PER_RANK

    def __init__(self, linear: nn.Linear, margin: float = SCREEN_MARGIN, max_exact: int = SCREEN_MAX_EXACT) -> None:
        super().__init__(linear)
        self._screen(margin, max_exact)

    @classmethod
    def from_int8(cls, layer: GroupedInt8Linear, margin: float = SCREEN_MARGIN,
                  max_exact: int = SCREEN_MAX_EXACT) -> ScreenedInt8Head:
        """The screened head over ``layer``'s own levels and scales (a file's, for instance), shared, not copied: a
        K-form head (GGUF's Q6_K) keeps its per-16 sub-scales rather than a float32 scale per 16 inputs (two bits a
        weight more, tens of MB for a 128k-token vocabulary)."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head._set(layer.levels, layer.scale, layer.bias)
        if layer.k_form:
            head.register_buffer("sub", layer.sub)
            head.BUFFERS = layer.BUFFERS
        head._screen(margin, max_exact)
        return head

    def _screen(self, margin: float, max_exact: int) -> None:
        if self.bias is not None or self.in_features % 64:
            raise ValueError("the screened head needs a bias-free head with in_features a multiple of 64")
        # The exact weights (what the int8 kernel multiplies by), a block of rows at a time: the whole float head
        # would be several times the int8 one at once (a 1B model's vocabulary: a gigabyte). The blocks are small and
        # the heap is trimmed after each: the screen is built last in a load, at its peak of resident memory.
        step = max(64, SCREEN_BLOCK_ELEMENTS // self.in_features)
        blocks = [slice(start, start + step) for start in range(0, self.out_features, step)]
        # Columns equalised before rounding (x is multiplied back): a few of SmolLM2's hidden channels hold weights
        # 3-4x the median, which would set every row's scale; the square root halves that spread (error 1.4 -> 1.0).
        # Every step in place or as a reduction: a block's float copy is the only one, which sets the peak of a load
        # whose head is screened.
        column = torch.zeros(self.in_features)
        for rows in blocks:
            block = self.dequantized(rows)
            column = torch.maximum(column, _largest_magnitude(block, dim=0))
            del block
            release_freed_memory()
        column = column.clamp_min(_TINY).sqrt()
        screen4 = torch.empty(self.out_features, self.in_features // 2, dtype=torch.uint8)
        row_scale = torch.empty(self.out_features)
        for rows in blocks:
            equalised = self.dequantized(rows).div_(column)
            row_scale[rows] = (_largest_magnitude(equalised, dim=1) / 7).clamp_min(_TINY)
            levels = equalised.div_(row_scale[rows][:, None]).round_().clamp_(-8, 7).add_(8).to(torch.uint8)  # 0..15
            chunks = levels.reshape(len(levels), -1, 64)
            # Byte b of a 64-input chunk: input b in the low nibble, input b + 32 in the high one (what the kernel
            # reads).
            screen4[rows] = (chunks[..., :32] | (chunks[..., 32:] << 4)).reshape(len(levels), -1)
            del equalised, levels, chunks
            release_freed_memory()
        self.register_buffer("screen4", screen4)
        self.register_buffer("screen_scale", row_scale)
        self.register_buffer("column", column.contiguous())
        self.margin = float(margin)
        self.max_exact = int(max_exact)

    def argmax_logits(self, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits whose rows' argmax is what greedy decoding reads: the 4-bit screen's scores, with the exact logit
        for every token within the margin of its row's best score. [..., in] -> [..., out]. ``allowed`` (bool, one
        row of ``out`` a row of ``x``; structured output): the other tokens are minus infinity, and the best score
        and the tokens near it are the allowed tokens' alone."""
        return self._screened_logits(x, 1, allowed)

    def top_k_logits(self, x: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits whose rows' ``k`` largest are what sampling with top-k reads: the 4-bit screen's scores, with the
        exact logit for every token within the margin of its row's k-th best score (at most ``exact_per_rank`` * k of
        them, the best-scoring). Where the margin decides, every other entry is a score at least a margin below the
        k-th best, and top-k keeps exact logits only, the same bits :meth:`forward` gives them; where the cap
        decides, scores past it may still be near the k-th best (not guaranteed exact, as the greedy screen's
        argmax is not: docs/kernels.md has how often). Each row depends on that row alone. [..., in] -> [..., out].
        ``allowed``: as for :meth:`argmax_logits`, the top k of the allowed tokens."""
        if not 1 <= k <= SCREEN_TOP_K_MAX:
            raise ValueError(f"the screen completes the top k for k in [1, {SCREEN_TOP_K_MAX}], got {k}; read "
                             "the exact head (forward) for a larger k")
        return self._screened_logits(x, k, allowed)

    def draw_tokens(self, x: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                    margin: float | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """A token per row of ``x`` ([rows, in]) drawn from softmax(logits / temperature) by the Gumbel-max trick
        through the screen (``screened_draws`` in csrc/grouped_linear.cpp): exact logits only for the tokens whose
        perturbed score comes within the margin of the best, the noise drawn top down and keyed by each row's
        ``keys`` entry (int64), so a row's draw depends on its key and its own logits alone. The winner is the exact
        head's Gumbel-max winner wherever the screen's error is under half the margin (as for greedy rows).
        ``temperature``: float32 [rows]. ``margin`` (logits; default the screen's): a very large one makes every
        logit exact (the definition the tests hold the screen to). ``allowed`` (bool [rows, out]; structured output):
        each row draws from softmax over its allowed tokens. A row with no finite perturbed score (a NaN row, or
        nothing allowed) gets -1."""
        rows = _rows(x, self.in_features)
        return kernels().screened_draws(rows, self.screen4, self.screen_scale, self.column,
                                        [getattr(self, name) for name in self.BUFFERS],
                                        self.margin if margin is None else float(margin),
                                        temperature.float().contiguous(), keys.long().contiguous(),
                                        self._allowed_rows(allowed, len(rows)))

    def _screened_logits(self, x: torch.Tensor, rank: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
        rows = _rows(x, self.in_features)
        max_exact = self.max_exact if rank == 1 else max(rank, self.exact_per_rank * rank)
        out = kernels().screened_head(rows, self.screen4, self.screen_scale, self.column,
                                      [getattr(self, name) for name in self.BUFFERS], self.margin, max_exact, rank,
                                      self._allowed_rows(allowed, len(rows)))
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _allowed_rows(self, allowed: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
        """A grammar's allowed tokens as the kernels take them: contiguous bool [rows, out] (None: no grammar)."""
        if allowed is None:
            return None
        return allowed.to(torch.bool).reshape(num_rows, self.out_features).contiguous()

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", greedy and top-k sampling read through a 4-bit screen (margin "
                                       f"{self.margin:g} logits)")


class ScreenedInt6Head(GroupedInt6Linear, ScreenedInt8Head):
    """:class:`ScreenedInt8Head` over a 6-bit head (GGUF's Q6_K at its own size, :class:`GroupedInt6Linear`): the
    same screen, and the same exact logits as the head's 8-bit K form would give, from a quarter fewer bytes."""

    @classmethod
    def from_int6(cls, layer: GroupedInt6Linear, margin: float = SCREEN_MARGIN,
                  max_exact: int = SCREEN_MAX_EXACT) -> ScreenedInt6Head:
        """The screened head over ``layer``'s own storage, shared, not copied."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.out_features, head.in_features = layer.out_features, layer.in_features
        for name in cls.BUFFERS:
            head.register_buffer(name, getattr(layer, name))
        head.register_buffer("bias", layer.bias)
        head._screen(margin, max_exact)
        return head

# Fused calls. The kernel computes every output row by the same instructions whatever the other rows of the call, so
# one call over the stacked weights of several layers that read the same input (a Llama layer's q/k/v, its gate/up)
# gives each layer's output bit for bit. One call instead of three or two saves the per-call cost, which inside a
# forward is large (module docstring): a few per cent of an int4 step on SmolLM2-135M (docs/kernels.md).
# :func:`stack_storage` lays such layers' buffers out back to back in one tensor
# (each layer keeps views, so nothing is stored twice and the layers still work alone); :class:`FusedCall` then
# makes the one call (the lean forward, backends/lean_forward.py, builds one per layer where it finds them so laid out).
def _stackable(layers: list[nn.Module]) -> bool:
    """Two or more bias-free grouped layers of one class, one input width and one group size."""
    kinds = {type(layer) for layer in layers}
    return (len(layers) >= 2 and len(kinds) == 1 and kinds <= set(GROUPED_LINEARS)
            and all(layer.bias is None for layer in layers) and len({layer.layout() for layer in layers}) == 1)


def kernel_arguments(layer: nn.Module) -> list[torch.Tensor]:
    """A grouped layer's buffers in the order the compiled kernels take them (4 bits: packed, scale, minimum, or
    packed and the K-quant scale stream; 8 bits: levels, scale; then its bias, if it has one)."""
    return [getattr(layer, name) for name in layer.BUFFERS] + ([] if layer.bias is None else [layer.bias])


def stack_storage(layers: list[nn.Module]) -> bool:
    """Put ``layers``' (one grouped class, same in_features and group size, no bias) buffers back to back in one
    tensor each, leaving every layer with views into it; returns whether it did (other layers are left alone)."""
    if not _stackable(layers):
        return False
    for name in layers[0].BUFFERS:
        stacked = torch.cat([getattr(layer, name) for layer in layers]).contiguous()
        start = 0
        for layer in layers:
            setattr(layer, name, stacked[start:start + layer.out_features])
            start += layer.out_features
    return True


class FusedCall:
    """One kernel call for several :class:`GroupedInt4Linear` layers that :func:`stack_storage` laid out back to back
    and that read the same input; returns each layer's output, bit for bit what calling it alone gives. Build it
    with :meth:`maybe` (None where the layers are not so laid out). It remembers the layers and buffers it was built
    from; :meth:`valid` says whether they are still the model's (a replaced layer or a moved buffer: call them one by
    one instead)."""

    def __init__(self, layers: list[nn.Module], spans: tuple[torch.Tensor, ...]) -> None:
        self.layers = list(layers)
        self.names = layers[0].BUFFERS
        self._buffers = [[layer._buffers[name] for name in self.names] for layer in layers]
        self.spans = spans
        self.sizes = [layer.out_features for layer in layers]
        self.in_features = layers[0].in_features

    @classmethod
    def maybe(cls, layers: list[nn.Module]) -> FusedCall | None:
        if not _stackable(layers) or kernels() is None:
            return None
        spans = []
        for name in layers[0].BUFFERS:
            tensors = [getattr(layer, name) for layer in layers]
            first = tensors[0]
            storage = first.untyped_storage().data_ptr()
            offset = first.storage_offset()
            for tensor in tensors:
                if (tensor.untyped_storage().data_ptr() != storage or tensor.storage_offset() != offset
                        or not tensor.is_contiguous() or tensor.shape[1:] != first.shape[1:]):
                    return None
                offset += tensor.numel()
            rows = sum(tensor.shape[0] for tensor in tensors)
            spans.append(first.as_strided((rows, *first.shape[1:]), first.stride()))
        return cls(layers, tuple(spans))

    def valid(self, layers: list[nn.Module]) -> bool:
        return all(layer is mine and all(layer._buffers[name] is buffer for name, buffer in zip(self.names, buffers))
                   for layer, mine, buffers in zip(layers, self.layers, self._buffers))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = _rows(x, self.in_features)
        out = kernels().linear(rows, list(self.spans), _long(x), True)
        out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
        return list(out.split(self.sizes, dim=-1))
