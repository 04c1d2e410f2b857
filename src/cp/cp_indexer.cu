// Host side of the CUDA CP indexer (include/m3msa/cp_cuda.h; kernels in cp_exchange_kernel.cuh,
// launched through cp_exchange.h): the collective setup (host agreement, buffer sets), the launch
// sequence of each transport and the turning of a device error record into Error(kTimeout)
// naming the rank.
//
// Buffer sets (docs/context_parallel.md): one per (communicator, device, transport, key), created
// on first use by a collective step and shared by every indexer (layer) with that key. A peer set
// owns this rank's candidate buffer [2][P][merged][max_rows][k] u64 (zeroed once, never cleared)
// and the addresses of every peer's: one PeerMemory allocation (src/comm/peer_memory.h: peer access
// when all ranks are threads of one process, CUDA IPC handles otherwise). Addresses stay fixed for
// the set's life, so captured graphs keep addressing the same slots. Each rank's buffer also holds
// the tagged call words [2][P][merged][max_rows] after the candidates (cp_exchange_kernel.cuh "Call
// words").
//
// Lifetime across processes: an exporter must not free a buffer another process still maps, so
// the last indexer of a set closes its IPC mappings, meets the other ranks (host all-gather,
// bounded) and only then frees (PeerMemory's destructor). A failed set (a timeout, a mismatch)
// frees nothing: a peer out of lockstep may still store into it, and a dead peer cannot meet.
//
// Host waits: check() polls the stream against CudaCpConfig::host_timeout (never an unbounded
// cudaStreamSynchronize: a stream holding an NCCL collective whose peer never joins would never
// finish), then aborts the NCCL communicator of the NCCL transports.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "comm/call_digest.h"
#include "comm/nccl_check.h"
#include "comm/peer_memory.h"
#include "cp/cp_exchange.h"
#include "cp/cp_exchange_params.h"
#include "cuda/common.cuh"
#include "cuda/indexer.h"
#include "cuda/indexer_kernel.cuh"
#include "cuda/indexer_params.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/error.h"

