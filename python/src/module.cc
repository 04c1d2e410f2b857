// m3msa._m3msa: the compiled half of the m3msa Python package. Thin: every entry imports its
// tensors zero-copy (interop.h), picks the backend from their device (dispatch.h) and runs the
// C++ entry with the GIL released. Defaults, output allocation and the CUDA stream lookup live in
// the pure-Python package (python/m3msa), which is the documented API.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "config_fields.h"
#include "dispatch.h"
#include "interop.h"
#include "m3msa/backend.h"
#include "m3msa/comm.h"
#include "m3msa/config.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/ops.h"
#include "m3msa/synthetic.h"
#include "m3msa/version.h"
#include "runtime_binding.h"
#if M3MSA_PY_WITH_CP
#include "m3msa/cp_model.h"
#endif

namespace m3msa::python {
namespace {

// ---- Errors: m3msa::Error -> m3msa.Error(text, code, message, rank) ----

PyObject* g_error_type = nullptr;  // set by m3msa/__init__.py; a strong reference kept forever

const char* error_code_key(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kInternal: return "internal";
  }
  return "internal";
}

void set_python_error(const Error& error) {
  if (g_error_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return;
  }
  // g_error_type is m3msa._errors.make_error: it returns the subclass of m3msa.Error for the code
  // (InvalidArgumentError is a ValueError, UnsupportedError a NotImplementedError, TimeoutError a
  // builtins.TimeoutError), raised here as its own type.
  py::handle factory(g_error_type);
  const py::object rank =
      error.rank() >= 0 ? py::object(py::int_(error.rank())) : py::object(py::none());
  const py::object instance =
      factory(error.what(), error_code_key(error.code()), error.message(), rank);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(instance.ptr())), instance.ptr());
}

void set_error_type(py::object type) {
  Py_XDECREF(g_error_type);
  g_error_type = type.release().ptr();
}

// ---- Operations ----

void check_cpu(const TensorView& view, const char* entry, const char* name) {
  M3MSA_CHECK_SUPPORTED(view.device.type == DeviceType::kCPU, entry,
                        " runs on the CPU reference only; ", name, " is on ",
                        device_name(view.device));
}

// The device a call runs on: the plan's, or else the device of the call's first tensor. A CUDA
// device this build or machine cannot run on is refused here, before the arguments are compared
// with it (so a CPU-only build says "not built" rather than "wrong device" for GPU tensors).
Device call_device(const CudaPlan* plan, const TensorView& first, const char* first_name) {
  if (plan != nullptr) return plan->device();
  if (first.device.type == DeviceType::kCUDA) {
    M3MSA_CHECK_SUPPORTED(built_with_cuda(), "CUDA backend not built: ", first_name, " is on ",
                          device_name(first.device),
                          " and this build of the m3msa Python module runs the CPU reference only");
    M3MSA_CHECK_SUPPORTED(cuda_device_count() > 0, first_name, " is on ", device_name(first.device),
                          " but no CUDA device is visible");
  }
  return first.device;
}

// Validates `args` against the call's device (every tensor named on a mismatch, before any CUDA
// call), then runs `body(backend)` with the GIL released on the leased backend.
template <typename Args, typename Body>
void run_on_backend(const SparseConfig& config, const Args& args, const TensorView& first,
                    const char* first_name, const char* entry, int threads, Stream stream,
                    CudaPlan* plan, Body&& body) {
  const Device device = call_device(plan, first, first_name);
  validate(config, args, device);
  py::gil_scoped_release release;  // destroyed last: the GIL is back before the scope's deleters
  BackendLease backend = plan != nullptr ? plan->lease(config, args.batch, stream, entry)
                                         : backend_for(device, threads, stream);
  body(*backend);
}

void select_topk(const SparseConfig& config, py::handle index_q, py::handle index_cache,
                 py::handle batch, py::handle topk_idx, const std::string& order,
                 const std::string& major, int threads, Stream stream, CudaPlan* plan) {
  ImportScope scope(stream);
  IndexerArgs args;
  args.selection.order = parse_selection_order(order, "order");
  args.selection.major = parse_selection_major(major, "major");
  args.index_q = scope.tensor(index_q, "index_q");
  args.index_cache.data = scope.tensor(index_cache, "index_cache");
  args.batch = scope.batch(batch);
  args.topk_idx = scope.tensor(topk_idx, "topk_idx", /*writable=*/true);
  run_on_backend(config, args, args.index_q, "index_q", "select_topk", threads, stream, plan,
                 [&](Backend& backend) { backend.select_topk(config, args); });
}

