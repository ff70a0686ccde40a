// SwiGLU's kernel choice (glu.h).
#include "glu.h"

namespace specc {

GluKernel glu_kernel(Isa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case Isa::kAvx2:
    case Isa::kAvxVnni: return swiglu_avx2;
    case Isa::kAvx512Vnni: return swiglu_avx512;
    default: return swiglu_scalar;
  }
#else
  (void)isa;
  return swiglu_scalar;
#endif
}

}  // namespace specc
