// Sixteen-float vectors for jointspec's CPU kernels (grouped_linear.cpp), in four backends picked by the build:
//   JOINTSPEC_ISA_AVX512  one AVX-512 register        (built with -mavx512f -mavx512bw -mavx512vl -mavx512dq ...;
//                                                      with -mavx512vnni too: the avx512vnni build)
//   JOINTSPEC_ISA_AVX2    two AVX2 registers           (built with -mavx2 -mfma; with -mavxvnni too: the avx2vnni
//                                                      build)
//   JOINTSPEC_ISA_NEON    four NEON registers          (AArch64 built with -march=armv8.2-a+dotprod: the neondot
//                                                      build, for ARM CPUs with the dot-product instructions)
//   neither               sixteen floats in an array   (plain C++: any CPU with a C++ compiler)
//
// The contract that makes the backends interchangeable: every operation here is defined lane by lane with one IEEE
// rounding (fmadd rounds a * b + c once), every reduction by one fixed tree written out below, and the kernels are
// built with -ffp-contract=off so the compiler fuses nothing on its own. So a kernel written once on V16 gives the
// same bits on all four backends (a NaN's payload aside: which NaN an invalid operation makes differs between CPUs),
// and tests can hold them against each other. Only integer dot products (the
// screened head's screen_dots, and dot8 / dot4_signed / dot4_six below) differ in instructions, and integer sums have
// no order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(JOINTSPEC_ISA_AVX512)
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__))
#error "JOINTSPEC_ISA_AVX512 needs -mavx512f -mavx512bw -mavx512vl -mavx512dq"
#endif
#include <immintrin.h>
#if defined(__AVX512VNNI__)  // the avx512vnni build: the same kernels, integer products by VNNI's instruction
#define JOINTSPEC_ISA_NAME "avx512vnni"
#else
#define JOINTSPEC_ISA_NAME "avx512"
#endif
#elif defined(JOINTSPEC_ISA_AVX2)
#if !(defined(__AVX2__) && defined(__FMA__))
#error "JOINTSPEC_ISA_AVX2 needs -mavx2 -mfma"
#endif
#include <immintrin.h>
#if defined(__AVXVNNI__)  // the avx2vnni build: the same kernels, integer products by AVX-VNNI's instruction
#define JOINTSPEC_ISA_NAME "avx2vnni"
#else
#define JOINTSPEC_ISA_NAME "avx2"
#endif
#elif defined(JOINTSPEC_ISA_NEON)
#if !(defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD))
#error "JOINTSPEC_ISA_NEON needs AArch64 with the dot-product extension (-march=armv8.2-a+dotprod)"
#endif
#include <arm_neon.h>
#define JOINTSPEC_ISA_NAME "neondot"
#else
#define JOINTSPEC_ISA_PORTABLE 1
#define JOINTSPEC_ISA_NAME "portable"
#endif

namespace simd {

// e^x, the constants: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes' coefficients).
constexpr float kExpLow = -87.3f;  // below this e^x is denormal: clamped (about 1e-38, an exact 0 after the softmax)
constexpr float kExpHigh = 88.0f;  // above this 2^n would not be a normal float; e^88 = 1.6e38 is as good as infinity
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

// 127 / top, the inputs' scale to levels; 0 (every level 0) where top is 0, or so small (under about 3.7e-37) that
// 127 / top overflows: infinity times the inputs gave levels of -128, whatever their signs.
inline float inverse_of(float top) {
  const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
  return std::isfinite(inverse) ? inverse : 0.0f;
}
// A group of 8-bit inputs that holds NaN or infinity (activations already broken): levels 0 and a NaN step, so the
// product comes out NaN as the float path's does, on every build. Converting NaN to an integer is undefined in C++
// and INT_MIN in the x86 instructions, and max() drops a NaN, which gave finite rows that differed by build.
inline int nonfinite_group(int8_t* out, float& step, int64_t high) {
  std::memset(out, 0, 16);
  std::memset(out + high, 0, 16);
  step = std::numeric_limits<float>::quiet_NaN();
  return 0;
}

#if defined(JOINTSPEC_ISA_AVX512)
struct V16 {
  __m512 v;
};
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
// Sixteen IEEE half-precision values, widened (exactly: every half is a float).
inline V16 load_half(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
inline V16 load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }  // the rest 0
inline void store_first(float* p, V16 a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline V16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline V16 fnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // lane: a > b ? a : b
inline V16 min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }  // lane: a < b ? a : b
inline uint32_t at_least(V16 a, float bar) {  // bit i: lane i >= bar (false for NaN, as the scalar >=)
  return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(bar), _CMP_GE_OQ);
}
inline V16 round_even(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral n in [-126, 127] (a normal float: exact).
inline V16 pow2(V16 n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
// Lanes 0-15: bytes 0-15 of p as unsigned / signed integers.
inline V16 from_u8(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))}; }
inline V16 from_i8(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))}; }
inline V16 from_i8(const int8_t* p) { return from_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// K-quant sub-scales: the first n (<= 16) bytes of p as unsigned / signed integers, the rest 0; p[0] in lanes 0-7 and
// p[1] in lanes 8-15 (or 0 where !two): a super-block's float for each of its eight groups; and -a, exactly.
// (Plain loads where the whole block is there: a masked load measured slower here, in the loops that take these.)
inline __m128i first_bytes(const void* p, int64_t n) {
  return n >= 16 ? _mm_loadu_si128(static_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(first(n), p);
}
inline V16 from_u8_first(const uint8_t* p, int64_t n) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first_bytes(p, n)))}; }
inline V16 from_i8_first(const int8_t* p, int64_t n) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first_bytes(p, n)))}; }
inline V16 eights(const float* p, bool two) {
  const __m512 low = _mm512_set1_ps(p[0]);
  return {two ? _mm512_insertf32x8(low, _mm256_set1_ps(p[1]), 1) : _mm512_maskz_mov_ps(0x00FF, low)};
}
inline V16 neg(V16 a) { return {_mm512_xor_ps(a.v, _mm512_set1_ps(-0.0f))}; }
// Levels of a 4-bit group of 32: byte i holds level i (low nibble) and level i + 16 (high nibble).
inline void nibbles(const uint8_t* p, V16& low, V16& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
  low = from_u8(_mm_and_si128(bytes, mask));
  high = from_u8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}
// 16.0 in lane i where bit i of `bits` is set, else 0 (a 5-bit level's fifth bit).
inline V16 sixteens(uint32_t bits) { return {_mm512_maskz_mov_ps(__mmask16(bits & 0xFFFF), _mm512_set1_ps(16.0f))}; }
// The halving tree: lane j + lane j + 8, then j + j + 4, j + j + 2, j + j + 1.
inline float reduce_add(V16 a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)));
}
// Sixteen vectors in, one out: lane j is vector j's sum by the tree (B0 + B1) + (B2 + B3), where B_L =
// (x[4L] + x[4L + 2]) + (x[4L + 1] + x[4L + 3]); about 3 instructions a vector where a horizontal sum costs 10.
inline V16 sum_lanes16(const V16* v) {
  __m512 t[8], s[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane L: B_L of each of vectors 4i .. 4i + 3
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 r0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 r1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(r0, r1, _MM_SHUFFLE(3, 1, 3, 1)))};
}
// (weight row, input row) pairs a short-forward kernel call takes together, and whether their 32 partial sums go in
// one pass or two (grouped_linear.cpp's dot_block): the accumulators must stay in registers.
constexpr int kPairs = 4;
constexpr bool kTwoPass = false;

