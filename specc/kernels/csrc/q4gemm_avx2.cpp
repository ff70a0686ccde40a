// AVX2 kernel (256-bit): one output column per register of eight lanes; the integer dot of a lane is
// vpmaddubsw + vpmaddwd (u8 weights below 16 times s8 activations: a pair's sum stays far from int16 saturation),
// the exact int32 sums the reference defines.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "q4gemm.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

struct DotAvx2 {
  static inline __m256i dot(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  }
};

#include "q4gemm_avx2.inc"

}  // namespace

void gemm_tiles_avx2(const QuantizedRows& a, int64_t m0, int64_t m1, const uint8_t* w, const Q4Layout& l, int64_t t0,
                     int64_t t1, float* y, int64_t ldy) {
  tiles<DotAvx2>(a, m0, m1, w, l, t0, t1, y, ldy);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
