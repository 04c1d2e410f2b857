// Runs the built `m3msa` binary: help, info, a small runtime demo (TP = 2 rank threads, fp8,
// --cp), the ops-level demo (--ops), demo --ops --save + replay --check, bad
// flags (non-zero exit, the flag named on stderr) and, in a CUDA build, every benchmark's flag
// checks (exit 2 before it looks for a device, so they run on a machine without a GPU).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "m3msa/backend.h"
#include "m3msa/npy.h"
#include "m3msa/version.h"

namespace m3msa {
namespace {

namespace fs = std::filesystem;

#ifdef M3MSA_CLI_PATH
constexpr const char* kCli = M3MSA_CLI_PATH;
#else
constexpr const char* kCli = "";  // not built: every test skips
#endif

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kCli[0] == '\0' || !fs::exists(kCli)) {
      GTEST_SKIP() << "the m3msa binary is not built (M3MSA_BUILD_CLI=OFF)";
    }
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / (std::string("m3msa_cli_") + info->name());
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

  // Runs `m3msa ARGS` with stdout and stderr captured separately.
  Result run(const std::string& args) const {
    const std::string out_file = path("stdout.txt");
    const std::string err_file = path("stderr.txt");
    const std::string command =
        std::string("'") + kCli + "' " + args + " >'" + out_file + "' 2>'" + err_file + "'";
    const int status = std::system(command.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out_file);
    r.err = slurp(err_file);
    return r;
  }

  fs::path dir_;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_F(CliTest, HelpListsSubcommandsAndEveryFlagWithItsDefault) {
  Result r = run("--help");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* sub : {"demo", "info", "replay", "bench", "Exit codes"}) {
    EXPECT_TRUE(contains(r.out, sub)) << sub << "\n" << r.out;
  }
  r = run("demo --help");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* flag : {"--ops",
                           "--batch INT:INT in [1 - 4096]=4",
                           "--context INT:INT in [0 - 1073741824]=8192",
                           "--q-len INT:INT in [1 - 8]=2",
                           "--layers INT:INT in [1 - 57]=2",
                           "--steps INT:INT in [1 - 100000]=3",
                           "--tp INT:INT in [0 - 2]=0",
                           "--cp",
                           "--weights TEXT:{bf16,fp8}=bf16",
                           "--hidden",
                           "--intermediate",
                           "--ranks",
                           "--index-dtype TEXT:{bf16,fp8}=bf16",
                           "--kv-dtype TEXT:{bf16,fp8}=bf16",
                           "--backend TEXT:{auto,cpu,cuda}=auto",
                           "--check",
                           "--threads",
                           "--seed UINT=1",
                           "--save",
                           "--json",
                           "--quiet"}) {
    EXPECT_TRUE(contains(r.out, flag)) << flag << "\n" << r.out;
  }
  r = run("replay --help");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* flag : {"--out", "--backend", "--check", "--threads", "--json", "uint16"}) {
    EXPECT_TRUE(contains(r.out, flag)) << flag << "\n" << r.out;
  }
  r = run("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(contains(r.out, "m3msa ")) << r.out;
}

// The version comes from project(m3msa VERSION ...) through the generated m3msa/version.h.
TEST_F(CliTest, VersionIsTheCMakeProjectVersion) {
  const std::string version = std::to_string(M3MSA_VERSION_MAJOR) + "." +
                              std::to_string(M3MSA_VERSION_MINOR) + "." +
                              std::to_string(M3MSA_VERSION_PATCH);
  EXPECT_EQ(version, M3MSA_VERSION_STRING);
  Result r = run("--version");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "m3msa " + version + "\n");
  r = run("info");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "m3msa " + version + "\n")) << r.out;
  r = run("info --json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "\"version\": \"" + version + "\"")) << r.out;
}

TEST_F(CliTest, Info) {
  Result r = run("info");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* part : {"m3msa ", "build:", "backends:", "cpu", "cuda", "devices:", "topk=16"}) {
    EXPECT_TRUE(contains(r.out, part)) << part << "\n" << r.out;
  }
  r = run("info --json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "\"cuda_devices\"")) << r.out;
}

