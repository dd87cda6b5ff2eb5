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
// depend on the batch it came in (what keeps speculative decoding exactly equal to plain decoding). Below them, a
// kernel built on the same rule: a whole Llama decoder layer on 4-bit weights. The product itself is products.cpp and
// row-by-row attention attention.cpp, translation units of their own so that a build compiles on several cores;
// rows.h holds the weight forms the product and this unit read.
//
// Every floating-point operation goes through simd.h, whose backends give the same bits, so the same model decodes
// the same tokens on every instruction set (tests/test_kernels_grouped.py holds the builds against each other).
// The tensor type, the three operations used and torch's pybind11 glue, not <torch/extension.h> or <ATen/ATen.h>:
// the headers are most of this unit's compile time, which a first run waits for (the C++ frontend's took over half of
// a build's time; ATen.h's every operation a third of this unit's).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/utils/pybind.h>

#include "attention.h"
#include "rows.h"

#include <cmath>
#include <limits>
#include <cstdlib>
#include <functional>
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
  // f(rows) with an output head's row reader: 6-bit (Q6_K at its own size) or 8-bit levels.
  template <typename F>
  void with_head_rows(F&& f) const {
    if (bits == 6)
      f(int6_rows());
    else
      f(int8_rows());
  }

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
// Attention (attention.cpp): which keys each row sees.
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
      TORCH_CHECK(out > 0, name, ": a layer with no output rows");
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
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a positive multiple of kv_heads");
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
  TORCH_CHECK(width % 64 == 0 && dim % 16 == 0 && dim <= 256 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
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
    TORCH_CHECK(count > 0, "forward_many needs one sequence or more");
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
// docs/kernels.md ("The screened head") says how often that was measured to happen. The screen's integer sums are
// products.cpp's screen_range.

// A row's best score and the tokens within `bar` of it, as std::max_element and a scalar >= scan give them, sixteen
// scores at a time (as softmax_numerators finds its largest score): a NaN first score is the best (then nothing is
// near), a NaN elsewhere is passed over (simd::max keeps its second operand where the first is NaN), and at_least is
// false for NaN, as >= is; the tokens come in id order. (A best of -0 or +0 gives the same bar either way.)
inline float row_best(const float* row, int64_t n) {
  float best = row[0];
  if (std::isnan(best)) return best;
  V16 lanes = simd::set1(best);
  int64_t j = 1;
  for (; j + 16 <= n; j += 16) lanes = simd::max(simd::load(row + j), lanes);
  float lane[16];
  simd::store(lane, lanes);
  for (const float x : lane) best = std::max(best, x);
  for (; j < n; ++j)
    if (best < row[j]) best = row[j];
  return best;
}

// A row's `rank` largest scores with their ids (NaN scores passed over, as at_least passes them), as a heap whose
// front is the one that comes last in the order "larger, or as large with the lower id": a heap of the best so far,
// and a scan sixteen scores at a time for those above its least. Fewer than `rank` where fewer scores are numbers.
// Which scores it holds is an order statistic (ties to the lower ids), so every build gives it.
using Entry = std::pair<float, int64_t>;
inline bool comes_before(const Entry& a, const Entry& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

inline void row_top(const float* row, int64_t n, int64_t rank, std::vector<Entry>& top) {
  top.clear();
  top.reserve(rank);
  int64_t j = 0;
  for (; j < n && static_cast<int64_t>(top.size()) < rank; ++j)
    if (!std::isnan(row[j])) {
      top.emplace_back(row[j], j);
      std::push_heap(top.begin(), top.end(), comes_before);
    }
  if (static_cast<int64_t>(top.size()) < rank) return;
  float least = top.front().first;
  // A later id as large as the least comes after it: only a larger score goes in.
  const auto offer = [&](int64_t i) {
    if (row[i] > least) {
      std::pop_heap(top.begin(), top.end(), comes_before);
      top.back() = {row[i], i};
      std::push_heap(top.begin(), top.end(), comes_before);
      least = top.front().first;
    }
  };
  for (; j + 16 <= n; j += 16)
    for (uint32_t hits = simd::at_least(simd::load(row + j), least); hits; hits &= hits - 1)
      offer(j + __builtin_ctz(hits));
  for (; j < n; ++j) offer(j);
}

// A row's rank-th largest score (NaN scores passed over); -inf where fewer than `rank` scores are numbers.
inline float row_kth(const float* row, int64_t n, int64_t rank) {
  std::vector<Entry> top;
  row_top(row, n, rank, top);
  return static_cast<int64_t>(top.size()) < rank ? -INFINITY : top.front().first;
}

inline void near_scores(const float* row, int64_t n, float bar, std::vector<Entry>& near) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (uint32_t hits = simd::at_least(simd::load(row + j), bar); hits; hits &= hits - 1) {
      const int64_t i = j + __builtin_ctz(hits);
      near.emplace_back(row[i], i);
    }
  for (; j < n; ++j)
    if (row[j] >= bar) near.emplace_back(row[j], j);
}

at::Tensor screened_head(at::Tensor x, at::Tensor screen4, at::Tensor screen_scale, at::Tensor column,
                            std::vector<at::Tensor> head, double margin, int64_t max_exact, int64_t rank,
                            c10::optional<at::Tensor> allowed) {
  check_x(x);
  // The exact head as an 8-bit layer takes it, (levels, scale) or Q6_K's (levels, scale, sub), or as a 6-bit one:
  // (packed, plane, scale, sub).
  TORCH_CHECK(head.size() == 2 || head.size() == 3 || head.size() == 4, "screened_head: the exact head comes as "
              "(levels, scale), (levels, scale, sub) or (packed, plane, scale, sub), got ", head.size(), " tensors");
  TORCH_CHECK(head[0].scalar_type() == (head.size() == 4 ? at::kByte : at::kChar),
              "screened_head: the exact head's levels must be int8, or packed uint8 at 6 bits");
  const Weights weights = weights_without_bias(head, x.size(1), "screened_head");
  const int64_t rows = x.size(0), k = x.size(1), vocab = weights.out_features;
  TORCH_CHECK(weights.bits == 8 || weights.bits == 6, "screened_head: the exact head must be 8-bit or 6-bit, got ",
              weights.bits, " bits");
  TORCH_CHECK(vocab > 0, "screened_head: an empty vocabulary");
  TORCH_CHECK(screen4.scalar_type() == at::kByte && screen4.is_contiguous() && screen4.dim() == 2 &&
              screen4.size(0) == vocab && screen4.size(1) == k / 2, "screen4 must be contiguous uint8 [V, in / 2]");
  TORCH_CHECK(screen_scale.scalar_type() == at::kFloat && screen_scale.is_contiguous() &&
              screen_scale.numel() == vocab, "screen_scale must be float32 [V]");
  TORCH_CHECK(column.scalar_type() == at::kFloat && column.is_contiguous() && column.numel() == k,
              "column must be float32 [in]");
  TORCH_CHECK(std::isfinite(margin), "margin must be finite (below 0: the scores alone, none exact)");
  TORCH_CHECK(max_exact >= 1, "max_exact must be >= 1");
  TORCH_CHECK(rank >= 1 && rank <= max_exact, "rank must be in [1, max_exact], got ", rank);
  // A grammar's allowed tokens per row (structured output): the others score minus infinity and are never completed,
  // so a row's best, its rank-th best and the tokens near them are the allowed tokens' alone.
  const bool* ap = nullptr;
  if (allowed.has_value()) {
    TORCH_CHECK(allowed->scalar_type() == at::kBool && allowed->is_contiguous() && allowed->dim() == 2 &&
                allowed->size(0) == x.size(0) && allowed->size(1) == vocab,
                "screened_head: allowed must be contiguous bool [rows, V]");
    ap = allowed->data_ptr<bool>();
  }
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
    if (ap != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = begin; j < end; ++j)
          if (!ap[r * vocab + j]) op[r * vocab + j] = -INFINITY;
  });
  // Exact logits near each row's top: the tokens within the margin of its best score (of its rank-th best, for a
  // sampler that keeps the top `rank`), at most max_exact of them (the best scores, ties to the lower id), so that a
  // flat row (random text: thousands within the margin) costs a bounded amount.
  // The rows are searched in parallel, each alone, in the same steps as one at a time: a verification or a batch has
  // several rows, and each search is two passes over the whole vocabulary.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> row_pairs(rows);  // (input row, vocabulary row)
  const auto search = [&](int64_t r) {
    const float* row = op + r * vocab;
    const float bar = (rank == 1 ? row_best(row, vocab) : row_kth(row, vocab, rank)) - static_cast<float>(margin);
    // (score, id) side by side: a flat row's tens of thousands of candidates are then ranked in one array rather
    // than through the ids into the row.
    std::vector<Entry> near;
    near.reserve(std::min<int64_t>(vocab, 4096));
    near_scores(row, vocab, bar, near);
    if (ap != nullptr)  // a row with fewer allowed tokens than its rank has a bar of minus infinity, which they pass
      near.erase(std::remove_if(near.begin(), near.end(), [&](const Entry& e) { return !ap[r * vocab + e.second]; }),
                 near.end());
    if (static_cast<int64_t>(near.size()) > max_exact) {
      std::nth_element(near.begin(), near.begin() + max_exact, near.end(), comes_before);
      near.resize(max_exact);
    }
    for (const auto& [score, j] : near) row_pairs[r].emplace_back(r, j);
  };
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) search(r);
  });
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (const auto& found : row_pairs) pairs.insert(pairs.end(), found.begin(), found.end());
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
  weights.with_head_rows(exact_logits);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// A draw of each row's next token through the screen (sampling with temperature alone; core/sampling.py, "Draws").
