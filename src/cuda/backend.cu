// The CUDA backend on one GPU (cuda_backend.h): owns a stream and the workspaces, validates on
// the host, and calls the launchers of the indexer (indexer.cu), the sparse attention
// (attention.cu) and the preprocessing (preprocess.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "cuda/attention.h"
#include "cuda/common.cuh"
#include "cuda/indexer.h"
#include "cuda/preprocess.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/error.h"

namespace m3msa {

// ---- DeviceTensor and copies ----

DeviceTensor::DeviceTensor(DType dtype, std::vector<int64_t> shape, int device)
    : dtype_(dtype), shape_(std::move(shape)), device_(device) {
  for (int64_t extent : shape_) {
    M3MSA_CHECK_ARG(extent >= 0, "DeviceTensor: negative extent in shape ", shape_string(shape_));
  }
  const std::size_t bytes = nbytes();
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device);
  void* raw = nullptr;
  CUDA_CHECK(cudaMalloc(&raw, bytes));
  storage_ = std::shared_ptr<void>(raw, [device](void* p) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaFree(p);
    cudaSetDevice(previous);
  });
}

int64_t DeviceTensor::numel() const {
  int64_t n = 1;
  for (int64_t extent : shape_) n *= extent;
  return n;
}

TensorView DeviceTensor::view() const {
  return TensorView::contiguous(storage_.get(), dtype_, shape_, Device::cuda(device_));
}

DeviceTensor to_device(const HostTensor& host, int device) {
  DeviceTensor out(host.dtype(), host.shape(), device);
  if (host.nbytes()) {
    cuda::DeviceGuard guard(device);
    CUDA_CHECK(cudaMemcpy(out.data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice));
  }
  return out;
}

void copy_to_host(const TensorView& device_view, HostTensor& host) {
  M3MSA_CHECK_ARG(device_view.device.type == DeviceType::kCUDA,
                  "copy_to_host: ", describe(device_view), " is not a CUDA tensor");
  M3MSA_CHECK_ARG(device_view.is_contiguous(), "copy_to_host: ", describe(device_view),
                  " is not contiguous");
  if (host.empty() || host.dtype() != device_view.dtype || host.shape() != device_view.sizes()) {
    host = HostTensor(device_view.dtype, device_view.sizes());
  }
  if (host.nbytes() == 0) return;
  cuda::DeviceGuard guard(device_view.device.index);
  CUDA_CHECK(cudaMemcpy(host.data(), device_view.data, host.nbytes(), cudaMemcpyDeviceToHost));
}

void copy_to_device(const HostTensor& host, const TensorView& device_view) {
  M3MSA_CHECK_ARG(device_view.device.type == DeviceType::kCUDA,
                  "copy_to_device: ", describe(device_view), " is not a CUDA tensor");
  M3MSA_CHECK_ARG(host.nbytes() == device_view.nbytes() && device_view.is_contiguous(),
                  "copy_to_device: ", host.nbytes(), " host bytes into ", describe(device_view));
  if (host.nbytes() == 0) return;
  cuda::DeviceGuard guard(device_view.device.index);
  CUDA_CHECK(cudaMemcpy(device_view.data, host.data(), host.nbytes(), cudaMemcpyHostToDevice));
}

void fill_device_bytes(const TensorView& device_view, uint8_t byte) {
  M3MSA_CHECK_ARG(device_view.device.type == DeviceType::kCUDA,
                  "fill_device_bytes: ", describe(device_view), " is not a CUDA tensor");
  if (device_view.nbytes() == 0) return;
  cuda::DeviceGuard guard(device_view.device.index);
  // On a private stream, waited for alone: a device-wide synchronize would also wait for other
  // threads' kernels (ranks sharing a GPU spin on each other's).
  cuda::Stream stream;
  CUDA_CHECK(cudaMemsetAsync(device_view.data, byte, device_view.nbytes(), stream.get()));
  stream.synchronize();
}

// ---- DeviceCase ----

IndexerArgs DeviceCase::indexer_args(const TensorView& topk_idx) const {
  IndexerArgs args;
  args.index_q = index_q.view();
  args.index_cache = index_cache_view();
  args.batch = batch;
  args.topk_idx = topk_idx;
  return args;
}

AttentionArgs DeviceCase::attention_args(const TensorView& topk_idx, const TensorView& out) const {
  AttentionArgs args;
  args.q = q.view();
  args.kv_cache = kv_cache_view();
  args.batch = batch;
  args.topk_idx = topk_idx;
  args.out = out;
  return args;
}