TEST_F(CliTest, RuntimeDemoRunsStepsAndPassesItsChecks) {
  // A small hidden size keeps it short; the attention dimensions are M3's either way.
  Result r =
      run("demo --backend cpu --tp 2 --hidden 256 --batch 2 --context 600 --steps 2 "
          "--threads 2 -q --json " +
          path("demo.json"));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  for (const char* part :
       {"the fused decode runtime (mono) on cpu", "TP 2 (ranks as threads), CP off",
        "64 q heads / 4 KV heads x 128", "top-16", "prepare: active",
        "stats (rank 0): state active, backend cpu, TP 2", "steps accepted 2", "fallbacks none",
        "oracle: the independent reference", "[ok] selections equal the oracle's",
        "[ok] layer outputs (hidden, residual)", "[ok] every rank's outputs bit-identical (TP 2)",
        "PASS"}) {
    EXPECT_TRUE(contains(r.out, part)) << part << "\n" << r.out;
  }
  EXPECT_FALSE(contains(r.out, "FAIL")) << r.out;
  EXPECT_TRUE(r.err.empty()) << "--quiet must keep stderr empty: " << r.err;
  const std::string json = slurp(path("demo.json"));
  for (const char* part : {"\"mode\": \"runtime\"", "\"passed\": true", "\"ms_per_layer\"",
                           "\"launches_per_layer\"", "\"fallback_reasons\""}) {
    EXPECT_TRUE(contains(json, part)) << part << "\n" << json;
  }

  // fp8 projections at TP = 1, plain decode rows.
  r =
      run("demo --backend cpu --tp 1 --weights fp8 --hidden 256 --batch 1 --context 300 "
          "--q-len 1 --steps 1 -q");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "weights fp8 e4m3")) << r.out;
  EXPECT_TRUE(contains(r.out, "[ok] layer outputs (hidden, residual)")) << r.out;

  // --cp: the indexer over the 2 rank threads, checked against the oracle like CP off.
  r = run("demo --backend cpu --cp --hidden 256 --batch 2 --context 2200 --steps 2 -q");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "prepare: active")) << r.out;
  EXPECT_TRUE(contains(r.out, "CP on")) << r.out;
  EXPECT_TRUE(contains(r.out, "[ok] selections equal the oracle's")) << r.out;
  EXPECT_TRUE(contains(r.out, "PASS")) << r.out;

  // --moe: the mixture of experts (MXFP8) after every sparse layer, at TP = 2.
  r = run("demo --backend cpu --moe --hidden 256 --batch 2 --context 600 --steps 2 -q");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "MoE 16 experts x 256 (top-4, 1 shared, mxfp8)")) << r.out;
  EXPECT_TRUE(contains(r.out, "[ok] MoE outputs (hidden) per row")) << r.out;
  EXPECT_TRUE(contains(r.out, "PASS")) << r.out;
}

TEST_F(CliTest, TinyOpsDemoPassesItsChecks) {
  // 2100 tokens: 17 blocks > topk, so the table has a dense "check" layer too.
  Result r = run("demo --ops --batch 2 --context 2100 --layers 1 --steps 2 --threads 2 -q --json " +
                 path("demo.json"));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "PASS")) << r.out;
  EXPECT_TRUE(contains(r.out, "== dense")) << r.out;
  EXPECT_TRUE(contains(r.out, "[ok] selections well-formed")) << r.out;
  EXPECT_TRUE(contains(r.out, "[ok] selections are exactly the top-k")) << r.out;
  EXPECT_TRUE(contains(r.out, "[ok] sparse attention == dense")) << r.out;
  EXPECT_FALSE(contains(r.out, "FAIL")) << r.out;
  EXPECT_TRUE(r.err.empty()) << "--quiet must keep stderr empty: " << r.err;
  EXPECT_TRUE(contains(slurp(path("demo.json")), "\"passed\": true"));
}

TEST_F(CliTest, DemoSpeculativeFp8ContextParallelAndReferenceMode) {
  Result r =
      run("demo --ops --batch 2 --context 700 --q-len 3 --layers 1 --steps 2 --index-dtype fp8 "
          "--kv-dtype fp8 --ranks 2 --threads 2 -q");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[ok] CP selection bit-identical")) << r.out;
  r = run("demo --ops --batch 1 --context 300 --layers 1 --steps 1 --check reference -q");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[ok] sparse attention vs the CPU reference")) << r.out;
}