//
// With independent standard Gumbel noise g, argmax_j (l_j / T + g_j) is a draw from softmax(l / T). The noise is drawn
// top down, as the Gumbel process can be: each block of 64 tokens first gets its maximum, a Gumbel about the
// log-sum-exp of its screen scores z = s / T; only the blocks whose maximum comes within margin / T of the best get
// their tokens' own values (the block's argmax drawn in proportion to exp(z), the others Gumbels truncated at the
// block's maximum), and of those the tokens within margin / T get their exact logit. Every token's noise is then the
// same as a draw of all 49k values would give it in law, whatever the margin; the winner is the exact Gumbel-max
// winner wherever the screen's error is under half the margin (as for greedy rows: measured, not guaranteed).
// The uniforms come from a counter-based generator keyed by the row's key (the request and the position it draws
// for) and the block or token: a row's draw depends on its key and its own logits alone, and every build gives it
// (exp through simd.h, logarithms in double through the C library).
namespace draws {

inline uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform in (0, 1) with 53 random bits, for counter `counter` of stream `stream` of the row keyed `key`.
inline double uniform(uint64_t key, uint64_t stream, uint64_t counter) {
  const uint64_t bits = mix(key ^ mix((stream << 40) + counter));
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

constexpr uint64_t kBlockStream = 1, kTokenStream = 2, kWinnerStream = 3;
constexpr int64_t kBlock = 64;

}  // namespace draws

at::Tensor screened_draws(at::Tensor x, at::Tensor screen4, at::Tensor screen_scale, at::Tensor column,
                          std::vector<at::Tensor> head, double margin, at::Tensor temperature, at::Tensor keys,
                          c10::optional<at::Tensor> allowed) {
  check_x(x);
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == rows,
              "screened_draws: temperature must be float32 [rows]");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.numel() == rows,
              "screened_draws: keys must be int64 [rows]");
  TORCH_CHECK(std::isfinite(margin) && margin >= 0, "screened_draws: margin must be finite and >= 0");
  // The 4-bit scores alone (a negative margin completes no exact logit); a grammar's forbidden tokens at minus
  // infinity, which no draw reaches: the draw is then from softmax over the allowed tokens, the constrained law.
  at::Tensor scores = screened_head(x, screen4, screen_scale, column, head, -1.0, 1, 1, allowed);
  const Weights weights = weights_without_bias(head, k, "screened_draws");
  const int64_t vocab = weights.out_features, blocks = (vocab + draws::kBlock - 1) / draws::kBlock;
  const float* xp = x.data_ptr<float>();
  const float* sp = scores.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  auto out = at::empty({rows}, at::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  const auto draw_rows = [&](const auto& exact) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> z(vocab);
      std::vector<double> top(blocks), lse(blocks);
      float* w = static_cast<float*>(std::aligned_alloc(64, k * sizeof(float)));
      for (int64_t r = begin; r < end; ++r) {
        const float t = tp[r];
        const uint64_t key = static_cast<uint64_t>(kp[r]);
        const float* s = sp + r * vocab;
        for (int64_t j = 0; j < vocab; ++j) z[j] = s[j] / t;
        // Each block's maximum: a Gumbel about its log-sum-exp.
        double best = -INFINITY;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t first = b * draws::kBlock, n = std::min<int64_t>(draws::kBlock, vocab - first);
          float high = -INFINITY;
          for (int64_t j = 0; j < n; ++j) high = std::max(high, z[first + j]);
          if (high == -INFINITY) {  // a block of forbidden tokens: nothing to draw there
            lse[b] = top[b] = -INFINITY;
            continue;
          }
          V16 total = simd::zero();
          const V16 shift = simd::set1(high);
          for (int64_t j = 0; j < n; j += 16) {
            const int64_t m = std::min<int64_t>(16, n - j);
            V16 e = simd::exp(simd::sub(simd::load_first(z.data() + first + j, m), shift));
            if (m < 16) {  // lanes past the block's last token add nothing
              float lanes[16];
              simd::store(lanes, e);
              for (int64_t i = m; i < 16; ++i) lanes[i] = 0.f;
              e = simd::load(lanes);
            }
            total = simd::add(total, e);
          }
          lse[b] = static_cast<double>(high) + std::log(static_cast<double>(simd::reduce_add(total)));
          top[b] = lse[b] - std::log(-std::log(draws::uniform(key, draws::kBlockStream, b)));
          best = std::max(best, top[b]);
        }
        const double bar = best - margin / t;
        int64_t winner = -1;
        double winner_value = -INFINITY;
        for (int64_t b = 0; b < blocks; ++b) {
          if (!(top[b] >= bar) || top[b] == -INFINITY) continue;  // (a row with nothing allowed draws nothing: -1)
          const int64_t first = b * draws::kBlock, n = std::min<int64_t>(draws::kBlock, vocab - first);
          // The block's argmax, in proportion to exp(z) (the block's own shift, in double), then the others below it.
          double weights_sum = 0, cumulative = 0;
          for (int64_t j = 0; j < n; ++j) weights_sum += std::exp(static_cast<double>(z[first + j]) - lse[b]);
          const double u = draws::uniform(key, draws::kWinnerStream, b) * weights_sum;
          int64_t argmax = n - 1;
          for (int64_t j = 0; j < n; ++j) {
            cumulative += std::exp(static_cast<double>(z[first + j]) - lse[b]);
            if (u < cumulative) {
              argmax = j;
              break;
            }
          }
          for (int64_t j = 0; j < n; ++j) {
            const int64_t id = first + j;
            const double zj = static_cast<double>(z[id]);
            // The token's noise g (its perturbed score is z + g): the block's maximum less z for the argmax; for the
            // others a Gumbel about z truncated at that maximum, -log(exp(-top) + E exp(-z)) - z, written as
            // -log(exp(z - top) + E) so that no exponential overflows at a small temperature (z - top is at most
            // about 3.6: top is a Gumbel about the block's log-sum-exp, which z never exceeds).
            const double noise = j == argmax ? top[b] - zj
                : -std::log(std::exp(zj - top[b]) - std::log(draws::uniform(key, draws::kTokenStream, id)));
            if (!(zj + noise >= bar)) continue;
            float logit;
            exact.row(id, w);
            dot_block<1, 1>(xp + r * k, w, k, &logit, 1);
            const double perturbed = static_cast<double>(logit) / t + noise;
            if (perturbed > winner_value) {
              winner_value = perturbed;
              winner = id;
            }
          }
        }
        op[r] = winner;
      }
      std::free(w);
    });
  };
  weights.with_head_rows(draw_rows);
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

