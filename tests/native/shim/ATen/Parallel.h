// A stand-in for ATen's parallel_for, for compiling the kernels' raw-pointer units without PyTorch (kernel_bits.cpp):
// the range in chunks of `grain`, one after another, so the kernels' split points are exercised on one thread.
#pragma once

#include <algorithm>
#include <cstdint>

namespace at {
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t step = std::max<int64_t>(grain, 1);
  for (int64_t first = begin; first < end; first += step) f(first, std::min(end, first + step));
}
}  // namespace at
