// Fault injection into the runtime with ranks as threads (TP = 2, CPU backend): after a
// successful prepare and two healthy steps, one rank misbehaves and every other rank must get an
// m3msa::Error naming the cause within the group's timeout, never a hang:
//  - a rank skips a forward_layer call: the lockstep mismatch names both ranks' tags; skipping
//    the last layer and waiting: the peer times out naming the rank that did not arrive;
//  - a rank runs a step of another shape (other requests, other query length): every rank names
//    both element counts of the TP reduce;
//  - a rank detaches while its peer steps: both name the two collectives (detach vs the layer);
//  - a rank dies (its thread stops calling anything) between layers or inside a layer: the
//    survivor times out naming it and the call it waited in.
// After a fault the group is broken: close() fails at once on every surviving rank but still
// releases everything (closed, nothing bound). The healthy phase runs under a long timeout; the
// fault phase under kFaultTimeout, and every failure must arrive within kSlack x that.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
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
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kFaultTimeout{400};
constexpr int kSlack = 5;           // a failure must arrive within kSlack x kFaultTimeout
constexpr int64_t kMaxBlocks = 16;  // small_config: max_context 256 / block 16
constexpr int kTp = 2;

// What one rank's thread ended with, and when (from the start of the fault phase).
struct RankEnd {
  std::exception_ptr error;
  Clock::duration at{};
};

// A rank whose thread stops calling anything: thrown by DyingCommunicator, caught by on_ranks.
struct Died {};

// Forwards to a rank's communicator until the collective tagged `die_at` (or any later one):
// there the rank "dies", i.e. its thread unwinds without ever joining that collective.
class DyingCommunicator final : public Communicator {
 public:
  explicit DyingCommunicator(Communicator& inner) : inner_(inner) {}
  void die_at(std::string tag) { die_at_ = std::move(tag); }
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string name() const override { return "dying " + inner_.name(); }
  std::vector<ByteRecord> all_gather(const ByteRecord& record, std::string_view tag) override {
    check(tag);
    return inner_.all_gather(record, tag);
  }
  void all_reduce_sum(float* data, std::size_t count, std::string_view tag) override {
    check(tag);
    inner_.all_reduce_sum(data, count, tag);
  }

 private:
  void check(std::string_view tag) {
    dead_ = dead_ || (!die_at_.empty() && tag == die_at_);
    if (dead_) throw Died{};
  }
  Communicator& inner_;
  std::string die_at_;
  bool dead_ = false;
};

// Two ranks of the small model (testkit::small_config), prepared and stepped twice with identical
// metadata.
class Tp2 {
 public:
  explicit Tp2(bool mlp) : config_(testkit::small_config(mlp ? 128 : 0)) {
    const int64_t pages = config_.max_requests * kMaxBlocks + 3;
    master_ = testkit::make_master(config_.model, pages, 11, /*mlp_on_last_layer=*/mlp);
    index_perm_ = testkit::page_permutation(pages, 12);
    kv_perm_ = testkit::page_permutation(pages, 13);
    group_ = ThreadGroup::create(kTp, 20s);  // the healthy phase: no spurious timeouts
    for (int r = 0; r < kTp; ++r) {
      comms_.push_back(group_->communicator(r));
      dying_.push_back(std::make_unique<DyingCommunicator>(*comms_.back()));
      models_.push_back(testkit::make_rank_model(master_, r, kTp));
      runtimes_.push_back(std::make_unique<Runtime>([](const std::string&) {}));
    }
    const testkit::StepMeta warm[] = {step({40, 70}, 1), step({41, 71}, 1)};
    std::vector<std::vector<uint16_t>> out(kTp);
    const auto ends = on_ranks([&](int r) {
      ASSERT_EQ(rt(r).prepare(models_[static_cast<std::size_t>(r)].weights, config_,
                              *dying_[static_cast<std::size_t>(r)]),
                PrepareResult::kActive);
      for (const testkit::StepMeta& s : warm) run_step(r, s, sparse_layers());
      out[static_cast<std::size_t>(r)] = last_hidden_[static_cast<std::size_t>(r)];
    });
    for (const RankEnd& end : ends) EXPECT_FALSE(end.error) << describe(end.error);
    EXPECT_EQ(out[0], out[1]) << "the healthy steps differ across ranks";
    EXPECT_FALSE(group_->broken());
    group_->set_timeout(kFaultTimeout);
  }