// ---------------------------------------------------------------------------------------------------------------
// Sampling's two passes over a vocabulary-wide row (jointspec/core/sampling.py), which PyTorch takes in several
// operations of a full pass each. Both give exactly what those operations give (tests/test_sampling_kernels.py), so
// a sampled token is the same whichever runs.

// The k largest entries of each row of `rows` [n, V], largest first, ties to the lower id (torch.topk leaves the order
// of ties unspecified), with how many entries of the row are >= the k-th largest. A heap of the best k so far and a
// scan sixteen entries at a time for those above its least; a row holding a NaN (which topk ranks above everything)
// gets a count of -1, for the caller to take PyTorch's path. -> (values [n, k], indices int64 [n, k], count int64 [n]).
std::vector<at::Tensor> top_k_rows(at::Tensor rows, int64_t k) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.device().is_cpu(),
              "top_k_rows: rows must be a contiguous float32 CPU matrix [n, V]");
  const int64_t n = rows.size(0), vocab = rows.size(1);
  TORCH_CHECK(1 <= k && k <= vocab, "top_k_rows: k must be in [1, ", vocab, "], got ", k);
  at::Tensor values = at::empty({n, k}, at::kFloat);
  at::Tensor indices = at::empty({n, k}, at::kLong);
  at::Tensor counts = at::empty({n}, at::kLong);
  const float* in = rows.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<Entry> top;
  for (int64_t r = 0; r < n; ++r) {
    const float* row = in + r * vocab;
    row_top(row, vocab, k, top);  // NaN passed over; a row with one is handed back below
    if (static_cast<int64_t>(top.size()) < k) {
      cp[r] = -1;
      continue;
    }
    std::sort_heap(top.begin(), top.end(), comes_before);
    const float kth = top.back().first;
    int64_t count = 0, nan = 0, j = 0;
    for (; j + 16 <= vocab; j += 16) {
      const V16 lanes = simd::load(row + j);
      count += __builtin_popcount(simd::at_least(lanes, kth));
      nan += 16 - __builtin_popcount(simd::at_least(lanes, -INFINITY));
    }
    for (; j < vocab; ++j) {
      count += row[j] >= kth;
      nan += std::isnan(row[j]);
    }
    for (int64_t i = 0; i < k; ++i) {
      vp[r * k + i] = top[i].first;
      ip[r * k + i] = top[i].second;
    }
    cp[r] = nan ? -1 : count;
  }
  return {values, indices, counts};
}