#elif defined(JOINTSPEC_ISA_AVX2)
struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load_half(const uint16_t* p) {  // F16C: every AVX2 CPU has it (the build asks for -mf16c)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline __m256i first8(int64_t n) {  // lanes < n all ones
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))), index);
}
// load_first and load_first_half are inlined by force: GCC stopped inlining them into the quad loop's function,
// and the calls (each a vzeroupper and a trip through memory) cost more than the loop saved.
// A whole vector is read by plain loads: masked ones are slow on some CPUs (AMD's Zen 3 among them).
__attribute__((always_inline)) inline V16 load_first(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  return {_mm256_maskload_ps(p, first8(n)), _mm256_maskload_ps(p + 8, first8(n - 8))};
}
inline void store_first(float* p, V16 a, int64_t n) {
  _mm256_maskstore_ps(p, first8(n), a.lo);
  _mm256_maskstore_ps(p + 8, first8(n - 8), a.hi);
}
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
#define JOINTSPEC_V16_BINARY(name, op) \
  inline V16 name(V16 a, V16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
JOINTSPEC_V16_BINARY(add, _mm256_add_ps)
JOINTSPEC_V16_BINARY(sub, _mm256_sub_ps)
JOINTSPEC_V16_BINARY(mul, _mm256_mul_ps)
JOINTSPEC_V16_BINARY(div, _mm256_div_ps)
JOINTSPEC_V16_BINARY(max, _mm256_max_ps)
JOINTSPEC_V16_BINARY(min, _mm256_min_ps)
#undef JOINTSPEC_V16_BINARY
inline uint32_t at_least(V16 a, float bar) {  // bit i: lane i >= bar (false for NaN, as the scalar >=)
  const __m256 level = _mm256_set1_ps(bar);
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, level, _CMP_GE_OQ))) |
         uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, level, _CMP_GE_OQ))) << 8;
}
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 fnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 round_even(V16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 pow2(V16 n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline V16 from_u8(__m128i bytes) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline V16 from_i8(__m128i bytes) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline V16 from_i8(const int8_t* p) { return from_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Bytes 0 .. 4 * words - 1 of p (words <= 8), the rest 0: up to four words by loads of exactly their size, more by
// one masked load (slow on some CPUs, as above). A copy into a buffer and a wide load of it instead stalls (the load
// cannot take its bytes from the copy's smaller stores until they reach the cache), once per weight row at widths
// that leave part of a block of scales (576 inputs: 18 groups; docs/kernels.md).
inline __m256i first_words(const void* p, int64_t words) {
  const char* bytes = static_cast<const char*>(p);
  // The low half, the high one zero (_mm256_zextsi128_si256 says the same, but older compilers lack it).
  const auto widen = [](__m128i low) { return _mm256_inserti128_si256(_mm256_setzero_si256(), low, 0); };
  int word;
  switch (words) {
    case 1:
      std::memcpy(&word, bytes, 4);
      return widen(_mm_cvtsi32_si128(word));
    case 2: return widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    case 3:
      std::memcpy(&word, bytes + 8, 4);
      return widen(_mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)), word, 2));
    case 4: return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    default: return _mm256_maskload_epi32(reinterpret_cast<const int*>(bytes), first8(words));
  }
}
inline __m128i first_bytes(const void* p, int64_t n) {  // bytes 0 .. n - 1 of p (n <= 16), the rest 0
  if (n >= 16) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  if (n % 4 == 0) return _mm256_castsi256_si128(first_words(p, n / 4));
  alignas(16) uint8_t buffer[16] = {};
  std::memcpy(buffer, p, static_cast<size_t>(std::max<int64_t>(n, 0)));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buffer));
}
inline V16 from_u8_first(const uint8_t* p, int64_t n) { return from_u8(first_bytes(p, n)); }
inline V16 from_i8_first(const int8_t* p, int64_t n) {
  const __m128i bytes = first_bytes(p, n);
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline V16 eights(const float* p, bool two) { return {_mm256_set1_ps(p[0]), two ? _mm256_set1_ps(p[1]) : _mm256_setzero_ps()}; }
inline V16 neg(V16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}
inline void nibbles(const uint8_t* p, V16& low, V16& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
  low = from_u8(_mm_and_si128(bytes, mask));
  high = from_u8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}
inline __m256 sixteens8(uint32_t bits) {
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits & 0xFF)), lane_bits), lane_bits);
  return _mm256_and_ps(_mm256_castsi256_ps(set), _mm256_set1_ps(16.0f));
}
inline V16 sixteens(uint32_t bits) { return {sixteens8(bits), sixteens8(bits >> 8)}; }
inline float reduce_add(V16 a) {  // the halving tree, as for AVX-512
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)));
}
// The AVX-512 tree on half-width registers: the same unpacks within each 128-bit lane give B_L of four vectors at a
// time (B0, B1 from the low halves, B2, B3 from the high ones), then (B0 + B1) + (B2 + B3).
inline __m128 sum_lanes4_128(const V16* v) {  // vectors v[0 .. 3]
  __m256 s[2];
  for (int half = 0; half < 2; ++half) {
    __m256 t[2];
    for (int j = 0; j < 2; ++j) {
      const __m256 a = half ? v[2 * j].hi : v[2 * j].lo;
      const __m256 b = half ? v[2 * j + 1].hi : v[2 * j + 1].lo;
      t[j] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    }
    const __m256d a = _mm256_castps_pd(t[0]), b = _mm256_castps_pd(t[1]);
    s[half] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  const __m128 low = _mm_add_ps(_mm256_castps256_ps128(s[0]), _mm256_extractf128_ps(s[0], 1));   // B0 + B1
  const __m128 high = _mm_add_ps(_mm256_castps256_ps128(s[1]), _mm256_extractf128_ps(s[1], 1));  // B2 + B3
  return _mm_add_ps(low, high);
}
inline V16 sum_lanes16(const V16* v) {
  __m128 out[4];
  for (int i = 0; i < 4; ++i) out[i] = sum_lanes4_128(v + 4 * i);
  return {_mm256_set_m128(out[1], out[0]), _mm256_set_m128(out[3], out[2])};
}
// Four vectors' sums (sum_lanes16's tree, lane by lane), each times `scale`, into out[0 .. 3]. Scoring keys four at a
// time keeps AVX2's sixteen registers from spilling sixteen keys' accumulators (grouped_linear.cpp's score16_full).
constexpr int kSumGroup = 4;
inline void sum_lanes_scaled(const V16* v, float scale, float* out) {
  _mm_storeu_ps(out, _mm_mul_ps(sum_lanes4_128(v), _mm_set1_ps(scale)));
}
constexpr int kPairs = 4;  // two passes: a pair's accumulators take two registers, eight of sixteen
constexpr bool kTwoPass = true;

#elif defined(JOINTSPEC_ISA_NEON)
struct V16 {
  float32x4_t q[4];  // lanes 0-3, 4-7, 8-11, 12-15
};
#define JOINTSPEC_V16_EACH(expression) \
  V16 r;                               \
  for (int i = 0; i < 4; ++i) r.q[i] = (expression); \
  return r;
inline V16 load(const float* p) { JOINTSPEC_V16_EACH(vld1q_f32(p + 4 * i)) }
inline V16 load_half(const uint16_t* p) { JOINTSPEC_V16_EACH(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)))) }
inline void store(float* p, V16 a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.q[i]);
}
// Partial vectors through a buffer (the rest 0): off the hot loops, which read whole vectors.
inline V16 load_first(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  alignas(16) float buffer[16] = {};
  std::memcpy(buffer, p, sizeof(float) * static_cast<size_t>(std::max<int64_t>(n, 0)));
  return load(buffer);
}
inline void store_first(float* p, V16 a, int64_t n) {
  if (n >= 16) return store(p, a);
  alignas(16) float buffer[16];
  store(buffer, a);
  std::memcpy(p, buffer, sizeof(float) * static_cast<size_t>(std::max<int64_t>(n, 0)));
}
inline V16 set1(float x) { JOINTSPEC_V16_EACH(vdupq_n_f32(x)) }
inline V16 zero() { return set1(0.0f); }
inline V16 add(V16 a, V16 b) { JOINTSPEC_V16_EACH(vaddq_f32(a.q[i], b.q[i])) }
inline V16 sub(V16 a, V16 b) { JOINTSPEC_V16_EACH(vsubq_f32(a.q[i], b.q[i])) }
inline V16 mul(V16 a, V16 b) { JOINTSPEC_V16_EACH(vmulq_f32(a.q[i], b.q[i])) }
inline V16 div(V16 a, V16 b) { JOINTSPEC_V16_EACH(vdivq_f32(a.q[i], b.q[i])) }
// As x86's max and min, not NEON's (which return NaN where either lane is NaN): a > b ? a : b, a < b ? a : b.
inline V16 max(V16 a, V16 b) { JOINTSPEC_V16_EACH(vbslq_f32(vcgtq_f32(a.q[i], b.q[i]), a.q[i], b.q[i])) }
inline V16 min(V16 a, V16 b) { JOINTSPEC_V16_EACH(vbslq_f32(vcltq_f32(a.q[i], b.q[i]), a.q[i], b.q[i])) }
inline uint32_t at_least(V16 a, float bar) {  // bit i: lane i >= bar (false for NaN, as the scalar >=)
  static const uint32_t kBits[4] = {1, 2, 4, 8};
  const uint32x4_t bits = vld1q_u32(kBits);
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= vaddvq_u32(vandq_u32(vcgeq_f32(a.q[i], vdupq_n_f32(bar)), bits)) << (4 * i);
  return out;
}
inline V16 fmadd(V16 a, V16 b, V16 c) { JOINTSPEC_V16_EACH(vfmaq_f32(c.q[i], a.q[i], b.q[i])) }   // one rounding
inline V16 fnmadd(V16 a, V16 b, V16 c) { JOINTSPEC_V16_EACH(vfmsq_f32(c.q[i], a.q[i], b.q[i])) }  // c - a * b, one
inline V16 round_even(V16 a) { JOINTSPEC_V16_EACH(vrndnq_f32(a.q[i])) }
inline V16 pow2(V16 n) {
  JOINTSPEC_V16_EACH(vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.q[i]), vdupq_n_s32(127)), 23)))
}
inline V16 from_s8(int8x16_t bytes) {
  const int16x8_t low = vmovl_s8(vget_low_s8(bytes)), high = vmovl_high_s8(bytes);
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(low))), vcvtq_f32_s32(vmovl_high_s16(low)),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(high))), vcvtq_f32_s32(vmovl_high_s16(high))}};
}
inline V16 from_u8(uint8x16_t bytes) {
  const uint16x8_t low = vmovl_u8(vget_low_u8(bytes)), high = vmovl_high_u8(bytes);
  return {{vcvtq_f32_u32(vmovl_u16(vget_low_u16(low))), vcvtq_f32_u32(vmovl_high_u16(low)),
           vcvtq_f32_u32(vmovl_u16(vget_low_u16(high))), vcvtq_f32_u32(vmovl_high_u16(high))}};
}
inline V16 from_i8(const int8_t* p) { return from_s8(vld1q_s8(p)); }
inline V16 from_u8_first(const uint8_t* p, int64_t n) {
  alignas(16) uint8_t buffer[16] = {};
  std::memcpy(buffer, p, static_cast<size_t>(std::clamp<int64_t>(n, 0, 16)));
  return from_u8(vld1q_u8(buffer));
}
inline V16 from_i8_first(const int8_t* p, int64_t n) {
  alignas(16) int8_t buffer[16] = {};
  std::memcpy(buffer, p, static_cast<size_t>(std::clamp<int64_t>(n, 0, 16)));
  return from_s8(vld1q_s8(buffer));
}
inline V16 eights(const float* p, bool two) {
  const float32x4_t low = vdupq_n_f32(p[0]), high = two ? vdupq_n_f32(p[1]) : vdupq_n_f32(0.0f);
  return {{low, low, high, high}};
}
inline V16 neg(V16 a) { JOINTSPEC_V16_EACH(vnegq_f32(a.q[i])) }
inline void nibbles(const uint8_t* p, V16& low, V16& high) {
  const uint8x16_t bytes = vld1q_u8(p);
  low = from_u8(vandq_u8(bytes, vdupq_n_u8(0x0F)));
  high = from_u8(vshrq_n_u8(bytes, 4));
}
inline V16 sixteens(uint32_t bits) {  // 16.0 in lane i where bit i is set
  static const uint32_t kBits[4] = {1, 2, 4, 8};
  const uint32x4_t lane_bits = vld1q_u32(kBits), sixteen = vreinterpretq_u32_f32(vdupq_n_f32(16.0f));
  JOINTSPEC_V16_EACH(vreinterpretq_f32_u32(vandq_u32(vtstq_u32(vdupq_n_u32((bits >> (4 * i)) & 15u), lane_bits), sixteen)))
}
#undef JOINTSPEC_V16_EACH
inline float reduce_add(V16 a) {  // the halving tree, as for AVX-512
  const float32x4_t q = vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3]));  // lane i: h[i] + h[i + 4]
  const float32x4_t e = vaddq_f32(q, vextq_f32(q, q, 2));  // lanes 0, 1: q0 + q2, q1 + q3
  return vgetq_lane_f32(e, 0) + vgetq_lane_f32(e, 1);
}
// Rows of a 4 x 4 block of floats to columns.
inline void transpose4(float32x4_t& a, float32x4_t& b, float32x4_t& c, float32x4_t& d) {
  const float32x4_t ab0 = vtrn1q_f32(a, b), ab1 = vtrn2q_f32(a, b), cd0 = vtrn1q_f32(c, d), cd1 = vtrn2q_f32(c, d);
  a = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(ab0), vreinterpretq_f64_f32(cd0)));
  b = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(ab1), vreinterpretq_f64_f32(cd1)));
  c = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(ab0), vreinterpretq_f64_f32(cd0)));
  d = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(ab1), vreinterpretq_f64_f32(cd1)));
}
// Four vectors' sums by sum_lanes16's tree, lane m vector m's: each 4-lane block B_L = (x[4L] + x[4L + 2]) + (x[4L + 1]
// + x[4L + 3]) of the four vectors at once (their registers L transposed), then (B0 + B1) + (B2 + B3).
inline float32x4_t sum_lanes4(const V16* v) {
  float32x4_t block[4];
  for (int L = 0; L < 4; ++L) {
    float32x4_t x0 = v[0].q[L], x1 = v[1].q[L], x2 = v[2].q[L], x3 = v[3].q[L];
    transpose4(x0, x1, x2, x3);
    block[L] = vaddq_f32(vaddq_f32(x0, x2), vaddq_f32(x1, x3));
  }
  return vaddq_f32(vaddq_f32(block[0], block[1]), vaddq_f32(block[2], block[3]));
}
inline V16 sum_lanes16(const V16* v) { return {{sum_lanes4(v), sum_lanes4(v + 4), sum_lanes4(v + 8), sum_lanes4(v + 12)}}; }
// Four keys at a time, as AVX2 (thirty-two 128-bit registers hold what AVX2's sixteen 256-bit ones do).
constexpr int kSumGroup = 4;
inline void sum_lanes_scaled(const V16* v, float scale, float* out) {
  vst1q_f32(out, vmulq_f32(sum_lanes4(v), vdupq_n_f32(scale)));
}
constexpr int kPairs = 4;  // as AVX2: two passes, a pair's accumulators eight registers of thirty-two
constexpr bool kTwoPass = true;

