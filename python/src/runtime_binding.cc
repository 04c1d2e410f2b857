// The runtime (include/m3msa/runtime.h) from Python, thin: the lifecycle calls with their
// collective semantics, the communicators they run over, and nothing the C++ API does not have.
// Every call releases the GIL, so one Python thread per rank can drive a ThreadGroup.
#include "runtime_binding.h"

#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "config_fields.h"
#include "dispatch.h"
#include "interop.h"
#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"

namespace m3msa::python {
namespace {

// A communicator handle (m3msa.Communicator): one rank's end of a group. A Runtime keeps the one
// it was prepared over alive until close() or detach().
struct PyCommunicator {
  std::unique_ptr<Communicator> comm;
  Communicator& get() {
    M3MSA_CHECK_ARG(comm != nullptr, "communicator: not initialized");
    return *comm;
  }
};

// C++ names as Python identifiers: "not ready" -> "not_ready".
std::string key(const char* name) {
  std::string out(name);
  for (char& c : out) {
    if (c == ' ') c = '_';
  }
  return out;
}

// The log sink: a Python callable, called with the GIL (the runtime calls it from prepare, which
// runs without the GIL). Shared so that copies of the std::function never touch Python refcounts
// without the GIL; the last copy releases the callable under the GIL.
Runtime::LogSink make_log_sink(py::object log) {
  if (log.is_none()) return {};
  std::shared_ptr<py::object> callable(new py::object(std::move(log)), [](py::object* object) {
    py::gil_scoped_acquire gil;
    delete object;
  });
  return [callable](const std::string& line) {
    py::gil_scoped_acquire gil;
    try {
      (*callable)(line);
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("m3msa.Runtime log callback");
    }
  };
}

struct PyRuntime {
  explicit PyRuntime(py::object log) : runtime(std::make_unique<Runtime>(make_log_sink(log))) {}

  // Runs body(runtime) holding the runtime's mutex, with the GIL released first (taking the
  // mutex while holding the GIL could deadlock against a call that holds the mutex and waits
  // for the GIL to return).
  template <typename Body>
  auto locked(Body&& body) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex);
    return body(*runtime);
  }

  std::unique_ptr<Runtime> runtime;
  // While bound: the communicator and the imports of the bound tensors (the runtime holds views
  // of the caller's memory; the imports keep DLPack producers' tensors alive).
  py::object comm;
  std::unique_ptr<ImportScope> bound;
  std::mutex mutex;

  void release_binding() {
    bound.reset();
    comm = py::none();
  }
};

float float_field(py::handle object, const char* field, float fallback) {
  if (!py::hasattr(object, field)) return fallback;
  const py::object value = object.attr(field);
  return value.is_none() ? fallback : value.cast<float>();
}

py::object field(py::handle object, const char* name, const std::string& where) {
  M3MSA_CHECK_ARG(py::hasattr(object, name), where, ": expected an m3msa.LayerWeights, got a ",
                  Py_TYPE(object.ptr())->tp_name, " without '", name, "'");
  return object.attr(name);
}

LayerWeights import_layer(ImportScope& scope, py::handle layer, std::size_t index) {
  const std::string where = "layers[" + std::to_string(index) + "]";
  LayerWeights w;
  w.layer = field(layer, "layer", where).cast<int>();
  auto tensor = [&](const char* name, TensorView& out, bool optional, bool writable) {
    const std::string label = where + "." + name;
    const py::object value = field(layer, name, where);
    out = optional ? scope.optional_tensor(value, label.c_str(), writable)
                   : scope.tensor(value, label.c_str(), writable);
  };
  tensor("qkv_proj", w.qkv_proj, false, false);
  tensor("qkv_proj_scale", w.qkv_proj_scale, true, false);
  tensor("q_norm", w.q_norm, false, false);
  tensor("k_norm", w.k_norm, false, false);
  // The index part is absent from a dense layer (the runtime names what a layer lacks).
  tensor("index_q_norm", w.index_q_norm, true, false);
  tensor("index_k_norm", w.index_k_norm, true, false);
  tensor("input_norm", w.input_norm, false, false);
  tensor("post_attention_norm", w.post_attention_norm, false, false);
  tensor("o_proj", w.o_proj, false, false);
  tensor("o_proj_scale", w.o_proj_scale, true, false);
  tensor("kv_cache", w.kv_cache.data, false, true);
  w.kv_cache.k_scale = float_field(layer, "k_scale", 1.0f);
  w.kv_cache.v_scale = float_field(layer, "v_scale", 1.0f);
  tensor("index_cache", w.index_cache.data, true, true);
  tensor("mlp_gate_up", w.mlp_gate_up, true, false);
  tensor("mlp_down", w.mlp_down, true, false);
  // The mixture of experts (docs/spec.md section 8): optional, and absent from objects that
  // predate it.
  auto moe_tensor = [&](const char* name, TensorView& out) {
    if (!py::hasattr(layer, name)) return;
    const std::string label = where + "." + name;
    out = scope.optional_tensor(layer.attr(name), label.c_str(), false);
  };
  moe_tensor("router_weight", w.router_weight);
  moe_tensor("router_bias", w.router_bias);
  moe_tensor("experts_w13", w.experts.w13);
  moe_tensor("experts_w13_scale", w.experts.w13_scale);
  moe_tensor("experts_w2", w.experts.w2);
  moe_tensor("experts_w2_scale", w.experts.w2_scale);
  moe_tensor("shared_w13", w.shared_expert.w13);
  moe_tensor("shared_w13_scale", w.shared_expert.w13_scale);
  moe_tensor("shared_w2", w.shared_expert.w2);
  moe_tensor("shared_w2_scale", w.shared_expert.w2_scale);
  // A dense layer's MLP (the shared expert's format).
  moe_tensor("dense_w13", w.dense_mlp.w13);
  moe_tensor("dense_w13_scale", w.dense_mlp.w13_scale);
  moe_tensor("dense_w2", w.dense_mlp.w2);
  moe_tensor("dense_w2_scale", w.dense_mlp.w2_scale);
  return w;
}

