// The quantised product of every layer: x [rows, in] times 4-, 5-, 6- or 8-bit weights, on 8-bit inputs (as llama.cpp
// multiplies its blocks) or float32 ones, each (weight row, input row) pair computed alone (grouped_linear.cpp's
// header comment says why). A translation unit of its own: its templates are about a quarter of a build's compile
// time, and ninja compiles it beside grouped_linear.cpp. It needs no tensor headers (raw pointers in and out), only
// ATen's parallel_for.
#include <ATen/Parallel.h>

#include "rows.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

namespace JOINTSPEC_NS {
namespace {

// One input row against W weight rows first .. first + W - 1, dequantised in registers 32 inputs at a time (no
// buffer): the operations of Rows::row then dot_block<W, 1>, pair by pair, so the same bits. A decoding step
// (one row) saves the buffer's stores and loads.
template <int W, typename Rows>
inline void dot_direct(const float* x, const Rows& weights, int64_t first, int64_t k, float* out) {
  V16 acc[W][2];
  for (int b = 0; b < W; ++b) acc[b][0] = acc[b][1] = simd::zero();
  for (int64_t c = 0; c < k / 32; ++c) {
    const V16 xa = simd::load(x + 32 * c), xb = simd::load(x + 32 * c + 16);
    // The next tile's levels, to L2, a pair of groups at a time: as in dot_q8, a weight row is too short a stream
    // for the hardware prefetcher to get ahead of alone (an exact head on float inputs waited on its loads).
    if (c % 2 == 0)
      for (int b = 0; b < W; ++b) __builtin_prefetch(weights.q8_address(first + W + b, c / 2), 0, 1);
    for (int b = 0; b < W; ++b) {
      V16 wa, wb;
      weights.chunk(first + b, c, wa, wb);
      acc[b][0] = simd::fmadd(xa, wa, acc[b][0]);
      acc[b][1] = simd::fmadd(xb, wb, acc[b][1]);
    }
  }
  for (int b = 0; b < W; ++b) out[b] = simd::reduce_add(simd::add(acc[b][0], acc[b][1]));
}

// dot_direct for R input rows at once: each weight chunk is dequantised in registers once and multiplied into all R
// rows. Every (weight row, input row) pair runs the operations dot_direct and dot_block give it, so the same bits; a
// short forward (verifying a few draft tokens) saves the weight buffer's stores and loads.
template <int W, int R, typename Rows>
inline void dot_direct_rows(const float* x, const Rows& weights, int64_t first, int64_t k, float* out,
                            int64_t out_stride) {
  V16 acc[W][R][2];
  for (int b = 0; b < W; ++b)
    for (int r = 0; r < R; ++r) acc[b][r][0] = acc[b][r][1] = simd::zero();
  for (int64_t c = 0; c < k / 32; ++c) {
    V16 xa[R], xb[R];
    for (int r = 0; r < R; ++r) {
      xa[r] = simd::load(x + r * k + 32 * c);
      xb[r] = simd::load(x + r * k + 32 * c + 16);
    }
    if (c % 2 == 0)  // the next tile's levels, as in dot_direct
      for (int b = 0; b < W; ++b) __builtin_prefetch(weights.q8_address(first + W + b, c / 2), 0, 1);
    for (int b = 0; b < W; ++b) {
      V16 wa, wb;
      weights.chunk(first + b, c, wa, wb);
      for (int r = 0; r < R; ++r) {
        acc[b][r][0] = simd::fmadd(xa[r], wa, acc[b][r][0]);
        acc[b][r][1] = simd::fmadd(xb[r], wb, acc[b][r][1]);
      }
    }
  }
  for (int b = 0; b < W; ++b)
    for (int r = 0; r < R; ++r) out[r * out_stride + b] = simd::reduce_add(simd::add(acc[b][r][0], acc[b][r][1]));
}

// Input rows m .. m + R - 1 against every weight row in [begin, end), W weight rows a call.
template <int R, typename Rows>
inline void direct_rows(const float* xp, const Rows& weights, int64_t begin, int64_t end, int64_t k,
                        int64_t out_features, float* op) {
  constexpr int W = 2 * simd::kPairs / R > 0 ? 2 * simd::kPairs / R : 1;  // W * R * 2 accumulators: 16 at most
  int64_t n = begin;
  for (; n + W <= end; n += W) dot_direct_rows<W, R>(xp, weights, n, k, op + n, out_features);
  for (; n < end; ++n) dot_direct_rows<1, R>(xp, weights, n, k, op + n, out_features);
}

// ---------------------------------------------------------------------------------------------------------------
// 4-, 5- and 8-bit weights against 8-bit inputs, the way llama.cpp multiplies its blocks: each input row is
// rounded to signed 8-bit levels per group of 32 inputs (step = the group's largest |x| / 127, as llama.cpp's Q8_0),
// then a group's product is an exact integer sum of level products, scaled once:
//   sum_i (l_i * s + m) * x_i  ~  s * step * sum_i l_i * q_i  +  m * step * sum_i q_i
// The minimum's term takes the rounded inputs too, as llama.cpp's Q8_1 sum does: the rounding errors e_i = step q_i -
// x_i are then weighted by the weights l_i s + m, which centre on zero, where with the exact sum of x_i they were
// weighted by l_i s alone (0 to 15 s, all one sign), a larger error (docs/kernels.md, "The minimum's term").
// The integer products take a fraction of the instructions that dequantising each weight to float does, which is
// what a decoding step on weights that do not fit in cache is short of (docs/kernels.md, "8-bit inputs"). Each
// (weight row, input row) pair is still computed alone and by fixed operations: the integer lanes of simd.h's quad
// layout (4 and 5 bits: eight products a lane, one group) or pair layout (8 bits: four), each lane's float sum over
// the quads or pairs in order, the minimum's term by sixteen groups a vector, then the halving trees. So a row's result
// does not depend on the other rows of the call, and every backend gives its bits.
struct QuantisedInputs {
  int64_t rows = 0, k = 0, groups = 0;
  int64_t stride = 0;          // an input row's levels: k, or k rounded up to a whole quad (quad layout)
  int64_t group_stride = 0;    // an input row's steps and sums: groups rounded up to 16, the rest 0
  std::vector<int8_t> levels;  // [rows, stride]: in simd.h's pair layout, or its quad layout (`quad`); padding 0
  std::vector<float> step;     // [rows, group_stride]
  std::vector<float> sum;      // [rows, group_stride]: step * the group's levels summed (for the minimum's term)
  std::vector<float> step4;    // [rows, 4 * group_stride]: each step four times over, where lane_steps() (below)
};

// Whether a tile of R input rows against the quad layout takes each lane's input step from QuantisedInputs::step4 (a
// load) and multiplies it by the weight scales, picked once for all R rows, instead of picking each row's product of
// the two (a cross-lane permutation a row, a slow instruction on AVX2's CPUs). It pays in AVX2's tiles of three and
// four rows (docs/kernels.md, "Input steps by lane"); tiles of one or two rows, and the other builds, keep the
// permutations. Each lane gets the same product either way, so the bits are the same.
template <int R>
constexpr bool lane_steps() {
#if defined(JOINTSPEC_ISA_AVX2)
  return R >= 3;
#else
  return false;
#endif
}

QuantisedInputs quantise_inputs(const float* x, int64_t rows, int64_t k, bool quad) {
  const int64_t groups = k / kGroup, stride = quad ? (k + 4 * kGroup - 1) / (4 * kGroup) * (4 * kGroup) : k;
  // Steps and sums padded with zeros to whole vectors of sixteen: the tiles load them without masks.
  const int64_t group_stride = (groups + 15) / 16 * 16;
  QuantisedInputs q{rows, k, groups, stride, group_stride, std::vector<int8_t>(rows * stride),
                    std::vector<float>(rows * group_stride), std::vector<float>(rows * group_stride)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + r * k + g * kGroup;
        const int64_t at = quad ? (g / 4) * 128 + (g % 4) * 16 : (g / 2) * 64 + (g % 2) * 16;
        float& step = q.step[r * group_stride + g];
        const int total = simd::quantise_group(xg, q.levels.data() + r * stride + at, step, quad ? 64 : 32);
        q.sum[r * group_stride + g] = step * static_cast<float>(total);  // one rounding: every build's bits
      }
  });
  if (quad && lane_steps<3>() && rows >= 3) {  // lanes 4g .. 4g + 3 of a row take group g's step
    q.step4.resize(rows * group_stride * 4);
    for (int64_t i = 0; i < rows * group_stride; ++i) std::fill_n(q.step4.data() + 4 * i, 4, q.step[i]);
  }
  return q;
}