// The main cache as given from Python: one tensor in `layout` (cache.h KVLayout), or K and V as
// two views [pages, kv_heads, block_size, head_dim] (kv_v given; the layout must then be "ours").
// A scale is a Python number (fixed at the call) or a one-element f32 tensor on the cache's
// device (read when the operation runs: what a captured graph needs).
KVCache import_kv_cache(ImportScope& scope, py::handle kv_cache, py::handle kv_v,
                        const std::string& layout, py::handle k_scale, py::handle v_scale,
                        bool writable) {
  const KVLayout parsed = parse_kv_layout(layout, "kv_layout");
  KVCache cache;
  if (kv_v.is_none()) {
    cache = kv_cache_from_layout(scope.tensor(kv_cache, "kv_cache", writable), parsed);
  } else {
    M3MSA_CHECK_ARG(parsed == KVLayout::kOurs, "kv_layout: a (k, v) pair is read as two views ",
                    "[pages, kv_heads, block_size, head_dim]; layout '", layout,
                    "' names a single tensor");
    cache = KVCache::split(scope.tensor(kv_cache, "kv_cache.k", writable),
                           scope.tensor(kv_v, "kv_cache.v", writable));
  }
  auto scale = [&](py::handle value, float& number, TensorView& tensor, const char* name) {
    if (py::isinstance<py::float_>(value) || py::isinstance<py::int_>(value)) {
      number = value.cast<float>();
    } else {
      tensor = scope.tensor(value, name);
    }
  };
  scale(k_scale, cache.k_scale, cache.k_scale_tensor, "k_scale");
  scale(v_scale, cache.v_scale, cache.v_scale_tensor, "v_scale");
  return cache;
}

void sparse_attention(const SparseConfig& config, py::handle q, py::handle kv_cache,
                      py::handle kv_v, const std::string& kv_layout, py::handle k_scale,
                      py::handle v_scale, py::handle batch, py::handle topk_idx, py::handle out,
                      int threads, Stream stream, CudaPlan* plan) {
  ImportScope scope(stream);
  AttentionArgs args;
  args.q = scope.tensor(q, "q");
  args.kv_cache = import_kv_cache(scope, kv_cache, kv_v, kv_layout, k_scale, v_scale, false);
  args.batch = scope.batch(batch);
  args.topk_idx = scope.optional_tensor(topk_idx, "topk_idx");
  args.out = scope.tensor(out, "out", /*writable=*/true);
  run_on_backend(config, args, args.q, "q", "sparse_attention", threads, stream, plan,
                 [&](Backend& backend) { backend.sparse_attention(config, args); });
}

void preprocess(const SparseConfig& config, py::handle qkv, py::handle q_norm, py::handle k_norm,
                py::handle index_q_norm, py::handle index_k_norm, py::handle positions,
                py::handle batch, py::handle kv_cache, py::handle kv_v,
                const std::string& kv_layout, py::handle k_scale, py::handle v_scale,
                py::handle index_cache, py::handle q_out, py::handle index_q_out, int threads,
                Stream stream, CudaPlan* plan) {
  ImportScope scope(stream);
  PreprocessArgs args;
  args.qkv = scope.tensor(qkv, "qkv");
  args.q_norm = scope.tensor(q_norm, "q_norm");
  args.k_norm = scope.tensor(k_norm, "k_norm");
  args.index_q_norm = scope.tensor(index_q_norm, "index_q_norm");
  args.index_k_norm = scope.tensor(index_k_norm, "index_k_norm");
  args.positions = scope.tensor(positions, "positions");
  args.batch = scope.batch(batch);
  args.kv_cache = import_kv_cache(scope, kv_cache, kv_v, kv_layout, k_scale, v_scale,
                                  /*writable=*/true);
  args.index_cache.data = scope.tensor(index_cache, "index_cache", /*writable=*/true);
  args.q_out = scope.tensor(q_out, "q_out", /*writable=*/true);
  args.index_q_out = scope.tensor(index_q_out, "index_q_out", /*writable=*/true);
  run_on_backend(config, args, args.qkv, "qkv", "preprocess", threads, stream, plan,
                 [&](Backend& backend) { backend.preprocess(config, args); });
}

