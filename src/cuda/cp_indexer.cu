// Host side of the CUDA CP indexer (include/m3msa/cp_cuda.h, kernels in cp_kernels.cuh): the
// collective setup (host agreement, buffer sets, peer mapping), the launch sequence of each
// transport and the turning of a device error record into Error(kTimeout) naming the rank.
//
// Buffer sets (cp.md): one per (communicator, device, transport, key), created on first use by a
// collective step and shared by every indexer (layer) with that key. A peer set owns this rank's
// candidate buffer [2][P][merged][max_rows][k] u64 (zeroed once, never cleared) and the addresses
// of every peer's: exchanged through the communicator, mapped by peer access when all ranks are
// threads of one process, by CUDA IPC handles otherwise. Addresses stay fixed for the set's life,
// so captured graphs keep addressing the same slots.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/common.cuh"
#include "cuda/cp_kernels.cuh"
#include "cuda/indexer.h"
#include "cuda/params.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/error.h"

namespace m3msa {

namespace {

using cuda::DeviceBuffer;
using cuda::DeviceGuard;
using cuda::narrow_int;

#define NCCL_CHECK(expr)                                                          \
  do {                                                                            \
    const ncclResult_t m3msa_nccl_status_ = (expr);                               \
    if (m3msa_nccl_status_ != ncclSuccess) {                                      \
      M3MSA_THROW(::m3msa::ErrorCode::kInternal, "NCCL call failed: " #expr ": ", \
                  ncclGetErrorString(m3msa_nccl_status_));                        \
    }                                                                             \
  } while (0)

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
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

// One buffer set (see the file comment).
struct BufferSet {
  CpBufferKey key;
  CpTransport transport = CpTransport::kPeer;
  int device = 0;
  DeviceBuffer candidates;       // peer: this rank's [2][P][merged][max_rows][k] u64
  DeviceBuffer control;          // cuda::cp::CpControl
  std::vector<uint64_t*> peers;  // by rank: candidate buffers (own included)
  std::vector<void*> ipc_opened;
  bool by_ipc = false;

  ~BufferSet() {
    DeviceGuard guard(device);
    cudaDeviceSynchronize();  // no call may still be storing into or reading a mapped buffer
    for (void* p : ipc_opened) cudaIpcCloseMemHandle(p);
  }
  cuda::cp::CpControl* ctl() const { return control.as<cuda::cp::CpControl>(); }
};

struct RegistryKey {
  const void* comm;
  int device, transport, world_size, merged_heads, max_rows, topk;
  auto tie() const {
    return std::tie(comm, device, transport, world_size, merged_heads, max_rows, topk);
  }
  bool operator<(const RegistryKey& o) const { return tie() < o.tie(); }
};

std::mutex g_registry_mutex;  // guards the registry and smem_limits()

// The dynamic shared memory limit set so far on the shard scoring kernels, by device.
std::map<int, std::size_t>& smem_limits() {
  static std::map<int, std::size_t> limits;
  return limits;
}
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
  DeviceGuard guard(device);
  set->control = DeviceBuffer(sizeof(cuda::cp::CpControl));
  CUDA_CHECK(cudaMemset(set->control.data(), 0, sizeof(cuda::cp::CpControl)));
  if (transport != CpTransport::kPeer) return set;