#else  // portable
struct V16 {
  float v[16];
};
inline V16 load(const float* p) { V16 r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void store(float* p, V16 a) { std::memcpy(p, a.v, sizeof a.v); }
inline V16 load_first(const float* p, int64_t n) {
  V16 r{};
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) r.v[i] = p[i];
  return r;
}
inline void store_first(float* p, V16 a, int64_t n) {
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) p[i] = a.v[i];
}
inline V16 set1(float x) { V16 r; for (float& e : r.v) e = x; return r; }
inline V16 zero() { return V16{}; }
#define JOINTSPEC_V16_LANES(name, expression) \
  inline V16 name(V16 a, V16 b) { V16 r; for (int i = 0; i < 16; ++i) { const float x = a.v[i], y = b.v[i]; r.v[i] = (expression); } return r; }
JOINTSPEC_V16_LANES(add, x + y)
JOINTSPEC_V16_LANES(sub, x - y)
JOINTSPEC_V16_LANES(mul, x * y)
JOINTSPEC_V16_LANES(div, x / y)
JOINTSPEC_V16_LANES(max, x > y ? x : y)
JOINTSPEC_V16_LANES(min, x < y ? x : y)
inline uint32_t at_least(V16 a, float bar) {  // bit i: lane i >= bar (false for NaN)
  uint32_t bits = 0;
  for (int i = 0; i < 16; ++i) bits |= uint32_t(a.v[i] >= bar) << i;
  return bits;
}
#undef JOINTSPEC_V16_LANES
inline V16 fmadd(V16 a, V16 b, V16 c) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
inline V16 fnmadd(V16 a, V16 b, V16 c) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::fma(-a.v[i], b.v[i], c.v[i]); return r; }
inline V16 round_even(V16 a) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::nearbyint(a.v[i]); return r; }
inline V16 pow2(V16 n) {
  V16 r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
    std::memcpy(&r.v[i], &bits, sizeof bits);
  }
  return r;
}
inline void nibbles(const uint8_t* p, V16& low, V16& high) {
  for (int i = 0; i < 16; ++i) {
    low.v[i] = float(p[i] & 15);
    high.v[i] = float(p[i] >> 4);
  }
}
inline V16 from_i8(const int8_t* p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = float(p[i]); return r; }
inline V16 from_u8_first(const uint8_t* p, int64_t n) {
  V16 r{};
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) r.v[i] = float(p[i]);
  return r;
}
inline V16 from_i8_first(const int8_t* p, int64_t n) {
  V16 r{};
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) r.v[i] = float(p[i]);
  return r;
}
inline V16 eights(const float* p, bool two) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = i < 8 ? p[0] : two ? p[1] : 0.0f;
  return r;
}
inline V16 neg(V16 a) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = -a.v[i]; return r; }
inline V16 sixteens(uint32_t bits) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = (bits >> i) & 1 ? 16.0f : 0.0f; return r; }
inline float reduce_add(V16 a) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline V16 sum_lanes16(const V16* v) {
  V16 r;
  for (int j = 0; j < 16; ++j) {
    const float* x = v[j].v;
    float block[4];
    for (int L = 0; L < 4; ++L) block[L] = (x[4 * L] + x[4 * L + 2]) + (x[4 * L + 1] + x[4 * L + 3]);
    r.v[j] = (block[0] + block[1]) + (block[2] + block[3]);
  }
  return r;
}
constexpr int kPairs = 2;
constexpr bool kTwoPass = false;
#endif