DeviceCase upload(const SyntheticCase& host, int device) {
  DeviceCase d;
  d.config = host.config;
  d.k_scale = host.k_scale;
  d.v_scale = host.v_scale;
  d.batch = host.batch;
  // A field the host batch leaves out stays out; the others point at their device copies.
  auto move = [&](const HostTensor& h, const TensorView& host_view, DeviceTensor& slot,
                  TensorView* batch_view) {
    if (!host_view.defined() && batch_view != nullptr) {
      *batch_view = TensorView{};
      return;
    }
    slot = to_device(h, device);
    if (batch_view != nullptr) *batch_view = slot.view();
  };
  move(host.seq_lens, host.batch.seq_lens, d.seq_lens, &d.batch.seq_lens);
  move(host.cu_seqlens_q, host.batch.cu_seqlens_q, d.cu_seqlens_q, &d.batch.cu_seqlens_q);
  move(host.context_lens, host.batch.context_lens, d.context_lens, &d.batch.context_lens);
  move(host.index_block_table, host.batch.index_block_table, d.index_block_table,
       &d.batch.index_block_table);
  move(host.kv_block_table, host.batch.kv_block_table, d.kv_block_table, &d.batch.kv_block_table);
  move(host.slot_mapping, host.batch.slot_mapping, d.slot_mapping, &d.batch.slot_mapping);
  move(host.index_slot_mapping, host.batch.index_slot_mapping, d.index_slot_mapping,
       &d.batch.index_slot_mapping);
  d.positions = to_device(host.positions, device);
  d.index_q = to_device(host.index_q, device);
  d.q = to_device(host.q, device);
  d.index_cache = to_device(host.index_cache, device);
  d.kv_cache = to_device(host.kv_cache, device);
  d.kv_layout = host.kv_layout;
  return d;
}

namespace {

// Host copies of the batch metadata a call reads, for content validation.
struct HostBatch {
  HostTensor seq_lens, cu_seqlens_q, context_lens, index_table, kv_table, slots, index_slots;
  BatchMeta batch;
};

HostBatch copy_batch_to_host(const BatchMeta& device_batch, bool index_table, bool kv_table,
                             bool slots) {
  HostBatch h;
  h.batch = device_batch;
  auto fetch = [](const TensorView& view, HostTensor& host, TensorView& out) {
    if (!view.defined()) {
      out = TensorView{};
      return;
    }
    copy_to_host(view, host);
    out = host.view();
  };
  fetch(device_batch.seq_lens, h.seq_lens, h.batch.seq_lens);
  fetch(device_batch.cu_seqlens_q, h.cu_seqlens_q, h.batch.cu_seqlens_q);
  fetch(device_batch.context_lens, h.context_lens, h.batch.context_lens);
  if (index_table) {
    fetch(device_batch.index_block_table, h.index_table, h.batch.index_block_table);
  } else {
    h.batch.index_block_table = TensorView{};
  }
  if (kv_table) {
    fetch(device_batch.kv_block_table, h.kv_table, h.batch.kv_block_table);
  } else {
    h.batch.kv_block_table = TensorView{};
  }
  if (slots) {
    fetch(device_batch.slot_mapping, h.slots, h.batch.slot_mapping);
    fetch(device_batch.index_slot_mapping, h.index_slots, h.batch.index_slot_mapping);
  } else {
    h.batch.slot_mapping = TensorView{};
    h.batch.index_slot_mapping = TensorView{};
  }
  return h;
}

class CudaBackendImpl final : public CudaBackend {
 public:
  explicit CudaBackendImpl(int device) : device_(device) {
    const int count = cuda_device_count();
    M3MSA_CHECK_SUPPORTED(count > 0, "CUDA backend: no CUDA device is visible");
    M3MSA_CHECK_ARG(device >= 0 && device < count, "CUDA backend: device ", device,
                    " is not in [0, ", count, ")");
    cuda::DeviceGuard guard(device_);
    CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    stream_ = own_stream_;
  }
  ~CudaBackendImpl() override {
    if (own_stream_) {
      cudaStreamSynchronize(own_stream_);
      cudaStreamDestroy(own_stream_);
    }
  }

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::cuda(device_); }
  int device_index() const override { return device_; }

  void set_stream(void* stream) override {
    stream_ = stream ? static_cast<cudaStream_t>(stream) : own_stream_;
  }
  void* stream() const override { return stream_; }
  void set_validate_contents(bool on) override { validate_contents_ = on; }
  void set_indexer_variant(IndexerVariant variant) override { variant_ = variant; }

  void plan(const SparseConfig& config, const PlanLimits& limits) override {
    cuda::DeviceGuard guard(device_);
    plan_indexer_workspace(config, limits);
    plan_attention_workspace(config, limits);
  }

  void preprocess(const SparseConfig& config, const PreprocessArgs& args) override {
    cuda::DeviceGuard guard(device_);
    validate(config, args, device());
    if (validate_contents_) {
      const HostBatch h = copy_batch_to_host(args.batch, false, false, true);
      validate_batch_contents(h.batch, config, args.index_cache.pages(), args.kv_cache.pages());
    }
    cuda::launch_preprocess(config, args, stream_);
  }

