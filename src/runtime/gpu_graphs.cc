// StepGraphs (runtime.h): CUDA graphs of whole decode steps over fixed device buffers. Built on
// the public Runtime API (begin_step with padding, forward_layer, the runtime's stream) plus the
// runtime's graph bookkeeping. Stubs without CUDA.
#include <algorithm>
#include <map>
#include <utility>

#include "m3msa/error.h"
#include "m3msa/runtime.h"

#if defined(M3MSA_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#endif

namespace m3msa {

#if defined(M3MSA_WITH_CUDA)

struct StepGraphs::Impl {
  Runtime* runtime = nullptr;
  int device = 0;
  int max_rows = 0;
  int64_t hidden_size = 0;
  std::vector<int> layers;
  cuda::DeviceBuffer hidden, residual, positions;
  std::map<std::pair<int, int>, cuda::Graph> graphs;  // (padded requests, q_len) -> graph
  const cuda::Graph* last = nullptr;                  // the graph of the last run()

  cudaStream_t stream() const { return static_cast<cudaStream_t>(runtime->cuda_stream()); }

  TensorView view(const cuda::DeviceBuffer& buffer, DType dtype, int64_t rows, bool wide) const {
    const Device dev = Device::cuda(device);
    if (wide) return TensorView::contiguous(buffer.data(), dtype, {rows, hidden_size}, dev);
    return TensorView::contiguous(buffer.data(), dtype, {rows}, dev);
  }

  void run_layers(int64_t rows) {
    for (int layer : layers) {
      runtime->forward_layer(layer, view(hidden, DType::kBF16, rows, true),
                             view(residual, DType::kBF16, rows, true),
                             view(positions, DType::kI64, rows, false));
    }
  }

  // begin_step padded to the graph shape, and the padding rows' positions set to -1.
  bool stage(StepGraphs& self, const BatchMeta& batch, int& padded) {
    padded = self.padded_requests(batch.num_reqs, batch.q_len);
    if (!runtime->begin_step(batch, padded)) return false;
    const int64_t rows = batch.num_rows();
    const int64_t padded_rows = int64_t{padded} * batch.q_len;
    if (padded_rows > rows) {
      CUDA_CHECK(cudaMemsetAsync(positions.as<int64_t>() + rows, 0xFF,
                                 sizeof(int64_t) * static_cast<std::size_t>(padded_rows - rows),
                                 stream()));
    }
    return true;
  }
};

StepGraphs::StepGraphs(Runtime& runtime) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  M3MSA_CHECK_ARG(runtime.state() == RuntimeState::kActive,
                  "StepGraphs: the runtime must be active (prepare returned kActive), it is ",
                  runtime_state_name(runtime.state()));
  M3MSA_CHECK_SUPPORTED(runtime.device().type == DeviceType::kCUDA,
                        "StepGraphs: the runtime runs on ", device_name(runtime.device()),
                        "; CUDA graphs need the CUDA backend");
  s.runtime = &runtime;
  s.device = runtime.device().index;
  const RuntimeConfig& c = runtime.config();
  s.max_rows = c.token_buckets.back();
  s.hidden_size = c.model.hidden;
  s.layers = runtime.stats().bound_layers;
  cuda::DeviceGuard guard(s.device);
  const auto rows = static_cast<std::size_t>(s.max_rows);
  const auto hidden = static_cast<std::size_t>(s.hidden_size);
  s.hidden = cuda::DeviceBuffer(2 * rows * hidden);
  s.residual = cuda::DeviceBuffer(2 * rows * hidden);
  s.positions = cuda::DeviceBuffer(sizeof(int64_t) * rows);
  CUDA_CHECK(cudaMemsetAsync(s.hidden.data(), 0, s.hidden.bytes(), s.stream()));
  CUDA_CHECK(cudaMemsetAsync(s.residual.data(), 0, s.residual.bytes(), s.stream()));
  CUDA_CHECK(cudaMemsetAsync(s.positions.data(), 0xFF, s.positions.bytes(), s.stream()));
  CUDA_CHECK(cudaStreamSynchronize(s.stream()));
}

StepGraphs::~StepGraphs() {
  Impl& s = *impl_;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(s.device);
  // The runtime may be closed already (its close synchronized everything then).
  if (s.runtime->state() == RuntimeState::kActive && s.stream() != nullptr) {
    cudaStreamSynchronize(s.stream());
  }
  s.graphs.clear();
  s.hidden.reset();
  s.residual.reset();
  s.positions.reset();
  cudaSetDevice(previous);
}