#if !defined(JOINTSPEC_ISA_AVX2) && !defined(JOINTSPEC_ISA_NEON)
// Sixteen vectors' sums (sum_lanes16), each times `scale`, into out[0 .. 15]: the AVX-512 and portable builds score
// sixteen keys at once (AVX2 and NEON four: their own sum_lanes_scaled above).
constexpr int kSumGroup = 16;
inline void sum_lanes_scaled(const V16* v, float scale, float* out) { store(out, mul(sum_lanes16(v), set1(scale))); }
#endif

// IEEE half-precision scales and minima (a 4- or 5-bit layer whose file stores them so: GGUF's Q4_0, Q4_1, Q5_0,
// Q5_1), widened to float32 exactly: every half is a float32. The scalar form is plain C++ on every backend (it is
// off the hot loops); the vector forms below use the hardware conversion where there is one, which is exact too.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, exponent = (h >> 10) & 31u, mantissa = h & 1023u;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  }
  // (A NaN comes out quiet, as the hardware conversions of the other builds give it: F16C's and NEON's set the top
  // mantissa bit of a signalling one.)
  const uint32_t nan_quiet = exponent == 31 && mantissa != 0 ? 0x00400000u : 0u;
  const uint32_t bits = sign | nan_quiet |
                        (exponent == 31 ? 0x7F800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
#if defined(JOINTSPEC_ISA_PORTABLE)
inline V16 load_half(const uint16_t* p) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = half_to_float(p[i]); return r; }
#endif
// Two halves, p[0] in lanes 0-7 and p[1] in lanes 8-15, widened exactly: a pair of K-quant super-blocks' floats for
// each of their eight groups (eights() for floats stored as the file stores them).
inline V16 eights_half(const uint16_t* p) {
#if defined(JOINTSPEC_ISA_PORTABLE) || defined(JOINTSPEC_ISA_NEON)
  const float two[2] = {half_to_float(p[0]), half_to_float(p[1])};
  return eights(two, true);
#else
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
#if defined(JOINTSPEC_ISA_AVX512)
  return {_mm512_insertf32x8(_mm512_broadcastss_ps(two), _mm256_broadcastss_ps(_mm_movehdup_ps(two)), 1)};
#else
  return {_mm256_broadcastss_ps(two), _mm256_broadcastss_ps(_mm_movehdup_ps(two))};
#endif
#endif
}