namespace m3msa {

namespace {

using cuda::DeviceBuffer;
using cuda::DeviceGuard;
using cuda::narrow_int;

using Clock = std::chrono::steady_clock;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// M3MSA_CP_DEBUG=1: the diagnostics of cp_cuda.h ("M3MSA_CP_DEBUG").
bool cp_debug() {
  static const bool on = [] {
    const char* v = std::getenv("M3MSA_CP_DEBUG");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// FNV-1a over the call's shape: what every rank must pass identically for one call.
uint32_t call_digest(int layer, const IndexerArgs& args) {
  return call_digest_of(
      {layer, args.batch.num_reqs, args.batch.q_len,
       args.batch.index_block_table.defined() ? args.batch.index_block_table.shape[1] : -1,
       static_cast<int64_t>(args.index_cache.data.dtype)});
}

std::string describe_word(uint64_t word) {
  char text[96];
  std::snprintf(text, sizeof(text), "digest 0x%08x, num_reqs %u, q_len %u",
                static_cast<unsigned>(word >> 32), static_cast<unsigned>((word >> 8) & 0xFFFFu),
                static_cast<unsigned>(word & 0xFFu));
  return text;
}

// What every rank must agree on before the setup shares anything.
struct AgreedShape {
  int64_t world_size, index_heads, merged_heads, max_rows, topk, max_reqs, max_q_len, max_context,
      transport, init_blocks, local_blocks;
  auto tie() const {
    return std::tie(world_size, index_heads, merged_heads, max_rows, topk, max_reqs, max_q_len,
                    max_context, transport, init_blocks, local_blocks);
  }
  bool operator==(const AgreedShape& o) const { return tie() == o.tie(); }
  std::string to_string() const {
    return detail::concat("(world_size=", world_size, ", index_heads=", index_heads,
                          ", merged_heads=", merged_heads, ", max_rows=", max_rows, ", topk=", topk,
                          ", max_reqs=", max_reqs, ", max_q_len=", max_q_len,
                          ", max_context=", max_context,
                          ", transport=", cp_transport_name(static_cast<CpTransport>(transport)),
                          ", init_blocks=", init_blocks, ", local_blocks=", local_blocks, ")");
  }
  ByteRecord record() const {
    RecordWriter w;
    w.i64(world_size).i64(index_heads).i64(merged_heads).i64(max_rows).i64(topk).i64(max_reqs);
    w.i64(max_q_len).i64(max_context).i64(transport).i64(init_blocks).i64(local_blocks);
    return w.take();
  }
  static AgreedShape parse(const ByteRecord& bytes) {
    RecordReader r(bytes, "CP setup record");
    AgreedShape s{};
    s.world_size = r.i64();
    s.index_heads = r.i64();
    s.merged_heads = r.i64();
    s.max_rows = r.i64();
    s.topk = r.i64();
    s.max_reqs = r.i64();
    s.max_q_len = r.i64();
    s.max_context = r.i64();
    s.transport = r.i64();
    s.init_blocks = r.i64();
    s.local_blocks = r.i64();
    return s;
  }
};

// One buffer set (see the file comment). The peer transport's candidate buffers are a
// PeerMemory (src/comm/peer_memory.h), which owns their mapping and the release protocol.
struct BufferSet {
  CpBufferKey key;
  CpTransport transport = CpTransport::kPeer;
  int device = 0;
  Communicator* comm = nullptr;  // outlives the set (cp_cuda.h)
  // peer: this rank's [2][P][merged][max_rows][k] u64 candidates, then the call words
  std::unique_ptr<PeerMemory> memory;
  std::size_t candidate_bytes = 0;
  std::size_t word_bytes = 0;    // [2][P][merged][max_rows] u64
  void* control = nullptr;       // cuda::cp_exchange::CpExchangeControl
  std::vector<uint64_t*> peers;  // by rank: candidate buffers (own included)
  // Set by the first check() that finds a fault; every indexer on the set refuses calls after it.
  std::atomic<bool> failed{false};

  ~BufferSet() {
    if (failed.load()) {
      if (memory) memory->mark_failed();
      if (cp_debug()) {
        std::fprintf(stderr, "m3msa cp[rank %d]: failed buffer set %s left allocated (%zu bytes)\n",
                     comm ? comm->rank() : -1, key.to_string().c_str(),
                     candidate_bytes + word_bytes);
      }
      memory.reset();  // failed: frees nothing
      return;  // the control block stays allocated too: a kernel of this rank may address it
    }
    // Synchronizes the device, closes the IPC mappings and, across processes, meets the other
    // ranks before freeing (PeerMemory's destructor).
    memory.reset();
    if (control) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      cudaDeviceSynchronize();
      cudaFree(control);
      cudaSetDevice(previous);
    }
  }
  bool by_ipc() const { return memory && memory->mapped_by_ipc(); }
  cuda::cp_exchange::CpExchangeControl* ctl() const {
    return static_cast<cuda::cp_exchange::CpExchangeControl*>(control);
  }
};

struct RegistryKey {
  const void* comm;
  int device, transport, world_size, merged_heads, max_rows, topk;
  auto tie() const {
    return std::tie(comm, device, transport, world_size, merged_heads, max_rows, topk);
  }
  bool operator<(const RegistryKey& o) const { return tie() < o.tie(); }
};

std::mutex g_registry_mutex;  // guards the registry
std::map<RegistryKey, std::weak_ptr<BufferSet>>& registry() {
  static std::map<RegistryKey, std::weak_ptr<BufferSet>> sets;
  return sets;
}

// Creates a buffer set: a collective step over `comm` for the peer transport (every rank
// allocates, then the addresses / IPC handles travel through the communicator).
std::shared_ptr<BufferSet> create_set(Communicator& comm, int device, CpTransport transport,
                                      const CpBufferKey& key) {
  auto set = std::make_shared<BufferSet>();
  set->key = key;
  set->transport = transport;
  set->device = device;
  set->comm = &comm;
  DeviceGuard guard(device);
  CUDA_CHECK(cudaMalloc(&set->control, sizeof(cuda::cp_exchange::CpExchangeControl)));
  CUDA_CHECK(cudaMemset(set->control, 0, sizeof(cuda::cp_exchange::CpExchangeControl)));
  CUDA_CHECK(cudaDeviceSynchronize());
  if (transport != CpTransport::kPeer) return set;

  // A set that fails half-made is left as it is (its destructor would wait for ranks that may
  // never meet it).
  try {
    set->candidate_bytes = key.bytes_per_rank();
    set->word_bytes =
        std::size_t{2} * key.world_size * key.merged_heads * key.max_rows * sizeof(uint64_t);
    const std::size_t bytes = set->candidate_bytes + set->word_bytes;
    // Zeroed once (tag 0 is never expected) before any rank may store into it.
    set->memory = std::make_unique<PeerMemory>(comm, device, bytes, "cp");
    const int P = comm.world_size();
    set->peers.resize(static_cast<std::size_t>(P));
    for (int r = 0; r < P; ++r) {
      set->peers[static_cast<std::size_t>(r)] = static_cast<uint64_t*>(set->memory->peer(r));
    }
    if (comm.rank() == 0 || cp_debug()) {
      std::fprintf(stderr, "m3msa cp: buffer set %s (%s): %zu bytes per rank, mapped by %s\n",
                   key.to_string().c_str(), cp_transport_name(transport), bytes,
                   set->by_ipc() ? "CUDA IPC" : "peer access");
    }
  } catch (const Error& error) {
    set->failed.store(true);
    if (error.code() == ErrorCode::kUnsupported) {
      throw Error(ErrorCode::kUnsupported,
                  detail::concat("CP peer transport: ", error.message(), "; use transport nccl"),
                  __FILE__, __LINE__, error.rank());
    }
    throw;
  } catch (...) {
    set->failed.store(true);
    throw;
  }
  return set;
}

}  // namespace

struct CudaCpIndexer::Impl {
  Communicator* comm = nullptr;
  NcclCommunicator* nccl = nullptr;
  int rank = 0;
  int device = 0;
  SparseConfig config;
  CudaCpConfig cp;
  std::vector<int> heads;
  int max_rows = 0;
  int64_t max_cols = 0;    // global table columns the plan serves
  int64_t local_cols = 0;  // shard table / score columns
  std::shared_ptr<BufferSet> set;
  std::optional<CpTimeoutRecord> timeout;
  std::optional<CudaCpFault> fault;
  int last_layer = -1;      // of the last call queued (for messages)
  uint64_t host_calls = 0;  // calls queued by this indexer (for the debug log)
  int grid_sm = 0;
  // Peer: nominate and merge in one launch (M3MSA_CP_SPLIT_EXCHANGE=1: two launches, to compare).
  bool fused_exchange = true;
  // Shard scoring on the split kernel (M3MSA_CP_SPAN_SCORING=1: the span kernel, to compare).
  bool split_scoring = true;