TEST_F(CliTest, DemoSaveThenReplayMatches) {
  const std::string dir = path("case");
  Result r =
      run("demo --ops --batch 2 --context 400 --q-len 2 --layers 2 --steps 2 -q --save " + dir);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  for (const char* file : {"case.json", "index_q.npy", "q.npy", "index_cache.npy", "kv_cache.npy",
                           "seq_lens.npy", "index_block_table.npy", "kv_block_table.npy",
                           "expected_topk_idx.npy", "expected_out.npy"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / file)) << file;
  }
  r = run("replay " + dir + " --check --out " + path("outputs"));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[ok] topk_idx == expected_topk_idx recorded by cpu-reference"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "[ok] out == expected_out recorded by cpu-reference")) << r.out;
  EXPECT_TRUE(contains(r.out, "PASS")) << r.out;
  const HostTensor topk = load_npy(path("outputs/topk_idx.npy"), DType::kI32, {4, 4, 16});
  const HostTensor out = load_npy(path("outputs/out.npy"), DType::kBF16, {4, 64, 128});
  const HostTensor expected = load_npy(dir + "/expected_topk_idx.npy", DType::kI32);
  EXPECT_EQ(std::memcmp(topk.data(), expected.data(), topk.nbytes()), 0);

  // Without --out the outputs land in the case directory.
  r = run("replay " + dir);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "topk_idx.npy"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "out.npy"));

  // A recorded output that disagrees makes --check fail with exit code 1.
  HostTensor wrong = load_npy(dir + "/expected_out.npy", DType::kBF16);
  wrong.ptr<uint16_t>()[5] ^= 0x0100;
  save_npy(dir + "/expected_out.npy", wrong.view());
  r = run("replay " + dir + " --check");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[FAIL] out == expected_out")) << r.out;

  // A malformed tensor file is an error naming it.
  std::ofstream(fs::path(dir) / "q.npy") << "not an npy file";
  r = run("replay " + dir);
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "q.npy")) << r.err;
}

TEST_F(CliTest, BadFlagsExitNonZeroNamingTheFlag) {
  struct Bad {
    const char* args;
    const char* named;
  };
  for (const Bad& bad : {Bad{"demo --q-len 0", "--q-len"},
                         Bad{"demo --q-len 9", "--q-len"},
                         Bad{"demo --batch 0", "--batch"},
                         Bad{"demo --bogus-flag", "--bogus-flag"},
                         Bad{"demo --context -5", "--context"},
                         Bad{"demo --index-dtype fp16", "--index-dtype"},
                         Bad{"demo --kv-dtype e5m2", "--kv-dtype"},
                         Bad{"demo --backend tpu", "--backend"},
                         Bad{"demo --ops --ranks 3", "--ranks"},
                         Bad{"demo --steps abc", "--steps"},
                         Bad{"demo --ranks 2", "--ranks"},
                         Bad{"demo --save dir", "--save"},
                         Bad{"demo --check oracle", "--check"},
                         Bad{"demo --ops --weights fp8", "--weights"},
                         Bad{"demo --ops --tp 1", "--tp"},
                         Bad{"demo --tp 3", "--tp"},
                         Bad{"demo --weights fp16", "--weights"},
                         Bad{"demo --hidden 100", "--hidden"},
                         Bad{"demo --backend cpu --tp 2 --intermediate 96", "--intermediate"},
                         Bad{"replay", "dir"},
                         Bad{"frobnicate", "frobnicate"}}) {
    SCOPED_TRACE(bad.args);
    const Result r = run(bad.args);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_TRUE(contains(r.err, bad.named)) << r.err;
    EXPECT_TRUE(contains(r.err, "error")) << r.err;
  }
}

