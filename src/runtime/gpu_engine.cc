// The CUDA backend of the runtime (runtime.h): one rank's device state and forward_layer as a
// queue of kernels on one stream. Host code only (kernels live in src/cuda); compiled in every
// build, with stubs that report "unsupported" where there is no CUDA.
//
// Per layer (rows <= 16 decode tokens), on the stream, nothing allocated, no host sync:
//   add_rmsnorm(hidden + residual -> residual, input_norm -> normed)       1 launch
//   skinny GEMM normed @ qkv_proj^T (* scale) -> qkv bf16                   1
//   preprocess (head norms, RoPE, k/v/index_k cache insert) -> q, index_q   1
//   decode indexer -> topk: replicated (every rank scores all blocks)       1
//     or the CP indexer (shard tables, shard scoring, exchange + merge)     3 (peer) | 5 (nccl)
//     or nothing (a layer sharing the last indexer layer's selection)      0
//   sparse attention -> attn                                                1
//   skinny GEMM attn @ o_proj^T -> o (bf16 at TP = 1, f32 + all-reduce at TP > 1)  1 (+1)
//   add_rmsnorm(residual + o -> residual, post_attention_norm -> hidden)    1
//   MLP when bound: GEMM gate_up, SwiGLU, GEMM down (-> hidden at TP = 1; f32, all-reduce and a
//   conversion at TP > 1)                                                   3 (+2)
//   or the MoE: router, gate/up, down, combine, (all-reduce,) conversion   5 (+1)
// A dense layer (below first_sparse_layer) projects [q | k | v] only, preprocesses without the
// index part, selects nothing, attends densely over every visible key, and runs its dense MLP on
// the moe family's kernels: gate/up, down, (all-reduce,) conversion      3 (+1)
//
// Projection choice: decode has <= 16 token rows, so one m16 tensor-core tile covers every row
// and the projections are pure weight streams; our skinny GEMM (cuda/gemm.h) reads each
// weight byte once with 16-byte loads and converts fp8 e4m3 weights to bf16 in registers; grids
// of < 4 CTAs per SM (o_proj, TP = 2 q/k/v) split K over 8 warps per tile instead of 4. It
// needs no cuBLAS(Lt) (whose static library would not fit the carried build, and whose fp8 path
// wants per-tensor scales, not the per-output-channel scales bound here).
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "m3msa/backend.h"
#include "runtime/runtime_internal.h"

#if defined(M3MSA_WITH_CUDA)
#include <cuda_runtime.h>
#include <nccl.h>

#include "comm/nccl_check.h"
#include "comm/peer_allreduce.h"
#include "cuda/activation.h"
#include "cuda/attention.h"
#include "cuda/common.cuh"
#include "cuda/convert.h"
#include "cuda/gemm.h"
#include "cuda/indexer.h"
#include "cuda/moe.h"
#include "cuda/norm.h"
#include "cuda/preprocess.h"
#include "m3msa/cp_cuda.h"
#endif

