// AVX-VNNI kernel (256-bit, e.g. Alder Lake, Zen 4/5 without the 512-bit path): the AVX2 kernel with vpdpbusd
// adding a block's products straight into int32 lanes.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "q4gemm.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")

namespace {

struct DotAvxVnni {
  using Acc = __m256i;
  static constexpr int kMaxRows = 5, kPairRows = 5;
  static inline __m256i add(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
  static inline __m256i finish(__m256i acc) { return acc; }
};

#include "q4gemm_avx2.inc"

}  // namespace

void gemm_panels_avxvnni(const QuantizedRows& a, int64_t m, const uint8_t* w, const Q4Layout& l, int64_t p0,
                         int64_t p1, float* y, int64_t ldy, bool stream, Window after) {
  panels<DotAvxVnni>(a, m, w, l, p0, p1, y, ldy, stream, after);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
