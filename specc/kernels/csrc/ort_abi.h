// The part of ONNX Runtime's C ABI this library calls, declared here because the onnxruntime wheel ships no headers.
// OrtApi is a table of function pointers that only ever grows at its end, so a slot keeps its index in every release
// (these are the C API's slots since its version 1); the OrtCustomOp layout is the one ONNX Runtime reads for
// custom operators of version 16. register_ops checks the table at load by round-tripping a status through
// CreateStatus / GetErrorCode / GetErrorMessage / ReleaseStatus before it uses any other slot.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;
struct OrtApi;  // an array of function pointers: see OrtSlot

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

enum OrtSlot : int {
  kCreateStatus = 0,
  kGetErrorCode = 1,
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
};

constexpr uint32_t kOrtApiVersion = 16;
constexpr int kOrtFail = 1, kOrtInvalidArgument = 2;
constexpr int kTensorFloat = 1, kTensorUint8 = 2, kTensorInt64 = 7, kTensorBool = 9;

struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
};

}  // extern "C"