// Two groups of 32 inputs at a time with 8-bit inputs (grouped_linear.cpp's multiply_q8, for the 8- and 6-bit layers;
// the 4- and 5-bit ones take the quad layout below): 64 weight levels of two adjacent groups against the matching 64
// input levels (signed, |q| <= 127). Lane j of the V16 that dot4_signed() or dot4_six() returns is the exact integer
// sum of four products, always the same four whatever the backend:
//   lanes 0-3   group 2p, inputs 0-15 (four each)    lanes 4-7   group 2p + 1, inputs 0-15
//   lanes 8-11  group 2p, inputs 16-31               lanes 12-15 group 2p + 1, inputs 16-31
// which is the byte order a 4-bit pair's 32 packed bytes give (low nibbles: inputs 0-15 of each group, high nibbles:
// 16-31), so the input levels are stored in that order too (64 bytes a pair, loaded by load_q64). Integer sums have
// no rounding, so every backend gives the same lanes. Each lane's float (weight scale times input step) comes from a
// block of sixteen, one lane per scale unit in order, by pick(): pick(block, pair_lanes(i)) gives pair i of eight
// (units are groups: lanes 0-3 and 8-11 take unit 2i, 4-7 and 12-15 unit 2i + 1), pick(block, quad_lanes(i)) pair i of
// four (units are halves of groups, Q6_K's scales: lanes 0-3 take unit 4i, 4-7 4i + 2, 8-11 4i + 1, 12-15 4i + 3).
// doubled(p, n) is p[0], p[0], p[1], p[1], ... (a group's input step for each of its halves).
// pair_levels6() gives a 6-bit pair's levels (GGUF's Q6_K at its own size) as stored, the signed level plus 32
// (0..63): a 4-bit pair's 32 nibble bytes, which give the low four bits, and a plane of 16 bytes whose byte j holds
// the top two bits of layout bytes j, j + 16, j + 32 and j + 48 (bits 0-1, 2-3, 4-5, 6-7). dot4_six() takes the
// signed levels' products from them: each lane's unsigned products plus six_base(q), -32 times the lane's four input
// levels summed (an input vector's, computed once for every weight row it meets): the same integers as the signed
// levels give, in fewer instructions than signed-by-signed products take.
//
// The quad layout: four groups of 32 inputs at a time, for the 4- and 5-bit layers (scale units of 32). Two adjacent
// pairs' 64 packed bytes give two vectors, their low nibbles and their high ones (quad_levels):
//   low:  lanes 0-3 group 4u, inputs 0-15   lanes 4-7 group 4u + 1, inputs 0-15   lanes 8-11 group 4u + 2 ...
//   high: the same lanes, inputs 16-31
// so every lane holds one group in both, and dot8() sums a lane's eight products (four from each) exactly before the
// one conversion and multiply-add a lane: half those of two pairs. The input levels are stored in that order (128
// bytes a quad: the low vector's inputs, then the high one's), and dot8 reads them from there. group_lanes(u) picks
// quad u of a block of sixteen scales (lanes 4j .. 4j + 3 take unit 4u + j). A row with an odd number of pairs ends
// on half a quad: its last two groups' lanes are zero, as are their scales.
// quad_levels is inlined by force: GCC left the AVX2 one out of line, its two results passing through memory, and
// the quad loop then ran slower than the pair loop it replaced.
#if defined(JOINTSPEC_ISA_AVX512)
struct L64 {
  __m512i v;
};
// The 32 bytes in both halves from one load, the high half shifted down four bits, then both masked: three
// instructions where unpacking each half and joining them took five.
// (Here only pair_levels6 takes a pair's nibbles: the 4- and 5-bit layers read quads, quad_levels.)
inline L64 pair_levels(const uint8_t* bytes) {
  const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  return {_mm512_and_si512(_mm512_srlv_epi16(raw, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1)),
                           _mm512_set1_epi8(0x0F))};
}
inline L64 load_q64(const int8_t* q) { return {_mm512_loadu_si512(q)}; }
// acc + the sums of four adjacent unsigned-by-signed byte products, per 32-bit lane (no pair of products here can
// saturate maddubs' 16 bits: weights below 64, or |w| <= 128 against |q| <= 127).
#if defined(__AVX512VNNI__)
inline __m512i dot4_add(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
inline __m512i dot4_add(__m512i acc, __m512i u, __m512i s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
#endif
struct I16 {
  __m512i v;  // sixteen int32
};
inline I16 six_base(L64 q) {
  return {_mm512_sub_epi32(_mm512_setzero_si512(), dot4_add(_mm512_setzero_si512(), _mm512_set1_epi8(32), q.v))};
}
inline V16 dot4_six(L64 u, L64 q, I16 base) { return {_mm512_cvtepi32_ps(dot4_add(base.v, u.v, q.v))}; }
// The first n (<= 16) halves of p, widened (the rest 0).
inline V16 load_first_half(const uint16_t* p, int64_t n) {
  return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p))};
}
struct Lanes {
  __m512i index;
};
inline Lanes pair_lanes(int i) {
  return {_mm512_add_epi32(_mm512_set1_epi32(2 * i), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1))};
}
inline Lanes quad_lanes(int i) {
  return {_mm512_add_epi32(_mm512_set1_epi32(4 * i), _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3))};
}
inline V16 pick(V16 block, Lanes lanes) { return {_mm512_permutexvar_ps(lanes.index, block.v)}; }
inline Lanes group_lanes(int u) {
  return {_mm512_add_epi32(_mm512_set1_epi32(4 * u), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3))};
}
// Both pairs' 64 bytes in one load (`both` false: the first pair's 32, the rest 0), low and high nibbles masked.
__attribute__((always_inline)) inline void quad_levels(const uint8_t* bytes, const uint32_t* fifth, bool both,
                                                       L64& low, L64& high) {
  const __m512i raw = both ? _mm512_loadu_si512(bytes)
                           : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  low.v = _mm512_and_si512(raw, nibble);
  high.v = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
  if (fifth != nullptr) {  // bits 0-15 of group e's word add 16 to low's bytes 16e .., bits 16-31 to high's
    uint64_t low_bits = 0, high_bits = 0;
    for (int e = 0; e < (both ? 4 : 2); ++e) {
      low_bits |= uint64_t(fifth[e] & 0xFFFFu) << (16 * e);
      high_bits |= uint64_t(fifth[e] >> 16) << (16 * e);
    }
    low.v = _mm512_mask_add_epi8(low.v, low_bits, low.v, _mm512_set1_epi8(16));
    high.v = _mm512_mask_add_epi8(high.v, high_bits, high.v, _mm512_set1_epi8(16));
  }
}
#if defined(__AVX512VNNI__)
inline V16 dot8(L64 low, L64 high, const int8_t* q) {
  const __m512i first = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low.v, _mm512_loadu_si512(q));
  return {_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(first, high.v, _mm512_loadu_si512(q + 64)))};
}
#else
// The two vectors' byte-pair sums added as 16-bit integers before widening: weights below 32, so each is at most
// 4 * 31 * 127 in size, no overflow.
inline V16 dot8(L64 low, L64 high, const int8_t* q) {
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(low.v, _mm512_loadu_si512(q)),
                                         _mm512_maddubs_epi16(high.v, _mm512_loadu_si512(q + 64)));
  return {_mm512_cvtepi32_ps(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
#endif
// A block kept for pick() across a loop: in a register (AVX2: in L1, below).
using Held = V16;
inline Held hold(V16 block) { return block; }
inline V16 doubled(const float* p, int64_t n) {
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                _mm512_maskz_loadu_ps(first(std::min<int64_t>(n, 8)), p))};
}
// Signed 8-bit weights of a pair, stored in input order (group 2p's 32, then group 2p + 1's), in the pair layout.
inline L64 pair_int8(const int8_t* w) {
  const __m512i raw = _mm512_loadu_si512(w);  // 128-bit chunks: 2p 0-15, 2p 16-31, 2p+1 0-15, 2p+1 16-31
  return {_mm512_shuffle_i64x2(raw, raw, _MM_SHUFFLE(3, 1, 2, 0))};
}
// The nibbles as pair_levels takes them; the plane in every 128-bit lane, rotated so that lane t's two bits (2t,
// 2t + 1) sit at bits 4-5, taken in by one ternary op.
inline L64 pair_levels6(const uint8_t* bytes, const uint8_t* plane) {
  const __m512i low = pair_levels(bytes).v;
  const __m512i top = _mm512_rolv_epi64(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane))),
                                        _mm512_setr_epi64(4, 4, 2, 2, 0, 0, 62, 62));
  return {_mm512_ternarylogic_epi64(low, top, _mm512_set1_epi8(0x30), 0xF8)};  // low | (top & 0x30)
}
// Signed times signed, as unsigned |w| times q with w's sign (|w| <= 128, |q| <= 127: no saturation).
inline V16 dot4_signed(L64 w, L64 q) {
  const __m512i negative = _mm512_mask_sub_epi8(q.v, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), q.v);
  return {_mm512_cvtepi32_ps(dot4_add(_mm512_setzero_si512(), _mm512_abs_epi8(w.v), negative))};
}
// Inputs x[0 .. 31] of one group as levels q = round(x / step) (ties to even), step = max |x| / 127; q[i] goes to
// out[i] for i < 16 and out[high + i - 16] for the rest (high: 32 in the pair layout above, 64 in the quad layout,
// with out at the group's first byte). Returns the levels' sum, an integer (exact in any order, so every build's).
inline int quantise_group(const float* x, int8_t* out, float& step, int64_t high) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q) || !std::isfinite(top))
    return nonfinite_group(out, step, high);
  step = top / 127.0f;
  const __m512 inverse = _mm512_set1_ps(inverse_of(top));
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + high), _mm512_cvtsepi32_epi8(qb));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

