// m3msa replay DIR: run one captured step (select_topk + sparse_attention) from files and write
// every output as .npy. See docs/replay.md for the case format.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "backend_select.h"
#include "checks.h"
#include "commands.h"
#include "common.h"
#include "json_out.h"
#include "m3msa/case_io.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/npy.h"

namespace m3msa::cli {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct ReplayOptions {
  std::string dir;
  std::string out_dir;
  std::string backend = "auto";
  int threads = 0;
  bool check = false;
  std::string json_path;
  bool quiet = false;
};

int run_replay(const ReplayOptions& o) {
  LoadedCase loaded = load_case(o.dir);
  SyntheticCase& c = loaded.step;
  const SparseConfig& cfg = c.config;
  try {
    validate_batch_contents(c.batch, cfg, c.index_cache.shape()[0], c.kv_cache.shape()[0]);
  } catch (const Error& e) {
    throw Error(e.code(), o.dir + ": " + e.message());
  }
  const int64_t rows = c.num_rows();
  const std::vector<RowPosition> positions = row_positions(c.batch);
  int64_t min_nb = -1, max_nb = 0, dead = 0;
  for (const RowPosition& p : positions) {
    const int64_t nb = visible_blocks(p.pos, cfg.block_size);
    if (p.pos < 0) {
      ++dead;
      continue;
    }
    min_nb = min_nb < 0 ? nb : std::min(min_nb, nb);
    max_nb = std::max(max_nb, nb);
  }

  std::string why_backend;
  std::unique_ptr<Backend> backend = select_backend(o.backend, o.threads, &why_backend);
  const bool reference_backend = is_cpu_reference(*backend);
  std::unique_ptr<Staging> staging = make_staging(*backend);
  int64_t max_context = 0;
  for (const RowPosition& p : positions) max_context = std::max(max_context, p.pos + 1);
  const int max_q_len = c.batch.kind == BatchKind::kDecode ? c.batch.q_len : 1;
  plan_backend(*backend, cfg, c.batch.num_reqs, max_q_len, rows, max_context);
  const int hw_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.threads > 0 ? o.threads : hw_threads;

  std::printf(
      "m3msa replay %s: %s batch, %d request%s, %lld rows (%lld dead), nb %lld..%lld, "
      "index %s, kv %s (layout %s)\n",
      o.dir.c_str(), c.batch.kind == BatchKind::kDecode ? "decode" : "prefill", c.batch.num_reqs,
      c.batch.num_reqs == 1 ? "" : "s", static_cast<long long>(rows), static_cast<long long>(dead),
      static_cast<long long>(std::max<int64_t>(min_nb, 0)), static_cast<long long>(max_nb),
      dtype_name(c.index_cache.dtype()), dtype_name(c.kv_cache.dtype()),
      kv_layout_name(c.kv_layout));
  if (!loaded.source.empty()) std::printf("  source: %s\n", loaded.source.c_str());
  std::printf("  backend %s (%s)\n", backend->name().c_str(), why_backend.c_str());

  HostTensor topk(DType::kI32, {rows, cfg.index_heads, cfg.topk});
  HostTensor out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
  topk.fill_bytes(0xA5);
  out.fill_bytes(0xA5);

  BatchMeta d_batch = c.batch;
  auto up = [&](const HostTensor& t) {
    return t.empty() && t.shape().empty() ? TensorView{} : staging->upload(t);
  };
  d_batch.seq_lens = up(c.seq_lens);
  d_batch.cu_seqlens_q = up(c.cu_seqlens_q);
  d_batch.context_lens = up(c.context_lens);
  d_batch.index_block_table = up(c.index_block_table);
  d_batch.kv_block_table = up(c.kv_block_table);
  d_batch.slot_mapping = up(c.slot_mapping);
  d_batch.index_slot_mapping = up(c.index_slot_mapping);

  IndexerArgs idx;
  idx.index_q = up(c.index_q);
  idx.index_cache = IndexCache{up(c.index_cache)};
  idx.batch = d_batch;
  idx.topk_idx = up(topk);
  auto t0 = Clock::now();
  backend->select_topk(cfg, idx);
  backend->synchronize();
  const double select_ms = seconds_since(t0) * 1e3;

  AttentionArgs att;
  att.q = up(c.q);
  att.kv_cache = kv_cache_from_layout(up(c.kv_cache), c.kv_layout, c.k_scale, c.v_scale);
  att.batch = d_batch;
  att.topk_idx = idx.topk_idx;
  att.out = up(out);
  t0 = Clock::now();
  backend->sparse_attention(cfg, att);
  backend->synchronize();
  const double attention_ms = seconds_since(t0) * 1e3;
  staging->download(idx.topk_idx, topk);
  staging->download(att.out, out);

  const std::string out_dir = o.out_dir.empty() ? o.dir : o.out_dir;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  M3MSA_CHECK_ARG(!ec && fs::is_directory(out_dir), "--out: cannot create ", out_dir, " (",
                  ec.message(), ")");
  save_npy((fs::path(out_dir) / "topk_idx.npy").string(), topk.view());
  save_npy((fs::path(out_dir) / "out.npy").string(), out.view());
  std::printf("  select_topk %.3f ms, sparse_attention %.3f ms\n", select_ms, attention_ms);
  std::printf("  wrote %s (int32 [%lld, %d, %d]) and %s (bf16 as uint16 [%lld, %d, %d])\n",
              (fs::path(out_dir) / "topk_idx.npy").c_str(), static_cast<long long>(rows),
              cfg.index_heads, cfg.topk, (fs::path(out_dir) / "out.npy").c_str(),
              static_cast<long long>(rows), cfg.q_heads, cfg.head_dim);

  std::vector<CheckResult> checks;
  if (o.check) {
    IndexerArgs h_idx = c.indexer_args(topk.view());
    checks.push_back(check_selections_wellformed(cfg, c.batch, topk.view()));
    if (reference_backend) {
      HostTensor ref_topk(DType::kI32, {rows, cfg.index_heads, cfg.topk});
      cpu::select_topk(cfg, c.indexer_args(ref_topk.view()), threads);
      CheckResult r = compare_exact("topk_idx", topk.view(), ref_topk.view());
      r.name = "topk_idx == CPU reference select_topk (exact)";
      checks.push_back(r);
    } else {
      checks.push_back(check_selections_vs_scores(cfg, h_idx, kSelectionTieTolerance, threads));
    }
    HostTensor ref_out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
    cpu::sparse_attention(cfg, c.attention_args(topk.view(), ref_out.view()), threads);
    const double ulps = reference_backend ? 0.0 : kCrossBackendUlps;
    CheckResult r = compare_values("out", out.view(), ref_out.view(), ulps);
    r.name = fmt::format(
        "out vs CPU reference sparse_attention on the same selection (<= {} "
        "bf16 ulp)",
        ulps);
    checks.push_back(r);
    // The outputs recorded when the case was captured (m3msa demo --ops --save), if any: bit for
    // bit when this is the backend that recorded them, else within the cross-backend rules.
    const bool same_backend = !loaded.backend.empty() && loaded.backend == backend->name();
    const std::string by = loaded.backend.empty() ? "an unknown backend" : loaded.backend;
    auto recorded_topk = loaded.extra.find("expected_topk_idx");
    const bool have_topk = recorded_topk != loaded.extra.end() &&
                           recorded_topk->second.dtype() == DType::kI32 &&
                           recorded_topk->second.shape() == topk.shape();
    if (recorded_topk != loaded.extra.end() && !have_topk) {
      throw Error(ErrorCode::kInvalidArgument,
                  o.dir + ": expected_topk_idx must be i32 " + shape_string(topk.shape()));
    }
    if (have_topk) {
      CheckResult e =
          same_backend
              ? compare_exact("expected_topk_idx", topk.view(), recorded_topk->second.view())
              : check_selections_vs_scores(cfg, h_idx, kSelectionTieTolerance, threads,
                                           recorded_topk->second.view());
      e.name = fmt::format("topk_idx == expected_topk_idx recorded by {}{}", by,
                           same_backend ? "" : " (up to swaps of near-tied blocks)");
      checks.push_back(e);
    }
    auto recorded_out = loaded.extra.find("expected_out");
    if (recorded_out != loaded.extra.end()) {
      // Across backends, only the (row, head) outputs whose selections agree can be compared.
      const int group = cfg.group_size();
      const int k = cfg.topk;
      const int32_t* mine = topk.ptr<int32_t>();
      const int32_t* theirs = have_topk ? recorded_topk->second.ptr<int32_t>() : nullptr;
      int64_t skipped = 0;
      std::vector<char> same_selection(static_cast<std::size_t>(rows * cfg.index_heads), 1);
      if (theirs != nullptr) {
        for (int64_t i = 0; i < rows * cfg.index_heads; ++i) {
          same_selection[static_cast<std::size_t>(i)] =
              std::equal(mine + i * k, mine + (i + 1) * k, theirs + i * k);
          skipped += same_selection[static_cast<std::size_t>(i)] ? 0 : group;
        }
      }
      const int64_t per_row = int64_t{cfg.q_heads} * cfg.head_dim;
      auto include = [&](int64_t index) {
        const int64_t row = index / per_row;
        const int64_t kv_head = (index % per_row) / cfg.head_dim / group;
        return same_selection[static_cast<std::size_t>(row * cfg.index_heads + kv_head)] != 0;
      };
      const double recorded_ulps = same_backend ? 0.0 : kCrossBackendUlps;
      CheckResult e = compare_values("expected_out", out.view(), recorded_out->second.view(),
                                     recorded_ulps, include);
      e.name =
          fmt::format("out == expected_out recorded by {} (<= {} bf16 ulp{})", by, recorded_ulps,
                      skipped ? fmt::format("; {} (row, head) outputs with another "
                                            "selection skipped",
                                            skipped)
                              : "");
      checks.push_back(e);
    }
  }
  bool passed = true;
  if (o.check) {
    std::printf("checks:\n");
    for (const CheckResult& r : checks) {
      std::printf("  [%s] %s: %lld checked%s\n", r.passed() ? "ok" : "FAIL", r.name.c_str(),
                  static_cast<long long>(r.checked),
                  r.failed ? fmt::format(", {} failed", r.failed).c_str() : "");
      if (!r.passed()) std::printf("       %s\n", r.detail.c_str());
      passed = passed && r.passed();
    }
    std::printf("%s\n", passed ? "PASS" : "FAIL");
  }
  if (!o.json_path.empty()) {
    nlohmann::ordered_json j = {
        {"command", command_line()},
        {"case", o.dir},
        {"backend", backend->name()},
        {"rows", rows},
        {"select_ms", select_ms},
        {"attention_ms", attention_ms},
        {"outputs",
         {(fs::path(out_dir) / "topk_idx.npy").string(), (fs::path(out_dir) / "out.npy").string()}},
        {"passed", passed}};
    nlohmann::ordered_json jc = nlohmann::ordered_json::array();
    for (const CheckResult& r : checks) jc.push_back(check_json(r));
    j["checks"] = jc;
    write_json_file(o.json_path, j);
  }
  return passed ? kExitOk : kExitCheckFailed;
}

}  // namespace

