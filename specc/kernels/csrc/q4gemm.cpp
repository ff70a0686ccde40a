// Kernel choice at run time and the threaded GEMM over whichever kernel was chosen.
#include "q4gemm.h"

#include <algorithm>
#include <cstdint>
#include <vector>

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

struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
};

}  // namespace

void gemm(Isa isa, const float* x, int64_t m, const uint8_t* w, const Q4Layout& l, float* y, int threads) {
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
  const PanelKernel kernel = kernel_for(isa);
  const int64_t panels = l.panels();
  const int tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, panels)));
  const bool stream = m * l.n * static_cast<int64_t>(sizeof(float)) >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(y) % 64 == 0 && l.n % kPanel == 0;
  shared_pool().run(tasks, [&](int i) {
    kernel(a, m, w, l, panels * i / tasks, panels * (i + 1) / tasks, y, l.n, stream);
  });
}

}  // namespace specc
