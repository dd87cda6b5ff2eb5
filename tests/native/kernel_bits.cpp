// The CPU kernels' arithmetic, built without PyTorch, for holding one build against another where PyTorch cannot run
// the build: the ARM (neondot) build, cross-compiled here and run under an emulator, against the portable build
// (tests/test_kernels_native.py). It links the kernels' two raw-pointer units (products.cpp, attention.cpp) through
// the stand-in headers in shim/, and prints one line per case: its name and a hash of every output bit. Inputs come
// from a seeded integer generator, the same numbers on every CPU. Every build must print the same lines.
#include "rows.h"
#include "attention.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace ns = JOINTSPEC_NS;

namespace {

struct Random {  // splitmix64
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1) with 23 bits, exact in float32 on any CPU.
  float unit() { return static_cast<float>(static_cast<int32_t>(next() >> 40) - (1 << 23)) * 0x1p-23f; }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

// An IEEE half for a float in roughly [2^-10, 2^10] (finite, normal): the float's top bits, truncated.
uint16_t half_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  int exponent = static_cast<int>((bits >> 23) & 255u) - 127 + 15;
  exponent = exponent < 1 ? 1 : exponent > 30 ? 30 : exponent;
  return static_cast<uint16_t>(sign | (uint32_t(exponent) << 10) | ((bits >> 13) & 1023u));
}

struct Hash {  // FNV-1a over bytes
  uint64_t value = 1469598103934665603ULL;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) value = (value ^ b[i]) * 1099511628211ULL;
  }
  // Floats by their bits, every NaN as one NaN: a NaN's payload is not part of the kernels' contract.
  void floats(const float* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      float x = p[i];
      if (x != x) x = __builtin_nanf("");
      bytes(&x, sizeof x);
    }
  }
};

void report(const std::string& name, const Hash& hash) { std::printf("%s %016" PRIx64 "\n", name.c_str(), hash.value); }

std::vector<float> randoms(Random& random, size_t n, float scale) {
  std::vector<float> out(n);
  for (float& x : out) x = random.unit() * scale;
  return out;
}