  void select_topk(const SparseConfig& config, const IndexerArgs& args) override {
    cuda::DeviceGuard guard(device_);
    validate(config, args, device());
    cuda::check_indexer_supported(config);
    if (validate_contents_) {
      const HostBatch h = copy_batch_to_host(args.batch, true, false, false);
      validate_batch_contents(h.batch, config, args.index_cache.pages(), 0);
    }
    if (!indexer_plan_ ||
        !cuda::indexer_fits_plan(*indexer_plan_, config, args, variant_, nullptr)) {
      PlanLimits limits = indexer_plan_ ? indexer_plan_->limits : PlanLimits{};
      const BatchMeta& b = args.batch;
      limits.max_reqs = std::max(limits.max_reqs, std::max(b.num_reqs, 1));
      if (b.kind == BatchKind::kDecode) {
        limits.max_q_len = std::max(limits.max_q_len, b.q_len);
      }
      limits.max_rows = std::max<int64_t>(
          {limits.max_rows, b.num_rows(), int64_t{limits.max_reqs} * limits.max_q_len});
      if (variant_ == IndexerVariant::kUnfused) {
        limits.max_context = std::max<int64_t>(
            limits.max_context, b.index_block_table.shape[1] * int64_t{config.block_size});
      }
      plan_indexer_workspace(config, limits);
    }
    cuda::launch_indexer(*indexer_plan_, config, args, variant_, indexer_ws_.data(), stream_);
  }

  void sparse_attention(const SparseConfig& config, const AttentionArgs& args) override {
    cuda::DeviceGuard guard(device_);
    validate(config, args, device());
    if (validate_contents_) {
      const HostBatch h = copy_batch_to_host(args.batch, false, true, false);
      validate_batch_contents(h.batch, config, 0, args.kv_cache.pages());
    }
    PlanLimits limits;
    limits.max_reqs = std::max(args.batch.num_reqs, 1);
    limits.max_q_len = args.batch.kind == BatchKind::kDecode ? args.batch.q_len : 1;
    limits.max_rows = args.batch.num_rows();
    const std::size_t need = cuda::attention_workspace_size(config, limits);
    if (need > attention_ws_.bytes()) {
      ensure_not_capturing("sparse_attention workspace");
      attention_ws_ = cuda::DeviceBuffer(need);
      CUDA_CHECK(cudaMemsetAsync(attention_ws_.data(), 0, need, stream_));
    }
    cuda::launch_attention(config, args, attention_ws_.data(), attention_ws_.bytes(), stream_);
  }

  void synchronize() override {
    cuda::DeviceGuard guard(device_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  uint32_t indexer_device_status(bool clear) override {
    cuda::DeviceGuard guard(device_);
    if (!indexer_plan_) return 0;
    return cuda::read_indexer_status(*indexer_plan_, indexer_ws_.data(), stream_, clear);
  }

 private:
  void ensure_not_capturing(const char* what) const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    M3MSA_CHECK_ARG(status == cudaStreamCaptureStatusNone, "CUDA backend: the ", what,
                    " must grow while the stream is being captured; call plan() with limits "
                    "covering the batch before capturing");
  }

  void plan_indexer_workspace(const SparseConfig& config, const PlanLimits& limits) {
    cuda::IndexerPlan plan = cuda::plan_indexer(config, limits, device_);
    if (plan.workspace_bytes > indexer_ws_.bytes()) {
      ensure_not_capturing("indexer workspace");
      CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old workspace may still be in use
      indexer_ws_ = cuda::DeviceBuffer(plan.workspace_bytes);
    }
    cuda::init_indexer_workspace(plan, indexer_ws_.data(), stream_);
    indexer_plan_ = std::make_unique<cuda::IndexerPlan>(plan);
  }

  void plan_attention_workspace(const SparseConfig& config, const PlanLimits& limits) {
    const std::size_t need = cuda::attention_workspace_size(config, limits);
    if (need > attention_ws_.bytes()) {
      ensure_not_capturing("sparse_attention workspace");
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      attention_ws_ = cuda::DeviceBuffer(need);
      CUDA_CHECK(cudaMemsetAsync(attention_ws_.data(), 0, need, stream_));
    }
  }

  int device_ = 0;
  cudaStream_t own_stream_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool validate_contents_ = true;
  IndexerVariant variant_ = IndexerVariant::kFused;
  std::unique_ptr<cuda::IndexerPlan> indexer_plan_;
  cuda::DeviceBuffer indexer_ws_;
  cuda::DeviceBuffer attention_ws_;
};

}  // namespace

std::unique_ptr<CudaBackend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackendImpl>(device);
}

}  // namespace m3msa