namespace m3msa::runtime_detail {

#if defined(M3MSA_WITH_CUDA)

namespace {

int max_of(const std::vector<int>& values) {
  return values.empty() ? 0 : *std::max_element(values.begin(), values.end());
}

std::size_t align_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// Pinned host memory (the staging of host metadata), freed with the object.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_) CUDA_CHECK(cudaHostAlloc(&data_, bytes_, cudaHostAllocDefault));
  }
  ~PinnedBuffer() {
    if (data_) cudaFreeHost(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Where each metadata array sits in the fixed buffer (and in each staging buffer: same layout).
struct MetaLayout {
  std::size_t seq_lens = 0;     // [max_reqs] i32
  std::size_t slots = 0;        // [max_rows] i64
  std::size_t index_slots = 0;  // [max_rows] i64
  std::size_t index_table = 0;  // [max_reqs, max_blocks] i32
  std::size_t kv_table = 0;     // [max_reqs, max_blocks] i32
  std::size_t total = 0;
};

MetaLayout meta_layout(int max_reqs, int max_rows, int64_t max_blocks) {
  MetaLayout l;
  std::size_t at = 0;
  l.seq_lens = at;
  at = align_up(at + sizeof(int32_t) * static_cast<std::size_t>(max_reqs), 256);
  l.slots = at;
  at = align_up(at + sizeof(int64_t) * static_cast<std::size_t>(max_rows), 256);
  l.index_slots = at;
  at = align_up(at + sizeof(int64_t) * static_cast<std::size_t>(max_rows), 256);
  const std::size_t table =
      sizeof(int32_t) * static_cast<std::size_t>(max_reqs) * static_cast<std::size_t>(max_blocks);
  l.index_table = at;
  at = align_up(at + table, 256);
  l.kv_table = at;
  at = align_up(at + table, 256);
  l.total = at;
  return l;
}

constexpr int kStagingSlots = 2;

// How the MoE's launches are scheduled: M3MSA_MOE_SCHEDULE = launches (default: the launch
// sequence), deep, down4 or persistent (MoeParams::deep / down_tiles / persistent), for comparing
// them inside the layer (bench layer --moe); each gives the same bits.
enum class MoeSchedule { kLaunches, kDeep, kDown4, kPersistent };

MoeSchedule moe_schedule_from_env() {
  const char* v = std::getenv("M3MSA_MOE_SCHEDULE");
  const std::string text = v == nullptr ? "" : v;
  if (text.empty() || text == "launches") return MoeSchedule::kLaunches;
  if (text == "deep") return MoeSchedule::kDeep;
  if (text == "down4") return MoeSchedule::kDown4;
  if (text == "persistent") return MoeSchedule::kPersistent;
  M3MSA_THROW(ErrorCode::kInvalidArgument, "M3MSA_MOE_SCHEDULE: expected launches, deep, down4 or ",
              "persistent, got '", text, "'");
}

void apply_moe_schedule(MoeSchedule schedule, cuda::MoeParams& p) {
  p.deep = schedule == MoeSchedule::kDeep;
  p.down_tiles = schedule == MoeSchedule::kDown4 ? cuda::kMoeDownTiles : 1;
  p.persistent = schedule == MoeSchedule::kPersistent;
}

class GpuEngineImpl final : public GpuEngine {
 public:
  GpuEngineImpl(const RuntimeConfig& config, int tp_size, Communicator& comm,
                const std::vector<LayerWeights>& layers, Device device)
      : config_(config),
        sparse_(config.model.sparse(tp_size, config.context_parallel)),
        tp_size_(tp_size),
        device_(device.index) {
    cuda::DeviceGuard guard(device_);
    if (config.cuda_stream != nullptr) {
      stream_ = static_cast<cudaStream_t>(config.cuda_stream);
    } else {
      CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
      stream_ = own_stream_;
    }
    try {
      CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
      overlap_ = config.indexer_overlap != IndexerOverlap::kOff && !config.context_parallel;
      if (overlap_) {
        int least = 0, greatest = 0;
        CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
        CUDA_CHECK(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, greatest));
        CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
      }
      allocate(layers);
    } catch (...) {
      if (stream_) cudaStreamSynchronize(stream_);
      free_buffers();
      release_stream();
      throw;
    }
  }

  ~GpuEngineImpl() override {
    // Close: the stream must be idle before the buffers go; everything is freed with this rank's
    // device current, then the caller's device is restored (errors here cannot be thrown).
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    free_buffers();
    release_stream();
    cudaSetDevice(previous);
  }

  void* stream() const override { return stream_; }
  int64_t launches_per_layer() const override { return launches_; }

  void refresh_plans() override {
    if (config_.context_parallel) return;  // the CP indexer re-applies its own before launches
    cuda::DeviceGuard guard(device_);
    // plan_indexer sets the scoring kernels' shared-memory limit to this plan's (a later plan
    // elsewhere in the process may have lowered it); the workspace layout is unchanged.
    indexer_plan_ = cuda::plan_indexer(sparse_, limits_, device_);
    side_indexer_plan_ = side_plan(indexer_plan_);
  }

  void connect(Communicator& comm, Problems& problems) override {
    cuda::DeviceGuard guard(device_);
    const int P = tp_size_;
    auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
    // Where every rank runs. Peer stores need every pair of ranks on one host with peer access
    // (or one device); the NCCL paths need every rank on an NcclCommunicator.
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const std::vector<ByteRecord> places = comm.all_gather(RecordWriter()
                                                               .str(host)
                                                               .i64(static_cast<int64_t>(getpid()))
                                                               .i64(device_)
                                                               .u8(nccl != nullptr ? 1 : 0)
                                                               .take(),
                                                           "prepare/connect: placement");
    bool can_map = true;
    bool all_nccl = true;
    std::string why_not_map;
    for (int r = 0; r < P; ++r) {
      RecordReader reader(places[static_cast<std::size_t>(r)],
                          "placement of rank " + std::to_string(r));
      const std::string peer_host = reader.str();
      reader.i64();  // pid: in-process peers map by peer access, others by CUDA IPC
      const int peer_device = static_cast<int>(reader.i64());
      all_nccl = all_nccl && reader.u8() == 1;
      if (r == comm.rank() || peer_device == device_) continue;
      int can = 0;
      CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, peer_device));
      if (peer_host != host || !can) {
        can_map = false;
        why_not_map = "rank " + std::to_string(comm.rank()) + " (cuda:" + std::to_string(device_) +
                      ") cannot map the memory of rank " + std::to_string(r) +
                      " (cuda:" + std::to_string(peer_device) +
                      (peer_host != host ? " on another host" : "") + ")";
      }
    }
    // Each rank checked its own row of the peer-access matrix: agree on the whole.
    const std::vector<ByteRecord> verdicts = comm.all_gather(
        RecordWriter().u8(can_map ? 1 : 0).str(why_not_map).take(), "prepare/connect: peer map");
    for (int r = 0; r < P; ++r) {
      RecordReader reader(verdicts[static_cast<std::size_t>(r)], "peer-map verdict");
      const bool ok = reader.u8() == 1;
      const std::string why = reader.str();
      if (!ok && can_map) {
        can_map = false;
        why_not_map = why;
      }
    }

    if (P > 1) {
      const TpAllReduce mode = config_.tp_allreduce;
      if (mode == TpAllReduce::kPeer && !can_map) {
        problems.unsupported("tp_allreduce peer: " + why_not_map);
      } else if (mode == TpAllReduce::kNccl && !all_nccl) {
        problems.unsupported("tp_allreduce nccl needs an NcclCommunicator on every rank");
      } else if (mode == TpAllReduce::kAuto && !can_map && !all_nccl) {
        problems.unsupported("the TP all-reduce: no rank pair can use peer stores (" + why_not_map +
                             ") and not every rank has an NcclCommunicator");
      }
      use_peer_ar_ = mode == TpAllReduce::kPeer || (mode == TpAllReduce::kAuto && can_map);
    }
    if (config_.context_parallel && P > 1) {
      if (config_.cp_transport == CpTransport::kPeer && !can_map) {
        problems.unsupported("cp_transport peer: " + why_not_map + " (use cp_transport nccl)");
      } else if (config_.cp_transport == CpTransport::kNccl && !all_nccl) {
        problems.unsupported("cp_transport nccl needs an NcclCommunicator on every rank");
      }
    }
    // Every rank saw the same facts, so every rank stops here, or none does.
    if (!problems.empty()) return;

    if (config_.context_parallel) {
      CudaCpConfig cp;
      cp.world_size = P;
      cp.max_reqs = std::min(max_reqs_, max_rows_);
      cp.max_q_len = max_of(config_.query_lens);
      cp.max_context = config_.max_context;
      cp.transport = config_.cp_transport;
      cp.spin_budget = config_.cp_spin_budget;
      cp_ = std::make_unique<CudaCpIndexer>(comm, device_, config_.model.sparse(1), cp);
    }
    if (P > 1 && use_peer_ar_) {
      PeerAllReduceConfig ar;
      ar.max_count = int64_t{max_rows_} * config_.model.hidden;
      ar.spin_budget = config_.cp_spin_budget;
      peer_ar_ = std::make_unique<PeerAllReduce>(comm, device_, ar);
    } else if (P > 1) {
      M3MSA_CHECK_INTERNAL(nccl != nullptr && nccl->nccl_comm() != nullptr,
                           "TP > 1 on NCCL without a live NcclCommunicator");
      nccl_ = nccl->nccl_comm();
      CUDA_CHECK(cudaMemsetAsync(o32_.data(), 0, o32_.bytes(), stream_));
      all_reduce(o32_.as<float>(), static_cast<int64_t>(o32_.bytes() / sizeof(float)), -1);
      nccl->wait(stream_, "prepare: warm-up all-reduce of the CUDA runtime");
    }
  }