// Whether quantised layers take 8-bit inputs (the default); use_q8_inputs(false) gives the float-input kernels, for
// comparing the two.
bool g_q8_inputs = true;


// Weight rows a block (each thread runs every input row against a block while it is in L1), which is also about the
// accumulators a tile keeps (weight rows x input rows). A decoding step (one input row) reads four weight rows at a
// time: eight measured slower from memory (more streams at once). Several input rows make the step compute-bound,
// and there eight weight rows a block keep two of them per tile for four input rows where AVX-512's registers allow;
// AVX2's sixteen do not.
constexpr int kQ8StepBlock = 4;
#if defined(JOINTSPEC_ISA_AVX512)
constexpr int kQ8RowsBlock = 8;
#else
constexpr int kQ8RowsBlock = 4;
#endif

// Input rows r0 .. r0 + R - 1 against weight rows first .. first + W - 1: out[r * out_stride + b]. Rows: Int4Rows
// (4 and 5 bits, unsigned levels and a minimum) or Int8Rows (signed levels, groups of 32 or 16).
template <int W, int R, typename Rows>
inline void dot_q8(const QuantisedInputs& x, int64_t r0, const Rows& w, int64_t first, float* out,
                   int64_t out_stride) {
  const int64_t groups = x.groups;
  V16 acc[W][R];
  for (int b = 0; b < W; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = simd::zero();
  const int64_t pairs = groups / 2, per_block = w.block_pairs();
  for (int64_t p0 = 0; p0 < pairs; p0 += per_block) {
    // Each lane's weight scale times its input step, a block of pairs at once: the products pair by pair would give
    // (the same multiplications), for one conversion and one multiply per sixteen scales instead of per two.
    simd::Held scaled[W][R];
    for (int b = 0; b < W; ++b) w.q8_prefetch_scales(first + W + b, p0);  // the next tile's, as for its levels below
    if constexpr (Rows::kQuad && lane_steps<R>()) {  // the weight scales alone: the steps come lane by lane
      for (int b = 0; b < W; ++b) scaled[b][0] = simd::hold(w.q8_scales(first + b, p0));
    } else {
      V16 step[R];
      for (int r = 0; r < R; ++r) step[r] = w.q8_steps(x.step.data() + (r0 + r) * x.group_stride, p0);
      for (int b = 0; b < W; ++b) {
        const V16 scales = w.q8_scales(first + b, p0);
        for (int r = 0; r < R; ++r) scaled[b][r] = simd::hold(simd::mul(scales, step[r]));
      }
    }
    const int count = static_cast<int>(std::min(per_block, pairs - p0));
    if constexpr (Rows::kQuad) {  // a quad (two pairs) at a time: p0 is a multiple of 8, so p is even
      const auto quad = [&](int i, bool both) __attribute__((always_inline)) {
        const int64_t p = p0 + i;
        const simd::Lanes lanes = simd::group_lanes(i / 2);
        for (int b = 0; b < W; ++b) __builtin_prefetch(w.q8_address(first + W + b, p), 0, 1);
        const int8_t* inputs = x.levels.data() + r0 * x.stride + 64 * p;  // read where used (L1), not held
        if constexpr (lane_steps<R>()) {
          const float* steps = x.step4.data() + r0 * x.group_stride * 4 + 8 * p;  // groups 2p .. 2p + 3
          for (int b = 0; b < W; ++b) {
            simd::L64 low, high;
            w.q8_quad(first + b, p, both, low, high);
            const V16 scales = simd::pick(scaled[b][0], lanes);
            for (int r = 0; r < R; ++r)
              acc[b][r] = simd::fmadd(simd::dot8(low, high, inputs + r * x.stride),
                                      simd::mul(scales, simd::load(steps + r * x.group_stride * 4)), acc[b][r]);
          }
          return;
        }
        for (int b = 0; b < W; ++b) {
          simd::L64 low, high;
          w.q8_quad(first + b, p, both, low, high);
          for (int r = 0; r < R; ++r)
            acc[b][r] = simd::fmadd(simd::dot8(low, high, inputs + r * x.stride), simd::pick(scaled[b][r], lanes),
                                    acc[b][r]);
        }
      };
      if (count == 8) {  // a whole block, unrolled with its lanes known
        for (int i = 0; i < 8; i += 2) quad(i, true);
      } else if (count == 1) {  // a row's last pair alone (576 inputs: 18 groups), its lanes known too
        quad(0, false);
      } else {
        for (int i = 0; i < count; i += 2) quad(i, i + 1 < count);
      }
    } else {  // a pair at a time: the 8- and 6-bit layers
      for (int i = 0; i < count; ++i) {
        const int64_t p = p0 + i;
        const simd::Lanes lanes = w.q8_lanes(i);
        simd::L64 q[R];
        simd::I16 base[R];  // Rows::kOffset: each input vector's share of the levels' offset
        for (int r = 0; r < R; ++r) {
          q[r] = simd::load_q64(x.levels.data() + (r0 + r) * x.stride + 64 * p);
          if constexpr (Rows::kOffset) base[r] = simd::six_base(q[r]);
        }
        // The next block's levels, to L2: a weight row's levels are only 16 cache lines at common widths, too short
        // a stream for the hardware prefetcher to get ahead of alone.
        if (p % Rows::kPrefetchEvery == 0)
          for (int b = 0; b < W; ++b) __builtin_prefetch(w.q8_address(first + W + b, p), 0, 1);
        if constexpr (Rows::kPlane)
          if (p % 4 == 0)
            for (int b = 0; b < W; ++b) __builtin_prefetch(w.q8_plane_address(first + W + b, p), 0, 1);
        for (int b = 0; b < W; ++b) {
          const simd::L64 levels = w.q8_pair(first + b, p);
          for (int r = 0; r < R; ++r) {
            V16 dot;
            if constexpr (Rows::kOffset) dot = Rows::q8_dot_base(levels, q[r], base[r]);
            else dot = Rows::q8_dot(levels, q[r]);
            acc[b][r] = simd::fmadd(dot, simd::pick(scaled[b][r], lanes), acc[b][r]);
          }
        }
      }
    }
  }
  for (int b = 0; b < W; ++b) {
    if constexpr (Rows::kMinimum) {  // each row's minima once for all R input rows
      V16 low[R];
      for (int r = 0; r < R; ++r) low[r] = simd::zero();
      for (int64_t g = 0; g < groups; g += 16) {
        const V16 minima = w.q8_minima(first + b, g);
        for (int r = 0; r < R; ++r)
          low[r] = simd::fmadd(minima, simd::load(x.sum.data() + (r0 + r) * x.group_stride + g), low[r]);
      }
      for (int r = 0; r < R; ++r) out[r * out_stride + b] = simd::reduce_add(acc[b][r]) + simd::reduce_add(low[r]);
    } else {
      for (int r = 0; r < R; ++r) out[r * out_stride + b] = simd::reduce_add(acc[b][r]);
    }
  }
}

// Weight rows a tile of R input rows: the block's rows shared among the input rows, but two for three or four input
// rows in a block of four (AVX2's and the portable build's): one weight row against three input rows left too little
// independent work in flight (a three-row product cost as much as a four-row one), and two still fit in sixteen
// registers. AVX2's quads hold four registers of weight levels besides the accumulators, so there one weight row
// takes several input rows alone (faster than two in an in-cache benchmark, docs/kernels.md).
template <int Block, int R, bool Quad>
constexpr int tile_weight_rows() {
#if defined(JOINTSPEC_ISA_AVX2) || defined(JOINTSPEC_ISA_NEON)  // NEON: AVX2's register budget
  if constexpr (Quad && R > 1) return 1;
#endif
  if constexpr (Block == 4 && (R == 3 || R == 4)) return 2;
  return Block / R > 0 ? Block / R : 1;
}

template <int Block, int R, typename Rows>
inline void q8_tile(const QuantisedInputs& x, int64_t r0, const Rows& w, int64_t first, int64_t count, float* out,
                    int64_t out_features) {
  constexpr int W = tile_weight_rows<Block, R, Rows::kQuad>();
  int64_t b = 0;
  for (; b + W <= count; b += W) dot_q8<W, R>(x, r0, w, first + b, out + b, out_features);
  for (; b < count; ++b) dot_q8<1, R>(x, r0, w, first + b, out + b, out_features);
}

// Input rows a tile at most. Each tile unpacks every weight level of its block once, whatever its rows, so a tile
// of R rows spends one unpacking on R products: AVX-512's 32 registers hold eight rows' accumulators and scaled steps
// beside one weight row's quads, so up to eight rows share one unpacking of 4- and 5-bit levels there (five to eight
// rows took two tiles before, the second unpacking everything again for a row or few). The pair layout (8 and 6 bits)
// also holds each row's input vector, and ran slower in tiles of eight; it keeps four, as sixteen registers do.
template <typename Rows>
constexpr int64_t q8_tile_rows() {
#if defined(JOINTSPEC_ISA_AVX512)
  if constexpr (Rows::kQuad) return 8;
#endif
  return 4;
}

// q8_tile for the n (1 .. q8_tile_rows) input rows from r0.
template <int Block, typename Rows>
inline void q8_rows(int64_t n, const QuantisedInputs& x, int64_t r0, const Rows& w, int64_t first, int64_t count,
                    float* out, int64_t out_features) {
  switch (n) {
    case 1: return q8_tile<Block, 1>(x, r0, w, first, count, out, out_features);
    case 2: return q8_tile<Block, 2>(x, r0, w, first, count, out, out_features);
    case 3: return q8_tile<Block, 3>(x, r0, w, first, count, out, out_features);
    case 4: return q8_tile<Block, 4>(x, r0, w, first, count, out, out_features);
    default: break;
  }
  if constexpr (q8_tile_rows<Rows>() == 8) {
    switch (n) {
      case 5: return q8_tile<Block, 5>(x, r0, w, first, count, out, out_features);
      case 6: return q8_tile<Block, 6>(x, r0, w, first, count, out, out_features);
      case 7: return q8_tile<Block, 7>(x, r0, w, first, count, out, out_features);
      default: return q8_tile<Block, 8>(x, r0, w, first, count, out, out_features);
    }
  }
}

// out [rows, out_features] = x [rows, k] times quantised weights (Int4Rows or Int8Rows), with x rounded to 8 bits
// (above), Block weight rows a block, the input rows in tiles of up to q8_tile_rows.
template <int Block, typename Rows>
void multiply_q8_blocks(const QuantisedInputs& x, int64_t rows, int64_t out_features, float* op, const Rows& w) {
  constexpr int64_t tile = q8_tile_rows<Rows>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += Block) {
      const int64_t count = std::min<int64_t>(Block, end - first);
      for (int64_t m = 0; m < rows; m += tile)
        q8_rows<Block>(std::min<int64_t>(tile, rows - m), x, m, w, first, count, op + m * out_features + first,
                       out_features);
    }
  });
}

