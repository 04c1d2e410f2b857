// m3msa demo on the CUDA runtime: ranks as threads, rank r on GPU r, an in-process
// NcclCommunicator between them (TP > 1) or a single-rank communicator (TP = 1). Each rank
// generates its slices of the weights and caches on the host (the test kit's demo model), copies
// them to its GPU, prepares the runtime on them and runs the steps eagerly (begin_step with host
// metadata, forward_layer per layer on the runtime's stream; the host waits for the stream once per
// step, or after every layer when recording). Compiled in every build; without CUDA run_cuda throws
// kUnsupported.
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"
#include "demo_runtime.h"
#include "m3msa/backend.h"
#include "m3msa/error.h"

#if defined(M3MSA_CLI_WITH_CUDA)
#include <cuda_runtime.h>

#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/cuda_backend.h"
#endif

namespace m3msa::cli::demo_rt {

int cuda_devices() {
  return cuda_device_count();
}

#if !defined(M3MSA_CLI_WITH_CUDA)

RunResult run_cuda(const Spec&, int, int, bool, const std::function<void(const std::string&)>&) {
  M3MSA_THROW(ErrorCode::kUnsupported,
              "demo --backend cuda: this build has no CUDA (configure with nvcc, "
              "M3MSA_ENABLE_CUDA=ON)");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

void cuda_check(cudaError_t status, const char* what) {
  M3MSA_CHECK(status == cudaSuccess, ErrorCode::kInternal, "demo (cuda): ", what, ": ",
              cudaGetErrorString(status));
}

template <typename T>
void download(const TensorView& view, std::vector<T>& out) {
  out.resize(static_cast<std::size_t>(view.numel()));
  if (out.empty()) return;
  cuda_check(cudaSetDevice(view.device.index), "cudaSetDevice");
  cuda_check(cudaMemcpy(out.data(), view.data, view.nbytes(), cudaMemcpyDeviceToHost),
             "cudaMemcpy to the host");
}

void upload(const TensorView& view, const void* host) {
  if (view.nbytes() == 0) return;
  cuda_check(cudaSetDevice(view.device.index), "cudaSetDevice");
  cuda_check(cudaMemcpy(view.data, host, view.nbytes(), cudaMemcpyHostToDevice),
             "cudaMemcpy to the device");
  // The runtime's stream does not synchronize with the legacy stream: land the copy first.
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// One rank's model on its GPU: every tensor of the host model copied.
struct DeviceModel {
  std::vector<DeviceTensor> storage;
  ModelWeights weights;
};

DeviceModel upload_model(const HostModel& host, int device) {
  DeviceModel d;
  auto up = [&](const TensorView& v) -> TensorView {
    if (!v.defined()) return {};
    d.storage.emplace_back(v.dtype, v.sizes(), device);
    upload(d.storage.back().view(), v.data);
    return d.storage.back().view();
  };
  for (const LayerWeights& h : host.weights.layers) {
    d.weights.layers.push_back(map_tensors(h, up));
  }
  return d;
}

}  // namespace

RunResult run_cuda(const Spec& spec, int tp, int threads, bool record,
                   const std::function<void(const std::string&)>& progress) {
  RunResult out = start_run(spec, "cuda", tp, record);
  const ModelConfig& m = spec.model;
  const int layers = spec.run_layers();
  const int64_t rows = spec.rows();
  const int64_t H = m.hidden;
  const int rank_threads = std::max(1, threads / tp);
  const std::vector<Step> steps = make_steps(spec);
  std::vector<std::unique_ptr<NcclCommunicator> > nccl;
  std::unique_ptr<Communicator> single;
  if (tp > 1) {
    std::vector<int> devices;
    for (int r = 0; r < tp; ++r) devices.push_back(r);
    nccl = make_nccl_communicators_in_process(devices, std::chrono::seconds(120));
  } else {
    single = make_single_rank_communicator();
  }
  const RuntimeConfig config = spec.runtime_config(rank_threads);
  RankOutputs kept(tp);
  run_threads(tp, [&](int r) {
    cuda_check(cudaSetDevice(r), "cudaSetDevice");
    Communicator& comm = tp > 1 ? *nccl[static_cast<std::size_t>(r)] : *single;
    const auto t_setup = Clock::now();
    if (r == 0) progress("building the weights and caches");
    DeviceModel dev;
    {
      const HostModel host = make_host_model(spec, r, tp, rank_threads);
      if (r == 0) progress("copying the weights and caches to the GPUs");
      dev = upload_model(host, r);
    }
    Runtime rt([](const std::string&) {});  // fallbacks are reported through stats()
    const PrepareResult prepared = rt.prepare(dev.weights, config, comm);
    if (r == 0) {
      out.prepared = prepared;
      out.setup_s = seconds_since(t_setup);
    }
    if (prepared != PrepareResult::kActive) {
      if (r == 0) out.stats = rt.stats();
      rt.close();
      return;
    }
    auto stream = static_cast<cudaStream_t>(rt.cuda_stream());
    DeviceTensor d_hidden(DType::kBF16, {rows, H}, r), d_residual(DType::kBF16, {rows, H}, r);
    DeviceTensor d_positions(DType::kI64, {rows}, r);
    const std::vector<uint16_t> zeros(static_cast<std::size_t>(rows * H), 0);
    std::vector<uint16_t> hidden, residual;
    std::vector<int32_t> topk;
    for (int s = 0; s < spec.steps; ++s) {
      if (r == 0) progress(fmt::format("step {}/{}", s + 1, spec.steps));
      const Step& step = steps[static_cast<std::size_t>(s)];
      upload(d_positions.view(), step.positions.data());
      upload(d_hidden.view(), step.hidden_in.data());
      upload(d_residual.view(), zeros.data());
      const auto t0 = Clock::now();
      M3MSA_CHECK_INTERNAL(rt.begin_step(step.batch), "rank ", r, ": step ", s + 1,
                           " refused: ", rt.stats().last_refusal);
      for (int l = 0; l < layers; ++l) {
        LayerRecord* rec =
            record ? &out.records[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)]
                   : nullptr;
        if (rec && r == 0) {
          download(d_hidden.view(), rec->in_hidden);
          download(d_residual.view(), rec->in_residual);
        }
        rt.forward_layer(spec.first_layer() + l, d_hidden.view(), d_residual.view(),
                         d_positions.view());
        if (!rec) continue;
        cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        if (!spec.is_dense(l)) download(rt.last_layer_trace().topk, topk);
        download(d_hidden.view(), hidden);
        download(d_residual.view(), residual);
        kept.keep(spec, r, tp, spec.is_dense(l) ? nullptr : topk.data(), hidden, residual, *rec);
      }
      cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (r == 0) out.step_ms.push_back(seconds_since(t0) * 1e3);
    }
    if (r == 0) out.stats = rt.stats();
    std::vector<LayerCaches> empty;
    for (const LayerWeights& w : dev.weights.layers) empty.push_back({w.layer, {}, {}});
    rt.detach(empty);
  });
  out.rank_mismatches = kept.mismatches();
  return out;
}

#endif

}  // namespace m3msa::cli::demo_rt