// ModelConfig is a SparseConfig with global head counts (config.h): it inherits the attention
// fields' attributes from the SparseConfig binding (module.cc) and adds its own; its constructor,
// repr and == cover both.
void bind_model_config(py::module_& m) {
  using M = ModelConfig;
  const ConfigFields<M> own = {{"hidden", &M::hidden},
                               {"num_layers", &M::num_layers},
                               {"first_sparse_layer", &M::first_sparse_layer},
                               {"intermediate", &M::intermediate},
                               {"num_experts", &M::num_experts},
                               {"experts_per_token", &M::experts_per_token},
                               {"moe_intermediate", &M::moe_intermediate},
                               {"shared_experts", &M::shared_experts},
                               {"dense_intermediate", &M::dense_intermediate},
                               {"routed_scaling", &M::routed_scaling},
                               {"activation_limit", &M::activation_limit}};
  ConfigFields<M> all(own.begin(), own.begin() + 3);  // hidden, num_layers, first_sparse_layer
  for (const auto& f : widen_fields<M>(sparse_config_fields())) all.push_back(f);
  all.insert(all.end(), own.begin() + 3, own.end());
  py::class_<ModelConfig, SparseConfig> model(
      m, "ModelConfig",
      "The whole model, with global head counts (a SparseConfig at TP=1 plus the model's own "
      "fields). Defaults: MiniMax-M3.");
  bind_config_fields(model, "ModelConfig", own, all);
  model.def_property_readonly("num_sparse_layers", &ModelConfig::num_sparse_layers)
      .def("sparse", &ModelConfig::sparse, py::arg("tp_size") = 1,
           py::arg("context_parallel") = false,
           "The per-rank SparseConfig under tensor parallelism of tp_size ranks (with "
           "context_parallel: the CP view, every index head on every rank).")
      .def("validate", &ModelConfig::validate);
}