void score_blocks(const SparseConfig& config, py::handle index_q, py::handle index_cache,
                  py::handle batch, py::handle scores, int threads) {
  ImportScope scope;
  IndexerArgs args;
  args.index_q = scope.tensor(index_q, "index_q");
  args.index_cache.data = scope.tensor(index_cache, "index_cache");
  args.batch = scope.batch(batch);
  const TensorView out = scope.tensor(scores, "scores", /*writable=*/true);
  check_cpu(args.index_q, "score_blocks", "index_q");
  M3MSA_CHECK_ARG(threads >= 0, "threads must be >= 0, got ", threads);
  py::gil_scoped_release release;
  cpu::score_blocks(config, args, out, threads);
}

void nominate(const SparseConfig& config, py::handle index_q, py::handle index_cache,
              py::handle batch, int shard, int num_shards, py::handle keys, int threads) {
  ImportScope scope;
  IndexerArgs args;
  args.index_q = scope.tensor(index_q, "index_q");
  args.index_cache.data = scope.tensor(index_cache, "index_cache");
  args.batch = scope.batch(batch);
  const TensorView out = scope.tensor(keys, "keys", /*writable=*/true);
  check_cpu(args.index_q, "nominate", "index_q");
  M3MSA_CHECK_ARG(threads >= 0, "threads must be >= 0, got ", threads);
  py::gil_scoped_release release;
  cpu::nominate(config, args, shard, num_shards, out, threads);
}

// ---- Synthetic cases: the C++ generator's tensors as NumPy arrays (zero-copy) ----

py::object to_numpy(const HostTensor& tensor) {
  if (tensor.shape().empty()) return py::none();  // not made for this kind of case
  const char* format = "uint8";
  switch (tensor.dtype()) {
    case DType::kF32: format = "float32"; break;
    case DType::kBF16: format = "uint16"; break;
    case DType::kFP8E4M3: format = "uint8"; break;
    case DType::kI32: format = "int32"; break;
    case DType::kI64: format = "int64"; break;
    case DType::kU64: format = "uint64"; break;
    case DType::kU8: format = "uint8"; break;
  }
  auto* owner = new HostTensor(tensor);  // shares the storage; freed with the array
  const py::capsule base(owner, [](void* p) { delete static_cast<HostTensor*>(p); });
  const py::array array(py::dtype(format), tensor.shape(), owner->data(), base);
  if (tensor.dtype() == DType::kBF16 || tensor.dtype() == DType::kFP8E4M3) {
    return py::cast(TypedView{array, tensor.dtype()});
  }
  return array;
}

