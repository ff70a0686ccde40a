// The CacheAttention reference: attention_impl.inc over a 16-lane vector spelled out lane by lane, each operation
// the one the SIMD kernels' instruction performs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention.h"

namespace specc {

namespace {

#include "vec16_scalar.inc"
#include "vec16_math.inc"
#include "attention_impl.inc"

}  // namespace

void attend_scalar(const AttentionArgs& a, int64_t b, int64_t hkv, int64_t i0, int64_t i1, AttentionScratch& s) {
  attend<LanesScalar>(a, b, hkv, i0, i1, s);
}

}  // namespace specc
