// The CPU reference behind the Backend interface, so tests, the CLI and the runtime can run one
// step on either backend and compare.
#include <memory>
#include <string>

#include "cpu/thread_pool.h"
#include "m3msa/backend.h"
#include "m3msa/cpu_reference.h"

namespace m3msa {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(cpu::detail::resolve_threads(threads)) {}

  std::string name() const override { return "cpu-reference"; }
  Device device() const override { return Device::cpu(); }

  void preprocess(const SparseConfig& config, const PreprocessArgs& args) override {
    cpu::preprocess(config, args, threads_);
  }
  void select_topk(const SparseConfig& config, const IndexerArgs& args) override {
    cpu::select_topk(config, args, threads_);
  }
  void sparse_attention(const SparseConfig& config, const AttentionArgs& args) override {
    cpu::sparse_attention(config, args, threads_);
  }

 private:
  int threads_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace m3msa