  DeviceBuffer local_seq_lens, local_table, scores, full_scores, send, recv, full_topk;
  cuda::IndexerPlan plan;  // replicated: the one-GPU indexer
  DeviceBuffer plan_workspace;

  cuda::cp_exchange::CpExchangeParams params(int layer, const IndexerArgs& args) const;
  void check_args(const IndexerArgs& args) const;
  [[noreturn]] void fail(ErrorCode code, const CudaCpFault& fault, const std::string& message);
  std::string read_control_for_diagnosis() const;
  void launch_score(const IndexerArgs& args, cudaStream_t stream);
  void launch_exchange(int layer, const IndexerArgs& args, cudaStream_t stream);
};

cuda::cp_exchange::CpExchangeParams CudaCpIndexer::Impl::params(int layer,
                                                                const IndexerArgs& args) const {
  cuda::cp_exchange::CpExchangeParams p;
  p.layer = layer;
  p.call_word = cuda::cp_exchange::call_word_of(call_digest(layer, args), args.batch.num_reqs,
                                                args.batch.q_len);
  const BatchMeta& batch = args.batch;
  p.seq_lens = batch.seq_lens.ptr<const int32_t>();
  p.block_table = batch.index_block_table.ptr<const int32_t>();
  p.table_cols = batch.index_block_table.shape[1];
  p.num_reqs = batch.num_reqs;
  p.q_len = batch.q_len;
  p.live_rows = static_cast<int>(batch.num_rows());
  p.max_rows = max_rows;
  p.rank = rank;
  p.world = cp.world_size;
  p.heads = config.index_heads;
  p.merged = static_cast<int>(heads.size());
  p.head0 = heads.front();
  p.topk = config.topk;
  p.init_blocks = config.init_blocks;
  p.local_blocks = config.local_blocks;
  p.local_seq_lens = local_seq_lens.as<int32_t>();
  p.local_table = local_table.as<int32_t>();
  p.scores = scores.as<float>();
  p.local_cols = local_cols;
  p.control = set->ctl();
  p.topk_idx = args.topk_idx.ptr<int32_t>();
  p.budget_ns = static_cast<uint64_t>(cp.spin_budget.count()) * 1000u;
  p.full_scores = full_scores.as<float>();
  p.full_cols = max_cols;
  const int64_t k = config.topk;
  if (cp.transport == CpTransport::kPeer) {
    for (int r = 0; r < cp.world_size; ++r) p.dest[r] = set->peers[static_cast<std::size_t>(r)];
    p.cand = set->peers[static_cast<std::size_t>(rank)];
    p.head_stride = int64_t{max_rows} * k;
    p.source_stride = p.head_stride * static_cast<int64_t>(heads.size());
    p.parity_stride = p.source_stride * cp.world_size;
    p.cand_head_base = 0;
    // Call words [2][P][merged][max_rows] after the candidates [2][P][merged][max_rows][k].
    p.word_offset = 2 * p.parity_stride;
    p.word_source_stride = int64_t{max_rows} * static_cast<int64_t>(heads.size());
    p.word_parity_stride = p.word_source_stride * cp.world_size;
  } else if (cp.transport == CpTransport::kNccl) {
    // One source's block: [H][max_rows][k] keys, then [H][max_rows] call words.
    p.dest[0] = send.as<uint64_t>();
    p.dest_local = 1;
    p.cand = recv.as<uint64_t>();
    p.head_stride = int64_t{max_rows} * k;
    p.source_stride = int64_t{max_rows} * (k + 1) * config.index_heads;
    p.parity_stride = 0;
    p.cand_head_base = heads.front();
    p.word_offset = p.head_stride * config.index_heads;
    p.word_source_stride = p.source_stride;
    p.word_parity_stride = 0;
  }
  return p;
}

void CudaCpIndexer::Impl::check_args(const IndexerArgs& args) const {
  M3MSA_CHECK_ARG(!set->failed.load(), "CP rank ", rank,
                  ": an earlier call failed and the ranks are out of lockstep; rebuild the group");
  M3MSA_CHECK_ARG(nccl == nullptr || !nccl->broken(), "CP rank ", rank, ": its ", nccl->name(),
                  " is broken by an earlier failure; rebuild the group");
  const BatchMeta& batch = args.batch;
  M3MSA_CHECK_SUPPORTED(batch.kind == BatchKind::kDecode, "CUDA CP indexer: decode only");
  M3MSA_CHECK_ARG(batch.num_reqs >= 0 && batch.num_reqs <= cp.max_reqs,
                  "CP: batch.num_reqs = ", batch.num_reqs,
                  " outside [0, CudaCpConfig.max_reqs = ", cp.max_reqs, "]");
  M3MSA_CHECK_ARG(batch.q_len >= 1 && batch.q_len <= cp.max_q_len,
                  "CP: batch.q_len = ", batch.q_len,
                  " outside [1, CudaCpConfig.max_q_len = ", cp.max_q_len, "]");
  const int64_t rows = batch.num_rows();
  M3MSA_CHECK_SUPPORTED(args.selection.is_default(),
                        "CP indexer: the selection is written token-major in descending key order "
                        "only, got order ",
                        selection_order_name(args.selection.order), ", major ",
                        selection_major_name(args.selection.major));
  check_tensor(args.topk_idx, "topk_idx", DType::kI32,
               {rows, static_cast<int64_t>(heads.size()), config.topk});
  check_device(args.topk_idx, "topk_idx", Device::cuda(device));
  IndexerArgs full = args;
  full.topk_idx = TensorView::contiguous(
      full_topk.data(), DType::kI32, {rows, config.index_heads, config.topk}, Device::cuda(device));
  validate(config, full, Device::cuda(device));
  cuda::check_indexer_args_supported(full);
  M3MSA_CHECK_ARG(batch.index_block_table.defined(), "batch.index_block_table is required");
  M3MSA_CHECK_ARG(batch.index_block_table.shape[1] <= max_cols, "CP: index_block_table has ",
                  batch.index_block_table.shape[1],
                  " columns, more than CudaCpConfig.max_context (", cp.max_context,
                  " tokens = ", max_cols, " blocks) allows");
}

void CudaCpIndexer::Impl::launch_score(const IndexerArgs& args, cudaStream_t stream) {
  DeviceGuard guard(device);
  const BatchMeta& batch = args.batch;
  if (cp.transport == CpTransport::kReplicated) {
    if (batch.num_reqs == 0) return;
    IndexerArgs full = args;
    full.topk_idx = TensorView::contiguous(full_topk.data(), DType::kI32,
                                           {batch.num_rows(), config.index_heads, config.topk},
                                           Device::cuda(device));
    // plan_indexer() sets the scoring kernels' dynamic shared memory limit to its own plan's
    // need, so any smaller plan made since on this device (another layer, a test's one-GPU
    // reference) may have lowered it under ours: re-apply ours. Not while capturing (the limit is
    // read at capture time, and a graph keeps what it captured).
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing == cudaStreamCaptureStatusNone) {
      (void)cuda::plan_indexer(plan.config, plan.limits, device);
    }
    cuda::launch_indexer(plan, config, full, IndexerVariant::kFused, plan_workspace.data(), stream);
    return;
  }
  cuda::cp_exchange::CpExchangeParams p = params(-1, args);
  cuda::launch_cp_exchange_shard_tables(p, cp.max_reqs, stream);
  if (batch.num_reqs == 0) return;
  cuda::IndexerParams s;
  s.index_q = args.index_q.data;
  s.index_cache = args.index_cache.data.data;
  s.block_table = local_table.as<const int32_t>();
  s.seq_lens = local_seq_lens.as<const int32_t>();
  s.scores = scores.as<float>();
  s.status = &set->ctl()->status;
  s.num_pages = args.index_cache.pages();
  s.page_bytes = args.index_cache.data.strides[0] *
                 static_cast<int64_t>(dtype_size(args.index_cache.data.dtype));
  s.table_cols = local_cols;
  s.num_rows = batch.num_rows();
  s.score_cols = local_cols;
  s.num_reqs = batch.num_reqs;
  s.q_len = batch.q_len;
  s.heads = config.index_heads;
  s.topk = config.topk;
  s.init_blocks = config.init_blocks;
  s.local_blocks = config.local_blocks;
  s.unit_vectors = batch.q_len * config.index_heads;
  s.max_units = cp.max_reqs;
  s.is_prefill = 0;
  const bool fp8 = args.index_cache.data.dtype == DType::kFP8E4M3;
  const bool q8 = args.index_q.dtype == DType::kFP8E4M3;
  const int tiles = s.unit_vectors <= 8 ? 1 : s.unit_vectors <= 16 ? 2 : 4;
  if (split_scoring && batch.num_reqs <= 65535) {  // grid.y limit
    // Every request's shard gets an equal share of the CTAs (the grid depends on num_reqs only).
    const int splits = std::max(1, grid_sm / batch.num_reqs);
    s.scores_only = 1;
    s.split_ctas = splits;
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(batch.num_reqs));
    cuda::split_indexer_kernel(
        fp8, q8,
        tiles)<<<grid, cuda::indexer::kThreads, cuda::indexer::kSplitRingBytes, stream>>>(s);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const std::size_t smem = cuda::span_indexer_smem_bytes(cp.max_reqs);
  cuda::span_indexer_kernel(
      fp8, q8, tiles, /*scores_only=*/true)<<<grid_sm, cuda::indexer::kThreads, smem, stream>>>(s);
  CUDA_CHECK_LAUNCH();
}

void CudaCpIndexer::Impl::launch_exchange(int layer, const IndexerArgs& args, cudaStream_t stream) {
  DeviceGuard guard(device);
  const int merged = static_cast<int>(heads.size());
  const int H = config.index_heads;
  last_layer = layer;
  ++host_calls;
  if (cp.transport == CpTransport::kReplicated) {
    cuda::launch_cp_exchange_gather_heads(
        full_topk.as<const int32_t>(), args.topk_idx.ptr<int32_t>(),
        static_cast<int>(args.batch.num_rows()), H, merged, heads.front(), config.topk, stream);
    return;
  }
  const cuda::cp_exchange::CpExchangeParams p = params(layer, args);
  if (cp_debug()) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    std::fprintf(stderr,
                 "m3msa cp[rank %d]: %s call %llu layer %d (%s): num_reqs %d q_len %d table_cols "
                 "%lld, call word %016llx\n",
                 rank, cp_transport_name(cp.transport), static_cast<unsigned long long>(host_calls),
                 layer, capturing == cudaStreamCaptureStatusNone ? "eager" : "captured",
                 args.batch.num_reqs, args.batch.q_len, static_cast<long long>(p.table_cols),
                 static_cast<unsigned long long>(p.call_word));
  }
  if (cp.transport == CpTransport::kAllReduceMax) {
    cuda::launch_cp_exchange_scatter_scores(p, stream);
    // The scores, then the [P][2] digest slots after them (cp_exchange_kernel.cuh).
    const std::size_t count = static_cast<std::size_t>(max_rows) * H * max_cols +
                              2 * static_cast<std::size_t>(cp.world_size);
    M3MSA_NCCL_CHECK(ncclAllReduce(full_scores.data(), full_scores.data(), count, ncclFloat32,
                                   ncclMax, static_cast<ncclComm_t>(nccl->nccl_comm()), stream));
    cuda::launch_cp_exchange_select_full(p, stream);
  } else if (cp.transport == CpTransport::kPeer && fused_exchange) {
    cuda::launch_cp_exchange_fused(p, stream);
  } else {
    cuda::launch_cp_exchange_nominate(p, stream);
    if (cp.transport == CpTransport::kNccl) {
      M3MSA_NCCL_CHECK(ncclAllGather(
          send.data(), recv.data(), static_cast<std::size_t>(H) * max_rows * (config.topk + 1),
          ncclUint64, static_cast<ncclComm_t>(nccl->nccl_comm()), stream));
    }
    cuda::launch_cp_exchange_merge(p, stream);
  }
  if (cp_debug()) cuda::launch_cp_exchange_debug(p, static_cast<int>(cp.transport), stream);
}