// The flag convention of every benchmark (bench/flags.h): an unknown flag and a bad value exit 2
// naming the flag, --help exits 0, all before the benchmark looks for a device.
TEST_F(CliTest, EveryBenchRefusesBadFlagsAndValuesBeforeTheDevice) {
  if (!built_with_cuda()) {
    GTEST_SKIP() << "built without CUDA: no benchmark is registered (BenchWithoutCudaSaysSo)";
  }
  struct BadValue {
    std::string args;
    std::string flag;  // named on stderr
  };
  struct Bench {
    std::string name;
    std::vector<BadValue> bad;
  };
  const std::vector<Bench> benches = {
      {"allreduce",
       {{"--reps 0", "--reps"},
        {"--rows 1,x", "--rows"},
        {"--tp 9", "--tp"},
        {"--hidden 0", "--hidden"}}},
      {"attention",
       {{"--reps 0", "--reps"},
        {"--batch 1,x", "--batch"},
        {"--kv bf17", "--kv"},
        {"--context 1024", "--context"},
        {"--q-len 9", "--q-len"},
        {"--tp 3", "--tp"},
        {"--layout ours,foo", "--layout"},
        {"--tunings 'default;bogus=1'", "--tunings"},
        {"--row-share 16", "--row-share"},
        {"--launches abc", "--launches"}}},
      {"cp",
       {{"--reps 0", "--reps"},
        {"--batches 1,,4", "--batches"},
        {"--contexts 0", "--contexts"},
        {"--transports peer,foo", "--transports"},
        {"--dtypes f32", "--dtypes"},
        {"--worlds 0", "--worlds"}}},
      {"gemm",
       {{"--reps 0", "--reps"},
        {"--rows 17", "--rows"},
        {"--shapes qkv_tp3", "--shapes"},
        {"--dtypes fp4", "--dtypes"},
        {"--check-cols -1", "--check-cols"}}},
      {"indexer",
       {{"--reps 0", "--reps"},
        {"--contexts 0", "--contexts"},
        {"--batches 1,4x", "--batches"},
        {"--tp 3", "--tp"},
        {"--q-dtypes e5m2", "--q-dtypes"},
        {"--min-blocks 0", "--min-blocks"}}},
      {"layer",
       {{"--reps 0", "--reps"},
        {"--tp 3", "--tp"},
        {"--tokens 17", "--tokens"},
        {"--q-len 3", "--q-len"},
        {"--context 2", "--context"},
        {"--cp maybe", "--cp"},
        {"--kv fp16", "--kv"},
        {"--weights bf16,x", "--weights"},
        {"--moe fp4", "--moe"},
        {"--layer-kind dense", "--layer-kind"},
        {"--allreduce ring", "--allreduce"},
        {"--overlap x", "--overlap"},
        {"--rank-of 3", "--rank-of"},
        {"--share-period 0", "--share-period"}}},
      {"moe",
       {{"--reps 0", "--reps"},
        {"--tp 5", "--tp"},
        {"--tokens 17", "--tokens"},
        {"--dtypes fp8", "--dtypes"},
        {"--kernels mma,x", "--kernels"},
        {"--what both", "--what"},
        {"--x-copies 0", "--x-copies"}}},
      {"sparse-step",
       {{"--reps 0", "--reps"},
        {"--batches 0", "--batches"},
        {"--tp 3", "--tp"},
        {"--indexer x", "--indexer"},
        {"--attention-tunings rows=3", "--attention-tunings"}}},
  };

  // `bench help` lists exactly these: a new benchmark needs its cases here.
  Result r = run("bench help");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const std::size_t list_at = r.out.find("Benchmarks:\n");
  ASSERT_NE(list_at, std::string::npos) << r.out;
  std::vector<std::string> listed;
  {
    std::istringstream lines(r.out.substr(list_at + std::string("Benchmarks:\n").size()));
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream words(line);
      std::string name;
      if (words >> name) listed.push_back(name);
    }
  }
  std::vector<std::string> expected;
  for (const Bench& b : benches) expected.push_back(b.name);
  EXPECT_EQ(listed, expected) << r.out;

  for (const Bench& b : benches) {
    SCOPED_TRACE("bench " + b.name);
    r = run("bench " + b.name + " --no-such-flag");
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_TRUE(contains(r.err, "--no-such-flag")) << r.err;

    r = run("bench " + b.name + " --help");
    EXPECT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_TRUE(contains(r.out, "Usage: m3msa bench " + b.name)) << r.out;
    EXPECT_TRUE(contains(r.out, "--reps")) << r.out;

    std::vector<BadValue> bad_values = b.bad;
    bad_values.push_back({"--json '" + path("no_such_folder/out.json") + "'", "--json"});
    for (const BadValue& bad : bad_values) {
      SCOPED_TRACE(bad.args);
      r = run("bench " + b.name + " " + bad.args);
      EXPECT_EQ(r.code, 2) << r.out << r.err;
      EXPECT_TRUE(contains(r.err, bad.flag)) << r.err;
      EXPECT_FALSE(contains(r.err, "no CUDA device")) << r.err;
    }

    // Good flags on a machine without a GPU: every benchmark says so (a library error, exit 3).
    if (cuda_device_count() == 0) {
      r = run("bench " + b.name + " --reps 1");
      EXPECT_EQ(r.code, 3) << r.out << r.err;
      EXPECT_TRUE(contains(r.err, "no CUDA device visible")) << r.err;
    }
  }
}

TEST_F(CliTest, BenchWithoutCudaSaysSo) {
  if (built_with_cuda()) GTEST_SKIP() << "built with CUDA: benchmarks may be registered";
  Result r = run("bench");
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "not built: needs the CUDA backend")) << r.err;
  r = run("bench attention --iters 3");
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "needs the CUDA backend")) << r.err;
  r = run("bench --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(contains(r.out, "needs the CUDA backend")) << r.out;
}

}  // namespace
}  // namespace m3msa