// One token per row of probabilities `probs` [n, V] by inverse transform, with `uniform` [n] in [0, 1): what
// sampling.sample() computes with torch.cumsum (float32 partial sums of a double running sum, as PyTorch's CPU cumsum
// keeps them) and two torch.searchsorted calls. A zero entry leaves the running sum as it was, so it can be neither
// the first partial sum above u * total nor the first to reach the total: only nonzero entries are summed, found
// sixteen at a time, and the two searches run over their partial sums. A row with a negative, infinite or NaN entry,
// or no mass, gets -1: the caller takes PyTorch's path for it. -> int64 [n].
at::Tensor sample_rows(at::Tensor probs, at::Tensor uniform) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous() && probs.device().is_cpu(),
              "sample_rows: probs must be a contiguous float32 CPU matrix [n, V]");
  const int64_t n = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.is_contiguous() && uniform.numel() == n,
              "sample_rows: uniform must be float32 [n]");
  at::Tensor out = at::empty({n}, at::kLong);
  const float* in = probs.data_ptr<float>();
  const float* up = uniform.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // The nonzero entries' ids and the float partial sums there; kept between calls (a row per sampled token).
  thread_local std::vector<int64_t> ids;
  thread_local std::vector<float> sums;
  if (static_cast<int64_t>(ids.size()) < vocab) {
    ids.resize(vocab);
    sums.resize(vocab);
  }
  constexpr float kLeast = std::numeric_limits<float>::denorm_min();
  for (int64_t r = 0; r < n; ++r) {
    const float* row = in + r * vocab;
    int64_t count = 0;
    double sum = 0.0;
    bool bad = false;
    int64_t j = 0;
    for (; j + 16 <= vocab && !bad; j += 16) {
      const V16 lanes = simd::load(row + j);
      // 0 <= x < inf in every lane (false for NaN), else the row is refused.
      bad = ((simd::at_least(lanes, 0.0f) & ~simd::at_least(lanes, INFINITY)) & 0xFFFFu) != 0xFFFFu;
      for (uint32_t hits = bad ? 0u : simd::at_least(lanes, kLeast); hits; hits &= hits - 1) {
        const int64_t i = j + __builtin_ctz(hits);
        sum += static_cast<double>(row[i]);
        ids[count] = i;
        sums[count++] = static_cast<float>(sum);
      }
    }
    for (; j < vocab && !bad; ++j) {
      bad = !(row[j] >= 0.0f) || std::isinf(row[j]);
      if (!bad && row[j] != 0.0f) {
        sum += static_cast<double>(row[j]);
        ids[count] = j;
        sums[count++] = static_cast<float>(sum);
      }
    }
    const float total = count ? sums[count - 1] : 0.0f;
    if (bad || !(total > 0.0f) || std::isinf(total)) {
      op[r] = -1;
      continue;
    }
    const float target = up[r] * total;
    const int64_t draw = std::upper_bound(sums.begin(), sums.begin() + count, target) - sums.begin();
    const int64_t last = std::lower_bound(sums.begin(), sums.begin() + count, total) - sums.begin();
    op[r] = draw < count ? std::min(ids[draw], ids[last]) : ids[last];
  }
  return out;
}

}  // namespace: internal linkage, so the builds for several instruction sets load side by side
}  // namespace JOINTSPEC_NS