// The vector primitives on their edges: NaN and infinite lanes, ties, exponent limits, partial loads.
void primitives() {
  Random random{1};
  {
    std::vector<float> x = randoms(random, 4096, 120.0f);
    const float special[] = {0.0f, -0.0f, __builtin_inff(), -__builtin_inff(), __builtin_nanf(""), -87.3f, 88.0f,
                             -87.4f, 88.1f, 1e-30f, -1e-30f, 0.5f, -0.5f, 1.5f, 2.5f, -2.5f};
    x.insert(x.begin(), special, special + 16);
    std::vector<float> out(x.size());
    Hash e, r, m;
    for (size_t i = 0; i < x.size(); i += 16) {
      const simd::V16 v = simd::load(x.data() + i), w = simd::load(x.data() + (i + 16) % x.size());
      simd::store(out.data() + i, simd::exp(v));
      e.floats(out.data() + i, 16);
      simd::store(out.data() + i, simd::round_even(v));
      r.floats(out.data() + i, 16);
      float both[32];
      simd::store(both, simd::max(v, w));
      simd::store(both + 16, simd::min(w, v));
      m.floats(both, 32);
      const uint32_t at = simd::at_least(v, x[(i + 3) % x.size()]);
      m.bytes(&at, sizeof at);
      const float sum = simd::reduce_add(v);
      m.floats(&sum, 1);
      simd::store(both, simd::fnmadd(v, w, simd::fmadd(w, v, simd::set1(0.25f))));
      simd::store(both + 16, simd::div(simd::neg(v), simd::sub(w, simd::set1(3.0f))));
      m.floats(both, 32);
    }
    report("exp", e);
    report("round_even", r);
    report("max_min_at_least_reduce_fma_div", m);
  }
  {
    Hash h;  // every pair of special values, lane by lane: signed zeros, infinities, NaN, subnormals, ties
    const float tiny = std::numeric_limits<float>::denorm_min(), inf = __builtin_inff();
    const float specials[16] = {0.0f, -0.0f, inf, -inf, __builtin_nanf(""), 1.0f, -1.0f, tiny, -tiny,
                                std::numeric_limits<float>::min(), 3.4e38f, -3.4e38f, 0.5f, 2.5f, -87.3f, 88.0f};
    const simd::V16 b = simd::load(specials);
    for (int i = 0; i < 16; ++i) {
      const simd::V16 a = simd::set1(specials[i]);
      const simd::V16 results[] = {simd::max(a, b), simd::min(a, b), simd::max(b, a), simd::min(b, a), simd::add(a, b),
                                   simd::sub(a, b), simd::mul(a, b), simd::div(a, b), simd::fmadd(a, b, b),
                                   simd::fnmadd(a, b, b), simd::exp(simd::mul(a, b)), simd::round_even(simd::mul(a, b)),
                                   simd::neg(simd::mul(a, b))};
      for (const simd::V16& result : results) {
        float out[16];
        simd::store(out, result);
        h.floats(out, 16);
      }
      const uint32_t at = simd::at_least(b, specials[i]) | simd::at_least(a, specials[(i + 5) % 16]) << 16;
      h.bytes(&at, sizeof at);
    }
    report("special_pairs", h);
  }
  {
    Hash h;  // every half, widened whole and in partial loads
    std::vector<uint16_t> halves(65536);
    for (uint32_t i = 0; i < 65536; ++i) halves[i] = static_cast<uint16_t>(i);
    float out[16];
    for (uint32_t i = 0; i < 65536; i += 16) {
      simd::store(out, simd::load_half(halves.data() + i));
      h.floats(out, 16);
      simd::store(out, simd::load_first_half(halves.data() + i, static_cast<int64_t>((i / 16) % 17)));
      h.floats(out, 16);
      simd::store(out, simd::eights_half(halves.data() + i + 3));
      h.floats(out, 16);
    }
    report("halves", h);
  }
  {
    Hash h;  // sixteen vectors' sums by the tree, whole and four or sixteen at a time
    for (int round = 0; round < 64; ++round) {
      simd::V16 v[16];
      const std::vector<float> x = randoms(random, 256, round % 2 ? 1e6f : 3.0f);
      for (int j = 0; j < 16; ++j) v[j] = simd::load(x.data() + 16 * j);
      float out[16];
      simd::store(out, simd::sum_lanes16(v));
      h.floats(out, 16);
      for (int j = 0; j < 16; j += simd::kSumGroup) simd::sum_lanes_scaled(v + j, 0.125f, out + j);
      h.floats(out, 16);
    }
    report("sum_lanes", h);
  }
  {
    Hash h;  // partial loads and small conversions
    std::vector<float> x = randoms(random, 64, 5.0f);
    std::vector<uint8_t> bytes(64);
    for (auto& b : bytes) b = static_cast<uint8_t>(random.next());
    float out[16];
    for (int64_t n = 0; n <= 16; ++n) {
      simd::store(out, simd::load_first(x.data(), n));
      h.floats(out, 16);
      simd::store(out, simd::from_u8_first(bytes.data(), n));
      h.floats(out, 16);
      simd::store(out, simd::from_i8_first(reinterpret_cast<const int8_t*>(bytes.data()), n));
      h.floats(out, 16);
      simd::store(out, simd::doubled(x.data(), n));
      h.floats(out, 16);
      std::fill(out, out + 16, -1.0f);
      simd::store_first(out, simd::load(x.data() + 16), n);
      h.floats(out, 16);
    }
    for (int e = 0; e < 2; ++e) {
      simd::V16 low, high;
      simd::six_group(bytes.data(), bytes.data() + 32, e, low, high);
      simd::store(out, low);
      h.floats(out, 16);
      simd::store(out, high);
      h.floats(out, 16);
    }
    simd::V16 low, high;
    simd::nibbles(bytes.data(), low, high);
    simd::store(out, simd::add(low, simd::sixteens(0xA5C3u)));
    h.floats(out, 16);
    simd::store(out, simd::add(high, simd::eights(x.data(), false)));
    h.floats(out, 16);
    simd::store(out, simd::mul(simd::from_i8(reinterpret_cast<const int8_t*>(bytes.data()) + 7), simd::pow2(simd::set1(-3.0f))));
    h.floats(out, 16);
    report("partial_loads", h);
  }
  {
    Hash h;  // inputs rounded to 8 bits, a group at a time, in both layouts' places
    for (int round = 0; round < 200; ++round) {
      std::vector<float> x = randoms(random, 32, round % 3 == 0 ? 1e-38f : round % 3 == 1 ? 1.0f : 3e4f);
      if (round == 7) x[5] = __builtin_nanf("");
      if (round == 8) x[30] = -__builtin_inff();
      if (round == 9) std::fill(x.begin(), x.end(), 0.0f);
      if (round == 10) x[3] = 126.5f / 127.0f * 4.0f, x[4] = -4.0f;  // ties
      if (round == 11) std::fill(x.begin(), x.end(), -0.0f);
      if (round == 12) for (size_t i = 0; i < x.size(); ++i) x[i] = std::numeric_limits<float>::denorm_min() * float(i);
      if (round == 13) std::fill(x.begin(), x.end(), -3.0f);  // every input the top
      int8_t out[128] = {};
      float step = 0.0f;
      const int sum = simd::quantise_group(x.data(), out, step, round % 2 ? 64 : 32);
      h.bytes(out, sizeof out);
      h.floats(&step, 1);
      h.bytes(&sum, sizeof sum);
    }
    report("quantise_group", h);
  }
}