Command add_replay_command(CLI::App& parent) {
  auto o = std::make_shared<ReplayOptions>();
  CLI::App* app = parent.add_subcommand(
      "replay", "Run one captured step from DIR (case.json + one .npy per tensor), write outputs");
  app->footer(
      "Runs select_topk and sparse_attention on the chosen backend and writes topk_idx.npy (int32 "
      "[rows, index_heads, topk]) and out.npy (bf16 stored as uint16, [rows, q_heads, head_dim]). "
      "numpy has no bf16 / fp8: those tensors are stored as their bit patterns (uint16 / uint8) "
      "and their dtype is recorded in case.json. `m3msa demo --ops --save DIR` writes a case; "
      "docs/replay.md describes the format.\n"
      "Exit codes: 0 ok, 1 a --check comparison failed, 2 bad flags, 3 a library error (a bad "
      "case names the file).");
  app->add_option("dir", o->dir, "case directory")->required();
  app->add_option("--out", o->out_dir, "write the outputs here instead of into DIR");
  app->add_option("--backend", o->backend, "auto (CUDA when usable, else CPU), cpu or cuda")
      ->check(CLI::IsMember(backend_choices()));
  app->add_option("--threads", o->threads, "CPU threads (0 = all hardware threads)")
      ->check(CLI::Range(0, 4096));
  app->add_flag("--check", o->check,
                "compare with the CPU reference (and with the expected_* outputs recorded in the "
                "case, if any); exit code 1 on a mismatch");
  app->add_option("--json", o->json_path, "also write the results as JSON to this file");
  app->add_flag("-q,--quiet", o->quiet, "no progress output on stderr");
  return {app, [o]() { return run_replay(*o); }};
}

}  // namespace m3msa::cli