  set->candidates = DeviceBuffer(key.bytes_per_rank());
  CUDA_CHECK(cudaMemset(set->candidates.data(), 0, key.bytes_per_rank()));  // zeroed once
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle{};
  CUDA_CHECK(cudaIpcGetMemHandle(&handle, set->candidates.data()));
  RecordWriter w;
  w.i64(static_cast<int64_t>(::getpid())).i64(device);
  w.i64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(set->candidates.data())));
  w.str(std::string_view(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  const std::vector<ByteRecord> all = comm.all_gather(w.take(), "cp/peer-buffers");
  const int P = comm.world_size();
  std::vector<int64_t> pids(static_cast<std::size_t>(P)), devices(pids.size()), ptrs(pids.size());
  std::vector<std::string> handles(pids.size());
  for (int r = 0; r < P; ++r) {
    RecordReader reader(all[static_cast<std::size_t>(r)], "CP peer-buffer record");
    pids[static_cast<std::size_t>(r)] = reader.i64();
    devices[static_cast<std::size_t>(r)] = reader.i64();
    ptrs[static_cast<std::size_t>(r)] = reader.i64();
    handles[static_cast<std::size_t>(r)] = reader.str();
  }
  const bool one_process =
      std::all_of(pids.begin(), pids.end(), [&](int64_t pid) { return pid == pids[0]; });
  set->by_ipc = !one_process;
  set->peers.resize(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    if (r == comm.rank()) {
      set->peers[ur] = set->candidates.as<uint64_t>();
      continue;
    }
    if (one_process) {
      const int peer_device = static_cast<int>(devices[ur]);
      if (peer_device != device) {
        int can = 0;
        CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer_device));
        M3MSA_CHECK_SUPPORTED(can, "CP peer transport: device ", device, " cannot access device ",
                              peer_device, " (no peer access); use transport nccl");
        const cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();  // clear the sticky-free "already enabled" status
        } else {
          CUDA_CHECK(e);
        }
      }
      set->peers[ur] = reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(ptrs[ur]));
    } else {
      cudaIpcMemHandle_t peer_handle{};
      M3MSA_CHECK_INTERNAL(handles[ur].size() == sizeof(peer_handle), "IPC handle of rank ", r,
                           " has ", handles[ur].size(), " bytes");
      std::memcpy(&peer_handle, handles[ur].data(), sizeof(peer_handle));
      void* mapped = nullptr;
      CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, peer_handle, cudaIpcMemLazyEnablePeerAccess));
      set->ipc_opened.push_back(mapped);
      set->peers[ur] = static_cast<uint64_t*>(mapped);
    }
  }
  // Nobody may store into a buffer before its owner has zeroed it (done above, synchronously).
  comm.all_gather({}, "cp/peer-buffers-ready");
  if (comm.rank() == 0) {
    std::fprintf(stderr, "m3msa cp: buffer set %s (%s): %zu bytes per rank, mapped by %s\n",
                 key.to_string().c_str(), cp_transport_name(transport), key.bytes_per_rank(),
                 one_process ? "peer access" : "CUDA IPC");
  }
  return set;
}

using ScoreKernel = void (*)(const cuda::IndexerParams);

ScoreKernel score_kernel(bool fp8, int tiles) {
  using cuda::idx::indexer_kernel;
  constexpr int kScores = cuda::idx::kModeScores;
  switch (tiles) {
    case 1: return fp8 ? indexer_kernel<true, 1, kScores> : indexer_kernel<false, 1, kScores>;
    case 2: return fp8 ? indexer_kernel<true, 2, kScores> : indexer_kernel<false, 2, kScores>;
    default: return fp8 ? indexer_kernel<true, 4, kScores> : indexer_kernel<false, 4, kScores>;
  }
}

// Dynamic shared memory of the scoring kernel: its cp.async ring, then the units' prefix sums.
// Must equal dynamic_smem_bytes() of indexer.cu (the one-GPU launcher), which it mirrors.
std::size_t score_smem_bytes(int max_units) {
  static_assert(cuda::idx::Tile<false>::kRingBytes == cuda::idx::Tile<true>::kRingBytes);
  return cuda::idx::Tile<false>::kRingBytes +
         static_cast<std::size_t>(max_units + 1) * sizeof(int32_t);
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
  bool failed = false;
  std::optional<CpTimeoutRecord> timeout;
  int grid_sm = 0;
  // Peer: nominate and merge in one launch (M3MSA_CP_SPLIT_EXCHANGE=1: two launches, to compare).
  bool fused_exchange = true;

  DeviceBuffer local_seq_lens, local_table, scores, full_scores, send, recv, full_topk;
  cuda::IndexerPlan plan;  // replicated: the one-GPU indexer
  DeviceBuffer plan_workspace;

  cuda::cp::CpParams params(const IndexerArgs& args) const;
  void check_args(const IndexerArgs& args) const;
  void launch_score(const IndexerArgs& args, cudaStream_t stream);
  void launch_exchange(int layer, const IndexerArgs& args, cudaStream_t stream);
};

cuda::cp::CpParams CudaCpIndexer::Impl::params(const IndexerArgs& args) const {
  cuda::cp::CpParams p;
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
  } else if (cp.transport == CpTransport::kNccl) {
    p.dest[0] = send.as<uint64_t>();
    p.dest_local = 1;
    p.cand = recv.as<uint64_t>();
    p.head_stride = int64_t{max_rows} * k;
    p.source_stride = p.head_stride * config.index_heads;
    p.parity_stride = 0;
    p.cand_head_base = heads.front();
  }
  return p;
}