py::dict synthetic_case(const SparseConfig& config, const std::string& kind, int num_reqs,
                        int q_len, std::vector<int64_t> seq_lens, int64_t min_context,
                        int64_t max_context, std::vector<int64_t> chunk_lens,
                        std::vector<int64_t> context_lens, int padding_reqs,
                        const std::string& index_dtype, const std::string& kv_dtype, float k_scale,
                        float v_scale, int extra_pages, float query_scale, bool make_index_cache,
                        bool make_kv_cache, uint64_t seed) {
  SyntheticSpec spec;
  spec.config = config;
  M3MSA_CHECK_ARG(kind == "decode" || kind == "prefill",
                  "kind must be 'decode' or 'prefill', got '", kind, "'");
  spec.kind = kind == "decode" ? BatchKind::kDecode : BatchKind::kPrefill;
  spec.num_reqs = num_reqs;
  spec.q_len = q_len;
  spec.seq_lens = std::move(seq_lens);
  spec.min_context = min_context;
  spec.max_context = max_context;
  spec.chunk_lens = std::move(chunk_lens);
  spec.context_lens = std::move(context_lens);
  spec.padding_reqs = padding_reqs;
  spec.index_dtype = parse_dtype(index_dtype, "index_dtype");
  spec.kv_dtype = parse_dtype(kv_dtype, "kv_dtype");
  spec.k_scale = k_scale;
  spec.v_scale = v_scale;
  spec.extra_pages = extra_pages;
  spec.query_scale = query_scale;
  spec.make_index_cache = make_index_cache;
  spec.make_kv_cache = make_kv_cache;
  spec.seed = seed;
  SyntheticCase made;
  {
    py::gil_scoped_release release;
    made = make_synthetic_case(spec);
  }
  py::dict out;
  out["kind"] = kind;
  out["num_reqs"] = made.batch.num_reqs;
  out["q_len"] = made.batch.q_len;
  out["num_tokens"] = made.batch.num_tokens;
  out["seq_lens"] = to_numpy(made.seq_lens);
  out["cu_seqlens_q"] = to_numpy(made.cu_seqlens_q);
  out["context_lens"] = to_numpy(made.context_lens);
  out["index_block_table"] = to_numpy(made.index_block_table);
  out["kv_block_table"] = to_numpy(made.kv_block_table);
  out["slot_mapping"] = to_numpy(made.slot_mapping);
  out["index_slot_mapping"] = to_numpy(made.index_slot_mapping);
  out["positions"] = to_numpy(made.positions);
  out["index_q"] = to_numpy(made.index_q);
  out["q"] = to_numpy(made.q);
  out["index_cache"] = to_numpy(made.index_cache);
  out["kv_cache"] = to_numpy(made.kv_cache);
  out["k_scale"] = made.k_scale;
  out["v_scale"] = made.v_scale;
  return out;
}

// ---- Context-parallel CPU model ----

#if M3MSA_PY_WITH_CP
void check_rank(const CpuCpGroup& group, int rank) {
  M3MSA_CHECK_ARG(rank >= 0 && rank < group.world_size(),
                  "rank must be in [0, world_size = ", group.world_size(), "), got ", rank);
}

void bind_cp(py::module_& m) {
  py::class_<CpuCpGroup>(m, "CpuCpGroup",
                         "P ranks of the CPU model of the context-parallel indexer (cp.h).")
      .def(py::init([](const SparseConfig& config, int world_size, int max_rows,
                       int64_t spin_budget_us, int threads) {
             CpConfig cp;
             cp.world_size = world_size;
             cp.max_rows = max_rows;
             cp.spin_budget = std::chrono::microseconds(spin_budget_us);
             cp.threads = threads;
             return std::make_unique<CpuCpGroup>(config, cp);
           }),
           py::arg("config"), py::arg("world_size"), py::arg("max_rows"), py::arg("spin_budget_us"),
           py::arg("threads"))
      .def_property_readonly("world_size", &CpuCpGroup::world_size)
      .def(
          "merged_heads",
          [](const CpuCpGroup& group, int rank) {
            check_rank(group, rank);
            return group.merged_heads(rank);
          },
          py::arg("rank"))
      .def(
          "generation",
          [](CpuCpGroup& group, int rank) {
            check_rank(group, rank);
            return group.rank(rank).generation();
          },
          py::arg("rank"))
      .def(
          "select_all",
          [](CpuCpGroup& group, int layer, py::handle index_q, py::handle index_cache,
             py::handle batch, py::handle topk_idx) {
            ImportScope scope;
            IndexerArgs args;
            args.index_q = scope.tensor(index_q, "index_q");
            args.index_cache.data = scope.tensor(index_cache, "index_cache");
            args.batch = scope.batch(batch);
            args.topk_idx = scope.tensor(topk_idx, "topk_idx", /*writable=*/true);
            check_cpu(args.index_q, "the CP CPU selector", "index_q");
            py::gil_scoped_release release;
            cp_select_all(group, layer, args);
          },
          py::arg("layer"), py::arg("index_q"), py::arg("index_cache"), py::arg("batch"),
          py::arg("topk_idx"));
  m.def("cp_merged_heads", &cp_merged_heads, py::arg("world_size"), py::arg("index_heads"),
        py::arg("rank"));
  m.def("cp_consumers", &cp_consumers, py::arg("world_size"), py::arg("index_heads"),
        py::arg("head"));
  m.def("validate_cp_placement", &validate_cp_placement, py::arg("world_size"),
        py::arg("index_heads"));
}
#endif

