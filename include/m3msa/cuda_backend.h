// The CUDA backend (one GPU) and the host helpers that move tensors and synthetic cases to it.
// Works in every build: without CUDA, make_cuda_backend() and the device helpers throw
// Error(kUnsupported). The header needs no CUDA headers (streams are passed as void*).
//
// Plan/run: plan() sizes every workspace for the batches within a PlanLimits; afterwards, calls
// within those limits allocate nothing, never synchronize the host (with content validation off)
// and can be captured into a CUDA graph. Launch grids depend only on the planned maxima and the
// host-side shapes, so one captured graph replays any device-side metadata within the limits.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "m3msa/backend.h"
#include "m3msa/synthetic.h"
#include "m3msa/tensor.h"

namespace m3msa {

// The largest batches a plan must serve. Zeros are filled in from the others where possible.
struct PlanLimits {
  int max_reqs = 1;         // requests per call (padding requests included)
  int max_q_len = 1;        // decode rows per request, 1..kMaxQueryLen
  int64_t max_rows = 0;     // rows per call; 0 = max_reqs * max_q_len (decode only)
  int64_t max_context = 0;  // tokens per request, new ones included (0 = unknown: not used by
                            // the decode indexer, whose workspace does not depend on it)
};

// ---- Owning device memory ----

// A contiguous tensor in device memory (cudaMalloc'd on `device`, freed with the object).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::vector<int64_t> shape, int device = 0);
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int device() const { return device_; }
  int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  void* data() const { return storage_.get(); }
  TensorView view() const;
  bool empty() const { return storage_ == nullptr; }

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  int device_ = 0;
  std::shared_ptr<void> storage_;
};

// Synchronous copies (they wait for the device): host -> new device tensor, device -> host.
DeviceTensor to_device(const HostTensor& host, int device = 0);
void copy_to_host(const TensorView& device_view, HostTensor& host);
void copy_to_device(const HostTensor& host, const TensorView& device_view);
// Fills every byte of a device tensor (poisoning outputs in tests); synchronous.
void fill_device_bytes(const TensorView& device_view, uint8_t byte);

// A SyntheticCase with every tensor on the device; `batch` and the cache views point there.
struct DeviceCase {
  SparseConfig config;
  BatchMeta batch;
  DeviceTensor seq_lens, cu_seqlens_q, context_lens, index_block_table, kv_block_table,
      slot_mapping, index_slot_mapping, positions, index_q, q, index_cache, kv_cache;
  KVLayout kv_layout = KVLayout::kOurs;  // how kv_cache is laid out (SyntheticCase::kv_layout)
  float k_scale = 1.0f;
  float v_scale = 1.0f;

  IndexCache index_cache_view() const { return {index_cache.view()}; }
  KVCache kv_cache_view() const {
    return kv_cache_from_layout(kv_cache.view(), kv_layout, k_scale, v_scale);
  }
  IndexerArgs indexer_args(const TensorView& topk_idx) const;
  AttentionArgs attention_args(const TensorView& topk_idx, const TensorView& out) const;
  int64_t num_rows() const { return batch.num_rows(); }
};

DeviceCase upload(const SyntheticCase& host, int device = 0);

// ---- The backend ----

// Which indexer implementation select_topk() runs (benchmarks and tests compare them).
enum class IndexerVariant : int {
  // The default. Decode runs the split kernel (each request's blocks spread over many CTAs, pages
  // streamed by bulk copies); its merge runs in the request's last CTA, or as the second kernel of
  // kSplitMerge where that measured faster (one to four requests with many query vectors or long
  // contexts: the last CTA merges the vectors one after another). Prefill runs the span kernel.
  kFused = 0,
  kUnfused = 1,  // baseline: [rows, H, max_blocks] f32 scores to memory, then a top-k kernel
  kSpan = 2,     // decode through the span kernel too (the batch's blocks laid end to end over
                 // the grid, last-CTA merge per request); kept for comparison
  kSplitMerge =
      3,  // decode: the split kernel writes candidates only, and a second kernel, launched
          // programmatically dependent, merges them with one CTA per query vector
  kLastCtaMerge = 4,  // decode: the split kernel with its merge always in the last CTA (comparison)
};

class CudaBackend : public Backend {
 public:
  // Allocates the workspaces for every call within `limits` (zeroed once; kernels keep them
  // reusable). Calls beyond the plan re-plan on the fly (allocating, so not while capturing).
  virtual void plan(const SparseConfig& config, const PlanLimits& limits) = 0;
  // The cudaStream_t all work is queued on (default: a non-blocking stream owned by the backend).
  virtual void set_stream(void* stream) = 0;
  virtual void* stream() const = 0;
  // On (default): every call copies the batch metadata to the host and validates its contents
  // (table entries, lengths) before launching, which synchronizes. Off: shapes only, no sync,
  // graph-capturable; kernels still never read outside the tensors they are given.
  virtual void set_validate_contents(bool on) = 0;
  virtual void set_indexer_variant(IndexerVariant variant) = 0;
  virtual int device_index() const = 0;
  // Sticky bits of the indexer's device-side guards (0 = none fired; 1: a table entry outside the
  // cache, 2: a sequence longer than its table row, 4: too many prefill row groups). Synchronizes.
  virtual uint32_t indexer_device_status(bool clear) = 0;
};

std::unique_ptr<CudaBackend> make_cuda_backend(int device = 0);

}  // namespace m3msa