CudaCpIndexer::CudaCpIndexer(Communicator& comm, int device, const SparseConfig& config,
                             const CudaCpConfig& cp)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  const int rank = comm.rank();
  try {
    config.validate();
    cuda::check_indexer_supported(config);
    M3MSA_CHECK_ARG(cp.world_size == comm.world_size(), "CudaCpConfig.world_size (", cp.world_size,
                    ") differs from the communicator's (", comm.world_size(), ")");
    M3MSA_CHECK_SUPPORTED(cp.world_size <= cuda::cp_exchange::kMaxWorld, "CUDA CP: world size ",
                          cp.world_size, " > ", cuda::cp_exchange::kMaxWorld);
    M3MSA_CHECK_ARG(cp.max_reqs >= 1, "CudaCpConfig.max_reqs must be >= 1, got ", cp.max_reqs);
    M3MSA_CHECK_ARG(cp.max_q_len >= 1 && cp.max_q_len <= kMaxQueryLen,
                    "CudaCpConfig.max_q_len must be in [1, ", kMaxQueryLen, "], got ",
                    cp.max_q_len);
    M3MSA_CHECK_ARG(cp.max_context >= 1, "CudaCpConfig.max_context must be >= 1, got ",
                    cp.max_context);
    M3MSA_CHECK_ARG(cp.spin_budget.count() > 0, "CudaCpConfig.spin_budget must be > 0 us");
    M3MSA_CHECK_ARG(cp.host_timeout.count() > 0, "CudaCpConfig.host_timeout must be > 0 ms");
    M3MSA_CHECK_SUPPORTED(
        cp.max_q_len * config.index_heads <= cuda::indexer::kMaxVectors,
        "CUDA CP: max_q_len * index_heads must be <= ", cuda::indexer::kMaxVectors);
    // The shard tables rely on every scored block being fully visible (cp_exchange_kernel.cuh).
    M3MSA_CHECK_SUPPORTED(cp.transport == CpTransport::kReplicated || config.local_blocks >= 1,
                          "CUDA CP: local_blocks must be >= 1 for the sharded transports, got ",
                          config.local_blocks);
    validate_cp_placement(cp.world_size, config.index_heads);
    if (cp.transport == CpTransport::kNccl || cp.transport == CpTransport::kAllReduceMax) {
      m.nccl = dynamic_cast<NcclCommunicator*>(&comm);
      M3MSA_CHECK_ARG(m.nccl != nullptr, "CP transport ", cp_transport_name(cp.transport),
                      " needs an NcclCommunicator, got ", comm.name());
      M3MSA_CHECK_ARG(m.nccl->device() == device, "CP: the NCCL communicator is on device ",
                      m.nccl->device(), ", the indexer on device ", device);
    }
    m.comm = &comm;
    const char* split = std::getenv("M3MSA_CP_SPLIT_EXCHANGE");
    m.fused_exchange = split == nullptr || std::string(split) != "1";
    const char* span = std::getenv("M3MSA_CP_SPAN_SCORING");
    m.split_scoring = span == nullptr || std::string(span) != "1";
    m.rank = rank;
    m.device = device;
    m.config = config;
    m.cp = cp;
    m.heads = cp_merged_heads(cp.world_size, config.index_heads, rank);
    m.max_rows = narrow_int(int64_t{cp.max_reqs} * cp.max_q_len, "CP max_rows");
    m.max_cols = ceil_div(cp.max_context, config.block_size);
    m.local_cols = ceil_div(m.max_cols, cp.world_size) + 1;

    // Host agreement: every rank posts its shape; any difference is an error on every rank.
    const AgreedShape shape{
        cp.world_size,      config.index_heads, static_cast<int64_t>(m.heads.size()),
        m.max_rows,         config.topk,        cp.max_reqs,
        cp.max_q_len,       cp.max_context,     static_cast<int64_t>(cp.transport),
        config.init_blocks, config.local_blocks};
    const std::vector<ByteRecord> posts = comm.all_gather(shape.record(), "cp/setup");
    for (int r = 0; r < cp.world_size; ++r) {
      const AgreedShape other = AgreedShape::parse(posts[static_cast<std::size_t>(r)]);
      M3MSA_CHECK_ARG(other == shape, "CP setup: rank ", r, " asked for ", other.to_string(),
                      " but this rank asked for ", shape.to_string(),
                      "; every rank must build its CP indexer with the same shapes");
    }

    DeviceGuard guard(device);
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    m.grid_sm = 2 * sms;
    if (cp.transport != CpTransport::kReplicated) {
      const std::size_t smem = cuda::span_indexer_smem_bytes(cp.max_reqs);
      int optin = 0;
      CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      M3MSA_CHECK_SUPPORTED(smem + 32 * 1024 <= static_cast<std::size_t>(optin),
                            "CUDA CP: max_reqs = ", cp.max_reqs,
                            " needs more shared memory than the device has");
      // One limit for every decode-indexer kernel of the device, shared with the one-GPU plans.
      cuda::raise_indexer_smem_limit(device, smem);
    }
    const CpBufferKey key{cp.world_size, static_cast<int>(m.heads.size()), m.max_rows, config.topk};
    const RegistryKey rkey{&comm,         device,           static_cast<int>(cp.transport),
                           cp.world_size, key.merged_heads, key.max_rows,
                           key.topk};
    {
      std::lock_guard<std::mutex> lock(g_registry_mutex);
      m.set = registry()[rkey].lock();
    }
    // Ranks in lockstep all find or all create (each rank's entry is keyed by its own
    // communicator). The creation is collective, so it runs without the registry lock, which
    // the other ranks' threads of this process need meanwhile.
    if (!m.set) {
      m.set = create_set(comm, device, cp.transport, key);
      std::lock_guard<std::mutex> lock(g_registry_mutex);
      registry()[rkey] = m.set;
    }
    const int H = config.index_heads;
    const int k = config.topk;
    m.full_topk = DeviceBuffer(sizeof(int32_t) * m.max_rows * H * k);
    if (cp.transport == CpTransport::kReplicated) {
      PlanLimits limits;
      limits.max_reqs = cp.max_reqs;
      limits.max_q_len = cp.max_q_len;
      m.plan = cuda::plan_indexer(config, limits, device);
      m.plan_workspace = DeviceBuffer(m.plan.workspace_bytes);
      cuda::init_indexer_workspace(m.plan, m.plan_workspace.data(), nullptr);
    } else {
      m.local_seq_lens = DeviceBuffer(sizeof(int32_t) * cp.max_reqs);
      m.local_table = DeviceBuffer(sizeof(int32_t) * cp.max_reqs * m.local_cols);
      m.scores = DeviceBuffer(sizeof(float) * m.max_rows * H * m.local_cols);
      CUDA_CHECK(cudaMemset(m.local_table.data(), 0, m.local_table.bytes()));
      CUDA_CHECK(cudaMemset(m.scores.data(), 0, m.scores.bytes()));
      if (cp.transport == CpTransport::kNccl) {
        // Per source: [H][max_rows][k] keys, then [H][max_rows] call words.
        m.send = DeviceBuffer(sizeof(uint64_t) * H * m.max_rows * (k + 1));
        m.recv = DeviceBuffer(sizeof(uint64_t) * cp.world_size * H * m.max_rows * (k + 1));
      }
      if (cp.transport == CpTransport::kAllReduceMax) {
        // The scores, then [P][2] digest slots (sized for the largest world).
        m.full_scores = DeviceBuffer(
            sizeof(float) * (m.max_rows * H * m.max_cols + 2 * cuda::cp_exchange::kMaxWorld));
      }
    }
    CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const Error& error) {
    if (error.rank() >= 0) throw;
    throw error.with_rank(rank);
  }
}

