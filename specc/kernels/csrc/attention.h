// CacheAttention: a chain or tree pass's attention over the keys at their positions, without copying the cache.
//
// A pass of T new tokens attends over the cache's S slots with the new tokens' keys and values standing in the slots
// of their positions. The mask has a column per cached slot and per new token ([cache ; new], the exported graph's
// own). For a query, slot s with cache_len <= s < end (end = the pass's last position + 1) holds the first new token
// at position s that the query's mask row allows, if any; every other slot holds the cache's own slot s, under its
// mask column. In a chain that is new token s - cache_len (the copies of a row's last token that pad a short pass
// share its position, and only those copies' own queries see two); in a token tree it is the query's ancestor at
// that depth, so a node attends over exactly the slots, in the same order, that a chain along its path would.
//
// The arithmetic, for each query (batch row b, head h, token t), in this order (the scalar reference spells it out):
//   for each slot s the mask allows, in order: score_s = dot(q, key_s) * scale, where dot is 16 lanes over D
//     (lane i sums, in order, the products of dimensions i, i + 16, ...; the first a multiply, the rest fmas) added
//     up by a fixed tree (lanes i and i + 8, then i and i + 4, then i and i + 2, then 0 and 1);
//   m = the largest score; e_s = exp(score_s - m) (exp_approx, the same polynomial on every ISA);
//   sum = the fixed tree over 16 lanes, lane i the sum in order of e_s over the allowed slots with s = i mod 16;
//   out_d = (sum in order over the allowed slots of fma(e_s, value_s[d], .)) / sum.
// Nothing there depends on T, S, or the other queries of the pass, so a row has the same bits in a pass of any size
// (a later pass reads the token's key from the cache, where the runtime copies the bits this pass computed), and
// every ISA gives the reference's bits. A query the mask allows nothing gets zeros.
#pragma once

#include <cstdint>
#include <vector>

#include "q4gemm.h"
#include "vec16.h"

namespace specc {

struct AttentionArgs {
  const float *q, *k_new, *v_new;  // [B, Hq, T, D], [B, Hkv, T, D], [B, Hkv, T, D]
  const float *k_cache, *v_cache;  // [B, Hkv, S, D]
  const uint8_t* mask;             // bool [mask_batch, mask_heads, T, S + T]: 1 where attended
  const int64_t* cache_len;        // [B]
  const int64_t* positions;        // [B, T]
  int64_t batch = 0, q_heads = 0, kv_heads = 0, tokens = 0, slots = 0, dim = 0;
  int64_t mask_batch = 1, mask_heads = 1;  // 1 or batch, 1 or q_heads
  float scale = 1.0f;
  float* out = nullptr;  // [B, Hq, T, D]
};

// Scratch one thread reuses from call to call.
struct AttentionScratch {
  std::vector<float> scores;     // [queries][slots rounded up to lanes]: scores, then exp(score - max)
  std::vector<uint16_t> bits;    // [queries][slot blocks]: which lanes of a block the mask allows
  std::vector<float> top;        // [queries]: the largest score
  std::vector<float> lanes_top;  // [queries][lanes]: the largest score of whole blocks' lanes
  std::vector<float> total;      // [queries]: the sum of exp(score - largest)
  std::vector<int32_t> fresh;    // [queries][fresh slots]: the new token standing in each, or -1
};

// An error message for arguments the kernel cannot take (shapes, positions outside the cache), or nullptr.
const char* attention_check(const AttentionArgs& a);

// Queries [i0, i1) of the Hq / Hkv * T queries of (batch row b, kv head): query i is head hkv * G + i / T, token i % T.
using AttentionKernel = void (*)(const AttentionArgs& a, int64_t b, int64_t hkv, int64_t i0, int64_t i1,
                                 AttentionScratch& s);
void attend_scalar(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, AttentionScratch&);
void attend_avx2(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, AttentionScratch&);
void attend_avx512(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, AttentionScratch&);

// The whole pass on `threads` threads of the shared pool, with the ISA's kernel (the AVX-VNNI class runs AVX2's).
void cache_attention(Isa isa, const AttentionArgs& a, int threads);

}  // namespace specc
