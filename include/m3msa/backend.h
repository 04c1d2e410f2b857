// One interface over every backend, so tests, the CLI and the runtime can run the same step on
// the CPU reference or the GPU and compare. Tensors must live on backend->device().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "m3msa/ops.h"

namespace m3msa {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  virtual void preprocess(const SparseConfig& config, const PreprocessArgs& args) = 0;
  virtual void select_topk(const SparseConfig& config, const IndexerArgs& args) = 0;
  virtual void sparse_attention(const SparseConfig& config, const AttentionArgs& args) = 0;
  // Waits for queued work (no-op on the CPU).
  virtual void synchronize() {}
};

// The CPU reference backend. threads = 0 uses every hardware thread.
std::unique_ptr<Backend> make_cpu_backend(int threads = 0);

// Whether this build has CUDA and how many devices the driver reports (0 without a GPU or driver).
bool built_with_cuda();
int cuda_device_count();

}  // namespace m3msa