CudaCpIndexer::~CudaCpIndexer() {
  if (impl_ && impl_->set && impl_->set->failed.load()) {
    // After a failure, work that still addresses these buffers may be left on the device (an
    // aborted collective), and freeing would synchronize the whole device: leave them allocated,
    // like the failed set itself.
    Impl& m = *impl_;
    auto* left = new std::vector<DeviceBuffer>();
    for (DeviceBuffer* b : {&m.local_seq_lens, &m.local_table, &m.scores, &m.full_scores, &m.send,
                            &m.recv, &m.full_topk, &m.plan_workspace}) {
      left->push_back(std::move(*b));
    }
  }
}

void CudaCpIndexer::select(int layer, const IndexerArgs& args, void* stream) {
  try {
    impl_->check_args(args);
    impl_->launch_score(args, static_cast<cudaStream_t>(stream));
    impl_->launch_exchange(layer, args, static_cast<cudaStream_t>(stream));
  } catch (const Error& error) {
    if (error.rank() >= 0) throw;
    throw error.with_rank(impl_->rank);
  }
}

void CudaCpIndexer::score(const IndexerArgs& args, void* stream) {
  try {
    impl_->check_args(args);
    impl_->launch_score(args, static_cast<cudaStream_t>(stream));
  } catch (const Error& error) {
    if (error.rank() >= 0) throw;
    throw error.with_rank(impl_->rank);
  }
}