#elif defined(JOINTSPEC_ISA_AVX2)
struct L64 {
  __m256i lo, hi;  // bytes 0-31 (lanes 0-7), 32-63 (lanes 8-15)
};
// 16 in byte i of `spread` where bit i % 8 of that byte is set (each byte holds a copy of the byte its bit is in).
inline __m256i sixteen_where_set(__m256i spread) {
  const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(16));
}
inline L64 pair_levels(const uint8_t* bytes, const uint32_t* fifth) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)), mask = _mm256_set1_epi8(0x0F);
  L64 out{_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask)};
  if (fifth != nullptr) {
    // The pair's two words, one load, as bytes 0-7 of every quadword. The low half's bytes take bits 0-15 of group
    // 2p's word (its bytes 0, 1), then bits 0-15 of group 2p + 1's (bytes 4, 5); the high half bits 16-31 of each
    // (bytes 2, 3 and 6, 7); each byte spread over the eight lanes of its bits.
    int64_t words;
    std::memcpy(&words, fifth, sizeof words);
    const __m256i both = _mm256_set1_epi64x(words);
    out.lo = _mm256_or_si256(out.lo, sixteen_where_set(_mm256_shuffle_epi8(
        both, _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0404040404040404LL, 0x0505050505050505LL))));
    out.hi = _mm256_or_si256(out.hi, sixteen_where_set(_mm256_shuffle_epi8(
        both, _mm256_setr_epi64x(0x0202020202020202LL, 0x0303030303030303LL, 0x0606060606060606LL,
                                 0x0707070707070707LL))));
  }
  return out;
}
inline L64 load_q64(const int8_t* q) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))};
}
// acc + the sums of four adjacent unsigned-by-signed byte products, per 32-bit lane (as the AVX-512 build's dot4_add).
#if defined(__AVXVNNI__)
inline __m256i dot4_add8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
inline __m256i dot4_add8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
struct Lanes {
  __m256i low, high;  // the permutation giving lanes 0-7 and 8-15, from the block's low half or its high one
  bool from_high;
};
inline Lanes pair_lanes(int i) {
  const __m256i index = _mm256_add_epi32(_mm256_set1_epi32((2 * i) % 8), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  return {index, index, i >= 4};
}
inline Lanes quad_lanes(int i) {
  const __m256i base = _mm256_set1_epi32((4 * i) % 8);
  return {_mm256_add_epi32(base, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)),
          _mm256_add_epi32(base, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3)), i >= 2};
}
inline V16 pick(V16 block, const Lanes& lanes) {
  const __m256 from = lanes.from_high ? block.hi : block.lo;
  return {_mm256_permutevar8x32_ps(from, lanes.low), _mm256_permutevar8x32_ps(from, lanes.high)};
}
inline Lanes group_lanes(int u) {
  const __m256i base = _mm256_set1_epi32((4 * u) % 8);
  return {_mm256_add_epi32(base, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
          _mm256_add_epi32(base, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), u >= 2};
}
// A pair's levels are its low nibbles (lo) and its high ones (hi), so a quad's are two pairs' halves side by side.
__attribute__((always_inline)) inline void quad_levels(const uint8_t* bytes, const uint32_t* fifth, bool both,
                                                       L64& low, L64& high) {
  const L64 first = pair_levels(bytes, fifth);
  const L64 second = both ? pair_levels(bytes + 32, fifth == nullptr ? nullptr : fifth + 2)
                          : L64{_mm256_setzero_si256(), _mm256_setzero_si256()};
  low = {first.lo, second.lo};
  high = {first.hi, second.hi};
}
// As the AVX-512 build's: byte-pair sums added as 16-bit integers (no overflow below 32), then widened; with
// AVX-VNNI two dot-product instructions give the same eight-product sums.
#if defined(__AVXVNNI__)
inline __m256 dot8_8(__m256i low, __m256i high, const int8_t* q) {
  const __m256i first = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), low,
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  return _mm256_cvtepi32_ps(
      _mm256_dpbusd_avx_epi32(first, high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64))));
}
#else
inline __m256 dot8_8(__m256i low, __m256i high, const int8_t* q) {
  const __m256i pairs = _mm256_add_epi16(
      _mm256_maddubs_epi16(low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
      _mm256_maddubs_epi16(high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64))));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
inline V16 dot8(const L64& low, const L64& high, const int8_t* q) {
  return {dot8_8(low.lo, high.lo, q), dot8_8(low.hi, high.hi, q + 32)};
}
// Sixteen registers cannot hold a loop's blocks besides its accumulators: kept in L1, each pick() loads the half it
// needs (measured faster than the spills the compiler otherwise makes).
struct Held {
  alignas(32) float v[16];
};
inline Held hold(V16 block) {
  Held out;
  _mm256_store_ps(out.v, block.lo);
  _mm256_store_ps(out.v + 8, block.hi);
  return out;
}
inline V16 pick(const Held& block, const Lanes& lanes) {
  const __m256 from = _mm256_load_ps(block.v + (lanes.from_high ? 8 : 0));
  return {_mm256_permutevar8x32_ps(from, lanes.low), _mm256_permutevar8x32_ps(from, lanes.high)};
}
inline V16 doubled(const float* p, int64_t n) {
  const __m256 eight = n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first8(n));
  return {_mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
          _mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))};
}
__attribute__((always_inline)) inline V16 load_first_half(const uint16_t* p, int64_t n) {
  __m256i raw;
  if (n >= 16) {
    raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else if (n % 2 == 0) {  // always, for the kernels' scales: rows of whole pairs of groups
    raw = first_words(p, n / 2);
  } else {
    alignas(32) uint16_t buffer[16] = {};
    std::memcpy(buffer, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(uint16_t));
    raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(buffer));
  }
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(raw)), _mm256_cvtph_ps(_mm256_extracti128_si256(raw, 1))};
}
inline L64 pair_int8(const int8_t* w) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  return {_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)};
}
// The plane shifted so that each 128-bit lane's two bits sit at bits 4-5 (left 4 and 2 for the low half's lanes, 0
// and right 2 for the high half's).
inline L64 pair_levels6(const uint8_t* bytes, const uint8_t* plane) {
  const L64 low = pair_levels(bytes, nullptr);
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
  const __m256i bits = _mm256_set1_epi8(0x30);
  const __m256i lo = _mm256_and_si256(_mm256_sllv_epi64(both, _mm256_setr_epi64x(4, 4, 2, 2)), bits);
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 2, 2)), bits);
  return {_mm256_or_si256(low.lo, lo), _mm256_or_si256(low.hi, hi)};
}
struct I16 {
  __m256i lo, hi;  // sixteen int32
};
inline I16 six_base(L64 q) {
  const __m256i zero = _mm256_setzero_si256(), c = _mm256_set1_epi8(32);
  return {_mm256_sub_epi32(zero, dot4_add8(zero, c, q.lo)), _mm256_sub_epi32(zero, dot4_add8(zero, c, q.hi))};
}
inline V16 dot4_six(L64 u, L64 q, I16 base) {
  return {_mm256_cvtepi32_ps(dot4_add8(base.lo, u.lo, q.lo)), _mm256_cvtepi32_ps(dot4_add8(base.hi, u.hi, q.hi))};
}
inline __m256 dot4_signed_8(__m256i w, __m256i q) {
  return _mm256_cvtepi32_ps(dot4_add8(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(q, w)));
}
inline V16 dot4_signed(L64 w, L64 q) { return {dot4_signed_8(w.lo, q.lo), dot4_signed_8(w.hi, q.hi)}; }
inline int quantise_group(const float* x, int8_t* out, float& step, int64_t high) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], top8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_shuffle_ps(top4, top4, 1)));
  int unordered = 0;
  for (int i = 0; i < 4; ++i) unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  if (unordered || !std::isfinite(top)) return nonfinite_group(out, step, high);
  step = top / 127.0f;
  const __m256 inverse = _mm256_set1_ps(inverse_of(top));
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // int32 -> int8 (|q| <= 127, no saturation), in order: packs interleave 128-bit halves, the permute undoes it.
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
  const __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + high), _mm256_extracti128_si256(bytes, 1));
  const __m256i eight = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i four = _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
  four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1)));
}

