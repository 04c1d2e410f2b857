// m3msa soak --gpu: the CUDA CP indexer (peer transport, P ranks as threads, rank r on GPU
// r % visible) against the one-GPU CUDA backend (bit for bit, docs/context_parallel.md "Exactness")
// and the CPU reference (up to the near-tie rule of docs/spec.md section 4), every step;
// cudaMemGetInfo sampled on every device. Compiled in every build; without CUDA run_gpu_soak throws
// kUnsupported.
//
// Nothing in the step loop allocates device memory: the caches, the per-device batch buffers
// (sized for the planned maxima; each step views a prefix with its own shape) and the outputs are
// allocated before the first step, the backend is planned once, the CP indexers are built once.
// So free device memory must stay flat; kDeviceMemorySlack (soak.h) is the allowance.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "checks.h"
#include "m3msa/backend.h"
#include "m3msa/error.h"
#include "progress.h"
#include "soak.h"

#if defined(M3MSA_CLI_WITH_CUDA)
#include <cuda_runtime.h>

#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/cuda_backend.h"
#endif

namespace m3msa::cli {

#if !defined(M3MSA_CLI_WITH_CUDA)

SoakResult run_gpu_soak(const SoakOptions&, Progress&) {
  M3MSA_THROW(ErrorCode::kUnsupported,
              "soak --gpu: this build has no CUDA (configure with nvcc, M3MSA_ENABLE_CUDA=ON)");
}

#else

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

void cuda_check(cudaError_t status, const char* what) {
  M3MSA_CHECK(status == cudaSuccess, ErrorCode::kInternal, "soak --gpu: ", what, ": ",
              cudaGetErrorString(status));
}

// P persistent rank threads; run(body) calls body(rank) on every one and waits for all, then
// rethrows the first rank's error (the lowest rank that is not a timeout, else the lowest).
class RankThreads {
 public:
  explicit RankThreads(int ranks) : errors_(static_cast<std::size_t>(ranks)) {
    for (int r = 0; r < ranks; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      ++generation_;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  void run(const std::function<void(int)>& body) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      body_ = &body;
      pending_ = static_cast<int>(threads_.size());
      std::fill(errors_.begin(), errors_.end(), nullptr);
      ++generation_;
    }
    wake_.notify_all();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    std::exception_ptr timeout;
    for (const std::exception_ptr& e : errors_) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const Error& error) {
        if (error.code() != ErrorCode::kTimeout) throw;
        if (!timeout) timeout = e;
      }
    }
    if (timeout) std::rethrow_exception(timeout);
  }

 private:
  void loop(int rank) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* body = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
        body = body_;
      }
      std::exception_ptr error;
      try {
        (*body)(rank);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      errors_[static_cast<std::size_t>(rank)] = error;
      if (--pending_ == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::vector<std::exception_ptr> errors_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* body_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// One device's copy of the inputs: caches uploaded once (touched pages follow each step), batch
// buffers at the planned maxima, viewed with each step's shape.
struct DeviceInputs {
  int device = 0;
  DeviceTensor cache_bf16, cache_fp8, seq_lens, table, index_q;
  BatchMeta batch;
  IndexerArgs args(DType dtype, const TensorView& topk) const {
    IndexerArgs a;
    a.index_q = index_q_view;
    a.index_cache = {dtype == DType::kBF16 ? cache_bf16.view() : cache_fp8.view()};
    a.batch = batch;
    a.topk_idx = topk;
    return a;
  }
  TensorView index_q_view;
};

TensorView prefix_view(const DeviceTensor& buffer, DType dtype, const std::vector<int64_t>& shape,
                       int device) {
  return TensorView::contiguous(buffer.data(), dtype, shape, Device::cuda(device));
}

void upload_step(const StepSource& source, DeviceInputs& d) {
  cuda_check(cudaSetDevice(d.device), "cudaSetDevice");
  const DType dtype = source.index_dtype();
  const DeviceTensor& cache = dtype == DType::kBF16 ? d.cache_bf16 : d.cache_fp8;
  const HostTensor& host_cache = source.cache(dtype);
  for (int32_t page : source.touched_pages()) {
    const TensorView src = cache_page(host_cache.view(), page);
    cuda_check(cudaMemcpy(cache_page(cache.view(), page).data, src.data, src.nbytes(),
                          cudaMemcpyHostToDevice),
               "page upload");
  }
  const BatchMeta& b = source.batch();
  const TensorView seq = prefix_view(d.seq_lens, DType::kI32, {b.num_reqs}, d.device);
  const TensorView table = prefix_view(d.table, DType::kI32, source.table().shape(), d.device);
  const TensorView q = prefix_view(d.index_q, DType::kBF16, source.index_q().shape(), d.device);
  if (b.num_reqs > 0) {
    copy_to_device(source.seq_lens(), seq);
    copy_to_device(source.table(), table);
  }
  if (source.index_q().numel() > 0) copy_to_device(source.index_q(), q);
  d.batch = b;
  d.batch.seq_lens = seq;
  d.batch.index_block_table = table;
  d.index_q_view = q;
}

}  // namespace

SoakResult run_gpu_soak(const SoakOptions& o, Progress& progress) {
  const auto start = Clock::now();
  SoakResult result;
  result.mode = "gpu";
  result.steps_requested = o.steps;
  const int devices = cuda_device_count();
  M3MSA_CHECK_SUPPORTED(devices > 0, "soak --gpu: no CUDA device is visible");
  const int P = o.ranks > 0 ? o.ranks : std::max(2, devices);
  const int64_t max_context = o.max_context > 0 ? o.max_context : 4096;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.threads > 0 ? o.threads : std::min(8, hw);
  auto device_of = [devices](int rank) { return rank % devices; };
  const int used_devices = std::min(P, devices);

  // M3's per-rank indexer view under CP: all 4 index heads, D 128, block 128, k 16.
  const SparseConfig config = ModelConfig{}.sparse(1);
  const int64_t max_blocks = (max_context + config.block_size - 1) / config.block_size;
  StepSource source(config, o.max_reqs, o.max_q_len, max_blocks, /*allow_empty_batch=*/false,
                    o.hostile, derive_seed(o.seed, 3));
  const int max_rows = source.max_rows();

  // ---- Setup (all allocations happen here) ----
  std::vector<DeviceInputs> inputs(static_cast<std::size_t>(used_devices));
  for (int d = 0; d < used_devices; ++d) {
    DeviceInputs& in = inputs[static_cast<std::size_t>(d)];
    in.device = d;
    in.cache_bf16 = to_device(source.cache(DType::kBF16), d);
    in.cache_fp8 = to_device(source.cache(DType::kFP8E4M3), d);
    in.seq_lens = DeviceTensor(DType::kI32, {o.max_reqs}, d);
    in.table = DeviceTensor(DType::kI32, {o.max_reqs, max_blocks}, d);
    in.index_q = DeviceTensor(DType::kBF16, {max_rows, config.index_heads, config.index_dim}, d);
  }
  std::unique_ptr<CudaBackend> backend = make_cuda_backend(0);
  PlanLimits limits;
  limits.max_reqs = o.max_reqs;
  limits.max_q_len = o.max_q_len;
  limits.max_context = max_blocks * config.block_size;
  backend->plan(config, limits);
  DeviceTensor single_out(DType::kI32, {max_rows, config.index_heads, config.topk}, 0);

  std::shared_ptr<ThreadGroup> group = ThreadGroup::create(P, std::chrono::seconds(60));
  std::vector<std::unique_ptr<Communicator> > comms;
  for (int r = 0; r < P; ++r) comms.push_back(group->communicator(r));
  std::vector<std::unique_ptr<CudaCpIndexer> > indexers(static_cast<std::size_t>(P));
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(P), nullptr);
  std::vector<DeviceTensor> cp_out(static_cast<std::size_t>(P));
  std::vector<HostTensor> cp_host(static_cast<std::size_t>(P));
  CudaCpConfig cp;
  cp.world_size = P;
  cp.max_reqs = o.max_reqs;
  cp.max_q_len = o.max_q_len;
  cp.max_context = max_blocks * config.block_size;
  cp.transport = CpTransport::kPeer;
  RankThreads ranks(P);
  ranks.run([&](int r) {
    const auto i = static_cast<std::size_t>(r);
    cuda_check(cudaSetDevice(device_of(r)), "cudaSetDevice");
    cuda_check(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), "stream");
    indexers[i] = std::make_unique<CudaCpIndexer>(*comms[i], device_of(r), config, cp);
    const auto merged = static_cast<int64_t>(indexers[i]->merged_heads().size());
    cp_out[i] = DeviceTensor(DType::kI32, {max_rows, merged, config.topk}, device_of(r));
  });
  json device_names = json::array();
  for (int d = 0; d < used_devices; ++d) {
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
    device_names.push_back(fmt::format("{}: {}", d, prop.name));
  }
  result.setup = {{"config", config.to_string()}, {"world_size", P},
                  {"transport", "peer"},          {"visible_devices", devices},
                  {"devices", device_names},      {"max_reqs", o.max_reqs},
                  {"max_q_len", o.max_q_len},     {"max_context", max_blocks * config.block_size},
                  {"pages", source.pages()},      {"reference_threads", threads},
                  {"hostile", o.hostile},         {"single_gpu", backend->name()}};
  result.steps_by_world_size[std::to_string(P)] = 0;

  std::vector<MemorySeries> device_free(static_cast<std::size_t>(used_devices));
  for (int d = 0; d < used_devices; ++d) {
    device_free[static_cast<std::size_t>(d)].what = fmt::format("device {} free", d);
    device_free[static_cast<std::size_t>(d)].slack = kDeviceMemorySlack;
  }
  MemorySeries rss = host_rss_series();
  auto sample = [&] {
    for (int d = 0; d < used_devices; ++d) {
      size_t free_bytes = 0, total_bytes = 0;
      cuda_check(cudaSetDevice(d), "cudaSetDevice");
      cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
      device_free[static_cast<std::size_t>(d)].add(static_cast<int64_t>(free_bytes));
    }
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    rss.add(host_rss_bytes());
  };
  const int64_t sample_every =
      o.sample_every > 0 ? o.sample_every : std::max<int64_t>(100, o.steps / 100);
  // Long enough for lazily loaded kernels (every dtype x q_len variant) to be in memory.
  const int64_t warmup = std::min<int64_t>(o.steps / 20, 1000);

  int64_t cp_bad = 0, structure_bad = 0, reference_bad = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    if (o.max_seconds > 0 && seconds_since(start) > o.max_seconds) {
      result.stopped_by_time_limit = true;
      break;
    }
    source.next(P);
    const BatchMeta& b = source.batch();
    const int64_t rows = b.num_rows();
    const int H = config.index_heads;
    const int k = config.topk;
    const int layer = static_cast<int>(step % 61);
    try {
      for (DeviceInputs& in : inputs) upload_step(source, in);
      // The one-GPU answer (contents validated on the host: a bad draw would be an error).
      cuda_check(cudaSetDevice(0), "cudaSetDevice");
      const TensorView single = prefix_view(single_out, DType::kI32, {rows, H, k}, 0);
      fill_device_bytes(single, 0x5A);
      backend->select_topk(config, inputs[0].args(source.index_dtype(), single));
      backend->synchronize();
      HostTensor single_host(DType::kI32, {rows, H, k});
      copy_to_host(single, single_host);
      // Every rank's CP answer for its merged heads.
      ranks.run([&](int r) {
        const auto i = static_cast<std::size_t>(r);
        cuda_check(cudaSetDevice(device_of(r)), "cudaSetDevice");
        CudaCpIndexer& ind = *indexers[i];
        const auto merged = static_cast<int64_t>(ind.merged_heads().size());
        const TensorView out = prefix_view(cp_out[i], DType::kI32, {rows, merged, k}, device_of(r));
        fill_device_bytes(out, 0x5A);
        const DeviceInputs& in = inputs[static_cast<std::size_t>(device_of(r))];
        ind.select(layer, in.args(source.index_dtype(), out), streams[i]);
        ind.check(streams[i]);
        cp_host[i] = HostTensor(DType::kI32, {rows, merged, k});
        copy_to_host(out, cp_host[i]);
      });
      if (step == o.inject_mismatch_step && cp_host[0].numel() > 0) {
        cp_host[0].ptr<int32_t>()[0] ^= 1;
      }
      // CP vs one GPU: bit for bit, every rank's heads.
      int64_t step_bad = 0;
      for (int r = 0; r < P; ++r) {
        const auto i = static_cast<std::size_t>(r);
        const std::vector<int>& heads = indexers[i]->merged_heads();
        const auto merged = static_cast<int64_t>(heads.size());
        for (int64_t row = 0; row < rows; ++row) {
          for (int64_t lh = 0; lh < merged; ++lh) {
            const int32_t* want = single_host.ptr<int32_t>() + (row * H + heads[lh]) * k;
            const int32_t* got = cp_host[i].ptr<int32_t>() + (row * merged + lh) * k;
            ++result.lists_compared;
            if (std::memcmp(want, got, sizeof(int32_t) * k) == 0) continue;
            ++cp_bad;
            if (step_bad++ == 0) {
              std::string w, g;
              for (int j = 0; j < k; ++j) {
                w += fmt::format(" {}", want[j]);
                g += fmt::format(" {}", got[j]);
              }
              result.record_mismatch(fmt::format(
                  "step {} layer {} {}: CP rank {} vs one GPU, row {} head {}: want [{} ], got "
                  "[{} ]",
                  step, layer, source.describe(), r, row, heads[lh], w, g));
            }
          }
        }
      }
      // One GPU vs the CPU reference: well formed, and the top-k of the CPU's block scores up
      // to near-ties (docs/spec.md section 4).
      const IndexerArgs host_args = source.args(single_host.view());
      const CheckResult structure = check_selections_wellformed(config, b, single_host.view());
      const CheckResult reference =
          check_selections_vs_scores(config, host_args, kSelectionTieTolerance, threads);
      result.lists_compared += structure.checked + reference.checked;
      structure_bad += structure.failed;
      reference_bad += reference.failed;
      for (const CheckResult* c : {&structure, &reference}) {
        if (c->failed == 0) continue;
        if (step_bad == 0) {
          result.record_mismatch(fmt::format("step {} {}: one GPU vs CPU reference: {}: {}", step,
                                             source.describe(), c->name, c->detail));
        }
        step_bad += c->failed;
      }
      if (step_bad > 0) {
        ++result.mismatched_steps;
        result.mismatches += step_bad;
      }
    } catch (const Error& e) {
      result.error = fmt::format("step {} ({}): {}", step, source.describe(), error_text(e));
      break;
    }
    ++result.steps_done;
    if (step >= warmup && (step - warmup) % sample_every == 0) sample();
    progress.update(fmt::format("soak --gpu step {}/{} P={} mismatches {} ({:.0f} steps/s)",
                                step + 1, o.steps, P, result.mismatches,
                                (step + 1) / std::max(1e-9, seconds_since(start))));
  }
  if (result.error.empty()) sample();
  result.steps_by_world_size[std::to_string(P)] = result.steps_done;
  result.mismatch_counts = {{"cp_vs_single_gpu", cp_bad},
                            {"single_gpu_wellformed", structure_bad},
                            {"single_gpu_vs_cpu_reference", reference_bad}};
  for (MemorySeries& m : device_free) result.memory.push_back(m);
  result.memory.push_back(rss);
  result.hostile_events = source.hostile_events();

  // Teardown: the indexers are collective (peers stop storing before buffers go).
  try {
    ranks.run([&](int r) {
      const auto i = static_cast<std::size_t>(r);
      cuda_check(cudaSetDevice(device_of(r)), "cudaSetDevice");
      indexers[i].reset();
      cp_out[i] = DeviceTensor();
      if (streams[i] != nullptr) cuda_check(cudaStreamDestroy(streams[i]), "stream destroy");
    });
  } catch (const Error& e) {
    if (result.error.empty()) result.error = "teardown: " + error_text(e);
  }
  result.wall_s = seconds_since(start);
  return result;
}

#endif  // M3MSA_CLI_WITH_CUDA

}  // namespace m3msa::cli
