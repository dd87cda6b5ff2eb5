// Quantised linear layers for CPU decoding: y = x W^T with W stored as 4-, 5- or 8-bit levels in groups of 32 inputs,
// one scale (and, for 4 and 5 bits, one minimum; float32, or halves where a file keeps them so) per group; each input
// row is rounded to 8 bits per group (multiply_q8, as llama.cpp does), except for the screened head's exact logits.
// Built at first use by jointspec/kernels/grouped.py (torch.utils.cpp_extension), once per instruction set (simd.h:
// AVX-512, AVX2 + FMA + F16C, portable C++); see that module for why and for the measurements.
//
// Each thread takes a range of output rows. For each row it dequantises the row's weights once into a float32
// buffer that stays in L1 cache, then takes the dot product of that buffer with every input row. So the weights are
// read from memory once per forward whatever the number of input rows (what verifying several draft tokens needs),
// and every output is computed by exactly the same operations whatever the number of rows: a row's result does not
// depend on the batch it came in (what keeps speculative decoding exactly equal to plain decoding). Below them, two
// kernels built on the same rule: row-by-row attention, and a whole Llama decoder layer on 4-bit weights. The product
// itself is products.cpp, a translation unit of its own so that a build compiles on two cores; rows.h holds the weight
// forms both read.
//
// Every floating-point operation goes through simd.h, whose backends give the same bits, so the same model decodes
// the same tokens on every instruction set (tests/test_grouped.py holds the builds against each other).
// ATen and torch's pybind11 glue, not <torch/extension.h>: the C++ frontend headers that one adds took over half of
// a build's time, and nothing here uses them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include "rows.h"

#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>
#include <algorithm>
#include <type_traits>
#include <utility>

namespace JOINTSPEC_NS {
namespace {

// The group size an 8-bit layer's scales give: 32 (Q8_0, Q5_0 and jointspec's own int8) or 16 (Q6_K's sub-blocks).
int64_t int8_group(const at::Tensor& scale, int64_t in_features, const char* name) {
  TORCH_CHECK(scale.dim() == 2 && scale.size(1) > 0 && (scale.size(1) * 32 == in_features ||
              scale.size(1) * 16 == in_features), name, ": an 8-bit layer's scale must be [out, in / 32] or "
              "[out, in / 16], got ", scale.sizes(), " for ", in_features, " inputs");
  return in_features / scale.size(1);
}

void check(const at::Tensor& x, const at::Tensor& levels, int64_t bytes_per_row, const at::Tensor& scale,
           int64_t group = kGroup) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix [rows, in]");
  TORCH_CHECK(x.size(1) % 64 == 0, "in_features must be a multiple of 64, got ", x.size(1));
  TORCH_CHECK(levels.dim() == 2 && levels.is_contiguous() && levels.size(1) == bytes_per_row,
              "levels must be a contiguous [out, ", bytes_per_row, "] matrix");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == levels.size(0) &&
              scale.size(1) == x.size(1) / group, "scale must be a contiguous float32 [out, in / ", group,
              "] matrix");
}

// The same product through PyTorch's float32 GEMM (MKL) on the weight dequantised first: several times faster
// for a prefill's hundreds of rows, but its rows are not computed alone (the GEMM blocks them), so callers use it only
// for forwards that decoding never has to reproduce row by row: prompt prefills, which plain and speculative
// decoding run alike (backends/lean_forward.py). The weight is dequantised kGemmSlice output rows at a time: all of
// it at once (a fused gate and up projection of a 1B model: 128 MB of floats) held, with the GEMM's own buffers, more
// memory than the 4-bit weights save.
constexpr int64_t kGemmSlice = 512;

template <typename Rows>
void multiply_gemm(const float* xp, int64_t rows, int64_t k, int64_t out_features, float* op, const Rows& weights) {
  auto x = at::from_blob(const_cast<float*>(xp), {rows, k}, at::kFloat);
  auto weight = at::empty({std::min(kGemmSlice, out_features), k}, at::kFloat);
  float* wp = weight.data_ptr<float>();
  at::Tensor part;
  for (int64_t first = 0; first < out_features; first += kGemmSlice) {
    const int64_t count = std::min(kGemmSlice, out_features - first);
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) weights.row(first + n, wp + n * k);
    });
    if (count == out_features) {  // one slice: straight into the output
      auto out = at::from_blob(op, {rows, out_features}, at::kFloat);
      at::mm_out(out, x, weight.t());
      return;
    }
    if (!part.defined() || part.size(1) != count) part = at::empty({rows, count}, at::kFloat);
    at::mm_out(part, x, weight.narrow(0, 0, count).t());
    const float* pp = part.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(op + r * out_features + first, pp + r * count, static_cast<size_t>(count) * sizeof(float));
  }
}


// One projection's buffers as raw pointers: 4 bits (packed [out, in / 2] uint8, scales and minima in one of Int4Rows's
// forms) or 8 bits (levels [out, in] int8, scales in one of Int8Rows's), and a bias [out] or none.
struct Weights {
  int bits;
  const uint8_t* packed;
  const int8_t* levels;
  const void* scale;
  const void* minimum;  // 4 bits
  int64_t in_features, out_features, group;
  const float* bias = nullptr;
  const uint32_t* fifth = nullptr;  // 5 bits: the fifth-bit words [out, in / 32]
  ScaleForm form = ScaleForm::kFloat;  // 4 and 5 bits
  float offset = 0.0f;  // kHalfOffset
  const int8_t* sub = nullptr;  // 6 and 8 bits: Q6_K's sub-scales (Int6Rows, Int8Rows), or none
  const uint8_t* plane = nullptr;  // 6 bits: the top two bits [out, in / 4]

  Int4Rows int4_rows() const { return Int4Rows{packed, scale, minimum, in_features / kGroup, fifth, form, offset}; }
  Int8Rows int8_rows() const {
    return Int8Rows{levels, static_cast<const float*>(scale), in_features / group, group, sub};
  }
  Int6Rows int6_rows() const { return Int6Rows{packed, plane, static_cast<const float*>(scale), sub, in_features}; }

  template <typename Rows>
  void apply_rows(const float* x, int64_t rows, float* out, bool gemm, const Rows& weights, bool q8 = true) const {
    if (gemm)
      multiply_gemm(x, rows, in_features, out_features, out, weights);
    else
      multiply(x, rows, in_features, out_features, out, weights, q8);
  }

  void apply(const float* x, int64_t rows, float* out, bool gemm, bool q8 = true) const {
    if (bits == 4)
      apply_rows(x, rows, out, gemm, int4_rows(), q8);
    else if (bits == 6)
      apply_rows(x, rows, out, gemm, int6_rows(), q8);
    else
      apply_rows(x, rows, out, gemm, int8_rows(), q8);
    if (bias != nullptr)  // as the layer's forward adds it: one rounding per output
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < out_features; ++n) out[r * out_features + n] += bias[n];
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Attention, defined one (query row, head) pair at a time: scores over the keys the row may see, in key order;
// softmax; the probability-weighted sum of values, in key order. A pair's result depends only on its query and the
// keys it sees, never on the other rows of the call, so a row verified among draft tokens equals the row decoded
// alone (what jointspec/kernels/quantize.py's row-wise attention needs), and one call serves every row and head of a
// layer. attend() is that definition; attend_all() computes the same bits for many pairs at once, sharing each key
// and value it loads among the pairs that see it (the query heads of one key head, the rows of one sequence).
// Keys and values are float32 or IEEE half (`T`: a cache stored in 16 bits, --kv-cache float16); a half is widened
// exactly when loaded, so the arithmetic is the same float32 arithmetic on the values the cache holds.
inline V16 load_kv(const float* p) { return simd::load(p); }
inline V16 load_kv(const at::Half* p) { return simd::load_half(reinterpret_cast<const uint16_t*>(p)); }

// Scores of one query (qv: its dim / 16 chunks) against the `n` <= 16 keys at list entries index[0 .. n - 1],
// times `scale`, into out[0 .. n - 1]: key j's 16-lane partial sums over the chunks in order, then every key's lanes by
// the same tree (simd::sum_lanes16), whatever its neighbours. A whole tile of a common head size (every tile of a
// shared prefix) takes score16_full, whose fixed chunk count keeps the accumulators in registers (sixteen keys' at
// once; four at a time on AVX2, which has sixteen registers and spilled them); the arithmetic is the same either way.
template <int C, typename T>
inline void score16_full(const V16* qv, const T* key, const int64_t* index, int64_t dim, float scale, float* out) {
  constexpr int kKeys = simd::kSumGroup;  // keys reduced at once: all sixteen, or AVX2's four
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += kKeys) {
    V16 acc[kKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) {
      const T* k = key + index[i + j] * dim;
      V16 a = simd::zero();
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a = simd::fmadd(qv[c], load_kv(k + 16 * c), a);
      acc[j] = a;
    }
    simd::sum_lanes_scaled(acc, scale, out + i);
  }
}

template <typename T>
inline void score16(const V16* qv, int64_t chunks, const T* key, const int64_t* index, int64_t n, int64_t dim,
                    float scale, float* out) {
  if (n == 16) {
    switch (chunks) {
      case 1: return score16_full<1, T>(qv, key, index, dim, scale, out);
      case 2: return score16_full<2, T>(qv, key, index, dim, scale, out);
      case 4: return score16_full<4, T>(qv, key, index, dim, scale, out);
      case 6: return score16_full<6, T>(qv, key, index, dim, scale, out);
      case 8: return score16_full<8, T>(qv, key, index, dim, scale, out);
      default: break;
    }
  }
  V16 acc[16];
  for (int64_t j = 0; j < 16; ++j) {
    acc[j] = simd::zero();
    if (j < n) {
      const T* k = key + index[j] * dim;
      for (int64_t c = 0; c < chunks; ++c) acc[j] = simd::fmadd(qv[c], load_kv(k + 16 * c), acc[j]);
    }
  }
  simd::store_first(out, simd::mul(simd::sum_lanes16(acc), simd::set1(scale)), n);
}

// The sixteen keys at list entries index[0 .. 15], to L1 (a 64-byte line at a time).
template <typename T>
inline void prefetch_keys(const T* key, const int64_t* index, int64_t dim) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int j = 0; j < 16; ++j) {
    const char* k = reinterpret_cast<const char*>(key + index[j] * dim);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(k + b, 0, 3);
  }
}

