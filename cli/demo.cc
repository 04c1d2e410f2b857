// m3msa demo: decode steps of a synthetic model with M3's attention dimensions, checked.
//
// Default mode: the fused decode runtime (demo_runtime.h / demo_runtime.cc): prepare ->
// begin_step / forward_layer -> detach over a whole model (weights, caches, TP), timed, then a
// check of the runtime against a CPU oracle on a small configuration.
//
// --ops: the ops-level demo (this file). Per step and sparse layer: a random fused projection
// output [q | k | v | index_q | index_k] -> preprocess (norms, RoPE, insert of the step's tokens
// into the layer's caches) -> select_topk -> sparse_attention, on the chosen backend, then the
// checks:
//  - "oracle" (the default on the CPU reference, which has nothing to be compared with):
//    selections well-formed; selections exactly the top-k of the recomputed block scores; sparse
//    attention equal to dense causal attention wherever every row sees nb <= topk blocks (an extra
//    short-context "check" layer guarantees one such layer); with --ranks > 1, the CP selection
//    bit-identical to one rank's.
//  - "reference" (the default on any other backend): every output compared with the CPU reference
//    run on the same inputs (selections up to near-ties, values in ulps).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "backend_select.h"
#include "checks.h"
#include "commands.h"
#include "common.h"
#include "demo_runtime.h"
#include "json_out.h"
#include "m3msa/case_io.h"
#include "m3msa/cp_model.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/synthetic.h"
#include "progress.h"

namespace m3msa::cli {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

struct DemoOptions {
  int batch = 4;
  int64_t context = 8192;
  int q_len = 2;
  int layers = 2;
  int steps = 3;
  int ranks = 1;
  std::string index_dtype = "bf16";
  std::string kv_dtype = "bf16";
  std::string backend = "auto";
  std::string check = "auto";
  int threads = 0;
  uint64_t seed = 1;
  std::string save_dir;
  std::string json_path;
  bool quiet = false;
  bool ops = false;            // the ops-level demo instead of the runtime
  RuntimeDemoOptions runtime;  // the runtime-only flags (the shared ones are above)
};

// A named check accumulated over layers and steps.
struct CheckBook {
  std::vector<CheckResult> results;
  CheckResult& get(const std::string& key) {
    for (CheckResult& r : results) {
      if (r.name == key) return r;
    }
    CheckResult fresh;
    fresh.name = key;
    results.push_back(fresh);
    return results.back();
  }
  void add(const std::string& key, const CheckResult& r) {
    CheckResult& total = get(key);
    CheckResult copy = r;
    copy.name = key;
    total.merge(copy);
  }
};

struct DemoLayer {
  std::string label;  // "0", "1", ..., "check"
  int id = 0;         // layer id given to the CP model
  bool check_layer = false;
  int64_t context = 0;  // tokens cached per request before the first step
  SyntheticCase cache;  // caches and tables sized for the final length
  HostTensor q_norm, k_norm, index_q_norm, index_k_norm;
  // Reference mode: the caches as the CPU reference's own preprocess leaves them, step by step.
  HostTensor ref_index_cache, ref_kv_cache;
  TensorView d_index_cache, d_kv_cache, d_index_table, d_kv_table;
  TensorView d_q_norm, d_k_norm, d_index_q_norm, d_index_k_norm;
  std::vector<double> preprocess_ms, select_ms, attention_ms;
  CheckResult layer_check;  // every check of this layer, merged
  bool dense_checked = false;
  std::vector<int32_t> last_selection;  // row 0, head 0 of the last step
  int64_t last_nb = 0;
  int64_t last_seq_len = 0;
};

// The per-step batch of one layer (host tensors; `batch` views them).
struct StepBatch {
  HostTensor seq_lens, positions, slot_mapping, index_slot_mapping;
  BatchMeta batch;
};

StepBatch make_step_batch(const DemoLayer& layer, const SparseConfig& cfg, int reqs, int q_len,
                          int step) {
  StepBatch s;
  const int64_t rows = int64_t{reqs} * q_len;
  s.seq_lens = HostTensor(DType::kI32, {reqs});
  s.positions = HostTensor(DType::kI64, {rows});
  s.slot_mapping = HostTensor(DType::kI64, {rows});
  s.index_slot_mapping = HostTensor(DType::kI64, {rows});
  const int64_t seq_len = layer.context + int64_t{step + 1} * q_len;
  const int64_t max_blocks = layer.cache.index_block_table.shape()[1];
  const int bs = cfg.block_size;
  for (int r = 0; r < reqs; ++r) {
    s.seq_lens.ptr<int32_t>()[r] = static_cast<int32_t>(seq_len);
    for (int j = 0; j < q_len; ++j) {
      const int64_t row = int64_t{r} * q_len + j;
      const int64_t pos = seq_len - q_len + j;
      s.positions.ptr<int64_t>()[row] = pos;
      const int64_t block = pos / bs;
      s.slot_mapping.ptr<int64_t>()[row] =
          int64_t{layer.cache.kv_block_table.ptr<int32_t>()[r * max_blocks + block]} * bs +
          pos % bs;
      s.index_slot_mapping.ptr<int64_t>()[row] =
          int64_t{layer.cache.index_block_table.ptr<int32_t>()[r * max_blocks + block]} * bs +
          pos % bs;
    }
  }
  s.batch.kind = BatchKind::kDecode;
  s.batch.num_reqs = reqs;
  s.batch.q_len = q_len;
  s.batch.seq_lens = s.seq_lens.view();
  s.batch.index_block_table = layer.cache.index_block_table.view();
  s.batch.kv_block_table = layer.cache.kv_block_table.view();
  s.batch.slot_mapping = s.slot_mapping.view();
  s.batch.index_slot_mapping = s.index_slot_mapping.view();
  return s;
}

std::string selection_summary(const std::vector<int32_t>& list, int64_t nb) {
  std::string out;
  int shown = 0;
  int valid = 0;
  for (int32_t b : list) {
    if (b < 0) continue;
    ++valid;
    if (shown < 8) {
      if (shown) out += ' ';
      out += std::to_string(b);
      ++shown;
    }
  }
  if (valid > shown) out += " ...";
  return out + fmt::format(" ({} of {})", valid, nb);
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  double sum = 0;
  for (double x : v) sum += x;
  return sum / static_cast<double>(v.size());
}

std::string format_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024)
    return fmt::format("{:.1f} GiB", bytes / (1024.0 * 1024 * 1024));
  return fmt::format("{:.0f} MiB", bytes / (1024.0 * 1024));
}