void CudaCpIndexer::Impl::check_args(const IndexerArgs& args) const {
  M3MSA_CHECK_ARG(!failed, "CP rank ", rank,
                  ": an earlier call failed and the ranks are out of lockstep; rebuild the group");
  const BatchMeta& batch = args.batch;
  M3MSA_CHECK_SUPPORTED(batch.kind == BatchKind::kDecode, "CUDA CP indexer: decode only");
  M3MSA_CHECK_ARG(batch.num_reqs >= 0 && batch.num_reqs <= cp.max_reqs,
                  "CP: batch.num_reqs = ", batch.num_reqs,
                  " outside [0, CudaCpConfig.max_reqs = ", cp.max_reqs, "]");
  M3MSA_CHECK_ARG(batch.q_len >= 1 && batch.q_len <= cp.max_q_len,
                  "CP: batch.q_len = ", batch.q_len,
                  " outside [1, CudaCpConfig.max_q_len = ", cp.max_q_len, "]");
  const int64_t rows = batch.num_rows();
  check_tensor(args.topk_idx, "topk_idx", DType::kI32,
               {rows, static_cast<int64_t>(heads.size()), config.topk});
  check_device(args.topk_idx, "topk_idx", Device::cuda(device));
  IndexerArgs full = args;
  full.topk_idx = TensorView::contiguous(
      full_topk.data(), DType::kI32, {rows, config.index_heads, config.topk}, Device::cuda(device));
  validate(config, full, Device::cuda(device));
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
  cuda::cp::CpParams p = params(args);
  cuda::cp::cp_shard_tables_kernel<<<cp.max_reqs, cuda::cp::kThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
  if (batch.num_reqs == 0) return;
  cuda::IndexerParams s;
  s.index_q = args.index_q.ptr<const uint16_t>();
  s.index_cache = args.index_cache.data.data;
  s.block_table = local_table.as<const int32_t>();
  s.seq_lens = local_seq_lens.as<const int32_t>();
  s.scores = scores.as<float>();
  s.status = &set->ctl()->status;
  s.num_pages = args.index_cache.pages();
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
  const int tiles = s.unit_vectors <= 8 ? 1 : s.unit_vectors <= 16 ? 2 : 4;
  const std::size_t smem = score_smem_bytes(cp.max_reqs);
  score_kernel(fp8, tiles)<<<grid_sm, cuda::idx::kThreads, smem, stream>>>(s);
  CUDA_CHECK_LAUNCH();
}

