// The runtime's collective lifecycle (docs/runtime.md) with ranks as threads: unanimous fallback,
// mixed failures raising one error everywhere, readiness retries, capture and metadata rules,
// weight refusals, begin_step refusals counted by reason, detach and close. Every wait is bounded
// by the group's timeout, so a broken rule fails the test instead of hanging it.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/testing/runtime_model.h"

namespace m3msa {
namespace {

using namespace std::chrono_literals;

constexpr int64_t kMaxBlocks = 16;  // small_config: max_context 256 / block 16

struct World {
  std::shared_ptr<ThreadGroup> group;
  std::vector<std::unique_ptr<Communicator>> comms;
  World(int n, std::chrono::milliseconds timeout) : group(ThreadGroup::create(n, timeout)) {
    for (int r = 0; r < n; ++r) comms.push_back(group->communicator(r));
  }
  Communicator& comm(int r) { return *comms[static_cast<std::size_t>(r)]; }
};

// fn(rank) on one thread per rank; each rank's exception (or null).
std::vector<std::exception_ptr> on_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void expect_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " threw: " << e.what();
    }
  }
}

// The m3msa::Error a rank threw (fails the test when it threw nothing or something else).
Error error_of(const std::exception_ptr& error) {
  if (!error) {
    ADD_FAILURE() << "expected an m3msa::Error, got none";
    return Error(ErrorCode::kInternal, "none");
  }
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected an m3msa::Error, got " << e.what();
  }
  return Error(ErrorCode::kInternal, "other");
}

// A log sink per rank.
struct Logs {
  std::mutex mutex;
  std::vector<std::string> lines;
  Runtime::LogSink sink() {
    return [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex);
      lines.push_back(line);
    };
  }
  bool contains(const std::string& text) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& l : lines) {
      if (l.find(text) != std::string::npos) return true;
    }
    return false;
  }
};

struct Fixture {
  RuntimeConfig config = testkit::small_config(/*intermediate=*/0);
  testkit::MasterModel master;
  std::vector<int32_t> index_perm, kv_perm;
  explicit Fixture(uint64_t seed = 5) {
    const int64_t pages = config.max_requests * kMaxBlocks + 3;
    master = testkit::make_master(config.model, pages, seed, false);
    // Permutations long enough for refused batches with more requests than pages allow.
    index_perm = testkit::page_permutation(pages, seed + 1);
    kv_perm = testkit::page_permutation(pages, seed + 2);
  }
  testkit::StepMeta step(const std::vector<int32_t>& lens, int q_len) const {
    return testkit::make_step(lens, q_len, config.model.block_size, kMaxBlocks, index_perm,
                              kv_perm);
  }
};