// ---- CUDA: plans and the context-parallel indexer ----

// One rank of the CUDA CP indexer (cp_cuda.h) with the communicator it was set up over (which
// must outlive it). Calls are serialized: a rank's calls must keep one stream order anyway.
struct CudaCpRank {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<CudaCpIndexer> indexer;  // null once closed
  int device = 0;
  int rank = 0;
  int world_size = 1;
  std::vector<int> merged_heads;
  std::mutex mutex;

  CudaCpIndexer& live() {
    M3MSA_CHECK_ARG(indexer != nullptr, "CudaCpIndexer (rank ", rank, "): closed");
    return *indexer;
  }
};

std::unique_ptr<CudaCpRank> make_cuda_cp_rank(const SparseConfig& config, const std::string& world,
                                              int device, int max_reqs, int max_q_len,
                                              int64_t max_context, const std::string& transport,
                                              int64_t spin_budget_us, int64_t timeout_ms) {
  M3MSA_CHECK_ARG(world == "single" || world == "env",
                  "world must be 'single' (one rank, this process) or 'env' (one rank per "
                  "process, NCCL bootstrap from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), "
                  "got '",
                  world, "'");
  M3MSA_CHECK_ARG(spin_budget_us > 0, "spin_budget_us must be > 0, got ", spin_budget_us);
  M3MSA_CHECK_ARG(timeout_ms > 0, "timeout_ms must be > 0, got ", timeout_ms);
  M3MSA_CHECK_SUPPORTED(built_with_cuda(),
                        "m3msa.CudaCpIndexer: this build of the m3msa Python module has no CUDA");
  M3MSA_CHECK_SUPPORTED(cuda_device_count() > 0, "m3msa.CudaCpIndexer: no CUDA device is visible");
  CudaCpConfig cp;
  cp.max_reqs = max_reqs;
  cp.max_q_len = max_q_len;
  cp.max_context = max_context;
  cp.transport = parse_cp_transport(transport);
  cp.spin_budget = std::chrono::microseconds(spin_budget_us);
  cp.host_timeout = std::chrono::milliseconds(timeout_ms);
  auto rank = std::make_unique<CudaCpRank>();
  // Collective from here on (every rank constructs together): no GIL, so other Python threads
  // (say, another rank's driver thread in a test) keep running while this rank waits.
  py::gil_scoped_release release;
  if (world == "single") {
    rank->comm = make_single_rank_communicator();
    rank->device = device >= 0 ? device : 0;
  } else {
    auto nccl = make_nccl_communicator_from_env(std::chrono::milliseconds(timeout_ms));
    rank->device = device >= 0 ? device : nccl->device();
    rank->comm = std::move(nccl);
  }
  cp.world_size = rank->comm->world_size();
  rank->indexer = std::make_unique<CudaCpIndexer>(*rank->comm, rank->device, config, cp);
  rank->rank = rank->indexer->rank();
  rank->world_size = cp.world_size;
  rank->merged_heads = rank->indexer->merged_heads();
  return rank;
}