// scores[0 .. count - 1] -> e^(score - max), in place; returns 1 / their sum (summed sixteen lanes at a time in key
// order, then the lanes by reduce_add's tree).
inline float softmax_numerators(float* scores, int64_t count) {
  // The largest score (a maximum has no rounding: any order gives it): sixteen lanes at a time, then the rest.
  V16 lanes = simd::set1(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) lanes = simd::max(lanes, simd::load(scores + i));
  float high = -INFINITY, lane[16];
  simd::store(lane, lanes);
  for (const float x : lane) high = std::max(high, x);
  for (; i < count; ++i) high = std::max(high, scores[i]);
  V16 total = simd::zero();
  const V16 top = simd::set1(high);
  for (i = 0; i < count; i += 16) {
    const int64_t n = std::min<int64_t>(16, count - i);
    const V16 e = simd::exp(simd::sub(simd::load_first(scores + i, n), top));
    simd::store_first(scores + i, e, n);
    total = simd::add(total, simd::load_first(scores + i, n));  // lanes past the last key add 0
  }
  return 1.0f / simd::reduce_add(total);
}

// One pair: q [dim], keys/values rows at `key` + j * dim for the `count` visible key indices `index` (ascending).
// dim is a multiple of 16, at most 256. `scores` has room for count + 16 floats.
template <typename T>
void attend(const float* q, const T* key, const T* value, const int64_t* index, int64_t count, int64_t dim,
            float scale, float* scores, float* out) {
  const int64_t chunks = dim / 16;
  V16 qv[16];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = simd::load(q + 16 * c);
  for (int64_t i = 0; i < count; i += 16)
    score16(qv, chunks, key, index + i, std::min<int64_t>(16, count - i), dim, scale, scores + i);
  const V16 inverse = simd::set1(softmax_numerators(scores, count));
  V16 acc[16];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = simd::zero();
  for (int64_t i = 0; i < count; ++i) {  // each output element a sum over the keys in order
    const V16 p = simd::set1(scores[i]);
    const T* v = value + index[i] * dim;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = simd::fmadd(p, load_kv(v + 16 * c), acc[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) simd::store(out + 16 * c, simd::mul(acc[c], inverse));
}

// Each row's visible key indices, ascending: from a bool [rows, keys] matrix, or (visible empty) row r sees keys
// 0 .. lengths[r] - 1.
std::vector<std::vector<int64_t>> visible_keys(const at::Tensor& visible, const at::Tensor& lengths,
                                               int64_t rows, int64_t num_keys) {
  std::vector<std::vector<int64_t>> index(rows);
  if (visible.numel() > 0) {
    TORCH_CHECK(visible.scalar_type() == at::kBool && visible.is_contiguous() && visible.size(0) == rows &&
                visible.size(1) == num_keys, "visible must be a contiguous bool [rows, keys] matrix");
  } else {
    TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == rows,
                "lengths must be a contiguous int64 [rows] vector");
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (visible.numel() > 0) {
      const bool* v = visible.data_ptr<bool>() + r * num_keys;
      for (int64_t j = 0; j < num_keys; ++j) if (v[j]) index[r].push_back(j);
    } else {
      const int64_t length = lengths.data_ptr<int64_t>()[r];
      TORCH_CHECK(length > 0 && length <= num_keys, "row ", r, " sees ", length, " of ", num_keys, " keys");
      index[r].resize(length);
      for (int64_t j = 0; j < length; ++j) index[r][j] = j;
    }
    TORCH_CHECK(!index[r].empty(), "row ", r, " sees no key");
  }
  return index;
}

// Queries per pass over the values in attend_all(): their accumulators stay in registers (two per V16 on AVX2).
#if defined(JOINTSPEC_ISA_AVX2)
constexpr int64_t kValueQueries = 6;
#else
constexpr int64_t kValueQueries = 8;
#endif
// Score entries kept at once: rows are taken in blocks whose scores fit (a long context's rows take smaller blocks).
constexpr int64_t kScoreBudget = int64_t(1) << 21;
// Keys per score task: a key head's keys are scored in spans this long, so that a long context's scores spread
// over every thread.
constexpr int64_t kScoreSpan = 512;
// Keys per span of attend_all()'s values passes: a task's share of a span's values (128 keys: 16 KB of float32, two
// chunks a key) stays in L1 while every pass reads it.
constexpr int64_t kValueSpan = 128;
// Passes a values task takes over each span (their accumulators: 6 KB on AVX-512); the rest go to further tasks, so
// that a prompt's many rows still spread over the threads.
constexpr int64_t kValuePasses = 12;

// Keys values_pass() prefetches ahead.
constexpr int64_t kValueAhead = 8;

// M queries' values pass for L adjacent 16-float chunks of dim: acc[l * M + m] += p_m[j] * value[index[j]] (chunk
// l) over j in key order, for list entries j in [begin, end). `probs[m]` is query m's row of probabilities. Each
// accumulator sums in key order whatever L is; L = 2 lets one task read whole 64-byte lines of a half cache's values.
template <int M, int L, typename T>
inline void values_pass(V16* acc, float* const* probs, const T* value, const int64_t* index, int64_t begin,
                        int64_t end, int64_t dim) {
  V16 a[L * M];
  for (int i = 0; i < L * M; ++i) a[i] = acc[i];
  for (int64_t j = begin; j < end; ++j) {
    // A row's chunks some keys ahead, to L1: a long context's values come from memory, one line or two a key, and
    // the hardware prefetcher did not keep the loop fed (it waited on the loads).
    if (j + kValueAhead < end) {
      const char* ahead = reinterpret_cast<const char*>(value + index[j + kValueAhead] * dim);
      __builtin_prefetch(ahead, 0, 3);
      if constexpr (L * 16 * sizeof(T) > 64) __builtin_prefetch(ahead + 64, 0, 3);
    }
    const T* row = value + index[j] * dim;
    V16 v[L];
    for (int l = 0; l < L; ++l) v[l] = load_kv(row + 16 * l);
    for (int m = 0; m < M; ++m) {
      const V16 p = simd::set1(probs[m][j]);
      for (int l = 0; l < L; ++l) a[l * M + m] = simd::fmadd(p, v[l], a[l * M + m]);
    }
  }
  for (int i = 0; i < L * M; ++i) acc[i] = a[i];
}

// values_pass for `count` queries (L * count <= kValueQueries, so that the accumulators stay in registers).
template <int L, typename T, int M = 1>
inline void values_pass_n(int64_t count, V16* acc, float* const* probs, const T* value, const int64_t* index,
                          int64_t begin, int64_t end, int64_t dim) {
  if constexpr (M * L <= kValueQueries) {
    if (count == M) return values_pass<M, L, T>(acc, probs, value, index, begin, end, dim);
    return values_pass_n<L, T, M + 1>(count, acc, probs, value, index, begin, end, dim);
  } else {
    TORCH_CHECK(false, "values_pass_n: ", count, " queries of ", L, " chunks");
  }
}

// Every (row, head) pair, each computing exactly attend()'s bits; out [rows, heads, dim]. Query head h reads key
// head h / (heads / kv_heads). The pairs of one key head share the prefix of key lists that all rows have in common
// (a sequence's cached tokens): its keys are scored sixteen at a time for every pair while they sit in the L1 cache,
// and its values are read once per pass for up to kValueQueries pairs. The rest of each row's list (its own draft
// tokens) runs pair by pair. A pair's arithmetic is attend()'s, operation for operation, in the same order.
template <typename T>
void attend_all(const float* qp, int64_t q_head_stride, int64_t q_row_stride, const T* kp, int64_t k_head_stride,
                const T* vp, int64_t v_head_stride, const std::vector<std::vector<int64_t>>& index,
                int64_t heads, int64_t kv_heads, int64_t dim, float scale, float* op) {
  const int64_t rows = static_cast<int64_t>(index.size()), group = heads / kv_heads, chunks = dim / 16;
  if (rows == 0) return;
  // The list prefix every row shares.
  int64_t shared = static_cast<int64_t>(index[0].size());
  for (int64_t r = 1; r < rows; ++r) {
    const auto& list = index[r];
    int64_t same = 0;
    const int64_t most = std::min<int64_t>(shared, static_cast<int64_t>(list.size()));
    while (same < most && list[same] == index[0][same]) ++same;
    shared = same;
  }
  const int64_t shared_tiles = shared / 16;  // whole tiles of sixteen keys inside the shared prefix
  const int64_t* shared_index = index[0].data();
  int64_t longest = 0;
  for (const auto& list : index) longest = std::max(longest, static_cast<int64_t>(list.size()));
  const int64_t stride = (longest + 31) / 16 * 16;  // a score row, room for a last partial tile
  const int64_t block_rows = std::max<int64_t>(1, kScoreBudget / (heads * stride));
  // Left uninitialised (zeroing them was a measurable share of a long context's step): every entry is written
  // before it is read.
  const std::unique_ptr<float[]> scores(new float[std::min(rows, block_rows) * heads * stride]);
  const std::unique_ptr<float[]> inverse(new float[std::min(rows, block_rows) * heads]);
  const int64_t spans = std::max<int64_t>(1, (shared_tiles * 16 + kScoreSpan - 1) / kScoreSpan);
  const int64_t span_tiles = (shared_tiles + spans - 1) / spans;

  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(rows, r0 + block_rows), block = r1 - r0;
    auto pair_scores = [&](int64_t r, int64_t h) { return scores.get() + ((r - r0) * heads + h) * stride; };
    auto finish_pair = [&](int64_t r, int64_t h) {  // the row's own keys, then the softmax
      V16 qv[16];
      const float* q = qp + h * q_head_stride + r * q_row_stride;
      for (int64_t c = 0; c < chunks; ++c) qv[c] = simd::load(q + 16 * c);
      const auto& list = index[r];
      const int64_t count = static_cast<int64_t>(list.size());
      float* s = pair_scores(r, h);
      for (int64_t i = shared_tiles * 16; i < count; i += 16)
        score16(qv, chunks, kp + (h / group) * k_head_stride, list.data() + i, std::min<int64_t>(16, count - i),
                dim, scale, s + i);
      inverse[(r - r0) * heads + h] = softmax_numerators(s, count);
    };
    // 1. Scores over the shared prefix: per key head and span of keys, every pair of the block; a key head whose
    // prefix is one span also finishes its pairs (their own keys, the softmax) in the same task.
    at::parallel_for(0, kv_heads * spans, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t g = task / spans, t0 = (task % spans) * span_tiles;
        const int64_t t1 = std::min(shared_tiles, t0 + span_tiles);
        const T* key = kp + g * k_head_stride;
        for (int64_t t = t0; t < t1; ++t) {
          // The next tile's keys, to L1, while this one is scored: its first pair would otherwise wait on memory
          // for each of them (the keys of a long context do not stay in cache from one forward to the next).
          if (t + 1 < t1) prefetch_keys(key, shared_index + 16 * (t + 1), dim);
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              V16 qv[16];
              const float* q = qp + h * q_head_stride + r * q_row_stride;
              for (int64_t c = 0; c < chunks; ++c) qv[c] = simd::load(q + 16 * c);
              score16(qv, chunks, key, shared_index + 16 * t, 16, dim, scale, pair_scores(r, h) + 16 * t);
            }
          }
        }
        if (spans == 1)
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t h = g * group; h < (g + 1) * group; ++h) finish_pair(r, h);
      }
    });
    // 2. Where a prefix took several spans: each pair's own keys and softmax.
    if (spans > 1) {
      at::parallel_for(0, block * heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t pair = begin; pair < end; ++pair) finish_pair(r0 + pair / heads, pair % heads);
      });
    }
    // 3. Values: per key head and group of `lines` 16-float chunks of dim, the pairs in passes of up to
    // kValueQueries / lines, over the shared prefix for the pass's pairs at once, then each pair's own keys; pair q's
    // chunk c is attend()'s acc[c], in key order. Where dim allows, a task takes two adjacent chunks (a whole 64-byte
    // line of a half cache's values), for half as many pairs a pass. A task takes up to kValuePasses passes and the
    // prefix in spans of kValueSpan keys, all its passes over one span before the next, each pass's accumulators kept
    // between spans: a verification's rows take several passes, and each then reads the span from L1 instead of the
    // whole prefix again from memory.
    const int64_t lines = chunks % 2 == 0 ? 2 : 1;
    const int64_t per_pass = kValueQueries / lines, chunk_groups = chunks / lines;
    const int64_t per_head = block * group, passes = (per_head + per_pass - 1) / per_pass;
    const int64_t pass_blocks = (passes + kValuePasses - 1) / kValuePasses;
    at::parallel_for(0, kv_heads * chunk_groups * pass_blocks, 1, [&](int64_t begin, int64_t end) {
      V16 held[kValuePasses * kValueQueries];  // the task's pass i's accumulators at i * kValueQueries, as acc below
      float* probs[kValuePasses * kValueQueries];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t g = task / (chunk_groups * pass_blocks), c = task / pass_blocks % chunk_groups * lines;
        const int64_t first = task % pass_blocks * kValuePasses, last = std::min(passes, first + kValuePasses);
        const T* value = vp + g * v_head_stride + 16 * c;
        auto pass_pairs = [&](int64_t pass) { return std::min(per_pass, per_head - pass * per_pass); };
        auto pair_of = [&](int64_t pass, int64_t m) {  // (row, head) of pass `pass`'s pair m
          const int64_t q = pass * per_pass + m;
          return std::make_pair(r0 + q / group, g * group + q % group);
        };
        for (int64_t pass = first; pass < last; ++pass) {
          for (int64_t m = 0; m < pass_pairs(pass); ++m) {
            const auto [r, h] = pair_of(pass, m);
            probs[(pass - first) * kValueQueries + m] = pair_scores(r, h);
          }
          for (int64_t i = 0; i < lines * pass_pairs(pass); ++i)
            held[(pass - first) * kValueQueries + i] = simd::zero();
        }
        for (int64_t s0 = 0; s0 < shared; s0 += kValueSpan) {
          const int64_t s1 = std::min(shared, s0 + kValueSpan);
          for (int64_t pass = first; pass < last; ++pass) {
            V16* acc = held + (pass - first) * kValueQueries;  // acc[l * count + m]: pair m, chunk c + l
            float* const* pass_probs = probs + (pass - first) * kValueQueries;
            if (lines == 2) {
              values_pass_n<2>(pass_pairs(pass), acc, pass_probs, value, shared_index, s0, s1, dim);
            } else {
              values_pass_n<1>(pass_pairs(pass), acc, pass_probs, value, shared_index, s0, s1, dim);
            }
          }
        }
        for (int64_t pass = first; pass < last; ++pass) {
          const int64_t count = pass_pairs(pass);
          for (int64_t m = 0; m < count; ++m) {
            const auto [r, h] = pair_of(pass, m);
            const auto& list = index[r];
            for (int64_t l = 0; l < lines; ++l) {
              V16* a = held + (pass - first) * kValueQueries + l * count + m;
              values_pass<1, 1, T>(a, probs + (pass - first) * kValueQueries + m, value + 16 * l, list.data(), shared,
                                   static_cast<int64_t>(list.size()), dim);
              simd::store(op + (r * heads + h) * dim + 16 * (c + l),
                          simd::mul(*a, simd::set1(inverse[(r - r0) * heads + h])));
            }
          }
        }
      }
    });
  }
}