TEST(RuntimeLifecycle, UnanimousUnsupportedFallsBackOnEveryRankForGood) {
  Fixture fx;
  World world(2, 20s);
  std::vector<testkit::RankModel> models = {testkit::make_rank_model(fx.master, 0, 2),
                                            testkit::make_rank_model(fx.master, 1, 2)};
  Logs logs[2];
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (int r = 0; r < 2; ++r) runtimes.push_back(std::make_unique<Runtime>(logs[r].sink()));
  RuntimeConfig config = fx.config;
  config.pipeline_parallel_size = 2;
  std::vector<PrepareResult> results(2);
  expect_no_errors(on_ranks(2, [&](int r) {
    results[static_cast<std::size_t>(r)] = runtimes[static_cast<std::size_t>(r)]->prepare(
        models[static_cast<std::size_t>(r)].weights, config, world.comm(r));
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[static_cast<std::size_t>(r)], PrepareResult::kFallback) << r;
    Runtime& rt = *runtimes[static_cast<std::size_t>(r)];
    EXPECT_EQ(rt.state(), RuntimeState::kFallback);
    const RuntimeStats stats = rt.stats();
    ASSERT_EQ(stats.fallback_reasons.size(), 2u) << stats.to_json();
    for (int peer = 0; peer < 2; ++peer) {
      const std::string reason = "rank " + std::to_string(peer) +
                                 ": model support: pipeline parallelism (pipeline_parallel_size 2) "
                                 "is not supported";
      EXPECT_EQ(stats.fallback_reasons.count(reason), 1u) << stats.to_json();
    }
    EXPECT_TRUE(logs[r].contains("falling back to native execution"));
    EXPECT_TRUE(logs[r].contains("pipeline parallelism"));
  }
  // Final: a later step does not retry. Rank 0 alone calls prepare again: a collective would time
  // out (rank 1 never joins), so returning at once proves none ran.
  world.group->set_timeout(200ms);
  EXPECT_EQ(runtimes[0]->prepare(models[0].weights, fx.config, world.comm(0)),
            PrepareResult::kFallback);
  EXPECT_EQ(runtimes[0]->stats().prepare_calls, 1);
  EXPECT_FALSE(world.group->broken());
  const testkit::StepMeta step = fx.step({20}, 1);
  EXPECT_FALSE(runtimes[0]->begin_step(step.batch));
  EXPECT_EQ(runtimes[0]->stats().refusal_count(StepRefusal::kNotActive), 1);
  runtimes[0]->close();
  EXPECT_EQ(runtimes[0]->state(), RuntimeState::kFallback);
}

TEST(RuntimeLifecycle, OneRankRefusingItsWeightsMakesEveryRankFallBack) {
  Fixture fx;
  World world(2, 20s);
  std::vector<testkit::RankModel> models = {testkit::make_rank_model(fx.master, 0, 2),
                                            testkit::make_rank_model(fx.master, 1, 2)};
  // Rank 1: layer 2's projection is a strided view, its input norm is f32 (both valid tensors
  // the CPU backend does not take: "unsupported").
  LayerWeights& w = models[1].weights.layers[1];
  const int64_t rows = w.qkv_proj.shape[0];
  const int64_t H = w.qkv_proj.shape[1];
  HostTensor wide(DType::kBF16, {rows, 2 * H});
  w.qkv_proj = TensorView::contiguous(wide.data(), DType::kBF16, {rows, 2 * H});
  w.qkv_proj.shape[1] = H;  // every other column block: strides [2H, 1]
  HostTensor norm32(DType::kF32, {H});
  w.input_norm = norm32.view();

  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (int r = 0; r < 2; ++r) {
    runtimes.push_back(std::make_unique<Runtime>([](const std::string&) {}));
  }
  std::vector<PrepareResult> results(2);
  expect_no_errors(on_ranks(2, [&](int r) {
    results[static_cast<std::size_t>(r)] = runtimes[static_cast<std::size_t>(r)]->prepare(
        models[static_cast<std::size_t>(r)].weights, fx.config, world.comm(r));
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[static_cast<std::size_t>(r)], PrepareResult::kFallback);
    const RuntimeStats stats = runtimes[static_cast<std::size_t>(r)]->stats();
    ASSERT_EQ(stats.fallback_reasons.size(), 1u) << stats.to_json();
    const std::string& reason = stats.fallback_reasons.begin()->first;
    EXPECT_NE(reason.find("rank 1: weight support: "), std::string::npos) << reason;
    EXPECT_NE(reason.find("layer 2 qkv_proj: expected contiguous strides [256, 1], found [512, 1]"),
              std::string::npos)
        << reason;
    EXPECT_NE(reason.find("layer 2 input_norm: expected dtype bf16, found f32"), std::string::npos)
        << reason;
    EXPECT_TRUE(stats.bound_layers.empty());
  }
}

TEST(RuntimeLifecycle, MixedFailureRaisesOneErrorListingEveryRankOnEveryRank) {
  Fixture fx;
  World world(2, 20s);
  std::vector<testkit::RankModel> models = {testkit::make_rank_model(fx.master, 0, 2),
                                            testkit::make_rank_model(fx.master, 1, 2)};
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (int r = 0; r < 2; ++r) {
    runtimes.push_back(std::make_unique<Runtime>([](const std::string&) {}));
  }
  // Stage "model support": rank 0 unsupported, rank 1 a bug.
  std::vector<RuntimeConfig> configs = {fx.config, fx.config};
  configs[0].pipeline_parallel_size = 2;
  configs[1].model.hidden = -1;
  auto errors = on_ranks(2, [&](int r) {
    runtimes[static_cast<std::size_t>(r)]->prepare(models[static_cast<std::size_t>(r)].weights,
                                                   configs[static_cast<std::size_t>(r)],
                                                   world.comm(r));
  });
  for (int r = 0; r < 2; ++r) {
    const Error e = error_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(e.rank(), r);
    const std::string text = e.what();
    EXPECT_NE(text.find("stage 'model support'"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 0: unsupported: pipeline parallelism"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 1: invalid argument: model.hidden must be > 0, got -1"),
              std::string::npos)
        << text;
    EXPECT_EQ(runtimes[static_cast<std::size_t>(r)]->state(), RuntimeState::kIdle);
  }

  // Stage "weight support": rank 0 unsupported (f32 norm), rank 1 a wrong shape (a bug).
  HostTensor norm32(DType::kF32, {fx.config.model.hidden});
  models[0].weights.layers[0].post_attention_norm = norm32.view();
  HostTensor short_o(DType::kBF16, {fx.config.model.hidden, 60});
  models[1].weights.layers[1].o_proj = short_o.view();
  errors = on_ranks(2, [&](int r) {
    runtimes[static_cast<std::size_t>(r)]->prepare(models[static_cast<std::size_t>(r)].weights,
                                                   fx.config, world.comm(r));
  });
  for (int r = 0; r < 2; ++r) {
    const std::string text = error_of(errors[static_cast<std::size_t>(r)]).what();
    EXPECT_NE(text.find("stage 'weight support'"), std::string::npos) << text;
    EXPECT_NE(
        text.find(
            "rank 0: unsupported: layer 1 post_attention_norm: expected dtype bf16, found f32"),
        std::string::npos)
        << text;
    EXPECT_NE(text.find("rank 1: invalid argument: layer 2 o_proj: expected shape [256, 64], "
                        "found [256, 60]"),
              std::string::npos)
        << text;
  }

  // An error is not final: fixed bindings prepare.
  models = {testkit::make_rank_model(fx.master, 0, 2), testkit::make_rank_model(fx.master, 1, 2)};
  std::vector<PrepareResult> results(2);
  expect_no_errors(on_ranks(2, [&](int r) {
    auto& rt = *runtimes[static_cast<std::size_t>(r)];
    results[static_cast<std::size_t>(r)] =
        rt.prepare(models[static_cast<std::size_t>(r)].weights, fx.config, world.comm(r));
    rt.close();
  }));
  EXPECT_EQ(results[0], PrepareResult::kActive);
  EXPECT_EQ(results[1], PrepareResult::kActive);
}

TEST(RuntimeLifecycle, ReadinessIsRetriedUntilEveryRankIsReady) {
  Fixture fx;
  World world(2, 20s);
  std::vector<testkit::RankModel> models = {testkit::make_rank_model(fx.master, 0, 2),
                                            testkit::make_rank_model(fx.master, 1, 2)};
  // Rank 1 still has the engine's temporary profiling cache for layer 1: zero pages.
  const SparseConfig sc = fx.config.model.sparse(2);
  std::vector<ModelWeights> profiling = {models[0].weights, models[1].weights};
  profiling[1].layers[0].kv_cache.data = TensorView::contiguous(
      nullptr, DType::kBF16, {0, sc.kv_heads, 2, sc.block_size, sc.head_dim});
  Logs logs[2];
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (int r = 0; r < 2; ++r) runtimes.push_back(std::make_unique<Runtime>(logs[r].sink()));
  std::vector<PrepareResult> first(2), second(2);
  expect_no_errors(on_ranks(2, [&](int r) {
    auto& rt = *runtimes[static_cast<std::size_t>(r)];
    first[static_cast<std::size_t>(r)] =
        rt.prepare(profiling[static_cast<std::size_t>(r)], fx.config, world.comm(r));
    second[static_cast<std::size_t>(r)] =
        rt.prepare(models[static_cast<std::size_t>(r)].weights, fx.config, world.comm(r));
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(first[static_cast<std::size_t>(r)], PrepareResult::kNotReady) << r;
    EXPECT_EQ(second[static_cast<std::size_t>(r)], PrepareResult::kActive) << r;
    const RuntimeStats stats = runtimes[static_cast<std::size_t>(r)]->stats();
    EXPECT_EQ(stats.prepare_not_ready, 1);
    EXPECT_EQ(stats.prepare_calls, 2);
    EXPECT_EQ(stats.bound_layers, (std::vector<int>{1, 2}));
    EXPECT_TRUE(logs[r].contains("rank 1: layer 1 kv_cache is empty")) << r;
  }
  expect_no_errors(on_ranks(2, [&](int r) { runtimes[static_cast<std::size_t>(r)]->close(); }));
}

TEST(RuntimeLifecycle, PrepareWhileCapturingIsAnErrorAndNoMetadataDoesNothing) {
  Fixture fx;
  // A 2-rank group in which rank 1 never calls anything: neither case may run a collective.
  World world(2, 200ms);
  testkit::RankModel model = testkit::make_rank_model(fx.master, 0, 2);
  Runtime rt([](const std::string&) {});
  StepContext capturing;
  capturing.capturing = true;
  try {
    rt.prepare(model.weights, fx.config, world.comm(0), capturing);
    ADD_FAILURE() << "prepare during capture did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("capturing"), std::string::npos) << e.what();
  }
  StepContext profiling;
  profiling.has_metadata = false;
  EXPECT_EQ(rt.prepare(model.weights, fx.config, world.comm(0), profiling),
            PrepareResult::kSkipped);
  capturing.has_metadata = false;  // capture is checked first
  EXPECT_THROW(rt.prepare(model.weights, fx.config, world.comm(0), capturing), Error);
  EXPECT_EQ(rt.state(), RuntimeState::kIdle);
  EXPECT_EQ(rt.stats().prepare_calls, 0);
  EXPECT_EQ(rt.stats().prepare_skipped, 1);
  EXPECT_FALSE(world.group->broken());
}

// A rank-local option with no valid value is refused by name before any collective.
TEST(RuntimeLifecycle, AnIndexerOverlapOutsideTheEnumIsRefusedByName) {
  Fixture fx;
  World world(1, 20s);
  testkit::RankModel model = testkit::make_rank_model(fx.master, 0, 1);
  RuntimeConfig config = fx.config;
  config.indexer_overlap = static_cast<IndexerOverlap>(7);
  Runtime rt([](const std::string&) {});
  try {
    rt.prepare(model.weights, config, world.comm(0));
    ADD_FAILURE() << "prepare accepted indexer_overlap = 7";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("config.indexer_overlap has no valid value (7)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(rt.state(), RuntimeState::kIdle);
  EXPECT_EQ(parse_indexer_overlap("on"), IndexerOverlap::kOn);
  EXPECT_THROW(parse_indexer_overlap("always"), Error);
}

TEST(RuntimeLifecycle, ConfigurationsThatDifferAcrossRanksAreAnError) {
  Fixture fx;
  World world(2, 20s);
  std::vector<testkit::RankModel> models = {testkit::make_rank_model(fx.master, 0, 2),
                                            testkit::make_rank_model(fx.master, 1, 2)};
  std::vector<RuntimeConfig> configs = {fx.config, fx.config};
  configs[1].max_context = 128;
  configs[1].threads = 2;  // rank-local: not compared
  auto errors = on_ranks(2, [&](int r) {
    Runtime rt([](const std::string&) {});
    rt.prepare(models[static_cast<std::size_t>(r)].weights, configs[static_cast<std::size_t>(r)],
               world.comm(r));
  });
  for (int r = 0; r < 2; ++r) {
    const std::string text = error_of(errors[static_cast<std::size_t>(r)]).what();
    EXPECT_NE(text.find("configurations differ"), std::string::npos) << text;
    EXPECT_NE(text.find("max_context=256"), std::string::npos) << text;
    EXPECT_NE(text.find("max_context=128"), std::string::npos) << text;
  }
}

TEST(RuntimeLifecycle, WeightRefusalsNameTheTensorAndTheExpectedAndFoundValues) {
  Fixture fx;
  auto comm = make_single_rank_communicator();
  auto prepare_error = [&](const ModelWeights& weights) -> std::string {
    Runtime rt([](const std::string&) {});
    try {
      const PrepareResult result = rt.prepare(weights, fx.config, *comm);
      return std::string("no error, result ") + prepare_result_name(result) + ", reasons " +
             rt.stats().to_json();
    } catch (const Error& e) {
      return e.what();
    }
  };
  testkit::RankModel base = testkit::make_rank_model(fx.master, 0, 1);
  const int64_t W = fx.config.model.sparse(1).qkv_width();

  testkit::RankModel fp8 = testkit::make_rank_model(fx.master, 0, 1, true);
  fp8.weights.layers[0].qkv_proj_scale = {};
  std::string text = prepare_error(fp8.weights);
  EXPECT_NE(
      text.find("layer 1 qkv_proj_scale: not bound (expected f32[" + std::to_string(W) + "])"),
      std::string::npos)
      << text;

  ModelWeights one_layer = base.weights;
  one_layer.layers.pop_back();
  text = prepare_error(one_layer);
  EXPECT_NE(
      text.find("1 of the 2 sparse layers are not bound (every sparse layer must be): layer 2"),
      std::string::npos)
      << text;

  ModelWeights twice = base.weights;
  twice.layers[1].layer = 1;
  text = prepare_error(twice);
  EXPECT_NE(text.find("layer 1: bound twice"), std::string::npos) << text;

  ModelWeights wrong_cache = base.weights;
  HostTensor small_kv(DType::kBF16, {4, 1, 2, 16, 32});
  wrong_cache.layers[1].kv_cache.data = small_kv.view();
  wrong_cache.layers[0].k_norm = {};
  text = prepare_error(wrong_cache);
  EXPECT_NE(
      text.find("layer 2 kv_cache: expected shape [*, 2, 2, 16, 32], found [4, 1, 2, 16, 32]"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("layer 1 k_norm: not bound (expected bf16[32])"), std::string::npos) << text;

  // Forms of KVCache the operations take but the runtime does not bind: a fallback naming them.
  ModelWeights scale_tensor = base.weights;
  HostTensor scale(DType::kF32, {1});
  scale_tensor.layers[0].kv_cache.k_scale_tensor = scale.view();
  text = prepare_error(scale_tensor);
  EXPECT_NE(text.find("layer 1 kv_cache.k_scale_tensor / v_scale_tensor: the runtime takes"),
            std::string::npos)
      << text;
  ModelWeights split_kv = base.weights;
  split_kv.layers[1].kv_cache.k = base.weights.layers[1].kv_cache.keys();
  text = prepare_error(split_kv);
  EXPECT_NE(text.find("layer 2 kv_cache: the runtime binds the packed layout"), std::string::npos)
      << text;

  ModelWeights page_mismatch = base.weights;
  HostTensor other_pages(DType::kBF16, {5, 2, 2, 16, 32});
  page_mismatch.layers[1].kv_cache.data = other_pages.view();
  text = prepare_error(page_mismatch);
  EXPECT_NE(text.find("layer 2 kv_cache: expected " + std::to_string(fx.master.pages) +
                      " pages (as layer 1), found 5"),
            std::string::npos)
      << text;
}

TEST(RuntimeLifecycle, BeginStepRefusalsAreCountedByReason) {
  Fixture fx;
  auto comm = make_single_rank_communicator();
  testkit::RankModel model = testkit::make_rank_model(fx.master, 0, 1);
  Runtime rt([](const std::string&) {});
  const testkit::StepMeta one = fx.step({20}, 1);
  EXPECT_FALSE(rt.begin_step(one.batch));  // not prepared yet
  ASSERT_EQ(rt.prepare(model.weights, fx.config, *comm), PrepareResult::kActive);

  BatchMeta prefill;
  prefill.kind = BatchKind::kPrefill;
  EXPECT_FALSE(rt.begin_step(prefill));
  const testkit::StepMeta too_many = testkit::make_step(
      {20, 20, 20, 20, 20}, 1, 16, kMaxBlocks, testkit::page_permutation(5 * kMaxBlocks, 1),
      testkit::page_permutation(5 * kMaxBlocks, 2));
  EXPECT_FALSE(rt.begin_step(too_many.batch));
  EXPECT_NE(rt.stats().last_refusal.find("num_reqs 5 > max_requests 4"), std::string::npos);
  const testkit::StepMeta q3 = fx.step({20}, 3);
  EXPECT_FALSE(rt.begin_step(q3.batch));
  const testkit::StepMeta twelve = fx.step({20, 30, 40}, 4);  // 12 rows > bucket 8
  EXPECT_FALSE(rt.begin_step(twelve.batch));
  const testkit::StepMeta empty = fx.step({}, 1);
  EXPECT_FALSE(rt.begin_step(empty.batch));
  const testkit::StepMeta too_long = fx.step({300}, 1);
  EXPECT_FALSE(rt.begin_step(too_long.batch));

  // A refused step leaves nothing to run.
  std::vector<uint16_t> h(256), r(256);
  EXPECT_THROW(rt.forward_layer(1, TensorView::contiguous(h.data(), DType::kBF16, {1, 256}),
                                TensorView::contiguous(r.data(), DType::kBF16, {1, 256}),
                                one.positions.view()),
               Error);

  const testkit::StepMeta six = fx.step({20, 100, 0}, 2);  // 6 rows -> bucket 8
  ASSERT_TRUE(rt.begin_step(six.batch)) << rt.stats().last_refusal;
  const BatchMeta& fixed = rt.step_metadata();
  const void* seq_lens_at = fixed.seq_lens.data;
  const void* kv_table_at = fixed.kv_block_table.data;
  const void* slots_at = fixed.slot_mapping.data;
  EXPECT_NE(seq_lens_at, six.batch.seq_lens.data);  // copied, not aliased
  EXPECT_EQ(fixed.num_reqs, 3);
  EXPECT_EQ(fixed.slot_mapping.ptr<int64_t>()[3], six.slots.ptr<const int64_t>()[3]);
  ASSERT_TRUE(rt.begin_step(one.batch));  // 1 row -> bucket 1
  EXPECT_EQ(rt.step_metadata().seq_lens.data, seq_lens_at);
  EXPECT_EQ(rt.step_metadata().kv_block_table.data, kv_table_at);
  EXPECT_EQ(rt.step_metadata().slot_mapping.data, slots_at);
  EXPECT_EQ(rt.step_metadata().seq_lens.ptr<int32_t>()[0], 20);

  const RuntimeStats stats = rt.stats();
  EXPECT_EQ(stats.refusal_count(StepRefusal::kNotActive), 1);
  EXPECT_EQ(stats.refusal_count(StepRefusal::kPrefill), 1);
  EXPECT_EQ(stats.refusal_count(StepRefusal::kTooManyRequests), 1);
  EXPECT_EQ(stats.refusal_count(StepRefusal::kQueryLen), 1);
  EXPECT_EQ(stats.refusal_count(StepRefusal::kTokenCount), 2);
  EXPECT_EQ(stats.refusal_count(StepRefusal::kContextTooLong), 1);
  EXPECT_EQ(stats.steps_accepted, 2);
  EXPECT_EQ(stats.buckets, (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(stats.bucket_steps, (std::vector<int64_t>{1, 0, 0, 1}));
  EXPECT_EQ(stats.launches_per_layer, 0);
  EXPECT_EQ(stats.graphs_captured, 0);
  const std::string json = stats.to_json();
  EXPECT_NE(json.find("\"too many requests\":1"), std::string::npos) << json;

  // Malformed metadata is an error, not a refusal.
  BatchMeta no_slots = one.batch;
  no_slots.slot_mapping = {};
  EXPECT_THROW(rt.begin_step(no_slots), Error);

  // Dense layers and bad tensors are refused by forward_layer.
  ASSERT_TRUE(rt.begin_step(one.batch));
  auto hv = TensorView::contiguous(h.data(), DType::kBF16, {1, 256});
  auto rv = TensorView::contiguous(r.data(), DType::kBF16, {1, 256});
  EXPECT_THROW(rt.forward_layer(0, hv, rv, one.positions.view()), Error);
  EXPECT_THROW(rt.forward_layer(1, hv, hv, one.positions.view()), Error);
  EXPECT_THROW(rt.forward_layer(1, TensorView::contiguous(h.data(), DType::kBF16, {1, 128}), rv,
                                one.positions.view()),
               Error);
  rt.forward_layer(1, hv, rv, one.positions.view());
  EXPECT_EQ(rt.stats().layers_run, 1);

  rt.close();
  EXPECT_FALSE(rt.begin_step(one.batch));
  EXPECT_EQ(rt.stats().refusal_count(StepRefusal::kNotActive), 2);
}

TEST(RuntimeLifecycle, DetachNeedsEmptyReplacementOnEveryRankThenCloses) {
  Fixture fx;
  World world(2, 20s);
  std::vector<testkit::RankModel> models = {testkit::make_rank_model(fx.master, 0, 2),
                                            testkit::make_rank_model(fx.master, 1, 2)};
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (int r = 0; r < 2; ++r) {
    runtimes.push_back(std::make_unique<Runtime>([](const std::string&) {}));
  }
  expect_no_errors(on_ranks(2, [&](int r) {
    ASSERT_EQ(runtimes[static_cast<std::size_t>(r)]->prepare(
                  models[static_cast<std::size_t>(r)].weights, fx.config, world.comm(r)),
              PrepareResult::kActive);
  }));
  // Rank 1 hands over storage that is not empty: every rank refuses, nothing is closed.
  HostTensor live(DType::kBF16, {3, 1, 2, 16, 32});
  std::vector<std::vector<LayerCaches>> replacement(2);
  replacement[0].push_back({1, KVCache{}, IndexCache{}});
  replacement[1].push_back({1, KVCache{live.view(), 1.0f, 1.0f}, IndexCache{}});
  auto errors = on_ranks(2, [&](int r) {
    runtimes[static_cast<std::size_t>(r)]->detach(replacement[static_cast<std::size_t>(r)]);
  });
  for (int r = 0; r < 2; ++r) {
    const Error e = error_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string text = e.what();
    EXPECT_NE(text.find("rank 0: ok"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 1: invalid argument: layer 1 kv_cache: the replacement must be empty "
                        "storage, found bf16[3, 1, 2, 16, 32] cpu"),
              std::string::npos)
        << text;
    EXPECT_EQ(runtimes[static_cast<std::size_t>(r)]->state(), RuntimeState::kActive);
  }
  // Empty replacements (a zero-page tensor counts as empty): detached and closed everywhere.
  replacement[1][0].kv_cache.data =
      TensorView::contiguous(nullptr, DType::kBF16, {0, 1, 2, 16, 32});
  expect_no_errors(on_ranks(2, [&](int r) {
    runtimes[static_cast<std::size_t>(r)]->detach(replacement[static_cast<std::size_t>(r)]);
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(runtimes[static_cast<std::size_t>(r)]->state(), RuntimeState::kClosed);
    EXPECT_TRUE(runtimes[static_cast<std::size_t>(r)]->stats().bound_layers.empty());
  }
  // The next eager step prepares afresh on new caches.
  std::vector<testkit::RankModel> fresh = {testkit::make_rank_model(fx.master, 0, 2),
                                           testkit::make_rank_model(fx.master, 1, 2)};
  std::vector<PrepareResult> results(2);
  expect_no_errors(on_ranks(2, [&](int r) {
    auto& rt = *runtimes[static_cast<std::size_t>(r)];
    results[static_cast<std::size_t>(r)] =
        rt.prepare(fresh[static_cast<std::size_t>(r)].weights, fx.config, world.comm(r));
    rt.close();
  }));
  EXPECT_EQ(results[0], PrepareResult::kActive);
  EXPECT_EQ(results[1], PrepareResult::kActive);
}

TEST(RuntimeLifecycle, CloseIsIdempotentAndAgreedAcrossRanks) {
  Fixture fx;
  World world(2, 20s);
  std::vector<testkit::RankModel> models = {testkit::make_rank_model(fx.master, 0, 2),
                                            testkit::make_rank_model(fx.master, 1, 2)};
  expect_no_errors(on_ranks(2, [&](int r) {
    Runtime rt([](const std::string&) {});
    rt.close();  // before prepare: nothing to do
    ASSERT_EQ(rt.prepare(models[static_cast<std::size_t>(r)].weights, fx.config, world.comm(r)),
              PrepareResult::kActive);
    rt.close();
    rt.close();
    rt.detach({});  // after close: nothing bound, nothing to agree
    EXPECT_EQ(rt.state(), RuntimeState::kClosed);
  }));

  // Ranks that ran different work are out of lockstep: close says so on every rank, and still
  // releases everything.
  const testkit::StepMeta step = fx.step({20}, 1);
  auto errors = on_ranks(2, [&](int r) {
    Runtime rt([](const std::string&) {});
    rt.prepare(models[static_cast<std::size_t>(r)].weights, fx.config, world.comm(r));
    if (r == 0) rt.begin_step(step.batch);
    try {
      rt.close();
    } catch (...) {
      EXPECT_EQ(rt.state(), RuntimeState::kClosed);
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    const std::string text = error_of(errors[static_cast<std::size_t>(r)]).what();
    EXPECT_NE(text.find("out of lockstep"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 0: steps_accepted=1"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 1: steps_accepted=0"), std::string::npos) << text;
  }
}

TEST(RuntimeLifecycle, APeerThatNeverArrivesIsNamedWithinTheTimeout) {
  Fixture fx;
  World world(3, 300ms);
  std::vector<testkit::RankModel> models;
  // The first collective (model support) already times out, so weights are never inspected:
  // every rank can hold the TP=1 slice (a TP=3 slice of this master would not exist).
  for (int r = 0; r < 3; ++r) models.push_back(testkit::make_rank_model(fx.master, 0, 1));
  RuntimeConfig config = fx.config;
  config.model.q_heads = 6;  // TP 3 needs 3 | q_heads; rank 2 never calls anyway
  const auto start = std::chrono::steady_clock::now();
  auto errors = on_ranks(2, [&](int r) {
    Runtime rt([](const std::string&) {});
    rt.prepare(models[static_cast<std::size_t>(r)].weights, config, world.comm(r));
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(elapsed, 10s);
  bool named = false;
  for (int r = 0; r < 2; ++r) {
    const Error e = error_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    named = named || std::string(e.what()).find("rank 2 did not arrive") != std::string::npos;
  }
  EXPECT_TRUE(named);
  EXPECT_TRUE(world.group->broken());
}

}  // namespace
}  // namespace m3msa
