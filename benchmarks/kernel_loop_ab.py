"""Two versions of the kernels' quantised product compiled side by side in one program: time per call and same bits.

``kernel_builds_ab.py`` compares two whole builds through torch (a minute or two to build each, calls from Python).
This one is for working on the product's inner loop: it takes, from each of two copies of the kernels' source folder,
the weight forms of ``rows.h`` and the code of ``products.cpp`` up to ``multiply_q8`` (the 8-bit-input product
``multiply_q8_blocks`` and what it needs), puts each in a namespace of its own beside ``simd.h``, with a one-thread
stand-in for ``at::parallel_for``, and compiles one program with the flags of the build named by ``--isa`` (seconds;
torch is imported only for those flags). The program multiplies random Q4_1-form layers (4-bit levels, half scales
and minima, ``--layers`` copies taken in turn, so that several copies of a large shape stream from memory) by
``--rows`` random input rows with both versions, checks that their outputs are the same bits, and times them
alternating; medians of 20 turns each. One thread: the loop's own speed, not the threads'.

    cp -r src/jointspec/kernels/csrc /tmp/new      # then change the loop in /tmp/new/products.cpp
    python benchmarks/kernel_loop_ab.py --new /tmp/new --shape 1024x2048 --rows 1
    python benchmarks/kernel_loop_ab.py --new /tmp/new --shape 2048x8192 --layers 8     # from memory

A gain here is a lead, not a result: whole forwards (``kernel_builds_ab.py --model``) decide (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "src" / "jointspec" / "kernels" / "csrc"

PROGRAM = r"""
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>
namespace at {  // one thread: the loop's own speed
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t, const F& f) {
  if (begin < end) f(begin, end);
}
}
#include "simd.h"
namespace old_code {
#include "old.inc"
}
namespace new_code {
#include "new.inc"
}

template <class NS> struct Version;
#define VERSION(NS)                                                                                     \
  template <> struct Version<NS::ScaleForm> {                                                           \
    NS::QuantisedInputs inputs;                                                                         \
    std::vector<NS::Int4Q8<NS::ScaleForm::kHalf, false>> layers;                                        \
    void run(int rows, int64_t out, float* y, int layer) const {                                        \
      NS::multiply_q8_blocks<4>(inputs, rows, out, y, layers[layer]);                                   \
    }                                                                                                   \
  };
VERSION(old_code)
VERSION(new_code)

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class V>
V make(const std::vector<float>& x, int rows, int64_t in, const std::vector<std::vector<uint8_t>>& packed,
       const std::vector<std::vector<uint16_t>>& scale, const std::vector<std::vector<uint16_t>>& minimum,
       decltype(V::inputs) (*quantise)(const float*, int64_t, int64_t, bool)) {
  V v{quantise(x.data(), rows, in, true), {}};
  v.layers.resize(packed.size());
  for (size_t l = 0; l < packed.size(); ++l) {
    v.layers[l].packed = packed[l].data();
    v.layers[l].scale = scale[l].data();
    v.layers[l].minimum = minimum[l].data();
    v.layers[l].groups = in / 32;
    v.layers[l].form = decltype(v.layers[l].form)::kHalf;
  }
  return v;
}