// The definition itself, pair by pair (attend()): what attend_all() must equal bit for bit (tests hold them against
// each other).
template <typename T>
void attend_pairs(const float* qp, int64_t q_head_stride, int64_t q_row_stride, const T* kp, int64_t k_head_stride,
                  const T* vp, int64_t v_head_stride, const std::vector<std::vector<int64_t>>& index,
                  int64_t heads, int64_t kv_heads, int64_t dim, float scale, float* op) {
  const int64_t rows = static_cast<int64_t>(index.size()), group = heads / kv_heads;
  int64_t most = 0;
  for (const auto& keys : index) most = std::max(most, static_cast<int64_t>(keys.size()));
  std::vector<float> scores(most + 16);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      attend(qp + h * q_head_stride + r * q_row_stride, kp + (h / group) * k_head_stride,
             vp + (h / group) * v_head_stride, index[r].data(), static_cast<int64_t>(index[r].size()), dim, scale,
             scores.data(), op + (r * heads + h) * dim);
}

// ---------------------------------------------------------------------------------------------------------------
// A whole Llama decoder layer on 4- or 8-bit weights, for the lean forward (jointspec/backends/lean_forward.py): the norms,
// the q/k/v projections, rotary embedding, writing the new keys and values into the cache, attention, the output
// projection, the gated MLP and both residual adds, in one call instead of about fifty PyTorch operations. Every step
// treats each row alone (norms, rotary, activation per row; projections and attention as above), so this layer
// keeps the row independence speculative decoding needs.
// LlamaRMSNorm: x / sqrt(mean(x^2) + eps), times the weight. n is a multiple of 16.
void rms_norm(const float* x, const float* weight, int64_t n, float eps, float* out) {
  V16 acc = simd::zero();
  for (int64_t i = 0; i < n; i += 16) {
    const V16 v = simd::load(x + i);
    acc = simd::fmadd(v, v, acc);
  }
  const float inverse = 1.0f / std::sqrt(simd::reduce_add(acc) / float(n) + eps);
  const V16 scale = simd::set1(inverse);
  for (int64_t i = 0; i < n; i += 16)
    simd::store(out + i, simd::mul(simd::load(weight + i), simd::mul(simd::load(x + i), scale)));
}

// silu(gate) * up = gate * up / (1 + e^-gate). n is a multiple of 16.
void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  const V16 one = simd::set1(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const V16 g = simd::load(gate + i);
    const V16 denominator = simd::add(one, simd::exp(simd::sub(simd::zero(), g)));
    simd::store(out + i, simd::div(simd::mul(g, simd::load(up + i)), denominator));
  }
}

// gelu_tanh(gate) * up: transformers' gelu_pytorch_tanh (Gemma's MLP) in silu_mul's form, since
// g / 2 * (1 + tanh(y)) = g / (1 + e^(-2y)) for y = sqrt(2 / pi) * (g + 0.044715 g^3). n is a multiple of 16.
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out) {
  const V16 one = simd::set1(1.0f), cubic = simd::set1(0.044715f);
  const V16 minus_two_root = simd::set1(-2.0f * 0.7978845608028654f);  // -2 sqrt(2 / pi)
  for (int64_t i = 0; i < n; i += 16) {
    const V16 g = simd::load(gate + i);
    const V16 inner = simd::fmadd(simd::mul(cubic, simd::mul(g, g)), g, g);
    const V16 denominator = simd::add(one, simd::exp(simd::mul(minus_two_root, inner)));
    simd::store(out + i, simd::div(simd::mul(g, simd::load(up + i)), denominator));
  }
}

void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) simd::store(x + i, simd::add(simd::load(x + i), simd::load(y + i)));
}