// The 4- and 5-bit layers in every scale form, on 8-bit and on float inputs, at 1-12 input rows.
void products_int4() {
  Random random{2};
  const ns::ScaleForm forms[] = {ns::ScaleForm::kFloat, ns::ScaleForm::kHalf, ns::ScaleForm::kSuper,
                                 ns::ScaleForm::kHalfOffset};
  const char* form_names[] = {"float", "half", "super", "halfoffset"};
  for (const int64_t k : {192, 576, 512}) {
    const int64_t out_features = 37, groups = k / 32;
    std::vector<uint8_t> packed(out_features * k / 2);
    for (auto& b : packed) b = static_cast<uint8_t>(random.next());
    std::vector<uint32_t> fifth(out_features * groups);
    for (auto& f : fifth) f = static_cast<uint32_t>(random.next());
    std::vector<float> scale = randoms(random, out_features * groups, 0.02f), minimum = randoms(random, out_features * groups, 0.2f);
    std::vector<uint16_t> scale16(out_features * groups), minimum16(out_features * groups);
    for (size_t i = 0; i < scale16.size(); ++i) scale16[i] = half_of(scale[i]), minimum16[i] = half_of(minimum[i]);
    const int64_t blocks = (groups + 15) / 16;
    std::vector<uint8_t> super(out_features * blocks * ns::kSuperBlockBytes);
    for (int64_t n = 0; n < out_features; ++n)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = super.data() + (n * blocks + b) * ns::kSuperBlockBytes;
        const int64_t in_block = std::min<int64_t>(16, groups - 16 * b);
        for (int i = 0; i < 32; ++i) block[i] = (i % 16) < in_block ? static_cast<uint8_t>(random.next() & 63) : 0;
        for (int i = 0; i < 4; ++i) {
          const uint16_t half = half_of(random.unit() * (i < 2 ? 0.002f : 0.01f));
          std::memcpy(block + 32 + 2 * i, &half, 2);
        }
      }
    for (int f = 0; f < 4; ++f)
      for (const bool five : {false, true}) {
        ns::Int4Rows w;
        w.packed = packed.data();
        w.groups = groups;
        w.form = forms[f];
        w.fifth = five ? fifth.data() : nullptr;
        if (forms[f] == ns::ScaleForm::kFloat) w.scale = scale.data(), w.minimum = minimum.data();
        else if (forms[f] == ns::ScaleForm::kHalf) w.scale = scale16.data(), w.minimum = minimum16.data();
        else if (forms[f] == ns::ScaleForm::kSuper) w.scale = super.data(), w.minimum = nullptr;
        else w.scale = scale16.data(), w.minimum = nullptr, w.offset = five ? -16.0f : -8.0f;
        for (const bool q8 : {true, false}) {
          Hash h;
          for (const int64_t rows : {1, 2, 3, 4, 5, 8, 9, 12}) {
            std::vector<float> x = randoms(random, rows * k, 3.0f), out(rows * out_features);
            x[5] *= 40.0f;  // an outlier channel, as real activations have
            ns::multiply(x.data(), rows, k, out_features, out.data(), w, q8);
            h.floats(out.data(), out.size());
          }
          report(std::string("int4_") + form_names[f] + (five ? "_5bit" : "") + (q8 ? "_q8" : "_float") + "_k" +
                     std::to_string(k), h);
        }
      }
  }
}

// The 8-bit layers (groups of 32, and Q6_K's 16 with sub-scales) and the 6-bit one.
void products_int8() {
  Random random{3};
  const int64_t k = 512, out_features = 21;
  std::vector<int8_t> levels(out_features * k);
  for (auto& l : levels) l = static_cast<int8_t>(random.next());
  std::vector<float> scale32 = randoms(random, out_features * k / 32, 0.01f);
  std::vector<float> super = randoms(random, out_features * k / 256, 0.01f);
  std::vector<int8_t> sub(out_features * k / 16);
  for (auto& s : sub) s = static_cast<int8_t>(random.next());
  std::vector<uint8_t> packed(out_features * k / 2), plane(out_features * k / 4);
  for (auto& b : packed) b = static_cast<uint8_t>(random.next());
  for (auto& b : plane) b = static_cast<uint8_t>(random.next());
  const ns::Int8Rows by32{levels.data(), scale32.data(), k / 32, 32};
  const ns::Int8Rows by16{levels.data(), super.data(), k / 16, 16, sub.data()};
  const ns::Int6Rows six(packed.data(), plane.data(), super.data(), sub.data(), k);
  for (const bool q8 : {true, false}) {
    Hash h32, h16, h6;
    for (const int64_t rows : {1, 2, 3, 4, 5, 7, 8, 13}) {
      std::vector<float> x = randoms(random, rows * k, 2.0f), out(rows * out_features);
      ns::multiply(x.data(), rows, k, out_features, out.data(), by32, q8);
      h32.floats(out.data(), out.size());
      ns::multiply(x.data(), rows, k, out_features, out.data(), by16, q8);
      h16.floats(out.data(), out.size());
      ns::multiply(x.data(), rows, k, out_features, out.data(), six, q8);
      h6.floats(out.data(), out.size());
    }
    const std::string inputs = q8 ? "_q8" : "_float";
    report("int8_groups32" + inputs, h32);
    report("int8_q6k" + inputs, h16);
    report("int6_q6k" + inputs, h6);
  }
}

