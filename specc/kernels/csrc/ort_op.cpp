// specc's operators (domain ai.specc) for ONNX Runtime, each running the kernel this CPU supports best, or the one
// SPECC_KERNEL_ISA names (scalar, avx2, avxvnni, avx512vnni) where this CPU supports it:
//   Int4Gemm: Y [..., N] = X [..., K] times a packed int4 weight (q4gemm.h). Inputs: X float, W uint8 (the packed
//     bytes); attributes N, K, offsets (0 or 1), layout (kLayoutVersion), glu (optional, 0 or 1: the weight's rows are
//     a gated MLP's gate and up projections and Y [..., N / 2] the SwiGLU of the product's halves, glu.h).
//   CacheAttention: a chain or tree pass's attention over the cache with its new keys at their positions (attention.h).
//     Inputs: Q [B, Hq, T, D], K_new, V_new [B, Hkv, T, D], K_cache, V_cache [B, Hkv, S, D] float, mask bool
//     [1|B, 1|Hq, T, S + T], cache_len int64 [B], position_ids int64 [B, T]; attribute scale; output [B, Hq, T, D].
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attention.h"
#include "ort_abi.h"
#include "q4gemm.h"
#include "threadpool.h"

namespace {

using specc::Isa;

const OrtApi* g_api = nullptr;

template <class Fn>
Fn slot(OrtSlot index) {
  return reinterpret_cast<Fn>(reinterpret_cast<void* const*>(g_api)[index]);
}

OrtStatus* status(int code, const std::string& message) {
  return slot<OrtStatus* (*)(int, const char*)>(kCreateStatus)(code, message.c_str());
}

#define RETURN_IF_ERROR(expr)      \
  do {                             \
    OrtStatus* s_ = (expr);        \
    if (s_ != nullptr) return s_;  \
  } while (0)

Isa chosen_isa() {
  static const Isa isa = [] {
    const char* env = std::getenv("SPECC_KERNEL_ISA");
    if (env != nullptr)
      for (int i = 0; i < static_cast<int>(Isa::kCount); ++i)
        if (std::strcmp(env, specc::isa_name(static_cast<Isa>(i))) == 0 && specc::isa_supported(static_cast<Isa>(i)))
          return static_cast<Isa>(i);
    return specc::best_isa();
  }();
  return isa;
}

struct Kernel {
  specc::Q4Layout layout;
  Isa isa;
  bool glu;
};

OrtStatus* attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  OrtStatus* s = slot<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name, out);
  if (s != nullptr) {
    slot<void (*)(OrtStatus*)>(kReleaseStatus)(s);
    return status(kOrtInvalidArgument, std::string("Int4Gemm needs the integer attribute ") + name);
  }
  return nullptr;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  int64_t n = 0, k = 0, offsets = 0, layout = 0;
  OrtStatus* missing = attribute(info, "layout", &layout);
  if (missing != nullptr) slot<void (*)(OrtStatus*)>(kReleaseStatus)(missing);
  if (layout != specc::kLayoutVersion)
    return status(kOrtInvalidArgument, "Int4Gemm: these weights are packed in layout " + std::to_string(layout) +
                                           " but this specc's kernels take layout " +
                                           std::to_string(specc::kLayoutVersion) + "; compile the bundle again");
  RETURN_IF_ERROR(attribute(info, "N", &n));
  RETURN_IF_ERROR(attribute(info, "K", &k));
  RETURN_IF_ERROR(attribute(info, "offsets", &offsets));
  if (n <= 0 || k <= 0 || (offsets != 0 && offsets != 1))
    return status(kOrtInvalidArgument, "Int4Gemm: N and K must be positive and offsets 0 or 1");
  int64_t glu = 0;
  if (OrtStatus* absent = attribute(info, "glu", &glu)) slot<void (*)(OrtStatus*)>(kReleaseStatus)(absent);
  if ((glu != 0 && glu != 1) || (glu == 1 && n % (2 * specc::kPanel) != 0))
    return status(kOrtInvalidArgument, "Int4Gemm: glu must be 0 or 1, and 1 only where N is two halves of a multiple of 16");
  auto* kernel = new Kernel;
  kernel->layout.n = n;
  kernel->layout.k = k;
  kernel->layout.offsets = offsets != 0;
  kernel->isa = chosen_isa();
  kernel->glu = glu == 1;
  *out = kernel;
  return nullptr;
}