void CudaCpIndexer::Impl::launch_exchange(int layer, const IndexerArgs& args, cudaStream_t stream) {
  DeviceGuard guard(device);
  const int merged = static_cast<int>(heads.size());
  const int H = config.index_heads;
  if (cp.transport == CpTransport::kReplicated) {
    const int64_t total = args.batch.num_rows() * merged * config.topk;
    if (total == 0) return;
    cuda::cp::
        cp_gather_heads_kernel<<<narrow_int(ceil_div(total, 256), "gather CTAs"), 256, 0, stream>>>(
            full_topk.as<const int32_t>(), args.topk_idx.ptr<int32_t>(),
            static_cast<int>(args.batch.num_rows()), H, merged, heads.front(), config.topk);
    CUDA_CHECK_LAUNCH();
    return;
  }
  cuda::cp::CpParams p = params(args);
  p.layer = layer;
  const int merge_grid =
      narrow_int(ceil_div(int64_t{max_rows} * merged, cuda::cp::kWarps), "merge CTAs");
  if (cp.transport == CpTransport::kAllReduceMax) {
    const dim3 grid(narrow_int(ceil_div(max_cols, 256), "scatter CTAs"), max_rows * H);
    cuda::cp::cp_scatter_scores_kernel<<<grid, cuda::cp::kThreads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH();
    NCCL_CHECK(ncclAllReduce(full_scores.data(), full_scores.data(),
                             static_cast<std::size_t>(max_rows) * H * max_cols, ncclFloat32,
                             ncclMax, static_cast<ncclComm_t>(nccl->nccl_comm()), stream));
    cuda::cp::cp_select_full_kernel<<<merge_grid, cuda::cp::kThreads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const int nominate_grid =
      narrow_int(ceil_div(int64_t{max_rows} * H, cuda::cp::kWarps), "nominate CTAs");
  if (cp.transport == CpTransport::kPeer && fused_exchange) {
    cuda::cp::cp_exchange_kernel<<<nominate_grid + merge_grid, cuda::cp::kThreads, 0, stream>>>(
        p, nominate_grid);
    CUDA_CHECK_LAUNCH();
    return;
  }
  cuda::cp::cp_nominate_kernel<<<nominate_grid, cuda::cp::kThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
  if (cp.transport == CpTransport::kNccl) {
    NCCL_CHECK(ncclAllGather(send.data(), recv.data(),
                             static_cast<std::size_t>(H) * max_rows * config.topk, ncclUint64,
                             static_cast<ncclComm_t>(nccl->nccl_comm()), stream));
  }
  cuda::cp::cp_merge_kernel<<<merge_grid, cuda::cp::kThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
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
    M3MSA_CHECK_SUPPORTED(cp.world_size <= cuda::cp::kMaxWorld, "CUDA CP: world size ",
                          cp.world_size, " > ", cuda::cp::kMaxWorld);
    M3MSA_CHECK_ARG(cp.max_reqs >= 1, "CudaCpConfig.max_reqs must be >= 1, got ", cp.max_reqs);
    M3MSA_CHECK_ARG(cp.max_q_len >= 1 && cp.max_q_len <= kMaxQueryLen,
                    "CudaCpConfig.max_q_len must be in [1, ", kMaxQueryLen, "], got ",
                    cp.max_q_len);
    M3MSA_CHECK_ARG(cp.max_context >= 1, "CudaCpConfig.max_context must be >= 1, got ",
                    cp.max_context);
    M3MSA_CHECK_ARG(cp.spin_budget.count() > 0, "CudaCpConfig.spin_budget must be > 0 us");
    M3MSA_CHECK_SUPPORTED(cp.max_q_len * config.index_heads <= cuda::idx::kMaxVectors,
                          "CUDA CP: max_q_len * index_heads must be <= ", cuda::idx::kMaxVectors);
    // The shard tables rely on every scored block being fully visible (cp_kernels.cuh).
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
      const std::size_t smem = score_smem_bytes(cp.max_reqs);
      int optin = 0;
      CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      M3MSA_CHECK_SUPPORTED(smem + 32 * 1024 <= static_cast<std::size_t>(optin),
                            "CUDA CP: max_reqs = ", cp.max_reqs,
                            " needs more shared memory than the device has");
      // The limit is per kernel and device, shared by every indexer of the process: only ever
      // raise it, so a smaller indexer made later never lowers it under a bigger one.
      std::lock_guard<std::mutex> lock(g_registry_mutex);
      std::size_t& limit = smem_limits()[device];
      if (smem > limit) {
        for (bool fp8 : {false, true}) {
          for (int tiles : {1, 2, 4}) {
            CUDA_CHECK(cudaFuncSetAttribute(score_kernel(fp8, tiles),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
          }
        }
        limit = smem;
      }
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
        m.send = DeviceBuffer(sizeof(uint64_t) * H * m.max_rows * k);
        m.recv = DeviceBuffer(sizeof(uint64_t) * cp.world_size * H * m.max_rows * k);
      }
      if (cp.transport == CpTransport::kAllReduceMax) {
        m.full_scores = DeviceBuffer(sizeof(float) * m.max_rows * H * m.max_cols);
      }
    }
    CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const Error& error) {
    if (error.rank() >= 0) throw;
    throw error.with_rank(rank);
  }
}

CudaCpIndexer::~CudaCpIndexer() = default;

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
  impl_->check_args(args);
  impl_->launch_score(args, static_cast<cudaStream_t>(stream));
}

void CudaCpIndexer::exchange(int layer, const IndexerArgs& args, void* stream) {
  impl_->check_args(args);
  impl_->launch_exchange(layer, args, static_cast<cudaStream_t>(stream));
}

void CudaCpIndexer::check(void* stream) {
  Impl& m = *impl_;
  DeviceGuard guard(m.device);
  CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  cuda::cp::CpDeviceError e{};
  CUDA_CHECK(cudaMemcpy(&e, &m.set->ctl()->error, sizeof(e), cudaMemcpyDeviceToHost));
  if (e.flag == 0) return;
  m.failed = true;
  m.timeout = CpTimeoutRecord{e.layer, e.row, e.head, e.source, e.expected_tag, e.seen_tag};
  throw Error(
      ErrorCode::kTimeout,
      detail::concat("rank ", e.source, " never delivered layer ", e.layer, " row ", e.row,
                     " head ", e.head, " (expected tag ", e.expected_tag, ", saw tag ", e.seen_tag,
                     ") within the spin budget of ", m.cp.spin_budget.count(), " us"),
      __FILE__, __LINE__, m.rank);
}

std::optional<CpTimeoutRecord> CudaCpIndexer::last_timeout() const {
  return impl_->timeout;
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
  info.buffer_bytes_per_rank = impl_->set->candidates.bytes();
  info.peer_mapped_by_ipc = impl_->set->by_ipc;
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
