// The integer dot-product peak a kernel's instruction sequence can reach on one core: independent chains of the
// instructions the kernels use for a block's dots (vpdpbusd, or vpmaddubsw + vpaddw into int16 sums without VNNI)
// on registers only. specc bench reports verify passes' MACs per second against it.
#include "q4gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specc {

namespace {
constexpr int kChains = 12;  // enough independent accumulators to cover the instructions' latency
}

#if defined(__x86_64__)

__attribute__((target("avx2"))) int64_t dot_peak_avx2(int64_t iterations) {
  // products of distinct weights, their activations opaque to the compiler each round: it may neither share one
  // product between the chains nor hoist it out of the loop; six chains leave room in the 16 registers
  constexpr int kChains16 = 6;
  __m256i acc[kChains16], w[kChains16];
  __m256i x = _mm256_set1_epi8(-3);
  for (int c = 0; c < kChains16; ++c) {
    acc[c] = _mm256_setzero_si256();
    w[c] = _mm256_set1_epi8(static_cast<char>(3 + c));
  }
  for (int64_t i = 0; i < iterations; ++i) {
    __asm__ volatile("" : "+x"(x));
    for (int c = 0; c < kChains16; ++c) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(w[c], x));
  }
  __m256i sum = acc[0];
  for (int c = 1; c < kChains16; ++c) sum = _mm256_add_epi16(sum, acc[c]);
  volatile int sink = _mm256_extract_epi16(sum, 0);
  (void)sink;
  return iterations * kChains16 * 32;
}

__attribute__((target("avx2,avxvnni"))) int64_t dot_peak_avxvnni(int64_t iterations) {
  __m256i acc[kChains];
  const __m256i w = _mm256_set1_epi8(7), x = _mm256_set1_epi8(-3);
  for (auto& a : acc) a = _mm256_setzero_si256();
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], w, x);
  __m256i sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_epi32(sum, acc[c]);
  volatile int sink = _mm256_extract_epi32(sum, 0);
  (void)sink;
  return iterations * kChains * 32;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t dot_peak_avx512vnni(int64_t iterations) {
  __m512i acc[kChains];
  const __m512i w = _mm512_set1_epi8(7), x = _mm512_set1_epi8(-3);
  for (auto& a : acc) a = _mm512_setzero_si512();
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], w, x);
  __m512i sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[c]);
  volatile int sink = _mm512_reduce_add_epi32(sum);
  (void)sink;
  return iterations * kChains * 64;
}

#endif

int64_t dot_peak(Isa isa, int64_t iterations) {
#if defined(__x86_64__)
  switch (isa) {
    case Isa::kAvx2: return dot_peak_avx2(iterations);
    case Isa::kAvxVnni: return dot_peak_avxvnni(iterations);
    case Isa::kAvx512Vnni: return dot_peak_avx512vnni(iterations);
    default: break;
  }
#endif
  int32_t acc[kChains] = {0};
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] += 7 * -3 + c;
  volatile int32_t sink = acc[0];
  (void)sink;
  return iterations * kChains;
}

}  // namespace specc