template <typename Rows>
void multiply_q8(const float* xp, int64_t rows, int64_t k, int64_t out_features, float* op, const Rows& w) {
  const QuantisedInputs x = quantise_inputs(xp, rows, k, Rows::kQuad);
  if (rows == 1)
    multiply_q8_blocks<kQ8StepBlock>(x, rows, out_features, op, w);
  else
    multiply_q8_blocks<kQ8RowsBlock>(x, rows, out_features, op, w);
}

// out [rows, out_features] = x [rows, k] times the dequantised weights of `weights` (Int4Rows / Int8Rows).
// Forwards of up to this many rows take direct_rows(), four input rows at a time, where the registers hold a weight
// chunk and four rows' accumulators (AVX-512's 32): it re-dequantises each weight chunk once per four rows but never
// stores it, and measured faster than the buffer up to 64 rows (docs/kernels.md). The two-pass backend (AVX2's 16
// registers) keeps the buffered path.
constexpr int64_t kDirectRows = simd::kTwoPass ? 1 : 64;

// 4- and 5-bit weights against 8-bit inputs, with the scales' form and the fifth bits fixed at compile time.
template <bool Fifth>
void multiply_int4_q8(const float* xp, int64_t rows, int64_t k, int64_t out_features, float* op,
                      const Int4Rows& weights) {
  switch (weights.form) {
    case ScaleForm::kHalf: multiply_q8(xp, rows, k, out_features, op, Int4Q8<ScaleForm::kHalf, Fifth>{weights}); break;
    case ScaleForm::kSuper: multiply_q8(xp, rows, k, out_features, op, Int4Q8<ScaleForm::kSuper, Fifth>{weights}); break;
    case ScaleForm::kHalfOffset:
      multiply_q8(xp, rows, k, out_features, op, Int4Q8<ScaleForm::kHalfOffset, Fifth>{weights});
      break;
    default: multiply_q8(xp, rows, k, out_features, op, Int4Q8<ScaleForm::kFloat, Fifth>{weights});
  }
}

}  // namespace