void bind_cuda(py::module_& m) {
  py::class_<CudaPlan>(m, "CudaPlan",
                       "A CUDA backend of its own with workspaces sized for every batch within "
                       "the limits: calls given it allocate nothing and never synchronize the "
                       "host (CUDA-graph capturable).")
      .def(py::init([](const SparseConfig& config, int max_reqs, int max_q_len, int64_t max_rows,
                       int64_t max_context, int device, bool validate_contents) {
             PlanLimits limits;
             limits.max_reqs = max_reqs;
             limits.max_q_len = max_q_len;
             limits.max_rows = max_rows;
             limits.max_context = max_context;
             py::gil_scoped_release release;
             return std::make_unique<CudaPlan>(config, limits, device, validate_contents);
           }),
           py::arg("config"), py::arg("max_reqs"), py::arg("max_q_len"), py::arg("max_rows"),
           py::arg("max_context"), py::arg("device"), py::arg("validate_contents"))
      .def_property_readonly("config", [](const CudaPlan& p) { return p.config(); })
      .def_property_readonly("max_reqs", [](const CudaPlan& p) { return p.limits().max_reqs; })
      .def_property_readonly("max_q_len", [](const CudaPlan& p) { return p.limits().max_q_len; })
      .def_property_readonly("max_rows", [](const CudaPlan& p) { return p.limits().max_rows; })
      .def_property_readonly("max_context",
                             [](const CudaPlan& p) { return p.limits().max_context; })
      .def_property_readonly("device", &CudaPlan::device_index)
      .def_property_readonly("validate_contents", &CudaPlan::validate_contents)
      .def(
          "device_status",
          [](CudaPlan& p, bool clear, Stream stream) {
            py::gil_scoped_release release;
            return p.device_status(clear, stream);
          },
          py::arg("clear"), py::arg("stream").none(true));

  py::class_<CudaCpRank>(m, "CudaCpRank", "One rank of the CUDA context-parallel indexer.")
      .def(py::init(&make_cuda_cp_rank), py::arg("config"), py::arg("world"), py::arg("device"),
           py::arg("max_reqs"), py::arg("max_q_len"), py::arg("max_context"), py::arg("transport"),
           py::arg("spin_budget_us"), py::arg("timeout_ms"))
      .def_property_readonly("rank", [](const CudaCpRank& r) { return r.rank; })
      .def_property_readonly("world_size", [](const CudaCpRank& r) { return r.world_size; })
      .def_property_readonly("device", [](const CudaCpRank& r) { return r.device; })
      .def_property_readonly("merged_heads", [](const CudaCpRank& r) { return r.merged_heads; })
      .def("close",
           [](CudaCpRank& r) {
             py::gil_scoped_release release;
             std::lock_guard<std::mutex> lock(r.mutex);
             r.indexer.reset();  // collective across processes (cp_cuda.h): every rank closes
             r.comm.reset();
           })
      .def(
          "select",
          [](CudaCpRank& r, int layer, py::handle index_q, py::handle index_cache, py::handle batch,
             py::handle topk_idx, Stream stream) {
            ImportScope scope(stream);
            IndexerArgs args;
            args.index_q = scope.tensor(index_q, "index_q");
            args.index_cache.data = scope.tensor(index_cache, "index_cache");
            args.batch = scope.batch(batch);
            args.topk_idx = scope.tensor(topk_idx, "topk_idx", /*writable=*/true);
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(r.mutex);
            r.live().select(layer, args, cuda_stream_handle(stream));
          },
          py::arg("layer"), py::arg("index_q"), py::arg("index_cache"), py::arg("batch"),
          py::arg("topk_idx"), py::arg("stream").none(true))
      .def(
          "check",
          [](CudaCpRank& r, Stream stream) {
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(r.mutex);
            r.live().check(cuda_stream_handle(stream));
          },
          py::arg("stream").none(true))
      .def("generation", [](CudaCpRank& r) {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(r.mutex);
        return r.live().generation();
      });
}

// ---- Configurations ----

void bind_configs(py::module_& m) {
  py::class_<SparseConfig> sparse(
      m, "SparseConfig",
      "What one sparse layer's kernels need, with head counts local to one "
      "rank. Defaults: MiniMax-M3 at TP=1 (docs/spec.md section 1).");
  const ConfigFields<SparseConfig> fields = sparse_config_fields();
  bind_config_fields(sparse, "SparseConfig", fields, fields);
  sparse.def_property_readonly("group_size", &SparseConfig::group_size, "query heads per KV head")
      .def_property_readonly("softmax_scale", &SparseConfig::softmax_scale, "1 / sqrt(head_dim)")
      .def_property_readonly("qkv_width", &SparseConfig::qkv_width,
                             "width of one token's fused projection [q | k | v | index_q | "
                             "index_k]")
      .def("validate", &SparseConfig::validate, "Raises m3msa.Error naming the first bad field.");
}