TensorView StepGraphs::hidden() const {
  return impl_->view(impl_->hidden, DType::kBF16, impl_->max_rows, true);
}

TensorView StepGraphs::residual() const {
  return impl_->view(impl_->residual, DType::kBF16, impl_->max_rows, true);
}

TensorView StepGraphs::positions() const {
  return impl_->view(impl_->positions, DType::kI64, impl_->max_rows, false);
}

int StepGraphs::padded_requests(int num_reqs, int q_len) const {
  const RuntimeConfig& c = impl_->runtime->config();
  if (q_len <= 0) return num_reqs;
  const int64_t rows = int64_t{num_reqs} * q_len;
  const auto bucket = std::lower_bound(c.token_buckets.begin(), c.token_buckets.end(), rows);
  if (bucket == c.token_buckets.end() || *bucket % q_len != 0) return num_reqs;
  const int padded = *bucket / q_len;
  return padded > c.max_requests ? num_reqs : std::max(padded, num_reqs);
}

bool StepGraphs::run(const BatchMeta& batch) {
  Impl& s = *impl_;
  cuda::DeviceGuard guard(s.device);
  int padded = 0;
  if (!s.stage(*this, batch, padded)) return false;
  const std::pair<int, int> key{padded, batch.q_len};
  auto it = s.graphs.find(key);
  if (it == s.graphs.end()) {
    s.runtime->refresh_device_plans();
    const int64_t rows = int64_t{padded} * batch.q_len;
    cuda::Graph graph = cuda::Graph::capture(s.stream(), [&] { s.run_layers(rows); });
    s.runtime->note_graph_captured();
    it = s.graphs.emplace(key, std::move(graph)).first;
  }
  it->second.launch(s.stream());
  s.last = &it->second;
  s.runtime->note_graph_replayed(static_cast<int>(s.layers.size()));
  return true;
}

void StepGraphs::replay_last() {
  Impl& s = *impl_;
  M3MSA_CHECK_ARG(s.last != nullptr, "StepGraphs::replay_last: no graph ran yet (call run())");
  M3MSA_CHECK_ARG(s.runtime->state() == RuntimeState::kActive,
                  "StepGraphs::replay_last: the runtime is ",
                  runtime_state_name(s.runtime->state()));
  cuda::DeviceGuard guard(s.device);
  s.last->launch(s.stream());
  s.runtime->note_graph_replayed(static_cast<int>(s.layers.size()));
}

bool StepGraphs::run_eager(const BatchMeta& batch) {
  Impl& s = *impl_;
  cuda::DeviceGuard guard(s.device);
  int padded = 0;
  if (!s.stage(*this, batch, padded)) return false;
  s.run_layers(int64_t{padded} * batch.q_len);
  return true;
}

int64_t StepGraphs::graphs() const {
  return static_cast<int64_t>(impl_->graphs.size());
}

void StepGraphs::reset() {
  Impl& s = *impl_;
  cuda::DeviceGuard guard(s.device);
  if (s.runtime->state() == RuntimeState::kActive && s.stream() != nullptr) {
    CUDA_CHECK(cudaStreamSynchronize(s.stream()));
  }
  s.graphs.clear();
  s.last = nullptr;
}

#else  // no CUDA

struct StepGraphs::Impl {};

StepGraphs::StepGraphs(Runtime& runtime) {
  M3MSA_THROW(ErrorCode::kUnsupported, "StepGraphs: this build has no CUDA backend (runtime on ",
              device_name(runtime.device()), ")");
}
StepGraphs::~StepGraphs() = default;
TensorView StepGraphs::hidden() const {
  return {};
}
TensorView StepGraphs::residual() const {
  return {};
}
TensorView StepGraphs::positions() const {
  return {};
}
bool StepGraphs::run(const BatchMeta&) {
  return false;
}
bool StepGraphs::run_eager(const BatchMeta&) {
  return false;
}
void StepGraphs::replay_last() {}
int StepGraphs::padded_requests(int num_reqs, int) const {
  return num_reqs;
}
int64_t StepGraphs::graphs() const {
  return 0;
}
void StepGraphs::reset() {}

#endif

}  // namespace m3msa