int run_ops_demo(const DemoOptions& o) {
  const auto start = Clock::now();
  const ModelConfig model;
  const SparseConfig cfg = model.sparse(1);
  const DType index_dtype = parse_dtype(o.index_dtype, "--index-dtype");
  const DType kv_dtype = parse_dtype(o.kv_dtype, "--kv-dtype");
  const int reqs = o.batch;
  const int q = o.q_len;
  const int64_t rows = int64_t{reqs} * q;
  const int64_t final_len = o.context + int64_t{o.steps} * q;
  const int64_t dense_limit = int64_t{cfg.topk} * cfg.block_size;  // nb <= topk iff pos < this
  M3MSA_CHECK_ARG(final_len <= INT32_MAX, "--context + --steps * --q-len = ", final_len,
                  " does not fit the i32 seq_lens");

  std::string why_backend;
  std::unique_ptr<Backend> backend = select_backend(o.backend, o.threads, &why_backend);
  const bool reference_backend = is_cpu_reference(*backend);
  std::unique_ptr<Staging> staging = make_staging(*backend);
  plan_backend(*backend, cfg, reqs, q, rows, final_len);
  std::string check_mode = o.check;
  if (check_mode == "auto") check_mode = reference_backend ? "oracle" : "reference";
  const bool oracle = check_mode == "oracle";
  const bool reference = check_mode == "reference";
  const int hw_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.threads > 0 ? o.threads : hw_threads;

  // Context parallelism: the CPU model of the exchange (cp.h), one thread per rank.
  std::unique_ptr<CpuCpGroup> cp_group;
  if (o.ranks > 1) {
    if (backend->device().type != DeviceType::kCPU) {
      throw UsageError(fmt::format(
          "--ranks {}: context parallelism runs on the CPU model of the exchange (cp.h); use "
          "--backend cpu",
          o.ranks));
    }
    try {
      validate_cp_placement(o.ranks, cfg.index_heads);
    } catch (const Error& e) {
      throw UsageError("--ranks: " + e.message());
    }
    CpConfig cp;
    cp.world_size = o.ranks;
    cp.max_rows = static_cast<int>(rows);
    cp.threads = std::max(1, threads / o.ranks);
    cp_group = std::make_unique<CpuCpGroup>(cfg, cp);
  }

  // ---- The layers: o.layers sparse layers, plus a short "check" layer when theirs are long ----
  std::vector<DemoLayer> layers;
  const bool need_check_layer = oracle && final_len > dense_limit;
  const int total_layers = o.layers + (need_check_layer ? 1 : 0);
  Progress progress(!o.quiet);
  for (int l = 0; l < total_layers; ++l) {
    progress.update(fmt::format("building caches: layer {}/{}", l + 1, total_layers));
    DemoLayer layer;
    layer.id = l;
    layer.check_layer = l >= o.layers;
    layer.label = layer.check_layer ? "check" : std::to_string(l);
    layer.layer_check.name = "every check of this layer";
    layer.context =
        layer.check_layer
            ? std::max<int64_t>(0, std::min(o.context, dense_limit - int64_t{o.steps} * q))
            : o.context;
    SyntheticSpec spec;
    spec.config = cfg;
    spec.kind = BatchKind::kDecode;
    spec.num_reqs = reqs;
    spec.q_len = q;
    spec.seq_lens.assign(static_cast<std::size_t>(reqs), layer.context + int64_t{o.steps} * q);
    spec.index_dtype = index_dtype;
    spec.kv_dtype = kv_dtype;
    spec.seed = derive_seed(o.seed, 1, static_cast<uint64_t>(l));
    layer.cache = make_synthetic_case(spec);
    auto norm = [&](int dim, uint64_t which) {
      HostTensor w(DType::kBF16, {dim});
      fill_bf16(w, derive_seed(o.seed, 2 + which, static_cast<uint64_t>(l)), 0.1f);
      return w;
    };
    layer.q_norm = norm(cfg.head_dim, 0);
    layer.k_norm = norm(cfg.head_dim, 1);
    layer.index_q_norm = norm(cfg.index_dim, 2);
    layer.index_k_norm = norm(cfg.index_dim, 3);
    if (reference) {
      layer.ref_index_cache = clone(layer.cache.index_cache);
      layer.ref_kv_cache = clone(layer.cache.kv_cache);
    }
    layer.d_index_cache = staging->upload(layer.cache.index_cache);
    layer.d_kv_cache = staging->upload(layer.cache.kv_cache);
    layer.d_index_table = staging->upload(layer.cache.index_block_table);
    layer.d_kv_table = staging->upload(layer.cache.kv_block_table);
    layer.d_q_norm = staging->upload(layer.q_norm);
    layer.d_k_norm = staging->upload(layer.k_norm);
    layer.d_index_q_norm = staging->upload(layer.index_q_norm);
    layer.d_index_k_norm = staging->upload(layer.index_k_norm);
    layers.push_back(std::move(layer));
  }
  double cache_bytes = 0;
  for (const DemoLayer& layer : layers) {
    cache_bytes +=
        static_cast<double>(layer.cache.index_cache.nbytes() + layer.cache.kv_cache.nbytes());
  }

  if (!o.quiet) progress.finish();
  std::printf("m3msa demo: backend %s (%s), %d threads%s\n", backend->name().c_str(),
              why_backend.c_str(), threads,
              o.ranks > 1 ? fmt::format(", CP over {} ranks (CPU model)", o.ranks).c_str() : "");
  std::printf(
      "  batch %d, context %lld, q-len %d, %d sparse layer%s%s, %d step%s, index %s, kv %s, "
      "seed %llu, caches %s\n",
      reqs, static_cast<long long>(o.context), q, o.layers, o.layers == 1 ? "" : "s",
      need_check_layer ? " + 1 check layer" : "", o.steps, o.steps == 1 ? "" : "s",
      dtype_name(index_dtype), dtype_name(kv_dtype), static_cast<unsigned long long>(o.seed),
      format_bytes(cache_bytes).c_str());
  std::printf("  config: %s\n", cfg.to_string().c_str());
  std::fflush(stdout);

  CheckBook book;
  const std::string kWellFormed =
      "selections well-formed (a prefix of min(k, nb) distinct visible "
      "blocks, forced blocks first, then -1)";
  const std::string kVsScores =
      "selections are exactly the top-k of the recomputed block scores "
      "(cpu::score_blocks + docs/spec.md section 4 keys)";
  const std::string kNearTies =
      "selections match the top-k of the CPU reference scores (swaps "
      "only between near-tied blocks)";
  const std::string kDense =
      "sparse attention == dense causal attention where every row has "
      "nb <= topk (bf16 ulps)";
  const std::string kCp = "CP selection bit-identical to the one-rank selection";
  const std::string kRefPre = "preprocess outputs (q, index_q) vs the CPU reference (bf16 ulps)";
  const std::string kRefCache = "caches after the insert vs the CPU reference (ulps)";
  const std::string kRefAttn = "sparse attention vs the CPU reference on the same selection";

  const int64_t width = cfg.qkv_width();
  HostTensor qkv(DType::kBF16, {rows, width});
  for (int step = 0; step < o.steps; ++step) {
    for (DemoLayer& layer : layers) {
      progress.update(
          fmt::format("step {}/{} layer {}/{}", step + 1, o.steps, layer.id + 1, total_layers));
      StepBatch sb = make_step_batch(layer, cfg, reqs, q, step);
      fill_bf16(qkv, derive_seed(o.seed, 100 + static_cast<uint64_t>(step),
                                 static_cast<uint64_t>(layer.id)));
      HostTensor q_out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
      HostTensor index_q_out(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
      HostTensor topk(DType::kI32, {rows, cfg.index_heads, cfg.topk});
      HostTensor out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
      for (HostTensor* t : {&q_out, &index_q_out, &topk, &out}) t->fill_bytes(0xA5);  // poison

      // Device views of this step's tensors.
      BatchMeta d_batch = sb.batch;
      d_batch.seq_lens = staging->upload(sb.seq_lens);
      d_batch.slot_mapping = staging->upload(sb.slot_mapping);
      d_batch.index_slot_mapping = staging->upload(sb.index_slot_mapping);
      d_batch.index_block_table = layer.d_index_table;
      d_batch.kv_block_table = layer.d_kv_table;
      const IndexCache d_index_cache{layer.d_index_cache};
      const KVCache d_kv_cache{layer.d_kv_cache, layer.cache.k_scale, layer.cache.v_scale};

      PreprocessArgs pre;
      pre.qkv = staging->upload(qkv);
      pre.q_norm = layer.d_q_norm;
      pre.k_norm = layer.d_k_norm;
      pre.index_q_norm = layer.d_index_q_norm;
      pre.index_k_norm = layer.d_index_k_norm;
      pre.positions = staging->upload(sb.positions);
      pre.batch = d_batch;
      pre.kv_cache = d_kv_cache;
      pre.index_cache = d_index_cache;
      pre.q_out = staging->upload(q_out);
      pre.index_q_out = staging->upload(index_q_out);
      auto t0 = Clock::now();
      backend->preprocess(cfg, pre);
      backend->synchronize();
      layer.preprocess_ms.push_back(seconds_since(t0) * 1e3);

      IndexerArgs idx;
      idx.index_q = pre.index_q_out;
      idx.index_cache = d_index_cache;
      idx.batch = d_batch;
      idx.topk_idx = staging->upload(topk);
      t0 = Clock::now();
      if (cp_group) {
        cp_select_all(*cp_group, layer.id, idx);
      } else {
        backend->select_topk(cfg, idx);
      }
      backend->synchronize();
      layer.select_ms.push_back(seconds_since(t0) * 1e3);

      AttentionArgs att;
      att.q = pre.q_out;
      att.kv_cache = d_kv_cache;
      att.batch = d_batch;
      att.topk_idx = idx.topk_idx;
      att.out = staging->upload(out);
      t0 = Clock::now();
      backend->sparse_attention(cfg, att);
      backend->synchronize();
      layer.attention_ms.push_back(seconds_since(t0) * 1e3);

      // ---- Back to the host for the checks ----
      staging->download(pre.q_out, q_out);
      staging->download(pre.index_q_out, index_q_out);
      staging->download(idx.topk_idx, topk);
      staging->download(att.out, out);
      // The host copies of the caches take this step's insert (a no-op on the CPU backend).
      if (check_mode != "none" || (!o.save_dir.empty() && step == o.steps - 1 && layer.id == 0)) {
        staging->download(layer.d_index_cache, layer.cache.index_cache);
        staging->download(layer.d_kv_cache, layer.cache.kv_cache);
      }
      const IndexCache h_index_cache = layer.cache.index_cache_view();
      const KVCache h_kv_cache = layer.cache.kv_cache_view();
      IndexerArgs h_idx;
      h_idx.index_q = index_q_out.view();
      h_idx.index_cache = h_index_cache;
      h_idx.batch = sb.batch;
      h_idx.topk_idx = topk.view();
      AttentionArgs h_att;
      h_att.q = q_out.view();
      h_att.kv_cache = h_kv_cache;
      h_att.batch = sb.batch;
      h_att.topk_idx = topk.view();
      h_att.out = out.view();

      auto record = [&](const std::string& key, const CheckResult& r) {
        book.add(key, r);
        layer.layer_check.merge(r);
      };
      if (oracle) {
        record(kWellFormed, check_selections_wellformed(cfg, sb.batch, topk.view()));
        record(reference_backend ? kVsScores : kNearTies,
               check_selections_vs_scores(
                   cfg, h_idx, reference_backend ? 0.0 : kSelectionTieTolerance, threads));
        if (layer.context + int64_t{step + 1} * q <= dense_limit) {
          HostTensor dense(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
          AttentionArgs d = h_att;
          d.topk_idx = TensorView{};
          d.out = dense.view();
          cpu::dense_attention(cfg, d, threads);
          record(kDense, compare_values("attention", out.view(), dense.view(),
                                        reference_backend ? kSameBackendUlps : kCrossBackendUlps));
          layer.dense_checked = true;
        }
      }
      if (cp_group && check_mode != "none") {
        HostTensor one_rank(DType::kI32, {rows, cfg.index_heads, cfg.topk});
        IndexerArgs a = h_idx;
        a.topk_idx = one_rank.view();
        cpu::select_topk(cfg, a, threads);
        record(kCp, compare_exact("topk_idx", topk.view(), one_rank.view()));
      }
      if (reference) {
        HostTensor ref_q(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
        HostTensor ref_iq(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
        PreprocessArgs rp;
        rp.qkv = qkv.view();
        rp.q_norm = layer.q_norm.view();
        rp.k_norm = layer.k_norm.view();
        rp.index_q_norm = layer.index_q_norm.view();
        rp.index_k_norm = layer.index_k_norm.view();
        rp.positions = sb.positions.view();
        rp.batch = sb.batch;
        rp.kv_cache = KVCache{layer.ref_kv_cache.view(), layer.cache.k_scale, layer.cache.v_scale};
        rp.index_cache = IndexCache{layer.ref_index_cache.view()};
        rp.q_out = ref_q.view();
        rp.index_q_out = ref_iq.view();
        cpu::preprocess(cfg, rp, threads);
        CheckResult pre_check = compare_values("q", q_out.view(), ref_q.view(), 1.0);
        pre_check.merge(compare_values("index_q", index_q_out.view(), ref_iq.view(), 1.0));
        record(kRefPre, pre_check);
        CheckResult cache_check = compare_values("index_cache", layer.cache.index_cache.view(),
                                                 layer.ref_index_cache.view(), 1.0);
        cache_check.merge(compare_values("kv_cache", layer.cache.kv_cache.view(),
                                         layer.ref_kv_cache.view(), 1.0));
        record(kRefCache, cache_check);
        record(kWellFormed, check_selections_wellformed(cfg, sb.batch, topk.view()));
        record(reference_backend ? kVsScores : kNearTies,
               check_selections_vs_scores(
                   cfg, h_idx, reference_backend ? 0.0 : kSelectionTieTolerance, threads));
        HostTensor ref_out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
        AttentionArgs ra = h_att;
        ra.out = ref_out.view();
        cpu::sparse_attention(cfg, ra, threads);
        record(kRefAttn, compare_values("attention", out.view(), ref_out.view(),
                                        reference_backend ? 0.0 : kCrossBackendUlps));
      }

      layer.last_seq_len = layer.context + int64_t{step + 1} * q;
      layer.last_nb = visible_blocks(layer.last_seq_len - q, cfg.block_size);
      layer.last_selection.assign(topk.ptr<int32_t>(), topk.ptr<int32_t>() + cfg.topk);

      if (!o.save_dir.empty() && step == o.steps - 1 && layer.id == 0) {
        SyntheticCase snap;
        snap.config = cfg;
        snap.batch = sb.batch;
        snap.seq_lens = sb.seq_lens;
        snap.index_block_table = layer.cache.index_block_table;
        snap.kv_block_table = layer.cache.kv_block_table;
        snap.slot_mapping = sb.slot_mapping;
        snap.index_slot_mapping = sb.index_slot_mapping;
        snap.positions = sb.positions;
        snap.index_q = index_q_out;
        snap.q = q_out;
        snap.index_cache = layer.cache.index_cache;
        snap.kv_cache = layer.cache.kv_cache;
        snap.k_scale = layer.cache.k_scale;
        snap.v_scale = layer.cache.v_scale;
        save_case(o.save_dir, snap,
                  {{"expected_topk_idx", topk.view()}, {"expected_out", out.view()}},
                  fmt::format("{} (step {}, layer 0)", command_line(), step + 1), backend->name());
      }
    }
  }
  progress.finish();

  // ---- The table ----
  std::printf("\n%-6s %8s %7s %11s %11s %11s  %-40s %s\n", "layer", "seq_len", "nb", "preprocess",
              "select", "attention", "selected (last step, row 0, head 0)", "check");
  for (const DemoLayer& layer : layers) {
    std::string status =
        layer.layer_check.passed() ? "ok" : fmt::format("FAIL ({})", layer.layer_check.failed);
    if (layer.dense_checked && layer.layer_check.passed()) status += " (== dense)";
    if (check_mode == "none") status = "-";
    std::printf("%-6s %8lld %7lld %8.3f ms %8.3f ms %8.3f ms  %-40s %s\n", layer.label.c_str(),
                static_cast<long long>(layer.last_seq_len), static_cast<long long>(layer.last_nb),
                mean(layer.preprocess_ms), mean(layer.select_ms), mean(layer.attention_ms),
                selection_summary(layer.last_selection, layer.last_nb).c_str(), status.c_str());
  }
  std::printf("(times: mean per step over %d step%s; seq_len and nb of the last step)\n", o.steps,
              o.steps == 1 ? "" : "s");

  bool passed = true;
  if (check_mode == "none") {
    std::printf("\nchecks: none (--check none)\n");
  } else {
    std::printf("\nchecks (%s, against %s):\n", check_mode.c_str(),
                oracle ? (reference_backend
                              ? "independent oracles, as the backend is the CPU reference itself"
                              : "independent oracles")
                       : "the CPU reference");
    for (const CheckResult& r : book.results) {
      std::printf("  [%s] %s: %lld checked%s\n", r.passed() ? "ok" : "FAIL", r.name.c_str(),
                  static_cast<long long>(r.checked),
                  r.failed ? fmt::format(", {} failed", r.failed).c_str() : "");
      if (!r.detail.empty() && (!r.passed() || r.name == kDense || r.name == kRefAttn)) {
        std::printf("       %s\n", r.detail.c_str());
      }
      passed = passed && r.passed();
    }
    bool dense_any = false;
    for (const DemoLayer& layer : layers) dense_any = dense_any || layer.dense_checked;
    if (oracle && !dense_any) {
      std::printf(
          "  [--] dense comparison skipped: no step had nb <= topk on every row "
          "(steps * q-len >= %lld)\n",
          static_cast<long long>(dense_limit));
    }
  }
  if (!o.save_dir.empty())
    std::printf("saved the last step of layer 0 to %s\n", o.save_dir.c_str());
  const double wall = seconds_since(start);
  std::printf("%s (%.1f s)\n", passed ? "PASS" : "FAIL", wall);

  if (!o.json_path.empty()) {
    json j;
    j["command"] = command_line();
    j["mode"] = "ops";
    j["version"] = version_string();
    j["backend"] = backend->name();
    j["threads"] = threads;
    j["options"] = {{"batch", o.batch},
                    {"context", o.context},
                    {"q_len", o.q_len},
                    {"layers", o.layers},
                    {"steps", o.steps},
                    {"ranks", o.ranks},
                    {"index_dtype", o.index_dtype},
                    {"kv_dtype", o.kv_dtype},
                    {"seed", o.seed},
                    {"check", check_mode}};
    j["config"] = cfg.to_string();
    json jl = json::array();
    for (const DemoLayer& layer : layers) {
      jl.push_back({{"layer", layer.label},
                    {"seq_len", layer.last_seq_len},
                    {"nb", layer.last_nb},
                    {"preprocess_ms", layer.preprocess_ms},
                    {"select_ms", layer.select_ms},
                    {"attention_ms", layer.attention_ms},
                    {"selection_row0_head0", layer.last_selection},
                    {"check", check_json(layer.layer_check)}});
    }
    j["layers"] = jl;
    json jc = json::array();
    for (const CheckResult& r : book.results) jc.push_back(check_json(r));
    j["checks"] = jc;
    j["passed"] = passed;
    j["wall_s"] = wall;
    write_json_file(o.json_path, j);
  }
  return passed ? kExitOk : kExitCheckFailed;
}

}  // namespace

Command add_demo_command(CLI::App& parent) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* app = parent.add_subcommand(
      "demo",
      "Run checked decode steps of a synthetic model with M3's attention dimensions through the "
      "fused decode runtime (--ops: the single operations)");
  app->footer(
      "Default (the runtime): the model has 64 q heads, 4 KV / index heads, head dim 128, block "
      "128, top-16, hidden 6144 on the GPU (1024 on the CPU: --hidden), a dense SwiGLU-OAI MLP as "
      "the FFN, seeded random weights (bf16 or --weights fp8) and caches holding --context tokens "
      "per request. TP over the GPUs present (1 or 2; on the CPU 2 rank threads), CP off. It runs "
      "prepare -> --steps decode steps of --batch requests x --q-len rows (begin_step, "
      "forward_layer per layer) -> detach, prints each step's time and the runtime's stats, then "
      "checks a small configuration (hidden 512, 2 layers, 2 requests, 2 steps) on the same "
      "backend and TP against an oracle replaying every layer from the same input: on the GPU the "
      "CPU runtime, on the CPU an independent composition of the reference ops with "
      "double-precision matmuls.\n"
      "--ops: the ops-level demo: per step and layer a random projection output -> preprocess "
      "(inserts the step's tokens) -> select_topk -> sparse_attention on the backend, then the "
      "checks (--check). When the layers' context has more than top-k blocks, an extra short "
      "'check' layer (nb <= topk) is run so sparse attention can be compared with dense causal "
      "attention.\n"
      "Exit codes: 0 every check passed, 1 a check failed (or the runtime fell back), 2 bad "
      "flags, 3 a library error.");
  app->add_flag("--ops", o->ops,
                "run the ops-level demo (preprocess / select_topk / sparse_attention checked one "
                "by one) instead of the runtime");
  app->add_option("--batch", o->batch, "requests per decode step")->check(CLI::Range(1, 4096));
  app->add_option("--context", o->context,
                  "tokens already cached per request before the first step (runtime: request r "
                  "holds r blocks + r tokens fewer)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app->add_option("--q-len", o->q_len,
                  "new tokens per request and step (1 = plain decode, >1 = speculative verify)")
      ->check(CLI::Range(1, 8));
  app->add_option("--layers", o->layers, "sparse layers (each with its own caches and weights)")
      ->check(CLI::Range(1, 57));
  app->add_option("--steps", o->steps, "decode steps")->check(CLI::Range(1, 100000));
  app->add_option("--backend", o->backend, "auto (CUDA when usable, else CPU), cpu or cuda")
      ->check(CLI::IsMember(backend_choices()));
  app->add_option("--check", o->check,
                  "auto: the runtime's check (--ops: 'oracle' on the CPU reference, 'reference' "
                  "on other backends); none; --ops only: oracle (well-formed selections, exact "
                  "top-k of the block scores, sparse == dense where nb <= topk), reference "
                  "(every output vs the CPU reference)")
      ->check(CLI::IsMember({"auto", "oracle", "reference", "none"}));
  app->add_option("--threads", o->threads, "CPU threads (0 = all hardware threads)")
      ->check(CLI::Range(0, 4096));
  app->add_option("--seed", o->seed, "seed of every random tensor");
  app->add_option("--json", o->json_path, "also write the results as JSON to this file");
  app->add_flag("-q,--quiet", o->quiet, "no progress indicator on stderr");
  // The runtime only.
  RuntimeDemoOptions& rt = o->runtime;
  std::vector<CLI::Option*> runtime_only = {
      app->add_option("--tp", rt.tp,
                      "tensor-parallel ranks (0 = the GPUs present, at most 2; on the CPU 2 rank "
                      "threads); runtime only")
          ->check(CLI::Range(0, 2)),
      app->add_flag("--cp", rt.cp,
                    "context parallelism: the indexer spread over the TP ranks (each scores 1/TP "
                    "of the blocks, nominations exchanged, selections bit-identical); runtime "
                    "only"),
      app->add_option("--weights", rt.weights,
                      "dtype of qkv_proj and o_proj (fp8: e4m3 with per-output-channel scales); "
                      "runtime only")
          ->check(CLI::IsMember({"bf16", "fp8"})),
      app->add_option("--hidden", rt.hidden,
                      "hidden size (0 = 6144, M3's, on the GPU; 1024 on the CPU); multiple of 64; "
                      "runtime only")
          ->check(CLI::Range(0, 65536)),
      app->add_option("--intermediate", rt.intermediate,
                      "width of the dense SwiGLU-OAI MLP (0 = the hidden size); runtime only")
          ->check(CLI::Range(0, 262144)),
      app->add_flag("--moe", rt.moe,
                    "the mixture of experts after every sparse layer instead of the dense MLP "
                    "(16 experts of width 256, top-4, one shared expert; docs/spec.md section "
                    "8), and the dense layers 0..first_sparse_layer-1 (dense attention, dense "
                    "MLP of width 1024) in front; runtime only"),
      app->add_option("--moe-weights", rt.moe_weights,
                      "--moe: the experts' and the dense MLPs' format (mxfp8: e4m3 + e8m0 scale "
                      "per 32); runtime only")
          ->check(CLI::IsMember({"mxfp8", "bf16"})),
  };
  // The ops-level demo only.
  std::vector<CLI::Option*> ops_only = {
      app->add_option("--ranks", o->ranks,
                      "--ops: context-parallel ranks for the indexer (threads running the CPU "
                      "model of the exchange, cp.h); must divide 4 or be a multiple of it")
          ->check(CLI::Range(1, 64)),
      app->add_option("--index-dtype", o->index_dtype, "--ops: index-K cache dtype")
          ->check(CLI::IsMember({"bf16", "fp8"})),
      app->add_option("--kv-dtype", o->kv_dtype, "--ops: main KV cache dtype")
          ->check(CLI::IsMember({"bf16", "fp8"})),
      app->add_option("--save", o->save_dir,
                      "--ops: write the last step of layer 0 as a replay case to this directory "
                      "(case.json + .npy files; bf16 / fp8 stored as uint16 / uint8, see "
                      "docs/replay.md)"),
  };
  return {app, [o, runtime_only, ops_only]() {
            const auto& wrong = o->ops ? runtime_only : ops_only;
            for (const CLI::Option* opt : wrong) {
              if (opt->count() > 0) {
                throw UsageError(fmt::format("{}: {}", opt->get_name(),
                                             o->ops ? "not with --ops (the runtime demo only)"
                                                    : "only with --ops (the ops-level demo)"));
              }
            }
            if (o->ops) return run_ops_demo(*o);
            if (o->check != "auto" && o->check != "none") {
              throw UsageError("--check " + o->check +
                               ": only with --ops (the runtime demo takes auto or none)");
            }
            RuntimeDemoOptions r = o->runtime;
            r.batch = o->batch;
            r.context = o->context;
            r.q_len = o->q_len;
            r.layers = o->layers;
            r.steps = o->steps;
            r.backend = o->backend;
            r.check = o->check;
            r.threads = o->threads;
            r.seed = o->seed;
            r.json_path = o->json_path;
            r.quiet = o->quiet;
            return run_runtime_demo(r);
          }};
}

}  // namespace m3msa::cli