// The screened head's 4-bit screen (grouped_linear.cpp says what it is): sum over k inputs of level (0..15) times x8
// (signed), for R input rows. Integer sums have no order, so every variant below gives the same numbers: x86 builds
// take 64 inputs a step (VNNI's dot-product instruction where the CPU has it, chosen at run time, else two steps
// whose 16-bit sums cannot saturate), the ARM build 32 by its dot-product instruction, the portable build one at a
// time. Here beside the layers' products so that a test can compile it without PyTorch (tests/native).

// dots[(j - begin) * rows + r]: vocabulary rows begin .. end - 1 against every input row, up to 4 input rows per
// pass over a weight row (DOTS<R>: one of the screen_dots variants below).
#define JOINTSPEC_SCREEN_RANGE(DOTS)                                                              \
  for (int64_t j = begin; j < end; ++j) {                                                        \
    const uint8_t* w = wp + j * (k / 2);                                                         \
    int32_t* out = dots + (j - begin) * rows;                                                    \
    for (int64_t r = 0; r < rows; r += 4) {                                                      \
      const int8_t* x = x8 + r * k;                                                              \
      switch (std::min<int64_t>(4, rows - r)) {                                                  \
        case 4: DOTS<4>(w, x, k, out + r); break;                                                \
        case 3: DOTS<3>(w, x, k, out + r); break;                                                \
        case 2: DOTS<2>(w, x, k, out + r); break;                                                \
        default: DOTS<1>(w, x, k, out + r); break;                                               \
      }                                                                                          \
    }                                                                                            \
  }