using namespace JOINTSPEC_NS;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute runs without Python's lock (taken again to return): a server's event loop thread then answers its
  // clients while a forward runs, instead of waiting for the interpreter's switch interval after every round.
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  m.def("isa", &isa, "the instruction set this build was compiled for: avx512vnni, avx512, avx2vnni, avx2 or portable");
  m.def("use_q8_inputs", &use_q8_inputs, "quantised layers on 8-bit inputs (the default) or float ones; returns which");
  m.def("use_vnni", &use_vnni, "the screened head on VNNI's dot product (where the CPU has it) or not; returns which");
  m.def("use_widened_keys", &use_widened_keys, "attention widens a half cache's key tiles once for many pairs, or "
        "reads them in place (the same bits); returns which");
  m.def("use_scores_by_key", &use_scores_by_key, "attention scores a shared prefix key by key for many pairs at once, "
        "or pair by pair (the same bits); returns which");
  m.def("scores_by_key", &scores_by_key, "whether attention scores a shared prefix key by key (use_scores_by_key)");
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
  m.def("screened_head", &screened_head,
        "logits: 4-bit scores, exact 8-bit logits within margin of each row's best (rank: its rank-th best) score",
        py::arg("x"), py::arg("screen4"), py::arg("screen_scale"), py::arg("column"), py::arg("head"),
        py::arg("margin"), py::arg("max_exact"), py::arg("rank") = 1, py::arg("allowed") = py::none(), unlocked);
  m.def("screened_draws", &screened_draws, "a token per row drawn from softmax(logits / temperature) by Gumbel-max "
        "through the screen, its noise keyed by the row's key", py::arg("x"), py::arg("screen4"),
        py::arg("screen_scale"), py::arg("column"), py::arg("head"), py::arg("margin"), py::arg("temperature"),
        py::arg("keys"), py::arg("allowed") = py::none(), unlocked);
  m.def("top_k_rows", &top_k_rows, "each row's k largest entries, largest first, ties to the lower id, and how many "
        "entries are >= the k-th (-1: the row holds a NaN)", py::arg("rows"), py::arg("k"), unlocked);
  m.def("sample_rows", &sample_rows, "a token per row of probabilities by inverse transform, as sampling.sample() "
        "draws it (-1: a row it hands back)", py::arg("probs"), py::arg("uniform"), unlocked);
}
