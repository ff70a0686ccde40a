// CacheAttention's checks and threading over whichever ISA's kernel was chosen.
#include "attention.h"

#include <algorithm>

#include "threadpool.h"

namespace specc {

const char* attention_check(const AttentionArgs& a) {
  if (a.batch < 0 || a.q_heads <= 0 || a.kv_heads <= 0 || a.tokens < 0 || a.slots < 0 || a.dim <= 0)
    return "CacheAttention: empty or negative shapes";
  if (a.q_heads % a.kv_heads != 0) return "CacheAttention: the query heads must be a multiple of the kv heads";
  if (a.dim % kLanes != 0 || a.dim > 16 * kLanes) return "CacheAttention: the head size must be a multiple of 16, at most 256";
  if ((a.mask_batch != 1 && a.mask_batch != a.batch) || (a.mask_heads != 1 && a.mask_heads != a.q_heads))
    return "CacheAttention: the mask must be [1 or B, 1 or Hq, T, S + T]";
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t cl = a.cache_len[b];
    if (cl < 0 || cl > a.slots) return "CacheAttention: cache_len outside the cache";
    for (int64_t t = 0; t < a.tokens; ++t) {
      const int64_t p = a.positions[b * a.tokens + t];
      if (p < cl || p >= cl + a.tokens || p >= a.slots)
        return "CacheAttention: a new token's position must be in [cache_len, cache_len + T) and inside the cache";
    }
  }
  return nullptr;
}

namespace {

AttentionKernel kernel_for(Isa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case Isa::kAvx2:
    case Isa::kAvxVnni: return attend_avx2;
    case Isa::kAvx512Vnni: return attend_avx512;
    default: return attend_scalar;
  }
#else
  (void)isa;
  return attend_scalar;
#endif
}

}  // namespace

void cache_attention(Isa isa, const AttentionArgs& a, int threads) {
  const AttentionKernel kernel = kernel_for(isa);
  const int64_t groups = a.batch * a.kv_heads, queries = a.q_heads / a.kv_heads * a.tokens;
  if (groups == 0 || queries == 0) return;
  // each (row, kv head) reads its own keys once; where there are fewer of them than threads, split their queries
  const int64_t splits = std::min<int64_t>(queries, std::max<int64_t>(1, (threads + groups - 1) / groups));
  const int tasks = static_cast<int>(groups * splits);
  shared_pool().run(tasks, [&](int i) {
    thread_local AttentionScratch scratch;
    const int64_t g = i / splits, part = i % splits;
    kernel(a, g / a.kv_heads, g % a.kv_heads, queries * part / splits, queries * (part + 1) / splits, scratch);
  });
}

}  // namespace specc
