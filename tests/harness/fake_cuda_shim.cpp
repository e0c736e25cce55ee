// A CPU build of torch that believes in one CUDA device without memory: for fake tensors only.
//
// torch's FakeTensorMode makes tensors on a `cuda` device on a CPU build, but the autograd
// engine asks the device's runtime for a device guard (current device, streams, events) and asks
// which accelerator is built before it moves a gradient between streams. A CPU build has neither
// for CUDA, so it aborts or raises. This library registers both:
//   * a device guard for CUDA with one device, one stream (the default one) and events that are
//     already complete: the engine's stream bookkeeping becomes a no-op, as on a single stream;
//   * CUDA hooks that say "built, available, one device, no primary context": the accelerator
//     query answers CUDA. They must be registered before torch first asks, so the library is
//     loaded before `import torch` (tests/harness/fake_cuda_step.py) and never in pytest itself.
// No memory can be allocated on this device: only fake tensors (meta kernels) ever live there.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace at {
// The registry key is the class name torch's CUDA build uses, so torch finds this one instead.
struct CUDAHooks : public CUDAHooksInterface {
  explicit CUDAHooks(CUDAHooksArgs /*unused*/) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*unused*/) const override { return false; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  void init() const override {}
};
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct OneStreamCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  static Device device() { return Device(DeviceType::CUDA, 0); }
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device /*unused*/) const override { return device(); }
  Device getDevice() const override { return device(); }
  void setDevice(Device /*unused*/) const override {}
  void uncheckedSetDevice(Device /*unused*/) const noexcept override {}
  Stream getStream(Device /*unused*/) const noexcept override { return Stream(Stream::DEFAULT, device()); }
  Stream getDefaultStream(Device d) const override { return getStream(d); }
  Stream getStreamFromGlobalPool(Device d, bool /*unused*/) const override { return getStream(d); }
  Stream getNewStream(Device d, int /*unused*/) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const noexcept override { return s; }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  // Events: nothing runs asynchronously, so every event is complete when recorded.
  void record(void** event, const Stream& /*unused*/, const DeviceIndex /*unused*/,
              const c10::EventFlag /*unused*/) const override {
    *event = nullptr;
  }
  void block(void* /*unused*/, const Stream& /*unused*/) const override {}
  bool queryEvent(void* /*unused*/) const override { return true; }
  void destroyEvent(void* /*unused*/, const DeviceIndex /*unused*/) const noexcept override {}
  bool queryStream(const Stream& /*unused*/) const override { return true; }
  void synchronizeStream(const Stream& /*unused*/) const override {}
  void synchronizeEvent(void* /*unused*/) const override {}
  void synchronizeDevice(const DeviceIndex /*unused*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*unused*/, const Stream& /*unused*/) const override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, OneStreamCudaGuard);
}  // namespace
