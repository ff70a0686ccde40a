// AVX-VNNI kernel (256-bit, e.g. Alder Lake, Zen 4/5 without the 512-bit path): the AVX2 kernel with one vpdpbusd
// for a lane's integer dot.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "q4gemm.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")

namespace {

struct DotAvxVnni {
  static inline __m256i dot(__m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x); }
};

#include "q4gemm_avx2.inc"

}  // namespace

void gemm_tiles_avxvnni(const QuantizedRows& a, int64_t m0, int64_t m1, const uint8_t* w, const Q4Layout& l, int64_t t0,
                     int64_t t1, float* y, int64_t ldy) {
  tiles<DotAvxVnni>(a, m0, m1, w, l, t0, t1, y, ldy);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
