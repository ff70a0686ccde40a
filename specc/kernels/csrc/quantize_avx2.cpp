// The activation quantiser with AVX2: the scalar reference's arithmetic (q4gemm.h) eight inputs at a time. Rounding
// with vcvtps2dq under the default rounding mode is round-half-even, as std::nearbyint is, so both give the same bits.
#include "q4gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

}  // namespace

void quantize_rows_avx2(const float* x, int64_t m0, int64_t m1, int64_t k, int64_t blocks, int8_t* q, float* d,
                        float* dsum) {
  const int64_t supers = (blocks + kSuper - 1) / kSuper;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  alignas(32) float padded[kBlock];
  for (int64_t r = m0; r < m1; ++r) {
    const float* xr = x + r * k;
    int8_t* qr = q + r * blocks * kBlock;
    for (int64_t s = 0; s < supers; ++s) {
      const int64_t begin = s * kSuper * kBlock, end = std::min<int64_t>(begin + kSuper * kBlock, blocks * kBlock);
      const int64_t full = std::min(end, k) - (std::min(end, k) - begin) % 8;
      __m256 vmax = _mm256_setzero_ps();
      for (int64_t c = begin; c < full; c += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + c)));
      float amax = hmax8(vmax);
      for (int64_t c = full; c < std::min(end, k); ++c) amax = std::fmax(amax, std::fabs(xr[c]));
      const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m256 vinv = _mm256_set1_ps(inv);
      d[r * supers + s] = scale;
      for (int64_t b = begin / kBlock; b < end / kBlock; ++b) {
        const float* src = xr + b * kBlock;
        if ((b + 1) * kBlock > k) {  // the block reaches past K: its missing inputs are zeros
          for (int i = 0; i < kBlock; ++i) padded[i] = b * kBlock + i < k ? src[i] : 0.0f;
          src = padded;
        }
        __m256i v[4];
        for (int i = 0; i < 4; ++i)
          v[i] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * i), vinv))));
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + b * kBlock), bytes);
        const int32_t sum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
        dsum[r * blocks + b] = scale * static_cast<float>(sum);
      }
    }
  }
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
