// Process environment of the GPU suites, set before main() (so before any CUDA context exists).
//
// Several tests run TP / CP ranks as threads on ONE GPU (what a one-GPU machine can check of the
// peer protocols): a rank's kernel spins until its peer's kernel on another stream stores into
// it. The driver maps streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (default 8);
// two ranks' streams sharing a queue would serialize the peer's kernel behind the spinning one
// until the spin budget expires. 32 queues (the maximum) keep the few live streams of a test on
// queues of their own. And modules load eagerly: lazy loading (CUDA's default) loads a kernel's
// module at its first launch, which waits for the device to be idle, so a rank's first launch of
// a kernel would wait for its peer's spinning kernel, which waits for this rank. An explicit
// setting in the environment wins.
#include <cstdlib>

namespace {

const bool kConnectionsSet = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  return true;
}();

}  // namespace