// transformers' apply_rotary_pos_emb for one head vector: x * cos + rotate_half(x) * sin, rotate_half(x) being
// [-x2, x1] for the halves x1, x2.
inline void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
  for (int64_t i = half; i < dim; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// Several projections of one input whose outputs sit side by side (q | k | v, gate | up): one fused projection (a
// single part, its layers' buffers stacked: kernels/grouped.py, stack_storage), or one part per layer where their
// formats differ (a GGUF file may store v in another block type than q and k).
struct Parts {
  std::vector<Weights> parts;
  int64_t out_features = 0;

  void apply(const float* x, int64_t rows, float* out, bool gemm) const {
    if (parts.size() == 1) return parts[0].apply(x, rows, out, gemm);
    std::vector<float> part_out;
    int64_t column = 0;
    for (const Weights& w : parts) {
      part_out.resize(rows * w.out_features);
      w.apply(x, rows, part_out.data(), gemm);
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(part_out.data() + r * w.out_features, w.out_features, out + r * out_features + column);
      column += w.out_features;
    }
  }
};

bool has_shape(const at::Tensor& t, std::initializer_list<int64_t> shape) {
  return t.is_contiguous() && t.sizes() == c10::IntArrayRef(shape);
}

Weights weights_of(const std::vector<at::Tensor>& tensors, int64_t in_features, const char* name);
Weights weights_without_bias(const std::vector<at::Tensor>& tensors, int64_t in_features, const char* name);

Parts parts_of(const std::vector<std::vector<at::Tensor>>& parts, int64_t in_features, const char* name) {
  TORCH_CHECK(!parts.empty(), name, ": no projection given");
  Parts out;
  for (const auto& part : parts) {
    out.parts.push_back(weights_of(part, in_features, name));
    out.out_features += out.parts.back().out_features;
  }
  return out;
}

// A projection given as (packed, scale, minimum[, bias]): 4 bits (uint8 levels), or (packed, scale[, bias]) with the
// K-quant scales' stream (uint8 [out, blocks, 40]: Int4Rows's kSuper); as (packed, fifth, scale, minimum[, bias]) or
// (packed, fifth, scale[, bias]): 5 bits (int32 fifth-bit words); as (packed, plane, scale, sub[, bias]): 6 bits
// (uint8 top bits: Q6_K as stored); as (levels, scale[, sub][, bias]): 8 bits (int8 sub-scales: Q6_K's form). The
// scales' types say their form (Int4Rows, Int6Rows, Int8Rows).
Weights weights_of(const std::vector<at::Tensor>& given, int64_t in_features, const char* name) {
  TORCH_CHECK(in_features % 64 == 0, name, ": in_features must be a multiple of 64, got ", in_features);
  TORCH_CHECK(given.size() >= 2, name, ": a projection comes as (packed, scale, minimum[, bias]) for 4 bits, "
              "(packed, fifth, scale, minimum[, bias]) for 5, (packed, plane, scale, sub[, bias]) for 6 or (levels, "
              "scale[, sub][, bias]) for 8, got ", given.size(), " tensors");
  const bool nibbles = given[0].scalar_type() == at::kByte;
  const bool five = nibbles && given[1].scalar_type() == at::kInt;
  const size_t scale_at = five ? 2 : 1;  // a K-quant scale stream: uint8, three dimensions
  const bool k_stream = nibbles && given.size() > scale_at && given[scale_at].scalar_type() == at::kByte &&
                        given[scale_at].dim() == 3;
  const bool six = nibbles && !k_stream && given[1].scalar_type() == at::kByte;
  const bool sub = !nibbles && given.size() >= 3 && given[2].scalar_type() == at::kChar;
  const size_t count = k_stream ? scale_at + 1 : five || six ? 4 : nibbles ? 3 : sub ? 3 : 2;
  TORCH_CHECK(given.size() == count || given.size() == count + 1, name, ": ", count, " tensors (and a bias) for ",
              five ? 5 : six ? 6 : nibbles ? 4 : 8, " bits, got ", given.size());
  std::vector<at::Tensor> tensors(given.begin(), given.begin() + count);
  at::Tensor fifth;
  if (five) {
    fifth = tensors[1];
    tensors.erase(tensors.begin() + 1);
  }
  Weights weights = weights_without_bias(tensors, in_features, name);
  if (five) {
    TORCH_CHECK(fifth.dim() == 2 && fifth.is_contiguous() && fifth.size(0) == weights.out_features &&
                fifth.size(1) == in_features / kGroup, name, ": fifth bits must be contiguous int32 [out, in / 32]");
    weights.fifth = reinterpret_cast<const uint32_t*>(fifth.data_ptr<int32_t>());
  }
  if (given.size() > count) {
    const at::Tensor& bias = given[count];
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == weights.out_features,
                name, ": a bias must be float32 [", weights.out_features, "]");
    weights.bias = bias.data_ptr<float>();
  }
  return weights;
}

Weights weights_without_bias(const std::vector<at::Tensor>& tensors, int64_t in_features, const char* name) {
  const int64_t groups = in_features / kGroup;
  if (tensors.size() == 4 && tensors[0].scalar_type() == at::kByte && tensors[1].scalar_type() == at::kByte) {
    const at::Tensor &packed = tensors[0], &plane = tensors[1], &super = tensors[2], &sub = tensors[3];
    const int64_t out = packed.size(0);
    TORCH_CHECK(in_features % 256 == 0 && packed.dim() == 2 && has_shape(packed, {out, in_features / 2}) &&
                has_shape(plane, {out, in_features / 4}) && super.scalar_type() == at::kFloat &&
                has_shape(super, {out, in_features / 256}) && sub.scalar_type() == at::kChar &&
                has_shape(sub, {out, in_features / 16}), name, ": 6-bit levels come as uint8 [out, in / 2] (nibbles), "
                "uint8 [out, in / 4] (top bits), float32 [out, in / 256] and int8 [out, in / 16] (K-quant scales), in "
                "a multiple of 256 inputs");
    Weights weights{6, packed.data_ptr<uint8_t>(), nullptr, super.data_ptr<float>(), nullptr, in_features, out, 16};
    weights.plane = plane.data_ptr<uint8_t>();
    weights.sub = sub.data_ptr<int8_t>();
    return weights;
  }
  const at::Tensor& scale = tensors[1];
  if (tensors[0].scalar_type() == at::kByte) {
    const at::Tensor& packed = tensors[0];
    TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == in_features / 2, name,
                ": packed levels must be a contiguous uint8 [out, ", in_features / 2, "] matrix");
    const int64_t out = packed.size(0);
    if (tensors.size() == 2) {  // (packed, the K-quant scales' stream): Int4Rows's kSuper
      const int64_t blocks = (groups + 15) / 16;
      TORCH_CHECK(in_features % 256 == 0 && scale.scalar_type() == at::kByte &&
                  has_shape(scale, {out, blocks, kSuperBlockBytes}), name,
                  ": K-quant scales come as one uint8 [out, ceil(in / 512), ", kSuperBlockBytes, "] stream in a "
                  "multiple of 256 inputs; got ", scale.sizes(), " for ", in_features, " inputs");
      Weights weights{4, packed.data_ptr<uint8_t>(), nullptr, scale.data_ptr(), nullptr, in_features, out, kGroup};
      weights.form = ScaleForm::kSuper;
      return weights;
    }
    const at::Tensor& minimum = tensors[2];
    Weights weights{4, packed.data_ptr<uint8_t>(), nullptr, scale.data_ptr(), minimum.data_ptr(), in_features, out,
                    kGroup};
    const bool half = scale.scalar_type() == at::kHalf;
    // The offset form: minimum [out, 1] halves, every one the offset (the layers write it so; row 0 is read).
    if (half && minimum.scalar_type() == at::kHalf && has_shape(minimum, {out, 1})) {
      TORCH_CHECK(has_shape(scale, {out, groups}), name, ": scale must be a contiguous float16 [out, in / 32] matrix");
      weights.form = ScaleForm::kHalfOffset;
      weights.offset = simd::half_to_float(*reinterpret_cast<const uint16_t*>(minimum.data_ptr()));
      TORCH_CHECK(weights.offset == -8.0f || weights.offset == -16.0f, name, ": minima given as one offset times "
                  "each scale must be -8 or -16 (Q4_0's or Q5_0's), got ", weights.offset);
      return weights;
    }
    TORCH_CHECK((half || scale.scalar_type() == at::kFloat) && has_shape(scale, {out, groups}) &&
                minimum.sizes() == scale.sizes() && minimum.scalar_type() == scale.scalar_type() &&
                minimum.is_contiguous(), name, ": scale and minimum must be contiguous [out, in / 32] matrices, both "
                "float32 or both float16");
    weights.form = half ? ScaleForm::kHalf : ScaleForm::kFloat;
    return weights;
  }
  const at::Tensor& levels = tensors[0];
  TORCH_CHECK(levels.scalar_type() == at::kChar && levels.dim() == 2 && levels.is_contiguous() &&
              levels.size(1) == in_features, name, ": levels must be a contiguous int8 [out, ", in_features,
              "] matrix");
  const int64_t out = levels.size(0);
  if (tensors.size() == 3) {  // Q6_K: a signed sub-scale per 16 inputs, a float32 per 256
    const at::Tensor& sub = tensors[2];
    TORCH_CHECK(in_features % 256 == 0 && scale.scalar_type() == at::kFloat &&
                has_shape(scale, {out, in_features / 256}) && has_shape(sub, {out, in_features / 16}), name,
                ": K-quant 8-bit scales come as float32 [out, in / 256] and int8 [out, in / 16]");
    Weights weights{8, nullptr, levels.data_ptr<int8_t>(), scale.data_ptr<float>(), nullptr, in_features, out, 16};
    weights.sub = sub.data_ptr<int8_t>();
    return weights;
  }
  const int64_t group = int8_group(scale, in_features, name);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == out, name,
              ": scale must be a contiguous float32 [out, in / ", group, "] matrix");
  return {8, nullptr, levels.data_ptr<int8_t>(), scale.data_ptr<float>(), nullptr, in_features, out, group};
}


std::string isa() { return JOINTSPEC_ISA_NAME; }

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix [rows, in]");
}

// x [rows, in] times one projection given as weights_of() takes it (any layout, no bias), -> [rows, out].
at::Tensor linear(at::Tensor x, std::vector<at::Tensor> tensors, bool gemm, bool q8) {
  check_x(x);
  const Weights w = weights_of(tensors, x.size(1), "linear");
  TORCH_CHECK(w.bias == nullptr, "linear: the bias is added by the caller");
  auto out = at::empty({x.size(0), w.out_features}, x.options());
  w.apply(x.data_ptr<float>(), x.size(0), out.data_ptr<float>(), gemm, q8);
  return out;
}

at::Tensor int5_linear(at::Tensor x, at::Tensor packed, at::Tensor fifth, at::Tensor scale,
                          at::Tensor minimum, bool gemm) {
  return linear(x, {packed, fifth, scale, minimum}, gemm, true);
}

at::Tensor int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scale, at::Tensor minimum,
                          bool gemm) {
  return linear(x, {packed, scale, minimum}, gemm, true);
}

at::Tensor int8_linear(at::Tensor x, at::Tensor levels, at::Tensor scale, bool gemm, bool q8) {
  return linear(x, {levels, scale}, gemm, q8);
}