void CudaCpIndexer::exchange(int layer, const IndexerArgs& args, void* stream) {
  try {
    impl_->check_args(args);
    impl_->launch_exchange(layer, args, static_cast<cudaStream_t>(stream));
  } catch (const Error& error) {
    if (error.rank() >= 0) throw;
    throw error.with_rank(impl_->rank);
  }
}

void CudaCpIndexer::Impl::fail(ErrorCode code, const CudaCpFault& f, const std::string& message) {
  set->failed.store(true);
  fault = f;
  if (f.kind == CudaCpFault::Kind::kTimeout) {
    timeout = CpTimeoutRecord{f.layer, f.row, f.head, f.source, f.expected_tag, f.seen_tag};
  }
  if (cp_debug()) std::fprintf(stderr, "m3msa cp[rank %d]: %s\n", rank, message.c_str());
  throw Error(code, message, __FILE__, __LINE__, rank);
}

// The control block read on a private stream into pinned memory, bounded (the call's stream may
// still be busy); for the message of a host timeout.
std::string CudaCpIndexer::Impl::read_control_for_diagnosis() const {
  // One pinned block for the whole process, never freed: this runs while a kernel may be stuck,
  // and cudaFreeHost synchronizes the device (it would wait for that kernel forever).
  static std::mutex host_mutex;
  static void* host = nullptr;
  std::lock_guard<std::mutex> lock(host_mutex);
  if (host == nullptr &&
      cudaMallocHost(&host, sizeof(cuda::cp_exchange::CpExchangeControl)) != cudaSuccess) {
    host = nullptr;
    return "";
  }
  cudaStream_t side = nullptr;
  if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess) return "";
  std::string text = "control block unreadable";
  if (cudaMemcpyAsync(host, set->ctl(), sizeof(cuda::cp_exchange::CpExchangeControl),
                      cudaMemcpyDeviceToHost, side) == cudaSuccess) {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(500);
    while (cudaStreamQuery(side) == cudaErrorNotReady && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (cudaStreamQuery(side) == cudaSuccess) {
      const auto* c = static_cast<const cuda::cp_exchange::CpExchangeControl*>(host);
      text = detail::concat("this rank's calls completed: ", c->generation,
                            ", merge CTAs of the current call arrived: ", c->done,
                            ", device error flag: ", c->error.flag);
    }
  }
  cudaStreamDestroy(side);
  return text;
}

