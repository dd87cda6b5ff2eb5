// Weight-only quantised linear layers for CPU decoding: y = x W^T with W stored as 4- or 8-bit levels in groups of
// 32 inputs, one scale (and, for 4 bits, one minimum) per group, and float32 activations. Built at first use by
// jointspec/models/grouped.py (torch.utils.cpp_extension); see that module for why and for the measurements.
//
// Each thread takes a range of output rows. For each row it dequantises the row's weights once into a float32
// buffer that stays in L1 cache, then takes the dot product of that buffer with every input row. So the weights are
// read from memory once per forward whatever the number of input rows (what verifying several draft tokens needs),
// and every output is computed by exactly the same instructions whatever the number of rows: a row's result does not
// depend on the batch it came in (what keeps speculative decoding exactly equal to plain decoding).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdlib>

namespace {

constexpr int64_t kGroup = 32;

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kAvailable = true;

// 4 bits: byte i of a group holds level i (low nibble) and level i + 16 (high nibble); w = level * scale + minimum.
inline void dequantise_int4(const uint8_t* row, const float* scale, const float* minimum, int64_t groups, float* w) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(scale[g]), lo = _mm512_set1_ps(minimum[g]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * kGroup / 2));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, nibble)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)));
    _mm512_store_ps(w + g * kGroup, _mm512_fmadd_ps(low, s, lo));
    _mm512_store_ps(w + g * kGroup + 16, _mm512_fmadd_ps(high, s, lo));
  }
}

// 8 bits: signed levels, w = level * scale.
inline void dequantise_int8(const int8_t* row, const float* scale, int64_t groups, float* w) {
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(scale[g]);
    for (int64_t half = 0; half < 2; ++half) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * kGroup + half * 16));
      const __m512 levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      _mm512_store_ps(w + g * kGroup + half * 16, _mm512_mul_ps(levels, s));
    }
  }
}

// Four independent accumulators over 64 inputs at a time, summed in a fixed order.
inline float dot(const float* x, const float* w, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_load_ps(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_load_ps(w + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), _mm512_load_ps(w + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), _mm512_load_ps(w + i + 48), a3);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
// Without AVX-512 nothing here runs (check() refuses first and grouped.py keeps PyTorch's kernels); these plain
// versions only let the file compile.
constexpr bool kAvailable = false;

inline void dequantise_int4(const uint8_t* row, const float* scale, const float* minimum, int64_t groups, float* w) {
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      w[g * kGroup + i] = float(row[g * kGroup / 2 + i] & 15) * scale[g] + minimum[g];
      w[g * kGroup + i + kGroup / 2] = float(row[g * kGroup / 2 + i] >> 4) * scale[g] + minimum[g];
    }
}

inline void dequantise_int8(const int8_t* row, const float* scale, int64_t groups, float* w) {
  for (int64_t i = 0; i < groups * kGroup; ++i) w[i] = float(row[i]) * scale[i / kGroup];
}

inline float dot(const float* x, const float* w, int64_t k) {
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += x[i] * w[i];
  return sum;
}
#endif

void check(const torch::Tensor& x, const torch::Tensor& levels, int64_t bytes_per_row, const torch::Tensor& scale) {
  TORCH_CHECK(kAvailable, "jointspec's grouped int4/int8 kernels need AVX-512 (F and BW); this CPU build has none");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix [rows, in]");
  TORCH_CHECK(x.size(1) % 64 == 0, "in_features must be a multiple of 64, got ", x.size(1));
  TORCH_CHECK(levels.dim() == 2 && levels.is_contiguous() && levels.size(1) == bytes_per_row,
              "levels must be a contiguous [out, ", bytes_per_row, "] matrix");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.size(0) == levels.size(0) &&
              scale.size(1) == x.size(1) / kGroup, "scale must be a contiguous float32 [out, in / 32] matrix");
}

template <typename Dequantise>
torch::Tensor run(const torch::Tensor& x, int64_t out_features, Dequantise dequantise) {
  const int64_t rows = x.size(0), k = x.size(1);
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    float* w = static_cast<float*>(std::aligned_alloc(64, k * sizeof(float)));
    for (int64_t n = begin; n < end; ++n) {
      dequantise(n, w);
      for (int64_t m = 0; m < rows; ++m) op[m * out_features + n] = dot(xp + m * k, w, k);
    }
    std::free(w);
  });
  return out;
}

}  // namespace

bool available() { return kAvailable; }

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor minimum) {
  check(x, packed, x.size(1) / 2, scale);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "packed levels must be uint8");
  TORCH_CHECK(minimum.sizes() == scale.sizes() && minimum.scalar_type() == torch::kFloat && minimum.is_contiguous(),
              "minimum must be shaped and typed like scale");
  const int64_t groups = scale.size(1);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minimum.data_ptr<float>();
  return run(x, packed.size(0), [&](int64_t n, float* w) {
    dequantise_int4(wp + n * groups * kGroup / 2, sp + n * groups, mp + n * groups, groups, w);
  });
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor levels, torch::Tensor scale) {
  check(x, levels, x.size(1), scale);
  TORCH_CHECK(levels.scalar_type() == torch::kInt8, "levels must be int8");
  const int64_t groups = scale.size(1);
  const int8_t* wp = levels.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return run(x, levels.size(0), [&](int64_t n, float* w) {
    dequantise_int8(wp + n * groups * kGroup, sp + n * groups, groups, w);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX-512 kernels");
  m.def("int4_linear", &int4_linear, "x [rows, in] @ dequantised 4-bit W [out, in]^T");
  m.def("int8_linear", &int8_linear, "x [rows, in] @ dequantised 8-bit W [out, in]^T");
}
