// SwiGLU on AVX2 (vec16_avx2.inc).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>

#include "glu.h"
#include "vec16.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

#include "vec16_avx2.inc"
#include "vec16_math.inc"
#include "glu_impl.inc"

}  // namespace

void swiglu_avx2(const float* gate, const float* up, float* y, int64_t n, bool stream) {
  swiglu_lanes<Lanes256x2>(gate, up, y, n, stream);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