// query [heads, rows, dim] (any strides, unit stride in dim); key / value [kv_heads, keys, dim] (rows of dim
// contiguous, any head stride); visible: bool [rows, keys], or an empty tensor with `lengths` [rows]: row r sees keys
// 0 .. lengths[r] - 1. Returns [rows, heads, dim]. Query head h reads key head h / (heads / kv_heads).
at::Tensor attention_by(bool pairwise, at::Tensor query, at::Tensor key, at::Tensor value,
                           at::Tensor visible, at::Tensor lengths, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "query, key and value must be 3-D");
  for (const auto* t : {&query, &key, &value}) {
    TORCH_CHECK(t->device().is_cpu() && t->stride(2) == 1,
                "query, key and value must be CPU tensors with a unit stride in the last dimension");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat && value.scalar_type() == key.scalar_type() &&
              (key.scalar_type() == at::kFloat || key.scalar_type() == at::kHalf),
              "query must be float32, key and value both float32 or both float16");
  const int64_t heads = query.size(0), rows = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key.size(0), num_keys = key.size(1);
  TORCH_CHECK(dim % 16 == 0 && dim <= 256, "head_dim must be a multiple of 16, at most 256, got ", dim);
  TORCH_CHECK(key.size(2) == dim && value.sizes() == key.sizes() && key.stride(1) == dim && value.stride(1) == dim,
              "key and value must be [kv_heads, keys, dim] with contiguous rows");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  const auto index = visible_keys(visible, lengths, rows, num_keys);
  auto out = at::empty({rows, heads, dim}, query.options());
  auto run = [&](auto* key_data, auto* value_data) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(key_data)>>;
    (pairwise ? attend_pairs<T> : attend_all<T>)(query.data_ptr<float>(), query.stride(0), query.stride(1), key_data,
                                                 key.stride(0), value_data, value.stride(0), index, heads, kv_heads,
                                                 dim, static_cast<float>(scale), out.data_ptr<float>());
  };
  if (key.scalar_type() == at::kHalf) {
    run(key.data_ptr<at::Half>(), value.data_ptr<at::Half>());
  } else {
    run(key.data_ptr<float>(), value.data_ptr<float>());
  }
  return out;
}

at::Tensor attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor visible,
                        at::Tensor lengths, double scale) {
  return attention_by(false, query, key, value, visible, lengths, scale);
}

// attention() by its definition, one pair at a time on one thread: the reference attention() must equal.
at::Tensor attention_pairwise(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor visible,
                                 at::Tensor lengths, double scale) {
  return attention_by(true, query, key, value, visible, lengths, scale);
}

// One sequence's rows in a decoder-layer call: rows row_begin .. row_begin + rows - 1 of the hidden matrix, whose new
// keys and values go to entries start .. start + rows - 1 of its own cache buffers ([kv_heads, capacity, dim],
// contiguous rows) and which attend to the keys `index` lists per row (visible_keys()).
struct Segment {
  int64_t row_begin, rows, start;
  void *key_base, *value_base;  // float, or at::Half where `half` (a cache kept in 16 bits)
  bool half;
  int64_t key_stride, value_stride;
  const std::vector<std::vector<int64_t>>* index;  // per row, ascending: owned by the caller
};

Segment segment_of(int64_t row_begin, int64_t rows, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   int64_t start, const std::vector<std::vector<int64_t>>& index, int64_t kv_heads, int64_t dim) {
  for (const auto* t : {&key_cache, &value_cache}) {
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                t->scalar_type() == key_cache.scalar_type() && t->dim() == 3 && t->size(0) == kv_heads &&
                t->size(2) == dim && t->stride(2) == 1 && t->stride(1) == dim, "caches must be float32 or float16 "
                "(both the same) [kv_heads, capacity, dim] with contiguous rows");
  }
  TORCH_CHECK(start >= 0 && start + rows <= key_cache.size(1) && value_cache.size(1) >= start + rows,
              "the caches have no room for ", rows, " entries after ", start);
  return {row_begin, rows, start, key_cache.data_ptr(), value_cache.data_ptr(),
          key_cache.scalar_type() == at::kHalf, key_cache.stride(0), value_cache.stride(0), &index};
}

// What a layer may add to Llama's (Gemma-3's layers); an undefined tensor is a step the layer does not have.
struct LayerExtras {
  at::Tensor q_norm, k_norm;            // [dim]: each head's query / key RMS-normed before the rotary embedding
  at::Tensor attn_out_norm, mlp_out_norm;  // [width]: each block's output RMS-normed before the residual add
  bool gelu = false;                       // the MLP's activation: gelu_tanh, else SiLU
  int64_t rope = 0;                        // which of the forward's cos / sin pairs the layer rotates by
  int64_t view = 0;                        // which of the forward's visibilities its rows attend by (sliding windows)
};

// hidden [rows, width] -> the layer's output [rows, width]. Each projection as weights_of() reads it: (packed,
// scale, minimum) for 4 bits, (levels, scale) for 8; qkv gives q, k and v as parts (parts_of: fused, or one each;
// q: heads * dim rows, k and v: kv_heads * dim each), gate_up gate and up (intermediate rows each).
// cos / sin [rows, dim] come from the model's rotary embedding. The rows belong to one or more sequences
// (`segments`); each segment's new keys and values go to its own cache, and its rows attend to its own keys (as
// attention() above), scaled by `scale`. The projections take every row of every segment in one pass (each row
// computed alone, so a row's result does not depend on the other sequences in the call). `gemm`: the projections
// through multiply_gemm (a prefill; its rows are then not computed alone), else row by row.
at::Tensor layer_over_segments(const at::Tensor& hidden, const at::Tensor& input_norm,
                                  const at::Tensor& post_norm, double eps, const Parts& w_qkv, const Weights& w_o,
                                  const Parts& w_gu, const Weights& w_down, const at::Tensor& cos,
                                  const at::Tensor& sin, const std::vector<Segment>& segments, int64_t heads,
                                  int64_t kv_heads, int64_t dim, double scale, bool gemm, const LayerExtras& extras) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  const int64_t intermediate = w_gu.out_features / 2;
  const float epsilon = static_cast<float>(eps);
  const float* h = hidden.data_ptr<float>();
  auto out = hidden.clone();
  float* o = out.data_ptr<float>();
  std::vector<float> normed(rows * width), projected(rows * (q_size + 2 * kv_size)), rotated(rows * q_size);
  std::vector<float> attended(rows * q_size), mixed(rows * width), gated(rows * 2 * intermediate);
  std::vector<float> activated(rows * intermediate);
  const float* q_norm = extras.q_norm.defined() ? extras.q_norm.data_ptr<float>() : nullptr;
  const float* k_norm = extras.k_norm.defined() ? extras.k_norm.data_ptr<float>() : nullptr;
  // A block's output RMS-normed in place, row by row, where the layer has that norm.
  auto out_norm = [&](const at::Tensor& weight) {
    if (!weight.defined()) return;
    for (int64_t r = 0; r < rows; ++r)
      rms_norm(mixed.data() + r * width, weight.data_ptr<float>(), width, epsilon, mixed.data() + r * width);
  };
  // Attention block.
  for (int64_t r = 0; r < rows; ++r)
    rms_norm(h + r * width, input_norm.data_ptr<float>(), width, epsilon, normed.data() + r * width);
  w_qkv.apply(normed.data(), rows, projected.data(), gemm);
  for (const Segment& s : segments) {
    for (int64_t i = 0; i < s.rows; ++i) {
      const int64_t r = s.row_begin + i;
      const float* row = projected.data() + r * (q_size + 2 * kv_size);
      const float* c = cos.data_ptr<float>() + r * dim;
      const float* sn = sin.data_ptr<float>() + r * dim;
      float normed_head[256];
      for (int64_t head = 0; head < heads; ++head) {
        const float* query = row + head * dim;
        if (q_norm) query = (rms_norm(query, q_norm, dim, epsilon, normed_head), normed_head);
        rotate(query, c, sn, dim, rotated.data() + r * q_size + head * dim);
      }
      for (int64_t g = 0; g < kv_heads; ++g) {
        const float* value = row + q_size + kv_size + g * dim;
        const float* key_in = row + q_size + g * dim;
        if (k_norm) key_in = (rms_norm(key_in, k_norm, dim, epsilon, normed_head), normed_head);
        const int64_t key_at = g * s.key_stride + (s.start + i) * dim;
        const int64_t value_at = g * s.value_stride + (s.start + i) * dim;
        if (s.half) {  // rounded to the nearest half, ties to even, as torch's float32 -> float16 conversion rounds
          float key[256];
          rotate(key_in, c, sn, dim, key);
          at::Half* keys = static_cast<at::Half*>(s.key_base) + key_at;
          at::Half* values = static_cast<at::Half*>(s.value_base) + value_at;
          for (int64_t e = 0; e < dim; ++e) keys[e] = at::Half(key[e]);
          for (int64_t e = 0; e < dim; ++e) values[e] = at::Half(value[e]);
        } else {
          rotate(key_in, c, sn, dim, static_cast<float*>(s.key_base) + key_at);
          std::copy_n(value, dim, static_cast<float*>(s.value_base) + value_at);
        }
      }
    }
    auto attend = [&](auto* keys, auto* values) {
      attend_all(rotated.data() + s.row_begin * q_size, dim, q_size, keys, s.key_stride, values, s.value_stride,
                 *s.index, heads, kv_heads, dim, static_cast<float>(scale), attended.data() + s.row_begin * q_size);
    };
    if (s.half) {
      attend(static_cast<const at::Half*>(s.key_base), static_cast<const at::Half*>(s.value_base));
    } else {
      attend(static_cast<const float*>(s.key_base), static_cast<const float*>(s.value_base));
    }
  }
  w_o.apply(attended.data(), rows, mixed.data(), gemm);
  out_norm(extras.attn_out_norm);
  add_into(o, mixed.data(), rows * width);
  // MLP block.
  for (int64_t r = 0; r < rows; ++r)
    rms_norm(o + r * width, post_norm.data_ptr<float>(), width, epsilon, normed.data() + r * width);
  w_gu.apply(normed.data(), rows, gated.data(), gemm);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gated.data() + r * 2 * intermediate;
    float* activation = activated.data() + r * intermediate;
    (extras.gelu ? gelu_tanh_mul : silu_mul)(gate, gate + intermediate, intermediate, activation);
  }
  w_down.apply(activated.data(), rows, mixed.data(), gemm);
  out_norm(extras.mlp_out_norm);
  add_into(o, mixed.data(), rows * width);
  return out;
}