namespace {
#if defined(JOINTSPEC_ISA_AVX512) || defined(JOINTSPEC_ISA_AVX2)
// x86: 64 inputs a step; DOT_ADD(acc, levels, x8) adds the sums of four adjacent byte products to each 32-bit lane.
#define JOINTSPEC_SCREEN_DOTS(NAME, DOT_ADD)                                                                   \
  template <int R>                                                                                            \
  inline void NAME(const uint8_t* w, const int8_t* x8, int64_t k, int32_t* out) {                              \
    __m256i acc[R];                                                                                           \
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();                                              \
    const __m256i nibble = _mm256_set1_epi8(0x0F);                                                            \
    for (int64_t c = 0; c < k; c += 64) {                                                                     \
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c / 2));                 \
      const __m256i low = _mm256_and_si256(bytes, nibble);                                                    \
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);                             \
      for (int r = 0; r < R; ++r) {                                                                           \
        acc[r] = DOT_ADD(acc[r], low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x8 + r * k + c)));   \
        acc[r] = DOT_ADD(acc[r], high,                                                                        \
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x8 + r * k + c + 32)));          \
      }                                                                                                       \
    }                                                                                                         \
    for (int r = 0; r < R; ++r) {                                                                             \
      const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1)); \
      const __m128i quarter = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));                             \
      out[r] = _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 0xB1)));                   \
    }                                                                                                         \
  }