void bind_view(py::module_& m) {
  py::class_<TypedView>(m, "TypedView",
                        "An array paired with the m3msa dtype its bits hold (NumPy has no "
                        "bfloat16 or float8): made by m3msa.view(array, dtype).")
      .def(py::init([](py::object array, const std::string& dtype) {
             M3MSA_CHECK_ARG(!py::isinstance<TypedView>(array),
                             "array: already an m3msa.view; pass its .array");
             return TypedView{std::move(array), parse_dtype(dtype, "dtype")};
           }),
           py::arg("array"), py::arg("dtype"))
      .def_property_readonly("array", [](const TypedView& v) { return v.array; })
      .def_property_readonly("dtype",
                             [](const TypedView& v) { return std::string(dtype_name(v.dtype)); })
      .def_property_readonly("shape", [](const TypedView& v) { return v.array.attr("shape"); })
      .def("__repr__", [](const TypedView& v) {
        std::string what = Py_TYPE(v.array.ptr())->tp_name;
        if (py::hasattr(v.array, "dtype") && py::hasattr(v.array, "shape")) {
          what = std::string(py::str(v.array.attr("dtype"))) +
                 std::string(py::str(py::tuple(v.array.attr("shape"))));
        }
        return "m3msa.view(" + what + ", '" + dtype_name(v.dtype) + "')";
      });
}

}  // namespace
}  // namespace m3msa::python

PYBIND11_MODULE(_m3msa, m) {
  namespace py = pybind11;
  using namespace m3msa::python;
  m.doc() = "m3msa compiled bindings; use the m3msa package, which wraps this module.";
  m.attr("__version__") = M3MSA_VERSION_STRING;

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const m3msa::Error& error) {
      set_python_error(error);
    }
  });
  m.def("_set_error_type", &set_error_type, py::arg("type"));

  bind_view(m);
  bind_configs(m);

  bind_cuda(m);
  bind_runtime(m);
  m.def("select_topk", &select_topk, py::arg("config"), py::arg("index_q"), py::arg("index_cache"),
        py::arg("batch"), py::arg("topk_idx"), py::arg("order"), py::arg("major"),
        py::arg("threads"), py::arg("stream").none(true), py::arg("plan").none(true));
  m.def("sparse_attention", &sparse_attention, py::arg("config"), py::arg("q"), py::arg("kv_cache"),
        py::arg("kv_v").none(true), py::arg("kv_layout"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("batch"), py::arg("topk_idx").none(true), py::arg("out"), py::arg("threads"),
        py::arg("stream").none(true), py::arg("plan").none(true));
  m.def("preprocess", &preprocess, py::arg("config"), py::arg("qkv"), py::arg("q_norm"),
        py::arg("k_norm"), py::arg("index_q_norm"), py::arg("index_k_norm"), py::arg("positions"),
        py::arg("batch"), py::arg("kv_cache"), py::arg("kv_v").none(true), py::arg("kv_layout"),
        py::arg("k_scale"), py::arg("v_scale"), py::arg("index_cache"), py::arg("q_out"),
        py::arg("index_q_out"), py::arg("threads"), py::arg("stream").none(true),
        py::arg("plan").none(true));
  m.def("score_blocks", &score_blocks, py::arg("config"), py::arg("index_q"),
        py::arg("index_cache"), py::arg("batch"), py::arg("scores"), py::arg("threads"));
  m.def("nominate", &nominate, py::arg("config"), py::arg("index_q"), py::arg("index_cache"),
        py::arg("batch"), py::arg("shard"), py::arg("num_shards"), py::arg("keys"),
        py::arg("threads"));
  m.def("synthetic_case", &synthetic_case, py::arg("config"), py::arg("kind"), py::arg("num_reqs"),
        py::arg("q_len"), py::arg("seq_lens"), py::arg("min_context"), py::arg("max_context"),
        py::arg("chunk_lens"), py::arg("context_lens"), py::arg("padding_reqs"),
        py::arg("index_dtype"), py::arg("kv_dtype"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("extra_pages"), py::arg("query_scale"), py::arg("make_index_cache"),
        py::arg("make_kv_cache"), py::arg("seed"));

  m.def("built_with_cuda", &m3msa::built_with_cuda);
  m.def("cuda_device_count", &m3msa::cuda_device_count);
  m.def("cuda_backend_available", &cuda_backend_available);
#if M3MSA_PY_WITH_CP
  bind_cp(m);
  m.attr("has_cp") = true;
#else
  m.attr("has_cp") = false;
#endif
}