  Runtime& rt(int r) { return *runtimes_[static_cast<std::size_t>(r)]; }
  ThreadGroup& group() { return *group_; }
  DyingCommunicator& dying(int r) { return *dying_[static_cast<std::size_t>(r)]; }

  std::vector<int> sparse_layers() const {
    std::vector<int> layers;
    for (int l = config_.model.first_sparse_layer; l < config_.model.num_layers; ++l) {
      layers.push_back(l);
    }
    return layers;
  }

  testkit::StepMeta step(const std::vector<int32_t>& lens, int q_len) const {
    return testkit::make_step(lens, q_len, config_.model.block_size, kMaxBlocks, index_perm_,
                              kv_perm_);
  }

  // begin_step, then forward_layer of `layers` in order, on fresh inputs (the same on every rank).
  void run_step(int r, const testkit::StepMeta& s, const std::vector<int>& layers) {
    ASSERT_TRUE(rt(r).begin_step(s.batch)) << rt(r).stats().last_refusal;
    const int64_t rows = s.batch.num_rows();
    const int64_t H = config_.model.hidden;
    testkit::SplitMix64 rng(static_cast<uint64_t>(rows) * 7919u + 1u);
    HostTensor hidden = testkit::bf16_tensor(
        testkit::random_values(rng, static_cast<std::size_t>(rows * H), 1.0f), {rows, H});
    HostTensor residual(DType::kBF16, {rows, H});
    residual.fill_bytes(0);
    for (int layer : layers) {
      rt(r).forward_layer(layer, hidden.view(), residual.view(), s.positions.view());
    }
    const uint16_t* h = hidden.ptr<uint16_t>();
    last_hidden_[static_cast<std::size_t>(r)].assign(h, h + rows * H);
  }

  // fn(rank) on one thread per rank, the fault phase's clock started just before; each rank's
  // exception and when its thread ended. A Died rank ends without an error.
  std::vector<RankEnd> on_ranks(const std::function<void(int)>& fn) {
    std::vector<RankEnd> ends(kTp);
    std::vector<std::thread> threads;
    const Clock::time_point start = Clock::now();
    for (int r = 0; r < kTp; ++r) {
      threads.emplace_back([&, r] {
        RankEnd& end = ends[static_cast<std::size_t>(r)];
        try {
          fn(r);
        } catch (const Died&) {
        } catch (...) {
          end.error = std::current_exception();
        }
        end.at = Clock::now() - start;
      });
    }
    for (std::thread& t : threads) t.join();
    return ends;
  }

  // A detach whose agreement failed already let go of everything: the runtime is closed with
  // nothing bound, and close() is the idempotent no-op.
  void expect_detach_released(int r) {
    EXPECT_EQ(rt(r).state(), RuntimeState::kClosed);
    EXPECT_TRUE(rt(r).stats().bound_layers.empty());
    rt(r).close();
    EXPECT_EQ(rt(r).state(), RuntimeState::kClosed);
  }

  // After a fault: close() on a surviving rank fails at once (the group is broken) but leaves the
  // runtime closed with nothing bound.
  void expect_close_releases(int r) {
    const Clock::time_point start = Clock::now();
    try {
      rt(r).close();
      ADD_FAILURE() << "rank " << r << ": close on a broken group did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the group is broken"), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - start, kFaultTimeout) << "close waited on a broken group";
    EXPECT_EQ(rt(r).state(), RuntimeState::kClosed);
    EXPECT_TRUE(rt(r).stats().bound_layers.empty());
    EXPECT_NO_THROW(rt(r).close());  // idempotent
  }

  static std::string describe(const std::exception_ptr& error) {
    if (!error) return "no error";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "unknown";
  }

 private:
  RuntimeConfig config_;
  testkit::MasterModel master_;
  std::vector<int32_t> index_perm_, kv_perm_;
  std::shared_ptr<ThreadGroup> group_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<DyingCommunicator>> dying_;
  std::vector<testkit::RankModel> models_;
  std::vector<std::unique_ptr<Runtime>> runtimes_;
  std::vector<std::vector<uint16_t>> last_hidden_ = std::vector<std::vector<uint16_t>>(kTp);
};

