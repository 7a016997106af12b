// A stand-in for the two CUDA runtime calls the preload library needs on its routed path
// (cudaGetDevice, cudaStreamIsCapturing), for preload_test on a machine without CUDA.
// The test loads it RTLD_GLOBAL and steers it with the fake_set_* functions.
extern "C" {

static int fake_device = 0;
static int fake_capture_status = 0;  // cudaStreamCaptureStatusNone

__attribute__((visibility("default"))) void fake_set_device(int device) { fake_device = device; }
__attribute__((visibility("default"))) void fake_set_capture_status(int status) { fake_capture_status = status; }

__attribute__((visibility("default"))) int cudaGetDevice(int* device) {
  if (device == nullptr) return 1;  // cudaErrorInvalidValue
  *device = fake_device;
  return 0;
}

__attribute__((visibility("default"))) int cudaStreamIsCapturing(void* stream, int* status) {
  (void)stream;
  if (status == nullptr) return 1;
  *status = fake_capture_status;
  return 0;
}

}  // extern "C"
