"""The kernels' outputs on one CPU held against another's, bit for bit: for a CPU this project cannot test on.

Every kernel build computes the same bits on every CPU (docs/kernels.md, "The same bits on every build"): the tests
hold each build a machine runs against its portable build, but a CPU with no x86 build (ARM) runs only the portable
one, so there nothing is held against anything. This holds it against another machine instead: ``make`` writes
seeded inputs (saved, so both sides read the same numbers, whatever each CPU's random-number code) and this
machine's outputs of the kernels' calls over them; ``check`` on the other machine (or under an emulator such as
qemu-user) computes the same calls and compares. The calls: the 4-, 5- and 8-bit products row by row (1-40 rows, on
8-bit and on float inputs, scales as floats and as halves, groups of 32 and 16), attention (causal and masked,
float32 and half keys, up to 1,500 keys), and the screened head (every margin and rank). The products' GEMM path is
PyTorch's own matrix product, whose bits depend on the CPU's BLAS: it is compared and reported apart::

    python benchmarks/cross_cpu_bits.py make DIR --isa portable      # on one machine
    python benchmarks/cross_cpu_bits.py check DIR --isa portable     # on the other, DIR copied there

Exits 1 if a row-wise output differs. Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn


def seeded_linear(out_features: int, in_features: int, seed: int, outlier: float) -> nn.Linear:
    """A random layer with one input channel ``outlier`` times the others (as real models have)."""
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight[:, 5] *= outlier
    return layer


def make_inputs() -> dict:
    from jointspec.kernels.grouped import GroupedInt4Linear, GroupedInt8Linear, ScreenedInt8Head

    generator = torch.Generator().manual_seed(0)
    layer = seeded_linear(72, 192, seed=5, outlier=20.0)
    q4, q8 = GroupedInt4Linear(layer), GroupedInt8Linear(layer)
    inputs = {"q4": [q4.packed, q4.scale, q4.minimum], "q8": [q8.levels, q8.scale],
              "fifth": torch.randint(-2 ** 31, 2 ** 31 - 1, (72, 6), generator=generator, dtype=torch.int32),
              "scale16": torch.rand(72, 12, generator=generator) * 0.01 + 1e-3,
              "x": {rows: torch.randn(rows, 192, generator=generator) * 3 for rows in (1, 2, 3, 4, 5, 8, 9, 12, 40)},
              "attention": []}
    for dim, keys in ((32, 40), (64, 17), (16, 3), (64, 300), (64, 1500)):
        query = torch.randn(4, 3, dim, generator=generator) * 2
        key, value = (torch.randn(2, keys, dim, generator=generator) * 2 for _ in range(2))
        visible = torch.rand(3, keys, generator=generator) > 0.3
        visible[:, 0] = True
        inputs["attention"].append((dim, query, key, value, visible, torch.tensor([keys - 2, keys - 1, keys])))
    torch.manual_seed(4)
    head = nn.Linear(128, 512, bias=False)
    with torch.no_grad():
        head.weight.mul_(torch.rand(1, 128) * 4)  # columns of unequal sizes, as a real head's
    screened = ScreenedInt8Head(head)
    inputs["screen"] = [screened.screen4, screened.screen_scale, screened.column, [screened.levels, screened.scale]]
    inputs["head_x"] = torch.randn(5, 128, generator=generator) * 3
    return inputs


def outputs(inputs: dict, isa: str) -> dict[str, torch.Tensor]:
    """Every call's output by name; names of the GEMM path begin with ``gemm``."""
    from jointspec.kernels.grouped import kernels

    built = kernels(isa)
    if built is None:
        raise SystemExit(f"the {isa} kernels cannot run here")
    out = {}
    packed, scale, minimum = inputs["q4"]
    for rows, x in inputs["x"].items():
        for gemm in (False, True):
            path = "gemm" if gemm else "rows"
            out[f"{path} int5 {rows}"] = built.int5_linear(x, packed, inputs["fifth"], scale, minimum, gemm)
            out[f"{path} int4 {rows}"] = built.int4_linear(x, packed, scale, minimum, gemm)
            out[f"{path} int4 float scales {rows}"] = built.int4_linear(x, packed, scale.float() * 37,
                                                                        minimum.float(), gemm)
            out[f"{path} int8 {rows}"] = built.int8_linear(x, *inputs["q8"], gemm)
            out[f"{path} int8 groups of 16 {rows}"] = built.int8_linear(x, inputs["q8"][0], inputs["scale16"], gemm)
        try:
            for q8 in (True, False):
                built.use_q8_inputs(q8)
                out[f"rows linear {rows} {'8-bit' if q8 else 'float'} inputs"] = built.linear(
                    x, list(inputs["q4"]), False, True)
        finally:
            built.use_q8_inputs(True)
    none_bool, none_long = torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.long)
    for i, (dim, query, key, value, visible, lengths) in enumerate(inputs["attention"]):
        for half in (False, True):
            keys, values = (key.half(), value.half()) if half else (key, value)
            kind = "half" if half else "float32"
            out[f"rows attention {i} masked {kind}"] = built.attention(query, keys, values, visible, none_long,
                                                                       dim ** -0.5)
            out[f"rows attention {i} causal {kind}"] = built.attention(query, keys, values, none_bool, lengths,
                                                                       dim ** -0.5)
    for margin in (-1.0, 1.5, 1e9):
        for rank in (1, 3, 40):
            out[f"rows screened head margin {margin} rank {rank}"] = built.screened_head(
                inputs["head_x"], *inputs["screen"], margin, 512, rank)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("make", "check"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--isa", default="portable", help="the kernel build to run (default: portable)")
    args = parser.parse_args()
    import platform

    if args.mode == "make":
        args.folder.mkdir(parents=True, exist_ok=True)
        inputs = make_inputs()
        torch.save(inputs, args.folder / "inputs.pt")
        torch.save(outputs(inputs, args.isa), args.folder / "outputs.pt")
        (args.folder / "machine.txt").write_text(f"{platform.machine()} {args.isa}\n")
        print(json.dumps({"made": len(torch.load(args.folder / "outputs.pt")), "machine": platform.machine()}))
        return 0
    theirs = torch.load(args.folder / "outputs.pt")
    mine = outputs(torch.load(args.folder / "inputs.pt"), args.isa)
    differ = [name for name in theirs
              if not torch.equal(mine[name].nan_to_num(7.0), theirs[name].nan_to_num(7.0))
              or not torch.equal(mine[name].isnan(), theirs[name].isnan())]
    rows = [name for name in theirs if name.startswith("rows")]
    bad_rows = [name for name in differ if name.startswith("rows")]
    made_on = (args.folder / "machine.txt").read_text().strip() if (args.folder / "machine.txt").exists() else "?"
    print(f"outputs made on {made_on}, checked on {platform.machine()} {args.isa}")
    print(f"row-wise kernels: {len(rows) - len(bad_rows)} of {len(rows)} outputs bit for bit equal")
    print(f"GEMM path (PyTorch's matrix product): {len(theirs) - len(rows) - len(differ) + len(bad_rows)} of "
          f"{len(theirs) - len(rows)} equal")
    for name in differ:
        print(f"  differs: {name} (largest difference {(mine[name].double() - theirs[name].double()).abs().max():.3g})")
    print(json.dumps({"rows": len(rows), "rows_differ": len(bad_rows), "gemm": len(theirs) - len(rows),
                      "gemm_differ": len(differ) - len(bad_rows), "made_on": made_on,
                      "checked_on": f"{platform.machine()} {args.isa}"}))
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
