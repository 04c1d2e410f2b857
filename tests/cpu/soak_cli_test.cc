// `m3msa soak` (CPU mode) through the built binary: a short soak passes with every world size
// exercised and memory sampled; an injected mismatch is caught (the soak can fail); the same seed
// repeats the same steps; bad flags are refused naming the flag; a time limit stops and fails the
// run; --gpu without a usable GPU is a library error, not a crash.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "m3msa/backend.h"

namespace m3msa {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

#ifdef M3MSA_CLI_PATH
constexpr const char* kCli = M3MSA_CLI_PATH;
#else
constexpr const char* kCli = "";
#endif

struct SoakRun {
  int code = -1;
  std::string out;
  std::string err;
};

class SoakCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kCli[0] == '\0' || !fs::exists(kCli)) {
      GTEST_SKIP() << "the m3msa binary is not built (M3MSA_BUILD_CLI=OFF)";
    }
    dir_ = fs::path(::testing::TempDir()) /
           (std::string("m3msa_soak_") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  static std::string slurp(const std::string& file) {
    std::ifstream in(file);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  SoakRun run(const std::string& args) const {
    const std::string command = std::string("'") + kCli + "' " + args + " >'" + path("out.txt") +
                                "' 2>'" + path("err.txt") + "'";
    const int status = std::system(command.c_str());
    SoakRun r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(path("out.txt"));
    r.err = slurp(path("err.txt"));
    return r;
  }
  json load(const std::string& name) const { return json::parse(slurp(path(name))); }

  fs::path dir_;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_F(SoakCli, ShortSoakPassesOnEveryWorldSize) {
  const SoakRun r = run("soak --steps 600 --seed 5 -q --json " + path("soak.json"));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "PASS")) << r.out;
  EXPECT_TRUE(r.err.empty()) << "-q must keep stderr empty: " << r.err;
  const json j = load("soak.json");
  EXPECT_EQ(j["mode"], "cpu");
  EXPECT_EQ(j["steps"], 600);
  EXPECT_EQ(j["mismatches"], 0);
  EXPECT_TRUE(j["passed"].get<bool>());
  EXPECT_GT(j["lists_compared"].get<int64_t>(), 600);
  int64_t by_size = 0;
  for (const char* p : {"2", "4", "8"}) {
    EXPECT_GT(j["steps_by_world_size"][p].get<int64_t>(), 100) << "P=" << p;
    by_size += j["steps_by_world_size"][p].get<int64_t>();
  }
  EXPECT_EQ(by_size, 600);
  EXPECT_GT(j["hostile_events"].get<int64_t>(), 0);
  ASSERT_EQ(j["memory"].size(), 1u);
  EXPECT_GE(j["memory"][0]["samples"].get<int64_t>(), 2);
  EXPECT_TRUE(j["memory"][0]["flat"].get<bool>());
}

TEST_F(SoakCli, InjectedMismatchIsCaughtAndFailsTheRun) {
  const SoakRun r =
      run("soak --steps 200 --ranks 4 --inject-mismatch-at 77 -q --json " + path("soak.json"));
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "FAIL")) << r.out;
  const json j = load("soak.json");
  EXPECT_EQ(j["steps"], 200);  // a mismatch is counted, the soak goes on
  EXPECT_EQ(j["mismatched_steps"], 1);
  EXPECT_EQ(j["mismatches"], 1);
  EXPECT_FALSE(j["passed"].get<bool>());
  ASSERT_EQ(j["first_mismatches"].size(), 1u);
  EXPECT_TRUE(contains(j["first_mismatches"][0].get<std::string>(), "step 77 P=4"))
      << j["first_mismatches"][0];
}

TEST_F(SoakCli, SameSeedSameSteps) {
  ASSERT_EQ(run("soak --steps 150 --seed 9 -q --json " + path("a.json")).code, 0);
  ASSERT_EQ(run("soak --steps 150 --seed 9 -q --json " + path("b.json")).code, 0);
  ASSERT_EQ(run("soak --steps 150 --seed 10 -q --json " + path("c.json")).code, 0);
  const json a = load("a.json"), b = load("b.json"), c = load("c.json");
  for (const char* key : {"lists_compared", "steps_by_world_size", "hostile_events"}) {
    EXPECT_EQ(a[key], b[key]) << key;
  }
  EXPECT_TRUE(a["lists_compared"] != c["lists_compared"] ||
              a["steps_by_world_size"] != c["steps_by_world_size"] ||
              a["hostile_events"] != c["hostile_events"])
      << "another seed, the same draws";
}

TEST_F(SoakCli, BadFlagsNameTheFlag) {
  struct Bad {
    const char* args;
    const char* named;
  };
  for (const Bad& bad :
       {Bad{"soak --ranks 3", "--ranks"}, Bad{"soak --ranks 0x3", "--ranks"},
        Bad{"soak --ranks 12x", "--ranks"}, Bad{"soak --steps 0", "--steps"},
        Bad{"soak --max-q-len 9", "--max-q-len"}, Bad{"soak --max-context -1", "--max-context"},
        Bad{"soak --max-seconds nan", "--max-seconds"}, Bad{"soak --bogus", "--bogus"}}) {
    SCOPED_TRACE(bad.args);
    const SoakRun r = run(bad.args);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_TRUE(contains(r.err, bad.named)) << r.err;
  }
}

TEST_F(SoakCli, TimeLimitStopsAndFails) {
  const SoakRun r = run("soak --steps 100000000 --max-seconds 0.5 -q --json " + path("soak.json"));
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  const json j = load("soak.json");
  EXPECT_TRUE(j["stopped_by_time_limit"].get<bool>());
  EXPECT_LT(j["steps"].get<int64_t>(), 100000000);
  EXPECT_EQ(j["mismatches"], 0);
}

TEST_F(SoakCli, GpuModeWithoutAGpuIsALibraryError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: scripts/gpu_steps/soak.sh";
  const SoakRun r = run("soak --gpu --steps 3 -q");
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "soak --gpu") || contains(r.err, "no CUDA device")) << r.err;
}

}  // namespace
}  // namespace m3msa
