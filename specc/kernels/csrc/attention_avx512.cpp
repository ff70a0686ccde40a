// CacheAttention on AVX-512 (vec16_avx512.inc: one register is the 16 lanes).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "attention.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq")

namespace {

#include "vec16_avx512.inc"
#include "vec16_math.inc"
#include "attention_impl.inc"

}  // namespace

void attend_avx512(const AttentionArgs& a, int64_t b, int64_t hkv, int64_t i0, int64_t i1, AttentionScratch& s) {
  attend<Lanes512>(a, b, hkv, i0, i1, s);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
