// forward_layer with the mixture of experts on the CUDA backend (docs/runtime.md, docs/spec.md
// section 8): against the CPU runtime layer by layer (teacher forcing: both backends start every
// layer from the CPU's input), bf16 and MXFP8 experts, with and without the dense layer 0 (dense
// attention and the dense MLP) bound in front; StepGraphs replay equals the same steps run
// eagerly, bit for bit. Skips without a GPU.
//
// Tolerances: the MoE output is a sum of 2-GEMM functions of h2, like the dense MLP of
// runtime_gpu_fixture.h, so it is checked per row by relative L2 error <= 2^-5. A row may also
// route differently: h2 differs by bf16 roundings between the backends, which can swap two experts
// whose keys are within ~1e-3 across the k-th place, and then its output legitimately differs; at
// most an eighth of the live rows may fail the L2 check (counted and printed), and no row may hold
// a NaN or an infinity the CPU does not. A dense layer routes nothing: every one of its rows must
// pass.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "m3msa/testing/moe_model.h"
#include "runtime_gpu_fixture.h"

namespace m3msa {
namespace {

using namespace rtgpu;

// dense_layers: layer 0 (the fixture's first_sparse_layer is 1) bound as a dense layer with a
// dense MLP of width 1024.
Scenario moe_scenario(uint64_t seed, bool fp8, const std::vector<Shape>& shapes,
                      bool dense_layers = false) {
  Scenario s = make_scenario(seed, shapes);
  ModelConfig& m = s.config.model;
  m.intermediate = 0;
  m.num_experts = 16;
  m.experts_per_token = 4;
  m.moe_intermediate = 256;
  m.shared_experts = 1;
  m.dense_intermediate = 1024;
  s.master.config = m;
  for (std::size_t i = 0; i < s.master.layers.size(); ++i) {
    testkit::MasterLayer& layer = s.master.layers[i];
    layer.mlp = false;
    layer.gate.clear();
    layer.up.clear();
    layer.down.clear();
    layer.has_moe = true;
    layer.moe = testkit::make_master_moe(m, seed * 97 + i, fp8);
  }
  if (dense_layers) testkit::add_dense_layers(s.master, seed * 89, fp8);
  return s;
}

void run_against_cpu(uint64_t seed, bool fp8, bool dense_layers = false) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = moe_scenario(seed, fp8, default_shapes(), dense_layers);
  const ModelConfig& m = s.config.model;
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1);
  testkit::RankModel host_for_gpu = testkit::make_rank_model(s.master, 0, 1);
  DeviceModel dev = upload_model(host_for_gpu, 0);
  auto comm_cpu = make_single_rank_communicator();
  auto comm_gpu = make_single_rank_communicator();
  Runtime cpu([](const std::string&) {});
  Runtime gpu([](const std::string&) {});
  ASSERT_EQ(cpu.prepare(host.weights, s.config, *comm_cpu), PrepareResult::kActive);
  ASSERT_EQ(gpu.prepare(dev.weights, s.config, *comm_gpu), PrepareResult::kActive)
      << gpu.stats().to_json();
  const int64_t H = m.hidden;
  DeviceTensor d_hidden(DType::kBF16, {16, H}), d_residual(DType::kBF16, {16, H});
  DeviceTensor d_positions(DType::kI64, {16});
  cudaStream_t stream = static_cast<cudaStream_t>(gpu.cuda_stream());
  int64_t rows_checked = 0, rows_bad = 0, nonfinite = 0, dense_rows = 0, dense_bad = 0;
  double worst = 0;
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const StepMeta& meta = s.steps[step];
    const int64_t rows = meta.batch.num_rows();
    ASSERT_TRUE(cpu.begin_step(meta.batch));
    ASSERT_TRUE(gpu.begin_step(meta.batch));
    std::vector<uint16_t> hidden = s.hidden_in[step];
    std::vector<uint16_t> residual = s.residual_in[step];
    const TensorView hv =
        TensorView::contiguous(d_hidden.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView rv =
        TensorView::contiguous(d_residual.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView pv =
        TensorView::contiguous(d_positions.data(), DType::kI64, {rows}, Device::cuda(0));
    upload_into(pv, meta.positions.data(), meta.positions.nbytes());
    for (const testkit::MasterLayer& layer : s.master.layers) {
      upload_into(hv, hidden.data(), hidden.size() * 2);
      upload_into(rv, residual.data(), residual.size() * 2);
      gpu.forward_layer(layer.layer, hv, rv, pv);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> got = download<uint16_t>(hv);
      cpu.forward_layer(layer.layer, TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}),
                        TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}),
                        meta.positions.view());
      for (int64_t r = 0; r < rows; ++r) {
        if (meta.positions.ptr<int64_t>()[r] < 0) continue;
        double err = 0, norm = 0;
        for (int64_t i = 0; i < H; ++i) {
          const double g = bf16_to_float(got[static_cast<std::size_t>(r * H + i)]);
          const double w = bf16_to_float(hidden[static_cast<std::size_t>(r * H + i)]);
          if (std::isfinite(g) != std::isfinite(w)) ++nonfinite;
          if (!std::isfinite(g) || !std::isfinite(w)) continue;
          err += (g - w) * (g - w);
          norm += w * w;
        }
        const double ratio = std::sqrt(err / std::max(norm, 1e-30)) / (1.0 / 32);
        worst = std::max(worst, ratio);
        rows_bad += ratio > 1.0;
        ++rows_checked;
        if (layer.dense) {
          dense_bad += ratio > 1.0;
          ++dense_rows;
        }
      }
    }
  }
  std::printf(
      "[ info ] MoE %s: %lld of %lld rows beyond relative L2 2^-5 (routing swaps), worst "
      "ratio %.3f\n",
      fp8 ? "mxfp8" : "bf16", static_cast<long long>(rows_bad),
      static_cast<long long>(rows_checked), worst);
  EXPECT_GT(rows_checked, 0);
  EXPECT_LE(rows_bad * 8, rows_checked);
  EXPECT_EQ(nonfinite, 0);
  EXPECT_EQ(dense_rows > 0, dense_layers);
  EXPECT_EQ(dense_bad, 0) << "of " << dense_rows << " dense-layer rows";
  gpu.close();
  cpu.close();
}

