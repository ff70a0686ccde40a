// CacheAttention on AVX-512: one register is the 16 lanes attention.h defines.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "attention.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq")

namespace {

#include "attention_x86.inc"

struct Lanes512 {
  using reg = __m512;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg round(reg a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg pow2(reg n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static reg keep(uint32_t bits, reg a) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(bits), a); }
  static float hsum(reg a) {
    return hsum_tree8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
  }
  static uint32_t nonzero16(const uint8_t* p) { return nonzero_bytes16(p); }
};

#include "attention_impl.inc"

}  // namespace

void attend_avx512(const AttentionArgs& a, int64_t b, int64_t hkv, int64_t i0, int64_t i1, AttentionScratch& s) {
  attend<Lanes512>(a, b, hkv, i0, i1, s);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