int main(int argc, char** argv) {
  const int64_t out = atoll(argv[1]), in = atoll(argv[2]);
  const int rows = atoi(argv[3]), layers = atoi(argv[4]);
  std::mt19937 gen(0);
  std::vector<std::vector<uint8_t>> packed(layers, std::vector<uint8_t>(out * in / 2));
  std::vector<std::vector<uint16_t>> scale(layers, std::vector<uint16_t>(out * in / 32)), minimum = scale;
  for (int l = 0; l < layers; ++l) {
    for (auto& b : packed[l]) b = gen() & 255;
    for (auto& s : scale[l]) s = 0x2000 + (gen() & 0x3FF);    // halves around 0.008
    for (auto& s : minimum[l]) s = 0xA000 + (gen() & 0x3FF);  // and around -0.008
  }
  std::vector<float> x(rows * in);
  for (auto& v : x) v = float(int(gen() % 2001) - 1000) / 1000.f;
  using Old = Version<old_code::ScaleForm>;
  using New = Version<new_code::ScaleForm>;
  const Old a = make<Old>(x, rows, in, packed, scale, minimum, old_code::quantise_inputs);
  const New b = make<New>(x, rows, in, packed, scale, minimum, new_code::quantise_inputs);
  std::vector<float> ya(rows * out), yb(rows * out);
  bool same = true;
  for (int l = 0; l < layers; ++l) {
    a.run(rows, out, ya.data(), l);
    b.run(rows, out, yb.data(), l);
    same = same && std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0;
  }
  const int calls = std::max<int64_t>(3, int64_t(2e8 / (double(out) * in * rows * layers + 1)));
  std::vector<double> ta, tb;
  for (int turn = 0; turn < 40; ++turn) {
    const bool old_first = turn % 2 == 0;
    for (int which = 0; which < 2; ++which) {
      const bool old_now = old_first == (which == 0);
      const double start = now();
      for (int c = 0; c < calls; ++c)
        for (int l = 0; l < layers; ++l) old_now ? a.run(rows, out, ya.data(), l) : b.run(rows, out, yb.data(), l);
      (old_now ? ta : tb).push_back((now() - start) / calls / layers);
    }
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  printf("{\"same_bits\": %s, \"old_us\": %.3f, \"new_us\": %.3f}\n", same ? "true" : "false", ta[20] * 1e6,
         tb[20] * 1e6);
}
"""


def _between(text: str, start: str, end: str, name: str) -> str:
    """The text of ``name`` after the first ``start`` up to the first ``end`` line after it, without includes."""
    begin = text.find(start)
    if begin < 0:
        raise SystemExit(f"{name}: no {start.strip()!r} to start at")
    stop = re.search(end, text[begin + len(start):], re.MULTILINE)
    if stop is None:
        raise SystemExit(f"{name}: nothing matching {end!r} after {start.strip()!r} to stop at")
    body = text[begin + len(start):begin + len(start) + stop.start()]
    return "\n".join(line for line in body.splitlines() if not line.startswith("#include"))


def product_code(folder: Path) -> str:
    """From a copy of the kernels' sources: rows.h's weight forms, then products.cpp's code up to ``multiply_q8``."""
    rows = _between((folder / "rows.h").read_text(), "namespace JOINTSPEC_NS {\n", r"^// out \[rows, out_features\]",
                    f"{folder}/rows.h")
    products = _between((folder / "products.cpp").read_text(), "namespace {\n",
                        r"^template <typename Rows>\nvoid multiply_q8\(", f"{folder}/products.cpp")
    return rows + "\n" + products


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=Path, required=True, help="the changed copy of the kernels' source folder")
    parser.add_argument("--old", type=Path, default=CSRC,
                        help="the copy to compare against (default: this checkout's src/jointspec/kernels/csrc)")
    parser.add_argument("--simd", type=Path, default=CSRC / "simd.h", help="simd.h both copies include")
    parser.add_argument("--isa", default="avx2",
                        help="the build's flags: avx512vnni, avx512, avx2vnni, avx2 or portable")
    parser.add_argument("--shape", default="1024x2048", help="OUTxIN of the layers (IN a multiple of 64)")
    parser.add_argument("--rows", default="1,4", help="input rows a call, comma-separated")
    parser.add_argument("--layers", type=int, default=1, help="copies of the layer taken in turn (from memory: "
                        "enough copies to pass the last-level cache)")
    args = parser.parse_args()
    from jointspec.kernels.grouped import ISA_FLAGS  # the flags the builds compile with

    if args.isa not in ISA_FLAGS:
        raise SystemExit(f"--isa: one of {', '.join(ISA_FLAGS)}, got {args.isa!r}")
    out_features, in_features = (int(value) for value in args.shape.lower().split("x"))
    if in_features % 64:
        raise SystemExit(f"--shape: IN must be a multiple of 64, got {in_features}")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise SystemExit(f"no C++ compiler '{compiler}' on PATH (set CXX)")
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        shutil.copyfile(args.simd, work / "simd.h")
        (work / "old.inc").write_text(product_code(args.old))
        (work / "new.inc").write_text(product_code(args.new))
        (work / "ab.cpp").write_text(PROGRAM)
        # -ffp-contract=off, as every build (simd.h: the same bits on every instruction set).
        command = [compiler, "-O3", "-std=c++17", "-ffp-contract=off", *ISA_FLAGS[args.isa][1], str(work / "ab.cpp"),
                   "-o", str(work / "ab")]
        built = subprocess.run(command, capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"the program did not compile:\n{built.stderr[-3000:]}")
        results = {}
        for rows in (int(value) for value in args.rows.split(",")):
            run = subprocess.run([str(work / "ab"), str(out_features), str(in_features), str(rows), str(args.layers)],
                                 capture_output=True, text=True, check=True)
            result = json.loads(run.stdout)
            result["ratio"] = round(result["new_us"] / result["old_us"], 3)
            results[rows] = result
            note = "" if result["same_bits"] else "  (outputs differ: a change of arithmetic)"
            print(f"{args.shape} x {args.layers}, {rows} rows: old {result['old_us']:9.1f} us  new "
                  f"{result['new_us']:9.1f} us  new / old {result['ratio']:.3f}{note}", flush=True)
    print(json.dumps({"isa": args.isa, "shape": args.shape, "layers": args.layers, "results": results}))


if __name__ == "__main__":
    main()
