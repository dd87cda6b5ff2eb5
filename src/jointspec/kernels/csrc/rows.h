// What both translation units of a kernel build share: the weight forms (4- and 5-bit levels with a scale and a
// minimum, 6- and 8-bit signed levels with a scale) and how a row of each is read, the float dot products, and the
// product every quantised layer runs (multiply, defined in products.cpp). The product's templates are about a quarter
// of a build's compile time; in a unit of their own they compile beside the rest (grouped_linear.cpp) on a second
// core.
//
// The names sit in a namespace named after the build (TORCH_EXTENSION_NAME carries the instruction set and a hash of
// the sources), so two builds loaded in one process (tests hold them against each other) never bind each other's
// symbols; the helpers each unit keeps to itself stay in an anonymous namespace inside it.
#pragma once

#ifndef JOINTSPEC_NS
#define JOINTSPEC_NS TORCH_EXTENSION_NAME
#endif

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace JOINTSPEC_NS {

using simd::V16;
constexpr int64_t kGroup = 32;

// 4 bits: byte i of a group holds level i (low nibble) and level i + 16 (high nibble); w = level * scale + minimum.
// 5 bits (GGUF's Q5_0, Q5_1, Q5_K): the same nibbles, plus bit i of the group's `fifth` word adding 16 to level i.
inline void group_levels(const uint8_t* bytes, const uint32_t* fifth, int64_t g, V16& low, V16& high) {
  simd::nibbles(bytes, low, high);
  if (fifth != nullptr) {
    low = simd::add(low, simd::sixteens(fifth[g]));
    high = simd::add(high, simd::sixteens(fifth[g] >> 16));
  }
}

// Dot products of R input rows (x, x + k, ...) with W weight rows (w, w + k, ...): out[r * out_stride + b] gets input
// row r against weight row b. Each (weight row, input row) pair has 32 partial sums (input i goes to sum i mod 32, in
// input order), added by the halving tree at the end (lane j + lane j + 16, then + 8, + 4, + 2, + 1). Sums 0-15 and
// 16-31 never meet until then, so a backend short of registers (simd::kTwoPass: AVX2's sixteen) takes them in two
// passes over the inputs, one vector of accumulators a pair at a time, which leaves room for more pairs; AVX-512
// keeps both in one pass, which gives its multiply-adds twice the independent chains. Which pairs share a call, and
// the passes, change only the loads (each weight vector is loaded once for all R input rows, each input vector once
// for all W weight rows), never a pair's operations, so every output is the same bits whatever W, R and the
// backend. k is a multiple of 32.
template <int W, int R>
inline void dot_block(const float* x, const float* w, int64_t k, float* out, int64_t out_stride) {
  V16 sums[W][R][2];
  if constexpr (simd::kTwoPass) {
    for (int j = 0; j < 2; ++j) {
      V16 a[W][R];
      for (int b = 0; b < W; ++b)
        for (int r = 0; r < R; ++r) a[b][r] = simd::zero();
      for (int64_t i = 16 * j; i < k; i += 32) {
        V16 wv[W];
        for (int b = 0; b < W; ++b) wv[b] = simd::load(w + b * k + i);
        for (int r = 0; r < R; ++r) {
          const V16 xv = simd::load(x + r * k + i);
          for (int b = 0; b < W; ++b) a[b][r] = simd::fmadd(xv, wv[b], a[b][r]);
        }
      }
      for (int b = 0; b < W; ++b)
        for (int r = 0; r < R; ++r) sums[b][r][j] = a[b][r];
    }
  } else {
    for (int b = 0; b < W; ++b)
      for (int r = 0; r < R; ++r) sums[b][r][0] = sums[b][r][1] = simd::zero();
    for (int64_t i = 0; i < k; i += 32)
      for (int j = 0; j < 2; ++j) {
        V16 wv[W];
        for (int b = 0; b < W; ++b) wv[b] = simd::load(w + b * k + i + 16 * j);
        for (int r = 0; r < R; ++r) {
          const V16 xv = simd::load(x + r * k + i + 16 * j);
          for (int b = 0; b < W; ++b) sums[b][r][j] = simd::fmadd(xv, wv[b], sums[b][r][j]);
        }
      }
  }
  for (int b = 0; b < W; ++b)
    for (int r = 0; r < R; ++r) out[r * out_stride + b] = simd::reduce_add(simd::add(sums[b][r][0], sums[b][r][1]));
}

// `count` weight rows (w, w + k, ...; count <= simd::kPairs) against R input rows, in the largest tiles that keep
// the accumulators in registers.
template <int R>
inline void dot_rows(const float* x, const float* w, int64_t count, int64_t k, float* out, int64_t out_stride) {
  constexpr int W = simd::kPairs / R > 0 ? simd::kPairs / R : 1;
  int64_t b = 0;
  for (; b + W <= count; b += W) dot_block<W, R>(x, w + b * k, k, out + b, out_stride);
  for (; b < count; ++b) dot_block<1, R>(x, w + b * k, k, out + b, out_stride);
}

// One output row's weights into a float32 buffer, 32 inputs at a time by the Rows type's chunk(): Int4Rows::row and
// Int8Rows::row.
template <typename Rows>
inline void row_by_chunks(const Rows& rows, int64_t n, int64_t chunks, float* w) {
  for (int64_t c = 0; c < chunks; ++c) {
    V16 a, b;
    rows.chunk(n, c, a, b);
    simd::store(w + c * kGroup, a);
    simd::store(w + c * kGroup + 16, b);
  }
}

// How a layer keeps its scales (and minima): float32 per group; IEEE halves per group, where the file keeps them so
// (GGUF's Q4_0, Q4_1, Q5_0, Q5_1); or as K-quants keep them (Q4_K, Q5_K, Q6_K): a small integer per group (6 bits,
// or Q6_K's signed 8 per 16 inputs) times a float32 per super-block of 256 inputs. Each form gives the same float
// per group as the float32 form of the same weights (a half widens exactly; a K-quant's float is the one product
// d * sc its dequantisation rounds once), so the same bits, from fewer bytes: 0.75 bytes a 4-bit weight as float32,
// 0.625 as halves, 0.578 as K-quant sub-scales. kHalfOffset: halves, and every group's minimum the same multiple
// (`offset`: -8 or -16, so the product is exact) of its scale, as GGUF's symmetric Q4_0 (-8 d) and Q5_0 (-16 d)
// dequantise: no minima stored, 0.5625 bytes a 4-bit weight, as in the file.
enum class ScaleForm { kFloat, kHalf, kSuper, kHalfOffset };

// One output row's weights, dequantised into a float32 buffer (what multiply() takes).
//   kFloat / kHalf: scale and minimum [out, groups] float32 / uint16_t halves;
//   kHalfOffset:    scale [out, groups] uint16_t halves, the minimum offset * scale (minimum unused);
//   kSuper:         scale [out, blocks, 40] uint8, minimum unused: a row's K-quant scales as one stream, a block
//                   per sixteen groups (two super-blocks): each group's sc (16 bytes), each group's m (16 bytes),
//                   the two super-blocks' d (halves, 4 bytes), then their dmin (4 bytes), zero past the row. The
//                   group's scale is d * sc, its minimum -(dmin * m). As four streams a row (sc, m, d, dmin
//                   apart), the scales made a layer read from memory a fifth to a quarter slower (docs/kernels.md).
constexpr int64_t kSuperBlockBytes = 40;

struct Int4Rows {
  const uint8_t* packed;
  const void* scale;
  const void* minimum;
  int64_t groups;
  const uint32_t* fifth = nullptr;  // 5 bits: [out, groups] words of fifth bits
  ScaleForm form = ScaleForm::kFloat;
  float offset = 0.0f;  // kHalfOffset
  // kSuper: the block holding group c of row n, and a half in it.
  const uint8_t* super_block(int64_t n, int64_t c) const {
    return static_cast<const uint8_t*>(scale) + (n * ((groups + 15) / 16) + c / 16) * kSuperBlockBytes;
  }
  static float half_at(const uint8_t* block, int64_t at) {
    uint16_t half;
    std::memcpy(&half, block + at, sizeof half);
    return simd::half_to_float(half);
  }
  float scale_at(int64_t n, int64_t c) const {
    switch (form) {
      case ScaleForm::kHalf:
      case ScaleForm::kHalfOffset: return simd::half_to_float(static_cast<const uint16_t*>(scale)[n * groups + c]);
      case ScaleForm::kSuper: {
        const uint8_t* block = super_block(n, c);
        return half_at(block, 32 + 2 * (c % 16 / 8)) * static_cast<float>(block[c % 16]);
      }
      default: return static_cast<const float*>(scale)[n * groups + c];
    }
  }
  float minimum_at(int64_t n, int64_t c) const {
    switch (form) {
      case ScaleForm::kHalf: return simd::half_to_float(static_cast<const uint16_t*>(minimum)[n * groups + c]);
      case ScaleForm::kHalfOffset: return offset * scale_at(n, c);
      case ScaleForm::kSuper: {
        const uint8_t* block = super_block(n, c);
        return -(half_at(block, 36 + 2 * (c % 16 / 8)) * static_cast<float>(block[16 + c % 16]));
      }
      default: return static_cast<const float*>(minimum)[n * groups + c];
    }
  }
  void row(int64_t n, float* w) const { row_by_chunks(*this, n, groups, w); }
  // Inputs 32c .. 32c + 15 and 32c + 16 .. 32c + 31 of row n: level * scale + minimum, one rounding each.
  void chunk(int64_t n, int64_t c, V16& a, V16& b) const {
    const int64_t g = n * groups + c;
    const V16 s = simd::set1(scale_at(n, c)), lo = simd::set1(minimum_at(n, c));
    group_levels(packed + g * kGroup / 2, fifth, g, a, b);
    a = simd::fmadd(a, s, lo);
    b = simd::fmadd(b, s, lo);
  }
  // For multiply_q8: the levels of groups 2p .. 2p + 3 of row n in simd.h's quad layout (q8_quad), and the minima of
  // groups g .. g + 15 of row n (those past `groups` 0).
  static constexpr bool kMinimum = true;
  static constexpr bool kQuad = true;  // scale units of 32: read a quad at a time (simd.h's quad layout)
  const void* q8_address(int64_t n, int64_t p) const { return packed + (n * groups + 2 * p) * kGroup / 2; }
  // Scales a block at a time: the scales of groups 2 p0 .. 2 p0 + 15 (pairs p0 .. p0 + 7; past the row 0) and the
  // input steps of those groups (`step`: an input row's, zero past its groups to a multiple of 16, so read without a
  // mask). (q8_quad, q8_scales, q8_minima and q8_prefetch_scales: Int4Q8 below, the form and fifth bits fixed at
  // compile time.)
  static int64_t block_pairs() { return 8; }
  V16 q8_steps(const float* step, int64_t p0) const { return simd::load(step + 2 * p0); }
};

// Int4Rows with the scales' form fixed at compile time, for the 8-bit-input kernel's loops: with the form chosen at
// run time there, a layer read from memory ran up to twice as slow (the branch held back the scale loads and
// prefetches the loop waits on; docs/kernels.md). Scales a block at a time: those of groups 2 p0 .. 2 p0 + 15 (pairs
// p0 .. p0 + 7, past the row 0), and the minima of groups g .. g + 15 (g a multiple of 16: two whole K-quant
// super-blocks, or the row's last). `Fifth`: 5-bit levels (fifth set), fixed at compile time for the same reason.
template <ScaleForm F, bool Fifth>
struct Int4Q8 : Int4Rows {
  // Pairs p and p + 1 of row n (`both` false: pair p alone, the row's last) in the quad layout.
  void q8_quad(int64_t n, int64_t p, bool both, simd::L64& low, simd::L64& high) const {
    const int64_t g = n * groups + 2 * p;
    simd::quad_levels(packed + g * kGroup / 2, Fifth ? fifth + g : nullptr, both, low, high);
  }
  V16 q8_scales(int64_t n, int64_t p0) const { return sixteen(n, 2 * p0, scale, 0); }
  V16 q8_minima(int64_t n, int64_t g) const {
    if constexpr (F == ScaleForm::kSuper) return simd::neg(sixteen(n, g, scale, 1));
    else if constexpr (F == ScaleForm::kHalfOffset) return simd::mul(sixteen(n, g, scale, 0), simd::set1(offset));
    else return sixteen(n, g, minimum, 0);
  }
  V16 sixteen(int64_t n, int64_t g, const void* from, int plane) const {
    const int64_t count = groups - g;
    if constexpr (F == ScaleForm::kSuper) {  // plane 0: d * sc, plane 1: dmin * m (zero past the row, as stored)
      const uint8_t* block = super_block(n, g);
      return simd::mul(simd::from_u8_first(block + 16 * plane, 16),
                       simd::eights_half(reinterpret_cast<const uint16_t*>(block + 32 + 4 * plane)));
    } else if constexpr (F == ScaleForm::kHalf || F == ScaleForm::kHalfOffset)
      return simd::load_first_half(static_cast<const uint16_t*>(from) + n * groups + g, count);
    else
      return simd::load_first(static_cast<const float*>(from) + n * groups + g, count);
  }
  void q8_prefetch_scales(int64_t n, int64_t p0) const {  // a block's scales and minima, to L2
    const int64_t g = 2 * p0;
    if constexpr (F == ScaleForm::kSuper) {  // a block may straddle two cache lines
      const uint8_t* block = super_block(n, g);
      __builtin_prefetch(block, 0, 1);
      __builtin_prefetch(block + kSuperBlockBytes - 1, 0, 1);
    } else {
      const int64_t at = (n * groups + g) * (F == ScaleForm::kFloat ? 4 : 2);
      __builtin_prefetch(static_cast<const char*>(scale) + at, 0, 1);
      if constexpr (F != ScaleForm::kHalfOffset) __builtin_prefetch(static_cast<const char*>(minimum) + at, 0, 1);
    }
  }
};

// Signed 8-bit levels, a scale per `group` (32, or Q6_K's 16) inputs: `units` scales a row. kFloat: scale [out, units]
// float32; kSuper (Q6_K): scale [out, units / 16] float32 (each super-block's d) and sub [out, units] int8 (each
// unit's sc): the unit's scale is d * sc.
struct Int8Rows {
  const int8_t* levels;
  const float* scale;
  int64_t units, group;
  const int8_t* sub = nullptr;  // kSuper where set
  float scale_at(int64_t n, int64_t u) const {
    return sub != nullptr ? scale[n * (units / 16) + u / 16] * static_cast<float>(sub[n * units + u])
                          : scale[n * units + u];
  }
  void row(int64_t n, float* w) const { row_by_chunks(*this, n, units * group / kGroup, w); }
  void chunk(int64_t n, int64_t c, V16& a, V16& b) const {
    const int8_t* p = levels + n * units * group + 32 * c;
    const int64_t u = 32 * c / group;
    a = simd::mul(simd::from_i8(p), simd::set1(scale_at(n, u)));
    b = simd::mul(simd::from_i8(p + 16), simd::set1(scale_at(n, group == 16 ? u + 1 : u)));
  }
  static constexpr bool kMinimum = false;
  static constexpr int kPrefetchEvery = 1;
  static constexpr bool kPlane = false;
  static constexpr bool kOffset = false;
  static constexpr bool kQuad = false;
  const void* q8_address(int64_t n, int64_t p) const { return levels + n * units * group + 64 * p; }
  simd::L64 q8_pair(int64_t n, int64_t p) const { return simd::pair_int8(levels + n * units * group + 64 * p); }
  // As Int4Rows's; a scale per 16 inputs (Q6_K) makes four scales a pair, so a block of sixteen is four pairs.
  int64_t block_pairs() const { return group == 16 ? 4 : 8; }
  V16 q8_steps(const float* step, int64_t p0) const {
    const int64_t inputs = units * group / kGroup;  // the input row's groups of 32
    return group == 16 ? simd::doubled(step + 2 * p0, inputs - 2 * p0) : simd::load(step + 2 * p0);  // zero-padded
  }
  simd::Lanes q8_lanes(int i) const { return group == 16 ? simd::quad_lanes(i) : simd::pair_lanes(i); }
  static V16 q8_dot(const simd::L64& w, const simd::L64& q) { return simd::dot4_signed(w, q); }
};

// Int8Rows with the scales' form fixed at compile time (as Int4Q8): K (Q6_K's sub-scales) or float32.
template <bool K>
struct Int8Q8 : Int8Rows {
  V16 q8_scales(int64_t n, int64_t p0) const {
    const int64_t u = group == 16 ? 4 * p0 : 2 * p0;
    if constexpr (K)  // u is a multiple of 16: one super-block
      return simd::mul(simd::from_i8_first(sub + n * units + u, units - u), simd::set1(scale[n * (units / 16) + u / 16]));
    else
      return simd::load_first(scale + n * units + u, units - u);
  }
  void q8_prefetch_scales(int64_t n, int64_t p0) const {
    const int64_t u = group == 16 ? 4 * p0 : 2 * p0;
    if constexpr (K) {
      __builtin_prefetch(sub + n * units + u, 0, 1);
      __builtin_prefetch(scale + n * (units / 16) + u / 16, 0, 1);
    } else {
      __builtin_prefetch(scale + n * units + u, 0, 1);
    }
  }
};

// 6-bit signed levels with Q6_K's scales, as a GGUF file keeps them: Int8Q8<true>'s scales (a signed sub-scale per 16
// inputs, a float32 per 256), each level plus 32 in simd::pair_levels6's storage: packed [out, in / 2] nibbles as a
// 4-bit layer's, plane [out, in / 4] the top two bits. The same levels and scales as the 8-bit K form of the same tensor,
// taken by the same operations, so the same bits from 6.6 bits a weight instead of 8.6.
struct Int6Rows : Int8Q8<true> {
  const uint8_t* packed = nullptr;
  const uint8_t* plane = nullptr;
  Int6Rows(const uint8_t* packed_levels, const uint8_t* top_bits, const float* super, const int8_t* sub_scales,
           int64_t in_features)
      : Int8Q8<true>{Int8Rows{nullptr, super, in_features / 16, 16, sub_scales}}, packed(packed_levels),
        plane(top_bits) {}
  int64_t in() const { return units * 16; }
  void row(int64_t n, float* w) const { row_by_chunks(*this, n, in() / kGroup, w); }
  void chunk(int64_t n, int64_t c, V16& a, V16& b) const {
    simd::six_group(packed + n * in() / 2 + 16 * c, plane + n * in() / 4 + 16 * (c / 2), static_cast<int>(c % 2), a, b);
    a = simd::mul(a, simd::set1(scale_at(n, 2 * c)));
    b = simd::mul(b, simd::set1(scale_at(n, 2 * c + 1)));
  }
  static constexpr int kPrefetchEvery = 2;
  static constexpr bool kPlane = true;  // a second stream to prefetch: the top bits, 16 bytes a pair
  static constexpr bool kOffset = true;  // levels stored plus 32: products through simd::dot4_six
  static V16 q8_dot_base(const simd::L64& w, const simd::L64& q, const simd::I16& base) {
    return simd::dot4_six(w, q, base);
  }
  const void* q8_address(int64_t n, int64_t p) const { return packed + n * in() / 2 + 32 * p; }
  const void* q8_plane_address(int64_t n, int64_t p) const { return plane + n * in() / 4 + 16 * p; }
  simd::L64 q8_pair(int64_t n, int64_t p) const {
    return simd::pair_levels6(packed + n * in() / 2 + 32 * p, plane + n * in() / 4 + 16 * p);
  }
};

// out [rows, out_features] = x [rows, k] times the dequantised weights of `weights` (products.cpp; instantiated there
// for Int4Rows, Int6Rows and Int8Rows). q8: inputs rounded to 8 bits per group where use_q8_inputs() allows.
template <typename Rows>
void multiply(const float* xp, int64_t rows, int64_t k, int64_t out_features, float* op, const Rows& weights,
              bool q8 = true);
extern template void multiply<Int4Rows>(const float*, int64_t, int64_t, int64_t, float*, const Int4Rows&, bool);
extern template void multiply<Int6Rows>(const float*, int64_t, int64_t, int64_t, float*, const Int6Rows&, bool);
extern template void multiply<Int8Rows>(const float*, int64_t, int64_t, int64_t, float*, const Int8Rows&, bool);

// Whether quantised layers take 8-bit inputs (the default); use_q8_inputs(false) gives the float-input kernels, for
// comparing the two. Returns the setting.
bool use_q8_inputs(bool on);

// The screened head's screen (products.cpp): dots[(j - begin) * rows + r] = the integer sum over k inputs of row j's
// 4-bit levels (wp: [vocabulary, k / 2] nibbles) times input row r's 8-bit levels (x8: [rows, k]), for vocabulary
// rows begin .. end - 1. use_vnni: whether x86 builds take VNNI's instruction for it where the CPU has it (the same
// integers either way); returns the setting.
void screen_range(const uint8_t* wp, const int8_t* x8, int64_t rows, int64_t k, int64_t begin, int64_t end,
                  int32_t* dots);
bool use_vnni(bool on);

}  // namespace JOINTSPEC_NS