// Two steps, u8 x s8 -> pairs summed to s16 -> quadruples to s32 (15 * 127 * 2 < 2^15: no saturation).
inline __m256i dot_add_maddubs(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
JOINTSPEC_SCREEN_DOTS(screen_dots_plain, dot_add_maddubs)

void screen_range_plain(const uint8_t* wp, const int8_t* x8, int64_t rows, int64_t k, int64_t begin, int64_t end,
                        int32_t* dots) {
  JOINTSPEC_SCREEN_RANGE(screen_dots_plain)
}

// VNNI's one instruction for the same sums, in a region compiled for it: every function there (the dot product, the
// loop, the range) carries the target, so they inline into each other. Run only where the CPU has it.
#pragma GCC push_options
#if defined(JOINTSPEC_ISA_AVX512)
#pragma GCC target("avx512vnni")
#define JOINTSPEC_VNNI_CPU "avx512vnni"
inline __m256i dot_add_vnni(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
#pragma GCC target("avxvnni")
#define JOINTSPEC_VNNI_CPU "avxvnni"
inline __m256i dot_add_vnni(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
JOINTSPEC_SCREEN_DOTS(screen_dots_vnni, dot_add_vnni)

void screen_range_vnni(const uint8_t* wp, const int8_t* x8, int64_t rows, int64_t k, int64_t begin, int64_t end,
                       int32_t* dots) {
  JOINTSPEC_SCREEN_RANGE(screen_dots_vnni)
}
#pragma GCC pop_options

// Whether the screen takes VNNI's instruction: where the CPU has it, unless use_vnni(false) said otherwise (tests
// hold both variants against the portable build).
bool g_vnni = (__builtin_cpu_init(), __builtin_cpu_supports(JOINTSPEC_VNNI_CPU));

}  // namespace

bool use_vnni(bool on) {
  g_vnni = on && __builtin_cpu_supports(JOINTSPEC_VNNI_CPU);
  return g_vnni;
}

void screen_range(const uint8_t* wp, const int8_t* x8, int64_t rows, int64_t k, int64_t begin, int64_t end,
                  int32_t* dots) {
  if (g_vnni) screen_range_vnni(wp, x8, rows, k, begin, end, dots);
  else screen_range_plain(wp, x8, rows, k, begin, end, dots);
}
#else
#if defined(JOINTSPEC_ISA_NEON)
// ARM: 32 inputs a step, each 16 weight bytes' nibbles against their 16 inputs by the dot-product instruction
// (levels 0..15 are non-negative as signed bytes, so signed-by-signed products are the same integers).
template <int R>
inline void screen_dots(const uint8_t* w, const int8_t* x8, int64_t k, int32_t* out) {
  int32x4_t acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vdupq_n_s32(0);
  const uint8x16_t nibble = vdupq_n_u8(0x0F);
  for (int64_t c = 0; c < k; c += 64)
    for (int64_t h = 0; h < 32; h += 16) {
      const uint8x16_t bytes = vld1q_u8(w + c / 2 + h);
      const int8x16_t low = vreinterpretq_s8_u8(vandq_u8(bytes, nibble));
      const int8x16_t high = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
      for (int r = 0; r < R; ++r) {
        acc[r] = vdotq_s32(acc[r], low, vld1q_s8(x8 + r * k + c + h));
        acc[r] = vdotq_s32(acc[r], high, vld1q_s8(x8 + r * k + c + 32 + h));
      }
    }
  for (int r = 0; r < R; ++r) out[r] = vaddvq_s32(acc[r]);
}
#else
// Portable: one input at a time (integer sums: the same numbers).
template <int R>
inline void screen_dots(const uint8_t* w, const int8_t* x8, int64_t k, int32_t* out) {
  for (int r = 0; r < R; ++r) {
    int32_t sum = 0;
    for (int64_t c = 0; c < k; c += 64)
      for (int64_t b = 0; b < 32; ++b) {
        sum += int32_t(w[c / 2 + b] & 15) * x8[r * k + c + b] + int32_t(w[c / 2 + b] >> 4) * x8[r * k + c + 32 + b];
      }
    out[r] = sum;
  }
}
#endif

}  // namespace

bool use_vnni(bool) { return false; }

void screen_range(const uint8_t* wp, const int8_t* x8, int64_t rows, int64_t k, int64_t begin, int64_t end,
                  int32_t* dots) {
  JOINTSPEC_SCREEN_RANGE(screen_dots)
}
#endif

template <typename Rows>
void multiply(const float* xp, int64_t rows, int64_t k, int64_t out_features, float* op, const Rows& weights,
              bool q8) {
  if (q8 && g_q8_inputs) {
    if constexpr (std::is_same_v<Rows, Int4Rows>) {
      if (weights.fifth != nullptr) multiply_int4_q8<true>(xp, rows, k, out_features, op, weights);
      else multiply_int4_q8<false>(xp, rows, k, out_features, op, weights);
      return;
    }
    if constexpr (std::is_same_v<Rows, Int6Rows>) {
      multiply_q8(xp, rows, k, out_features, op, weights);
      return;
    }
    if constexpr (std::is_same_v<Rows, Int8Rows>) {
      if (weights.sub != nullptr)
        multiply_q8(xp, rows, k, out_features, op, Int8Q8<true>{weights});
      else
        multiply_q8(xp, rows, k, out_features, op, Int8Q8<false>{weights});
      return;
    }
  }
  // One input row (a decoding step): each weight row dequantised in registers (dot_direct), as there is nothing to
  // share a buffer with. More rows: each weight row dequantised once into a buffer (L1), then multiplied by every
  // input row (dequantising into registers again for each input row was slower). Short forwards (verification)
  // take simd::kPairs weight rows at a time against input rows one or two at a time, so a loaded vector serves
  // several multiply-adds; a long forward (a prefill), blocks of 8 weight rows dequantised side by side (8 x 576
  // floats: 18 KB) against input rows several at a time, so each input row is read from L2 once per block rather
  // than once per weight row. Whatever the path, every output is one pair of dot_block or dot_direct, the same
  // operations: the path changes no result.
  const bool short_forward = rows <= 8;
  const int64_t block = short_forward ? simd::kPairs : 8;
  constexpr int kLongRows = simd::kPairs;
  if (rows == 1) {
    constexpr int W = simd::kPairs / 2;  // two vectors of accumulators a weight row
    at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
      int64_t n = begin;
      for (; n + W <= end; n += W) dot_direct<W>(xp, weights, n, k, op + n);
      for (; n < end; ++n) dot_direct<1>(xp, weights, n, k, op + n);
    });
    return;
  }
  if (rows <= kDirectRows) {  // a few rows: dequantise in registers too, once per four rows (no buffer)
    at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = 0; m < rows; m += 4) {
        const float* x = xp + m * k;
        float* o = op + m * out_features;
        switch (std::min<int64_t>(4, rows - m)) {
          case 1: direct_rows<1>(x, weights, begin, end, k, out_features, o); break;
          case 2: direct_rows<2>(x, weights, begin, end, k, out_features, o); break;
          case 3: direct_rows<3>(x, weights, begin, end, k, out_features, o); break;
          default: direct_rows<4>(x, weights, begin, end, k, out_features, o); break;
        }
      }
    });
    return;
  }
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    float* w = static_cast<float*>(std::aligned_alloc(64, block * k * sizeof(float)));
    for (int64_t first = begin; first < end; first += block) {
      const int64_t count = std::min(block, end - first);
      for (int64_t b = 0; b < count; ++b) weights.row(first + b, w + b * k);
      if (short_forward) {
        int64_t m = 0;
        if (rows > 1)
          for (; m + 2 <= rows; m += 2)
            dot_rows<2>(xp + m * k, w, count, k, op + m * out_features + first, out_features);
        if (m < rows) dot_rows<1>(xp + m * k, w, count, k, op + m * out_features + first, out_features);
        continue;
      }
      int64_t m = 0;
      for (; m + kLongRows <= rows; m += kLongRows)
        for (int64_t b = 0; b < count; ++b)
          dot_block<1, kLongRows>(xp + m * k, w + b * k, k, op + m * out_features + first + b, out_features);
      for (; m < rows; ++m)
        for (int64_t b = 0; b < count; ++b)
          dot_block<1, 1>(xp + m * k, w + b * k, k, op + m * out_features + first + b, out_features);
    }
    std::free(w);
  });
}

template void multiply<Int4Rows>(const float*, int64_t, int64_t, int64_t, float*, const Int4Rows&, bool);
template void multiply<Int6Rows>(const float*, int64_t, int64_t, int64_t, float*, const Int6Rows&, bool);
template void multiply<Int8Rows>(const float*, int64_t, int64_t, int64_t, float*, const Int8Rows&, bool);

bool use_q8_inputs(bool on) {
  g_q8_inputs = on;
  return on;
}

}  // namespace JOINTSPEC_NS
