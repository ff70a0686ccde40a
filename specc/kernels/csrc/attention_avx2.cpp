// CacheAttention on AVX2 (vec16_avx2.inc: two 256-bit registers are the 16 lanes).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "attention.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

#include "vec16_avx2.inc"
#include "vec16_math.inc"
#include "attention_impl.inc"

}  // namespace

void attend_avx2(const AttentionArgs& a, int64_t b, int64_t hkv, int64_t i0, int64_t i1, AttentionScratch& s) {
  attend<Lanes256x2>(a, b, hkv, i0, i1, s);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