  void check() override {
    cuda::DeviceGuard guard(device_);
    if (cp_) cp_->check(stream_);
    if (peer_ar_) peer_ar_->check(stream_);
    if (!cp_ && !peer_ar_) CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  std::string tp_allreduce_name() const override {
    return tp_size_ == 1 ? "none" : peer_ar_ ? "peer" : "nccl";
  }

  void drain(Communicator& comm) override {
    cuda::DeviceGuard guard(device_);
    auto* nccl = nccl_ != nullptr ? dynamic_cast<NcclCommunicator*>(&comm) : nullptr;
    if (cp_ || peer_ar_) {
      check();  // bounded waits that also report what the exchanges recorded
    } else if (nccl != nullptr) {
      nccl->wait(stream_, "close: the CUDA runtime's stream");
    } else {
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  }

  BatchMeta stage_step(const BatchMeta& batch, int padded_reqs) override {
    cuda::DeviceGuard guard(device_);
    M3MSA_CHECK_ARG(!stream_is_capturing(stream_),
                    "begin_step: the runtime's stream is capturing; stage each step's metadata "
                    "eagerly, before replaying (a captured copy would replay stale metadata)");
    const int n = batch.num_reqs;
    const int q = batch.q_len;
    const int64_t rows = int64_t{n} * q;
    const int64_t padded_rows = int64_t{padded_reqs} * q;
    M3MSA_CHECK_INTERNAL(padded_reqs >= n && padded_reqs <= max_reqs_ && padded_rows <= max_rows_,
                         "padded step ", padded_reqs, " x ", q, " outside the buffers");
    const bool on_host = batch.seq_lens.device.type == DeviceType::kCPU;
    for (const auto& [view, name] : {std::pair{&batch.seq_lens, "seq_lens"},
                                     {&batch.slot_mapping, "slot_mapping"},
                                     {&batch.index_slot_mapping, "index_slot_mapping"}}) {
      M3MSA_CHECK_ARG(view->is_contiguous(), "begin_step: batch.", name,
                      " must be contiguous, got ", describe(*view));
    }
    uint8_t* meta = meta_.as<uint8_t>();
    const std::size_t table_row = sizeof(int32_t) * static_cast<std::size_t>(max_blocks_);
    const std::size_t table_bytes = table_row * static_cast<std::size_t>(padded_reqs);
    if (on_host) {
      // Wait until this staging buffer's previous copy has run (only when the host is two steps
      // ahead of the stream), fill it, copy it.
      const int slot = next_slot_;
      next_slot_ = (next_slot_ + 1) % kStagingSlots;
      CUDA_CHECK(cudaEventSynchronize(staged_[slot]));
      uint8_t* stage = staging_[slot]->data();
      auto* seq = reinterpret_cast<int32_t*>(stage + layout_.seq_lens);
      std::memcpy(seq, batch.seq_lens.data, sizeof(int32_t) * static_cast<std::size_t>(n));
      std::fill(seq + n, seq + padded_reqs, 0);
      const std::pair<const TensorView*, std::size_t> slot_maps[] = {
          {&batch.slot_mapping, layout_.slots}, {&batch.index_slot_mapping, layout_.index_slots}};
      for (const auto& [src, offset] : slot_maps) {
        auto* dst = reinterpret_cast<int64_t*>(stage + offset);
        std::memcpy(dst, src->data, sizeof(int64_t) * static_cast<std::size_t>(rows));
        std::fill(dst + rows, dst + padded_rows, int64_t{-1});
      }
      const std::pair<const TensorView*, std::size_t> tables[] = {
          {&batch.index_block_table, layout_.index_table},
          {&batch.kv_block_table, layout_.kv_table}};
      for (const auto& [src, offset] : tables) {
        const int64_t cols = std::min<int64_t>(src->shape[1], max_blocks_);
        auto* dst = reinterpret_cast<int32_t*>(stage + offset);
        for (int r = 0; r < padded_reqs; ++r) {
          int32_t* out = dst + int64_t{r} * max_blocks_;
          int64_t copied = 0;
          if (r < n) {
            const int32_t* in = src->ptr<const int32_t>() + r * src->strides[0];
            for (int64_t c = 0; c < cols; ++c) out[c] = in[c * src->strides[1]];
            copied = cols;
          }
          std::fill(out + copied, out + max_blocks_, -1);
        }
      }
      // Three copies: the header (lengths and slots), then the used rows of each table.
      CUDA_CHECK(
          cudaMemcpyAsync(meta, stage, layout_.index_table, cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaMemcpyAsync(meta + layout_.index_table, stage + layout_.index_table,
                                 table_bytes, cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaMemcpyAsync(meta + layout_.kv_table, stage + layout_.kv_table, table_bytes,
                                 cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaEventRecord(staged_[slot], stream_));
    } else {
      M3MSA_CHECK_ARG(batch.seq_lens.device == Device::cuda(device_),
                      "begin_step: the metadata is on ", device_name(batch.seq_lens.device),
                      ", the runtime on cuda:", device_);
      CUDA_CHECK(cudaMemcpyAsync(meta + layout_.seq_lens, batch.seq_lens.data,
                                 sizeof(int32_t) * static_cast<std::size_t>(n),
                                 cudaMemcpyDeviceToDevice, stream_));
      if (padded_reqs > n) {
        CUDA_CHECK(cudaMemsetAsync(meta + layout_.seq_lens + sizeof(int32_t) * n, 0,
                                   sizeof(int32_t) * static_cast<std::size_t>(padded_reqs - n),
                                   stream_));
      }
      const std::pair<const TensorView*, std::size_t> slot_maps[] = {
          {&batch.slot_mapping, layout_.slots}, {&batch.index_slot_mapping, layout_.index_slots}};
      for (const auto& [src, offset] : slot_maps) {
        if (rows > 0) {
          CUDA_CHECK(cudaMemcpyAsync(meta + offset, src->data,
                                     sizeof(int64_t) * static_cast<std::size_t>(rows),
                                     cudaMemcpyDeviceToDevice, stream_));
        }
        if (padded_rows > rows) {
          CUDA_CHECK(cudaMemsetAsync(meta + offset + sizeof(int64_t) * rows, 0xFF,
                                     sizeof(int64_t) * static_cast<std::size_t>(padded_rows - rows),
                                     stream_));
        }
      }
      const std::pair<const TensorView*, std::size_t> tables[] = {
          {&batch.index_block_table, layout_.index_table},
          {&batch.kv_block_table, layout_.kv_table}};
      for (const auto& [src, offset] : tables) {
        M3MSA_CHECK_ARG(src->strides[1] == 1,
                        "begin_step: block table rows must be contiguous, got ", describe(*src));
        const int64_t cols = std::min<int64_t>(src->shape[1], max_blocks_);
        // Every used row: -1 everywhere, then the given columns over it.
        CUDA_CHECK(cudaMemsetAsync(meta + offset, 0xFF, table_bytes, stream_));
        if (n > 0 && cols > 0) {
          CUDA_CHECK(cudaMemcpy2DAsync(meta + offset, table_row, src->data,
                                       sizeof(int32_t) * static_cast<std::size_t>(src->strides[0]),
                                       sizeof(int32_t) * static_cast<std::size_t>(cols),
                                       static_cast<std::size_t>(n), cudaMemcpyDeviceToDevice,
                                       stream_));
        }
      }
    }

    const Device dev = Device::cuda(device_);
    BatchMeta step;
    step.kind = BatchKind::kDecode;
    step.num_reqs = padded_reqs;
    step.q_len = q;
    step.seq_lens =
        TensorView::contiguous(meta + layout_.seq_lens, DType::kI32, {int64_t{padded_reqs}}, dev);
    step.index_block_table = TensorView::contiguous(meta + layout_.index_table, DType::kI32,
                                                    {int64_t{padded_reqs}, max_blocks_}, dev);
    step.kv_block_table = TensorView::contiguous(meta + layout_.kv_table, DType::kI32,
                                                 {int64_t{padded_reqs}, max_blocks_}, dev);
    step.slot_mapping =
        TensorView::contiguous(meta + layout_.slots, DType::kI64, {padded_rows}, dev);
    step.index_slot_mapping =
        TensorView::contiguous(meta + layout_.index_slots, DType::kI64, {padded_rows}, dev);
    return step;
  }

  void forward_layer(const LayerWeights& w, const BatchMeta& step, const TensorView& hidden,
                     const TensorView& residual, const TensorView& positions,
                     bool run_indexer) override {
    cuda::DeviceGuard guard(device_);
    const SparseConfig& sc = sparse_;
    const ModelConfig& m = config_.model;
    const int rows = static_cast<int>(step.num_rows());
    const int H = m.hidden;
    const int width = static_cast<int>(sc.qkv_width());
    // The columns [q | k | v] of qkv_proj: the index columns come after them.
    const int attention_cols = (sc.q_heads + 2 * sc.kv_heads) * sc.head_dim;
    const int attn_width = sc.q_heads * sc.head_dim;
    const Device dev = Device::cuda(device_);
    const bool dense = w.layer < m.first_sparse_layer;  // run_indexer is false
    int64_t launches = 0;
    auto* h = hidden.ptr<uint16_t>();
    auto* res = residual.ptr<uint16_t>();

    // 1. x = hidden + residual (the new residual), normed = input_norm(x).
    add_norm(h, /*delta_f32=*/false, res, w.input_norm, normed_.as<uint16_t>(), rows);
    ++launches;

    // 2-4. The fused projection [q | k | v | index_q | index_k], head norms, RoPE and cache
    // inserts, then the selection. A sharing layer projects [q | k | v] only (its index columns
    // come last in qkv_proj) and selects nothing.
    PreprocessArgs pre;
    pre.qkv =
        TensorView::contiguous(qkv_.data(), DType::kBF16, {int64_t{rows}, int64_t{width}}, dev);
    pre.q_norm = w.q_norm;
    pre.k_norm = w.k_norm;
    pre.index_q_norm = w.index_q_norm;
    pre.index_k_norm = w.index_k_norm;
    pre.positions = positions;
    pre.batch = step;
    pre.kv_cache = w.kv_cache;
    pre.q_out = q_view(rows);
    if (run_indexer) {
      pre.index_cache = w.index_cache;
      pre.index_q_out = index_q_view(rows);
    }
    IndexerArgs idx;
    idx.index_q = pre.index_q_out;
    idx.index_cache = w.index_cache;
    idx.batch = step;
    idx.topk_idx = topk_view(rows);
    bool attention_follows_indexer = false;  // the indexer is the attention's previous kernel
    const bool overlap = run_indexer && overlap_ &&
                         (config_.indexer_overlap == IndexerOverlap::kOn || step.q_len >= 2);
    if (overlap) {
      // The indexer needs only the index columns: they are projected first (a launch of their
      // own, deep: few CTAs; the same bits as inside the whole projection) and preprocessed,
      // then the indexer (a latency chain at small batches) runs on a high-priority side stream
      // beside the q, k, v columns' projection (most of the weight bytes). It is queued first,
      // at one CTA per SM, so the projection's CTAs fill the rest of every SM and take its place
      // when it is done; attention waits for both.
      gemm(normed_.as<uint16_t>(), H, w.qkv_proj, w.qkv_proj_scale, qkv_.data(),
           width - attention_cols, /*out_f32=*/false, rows, /*out_stride=*/width,
           /*first_col=*/attention_cols, /*deep=*/true);
      cuda::launch_preprocess(sc, pre, stream_, cuda::PreprocessPart::kIndex);
      CUDA_CHECK(cudaEventRecord(fork_, stream_));
      CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
      cuda::launch_indexer(side_indexer_plan_, sc, idx, IndexerVariant::kFused, indexer_ws_.data(),
                           side_);
      CUDA_CHECK(cudaEventRecord(join_, side_));
      gemm(normed_.as<uint16_t>(), H, w.qkv_proj, w.qkv_proj_scale, qkv_.data(), attention_cols,
           /*out_f32=*/false, rows, /*out_stride=*/width);
      cuda::launch_preprocess(sc, pre, stream_, cuda::PreprocessPart::kAttention);
      CUDA_CHECK(cudaStreamWaitEvent(stream_, join_, 0));
      launches += 5;
    } else {
      gemm(normed_.as<uint16_t>(), H, w.qkv_proj, w.qkv_proj_scale, qkv_.data(),
           run_indexer ? width : attention_cols, /*out_f32=*/false, rows, /*out_stride=*/width);
      cuda::launch_preprocess(sc, pre, stream_);
      launches += 2;
      if (run_indexer && cp_) {
        cp_->select(w.layer, idx, stream_);
        launches += config_.cp_transport == CpTransport::kNccl && tp_size_ > 1 ? 5 : 3;
      } else if (run_indexer) {
        cuda::launch_indexer(indexer_plan_, sc, idx, IndexerVariant::kFused, indexer_ws_.data(),
                             stream_);
        ++launches;
        attention_follows_indexer = true;
      }
    }

    // 5. Sparse attention (a dense layer: dense causal attention); 6. output projection (this
    // rank's heads) and the TP reduce; 7. x2 = x + o, h2 = norm(x2).
    AttentionArgs att;
    att.q = pre.q_out;
    att.kv_cache = w.kv_cache;
    att.batch = step;
    if (!dense) att.topk_idx = topk_view(rows);
    att.out = attn_view(rows);
    cuda::launch_attention_tuned(sc, att, attention_ws_.data(), attention_ws_.bytes(), stream_,
                                 attention_follows_indexer
                                     ? cuda::attention_tuning_after_indexer(rows)
                                     : cuda::default_attention_tuning());
    ++launches;

    const bool reduce = tp_size_ > 1;
    gemm(attn_.as<uint16_t>(), attn_width, w.o_proj, w.o_proj_scale,
         reduce ? o32_.data() : o16_.data(), H, /*out_f32=*/reduce, rows);
    ++launches;
    if (reduce) {
      all_reduce(o32_.as<float>(), int64_t{rows} * H, 2 * w.layer);
      ++launches;
    }
    add_norm(reduce ? o32_.data() : o16_.data(), reduce, res, w.post_attention_norm, h, rows);
    ++launches;

    // 8. Optional dense SwiGLU-OAI MLP: hidden <- mlp(h2).
    if (w.mlp_gate_up.defined()) {
      const int inter = m.intermediate / tp_size_;
      gemm(h, H, w.mlp_gate_up, TensorView{}, mlp_gu_.data(), 2 * inter, false, rows);
      cuda::ActivationSwigluParams sw;
      sw.gate_up = mlp_gu_.as<uint16_t>();
      sw.act = mlp_act_.as<uint16_t>();
      sw.rows = rows;
      sw.inter = inter;
      sw.limit = config_.swiglu_limit;
      cuda::launch_activation_swiglu(sw, stream_);
      launches += 2;
      if (reduce) {
        gemm(mlp_act_.as<uint16_t>(), inter, w.mlp_down, TensorView{}, o32_.data(), H, true, rows);
        launches += 1 + ffn_to_hidden(w.layer, h, rows);
      } else {
        gemm(mlp_act_.as<uint16_t>(), inter, w.mlp_down, TensorView{}, h, H, false, rows);
        ++launches;
      }
    }

    // 8'. Or the mixture of experts (docs/spec.md section 8): router + top-k, the experts each
    // selected expert's weights read once, the weighted sum; one fp32 TP reduce, then bf16.
    if (w.has_moe()) {
      MoeArgs a;
      a.x = TensorView::contiguous(h, DType::kBF16, {int64_t{rows}, H}, dev);
      a.router_weight = w.router_weight;
      a.router_bias = w.router_bias;
      a.experts = w.experts;
      a.shared = w.shared_expert;
      a.out = TensorView::contiguous(o32_.data(), DType::kF32, {int64_t{rows}, H}, dev);
      cuda::MoeParams p = cuda::moe_params(m.moe(tp_size_), a, moe_ws_.data());
      apply_moe_schedule(moe_schedule_, p);
      cuda::launch_moe(p, stream_);
      launches += cuda::moe_launches(p) + ffn_to_hidden(w.layer, h, rows);
    }

    // 8''. Or a dense layer's MLP (docs/spec.md section 8, "Dense MLP"): the shared-expert path of
    // the moe kernels with weight 1, one fp32 TP reduce, then bf16.
    if (w.dense_mlp.defined()) {
      DenseMlpArgs a;
      a.x = TensorView::contiguous(h, DType::kBF16, {int64_t{rows}, H}, dev);
      a.mlp = w.dense_mlp;
      a.out = TensorView::contiguous(o32_.data(), DType::kF32, {int64_t{rows}, H}, dev);
      a.activation_limit = m.activation_limit;
      cuda::launch_dense_mlp(cuda::dense_mlp_params(a, dense_ws_.data()), stream_);
      launches += 2 + ffn_to_hidden(w.layer, h, rows);
    }
    launches_ = launches;
  }

  // An FFN's fp32 partial in o32_: summed over the ranks (TP > 1), then hidden <- bf16. Returns
  // the launches.
  int64_t ffn_to_hidden(int layer, uint16_t* h, int rows) {
    const int64_t count = int64_t{rows} * config_.model.hidden;
    int64_t launches = 1;
    if (tp_size_ > 1) {
      all_reduce(o32_.as<float>(), count, 2 * layer + 1);
      ++launches;
    }
    cuda::launch_convert_f32_to_bf16(o32_.as<float>(), h, count, stream_);
    return launches;
  }

  Runtime::LayerTrace trace(int64_t rows) const override {
    const Device dev = Device::cuda(device_);
    Runtime::LayerTrace t;
    t.normed = TensorView::contiguous(normed_.data(), DType::kBF16,
                                      {rows, int64_t{config_.model.hidden}}, dev);
    t.qkv = TensorView::contiguous(qkv_.data(), DType::kBF16, {rows, sparse_.qkv_width()}, dev);
    t.q = q_view(rows);
    t.index_q = index_q_view(rows);
    t.topk = topk_view(rows);
    t.attn = attn_view(rows);
    return t;
  }

 private:
  void release_stream() {
    if (own_stream_) cudaStreamDestroy(own_stream_);
    own_stream_ = nullptr;
    if (side_) cudaStreamDestroy(side_);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    side_ = nullptr;
    fork_ = join_ = nullptr;
  }

  // The indexer beside the projection: one CTA per SM (its kernel takes any grid).
  cuda::IndexerPlan side_plan(const cuda::IndexerPlan& plan) const {
    cuda::IndexerPlan side = plan;
    side.grid = std::min(plan.grid, sm_count_);
    return side;
  }

  void free_buffers() {
    for (int i = 0; i < kStagingSlots; ++i) {
      if (staged_[i]) cudaEventDestroy(staged_[i]);
      staged_[i] = nullptr;
      staging_[i].reset();
    }
    cp_.reset();
    peer_ar_.reset();
    for (cuda::DeviceBuffer* b :
         {&meta_, &normed_, &qkv_, &q_, &index_q_, &topk_, &attn_, &o16_, &o32_, &mlp_gu_,
          &mlp_act_, &moe_ws_, &dense_ws_, &indexer_ws_, &attention_ws_}) {
      b->reset();
    }
  }

  void allocate(const std::vector<LayerWeights>& layers) {
    const ModelConfig& m = config_.model;
    max_reqs_ = config_.max_requests;
    max_rows_ = max_of(config_.token_buckets);
    max_blocks_ = blocks_for(config_.max_context, m.block_size);
    layout_ = meta_layout(max_reqs_, max_rows_, max_blocks_);
    meta_ = cuda::DeviceBuffer(layout_.total);
    CUDA_CHECK(cudaMemsetAsync(meta_.data(), 0, layout_.total, stream_));
    for (int i = 0; i < kStagingSlots; ++i) {
      staging_[i] = std::make_unique<PinnedBuffer>(layout_.total);
      CUDA_CHECK(cudaEventCreateWithFlags(&staged_[i], cudaEventDisableTiming));
    }

    const SparseConfig& sc = sparse_;
    const std::size_t rows = static_cast<std::size_t>(max_rows_);
    const std::size_t hidden = static_cast<std::size_t>(m.hidden);
    const std::size_t attn_width = static_cast<std::size_t>(sc.q_heads) * sc.head_dim;
    normed_ = cuda::DeviceBuffer(2 * rows * hidden);
    qkv_ = cuda::DeviceBuffer(2 * rows * static_cast<std::size_t>(sc.qkv_width()));
    q_ = cuda::DeviceBuffer(2 * rows * attn_width);
    index_q_ =
        cuda::DeviceBuffer(2 * rows * static_cast<std::size_t>(sc.index_heads) * sc.index_dim);
    topk_ = cuda::DeviceBuffer(4 * rows * static_cast<std::size_t>(sc.kv_heads) * sc.topk);
    attn_ = cuda::DeviceBuffer(2 * rows * attn_width);
    o16_ = cuda::DeviceBuffer(2 * rows * hidden);
    bool any_moe = false;
    bool any_dense = false;
    for (const LayerWeights& w : layers) {
      any_moe = any_moe || w.has_moe();
      any_dense = any_dense || w.dense_mlp.defined();
    }
    if (tp_size_ > 1 || any_moe || any_dense) o32_ = cuda::DeviceBuffer(4 * rows * hidden);
    if (any_moe) {
      moe_schedule_ = moe_schedule_from_env();
      moe_ws_ = cuda::DeviceBuffer(cuda::moe_workspace_bytes(m.moe(tp_size_), max_rows_));
      // Zero once before the first launch (moe.h): the persistent kernel's counters.
      CUDA_CHECK(cudaMemsetAsync(moe_ws_.data(), 0, moe_ws_.bytes(), stream_));
    }
    if (any_dense) {
      dense_ws_ = cuda::DeviceBuffer(
          cuda::dense_mlp_workspace_bytes(m.dense_intermediate / tp_size_, max_rows_));
    }
    bool any_mlp = false;
    for (const LayerWeights& w : layers) any_mlp = any_mlp || w.mlp_gate_up.defined();
    if (any_mlp) {
      const std::size_t inter = static_cast<std::size_t>(m.intermediate / tp_size_);
      mlp_gu_ = cuda::DeviceBuffer(2 * rows * 2 * inter);
      mlp_act_ = cuda::DeviceBuffer(2 * rows * inter);
    }

    limits_.max_reqs = max_reqs_;
    limits_.max_q_len = max_of(config_.query_lens);
    limits_.max_rows = std::max<int64_t>(max_rows_, int64_t{max_reqs_} * limits_.max_q_len);
    limits_.max_context = 0;          // the fused decode indexer's workspace does not depend on it
    if (!config_.context_parallel) {  // with CP the CP indexer (made by connect) selects
      indexer_plan_ = cuda::plan_indexer(sc, limits_, device_);
      side_indexer_plan_ = side_plan(indexer_plan_);
      indexer_ws_ = cuda::DeviceBuffer(indexer_plan_.workspace_bytes);
      cuda::init_indexer_workspace(indexer_plan_, indexer_ws_.data(), stream_);
    }
    const std::size_t attention_bytes = cuda::attention_workspace_size(sc, limits_);
    attention_ws_ = cuda::DeviceBuffer(attention_bytes);
    if (attention_bytes)
      CUDA_CHECK(cudaMemsetAsync(attention_ws_.data(), 0, attention_bytes, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  TensorView q_view(int64_t rows) const {
    return TensorView::contiguous(q_.data(), DType::kBF16,
                                  {rows, int64_t{sparse_.q_heads}, int64_t{sparse_.head_dim}},
                                  Device::cuda(device_));
  }
  TensorView index_q_view(int64_t rows) const {
    return TensorView::contiguous(index_q_.data(), DType::kBF16,
                                  {rows, int64_t{sparse_.index_heads}, int64_t{sparse_.index_dim}},
                                  Device::cuda(device_));
  }
  TensorView topk_view(int64_t rows) const {  // [rows, KV heads of this rank, k]
    return TensorView::contiguous(topk_.data(), DType::kI32,
                                  {rows, int64_t{sparse_.kv_heads}, int64_t{sparse_.topk}},
                                  Device::cuda(device_));
  }
  TensorView attn_view(int64_t rows) const {
    return TensorView::contiguous(attn_.data(), DType::kBF16,
                                  {rows, int64_t{sparse_.q_heads}, int64_t{sparse_.head_dim}},
                                  Device::cuda(device_));
  }

  void add_norm(const void* delta, bool delta_f32, uint16_t* residual, const TensorView& weight,
                uint16_t* out, int rows) {
    cuda::NormResidualParams p;
    p.delta = delta;
    p.residual = residual;
    p.weight = weight.ptr<const uint16_t>();
    p.out = out;
    p.rows = rows;
    p.n = config_.model.hidden;
    p.delta_f32 = delta_f32 ? 1 : 0;
    p.eps = config_.model.rms_eps;
    cuda::launch_norm_residual(p, stream_);
  }

  // out[:, first_col + j] = x . w[first_col + j, :] (* scale) for j < n, of a [*, k] weight
  // (deep: GemmSkinnyParams::deep). The K split (split_k8) follows from the weight's full row
  // count, so every column range of one projection reduces in the same order.
  void gemm(const uint16_t* x, int k, const TensorView& w, const TensorView& scale, void* out,
            int n, bool out_f32, int rows, int out_stride = 0, int first_col = 0,
            bool deep = false) {
    cuda::GemmSkinnyParams p;
    p.x = x;
    p.x_stride = k;
    p.w = static_cast<const uint8_t*>(w.data) +
          int64_t{first_col} * k * static_cast<int64_t>(dtype_size(w.dtype));
    p.scale = scale.defined() ? scale.ptr<const float>() + first_col : nullptr;
    p.out = static_cast<uint8_t*>(out) + int64_t{first_col} * (out_f32 ? 4 : 2);
    p.deep = deep ? 1 : 0;
    p.split_k8 = cuda::gemm_skinny_prefers_split_k8(static_cast<int>(w.shape[0])) ? 1 : 0;
    p.out_stride = out_stride > 0 ? out_stride : n;
    p.rows = rows;
    p.n = n;
    p.k = k;
    p.w_fp8 = w.dtype == DType::kFP8E4M3 ? 1 : 0;
    p.out_f32 = out_f32 ? 1 : 0;
    cuda::launch_gemm_skinny(p, stream_);
  }

  // call_id labels the call for the peer all-reduce's shape check (2 * layer + 0 | 1).
  void all_reduce(float* data, int64_t count, int call_id) {
    if (peer_ar_) {
      peer_ar_->run(data, count, call_id, stream_);
      return;
    }
    M3MSA_NCCL_CHECK(ncclAllReduce(data, data, static_cast<std::size_t>(count), ncclFloat32,
                                   ncclSum, static_cast<ncclComm_t>(nccl_), stream_));
  }

  RuntimeConfig config_;
  SparseConfig sparse_;
  int tp_size_ = 1;
  int device_ = 0;
  void* nccl_ = nullptr;  // ncclComm_t (TP > 1 on NCCL)
  bool use_peer_ar_ = false;
  std::unique_ptr<CudaCpIndexer> cp_;       // context_parallel
  std::unique_ptr<PeerAllReduce> peer_ar_;  // TP > 1 on peer stores
  cudaStream_t stream_ = nullptr;
  cudaStream_t own_stream_ = nullptr;
  int max_reqs_ = 0;
  int max_rows_ = 0;
  int64_t max_blocks_ = 0;
  int64_t launches_ = 0;
  int sm_count_ = 0;
  // The fused indexer may run beside the q/k/v projection (RuntimeConfig::indexer_overlap not
  // kOff, no CP: the side stream exists); kAuto decides per step by q_len.
  bool overlap_ = false;
  cudaStream_t side_ = nullptr;  // high priority: the indexer
  cudaEvent_t fork_ = nullptr;   // index_q and the index-K insert done (main -> side)
  cudaEvent_t join_ = nullptr;   // the selection ready (side -> main, before attention)

  MetaLayout layout_;
  cuda::DeviceBuffer meta_;
  std::unique_ptr<PinnedBuffer> staging_[kStagingSlots];
  cudaEvent_t staged_[kStagingSlots] = {};
  int next_slot_ = 0;

  cuda::DeviceBuffer normed_, qkv_, q_, index_q_, topk_, attn_, o16_, o32_, mlp_gu_, mlp_act_;
  cuda::DeviceBuffer moe_ws_;  // the moe family's workspace (layers with experts)
  MoeSchedule moe_schedule_ = MoeSchedule::kLaunches;  // M3MSA_MOE_SCHEDULE, read at allocation
  cuda::DeviceBuffer dense_ws_;  // the dense MLP's activations (the dense layers)
  PlanLimits limits_;
  cuda::IndexerPlan indexer_plan_;
  cuda::IndexerPlan side_indexer_plan_;  // overlap_: one CTA per SM (beside the projection)
  cuda::DeviceBuffer indexer_ws_;
  cuda::DeviceBuffer attention_ws_;
};

}  // namespace

bool stream_is_capturing(void* stream) {
  if (stream == nullptr) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

void check_gpu_support(const RuntimeConfig& config, int tp_size, Communicator& comm,
                       const std::vector<LayerWeights>& layers, Device device, Problems& problems) {
  const int count = cuda_device_count();
  if (device.index < 0 || device.index >= count) {
    problems.error(ErrorCode::kInvalidArgument, "the tensors are on " + device_name(device) +
                                                    " but " + std::to_string(count) +
                                                    " CUDA device(s) are visible");
    return;
  }
  const ModelConfig& m = config.model;
  const SparseConfig sc = m.sparse(tp_size, config.context_parallel);
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) problems.unsupported("CUDA backend: " + what);
  };
  if (config.context_parallel) {
    need(config.cp_transport == CpTransport::kPeer || config.cp_transport == CpTransport::kNccl,
         std::string("the runtime's CP exchange is peer or nccl, got cp_transport ") +
             cp_transport_name(config.cp_transport));
  }
  need(sc.head_dim == 128, "head_dim must be 128, got " + std::to_string(sc.head_dim));
  need(sc.block_size == 128, "block_size must be 128, got " + std::to_string(sc.block_size));
  need(sc.index_dim == 128, "index_dim must be 128, got " + std::to_string(sc.index_dim));
  need(sc.group_size() <= 16,
       "at most 16 query heads per KV head, got " + std::to_string(sc.group_size()));
  need(sc.topk <= 32, "topk must be <= 32, got " + std::to_string(sc.topk));
  need(sc.rope_dim <= 128, "rope_dim must be <= 128, got " + std::to_string(sc.rope_dim));
  need(sc.index_heads <= 32,
       "index heads per rank must be <= 32, got " + std::to_string(sc.index_heads));
  const int max_bucket = max_of(config.token_buckets);
  need(max_bucket <= cuda::kSkinnyMaxRows,
       "token buckets must be <= " + std::to_string(cuda::kSkinnyMaxRows) + " rows (decode), got " +
           std::to_string(max_bucket));
  const int max_q = max_of(config.query_lens);
  need(max_q * sc.index_heads <= 32, "max query length (" + std::to_string(max_q) +
                                         ") * index heads per rank (" +
                                         std::to_string(sc.index_heads) + ") must be <= 32");
  need(m.hidden % cuda::kSkinnyKAlign == 0,
       "hidden must be a multiple of 64, got " + std::to_string(m.hidden));
  need((sc.q_heads * sc.head_dim) % cuda::kSkinnyKAlign == 0,
       "q_heads * head_dim per rank must be a multiple of 64");
  bool any_mlp = false;
  for (const LayerWeights& w : layers) any_mlp = any_mlp || w.mlp_gate_up.defined();
  if (any_mlp) {
    need((m.intermediate / tp_size) % cuda::kSkinnyKAlign == 0,
         "the MLP width per rank must be a multiple of 64, got " +
             std::to_string(m.intermediate / tp_size));
  }
  bool any_moe = false;
  for (const LayerWeights& w : layers) any_moe = any_moe || w.has_moe();
  if (any_moe) {
    // The moe family's limits (src/cuda/moe.h); the binding stage checked the shapes.
    const MoeConfig mc = m.moe(tp_size);
    need(max_bucket <= cuda::kMoeMaxRows,
         "the mixture of experts takes token buckets of <= " + std::to_string(cuda::kMoeMaxRows) +
             " rows, got " + std::to_string(max_bucket));
    need(mc.experts_per_token <= cuda::kMoeMaxTopk,
         "experts_per_token must be <= " + std::to_string(cuda::kMoeMaxTopk) + ", got " +
             std::to_string(mc.experts_per_token));
    need(mc.num_experts <= cuda::kMoeMaxExperts,
         "num_experts must be <= " + std::to_string(cuda::kMoeMaxExperts));
    need(mc.intermediate % 8 == 0 && mc.shared_intermediate % 8 == 0 && mc.hidden % 8 == 0,
         "the expert intermediate per rank must be a multiple of 8, got " +
             std::to_string(mc.intermediate));
    for (const LayerWeights& w : layers) {
      if (!w.has_moe()) continue;
      need(mc.shared_intermediate == 0 || w.shared_expert.w13.dtype == w.experts.w13.dtype,
           "layer " + std::to_string(w.layer) +
               ": the shared and the routed experts must share one format (bf16 or MXFP8)");
      for (const auto& [view, name] : {std::pair{&w.experts.w13, "experts.w13"},
                                       {&w.experts.w2, "experts.w2"},
                                       {&w.shared_expert.w13, "shared_expert.w13"},
                                       {&w.shared_expert.w2, "shared_expert.w2"}}) {
        need(!view->defined() || reinterpret_cast<uintptr_t>(view->data) % 16 == 0,
             "layer " + std::to_string(w.layer) + " " + name + " must be 16-byte aligned");
      }
    }
  }
  bool any_dense = false;
  for (const LayerWeights& w : layers) any_dense = any_dense || w.dense_mlp.defined();
  if (any_dense) {
    // The dense MLP runs on the moe family's kernels (src/cuda/moe.h); the binding stage checked
    // the shapes.
    const int width = m.dense_intermediate / tp_size;
    need(max_bucket <= cuda::kMoeMaxRows,
         "the dense MLP takes token buckets of <= " + std::to_string(cuda::kMoeMaxRows) +
             " rows, got " + std::to_string(max_bucket));
    need(width % 8 == 0,
         "the dense MLP width per rank must be a multiple of 8, got " + std::to_string(width));
    for (const LayerWeights& w : layers) {
      for (const auto& [view, name] :
           {std::pair{&w.dense_mlp.w13, "dense_mlp.w13"}, {&w.dense_mlp.w2, "dense_mlp.w2"}}) {
        need(!view->defined() || reinterpret_cast<uintptr_t>(view->data) % 16 == 0,
             "layer " + std::to_string(w.layer) + " " + name + " must be 16-byte aligned");
      }
    }
  }
  // Whether NCCL or peer stores can carry the TP all-reduce and the CP exchange is agreed by
  // connect(), which knows every rank's placement.
  if (tp_size > 1) {
    auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
    if (nccl != nullptr && nccl->device() != device.index) {
      problems.error(ErrorCode::kInvalidArgument,
                     "the NCCL communicator of rank " + std::to_string(comm.rank()) +
                         " is on cuda:" + std::to_string(nccl->device()) +
                         ", the bound tensors on " + device_name(device));
    }
  }
  // Alignment of what the kernels read with 16-byte loads.
  for (const LayerWeights& w : layers) {
    for (const auto& [view, name] : {std::pair{&w.qkv_proj, "qkv_proj"},
                                     {&w.o_proj, "o_proj"},
                                     {&w.input_norm, "input_norm"},
                                     {&w.post_attention_norm, "post_attention_norm"},
                                     {&w.mlp_gate_up, "mlp_gate_up"},
                                     {&w.mlp_down, "mlp_down"},
                                     {&w.index_cache.data, "index_cache"}}) {
      if (view->defined() && reinterpret_cast<uintptr_t>(view->data) % 16 != 0) {
        problems.unsupported("CUDA backend: layer " + std::to_string(w.layer) + " " + name +
                             " must be 16-byte aligned, found address " +
                             std::to_string(reinterpret_cast<uintptr_t>(view->data)));
      }
    }
  }
}

std::unique_ptr<GpuEngine> make_gpu_engine(const RuntimeConfig& config, int tp_size,
                                           Communicator& comm,
                                           const std::vector<LayerWeights>& layers, Device device) {
  return std::make_unique<GpuEngineImpl>(config, tp_size, comm, layers, device);
}

#else  // no CUDA

bool stream_is_capturing(void*) {
  return false;
}

void check_gpu_support(const RuntimeConfig&, int, Communicator&, const std::vector<LayerWeights>&,
                       Device device, Problems& problems) {
  problems.unsupported("the tensors are on " + device_name(device) +
                       " but this build has no CUDA backend");
}

std::unique_ptr<GpuEngine> make_gpu_engine(const RuntimeConfig&, int, Communicator&,
                                           const std::vector<LayerWeights>&, Device device) {
  M3MSA_THROW(ErrorCode::kUnsupported, "the tensors are on ", device_name(device),
              " but this build has no CUDA backend");
}

#endif

}  // namespace m3msa::runtime_detail