// The checks every layer call makes of its inputs; returns the parsed projections.
struct LayerWeights {
  Parts qkv;
  Weights o;
  Parts gate_up;
  Weights down;
};

LayerWeights layer_weights(const at::Tensor& hidden, const at::Tensor& input_norm,
                           const at::Tensor& post_norm, const std::vector<std::vector<at::Tensor>>& qkv,
                           const std::vector<at::Tensor>& o_proj,
                           const std::vector<std::vector<at::Tensor>>& gate_up,
                           const std::vector<at::Tensor>& down, const at::Tensor& cos, const at::Tensor& sin,
                           int64_t heads, int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
              hidden.device().is_cpu(), "hidden must be a contiguous float32 CPU matrix [rows, width]");
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  TORCH_CHECK(width % 64 == 0 && dim % 16 == 0 && dim <= 256 && kv_heads > 0 && heads % kv_heads == 0,
              "width must be a multiple of 64, head_dim of 16 (at most 256), heads of kv_heads");
  for (const auto* t : {&input_norm, &post_norm}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == width,
                "norm weights must be float32 [width]");
  }
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == rows &&
                t->size(1) == dim, "cos and sin must be contiguous float32 [rows, head_dim]");
  }
  LayerWeights w{parts_of(qkv, width, "qkv"), weights_of(o_proj, q_size, "o_proj"),
                 parts_of(gate_up, width, "gate_up"), {}};
  const int64_t intermediate = w.gate_up.out_features / 2;
  w.down = weights_of(down, intermediate, "down");
  TORCH_CHECK(w.qkv.out_features == q_size + 2 * kv_size && w.o.out_features == width &&
              w.gate_up.out_features == 2 * intermediate && intermediate % 64 == 0 && w.down.out_features == width,
              "projection shapes do not fit the layer");
  return w;
}

// One sequence's rows through one layer (layer_over_segments with a single segment): new keys and values go to rows
// start .. start + rows - 1 of key_cache / value_cache, and each row attends to the keys `visible` / `lengths` give
// it (as attention() above).
at::Tensor decoder_layer(at::Tensor hidden, at::Tensor input_norm, at::Tensor post_norm, double eps,
                            std::vector<std::vector<at::Tensor>> qkv, std::vector<at::Tensor> o_proj,
                            std::vector<std::vector<at::Tensor>> gate_up, std::vector<at::Tensor> down,
                            at::Tensor cos, at::Tensor sin, at::Tensor key_cache, at::Tensor value_cache,
                            int64_t start, at::Tensor visible, at::Tensor lengths, int64_t heads,
                            double scale, bool gemm, const LayerExtras& extras = {}) {
  TORCH_CHECK(key_cache.dim() == 3, "caches must be float32 or float16 [kv_heads, capacity, dim] with contiguous rows");
  const int64_t kv_heads = key_cache.size(0), dim = key_cache.size(2);
  const LayerWeights w = layer_weights(hidden, input_norm, post_norm, qkv, o_proj, gate_up, down, cos, sin, heads,
                                       kv_heads, dim);
  const auto index = visible_keys(visible, lengths, hidden.size(0), start + hidden.size(0));
  const std::vector<Segment> segments{segment_of(0, hidden.size(0), key_cache, value_cache, start, index, kv_heads,
                                                 dim)};
  return layer_over_segments(hidden, input_norm, post_norm, eps, w.qkv, w.o, w.gate_up, w.down, cos, sin, segments,
                             heads, kv_heads, dim, scale, gemm, extras);
}

// The decoder layers of one model, registered once, run in one call: a forward then crosses from Python to C++
// once instead of once per layer, and converts no weight tensor (a measurable share of a step: docs/kernels.md). Each
// layer runs decoder_layer() above, so the results are the same bits as calling it layer by layer.
class CompiledLayers {
 public:
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps,
                 std::vector<std::vector<at::Tensor>> qkv, std::vector<at::Tensor> o_proj,
                 std::vector<std::vector<at::Tensor>> gate_up,
                 std::vector<at::Tensor> down, int64_t heads, double scale) {
    layers_.push_back({input_norm, post_norm, eps, qkv, o_proj, gate_up, down, heads, scale, {}});
  }

  // What layer `index` adds to Llama's (LayerExtras; None for a step it does not have): Gemma-3's per-head query and
  // key norms, norms of each block's output, gelu_tanh, and which cos / sin pair and visibility of a forward it takes.
  void set_extras(int64_t index, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                  c10::optional<at::Tensor> attn_out_norm, c10::optional<at::Tensor> mlp_out_norm, bool gelu,
                  int64_t rope, int64_t view) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "no layer ", index);
    Layer& l = layers_[index];
    const int64_t width = l.input_norm.numel();
    LayerExtras extras;
    extras.gelu = gelu;
    extras.rope = rope;
    extras.view = view;
    TORCH_CHECK(rope >= 0 && view >= 0, "rope and view index a forward's lists: at least 0");
    auto take = [&](const c10::optional<at::Tensor>& given, at::Tensor& into, int64_t size, const char* name) {
      if (!given.has_value()) return;
      TORCH_CHECK(given->scalar_type() == at::kFloat && given->is_contiguous() && given->dim() == 1 &&
                  given->numel() == size && size % 16 == 0, name, " must be float32 [", size, "]");
      into = *given;
    };
    take(attn_out_norm, extras.attn_out_norm, width, "attn_out_norm");
    take(mlp_out_norm, extras.mlp_out_norm, width, "mlp_out_norm");
    // The head size is known once a cache is set; q_norm and k_norm are checked against it then (head_norms_fit).
    if (q_norm.has_value()) take(q_norm, extras.q_norm, q_norm->numel(), "q_norm");
    if (k_norm.has_value()) take(k_norm, extras.k_norm, k_norm->numel(), "k_norm");
    l.extras = extras;
  }

  // Each layer's key and value buffers ([kv_heads, capacity, dim]); set again whenever a buffer is replaced.
  void set_caches(std::vector<at::Tensor> keys, std::vector<at::Tensor> values) {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "one key and one value buffer "
                "per layer: ", layers_.size(), " layers, ", keys.size(), " key and ", values.size(), " value buffers");
    keys_ = std::move(keys);
    values_ = std::move(values);
  }

  // hidden [rows, width] through every layer (new entries written at start .. start + rows - 1 of the buffers);
  // returns the last layer's output, then the outputs of the layers (1-based) in `keep`, in that order.
  // A layer rotates by cos[extras.rope] / sin[extras.rope] and its rows see the keys visible[extras.view] /
  // lengths[extras.view] give them (one of each for Llama; Gemma-3's sliding layers take their own).
  std::vector<at::Tensor> forward(at::Tensor hidden, int64_t start, std::vector<at::Tensor> visible,
                                     std::vector<at::Tensor> lengths, std::vector<at::Tensor> cos,
                                     std::vector<at::Tensor> sin, bool gemm, std::vector<int64_t> keep) {
    TORCH_CHECK(keys_.size() == layers_.size(), "set_caches before forward");
    TORCH_CHECK(visible.size() == lengths.size() && cos.size() == sin.size(), "one lengths per visibility and one sin "
                "per cos");
    std::vector<at::Tensor> kept(keep.size());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const LayerExtras& x = l.extras;
      TORCH_CHECK(x.rope < static_cast<int64_t>(cos.size()) && x.view < static_cast<int64_t>(visible.size()),
                  "layer ", i, " takes cos / sin pair ", x.rope, " and visibility ", x.view, ": not given");
      head_norms_fit(x, keys_[i].size(2), i);
      hidden = decoder_layer(hidden, l.input_norm, l.post_norm, l.eps, l.qkv, l.o_proj, l.gate_up, l.down,
                             cos[x.rope], sin[x.rope], keys_[i], values_[i], start, visible[x.view], lengths[x.view],
                             l.heads, l.scale, gemm, x);
      for (size_t j = 0; j < keep.size(); ++j)
        if (keep[j] == static_cast<int64_t>(i) + 1) kept[j] = hidden;
    }
    std::vector<at::Tensor> out{hidden};
    out.insert(out.end(), kept.begin(), kept.end());
    return out;
  }

  // Several sequences' rows through every layer in one pass (the batched engine's round): hidden [rows, width] holds
  // row_counts[s] consecutive rows of sequence s, whose new entries go at starts[s] .. of its own buffers keys[s][i]
  // / values[s][i] for layer i, and whose rows see the keys visible[s][v] / lengths[s][v] give them in a layer of
  // view v (as forward() takes them; cos[r] / sin[r] hold every row's rotary pair r). Each row goes through exactly
  // the operations forward() gives it when its sequence is run alone, so its results are the same bits. Returns
  // what forward() returns, over all rows.
  std::vector<at::Tensor> forward_many(at::Tensor hidden, std::vector<int64_t> row_counts,
                                          std::vector<int64_t> starts,
                                          std::vector<std::vector<at::Tensor>> visible,
                                          std::vector<std::vector<at::Tensor>> lengths,
                                          std::vector<std::vector<at::Tensor>> keys,
                                          std::vector<std::vector<at::Tensor>> values,
                                          std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                          std::vector<int64_t> keep) {
    const size_t count = row_counts.size();
    TORCH_CHECK(!layers_.empty(), "no layers registered");
    TORCH_CHECK(starts.size() == count && visible.size() == count && lengths.size() == count &&
                keys.size() == count && values.size() == count, "one start, visibility, lengths and set of caches "
                "per sequence");
    TORCH_CHECK(cos.size() == sin.size(), "one sin per cos");
    int64_t total = 0;
    for (size_t s = 0; s < count; ++s) {
      TORCH_CHECK(row_counts[s] > 0, "sequence ", s, " has no rows");
      TORCH_CHECK(keys[s].size() == layers_.size() && values[s].size() == layers_.size(), "sequence ", s,
                  ": one key and one value buffer per layer");
      TORCH_CHECK(visible[s].size() == lengths[s].size(), "sequence ", s, ": one lengths per visibility");
      total += row_counts[s];
    }
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == total, "hidden must hold the rows of every sequence: ", total,
                " rows");
    TORCH_CHECK(keys[0][0].dim() == 3, "caches must be float32 [kv_heads, capacity, dim] with contiguous rows");
    const int64_t kv_heads = keys[0][0].size(0), dim = keys[0][0].size(2);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerExtras& x = layers_[i].extras;
      TORCH_CHECK(x.rope < static_cast<int64_t>(cos.size()), "layer ", i, " takes cos / sin pair ", x.rope,
                  ": not given");
      for (size_t s = 0; s < count; ++s) {
        TORCH_CHECK(x.view < static_cast<int64_t>(visible[s].size()), "layer ", i, " takes visibility ", x.view,
                    ": not given for sequence ", s);
      }
      head_norms_fit(x, dim, i);
    }
    // index[s][v]: sequence s's rows' visible keys in view v.
    std::vector<std::vector<std::vector<std::vector<int64_t>>>> index(count);
    std::vector<int64_t> begins(count);
    for (size_t s = 0, row = 0; s < count; row += row_counts[s], ++s) {
      for (size_t v = 0; v < visible[s].size(); ++v)
        index[s].push_back(visible_keys(visible[s][v], lengths[s][v], row_counts[s], starts[s] + row_counts[s]));
      begins[s] = static_cast<int64_t>(row);
    }
    std::vector<at::Tensor> kept(keep.size());
    std::vector<Segment> segments;
    segments.reserve(count);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const at::Tensor &c = cos[l.extras.rope], &sn = sin[l.extras.rope];
      const LayerWeights w = layer_weights(hidden, l.input_norm, l.post_norm, l.qkv, l.o_proj, l.gate_up, l.down, c, sn,
                                           l.heads, kv_heads, dim);
      segments.clear();
      for (size_t s = 0; s < count; ++s)
        segments.push_back(segment_of(begins[s], row_counts[s], keys[s][i], values[s][i], starts[s],
                                      index[s][l.extras.view], kv_heads, dim));
      hidden = layer_over_segments(hidden, l.input_norm, l.post_norm, l.eps, w.qkv, w.o, w.gate_up, w.down, c, sn,
                                   segments, l.heads, kv_heads, dim, l.scale, false, l.extras);
      for (size_t j = 0; j < keep.size(); ++j)
        if (keep[j] == static_cast<int64_t>(i) + 1) kept[j] = hidden;
    }
    std::vector<at::Tensor> out{hidden};
    out.insert(out.end(), kept.begin(), kept.end());
    return out;
  }

 private:
  static void head_norms_fit(const LayerExtras& x, int64_t dim, size_t layer) {
    for (const auto* norm : {&x.q_norm, &x.k_norm}) {
      TORCH_CHECK(!norm->defined() || norm->numel() == dim, "layer ", layer, ": q_norm and k_norm must have the "
                  "head size, ", dim);
    }
  }

  struct Layer {
    at::Tensor input_norm, post_norm;
    double eps;
    std::vector<std::vector<at::Tensor>> qkv;
    std::vector<at::Tensor> o_proj;
    std::vector<std::vector<at::Tensor>> gate_up;
    std::vector<at::Tensor> down;
    int64_t heads;
    double scale;
    LayerExtras extras;
  };
  std::vector<Layer> layers_;
  std::vector<at::Tensor> keys_, values_;
};


