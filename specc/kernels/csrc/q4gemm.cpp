// Kernel choice at run time and the threaded GEMM over whichever kernel was chosen.
#include "q4gemm.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "glu.h"
#include "threadpool.h"

namespace specc {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvxVnni: return "avxvnni";
    case Isa::kAvx512Vnni: return "avx512vnni";
    default: return "unknown";
  }
}

bool isa_supported(Isa isa) {
#if !defined(__x86_64__)
  return isa == Isa::kScalar;
#else
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case Isa::kAvx512Vnni:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
#endif
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvxVnni, Isa::kAvx2})
    if (isa_supported(isa)) return isa;
  return Isa::kScalar;
}

namespace {

PanelKernel kernel_for(Isa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case Isa::kAvx2: return gemm_panels_avx2;
    case Isa::kAvxVnni: return gemm_panels_avxvnni;
    case Isa::kAvx512Vnni: return gemm_panels_avx512vnni;
    default: return gemm_panels_scalar;
  }
#else
  (void)isa;
  return gemm_panels_scalar;
#endif
}

using Quantizer = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, int8_t*, float*, float*);

// The scalar reference quantises for the scalar kernel; every SIMD kernel takes the AVX2 quantiser (the same bits).
Quantizer quantizer_for(Isa isa) {
#if defined(__x86_64__)
  if (isa != Isa::kScalar) return quantize_rows_avx2;
#else
  (void)isa;
#endif
  return quantize_rows;
}

// Outputs of at least this many bytes are written around the caches: a prefill chunk's output (a wide layer's, 256
// rows by some 10,000 columns) is larger than a core's cache, and written through it each line is first read in and
// then evicts the activations and weights the kernel still reads.
constexpr int64_t kStreamBytes = int64_t{2} << 20;

constexpr int64_t kGluTile = 4;  // gate panels (and as many up panels) a large gated pass multiplies at a time

struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<float> whole;  // a small gated pass's product
};

inline void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Panels of a product claimed a few at a time by whichever thread is free, after each thread's even share of the
// rest: threads that run at different speeds (the memory, the hypervisor) end within one claim of each other.
constexpr int64_t kClaimedShare = 8;       // one panel in this many is claimed
constexpr int64_t kClaimBytes = 64 << 10;  // a claim's weights, within a group of panels

// The product of every row with the whole weight, on the pool, into z (row stride ldz); streamed where z is large
// and on a line boundary. A thread claims its next panels before it multiplies the ones in hand, whose kernel
// prefetches them meanwhile.
void multiply(PanelKernel kernel, const QuantizedRows& a, int64_t m, const uint8_t* w, const Q4Layout& l, int threads,
              float* z, int64_t ldz) {
  const int64_t panels = l.panels();
  const int tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, panels)));
  const bool stream = m * ldz * static_cast<int64_t>(sizeof(float)) >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(z) % 64 == 0 && ldz % kPanel == 0;
  // (two panels at least where the kernels multiply two at a time: more than one row)
  const int64_t unit = std::clamp<int64_t>(kClaimBytes / l.panel_bytes(), m > 1 ? 2 : 1, kGroup);
  const int64_t shared = tasks > 1 ? panels / kClaimedShare / unit * unit : 0, even = panels - shared;
  std::atomic<int64_t> next{even};
  auto claim = [&]() -> int64_t {  // the first panel of a unit nobody has taken, or -1
    const int64_t p = next.fetch_add(unit, std::memory_order_relaxed);
    return p < panels ? p : -1;
  };
  auto bytes_of = [&](int64_t p) { return p < 0 ? Window{} : panel_span(w, l, p, std::min(p + unit, panels)); };
  shared_pool().run(tasks, [&](int i) {
    int64_t p = shared > 0 ? claim() : -1;
    kernel(a, m, w, l, even * i / tasks, even * (i + 1) / tasks, z, ldz, stream, bytes_of(p));
    while (p >= 0) {
      const int64_t at = p;
      p = claim();
      kernel(a, m, w, l, at, std::min(at + unit, panels), z, ldz, stream, bytes_of(p));
    }
  });
}

// SwiGLU of the product (q4gemm.h's gemm with glu). A small pass multiplies as a plain one does (the weights streamed
// group by group) into a scratch that stays in cache, then gates it; a larger one takes kGluTile gate panels and
// their up panels at a time, through a scratch per thread, so its product never leaves the cache.
void gated(Isa isa, const QuantizedRows& a, int64_t m, const uint8_t* w, const Q4Layout& l, float* y, int threads,
           std::vector<float>& whole) {
  const PanelKernel kernel = kernel_for(isa);
  const GluKernel gate = glu_kernel(isa);
  const int64_t half = l.n / 2, pairs = half / kPanel;
  const int tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, pairs)));
  if (m * l.n * static_cast<int64_t>(sizeof(float)) < kStreamBytes) {
    whole.resize(m * l.n);
    float* z = whole.data();
    multiply(kernel, a, m, w, l, threads, z, l.n);
    shared_pool().run(tasks, [&](int i) {
      const int64_t c0 = half * i / tasks, c1 = half * (i + 1) / tasks;
      for (int64_t r = 0; r < m; ++r) gate(z + r * l.n + c0, z + r * l.n + half + c0, y + r * half + c0, c1 - c0, false);
    });
    return;
  }
  const bool stream = reinterpret_cast<uintptr_t>(y) % 64 == 0;
  shared_pool().run(tasks, [&](int i) {
    thread_local std::vector<float> tile;
    const int64_t p1 = pairs * (i + 1) / tasks, ldt = 2 * kGluTile * kPanel;
    tile.resize(m * ldt);
    for (int64_t p = pairs * i / tasks; p < p1; p += kGluTile) {
      Q4Layout part = l;  // the tile's gate (or up) panels as a layer of their own
      part.n = std::min(kGluTile, p1 - p) * kPanel;
      kernel(a, m, w + p * l.panel_bytes(), part, 0, part.panels(), tile.data(), ldt, false, Window{});
      kernel(a, m, w + (pairs + p) * l.panel_bytes(), part, 0, part.panels(), tile.data() + part.n, ldt, false, Window{});
      for (int64_t r = 0; r < m; ++r)
        gate(tile.data() + r * ldt, tile.data() + r * ldt + part.n, y + r * half + p * kPanel, part.n, stream);
    }
    if (stream) store_fence();
  });
}

}  // namespace

void gemm(Isa isa, const float* x, int64_t m, const uint8_t* w, const Q4Layout& l, float* y, int threads, bool glu) {
  thread_local Scratch s;
  const int64_t nb = l.blocks(), supers = l.supers();
  s.q.resize(m * nb * kBlock);
  s.d.resize(m * supers);
  s.dsum.resize(m * nb);
  // pointers taken here: inside the tasks `s` would name each worker thread's own scratch
  int8_t* q = s.q.data();
  float *d = s.d.data(), *dsum = s.dsum.data();
  const Quantizer quantize = quantizer_for(isa);
  const int row_tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, m / 4)));
  shared_pool().run(row_tasks, [&](int i) {
    quantize(x, m * i / row_tasks, m * (i + 1) / row_tasks, l.k, nb, q, d, dsum);
  });
  const QuantizedRows a{q, d, dsum, nb, supers};
  if (glu) gated(isa, a, m, w, l, y, threads, s.whole);
  else multiply(kernel_for(isa), a, m, w, l, threads, y, l.n);
}

}  // namespace specc