void bind_config(py::module_& m) {
  const RuntimeConfig d;
  py::class_<RuntimeConfig>(
      m, "RuntimeConfig",
      "What every rank of a runtime must agree on, plus the rank-local "
      "threads and indexer_overlap (runtime.h). The CUDA stream is prepare()'s stream=.")
      .def(
          py::init([](const ModelConfig& model, int pipeline_parallel_size, int cache_block_size,
                      std::vector<int> token_buckets, std::vector<int> query_lens, int max_requests,
                      int64_t max_context, bool context_parallel, const std::string& cp_transport,
                      int selection_share_period, const std::string& tp_allreduce,
                      float swiglu_limit, int threads, const std::string& indexer_overlap) {
            RuntimeConfig c;
            c.model = model;
            c.pipeline_parallel_size = pipeline_parallel_size;
            c.cache_block_size = cache_block_size;
            c.token_buckets = std::move(token_buckets);
            c.query_lens = std::move(query_lens);
            c.max_requests = max_requests;
            c.max_context = max_context;
            c.context_parallel = context_parallel;
            c.cp_transport = parse_cp_transport(cp_transport);
            c.selection_share_period = selection_share_period;
            c.tp_allreduce = parse_tp_allreduce(tp_allreduce);
            c.swiglu_limit = swiglu_limit;
            c.threads = threads;
            c.indexer_overlap = parse_indexer_overlap(indexer_overlap);
            return c;
          }),
          py::kw_only(), py::arg("model") = d.model,
          py::arg("pipeline_parallel_size") = d.pipeline_parallel_size,
          py::arg("cache_block_size") = d.cache_block_size,
          py::arg("token_buckets") = d.token_buckets, py::arg("query_lens") = d.query_lens,
          py::arg("max_requests") = d.max_requests, py::arg("max_context") = d.max_context,
          py::arg("context_parallel") = d.context_parallel,
          py::arg("cp_transport") = cp_transport_name(d.cp_transport),
          py::arg("selection_share_period") = d.selection_share_period,
          py::arg("tp_allreduce") = tp_allreduce_name(d.tp_allreduce),
          py::arg("swiglu_limit") = d.swiglu_limit, py::arg("threads") = d.threads,
          py::arg("indexer_overlap") = indexer_overlap_name(d.indexer_overlap))
      .def_readwrite("model", &RuntimeConfig::model)
      .def_readwrite("pipeline_parallel_size", &RuntimeConfig::pipeline_parallel_size)
      .def_readwrite("cache_block_size", &RuntimeConfig::cache_block_size)
      .def_readwrite("token_buckets", &RuntimeConfig::token_buckets)
      .def_readwrite("query_lens", &RuntimeConfig::query_lens)
      .def_readwrite("max_requests", &RuntimeConfig::max_requests)
      .def_readwrite("max_context", &RuntimeConfig::max_context)
      .def_readwrite("context_parallel", &RuntimeConfig::context_parallel)
      .def_property(
          "cp_transport", [](const RuntimeConfig& c) { return cp_transport_name(c.cp_transport); },
          [](RuntimeConfig& c, const std::string& v) { c.cp_transport = parse_cp_transport(v); })
      .def_readwrite("selection_share_period", &RuntimeConfig::selection_share_period)
      .def_property(
          "tp_allreduce", [](const RuntimeConfig& c) { return tp_allreduce_name(c.tp_allreduce); },
          [](RuntimeConfig& c, const std::string& v) { c.tp_allreduce = parse_tp_allreduce(v); })
      .def_readwrite("swiglu_limit", &RuntimeConfig::swiglu_limit)
      .def_readwrite("threads", &RuntimeConfig::threads)
      .def_property(
          "indexer_overlap",
          [](const RuntimeConfig& c) { return indexer_overlap_name(c.indexer_overlap); },
          [](RuntimeConfig& c, const std::string& v) {
            c.indexer_overlap = parse_indexer_overlap(v);
          })
      .def("__repr__",
           [](const RuntimeConfig& c) { return "RuntimeConfig(" + c.to_string() + ")"; });
}

void bind_communicators(py::module_& m) {
  py::class_<PyCommunicator>(m, "Communicator", "One rank's handle on a communicator (comm.h).")
      .def_static(
          "single",
          [] {
            auto handle = std::make_unique<PyCommunicator>();
            handle->comm = make_single_rank_communicator();
            return handle;
          },
          "A world of one rank (TP = 1).")
      .def_static(
          "nccl_from_env",
          [](int64_t timeout_ms) {
            M3MSA_CHECK_ARG(timeout_ms > 0, "timeout_ms must be > 0, got ", timeout_ms);
            auto handle = std::make_unique<PyCommunicator>();
            py::gil_scoped_release release;  // collective: waits for the other processes
            handle->comm = make_nccl_communicator_from_env(std::chrono::milliseconds(timeout_ms));
            return handle;
          },
          py::arg("timeout_ms"),
          "One rank per process over NCCL: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
          "LOCAL_RANK from the environment.")
      .def_property_readonly("rank", [](PyCommunicator& c) { return c.get().rank(); })
      .def_property_readonly("world_size", [](PyCommunicator& c) { return c.get().world_size(); })
      .def("__repr__",
           [](PyCommunicator& c) { return "m3msa.Communicator(" + c.get().name() + ")"; });

  py::class_<ThreadGroup, std::shared_ptr<ThreadGroup>>(
      m, "ThreadGroup", "Ranks as threads of this process: one Python thread drives each rank.")
      .def(py::init([](int world_size, int64_t timeout_ms) {
             M3MSA_CHECK_ARG(timeout_ms > 0, "timeout_ms must be > 0, got ", timeout_ms);
             return ThreadGroup::create(world_size, std::chrono::milliseconds(timeout_ms));
           }),
           py::arg("world_size"), py::arg("timeout_ms"))
      .def_property_readonly("world_size", &ThreadGroup::world_size)
      .def_property_readonly("broken", &ThreadGroup::broken)
      .def_property_readonly("broken_reason", &ThreadGroup::broken_reason)
      .def(
          "communicator",
          [](ThreadGroup& group, int rank) {
            M3MSA_CHECK_ARG(rank >= 0 && rank < group.world_size(), "rank must be in [0, ",
                            group.world_size(), "), got ", rank);
            auto handle = std::make_unique<PyCommunicator>();
            handle->comm = group.communicator(rank);
            return handle;
          },
          py::arg("rank"));
}