// ---------------------------------------------------------------------------------------------------------------
// The screened output head: a cheap 4-bit pass ranks the vocabulary, the exact 8-bit head scores the few tokens near
// the top. The 8-bit head (49152 x 576 in SmolLM2, 32 MB with its scales) is read from memory on every decode step,
// evicted by the layers' weights, and costs about a quarter of an int4 step; the 4-bit copy is half the bytes and
// its products are integer (activations rounded to 8 bits, one dot-product instruction per 4 inputs).
//
// screen4: [V, in / 2] uint8. Inputs come in chunks of 64; byte b (0..31) of chunk c holds input c * 64 + b in its
// low nibble and c * 64 + 32 + b in its high one, each as level + 8 (0..15) of a symmetric 4-bit code with one scale
// per vocabulary row (screen_scale [V]). The input x is first multiplied by column [in] (the weight's columns were
// divided by it before rounding: equalised columns round with less error), then rounded to signed 8 bits with one
// scale per input row. The score of row j is screen_scale[j] * x_scale * (sum of level * x8), summed in int32:
// exact, so scores do not depend on which rows or threads shared a call.
//
// Then, per input row: every vocabulary row whose score is within `margin` of the row's best score (at most
// `max_exact` of them: the highest scores) is computed exactly as int8_linear computes it row by row
// (Int8Rows::row, dot_block<1, 1>: the same bits), and its logit replaces the score (a negative margin: the scores
// alone). The result is a deterministic function of the input row
// alone: plain and speculative decoding see the same logits for the same row. Where the exact head's argmax was
// screened out (its score more than `margin` under the best), the argmax differs from the exact head's; the
// docs/kernels.md ("The screened head") says how often that was measured to happen.

// Sum over k inputs of level (0..15) times x8 (signed), for R input rows. Integer sums have no order, so every
// variant below gives the same numbers: x86 builds take 64 inputs a step (VNNI's dot-product instruction where the
// CPU has it, chosen at run time, else two steps whose 16-bit sums cannot saturate), the portable build one at a
// time.

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

bool use_vnni(bool) { return false; }

void screen_range(const uint8_t* wp, const int8_t* x8, int64_t rows, int64_t k, int64_t begin, int64_t end,
                  int32_t* dots) {
  JOINTSPEC_SCREEN_RANGE(screen_dots)
}
#endif

at::Tensor screened_head(at::Tensor x, at::Tensor screen4, at::Tensor screen_scale, at::Tensor column,
                            std::vector<at::Tensor> head, double margin, int64_t max_exact) {
  check_x(x);
  // The exact head as an 8-bit layer takes it, (levels, scale) or Q6_K's (levels, scale, sub), or as a 6-bit one:
  // (packed, plane, scale, sub).
  TORCH_CHECK(head.size() == 2 || head.size() == 3 || head.size() == 4, "screened_head: the exact head comes as "
              "(levels, scale), (levels, scale, sub) or (packed, plane, scale, sub), got ", head.size(), " tensors");
  TORCH_CHECK(head[0].scalar_type() == (head.size() == 4 ? at::kByte : at::kChar),
              "screened_head: the exact head's levels must be int8, or packed uint8 at 6 bits");
  const Weights weights = weights_without_bias(head, x.size(1), "screened_head");
  const int64_t rows = x.size(0), k = x.size(1), vocab = weights.out_features;
  TORCH_CHECK(screen4.scalar_type() == at::kByte && screen4.is_contiguous() && screen4.dim() == 2 &&
              screen4.size(0) == vocab && screen4.size(1) == k / 2, "screen4 must be contiguous uint8 [V, in / 2]");
  TORCH_CHECK(screen_scale.scalar_type() == at::kFloat && screen_scale.is_contiguous() &&
              screen_scale.numel() == vocab, "screen_scale must be float32 [V]");
  TORCH_CHECK(column.scalar_type() == at::kFloat && column.is_contiguous() && column.numel() == k,
              "column must be float32 [in]");
  TORCH_CHECK(std::isfinite(margin), "margin must be finite (below 0: the scores alone, none exact)");
  TORCH_CHECK(max_exact >= 1, "max_exact must be >= 1");
  const float* xp = x.data_ptr<float>();
  const float* cp = column.data_ptr<float>();
  // Each input row equalised and rounded to 8 bits alone (its own scale): rows stay independent.
  std::vector<int8_t> x8(rows * k);
  std::vector<float> x_scale(rows);
  std::vector<int32_t> x_sum(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float top = 0.f;
    for (int64_t i = 0; i < k; ++i) top = std::max(top, std::fabs(xp[r * k + i] * cp[i]));
    const float s = top > 0.f ? top / 127.f : 1.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < k; ++i) {
      const float q = std::nearbyint(xp[r * k + i] * cp[i] / s);
      // A non-finite input (a broken model) scores as 0 rather than being cast: its exact logits say the rest.
      x8[r * k + i] = std::isfinite(q) ? static_cast<int8_t>(std::clamp(q, -127.f, 127.f)) : 0;
      sum += x8[r * k + i];
    }
    x_scale[r] = s;
    x_sum[r] = sum;
  }
  auto out = at::empty({rows, vocab}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = screen4.data_ptr<uint8_t>();
  const float* sp = screen_scale.data_ptr<float>();
  at::parallel_for(0, vocab, 256, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> dots((end - begin) * rows);
    screen_range(wp, x8.data(), rows, k, begin, end, dots.data());
    for (int64_t j = begin; j < end; ++j)
      for (int64_t r = 0; r < rows; ++r)
        op[r * vocab + j] = sp[j] * x_scale[r] * float(dots[(j - begin) * rows + r] - 8 * x_sum[r]);
  });
  // Exact logits near each row's top: the tokens within the margin, at most max_exact of them (the best scores,
  // ties to the lower id), so that a flat row (random text: thousands within the margin) costs a bounded amount.
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (input row, vocabulary row)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = op + r * vocab;
    const float best = *std::max_element(row, row + vocab);
    const float bar = best - static_cast<float>(margin);
    // (score, id) side by side: a flat row's tens of thousands of candidates are then ranked in one array rather
    // than through the ids into the row.
    std::vector<std::pair<float, int64_t>> near;
    near.reserve(std::min<int64_t>(vocab, 4096));
    for (int64_t j = 0; j < vocab; ++j)
      if (row[j] >= bar) near.emplace_back(row[j], j);
    if (static_cast<int64_t>(near.size()) > max_exact) {
      const auto higher = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      std::nth_element(near.begin(), near.begin() + max_exact, near.end(), higher);
      near.resize(max_exact);
    }
    for (const auto& [score, j] : near) pairs.emplace_back(r, j);
  }
  // Each pair alone (its own buffer, the same operations): splitting them between threads changes no bits.
  const auto exact_logits = [&](const auto& exact) {
    at::parallel_for(0, static_cast<int64_t>(pairs.size()), 32, [&](int64_t begin, int64_t end) {
      float* w = static_cast<float*>(std::aligned_alloc(64, k * sizeof(float)));
      for (int64_t i = begin; i < end; ++i) {
        const auto [r, j] = pairs[i];
        exact.row(j, w);
        dot_block<1, 1>(xp + r * k, w, k, op + r * vocab + j, vocab);
      }
      std::free(w);
    });
  };
  if (weights.bits == 6)
    exact_logits(weights.int6_rows());
  else
    exact_logits(weights.int8_rows());
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// A GGUF file's K-quant blocks in the layers' storage, at load (jointspec/kernels/gguf_blocks.py's decode(), whose
// numpy version is the reference these equal byte for byte): plain integer shuffles and exact half -> float widening,
// a row per task. raw: uint8 [rows, blocks * block bytes].

