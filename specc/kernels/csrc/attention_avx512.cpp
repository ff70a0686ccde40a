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
  // The 16 trees at once: each step adds the lanes the tree pairs (i and i + 8, i + 4, i + 2, i + 1) of two registers
  // side by side, inputs taken in the order that leaves lane j with register j's sum.
  static reg hsums(const reg* d) {
    constexpr int order[kLanes] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    __m512 l1[8], l2[4], l3[2];
    for (int m = 0; m < 8; ++m) {
      const __m512 a = d[order[2 * m]], b = d[order[2 * m + 1]];
      l1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int m = 0; m < 4; ++m)
      l2[m] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * m], l1[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(l1[2 * m], l1[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; ++m)
      l3[m] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * m], l2[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(l2[2 * m], l2[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static constexpr bool kWideRegisterFile = true;
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