OrtStatus* shape_of(const OrtValue* value, std::vector<int64_t>* dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(value, &info));
  size_t rank = 0;
  OrtStatus* s = slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &rank);
  if (s == nullptr) {
    dims->assign(rank, 0);
    s = slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, dims->data(), rank);
  }
  slot<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  return s;
}

OrtStatus* compute(void* opaque, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<const Kernel*>(opaque);
  const specc::Q4Layout& l = kernel.layout;
  auto get_input = slot<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput);
  auto data = slot<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData);
  const OrtValue *x = nullptr, *w = nullptr;
  RETURN_IF_ERROR(get_input(context, 0, &x));
  RETURN_IF_ERROR(get_input(context, 1, &w));
  std::vector<int64_t> xs, ws;
  RETURN_IF_ERROR(shape_of(x, &xs));
  RETURN_IF_ERROR(shape_of(w, &ws));
  if (xs.empty() || xs.back() != l.k)
    return status(kOrtInvalidArgument, "Int4Gemm: X's last dimension must be K = " + std::to_string(l.k));
  if (ws.size() != 1 || ws[0] != l.bytes())
    return status(kOrtInvalidArgument, "Int4Gemm: W must hold " + std::to_string(l.bytes()) + " packed bytes");
  int64_t m = 1;
  for (size_t i = 0; i + 1 < xs.size(); ++i) m *= xs[i];
  std::vector<int64_t> ys(xs);
  ys.back() = kernel.glu ? l.n / 2 : l.n;
  OrtValue* y = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContextGetOutput)(
      context, 0, ys.data(), ys.size(), &y));
  if (m == 0) return nullptr;
  void *xp = nullptr, *wp = nullptr, *yp = nullptr;
  RETURN_IF_ERROR(data(const_cast<OrtValue*>(x), &xp));
  RETURN_IF_ERROR(data(const_cast<OrtValue*>(w), &wp));
  RETURN_IF_ERROR(data(y, &yp));
  specc::gemm(kernel.isa, static_cast<const float*>(xp), m, static_cast<const uint8_t*>(wp), l, static_cast<float*>(yp),
              specc::shared_pool().size(), kernel.glu);
  return nullptr;
}

void* create_kernel_v1(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  void* kernel = nullptr;
  OrtStatus* s = create_kernel(op, api, info, &kernel);
  if (s != nullptr) slot<void (*)(OrtStatus*)>(kReleaseStatus)(s);
  return kernel;
}

void compute_v1(void* kernel, OrtKernelContext* context) {
  OrtStatus* s = compute(kernel, context);
  if (s != nullptr) slot<void (*)(OrtStatus*)>(kReleaseStatus)(s);
}

// The fields every operator of this library fills alike.
OrtCustomOp base_op() {
  OrtCustomOp op{};
  op.version = kOrtApiVersion;
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return kTensorFloat; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };   // required
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };  // required
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };       // the provider's default
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  return op;
}

OrtCustomOp make_int4gemm() {
  OrtCustomOp op = base_op();
  op.CreateKernel = create_kernel_v1;
  op.GetName = [](const OrtCustomOp*) { return "Int4Gemm"; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return i == 0 ? kTensorFloat : kTensorUint8; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 2; };
  op.KernelCompute = compute_v1;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

struct AttentionKernelState {
  float scale;
  Isa isa;
};

OrtStatus* create_attention(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  float scale = 0.0f;
  OrtStatus* s = slot<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttributeFloat)(
      info, "scale", &scale);
  if (s != nullptr) {
    slot<void (*)(OrtStatus*)>(kReleaseStatus)(s);
    return status(kOrtInvalidArgument, "CacheAttention needs the float attribute scale");
  }
  *out = new AttentionKernelState{scale, chosen_isa()};
  return nullptr;
}