// Q4_K (144 bytes: d, dmin halves, twelve bytes of 6-bit scales and minima, 128 bytes of nibbles) and Q5_K (the same
// with 32 bytes of fifth bits before the nibbles: 176 bytes) -> (packed uint8 [rows, in / 2] in the 4- and 5-bit
// layers' order, (d, dmin) float32 [rows, 2, blocks], (sc, m) uint8 [rows, 2, blocks * 8], and for Q5_K the fifth
// bits int32 [rows, in / 32], bit i of a group's word that of its level i).
std::vector<at::Tensor> k_quant_blocks(at::Tensor raw, bool fifth_bits) {
  const int64_t size = fifth_bits ? 176 : 144;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.size(1) % size == 0,
              "k_quant_blocks: raw must be contiguous uint8 [rows, blocks * ", size, "]");
  const int64_t rows = raw.size(0), blocks = raw.size(1) / size;
  at::Tensor packed = at::empty({rows, blocks * 128}, at::kByte);
  at::Tensor scales = at::empty({rows, 2, blocks}, at::kFloat);
  at::Tensor subs = at::empty({rows, 2, blocks * 8}, at::kByte);
  at::Tensor fifth = at::empty({fifth_bits ? rows : 0, blocks * 8}, at::kInt);
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* d = scales.data_ptr<float>();
  uint8_t* sm = subs.data_ptr<uint8_t>();
  uint32_t* words = fifth_bits ? reinterpret_cast<uint32_t*>(fifth.data_ptr<int32_t>()) : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = in + (r * blocks + b) * size;
        uint16_t half[2];
        std::memcpy(half, block, sizeof half);
        d[(r * 2) * blocks + b] = simd::half_to_float(half[0]);
        d[(r * 2 + 1) * blocks + b] = simd::half_to_float(half[1]);
        const uint8_t* s = block + 4;  // llama.cpp's get_scale_min_k4
        uint8_t* sc = sm + (r * 2) * blocks * 8 + b * 8;
        uint8_t* m = sm + (r * 2 + 1) * blocks * 8 + b * 8;
        for (int j = 0; j < 4; ++j) {
          sc[j] = s[j] & 63;
          m[j] = s[j + 4] & 63;
          sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
          m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
        }
        // Chunk c of 32 bytes: low nibbles are sub-block 2c, high ones 2c + 1; byte i of a sub-block holds its levels
        // i and i + 16. Q5_K: level l of sub-block g takes bit g of qh[l] as its fifth.
        const uint8_t* q = block + (fifth_bits ? 48 : 16);
        uint8_t* o = out + r * blocks * 128 + b * 128;
        for (int c = 0; c < 4; ++c, q += 32, o += 32)
          for (int i = 0; i < 16; ++i) {
            o[i] = (q[i] & 15) | static_cast<uint8_t>(q[i + 16] << 4);
            o[16 + i] = (q[i] >> 4) | (q[i + 16] & 0xF0);
          }
        if (fifth_bits) {
          const uint8_t* qh = block + 16;
          for (int g = 0; g < 8; ++g) {
            uint32_t word = 0;
            for (int l = 0; l < 32; ++l) word |= uint32_t((qh[l] >> g) & 1) << l;
            words[r * blocks * 8 + b * 8 + g] = word;
          }
        }
      }
    }
  });
  if (fifth_bits) return {packed, scales, subs, fifth};
  return {packed, scales, subs};
}

// Q6_K (210 bytes: 128 of low nibbles, 64 of top bit pairs, 16 signed scales, d) -> (packed uint8 [rows, in / 2] and
// plane uint8 [rows, in / 4], the 6-bit layers' storage of each level plus 32 (grouped.py's pack_six); d float32
// [rows, blocks]; sc int8 [rows, blocks * 16]).
std::vector<at::Tensor> q6_k_blocks(at::Tensor raw) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.size(1) % 210 == 0,
              "q6_k_blocks: raw must be contiguous uint8 [rows, blocks * 210]");
  const int64_t rows = raw.size(0), blocks = raw.size(1) / 210;
  at::Tensor packed = at::empty({rows, blocks * 128}, at::kByte);
  at::Tensor plane = at::empty({rows, blocks * 64}, at::kByte);
  at::Tensor scale = at::empty({rows, blocks}, at::kFloat);
  at::Tensor sub = at::empty({rows, blocks * 16}, at::kChar);
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  uint8_t* top_out = plane.data_ptr<uint8_t>();
  float* d = scale.data_ptr<float>();
  int8_t* sc = sub.data_ptr<int8_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    uint8_t level[256];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = in + (r * blocks + b) * 210;
        const uint8_t *ql = block, *qh = block + 128;
        // llama.cpp's dequantize_row_q6_K: element 128h + 32k + l from a nibble of ql and bits 2k, 2k + 1 of qh.
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < 32; ++l) {
            const uint8_t a = ql[64 * h + l], c = ql[64 * h + 32 + l], t = qh[32 * h + l];
            level[128 * h + l] = (a & 15) | ((t & 3) << 4);
            level[128 * h + 32 + l] = (c & 15) | (((t >> 2) & 3) << 4);
            level[128 * h + 64 + l] = (a >> 4) | (((t >> 4) & 3) << 4);
            level[128 * h + 96 + l] = (c >> 4) | (((t >> 6) & 3) << 4);
          }
        uint8_t* o = out + r * blocks * 128 + b * 128;
        uint8_t* p = top_out + r * blocks * 64 + b * 64;
        for (int pair = 0; pair < 4; ++pair) {  // 64 inputs: groups g0 = level[64 pair ..], g1 = level[64 pair + 32 ..]
          const uint8_t *g0 = level + 64 * pair, *g1 = g0 + 32;
          for (int i = 0; i < 16; ++i) {
            o[32 * pair + i] = (g0[i] & 15) | static_cast<uint8_t>(g0[i + 16] << 4);
            o[32 * pair + 16 + i] = (g1[i] & 15) | static_cast<uint8_t>(g1[i + 16] << 4);
            p[16 * pair + i] = (g0[i] >> 4) | ((g1[i] >> 4) << 2) | ((g0[i + 16] >> 4) << 4) | ((g1[i + 16] >> 4) << 6);
          }
        }
        uint16_t half;
        std::memcpy(&half, block + 208, sizeof half);
        d[r * blocks + b] = simd::half_to_float(half);
        std::memcpy(sc + r * blocks * 16 + b * 16, block + 192, 16);
      }
    }
  });
  return {packed, plane, scale, sub};
}

}  // namespace: internal linkage, so the builds for several instruction sets load side by side
}  // namespace JOINTSPEC_NS

using namespace JOINTSPEC_NS;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute runs without Python's lock (taken again to return): a server's event loop thread then answers its
  // clients while a forward runs, instead of waiting for the interpreter's switch interval after every round.
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  m.def("isa", &isa, "the instruction set this build was compiled for: avx512, avx2 or portable");
  m.def("use_q8_inputs", &use_q8_inputs, "quantised layers on 8-bit inputs (the default) or float ones; returns which");
  m.def("use_vnni", &use_vnni, "the screened head on VNNI's dot product (where the CPU has it) or not; returns which");
  m.def("linear", &linear, "x [rows, in] @ dequantised W [out, in]^T, W as (packed, scale, minimum), (packed, fifth, "
        "scale, minimum), (levels, scale) or (levels, scale, sub) (gemm: through MKL, rows not alone)",
        py::arg("x"), py::arg("tensors"), py::arg("gemm") = false, py::arg("q8") = true, unlocked);
  m.def("int4_linear", &int4_linear, "x [rows, in] @ dequantised 4-bit W [out, in]^T (gemm: through MKL, rows not alone)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("minimum"), py::arg("gemm") = false, unlocked);
  m.def("int5_linear", &int5_linear, "x [rows, in] @ dequantised 5-bit W [out, in]^T (4-bit nibbles plus a fifth bit)",
        py::arg("x"), py::arg("packed"), py::arg("fifth"), py::arg("scale"), py::arg("minimum"),
        py::arg("gemm") = false, unlocked);
  m.def("attention", &attention, "row-by-row attention, each (row, head) alone", unlocked);
  m.def("k_quant_blocks", &k_quant_blocks, "a GGUF Q4_K (fifth_bits false) or Q5_K tensor's blocks in the 4- or "
        "5-bit layers' storage", py::arg("raw"), py::arg("fifth_bits"), unlocked);
  m.def("q6_k_blocks", &q6_k_blocks, "a GGUF Q6_K tensor's blocks in the 6-bit layers' storage", unlocked);
  m.def("attention_pairwise", &attention_pairwise, "attention's definition, one (row, head) pair at a time", unlocked);
  py::class_<CompiledLayers>(m, "CompiledLayers", py::module_local())
      .def(py::init<>())
      .def("add_layer", &CompiledLayers::add_layer)
      .def("set_extras", &CompiledLayers::set_extras)
      .def("set_caches", &CompiledLayers::set_caches)
      .def("forward", &CompiledLayers::forward, unlocked)
      .def("forward_many", &CompiledLayers::forward_many, unlocked);
  m.def("int8_linear", &int8_linear, "x [rows, in] @ dequantised 8-bit W [out, in]^T (gemm: through MKL, rows not alone)",
        py::arg("x"), py::arg("levels"), py::arg("scale"), py::arg("gemm") = false, py::arg("q8") = true, unlocked);
  m.def("screened_head", &screened_head, "logits: 4-bit scores, exact 8-bit logits within margin of each row's best",
        py::arg("x"), py::arg("screen4"), py::arg("screen_scale"), py::arg("column"), py::arg("head"),
        py::arg("margin"), py::arg("max_exact"), unlocked);
}