void bind_runtime_class(py::module_& m) {
  py::class_<PyRuntime>(m, "Runtime", "One rank's fused decode runtime (runtime.h).")
      .def(py::init([](py::object log) { return std::make_unique<PyRuntime>(std::move(log)); }),
           py::arg("log").none(true))
      .def(
          "prepare",
          [](PyRuntime& self, py::sequence layers, const RuntimeConfig& config, py::object comm,
             bool capturing, bool has_metadata, Stream stream, bool cuda) {
            auto& handle = comm.cast<PyCommunicator&>();
            auto scope = std::make_unique<ImportScope>(stream);
            ModelWeights model;
            for (std::size_t i = 0; i < layers.size(); ++i) {
              model.layers.push_back(import_layer(*scope, layers[i], i));
            }
            RuntimeConfig rank_config = config;
            rank_config.cuda_stream = cuda ? cuda_stream_handle(stream) : nullptr;
            StepContext step;
            step.capturing = capturing;
            step.has_metadata = has_metadata;
            bool newly_bound = false;
            const PrepareResult result = self.locked([&](Runtime& r) {
              const bool was_active = r.state() == RuntimeState::kActive;
              const PrepareResult outcome = r.prepare(model, rank_config, handle.get(), step);
              newly_bound = !was_active && r.state() == RuntimeState::kActive;
              return outcome;
            });
            if (newly_bound) {  // the runtime now holds views of these imports
              self.bound = std::move(scope);
              self.comm = comm;
            }
            return key(prepare_result_name(result));
          },
          py::arg("layers"), py::arg("config"), py::arg("comm"), py::arg("capturing"),
          py::arg("has_metadata"), py::arg("stream").none(true), py::arg("cuda"))
      .def(
          "begin_step",
          [](PyRuntime& self, py::handle batch, int pad_to_reqs, Stream stream) {
            ImportScope scope(stream);
            const BatchMeta meta = scope.batch(batch);
            return self.locked([&](Runtime& r) {
              return pad_to_reqs < 0 ? r.begin_step(meta) : r.begin_step(meta, pad_to_reqs);
            });
          },
          py::arg("batch"), py::arg("pad_to_reqs"), py::arg("stream").none(true))
      .def(
          "forward_layer",
          [](PyRuntime& self, int layer, py::handle hidden, py::handle residual,
             py::handle positions, Stream stream) {
            ImportScope scope(stream);
            const TensorView h = scope.tensor(hidden, "hidden", /*writable=*/true);
            const TensorView r = scope.tensor(residual, "residual", /*writable=*/true);
            const TensorView p = scope.tensor(positions, "positions");
            self.locked([&](Runtime& runtime) { runtime.forward_layer(layer, h, r, p); });
          },
          py::arg("layer"), py::arg("hidden"), py::arg("residual"), py::arg("positions"),
          py::arg("stream").none(true))
      .def(
          "detach",
          [](PyRuntime& self, py::sequence replacement) {
            ImportScope scope;
            std::vector<LayerCaches> caches;
            for (std::size_t i = 0; i < replacement.size(); ++i) {
              const py::tuple entry = replacement[i].cast<py::tuple>();
              M3MSA_CHECK_ARG(entry.size() == 3, "replacement[", i,
                              "]: expected (layer, kv_cache, index_cache), got ", entry.size(),
                              " items");
              const std::string where = "replacement[" + std::to_string(i) + "]";
              LayerCaches c;
              c.layer = entry[0].cast<int>();
              c.kv_cache.data = scope.optional_tensor(entry[1], (where + ".kv_cache").c_str());
              c.index_cache.data =
                  scope.optional_tensor(entry[2], (where + ".index_cache").c_str());
              caches.push_back(c);
            }
            self.locked([&](Runtime& r) { r.detach(caches); });
            self.release_binding();
          },
          py::arg("replacement"))
      .def("close",
           [](PyRuntime& self) {
             const RuntimeState state = self.locked([](Runtime& r) {
               r.close();
               return r.state();
             });
             if (state != RuntimeState::kActive) self.release_binding();
           })
      .def("stats_json",
           [](PyRuntime& self) {
             return self.locked([](Runtime& r) { return r.stats().to_json(); });
           })
      .def_property_readonly("state", [](PyRuntime& self) {
        return self.locked([](Runtime& r) { return key(runtime_state_name(r.state())); });
      });
}

}  // namespace

void bind_runtime(py::module_& m) {
  bind_model_config(m);
  bind_config(m);
  bind_communicators(m);
  bind_runtime_class(m);
}

}  // namespace m3msa::python
