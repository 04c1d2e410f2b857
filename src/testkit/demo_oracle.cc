#include "m3msa/testing/demo_oracle.h"

#include <array>

#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/testing/oracle.h"

namespace m3msa::testkit::demo {

namespace {

// The CPU runtime at TP = 1 (the oracle of the CUDA path).
class CpuRuntimeOracle final : public Oracle {
 public:
  CpuRuntimeOracle(const Spec& spec, int threads)
      : spec_(spec),
        model_(make_host_model(spec, 0, 1, threads)),
        comm_(make_single_rank_communicator()),
        rt_([](const std::string&) {}) {
    const PrepareResult p = rt_.prepare(model_.weights, spec.runtime_config(threads), *comm_);
    M3MSA_CHECK_INTERNAL(p == PrepareResult::kActive, "the CPU runtime oracle: prepare returned ",
                         prepare_result_name(p));
  }
  ~CpuRuntimeOracle() override {
    try {
      rt_.close();
    } catch (...) {
    }
  }
  std::string name() const override { return "the CPU runtime (TP = 1)"; }
  void begin_step(const Step& step) override {
    M3MSA_CHECK_INTERNAL(rt_.begin_step(step.batch),
                         "the CPU runtime oracle refused a step: ", rt_.stats().last_refusal);
  }
  void layer(int li, const Step& step, std::vector<uint16_t>& hidden,
             std::vector<uint16_t>& residual, std::vector<int32_t>& topk,
             HostTensor& scores) override {
    const int64_t rows = spec_.rows();
    const int64_t H = spec_.model.hidden;
    rt_.forward_layer(
        spec_.first_layer() + li, TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}),
        TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}), step.positions.view());
    topk.clear();
    if (spec_.is_dense(li)) return;  // no selection
    const Runtime::LayerTrace t = rt_.last_layer_trace();
    topk.assign(t.topk.ptr<const int32_t>(), t.topk.ptr<const int32_t>() + t.topk.numel());
    IndexerArgs idx;
    idx.index_q = t.index_q;
    idx.index_cache = model_.weights.layers[static_cast<std::size_t>(li)].index_cache;
    idx.batch = rt_.step_metadata();
    idx.topk_idx = t.topk;
    cpu::score_blocks(spec_.model.sparse(1), idx, scores.view());
  }

 private:
  Spec spec_;
  HostModel model_;
  std::unique_ptr<Communicator> comm_;
  Runtime rt_;
};

class ComposedOracle final : public Oracle {
 public:
  ComposedOracle(const Spec& spec, int threads) : spec_(spec), threads_(threads) {
    HostModel caches = make_host_model(spec, 0, 1, threads);
    for (int li = 0; li < spec.run_layers(); ++li) {
      master_.push_back(make_master_layer(spec, li, threads));
      const LayerWeights& w = caches.weights.layers[static_cast<std::size_t>(li)];
      kv_.push_back(w.kv_cache);
      index_.push_back(w.index_cache);
      norms_.push_back({w.q_norm, w.k_norm, w.index_q_norm, w.index_k_norm});
    }
    keep_ = std::move(caches.storage);
  }
  std::string name() const override {
    return "the independent reference (CPU reference ops + double-precision matmuls and norms, "
           "TP = 1)";
  }
  void begin_step(const Step&) override {}
  void layer(int li, const Step& step, std::vector<uint16_t>& hidden,
             std::vector<uint16_t>& residual, std::vector<int32_t>& topk,
             HostTensor& scores) override {
    const std::size_t l = static_cast<std::size_t>(li);
    const MasterLayer& m = master_[l];
    ReferenceLayer w;
    w.qkv = m.qkv;
    w.o_proj = m.o_proj;
    w.gate = m.gate;
    w.up = m.up;
    w.down = m.down;
    if (m.has_moe) w.moe = &m.moe;
    if (m.dense) w.dense_mlp = &m.dense_mlp;
    w.input_norm = m.input_norm;
    w.post_norm = m.post_norm;
    w.q_norm = norms_[l][0];
    w.k_norm = norms_[l][1];
    w.index_q_norm = norms_[l][2];
    w.index_k_norm = norms_[l][3];
    w.kv_cache = kv_[l];
    w.index_cache = index_[l];
    HostTensor selection;
    ReferenceOptions options;
    options.swiglu_limit = RuntimeConfig{}.swiglu_limit;  // what runtime_config() binds
    options.threads = threads_;
    options.select_out = &selection;
    options.scores_out = scores.view();
    if (m.dense) options.scores_out = {};
    reference_layer(spec_.model, w, step.batch, step.positions.view(), hidden, residual, options);
    topk.clear();
    if (!m.dense) {
      topk.assign(selection.ptr<int32_t>(), selection.ptr<int32_t>() + selection.numel());
    }
  }

 private:
  Spec spec_;
  int threads_;
  std::vector<MasterLayer> master_;
  std::vector<KVCache> kv_;
  std::vector<IndexCache> index_;
  std::vector<std::array<TensorView, 4>> norms_;
  std::vector<HostTensor> keep_;
};

}  // namespace

std::unique_ptr<Oracle> make_cpu_runtime_oracle(const Spec& spec, int threads) {
  return std::make_unique<CpuRuntimeOracle>(spec, threads);
}

std::unique_ptr<Oracle> make_composed_oracle(const Spec& spec, int threads) {
  return std::make_unique<ComposedOracle>(spec, threads);
}

}  // namespace m3msa::testkit::demo
