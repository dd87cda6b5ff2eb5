// Attention for the compiled layers (grouped_linear.cpp) and the kernels' attention(): a translation unit of its own,
// which a build compiles beside the other two (a first run waits on the compiler). Defined one (query row, head) pair
// at a time: scores over the keys the row may see, in key order; softmax; the probability-weighted sum of values, in
// key order. A pair's result depends only on its query and the keys it sees, never on the other rows of the call, so
// a row verified among draft tokens equals the row decoded alone (what jointspec/kernels/quantize.py's row-wise
// attention needs), and one call serves every row and head of a layer. attend_pairs() is that definition pair by pair;
// attend_all() computes the same bits for many pairs at once, sharing each key and value it loads among the pairs
// that see it (the query heads of one key head, the rows of one sequence). Keys and values are float32 or IEEE half
// (`T`: a cache stored in 16 bits, --kv-cache float16); a half is widened exactly when loaded, so the arithmetic is the
// same float32 arithmetic on the values the cache holds.
#pragma once

#ifndef JOINTSPEC_NS
#define JOINTSPEC_NS TORCH_EXTENSION_NAME
#endif

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace JOINTSPEC_NS {

// Every (row, head) pair: query row r of head h at qp + h * q_head_stride + r * q_row_stride (dim floats) against key
// head h / (heads / kv_heads)'s keys and values (rows of dim at kp + g * k_head_stride + j * dim, likewise vp), the
// keys `index[r]` lists (ascending); out [rows, heads, dim]. dim is a multiple of 16, at most 256.
template <typename T>
void attend_all(const float* qp, int64_t q_head_stride, int64_t q_row_stride, const T* kp, int64_t k_head_stride,
                const T* vp, int64_t v_head_stride, const std::vector<std::vector<int64_t>>& index,
                int64_t heads, int64_t kv_heads, int64_t dim, float scale, float* op);
// Whether attend_all() widens a half cache's tiles of keys once for a key head's many pairs (the default) or each
// pair reads them in place, where it scores pair by pair (below); the bits are the same either way, the speed is not
// on every CPU (kernels/grouped.py chooses). Returns the setting.
bool use_widened_keys(bool on);
// Whether attend_all() scores a shared prefix key by key for many pairs at once (score_tile_pairs(), the default on
// AVX2) or pair by pair; the bits are the same either way. Returns the setting.
bool use_scores_by_key(bool on);
bool scores_by_key();  // the setting in force
// The same, by the definition pair by pair on one thread: what attend_all() must equal bit for bit.
template <typename T>
void attend_pairs(const float* qp, int64_t q_head_stride, int64_t q_row_stride, const T* kp, int64_t k_head_stride,
                  const T* vp, int64_t v_head_stride, const std::vector<std::vector<int64_t>>& index,
                  int64_t heads, int64_t kv_heads, int64_t dim, float scale, float* op);

// Their two instantiations, defined in attention.cpp (`extern` here, so that no other unit compiles them again).
#define JOINTSPEC_ATTENTION(EXTERN, T)                                                                                   \
  EXTERN template void attend_all<T>(const float*, int64_t, int64_t, const T*, int64_t, const T*, int64_t,            \
                                     const std::vector<std::vector<int64_t>>&, int64_t, int64_t, int64_t, float,      \
                                     float*);                                                                        \
  EXTERN template void attend_pairs<T>(const float*, int64_t, int64_t, const T*, int64_t, const T*, int64_t,          \
                                       const std::vector<std::vector<int64_t>>&, int64_t, int64_t, int64_t, float,    \
                                       float*);
JOINTSPEC_ATTENTION(extern, float)
JOINTSPEC_ATTENTION(extern, c10::Half)

}  // namespace JOINTSPEC_NS