// The m3msa::Error a rank ended with; checks its code and that it came in time.
Error error_of(const RankEnd& end, ErrorCode code, int rank) {
  EXPECT_LT(end.at, kSlack * kFaultTimeout) << "rank " << rank << " failed too late";
  if (!end.error) {
    ADD_FAILURE() << "rank " << rank << ": expected an m3msa::Error, got none";
    return Error(ErrorCode::kInternal, "none");
  }
  try {
    std::rethrow_exception(end.error);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << "rank " << rank << ": " << e.what();
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << rank << ": expected an m3msa::Error, got " << e.what();
  }
  return Error(ErrorCode::kInternal, "other");
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(RuntimeFaults, ASkippedLayerIsALockstepMismatchNamingBothTags) {
  Tp2 tp(/*mlp=*/false);
  const testkit::StepMeta s = tp.step({42, 72}, 1);
  const auto ends = tp.on_ranks([&](int r) {
    // Rank 1 skips layer 1: its layer 2 reduce meets rank 0's layer 1 reduce.
    tp.run_step(r, s, r == 0 ? std::vector<int>{1, 2} : std::vector<int>{2});
  });
  for (int r = 0; r < kTp; ++r) {
    const std::string text =
        error_of(ends[static_cast<std::size_t>(r)], ErrorCode::kInternal, r).what();
    EXPECT_TRUE(contains(text, "out of lockstep")) << text;
    EXPECT_TRUE(contains(text, "rank 0 'layer 1 o_proj'")) << text;
    EXPECT_TRUE(contains(text, "rank 1 'layer 2 o_proj'")) << text;
    // A mismatch is seen when both ranks meet: no waiting for the timeout.
    EXPECT_LT(ends[static_cast<std::size_t>(r)].at, kFaultTimeout);
  }
  EXPECT_TRUE(tp.group().broken());
  for (int r = 0; r < kTp; ++r) tp.expect_close_releases(r);
}

TEST(RuntimeFaults, ASkippedLastLayerTimesOutNamingTheRankThatDidNotArrive) {
  Tp2 tp(/*mlp=*/false);
  const testkit::StepMeta s = tp.step({42, 72}, 1);
  std::promise<void> survivor_failed;
  std::shared_future<void> failed = survivor_failed.get_future().share();
  const auto ends = tp.on_ranks([&](int r) {
    if (r == 0) {
      try {
        tp.run_step(0, s, {1, 2});
      } catch (...) {
        survivor_failed.set_value();
        throw;
      }
      survivor_failed.set_value();
      return;
    }
    // Rank 1 skips layer 2 and calls nothing until rank 0 gave up (bounded: 10 x the timeout).
    tp.run_step(1, s, {1});
    failed.wait_for(10 * kFaultTimeout);
  });
  const Error e = error_of(ends[0], ErrorCode::kTimeout, 0);
  const std::string text = e.what();
  EXPECT_TRUE(contains(text, "'layer 2 o_proj'")) << text;
  EXPECT_TRUE(contains(text, "rank 1 did not arrive")) << text;
  EXPECT_TRUE(contains(text, "timed out after " + std::to_string(kFaultTimeout.count()) + " ms"))
      << text;
  EXPECT_GE(ends[0].at, kFaultTimeout);  // it waited the bound, then gave up
  EXPECT_FALSE(ends[1].error) << Tp2::describe(ends[1].error);
  EXPECT_TRUE(tp.group().broken());
  for (int r = 0; r < kTp; ++r) tp.expect_close_releases(r);
}

TEST(RuntimeFaults, AStepOfAnotherShapeNamesBothCountsOnEveryRank) {
  const int64_t H = testkit::small_config(0).model.hidden;
  struct Case {
    const char* what;
    std::vector<int32_t> lens[kTp];
    int q_len[kTp];
  };
  const Case cases[] = {
      {"another number of requests", {{42, 72}, {42}}, {1, 1}},
      {"another query length", {{42, 72}, {42, 72}}, {1, 2}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Tp2 tp(/*mlp=*/false);
    const testkit::StepMeta steps[kTp] = {tp.step(c.lens[0], c.q_len[0]),
                                          tp.step(c.lens[1], c.q_len[1])};
    const auto ends = tp.on_ranks([&](int r) { tp.run_step(r, steps[r], tp.sparse_layers()); });
    for (int r = 0; r < kTp; ++r) {
      const std::string text =
          error_of(ends[static_cast<std::size_t>(r)], ErrorCode::kInvalidArgument, r).what();
      EXPECT_TRUE(contains(text, "'layer 1 o_proj': ranks passed different element counts"))
          << text;
      for (int peer = 0; peer < kTp; ++peer) {
        const int64_t count = steps[peer].batch.num_rows() * H;
        EXPECT_TRUE(contains(text, "rank " + std::to_string(peer) + " " + std::to_string(count)))
            << text;
      }
      EXPECT_LT(ends[static_cast<std::size_t>(r)].at, kFaultTimeout);
    }
    EXPECT_TRUE(tp.group().broken());
    for (int r = 0; r < kTp; ++r) tp.expect_close_releases(r);
  }
}

TEST(RuntimeFaults, DetachWhileThePeerStepsIsNamedOnBothRanks) {
  Tp2 tp(/*mlp=*/false);
  const testkit::StepMeta s = tp.step({42, 72}, 1);
  const auto ends = tp.on_ranks([&](int r) {
    if (r == 0) {
      tp.rt(0).detach({});  // empty replacement: a valid detach, but rank 1 is stepping
    } else {
      tp.run_step(1, s, tp.sparse_layers());
    }
  });
  for (int r = 0; r < kTp; ++r) {
    const std::string text =
        error_of(ends[static_cast<std::size_t>(r)], ErrorCode::kInternal, r).what();
    EXPECT_TRUE(contains(text, "out of lockstep")) << text;
    EXPECT_TRUE(contains(text, "rank 0 'detach'")) << text;
    EXPECT_TRUE(contains(text, "rank 1 'layer 1 o_proj'")) << text;
    EXPECT_LT(ends[static_cast<std::size_t>(r)].at, kFaultTimeout);
  }
  EXPECT_TRUE(tp.group().broken());
  tp.expect_detach_released(0);
  tp.expect_close_releases(1);
}

TEST(RuntimeFaults, DetachWhileThePeerIsGoneNamesThePeer) {
  Tp2 tp(/*mlp=*/false);
  const auto ends = tp.on_ranks([&](int r) {
    if (r == 0) tp.rt(0).detach({});  // rank 1 never joins
  });
  const std::string text = error_of(ends[0], ErrorCode::kTimeout, 0).what();
  EXPECT_TRUE(contains(text, "'detach'")) << text;
  EXPECT_TRUE(contains(text, "rank 1 did not arrive")) << text;
  EXPECT_GE(ends[0].at, kFaultTimeout);
  tp.expect_detach_released(0);
  tp.expect_close_releases(1);
}

TEST(RuntimeFaults, ARankThatDiesBetweenLayersIsNamedByTheSurvivor) {
  Tp2 tp(/*mlp=*/false);
  const testkit::StepMeta s = tp.step({42, 72}, 1);
  tp.dying(1).die_at("layer 2 o_proj");  // rank 1 runs layer 1, then its thread stops
  const auto ends = tp.on_ranks([&](int r) { tp.run_step(r, s, tp.sparse_layers()); });
  const std::string text = error_of(ends[0], ErrorCode::kTimeout, 0).what();
  EXPECT_TRUE(contains(text, "all_reduce_sum 'layer 2 o_proj'")) << text;
  EXPECT_TRUE(contains(text, "rank 1 did not arrive (1 of 2 ranks arrived)")) << text;
  EXPECT_GE(ends[0].at, kFaultTimeout);
  EXPECT_FALSE(ends[1].error) << Tp2::describe(ends[1].error);
  EXPECT_TRUE(tp.group().broken());
  tp.expect_close_releases(0);
}

TEST(RuntimeFaults, ARankThatDiesInsideALayerIsNamedByTheSurvivor) {
  Tp2 tp(/*mlp=*/true);  // layer 2 has an MLP: two reduces per layer
  const testkit::StepMeta s = tp.step({42, 72}, 1);
  tp.dying(1).die_at("layer 2 mlp_down");  // after layer 2's o_proj reduce, before its MLP one
  const auto ends = tp.on_ranks([&](int r) { tp.run_step(r, s, tp.sparse_layers()); });
  const std::string text = error_of(ends[0], ErrorCode::kTimeout, 0).what();
  EXPECT_TRUE(contains(text, "all_reduce_sum 'layer 2 mlp_down'")) << text;
  EXPECT_TRUE(contains(text, "rank 1 did not arrive")) << text;
  EXPECT_GE(ends[0].at, kFaultTimeout);
  EXPECT_FALSE(ends[1].error) << Tp2::describe(ends[1].error);
  tp.expect_close_releases(0);
  // The dead rank's runtime is still bound (it never closed); destroying it runs no collective.
  EXPECT_EQ(tp.rt(1).state(), RuntimeState::kActive);
}

}  // namespace
}  // namespace m3msa