#elif defined(JOINTSPEC_ISA_NEON)
struct L64 {
  int8x16_t q[4];  // bytes 0-15 (lanes 0-3), 16-31 (4-7), 32-47 (8-11), 48-63 (12-15)
};
// The dot-product instruction sums four adjacent signed byte products into each 32-bit lane, the lanes the layouts
// above define. The 4-, 5- and 6-bit layers' levels (0..63) are non-negative as signed bytes, so there signed-by-signed
// products are the x86 builds' unsigned-by-signed ones; the 8-bit layers' signed levels are signed-by-signed by
// definition. No sum can overflow.
inline V16 to_float(const int32x4_t* lanes) {
  return {{vcvtq_f32_s32(lanes[0]), vcvtq_f32_s32(lanes[1]), vcvtq_f32_s32(lanes[2]), vcvtq_f32_s32(lanes[3])}};
}
// 16 in byte j where bit j of `bits` is set (a 5-bit level's fifth bit).
inline uint8x16_t sixteen_where(uint32_t bits) {
  static const uint8_t kBit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t spread = vcombine_u8(vdup_n_u8(uint8_t(bits)), vdup_n_u8(uint8_t(bits >> 8)));
  return vandq_u8(vtstq_u8(spread, vld1q_u8(kBit)), vdupq_n_u8(16));
}
inline L64 pair_levels(const uint8_t* bytes, const uint32_t* fifth) {
  const uint8x16_t a = vld1q_u8(bytes), b = vld1q_u8(bytes + 16), nibble = vdupq_n_u8(0x0F);
  uint8x16_t q[4] = {vandq_u8(a, nibble), vandq_u8(b, nibble), vshrq_n_u8(a, 4), vshrq_n_u8(b, 4)};
  if (fifth != nullptr) {  // group 2p's word: bits 0-15 to bytes 0-15, 16-31 to 32-47; group 2p + 1's to 16-31, 48-63
    q[0] = vorrq_u8(q[0], sixteen_where(fifth[0] & 0xFFFFu));
    q[1] = vorrq_u8(q[1], sixteen_where(fifth[1] & 0xFFFFu));
    q[2] = vorrq_u8(q[2], sixteen_where(fifth[0] >> 16));
    q[3] = vorrq_u8(q[3], sixteen_where(fifth[1] >> 16));
  }
  return {{vreinterpretq_s8_u8(q[0]), vreinterpretq_s8_u8(q[1]), vreinterpretq_s8_u8(q[2]), vreinterpretq_s8_u8(q[3])}};
}
inline L64 load_q64(const int8_t* q) { return {{vld1q_s8(q), vld1q_s8(q + 16), vld1q_s8(q + 32), vld1q_s8(q + 48)}}; }
// Every lane picked here takes its four lanes' one source lane (the three layouts' units come four lanes at a
// time), so a pick is four broadcast loads from a block kept in L1, as AVX2's Held.
struct Lanes {
  int from[4];  // the source lane of lanes 4i .. 4i + 3
};
inline Lanes pair_lanes(int i) { return {{2 * i, 2 * i + 1, 2 * i, 2 * i + 1}}; }
inline Lanes quad_lanes(int i) { return {{4 * i, 4 * i + 2, 4 * i + 1, 4 * i + 3}}; }
inline Lanes group_lanes(int u) { return {{4 * u, 4 * u + 1, 4 * u + 2, 4 * u + 3}}; }
struct Held {
  alignas(16) float v[16];
};
inline Held hold(V16 block) {
  Held out;
  store(out.v, block);
  return out;
}
inline V16 pick(const Held& block, const Lanes& lanes) {
  return {{vld1q_dup_f32(block.v + lanes.from[0]), vld1q_dup_f32(block.v + lanes.from[1]),
           vld1q_dup_f32(block.v + lanes.from[2]), vld1q_dup_f32(block.v + lanes.from[3])}};
}
inline V16 pick(V16 block, const Lanes& lanes) { return pick(hold(block), lanes); }
__attribute__((always_inline)) inline void quad_levels(const uint8_t* bytes, const uint32_t* fifth, bool both,
                                                       L64& low, L64& high) {
  const L64 first = pair_levels(bytes, fifth);
  const int8x16_t zero = vdupq_n_s8(0);
  const L64 second = both ? pair_levels(bytes + 32, fifth == nullptr ? nullptr : fifth + 2) : L64{{zero, zero, zero, zero}};
  low = {{first.q[0], first.q[1], second.q[0], second.q[1]}};
  high = {{first.q[2], first.q[3], second.q[2], second.q[3]}};
}
inline V16 dot8(const L64& low, const L64& high, const int8_t* q) {
  int32x4_t lanes[4];
  for (int i = 0; i < 4; ++i)
    lanes[i] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), low.q[i], vld1q_s8(q + 16 * i)), high.q[i], vld1q_s8(q + 64 + 16 * i));
  return to_float(lanes);
}
inline V16 doubled(const float* p, int64_t n) {  // p[0], p[0], p[1], p[1], ... (past n: 0)
  alignas(16) float buffer[8] = {};
  std::memcpy(buffer, p, sizeof(float) * static_cast<size_t>(std::clamp<int64_t>(n, 0, 8)));
  V16 r;
  for (int i = 0; i < 4; ++i) {
    const float32x4_t two = vcombine_f32(vld1_f32(buffer + 2 * i), vld1_f32(buffer + 2 * i));
    r.q[i] = vzip1q_f32(two, two);
  }
  return r;
}
inline V16 load_first_half(const uint16_t* p, int64_t n) {
  if (n >= 16) return load_half(p);
  alignas(16) uint16_t buffer[16] = {};
  std::memcpy(buffer, p, sizeof(uint16_t) * static_cast<size_t>(std::max<int64_t>(n, 0)));
  return load_half(buffer);
}
inline L64 pair_int8(const int8_t* w) {  // layout bytes 0-15: w 0-15, 16-31: w 32-47, 32-47: w 16-31, 48-63: w 48-63
  return {{vld1q_s8(w), vld1q_s8(w + 32), vld1q_s8(w + 16), vld1q_s8(w + 48)}};
}
// Layout bytes 16r .. 16r + 15 take bits 2r, 2r + 1 of the plane's bytes as bits 4-5.
inline L64 pair_levels6(const uint8_t* bytes, const uint8_t* plane) {
  const L64 low = pair_levels(bytes, nullptr);
  const uint8x16_t top = vld1q_u8(plane), bits = vdupq_n_u8(0x30);
  const uint8x16_t add[4] = {vandq_u8(vshlq_n_u8(top, 4), bits), vandq_u8(vshlq_n_u8(top, 2), bits), vandq_u8(top, bits),
                             vandq_u8(vshrq_n_u8(top, 2), bits)};
  L64 out;
  for (int i = 0; i < 4; ++i) out.q[i] = vorrq_s8(low.q[i], vreinterpretq_s8_u8(add[i]));
  return out;
}
struct I16 {
  int32x4_t q[4];  // sixteen int32
};
inline I16 six_base(const L64& q) {
  I16 out;
  for (int i = 0; i < 4; ++i) out.q[i] = vnegq_s32(vdotq_s32(vdupq_n_s32(0), vdupq_n_s8(32), q.q[i]));
  return out;
}
inline V16 dot4_six(const L64& u, const L64& q, const I16& base) {
  int32x4_t lanes[4];
  for (int i = 0; i < 4; ++i) lanes[i] = vdotq_s32(base.q[i], u.q[i], q.q[i]);
  return to_float(lanes);
}
inline V16 dot4_signed(const L64& w, const L64& q) {
  int32x4_t lanes[4];
  for (int i = 0; i < 4; ++i) lanes[i] = vdotq_s32(vdupq_n_s32(0), w.q[i], q.q[i]);
  return to_float(lanes);
}
inline int quantise_group(const float* x, int8_t* out, float& step, int64_t high) {
  float32x4_t v[8], top4 = vdupq_n_f32(0.0f);
  uint32x4_t ordered = vdupq_n_u32(~0u);
  for (int i = 0; i < 8; ++i) {
    v[i] = vld1q_f32(x + 4 * i);
    ordered = vandq_u32(ordered, vceqq_f32(v[i], v[i]));
    top4 = vmaxq_f32(top4, vabsq_f32(v[i]));
  }
  const float top = vmaxvq_f32(top4);
  if (vminvq_u32(ordered) == 0 || !std::isfinite(top)) return nonfinite_group(out, step, high);
  step = top / 127.0f;
  const float32x4_t inverse = vdupq_n_f32(inverse_of(top));
  int32x4_t q[8], sum = vdupq_n_s32(0);
  for (int i = 0; i < 8; ++i) {
    q[i] = vcvtnq_s32_f32(vmulq_f32(v[i], inverse));  // to nearest, ties to even
    sum = vaddq_s32(sum, q[i]);
  }
  for (int half = 0; half < 2; ++half) {  // |q| <= 127: the narrowing saturates nothing
    const int16x8_t a = vcombine_s16(vqmovn_s32(q[4 * half]), vqmovn_s32(q[4 * half + 1]));
    const int16x8_t b = vcombine_s16(vqmovn_s32(q[4 * half + 2]), vqmovn_s32(q[4 * half + 3]));
    vst1q_s8(out + (half ? high : 0), vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
  }
  return vaddvq_s32(sum);
}

#else  // portable
struct L64 {
  int32_t v[64];  // levels (weights) or signed levels (inputs), in the pair layout
};
inline L64 pair_levels(const uint8_t* bytes, const uint32_t* fifth) {
  L64 out;
  for (int i = 0; i < 32; ++i) {
    const int e = i / 16, j = i % 16;  // group 2p + e, byte j
    out.v[i] = bytes[i] & 15;
    out.v[32 + i] = bytes[i] >> 4;
    if (fifth != nullptr) {
      out.v[i] += ((fifth[e] >> j) & 1) * 16;
      out.v[32 + i] += ((fifth[e] >> (16 + j)) & 1) * 16;
    }
  }
  return out;
}
inline L64 load_q64(const int8_t* q) { L64 out; for (int i = 0; i < 64; ++i) out.v[i] = q[i]; return out; }
inline V16 dot4(const L64& w, const L64& q) {
  V16 r;
  for (int j = 0; j < 16; ++j) {
    int32_t sum = 0;
    for (int t = 0; t < 4; ++t) sum += w.v[4 * j + t] * q.v[4 * j + t];
    r.v[j] = float(sum);
  }
  return r;
}
struct Lanes {
  int index[16];
};
inline Lanes pair_lanes(int i) {
  Lanes out;
  for (int j = 0; j < 16; ++j) out.index[j] = 2 * i + (j / 4) % 2;
  return out;
}
inline Lanes quad_lanes(int i) {
  static constexpr int kQuad[4] = {0, 2, 1, 3};
  Lanes out;
  for (int j = 0; j < 16; ++j) out.index[j] = 4 * i + kQuad[j / 4];
  return out;
}
inline V16 pick(const V16& block, const Lanes& lanes) {
  V16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = block.v[lanes.index[j]];
  return r;
}
inline Lanes group_lanes(int u) {
  Lanes out;
  for (int j = 0; j < 16; ++j) out.index[j] = 4 * u + j / 4;
  return out;
}
__attribute__((always_inline)) inline void quad_levels(const uint8_t* bytes, const uint32_t* fifth, bool both,
                                                       L64& low, L64& high) {
  const L64 first = pair_levels(bytes, fifth);
  L64 second{};
  if (both) second = pair_levels(bytes + 32, fifth == nullptr ? nullptr : fifth + 2);
  for (int i = 0; i < 32; ++i) {
    low.v[i] = first.v[i];
    low.v[32 + i] = second.v[i];
    high.v[i] = first.v[32 + i];
    high.v[32 + i] = second.v[32 + i];
  }
}
inline V16 dot8(const L64& low, const L64& high, const int8_t* q) {
  V16 r;
  for (int j = 0; j < 16; ++j) {
    int32_t sum = 0;
    for (int t = 0; t < 4; ++t) sum += low.v[4 * j + t] * q[4 * j + t] + high.v[4 * j + t] * q[64 + 4 * j + t];
    r.v[j] = float(sum);
  }
  return r;
}
using Held = V16;
inline Held hold(V16 block) { return block; }
inline V16 doubled(const float* p, int64_t n) {
  V16 r{};
  for (int j = 0; j < 16; ++j) r.v[j] = j / 2 < n ? p[j / 2] : 0.0f;
  return r;
}
inline V16 load_first_half(const uint16_t* p, int64_t n) {
  V16 r{};
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) r.v[i] = half_to_float(p[i]);
  return r;
}
inline L64 pair_int8(const int8_t* w) {
  L64 out;
  for (int i = 0; i < 64; ++i) {  // layout byte i: group (i / 16) % 2, input 16 * (i / 32) + i % 16
    out.v[i] = w[32 * ((i / 16) % 2) + 16 * (i / 32) + i % 16];
  }
  return out;
}
inline L64 pair_levels6(const uint8_t* bytes, const uint8_t* plane) {
  L64 out = pair_levels(bytes, nullptr);
  for (int i = 0; i < 64; ++i) out.v[i] += ((plane[i % 16] >> (2 * (i / 16))) & 3) << 4;
  return out;
}
struct I16 {
  int32_t v[16];
};
inline I16 six_base(const L64& q) {
  I16 out;
  for (int j = 0; j < 16; ++j) out.v[j] = -32 * (q.v[4 * j] + q.v[4 * j + 1] + q.v[4 * j + 2] + q.v[4 * j + 3]);
  return out;
}
inline V16 dot4_six(const L64& u, const L64& q, const I16& base) {
  V16 r;
  for (int j = 0; j < 16; ++j) {
    int32_t sum = base.v[j];
    for (int t = 0; t < 4; ++t) sum += u.v[4 * j + t] * q.v[4 * j + t];
    r.v[j] = float(sum);
  }
  return r;
}
inline V16 dot4_signed(const L64& w, const L64& q) { return dot4(w, q); }
inline int quantise_group(const float* x, int8_t* out, float& step, int64_t high) {
  float top = 0.0f;
  bool finite = true;
  for (int i = 0; i < 32; ++i) {
    top = std::max(top, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
  if (!finite) return nonfinite_group(out, step, high);
  step = top / 127.0f;
  const float inverse = inverse_of(top);
  int total = 0;
  for (int i = 0; i < 32; ++i) {
    const int8_t level = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
    out[i < 16 ? i : high + i - 16] = level;
    total += level;
  }
  return total;
}
#endif

// One group of a 6-bit pair (pair_levels6's storage; `e`: the group's place in its pair, 0 or 1): its signed levels as
// floats, inputs 0-15 in `low` and 16-31 in `high`, from the group's 16 nibble bytes and the pair's plane. The same
// integers as pair_levels6 gives, converted exactly.
#if defined(JOINTSPEC_ISA_NEON)
inline void six_group(const uint8_t* p, const uint8_t* plane, int e, V16& low, V16& high) {
  const uint8x16_t bytes = vld1q_u8(p), top = vld1q_u8(plane), nibble = vdupq_n_u8(0x0F), three = vdupq_n_u8(3);
  const uint8x16_t top_low = vandq_u8(vshlq_u8(top, vdupq_n_s8(int8_t(-2 * e))), three);
  const uint8x16_t top_high = vandq_u8(vshlq_u8(top, vdupq_n_s8(int8_t(-4 - 2 * e))), three);
  const int8x16_t offset = vdupq_n_s8(32);
  low = from_s8(vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(bytes, nibble), vshlq_n_u8(top_low, 4))), offset));
  high = from_s8(vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(bytes, 4), vshlq_n_u8(top_high, 4))), offset));
}
#elif defined(JOINTSPEC_ISA_PORTABLE)
inline void six_group(const uint8_t* p, const uint8_t* plane, int e, V16& low, V16& high) {
  for (int j = 0; j < 16; ++j) {
    low.v[j] = float(((p[j] & 15) | (((plane[j] >> (2 * e)) & 3) << 4)) - 32);
    high.v[j] = float(((p[j] >> 4) | (((plane[j] >> (4 + 2 * e)) & 3) << 4)) - 32);
  }
}
#else
inline void six_group(const uint8_t* p, const uint8_t* plane, int e, V16& low, V16& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i top = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane));
  const __m128i nibble = _mm_set1_epi8(0x0F), three = _mm_set1_epi8(3), offset = _mm_set1_epi8(32);
  const __m128i top_low = _mm_and_si128(_mm_srl_epi16(top, _mm_cvtsi32_si128(2 * e)), three);
  const __m128i top_high = _mm_and_si128(_mm_srl_epi16(top, _mm_cvtsi32_si128(4 + 2 * e)), three);
  low = from_i8(_mm_sub_epi8(_mm_or_si128(_mm_and_si128(bytes, nibble), _mm_slli_epi16(top_low, 4)), offset));
  high = from_i8(_mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_slli_epi16(top_high, 4)),
                              offset));
}
#endif

// e^x lane by lane: the same operations in every backend, so a score's exponential is the same bits everywhere.
inline V16 exp(V16 x) {
  x = min(max(x, set1(kExpLow)), set1(kExpHigh));
  const V16 n = round_even(mul(x, set1(kLog2e)));
  V16 r = fnmadd(n, set1(kLn2High), x);
  r = fnmadd(n, set1(kLn2Low), r);
  V16 p = set1(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = fmadd(p, r, set1(kExpPoly[i]));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return mul(p, pow2(n));
}

}  // namespace simd