TEST(MoeRuntimeGpu, Bf16ForwardLayerMatchesCpuRuntime) {
  run_against_cpu(611, false);
}

TEST(MoeRuntimeGpu, Mxfp8ForwardLayerMatchesCpuRuntime) {
  run_against_cpu(612, true);
}

TEST(DenseLayersRuntimeGpu, Bf16DenseLayerMatchesCpuRuntime) {
  run_against_cpu(621, false, /*dense_layers=*/true);
}

TEST(DenseLayersRuntimeGpu, Mxfp8DenseLayerMatchesCpuRuntime) {
  run_against_cpu(622, true, /*dense_layers=*/true);
}

void graph_replay_equals_eager(uint64_t seed, bool dense_layers) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const std::vector<Shape> shapes = {{{700, 1500, 0, 2000}, 2}, {{703, 1503, 90}, 1}};
  const Scenario s = moe_scenario(seed, /*fp8=*/true, shapes, dense_layers);
  const int64_t H = s.config.model.hidden;
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1);
  auto comm = make_single_rank_communicator();
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    std::vector<std::vector<uint16_t>> outs;
    for (bool graph : {false, true}) {
      // A fresh model (caches as the master's) for each run.
      DeviceModel dev = upload_model(host, 0);
      Runtime rt([](const std::string&) {});
      ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive);
      {
        StepGraphs graphs(rt);
        const StepMeta& meta = s.steps[step];
        upload_into(graphs.hidden(), s.hidden_in[step].data(), s.hidden_in[step].size() * 2);
        upload_into(graphs.residual(), s.residual_in[step].data(), s.residual_in[step].size() * 2);
        upload_into(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
        ASSERT_TRUE(graph ? graphs.run(meta.batch) : graphs.run_eager(meta.batch));
        CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(rt.cuda_stream())));
        std::vector<uint16_t> h = download<uint16_t>(graphs.hidden());
        h.resize(static_cast<std::size_t>(meta.batch.num_rows() * H));
        outs.push_back(h);
      }
      rt.close();
    }
    EXPECT_EQ(outs[0], outs[1]) << "step " << step << ": graph replay != eager";
    EXPECT_NE(outs[0], s.hidden_in[step]) << "step " << step;
  }
}

TEST(MoeRuntimeGpu, GraphReplayEqualsEager) {
  graph_replay_equals_eager(613, false);
}

// Every MoE schedule of the runtime (M3MSA_MOE_SCHEDULE: the launch sequence, deep, down4, the
// persistent kernel) gives the launch sequence's bits under StepGraphs replay, bf16 and MXFP8; a
// bad value is refused at prepare, naming the variable.
TEST(MoeRuntimeGpu, EveryMoeScheduleGivesTheSameBits) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  struct EnvRestore {
    ~EnvRestore() { unsetenv("M3MSA_MOE_SCHEDULE"); }
  } restore;
  const std::vector<Shape> shapes = {{{700, 1500, 0, 2000}, 2}, {{703, 1503, 90}, 1}};
  for (bool fp8 : {false, true}) {
    const Scenario s = moe_scenario(fp8 ? 615 : 614, fp8, shapes);
    const int64_t H = s.config.model.hidden;
    testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1);
    auto comm = make_single_rank_communicator();
    std::vector<std::vector<uint16_t>> first;  // the launch sequence's outputs, per step
    for (const char* schedule : {"launches", "deep", "down4", "persistent"}) {
      SCOPED_TRACE(std::string(schedule) + (fp8 ? " mxfp8" : " bf16"));
      setenv("M3MSA_MOE_SCHEDULE", schedule, 1);
      DeviceModel dev = upload_model(host, 0);
      Runtime rt([](const std::string&) {});
      ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive);
      {
        StepGraphs graphs(rt);
        for (std::size_t step = 0; step < s.steps.size(); ++step) {
          const StepMeta& meta = s.steps[step];
          upload_into(graphs.hidden(), s.hidden_in[step].data(), s.hidden_in[step].size() * 2);
          upload_into(graphs.residual(), s.residual_in[step].data(),
                      s.residual_in[step].size() * 2);
          upload_into(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
          ASSERT_TRUE(graphs.run(meta.batch));
          CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(rt.cuda_stream())));
          std::vector<uint16_t> h = download<uint16_t>(graphs.hidden());
          h.resize(static_cast<std::size_t>(meta.batch.num_rows() * H));
          if (first.size() <= step) {
            first.push_back(h);
          } else {
            EXPECT_EQ(h, first[step]) << "step " << step << ": differs from the launch sequence";
          }
        }
      }
      rt.close();
    }
    first.clear();
  }
  setenv("M3MSA_MOE_SCHEDULE", "fastest", 1);
  const Scenario s = moe_scenario(616, true, shapes);
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1);
  DeviceModel dev = upload_model(host, 0);
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  try {
    rt.prepare(dev.weights, s.config, *comm);
    ADD_FAILURE() << "prepare took M3MSA_MOE_SCHEDULE=fastest";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("M3MSA_MOE_SCHEDULE"), std::string::npos) << e.what();
  }
}

TEST(DenseLayersRuntimeGpu, GraphReplayEqualsEager) {
  graph_replay_equals_eager(623, true);
}

}  // namespace
}  // namespace m3msa
