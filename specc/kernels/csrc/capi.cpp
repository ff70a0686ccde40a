// A plain C interface to the kernels for Python (ctypes): the tests compare every ISA with the scalar reference,
// and the kernel benchmark times them outside ONNX Runtime.
#include "attention.h"
#include "glu.h"
#include "q4gemm.h"

using specc::Isa;

extern "C" {

int specc_kernels_abi() { return 2; }

int specc_isa_count() { return static_cast<int>(Isa::kCount); }

const char* specc_isa_name(int isa) { return specc::isa_name(static_cast<Isa>(isa)); }

int specc_isa_supported(int isa) {
  return isa >= 0 && isa < static_cast<int>(Isa::kCount) && specc::isa_supported(static_cast<Isa>(isa));
}

int specc_best_isa() { return static_cast<int>(specc::best_isa()); }

long long specc_int4_packed_bytes(long long n, long long k, int offsets) {
  specc::Q4Layout l;
  l.n = n;
  l.k = k;
  l.offsets = offsets != 0;
  return l.bytes();
}

// y [m, n] = x [m, k] times the packed weight (glu: y [m, n / 2], the SwiGLU of its halves); 0, or -1 for an ISA
// this CPU lacks or bad sizes.
int specc_int4_gemm(int isa, const float* x, long long m, const unsigned char* w, long long n, long long k, int offsets,
                    float* y, int threads, int glu) {
  if (!specc_isa_supported(isa) || m < 0 || n <= 0 || k <= 0 || threads < 1) return -1;
  if (glu != 0 && n % (2 * specc::kPanel) != 0) return -1;
  specc::Q4Layout l;
  l.n = n;
  l.k = k;
  l.offsets = offsets != 0;
  if (m > 0) specc::gemm(static_cast<Isa>(isa), x, m, w, l, y, threads, glu != 0);
  return 0;
}

// y[0..n) = SwiGLU(gate, up) (glu.h) on one ISA; 0, or -1 for an ISA this CPU lacks.
int specc_swiglu(int isa, const float* gate, const float* up, float* y, long long n) {
  if (!specc_isa_supported(isa) || n < 0) return -1;
  specc::glu_kernel(static_cast<Isa>(isa))(gate, up, y, n, false);
  return 0;
}

// CacheAttention (attention.h) on one ISA: 0, -1 for an ISA this CPU lacks, -2 for arguments the kernel refuses.
int specc_cache_attention(int isa, const float* q, const float* k_new, const float* v_new, const float* k_cache,
                          const float* v_cache, const unsigned char* mask, const long long* cache_len,
                          const long long* positions, long long batch, long long q_heads, long long kv_heads,
                          long long tokens, long long slots, long long dim, long long mask_batch, long long mask_heads,
                          float scale, float* out, int threads) {
  if (!specc_isa_supported(isa) || threads < 1) return -1;
  specc::AttentionArgs a;
  a.q = q;
  a.k_new = k_new;
  a.v_new = v_new;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.mask = mask;
  a.cache_len = reinterpret_cast<const int64_t*>(cache_len);
  a.positions = reinterpret_cast<const int64_t*>(positions);
  a.batch = batch;
  a.q_heads = q_heads;
  a.kv_heads = kv_heads;
  a.tokens = tokens;
  a.slots = slots;
  a.dim = dim;
  a.mask_batch = mask_batch;
  a.mask_heads = mask_heads;
  a.scale = scale;
  a.out = out;
  if (specc::attention_check(a) != nullptr) return -2;
  specc::cache_attention(static_cast<Isa>(isa), a, threads);
  return 0;
}

// MACs done by `iterations` rounds of the ISA's integer dot instructions on one thread (its peak, timed by Python).
long long specc_dot_peak(int isa, long long iterations) {
  return specc_isa_supported(isa) ? specc::dot_peak(static_cast<Isa>(isa), iterations) : -1;
}

}  // extern "C"
