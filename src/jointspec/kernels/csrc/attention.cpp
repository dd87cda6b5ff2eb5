// Attention's definition and its shared-load form (attention.h says what and why). Only ATen's parallel_for and the
// half type from torch: this unit compiles in a fraction of the time grouped_linear.cpp's tensor headers take.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "attention.h"
#include "rows.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace JOINTSPEC_NS {
namespace {

inline V16 load_kv(const float* p) { return simd::load(p); }
inline V16 load_kv(const c10::Half* p) { return simd::load_half(reinterpret_cast<const uint16_t*>(p)); }

// Scores of one query (qv: its dim / 16 chunks) against the `n` <= 16 keys at list entries index[0 .. n - 1],
// times `scale`, into out[0 .. n - 1]: key j's 16-lane partial sums over the chunks in order, then every key's lanes by
// the same tree (simd::sum_lanes16), whatever its neighbours. A whole tile of a common head size (every tile of a
// shared prefix) takes score16_full, whose fixed chunk count keeps the accumulators in registers (sixteen keys' at
// once; four at a time on AVX2, which has sixteen registers and spilled them); the arithmetic is the same either way.
template <int C, bool Contiguous, typename T>
inline void score16_full(const V16* qv, const T* key, const int64_t* index, int64_t dim, float scale, float* out) {
  constexpr int kKeys = simd::kSumGroup;  // keys reduced at once: all sixteen, or AVX2's four
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += kKeys) {
    V16 acc[kKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) {
      const T* k = key + (Contiguous ? i + j : index[i + j]) * dim;
      V16 a = simd::zero();
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a = simd::fmadd(qv[c], load_kv(k + 16 * c), a);
      acc[j] = a;
    }
    simd::sum_lanes_scaled(acc, scale, out + i);
  }
}

// score16_full for the head sizes it fixes (chunks 1, 2, 4, 6 or 8); false for any other, which it leaves unscored.
template <bool Contiguous, typename T>
inline bool score16_fixed(const V16* qv, int64_t chunks, const T* key, const int64_t* index, int64_t dim, float scale,
                          float* out) {
  switch (chunks) {
    case 1: score16_full<1, Contiguous, T>(qv, key, index, dim, scale, out); return true;
    case 2: score16_full<2, Contiguous, T>(qv, key, index, dim, scale, out); return true;
    case 4: score16_full<4, Contiguous, T>(qv, key, index, dim, scale, out); return true;
    case 6: score16_full<6, Contiguous, T>(qv, key, index, dim, scale, out); return true;
    case 8: score16_full<8, Contiguous, T>(qv, key, index, dim, scale, out); return true;
    default: return false;
  }
}