// The screened head's integer screen at 1-9 input rows.
void screen() {
  Random random{4};
  for (const int64_t k : {128, 576}) {
    const int64_t vocab = 300;
    std::vector<uint8_t> w(vocab * k / 2);
    for (auto& b : w) b = static_cast<uint8_t>(random.next());
    Hash h;
    for (const int64_t rows : {1, 2, 3, 4, 5, 9}) {
      std::vector<int8_t> x(rows * k);
      for (auto& v : x) v = static_cast<int8_t>(random.below(255) - 127);
      std::vector<int32_t> dots((vocab - 7) * rows);
      ns::screen_range(w.data(), x.data(), rows, k, 7, vocab, dots.data());
      h.bytes(dots.data(), dots.size() * sizeof(int32_t));
    }
    report("screen_k" + std::to_string(k), h);
  }
}

// Attention over float32 and half caches: grouped heads, causal and gapped key lists, 1-12 rows, both forms of
// attend_all's half tiles and both orders of its scores (key by key for many pairs, pair by pair), against the same
// cases pair by pair.
template <typename T>
void attention(const char* name) {
  Random random{5};
  for (const int form_index : {0, 1, 2, 3}) {
    const bool widen = form_index % 2 == 0, by_key = form_index < 2;
    ns::use_widened_keys(widen);
    ns::use_scores_by_key(by_key);
    Hash all, pairs;
    for (const int64_t dim : {16, 64, 128})
      for (const int64_t keys : {3, 17, 300, 1500}) {
        const int64_t heads = 6, kv_heads = 2;
        for (const int64_t rows : {1, 2, 5, 12}) {
          const std::vector<float> q = randoms(random, rows * heads * dim, 2.0f);
          const std::vector<float> kf = randoms(random, kv_heads * keys * dim, 2.0f), vf = randoms(random, kv_heads * keys * dim, 2.0f);
          std::vector<T> kc(kf.size()), vc(vf.size());
          for (size_t i = 0; i < kf.size(); ++i) {
            if constexpr (std::is_same_v<T, float>) kc[i] = kf[i], vc[i] = vf[i];
            else kc[i] = T{half_of(kf[i])}, vc[i] = T{half_of(vf[i])};
          }
          std::vector<std::vector<int64_t>> index(rows);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t seen = std::max<int64_t>(1, keys - rows + 1 + r);  // causal: the last rows see more
            for (int64_t j = 0; j < seen; ++j)
              if (j == 0 || r % 2 == 0 || random.below(10) < 7) index[r].push_back(j);  // odd rows: gaps
          }
          std::vector<float> out(rows * heads * dim), by_pairs(out.size());
          const float scale = 1.0f / 8.0f;
          ns::attend_all<T>(q.data(), dim, heads * dim, kc.data(), keys * dim, vc.data(), keys * dim, index, heads,
                            kv_heads, dim, scale, out.data());
          ns::attend_pairs<T>(q.data(), dim, heads * dim, kc.data(), keys * dim, vc.data(), keys * dim, index, heads,
                              kv_heads, dim, scale, by_pairs.data());
          all.floats(out.data(), out.size());
          pairs.floats(by_pairs.data(), by_pairs.size());
          if (std::memcmp(out.data(), by_pairs.data(), out.size() * sizeof(float)) != 0)
            std::printf("attend_all_differs_from_pairs %s dim %" PRId64 " keys %" PRId64 " rows %" PRId64 "\n", name, dim,
                        keys, rows);
        }
      }
    const std::string form = std::string(name) + (widen ? "_widened" : "_in_place") + (by_key ? "_by_key" : "");
    report("attention_all_" + form, all);
    report("attention_pairs_" + form, pairs);
  }
}

}  // namespace

int main() {
  std::printf("build %s\n", JOINTSPEC_ISA_NAME);
  primitives();
  products_int4();
  products_int8();
  screen();
  attention<float>("float32");
  attention<c10::Half>("half");
  return 0;
}