void CudaCpIndexer::check(void* stream) {
  Impl& m = *impl_;
  DeviceGuard guard(m.device);
  auto s = static_cast<cudaStream_t>(stream);
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + m.cp.host_timeout;
  Clock::time_point next_note = start + std::chrono::seconds(1);
  bool done = false;
  for (uint32_t polls = 0;; ++polls) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) {
      done = true;
      break;
    }
    if (q != cudaErrorNotReady) {
      m.set->failed.store(true);
      throw Error(ErrorCode::kInternal,
                  detail::concat("CP rank ", m.rank, ": CUDA error ", cudaGetErrorName(q), " (",
                                 cudaGetErrorString(q), ") while waiting for layer ", m.last_layer),
                  __FILE__, __LINE__, m.rank);
    }
    if (m.nccl != nullptr) {
      try {
        m.nccl->check_async_error("CP check");
      } catch (const Error&) {
        m.set->failed.store(true);
        throw;
      }
    }
    const Clock::time_point now = Clock::now();
    if (now >= deadline) break;
    if (cp_debug() && now >= next_note) {
      std::fprintf(stderr, "m3msa cp[rank %d]: check(): still waiting for layer %d after %.0f ms\n",
                   m.rank, m.last_layer,
                   std::chrono::duration<double, std::milli>(now - start).count());
      next_note = now + std::chrono::seconds(1);
    }
    if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (!done) {
    // The device waits of peer / nccl end within the spin budget, so what is left is a collective
    // that waits for a rank that never joined (or work queued before this call).
    // Abort NCCL first: its kernels poll the abort flag, so the stream drains and the
    // diagnosis below never waits behind a collective that cannot finish.
    if (m.nccl != nullptr) m.nccl->abort("CP check timed out");
    const std::string control = m.read_control_for_diagnosis();
    const int P = m.cp.world_size;
    std::string missing = "a rank that never joined";
    CudaCpFault f;
    f.kind = CudaCpFault::Kind::kHostTimeout;
    f.layer = m.last_layer;
    if (P == 2) {
      f.source = 1 - m.rank;
      missing = detail::concat("rank ", f.source, " never joined");
    }
    std::string what;
    if (m.nccl != nullptr) {
      what = detail::concat("its NCCL collective never completed: ", missing,
                            " (the NCCL communicator was aborted)");
    } else {
      what = detail::concat(
          "no device wait of the exchange outlives its spin budget, so the stream is held by "
          "other work or a kernel that could not be scheduled (",
          missing, "?)");
    }
    m.fail(ErrorCode::kTimeout, f,
           detail::concat("CP rank ", m.rank, ": layer ", m.last_layer, " did not complete within ",
                          m.cp.host_timeout.count(), " ms: ", what, "; ", control));
  }
  cuda::cp_exchange::CpExchangeError e{};
  cuda::cp_exchange::CpExchangeControl* ctl = m.set->ctl();
  // The stream is idle, so this copy (into pageable memory, returning when it completes) is quick.
  CUDA_CHECK(cudaMemcpyAsync(&e, &ctl->error, sizeof(e), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  if (cp_debug()) {
    std::fprintf(stderr, "m3msa cp[rank %d]: check(): layer %d done after %.3f ms, error flag %u\n",
                 m.rank, m.last_layer,
                 std::chrono::duration<double, std::milli>(Clock::now() - start).count(), e.flag);
  }
  if (e.flag == 0) return;
  CudaCpFault f;
  f.layer = e.layer;
  f.row = e.row;
  f.head = e.head;
  f.source = e.source;
  f.expected_tag = e.expected_tag;
  f.seen_tag = e.seen_tag;
  f.expected_word = e.expected_word;
  f.seen_word = e.seen_word;
  if (e.kind == cuda::cp_exchange::kFaultShapeMismatch) {
    f.kind = CudaCpFault::Kind::kShapeMismatch;
    m.fail(ErrorCode::kInvalidArgument, f,
           detail::concat("rank ", e.source, " passed another shape for the same call (layer ",
                          e.layer, " on this rank): its call has ", describe_word(e.seen_word),
                          ", this rank's has ", describe_word(e.expected_word),
                          " (the digest covers layer, num_reqs, q_len, table width and cache "
                          "dtype); every rank must make the same calls with the same shapes in "
                          "the same order"));
  }
  f.kind = CudaCpFault::Kind::kTimeout;
  m.fail(
      ErrorCode::kTimeout, f,
      detail::concat("rank ", e.source, " never delivered layer ", e.layer, " row ", e.row,
                     " head ", e.head, " (expected tag ", e.expected_tag, ", saw tag ", e.seen_tag,
                     ") within the spin budget of ", m.cp.spin_budget.count(), " us"));
}

std::optional<CpTimeoutRecord> CudaCpIndexer::last_timeout() const {
  return impl_->timeout;
}

std::optional<CudaCpFault> CudaCpIndexer::last_fault() const {
  return impl_->fault;
}

int CudaCpIndexer::rank() const {
  return impl_->rank;
}

const std::vector<int>& CudaCpIndexer::merged_heads() const {
  return impl_->heads;
}

CudaCpInfo CudaCpIndexer::info() const {
  CudaCpInfo info;
  info.key = impl_->set->key;
  info.buffer_bytes_per_rank = impl_->set->candidate_bytes + impl_->set->word_bytes;
  info.word_bytes_per_rank = impl_->set->word_bytes;
  info.peer_mapped_by_ipc = impl_->set->by_ipc();
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  for (const auto& [key, weak] : registry()) {
    if (key.comm == impl_->comm && !weak.expired()) ++info.buffer_sets;
  }
  return info;
}

uint32_t CudaCpIndexer::generation() const {
  DeviceGuard guard(impl_->device);
  CUDA_CHECK(cudaDeviceSynchronize());
  uint32_t g = 0;
  CUDA_CHECK(cudaMemcpy(&g, &impl_->set->ctl()->generation, sizeof(g), cudaMemcpyDeviceToHost));
  return g;
}

}  // namespace m3msa