template <typename T>
inline void score16(const V16* qv, int64_t chunks, const T* key, const int64_t* index, int64_t n, int64_t dim,
                    float scale, float* out) {
  if (n == 16 && score16_fixed<false>(qv, chunks, key, index, dim, scale, out)) return;
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

// score16() for sixteen keys held one after another in `tile` (float32 rows of dim): the same arithmetic, without a
// half to widen per query (nor, for the head sizes score16_full fixes, a key list to read).
inline void score16_tile(const V16* qv, int64_t chunks, const float* tile, int64_t dim, float scale, float* out) {
  static constexpr int64_t kIdentity[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  if (!score16_fixed<true>(qv, chunks, tile, nullptr, dim, scale, out))
    score16(qv, chunks, tile, kIdentity, 16, dim, scale, out);
}

// Pairs of one key head that score_tile_pairs() scores a tile for at once (a buffer of kSumGroup partial sums each).
constexpr int64_t kTilePairs = 12;
// A key's 16-float chunks score_tile_pairs() holds in registers at once (eight of AVX2's sixteen).
constexpr int kHeldChunks = 4;

// score16_full's arithmetic for `pairs` (<= kTilePairs) queries of one key head at once, its loops exchanged: each of
// the tile's sixteen keys is loaded (a half widened) once, held in registers kHeldChunks chunks at a time and
// multiplied into every pair's accumulator, which waits in `part` between chunk blocks and until kSumGroup keys are
// in, when sum_lanes_scaled() reduces them. Each pair's lanes sum the same products in the same order (an
// accumulator stored and reloaded between blocks is exact) and reduce by the same tree, so the bits are
// score16_full's; what changes is that a key is loaded and widened once for all the pairs instead of once a pair,
// and that a pair's query is read from L1 instead of held beside the accumulators (which spilled AVX2's sixteen
// registers). q[p]: pair p's query (dim = 16 C floats); out[p] + offset: its sixteen scores.
template <int C, typename T>
inline void score_tile_pairs(const float* const* q, float* const* out, int64_t offset, int64_t pairs, const T* key,
                             const int64_t* index, float scale) {
  constexpr int kGroup = simd::kSumGroup;
  V16 part[kTilePairs * kGroup];
  for (int i = 0; i < 16; i += kGroup) {
    for (int j = 0; j < kGroup; ++j) {
      const T* k = key + index[i + j] * (16 * C);
#pragma GCC unroll 4
      for (int c0 = 0; c0 < C; c0 += kHeldChunks) {
        constexpr int kFirst = C < kHeldChunks ? C : kHeldChunks;
        const int held = c0 + kHeldChunks <= C ? kHeldChunks : C - c0;
        V16 kv[kFirst];
#pragma GCC unroll 4
        for (int c = 0; c < kFirst; ++c)
          if (c < held) kv[c] = load_kv(k + 16 * (c0 + c));
        for (int64_t p = 0; p < pairs; ++p) {
          V16 a = c0 == 0 ? simd::zero() : part[p * kGroup + j];
#pragma GCC unroll 4
          for (int c = 0; c < kFirst; ++c)
            if (c < held) a = simd::fmadd(simd::load(q[p] + 16 * (c0 + c)), kv[c], a);
          part[p * kGroup + j] = a;
        }
      }
    }
    for (int64_t p = 0; p < pairs; ++p) simd::sum_lanes_scaled(part + p * kGroup, scale, out[p] + offset + i);
  }
}

// Whether score_tile_pairs_fixed() takes heads of `chunks` 16-float chunks: 1, 2, 4, 6, 8 or 16 (heads of 16 to 256).
inline bool tile_pairs_fix(int64_t chunks) {
  return chunks == 1 || chunks == 2 || chunks == 4 || chunks == 6 || chunks == 8 || chunks == 16;
}

// score_tile_pairs() for the head sizes tile_pairs_fix() names.
template <typename T>
inline void score_tile_pairs_fixed(int64_t chunks, const float* const* q, float* const* out, int64_t offset,
                                   int64_t pairs, const T* key, const int64_t* index, float scale) {
  switch (chunks) {
    case 1: return score_tile_pairs<1, T>(q, out, offset, pairs, key, index, scale);
    case 2: return score_tile_pairs<2, T>(q, out, offset, pairs, key, index, scale);
    case 4: return score_tile_pairs<4, T>(q, out, offset, pairs, key, index, scale);
    case 6: return score_tile_pairs<6, T>(q, out, offset, pairs, key, index, scale);
    case 8: return score_tile_pairs<8, T>(q, out, offset, pairs, key, index, scale);
    case 16: return score_tile_pairs<16, T>(q, out, offset, pairs, key, index, scale);
    default: TORCH_CHECK(false, "score_tile_pairs: heads of ", chunks, " chunks");
  }
}

// The sixteen keys at list entries index[0 .. 15], widened to float32 into tile[j * dim ..] (exact: every half is a
// float32).
template <typename T>
inline void gather_tile(const T* key, const int64_t* index, int64_t dim, float* tile) {
  for (int j = 0; j < 16; ++j) {
    const T* k = key + index[j] * dim;
    for (int64_t c = 0; c < dim; c += 16) simd::store(tile + j * dim + c, load_kv(k + c));
  }
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
  // Whole vectors without masks (AVX2's masked loads and stores are slow, and a masked load of a masked store's
  // bytes waits for the store to reach the cache), then the last part vector with them.
  for (i = 0; i + 16 <= count; i += 16) {
    const V16 e = simd::exp(simd::sub(simd::load(scores + i), top));
    simd::store(scores + i, e);
    total = simd::add(total, e);
  }
  if (i < count) {
    const int64_t n = count - i;
    simd::store_first(scores + i, simd::exp(simd::sub(simd::load_first(scores + i, n), top)), n);
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

// Queries per pass over the values in attend_all(): their accumulators stay in registers (two per V16 on AVX2, four
// on NEON, whose thirty-two registers hold what AVX2's sixteen do).
#if defined(JOINTSPEC_ISA_AVX2) || defined(JOINTSPEC_ISA_NEON)
constexpr int64_t kValueQueries = 6;
#else
constexpr int64_t kValueQueries = 8;
#endif
// Score entries kept at once: rows are taken in blocks whose scores fit (a long context's rows take smaller blocks).
constexpr int64_t kScoreBudget = int64_t(1) << 21;
// Whether attend_all() scores the shared prefix's tiles with score_tile_pairs() (each key loaded once for all the
// pairs) rather than pair by pair with score16_full() (each pair loading every key, its accumulators held at once).
#if defined(JOINTSPEC_ISA_AVX2)
bool g_score_by_key = true;
#else
bool g_score_by_key = false;
#endif
// Keys per score task: a key head's keys are scored in spans this long, so that a long context's scores spread
// over every thread.
constexpr int64_t kScoreSpan = 512;
// Keys per span of attend_all()'s values passes: a task's share of a span's values (128 keys: 16 KB of float32, two
// chunks a key) stays in L1 while every pass reads it.
constexpr int64_t kValueSpan = 128;
// Passes a values task takes over each span (their accumulators: 6 KB on AVX-512); the rest go to further tasks, so
// that a prompt's many rows still spread over the threads.
constexpr int64_t kValuePasses = 12;

// Pairs of one key head from which attend_all() widens a half cache's tile of keys once for all of them, where
// use_widened_keys() allows it.
constexpr int64_t kWidenPairs = 8;
bool g_widen_keys = true;

// Keys values_pass() prefetches ahead.
constexpr int64_t kValueAhead = 8;

// M queries' values pass for L adjacent 16-float chunks of dim: acc[l * M + m] += p_m[j] * value[index[j]] (chunk
// l) over j in key order, for list entries j in [begin, end). `probs[m]` is query m's row of probabilities. Each
// accumulator sums in key order whatever L is; L = 2 lets one task read whole 64-byte lines of a half cache's values.
// Contiguous: list entry j's chunks are at value + (j - begin) * 16 * L instead (a span widened into a buffer), and
// `index` is not read.
template <int M, int L, typename T, bool Contiguous = false>
inline void values_pass(V16* acc, float* const* probs, const T* value, const int64_t* index, int64_t begin,
                        int64_t end, int64_t dim) {
  V16 a[L * M];
  for (int i = 0; i < L * M; ++i) a[i] = acc[i];
  for (int64_t j = begin; j < end; ++j) {
    // A row's chunks some keys ahead, to L1: a long context's values come from memory, one line or two a key, and
    // the hardware prefetcher did not keep the loop fed (it waited on the loads).
    if (!Contiguous && j + kValueAhead < end) {
      const char* ahead = reinterpret_cast<const char*>(value + index[j + kValueAhead] * dim);
      __builtin_prefetch(ahead, 0, 3);
      if constexpr (L * 16 * sizeof(T) > 64) __builtin_prefetch(ahead + 64, 0, 3);
    }
    const T* row = Contiguous ? value + (j - begin) * 16 * L : value + index[j] * dim;
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
template <int L, typename T, bool Contiguous = false, int M = 1>
inline void values_pass_n(int64_t count, V16* acc, float* const* probs, const T* value, const int64_t* index,
                          int64_t begin, int64_t end, int64_t dim) {
  if constexpr (M * L <= kValueQueries) {
    if (count == M) return values_pass<M, L, T, Contiguous>(acc, probs, value, index, begin, end, dim);
    return values_pass_n<L, T, Contiguous, M + 1>(count, acc, probs, value, index, begin, end, dim);
  } else {
    TORCH_CHECK(false, "values_pass_n: ", count, " queries of ", L, " chunks");
  }
}

}  // namespace

bool use_widened_keys(bool on) {
  g_widen_keys = on;
  return g_widen_keys;
}

bool use_scores_by_key(bool on) {
  g_score_by_key = on;
  return g_score_by_key;
}

bool scores_by_key() { return g_score_by_key; }

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
    // The shared tiles scored key by key for all the pairs at once (score_tile_pairs(), AVX2's way: it widens each
    // key once for all of them too, in registers, and was faster than a widened tile on a Zen 3), else pair by pair,
    // from a tile widened once where there are kWidenPairs pairs or more and use_widened_keys() allows it.
    const bool by_key = g_score_by_key && tile_pairs_fix(chunks);
    const bool widen_tiles =
        !by_key && std::is_same_v<T, c10::Half> && g_widen_keys && block * group >= kWidenPairs;
    // 1. Scores over the shared prefix: per key head and span of keys, every pair of the block; a key head whose
    // prefix is one span also finishes its pairs (their own keys, the softmax) in the same task.
    at::parallel_for(0, kv_heads * spans, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float tile[16 * 256];  // a tile's keys in float32 (dim <= 256)
      std::vector<const float*> pair_queries(by_key ? block * group : 0);
      std::vector<float*> pair_outs(by_key ? block * group : 0);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t g = task / spans, t0 = (task % spans) * span_tiles;
        for (int64_t p = 0; p < static_cast<int64_t>(pair_queries.size()); ++p) {
          const int64_t r = r0 + p / group, h = g * group + p % group;
          pair_queries[p] = qp + h * q_head_stride + r * q_row_stride;
          pair_outs[p] = pair_scores(r, h);
        }
        const int64_t t1 = std::min(shared_tiles, t0 + span_tiles);
        const T* key = kp + g * k_head_stride;
        for (int64_t t = t0; t < t1; ++t) {
          // The next tile's keys, to L1, while this one is scored: its first pair would otherwise wait on memory
          // for each of them (the keys of a long context do not stay in cache from one forward to the next).
          if (t + 1 < t1) prefetch_keys(key, shared_index + 16 * (t + 1), dim);
          // A half cache's tile is widened once for all the pairs of the block where they are kWidenPairs or more
          // and use_widened_keys() allows it (on some CPUs each pair widening it again cost more than the copy, on
          // others less); a float32 one, or fewer pairs (SmolLM2's decoding step has 3), read it in place (there the
          // copy cost as much as it saved, or more).
          if (widen_tiles) gather_tile(key, shared_index + 16 * t, dim, tile);
          if (by_key) {
            for (int64_t p0 = 0; p0 < block * group; p0 += kTilePairs)
              score_tile_pairs_fixed(chunks, pair_queries.data() + p0, pair_outs.data() + p0, 16 * t,
                                     std::min(kTilePairs, block * group - p0), key, shared_index + 16 * t, scale);
            continue;
          }
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              V16 qv[16];
              const float* q = qp + h * q_head_stride + r * q_row_stride;
              for (int64_t c = 0; c < chunks; ++c) qv[c] = simd::load(q + 16 * c);
              float* out = pair_scores(r, h) + 16 * t;
              if (widen_tiles) {
                score16_tile(qv, chunks, tile, dim, scale, out);
              } else {
                score16(qv, chunks, key, shared_index + 16 * t, 16, dim, scale, out);
              }
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
      alignas(64) float span_values[kValueSpan * 32];  // a span's `lines` chunks from c in float32 (widen, below)
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
        // A half cache's span is widened once into `span_values` where the task takes several passes over it (each
        // pass widening it again cost more than the copy).
        const bool widen = std::is_same_v<T, c10::Half> && last - first > 2;
        for (int64_t s0 = 0; s0 < shared; s0 += kValueSpan) {
          const int64_t s1 = std::min(shared, s0 + kValueSpan);
          if (widen) {
            for (int64_t j = s0; j < s1; ++j) {
              if (j + kValueAhead < s1) {
                const char* ahead = reinterpret_cast<const char*>(value + shared_index[j + kValueAhead] * dim);
                __builtin_prefetch(ahead, 0, 3);
              }
              const T* row = value + shared_index[j] * dim;
              for (int64_t l = 0; l < lines; ++l)
                simd::store(span_values + (j - s0) * 16 * lines + 16 * l, load_kv(row + 16 * l));
            }
          }
          for (int64_t pass = first; pass < last; ++pass) {
            V16* acc = held + (pass - first) * kValueQueries;  // acc[l * count + m]: pair m, chunk c + l
            float* const* pass_probs = probs + (pass - first) * kValueQueries;
            const int64_t count = pass_pairs(pass);
            if (widen && lines == 2) {
              values_pass_n<2, float, true>(count, acc, pass_probs, span_values, nullptr, s0, s1, dim);
            } else if (widen) {
              values_pass_n<1, float, true>(count, acc, pass_probs, span_values, nullptr, s0, s1, dim);
            } else if (lines == 2) {
              values_pass_n<2>(count, acc, pass_probs, value, shared_index, s0, s1, dim);
            } else {
              values_pass_n<1>(count, acc, pass_probs, value, shared_index, s0, s1, dim);
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

JOINTSPEC_ATTENTION(, float)
JOINTSPEC_ATTENTION(, c10::Half)

}  // namespace JOINTSPEC_NS
