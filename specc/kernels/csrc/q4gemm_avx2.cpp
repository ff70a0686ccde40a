// AVX2 kernel (256-bit): vpmaddubsw sums a column's products in pairs into int16 lanes, which hold a whole block's
// sums without saturating (u8 weights below 16 times s8 activations of at most 127 in magnitude: 8 pair sums of at
// most 3810 each), and one vpmaddwd per block turns them into the exact int32 dots.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "q4gemm.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

struct DotAvx2 {
  using Acc = __m256i;
  static constexpr int kMaxRows = 6, kPairRows = 3;
  static inline __m256i add(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x));
  }
  static inline __m256i finish(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
};

#include "q4gemm_avx2.inc"

}  // namespace

void gemm_panels_avx2(const QuantizedRows& a, int64_t m, const uint8_t* w, const Q4Layout& l, int64_t p0, int64_t p1,
                      float* y, int64_t ldy, bool stream, Window after) {
  panels<DotAvx2>(a, m, w, l, p0, p1, y, ldy, stream, after);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