OrtStatus* compute_attention(void* opaque, OrtKernelContext* context) {
  const AttentionKernelState& kernel = *static_cast<const AttentionKernelState*>(opaque);
  auto get_input = slot<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput);
  auto data = slot<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData);
  const OrtValue* in[8];
  std::vector<int64_t> shape[8];
  void* ptr[8];
  for (size_t i = 0; i < 8; ++i) {
    RETURN_IF_ERROR(get_input(context, i, &in[i]));
    RETURN_IF_ERROR(shape_of(in[i], &shape[i]));
    RETURN_IF_ERROR(data(const_cast<OrtValue*>(in[i]), &ptr[i]));
  }
  const std::vector<int64_t>&q = shape[0], &kn = shape[1], &kc = shape[3], &mask = shape[5];
  bool ok = q.size() == 4 && kn.size() == 4 && kc.size() == 4 && mask.size() == 4 && shape[2] == kn &&
            shape[4] == kc && kn[0] == q[0] && kn[2] == q[2] && kn[3] == q[3] && kc[0] == q[0] && kc[1] == kn[1] &&
            kc[3] == q[3] && shape[6] == std::vector<int64_t>{q[0]} &&
            shape[7] == std::vector<int64_t>{q[0], q[2]} && mask[2] == q[2] && mask[3] == kc[2] + q[2];
  if (!ok)
    return status(kOrtInvalidArgument,
                  "CacheAttention: inputs must be Q [B, Hq, T, D], K_new and V_new [B, Hkv, T, D], K_cache and V_cache "
                  "[B, Hkv, S, D], mask [1|B, 1|Hq, T, S + T], cache_len [B], position_ids [B, T]");
  specc::AttentionArgs a;
  a.q = static_cast<const float*>(ptr[0]);
  a.k_new = static_cast<const float*>(ptr[1]);
  a.v_new = static_cast<const float*>(ptr[2]);
  a.k_cache = static_cast<const float*>(ptr[3]);
  a.v_cache = static_cast<const float*>(ptr[4]);
  a.mask = static_cast<const uint8_t*>(ptr[5]);
  a.cache_len = static_cast<const int64_t*>(ptr[6]);
  a.positions = static_cast<const int64_t*>(ptr[7]);
  a.batch = q[0];
  a.q_heads = q[1];
  a.kv_heads = kn[1];
  a.tokens = q[2];
  a.slots = kc[2];
  a.dim = q[3];
  a.mask_batch = mask[0];
  a.mask_heads = mask[1];
  a.scale = kernel.scale;
  if (const char* error = specc::attention_check(a)) return status(kOrtInvalidArgument, error);
  OrtValue* y = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContextGetOutput)(
      context, 0, q.data(), q.size(), &y));
  void* yp = nullptr;
  RETURN_IF_ERROR(data(y, &yp));
  a.out = static_cast<float*>(yp);
  specc::cache_attention(kernel.isa, a, specc::shared_pool().size());
  return nullptr;
}

OrtCustomOp make_cache_attention() {
  OrtCustomOp op = base_op();
  op.GetName = [](const OrtCustomOp*) { return "CacheAttention"; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return i < 5 ? kTensorFloat : i == 5 ? kTensorBool : kTensorInt64; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 8; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<AttentionKernelState*>(kernel); };
  op.CreateKernelV2 = create_attention;
  op.KernelComputeV2 = compute_attention;
  return op;
}

bool abi_matches() {
  OrtStatus* s = slot<OrtStatus* (*)(int, const char*)>(kCreateStatus)(kOrtInvalidArgument, "specc-abi-check");
  if (s == nullptr) return false;
  const bool ok = slot<int (*)(const OrtStatus*)>(kGetErrorCode)(s) == kOrtInvalidArgument &&
                  std::strcmp(slot<const char* (*)(const OrtStatus*)>(kGetErrorMessage)(s), "specc-abi-check") == 0;
  slot<void (*)(OrtStatus*)>(kReleaseStatus)(s);
  return ok;
}

}  // namespace

extern "C" OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  static OrtCustomOp int4gemm = make_int4gemm(), attention = make_cache_attention();
  static OrtCustomOpDomain* domain = nullptr;
  g_api = base->GetApi(kOrtApiVersion);
  if (g_api == nullptr) return nullptr;  // older than the API version this library needs: nothing registered
  if (!abi_matches()) return status(kOrtFail, "specc kernels: ONNX Runtime's C API table is not the one this library expects");
  if (domain == nullptr) {
    RETURN_IF_ERROR(slot<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ai.specc", &domain));
    for (const OrtCustomOp* op : {&int4gemm, &attention})
      RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomainAdd)(domain, op));
  }
  return slot<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}
