"""Two builds of jointspec's grouped kernels in one process, on the same weights and inputs: time per call of each.

For a change to the C++ kernels (``src/jointspec/kernels/csrc``): build the old sources into one cache and the new
into another, then compare them here. Both builds are loaded side by side (their module names carry the sources'
hash, so they do not collide) and their calls alternate, so a machine whose speed drifts between processes (the VMs
this project measures on drift by 10-30 %) slows both alike. Random 4-bit layers of ``--shape`` OUTxIN in three scale
forms (the K-quant form, Q4_0's half scales with the -8 offset, Q4_1's halves), 1, 2, 4 and 8 input rows (or
``--rows``); a layer that fits in cache measures the kernel's compute, one of a few tens of MB its streaming. With
``--model`` it times whole forwards instead (a decoding step, or a verification of ``--rows`` rows), each build on
its own copy of the model: what a change is worth where every layer's weights come after the others' through memory.
Prints medians and the ratio new / old per case, then one JSON line::

    git worktree add /tmp/old HEAD          # the sources before the change
    PYTHONPATH=/tmp/old/src XDG_CACHE_HOME=/tmp/oldcache JOINTSPEC_KERNEL_ISA=avx2 \\
        python -c "from jointspec.kernels.grouped import kernels; kernels()"
    python benchmarks/kernel_builds_ab.py --isa avx2 --old-cache /tmp/oldcache --shape 2048x2048 --threads 1
    python benchmarks/kernel_builds_ab.py --isa avx2 --old-cache /tmp/oldcache --model default --rows 1,4 --threads 2

The new build is this checkout's (built first where it is not yet); ``--new-cache`` takes the newest build under
another cache instead. A cache collects builds of many sources (each checkout's, each edit's), so the old cache
should hold only the build to compare against; both builds' folders are printed.

With ``--old-isa`` and no ``--old-cache`` the two builds are two instruction sets of this checkout's sources: what a
build is worth against the one below it on this CPU::

    python benchmarks/kernel_builds_ab.py --old-isa avx2 --isa avx2vnni --model default
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path


def load_build(cache: Path | None, isa: str):
    """The newest ``isa`` build under ``cache`` (an XDG cache directory), imported as a module; with ``cache`` None,
    this checkout's own ``isa`` build (made first where it is not yet)."""
    if cache is None:
        from jointspec.kernels.grouped import build_folder, kernels, unavailable_reason

        module = kernels(isa)
        if module is None:
            raise SystemExit(f"this checkout's {isa} build cannot run here: {unavailable_reason(isa)}")
        print(f"{isa}: {build_folder(isa)} (this checkout's sources)", flush=True)
        return module
    found = sorted((cache / "jointspec" / "kernels").glob(f"jointspec_kernels_{isa}_*/*.so"),
                   key=lambda path: path.stat().st_mtime)
    if not found:
        raise SystemExit(f"no {isa} build under {cache}/jointspec/kernels: build it first (see --help)")
    print(f"{isa}: {found[-1].parent} (the newest of {len(found)} under {cache})", flush=True)
    spec = importlib.util.spec_from_file_location(found[-1].name.split(".")[0], found[-1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "use_widened_keys"):  # as jointspec sets it when it loads a build ($JOINTSPEC_KERNEL_WIDEN_KEYS)
        from jointspec.kernels.grouped import widen_keys_setting

        module.use_widened_keys(widen_keys_setting())
    return module


def layers(out_features: int, in_features: int, generator):
    import torch

    from jointspec.kernels.grouped import GroupedInt4Linear

    packed = torch.randint(0, 256, (out_features, in_features // 2), generator=generator, dtype=torch.uint8)
    groups = in_features // 32
    half = (torch.rand(out_features, groups, generator=generator) * 0.01 + 1e-3).half()
    made = {"Q4_0": GroupedInt4Linear.from_levels(packed, half, half.float() * -8),
            "Q4_1": GroupedInt4Linear.from_levels(packed, half, (torch.rand(out_features, groups, generator=generator)
                                                                 * -0.1).half())}
    if in_features % 256 == 0:
        super_scales = (torch.rand(out_features, 2, in_features // 256, generator=generator) * 0.01).half().float()
        sub = torch.randint(0, 64, (out_features, 2, groups), generator=generator, dtype=torch.uint8)
        made["K"] = GroupedInt4Linear.from_levels(packed, super_scales, sub)
    return made


def time_layers(builds: dict, args) -> dict:
    """Each scale form's random layer of ``--shape``, every ``--rows``: µs a call of each build."""
    import torch

    from jointspec.kernels.grouped import kernel_arguments

    out_features, in_features = (int(value) for value in args.shape.lower().split("x"))
    if in_features % 64:
        raise SystemExit(f"--shape: IN must be a multiple of 64, got {in_features}")
    generator = torch.Generator().manual_seed(0)
    results = {}
    for form, layer in layers(out_features, in_features, generator).items():
        tensors = kernel_arguments(layer)
        for rows in (int(value) for value in args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=generator)
            if not torch.equal(*(build.linear(x, tensors, False, True) for build in builds.values())):
                print(f"note: {form}, {rows} rows: the two builds' outputs differ (a change of arithmetic)")
            times = {name: [] for name in builds}
            for call in range(args.calls + 10):
                for name in (("old", "new") if call % 2 == 0 else ("new", "old")):
                    start = time.perf_counter()
                    builds[name].linear(x, tensors, False, True)
                    if call >= 10:
                        times[name].append(time.perf_counter() - start)
            results[f"{form}/{rows}"] = report(f"{form:5} {rows} rows", times, 1e6, "us")
    return results


def time_model(builds: dict, args) -> dict:
    """Whole forwards of ``--model`` (loaded once per build, ``--quantize auto``) after ``--context`` tokens: ms a
    forward of each build, greedy (the screened head where the model has one), as a decoding step or a verification
    of ``--rows`` rows runs it. A layer timed alone is read from cache more than inside a model, where each layer's
    weights follow the others' through memory: the gains the two measure can differ (docs/kernels.md)."""
    import random

    import torch

    from jointspec.backends.loading import load_model
    from jointspec.kernels.grouped import forced_build, inputs_setting

    generator = random.Random(0)
    prompt = [generator.randrange(1000) for _ in range(args.context)]
    models = {}
    for name, build in builds.items():
        build.use_q8_inputs(inputs_setting() == "q8")
        with forced_build(build):
            target, _ = load_model(**({} if args.model == "default" else {"source": args.model}), quantize="auto")
            target.forward(prompt, num_logits=0)
        models[name] = (target, build, target.num_cached)
    results = {}
    for rows in (int(value) for value in args.rows.split(",")):
        ids = [generator.randrange(1000) for _ in range(rows)]
        logits = []
        for target, build, cached in models.values():
            with forced_build(build):
                logits.append(target.forward(ids, num_logits=rows).logits)
            target.crop(cached)
        if not torch.equal(*logits):
            print(f"note: {rows} rows: the two builds' logits differ (a change of arithmetic)")
        times = {name: [] for name in builds}
        for call in range(args.calls + 5):
            for name in (("old", "new") if call % 2 == 0 else ("new", "old")):
                target, build, cached = models[name]
                with forced_build(build):
                    start = time.perf_counter()
                    target.forward(ids, num_logits=rows, argmax_only=True)
                    elapsed = time.perf_counter() - start
                target.crop(cached)
                if call >= 5:
                    times[name].append(elapsed)
        results[f"model/{rows}"] = report(f"{rows} rows", times, 1e3, "ms")
    return results


def report(label: str, times: dict, scale: float, unit: str) -> dict:
    old, new = (statistics.median(times[name]) * scale for name in ("old", "new"))
    print(f"{label}: old {old:8.2f} {unit}  new {new:8.2f} {unit}  new / old {new / old:.3f}", flush=True)
    return {f"old_{unit}": round(old, 3), f"new_{unit}": round(new, 3), "ratio": round(new / old, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", required=True,
                        help="the build to compare: avx512vnni, avx512, avx2vnni, avx2 or portable")
    parser.add_argument("--old-isa", default=None,
                        help="the old build's instruction set, where it is not --isa's (then --isa names the new one)")
    parser.add_argument("--old-cache", type=Path, default=None,
                        help="XDG cache directory holding the old build (its newest; required without --old-isa)")
    parser.add_argument("--new-cache", type=Path, default=None,
                        help="XDG cache directory whose newest build is the new one (default: this checkout's build)")
    parser.add_argument("--shape", default="2048x2048", help="OUTxIN of the random layers (IN a multiple of 64)")
    parser.add_argument("--model", default=None,
                        help="time whole forwards of this model instead of layers ('default': the embedded one; a "
                             "GGUF file or model folder): each build gets its own copy, loaded with --quantize auto")
    parser.add_argument("--context", type=int, default=128, help="--model: cached tokens before the timed forwards")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=60, help="timed calls of each build per case (10 more warm up)")
    parser.add_argument("--rows", default="1,2,4,8", help="input rows a call, comma-separated (default 1,2,4,8)")
    args = parser.parse_args()
    if args.old_cache is None and args.old_isa is None:
        parser.error("--old-cache: the cache holding the build to compare against (or --old-isa for another "
                     "instruction set of this checkout)")

    import torch

    torch.set_num_threads(args.threads)
    builds = {"old": load_build(args.old_cache, args.old_isa or args.isa), "new": load_build(args.new_cache, args.isa)}
    if builds["old"].__name__ == builds["new"].__name__:
        raise SystemExit("the old and the new cache hold the same build (the same sources): nothing to compare")
    results = time_model(builds, args) if args.model else time_layers(builds, args)
    print(json.dumps({"isa": args.isa, "old_isa": args.old_isa or args.isa,
                      "shape": None if args.model else args.shape, "model": args.model,
                      "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
