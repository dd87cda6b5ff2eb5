// A stand-in for c10::Half (kernel_bits.cpp): the kernels only reinterpret its 16 bits.
#pragma once

#include <cstdint>

namespace c10 {
struct Half {
  uint16_t x;
};
}  // namespace c10
