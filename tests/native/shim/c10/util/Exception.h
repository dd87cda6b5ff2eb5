// A stand-in for TORCH_CHECK (kernel_bits.cpp): a failed check ends the program.
#pragma once

#include <cstdio>
#include <cstdlib>

#define TORCH_CHECK(condition, ...)                                           \
  do {                                                                        \
    if (!(condition)) {                                                       \
      std::fprintf(stderr, "TORCH_CHECK failed: %s\n", #condition);          \
      std::abort();                                                           \
    }                                                                         \
  } while (0)
