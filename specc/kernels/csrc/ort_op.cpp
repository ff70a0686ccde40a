// Int4Gemm (domain ai.specc) for ONNX Runtime: Y [..., N] = X [..., K] times a packed int4 weight (q4gemm.h).
// Inputs: X float, W uint8 (the packed bytes); attributes N, K, offsets (0 or 1), layout (kLayoutVersion). The kernel is the best this CPU
// supports, or the one SPECC_KERNEL_ISA names (scalar, avx2, avxvnni, avx512vnni) where this CPU supports it.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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
  auto* kernel = new Kernel;
  kernel->layout.n = n;
  kernel->layout.k = k;
  kernel->layout.offsets = offsets != 0;
  kernel->isa = chosen_isa();
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
  ys.back() = l.n;
  OrtValue* y = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContextGetOutput)(
      context, 0, ys.data(), ys.size(), &y));
  if (m == 0) return nullptr;
  void *xp = nullptr, *wp = nullptr, *yp = nullptr;
  RETURN_IF_ERROR(data(const_cast<OrtValue*>(x), &xp));
  RETURN_IF_ERROR(data(const_cast<OrtValue*>(w), &wp));
  RETURN_IF_ERROR(data(y, &yp));
  specc::gemm(kernel.isa, static_cast<const float*>(xp), m, static_cast<const uint8_t*>(wp), l, static_cast<float*>(yp),
              specc::shared_pool().size());
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

OrtCustomOp make_op() {
  OrtCustomOp op{};
  op.version = kOrtApiVersion;
  op.CreateKernel = create_kernel_v1;
  op.GetName = [](const OrtCustomOp*) { return "Int4Gemm"; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return i == 0 ? kTensorFloat : kTensorUint8; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 2; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return kTensorFloat; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.KernelCompute = compute_v1;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };   // required
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };  // required
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };       // the provider's default
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
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
  static OrtCustomOp op = make_op();
  static OrtCustomOpDomain* domain = nullptr;
  g_api = base->GetApi(kOrtApiVersion);
  if (g_api == nullptr) return nullptr;  // older than the API version this library needs: nothing registered
  if (!abi_matches()) return status(kOrtFail, "specc kernels: ONNX Runtime's C API table is not the one this library expects");
  if (domain == nullptr) {
    RETURN_IF_ERROR(slot<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ai.specc", &domain));
    RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomainAdd)(domain, &op));
  }
  return slot<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}
