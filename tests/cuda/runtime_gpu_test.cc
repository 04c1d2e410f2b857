// The CUDA backend of the runtime (runtime.h, src/runtime/gpu_engine.cc): forward_layer against the
// CPU runtime layer by layer, graph replay against eager, TP = 2 against TP = 1, the lifecycle and
// faults of one rank (oracles and tolerances: runtime_gpu_fixture.h). Every test skips without a
// GPU (TP = 2 ones without two).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "m3msa/testing/checks.h"
#include "runtime_gpu_fixture.h"

namespace m3msa {
namespace {

using namespace rtgpu;

// ---- GPU forward_layer vs the CPU runtime, layer by layer ----

struct AgainstCpu {
  bool fp8_qkv = false;
  bool device_metadata = false;
  bool context_parallel = false;  // TP = 1: the CP indexer at P = 1 (exchange with itself)
  int share_period = 1;
};

void run_against_cpu(uint64_t seed, const AgainstCpu& opt = {}) {
  Scenario s = make_scenario(seed);
  s.config.context_parallel = opt.context_parallel;
  s.config.selection_share_period = opt.share_period;
  const ModelConfig& m = s.config.model;
  const SparseConfig sc = m.sparse(1);
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1, opt.fp8_qkv);
  testkit::RankModel host_for_gpu = testkit::make_rank_model(s.master, 0, 1, opt.fp8_qkv);
  DeviceModel dev = upload_model(host_for_gpu, 0);
  auto comm_cpu = make_single_rank_communicator();
  auto comm_gpu = make_single_rank_communicator();
  Runtime cpu([](const std::string&) {});
  Runtime gpu([](const std::string&) {});
  ASSERT_EQ(cpu.prepare(host.weights, s.config, *comm_cpu), PrepareResult::kActive);
  ASSERT_EQ(gpu.prepare(dev.weights, s.config, *comm_gpu), PrepareResult::kActive)
      << gpu.stats().to_json();
  EXPECT_EQ(gpu.stats().context_parallel, opt.context_parallel);
  EXPECT_EQ(gpu.stats().backend, "cuda");
  EXPECT_EQ(gpu.device(), Device::cuda(0));
  const int64_t H = m.hidden;
  DeviceTensor d_hidden(DType::kBF16, {16, H}), d_residual(DType::kBF16, {16, H});
  DeviceTensor d_positions(DType::kI64, {16});
  cudaStream_t stream = static_cast<cudaStream_t>(gpu.cuda_stream());
  ASSERT_NE(stream, nullptr);

  Check out_check, res_check, mlp_check;
  int64_t selection_failures = 0, swapped_rows = 0, rows_total = 0, shared_mismatches = 0;
  std::string selection_first;
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const StepMeta& meta = s.steps[step];
    const int64_t rows = meta.batch.num_rows();
    ASSERT_TRUE(cpu.begin_step(meta.batch)) << cpu.stats().last_refusal;
    DeviceBatch db;
    if (opt.device_metadata) db = device_batch(meta.batch, 0);
    ASSERT_TRUE(gpu.begin_step(opt.device_metadata ? db.batch : meta.batch))
        << gpu.stats().last_refusal;
    // Rows whose selection swapped near-tied blocks in the step's last indexer layer (a sharing
    // layer inherits them).
    std::vector<bool> swapped(static_cast<std::size_t>(rows), false);
    std::vector<int32_t> last_gpu_topk;
    std::vector<uint16_t> hidden = s.hidden_in[step];
    std::vector<uint16_t> residual = s.residual_in[step];
    const TensorView hv =
        TensorView::contiguous(d_hidden.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView rv =
        TensorView::contiguous(d_residual.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView pv =
        TensorView::contiguous(d_positions.data(), DType::kI64, {rows}, Device::cuda(0));
    upload_into(pv, meta.positions.data(), meta.positions.nbytes());
    for (std::size_t l = 0; l < s.master.layers.size(); ++l) {
      const int layer = s.master.layers[l].layer;
      // Both backends start the layer from the CPU's input.
      upload_into(hv, hidden.data(), hidden.size() * 2);
      upload_into(rv, residual.data(), residual.size() * 2);
      gpu.forward_layer(layer, hv, rv, pv);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const Runtime::LayerTrace gt = gpu.last_layer_trace();
      const std::vector<int32_t> gpu_topk = download<int32_t>(gt.topk);
      const std::vector<uint16_t> gpu_hidden = download<uint16_t>(hv);
      const std::vector<uint16_t> gpu_residual = download<uint16_t>(rv);

      cpu.forward_layer(layer, TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}),
                        TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}),
                        meta.positions.view());
      const Runtime::LayerTrace ct = cpu.last_layer_trace();
      const bool shares = (layer - m.first_sparse_layer) % opt.share_period != 0;
      if (shares) {
        // No indexer ran: the GPU attends with its own last selection, bit for bit.
        shared_mismatches += gpu_topk != last_gpu_topk;
      } else {
        // Scores of the CPU's index_q over the CPU's caches (the near-tie rule's reference).
        IndexerArgs idx;
        idx.index_q = ct.index_q;
        idx.index_cache = host.weights.layers[l].index_cache;
        idx.batch = cpu.step_metadata();
        idx.topk_idx = ct.topk;
        HostTensor scores(DType::kF32, {rows, sc.index_heads, max_blocks()});
        cpu::score_blocks(sc, idx, scores.view());
        std::fill(swapped.begin(), swapped.end(), false);
        selection_failures +=
            testkit::compare_selection_near_tie(sc, gpu_topk, host_values<int32_t>(ct.topk), scores,
                                                meta.batch, swapped, selection_first);
        for (bool b : swapped) swapped_rows += b;
        rows_total += rows;
        last_gpu_topk = gpu_topk;
      }
      const std::string where = "step " + std::to_string(step) + " layer " + std::to_string(layer);
      compare_bf16(res_check, gpu_residual.data(), residual.data(), rows, H, kAbsTol, kRelTol,
                   swapped, where + " residual");
      if (host.weights.layers[l].mlp_down.defined()) {
        compare_bf16_rows_l2(mlp_check, gpu_hidden.data(), hidden.data(), rows, H, swapped,
                             where + " MLP output");
      } else {
        compare_bf16(out_check, gpu_hidden.data(), hidden.data(), rows, H, kAbsTol, kRelTol,
                     swapped, where + " hidden");
      }
    }
  }
  EXPECT_EQ(mlp_check.bad, 0) << mlp_check.first << " (worst " << mlp_check.worst << ")";
  EXPECT_GT(mlp_check.checked, 0);
  std::printf("[ info ] MLP output: worst relative L2 error / tolerance %.3f\n", mlp_check.worst);
  EXPECT_EQ(selection_failures, 0) << selection_first;
  EXPECT_LE(swapped_rows * 4, rows_total)
      << swapped_rows << " of " << rows_total << " rows swapped near-tied blocks";
  EXPECT_EQ(res_check.bad, 0) << res_check.first << " (worst " << res_check.worst << " of the "
                              << "tolerance)";
  EXPECT_EQ(out_check.bad, 0) << out_check.first << " (worst " << out_check.worst << ")";
  EXPECT_GT(out_check.checked, 0);
  std::printf(
      "[ info ] %lld rows, %lld near-tie rows; worst error / tolerance: residual %.3f, "
      "hidden %.3f; launches per layer %lld\n",
      static_cast<long long>(rows_total), static_cast<long long>(swapped_rows), res_check.worst,
      out_check.worst, static_cast<long long>(gpu.stats().launches_per_layer));
  EXPECT_EQ(shared_mismatches, 0) << "a sharing layer did not attend with the last selection";
  EXPECT_EQ(gpu.stats().layers_run, cpu.stats().layers_run);
  EXPECT_EQ(gpu.stats().sharing_layers_run, cpu.stats().sharing_layers_run);
  if (opt.share_period > 1) {
    EXPECT_GT(gpu.stats().sharing_layers_run, 0);
  }
  compare_caches(sc, host, dev, s.steps);
  gpu.close();
  cpu.close();
  EXPECT_EQ(gpu.state(), RuntimeState::kClosed);
}

// ---- The layer ----

TEST(RuntimeGpu, LayerMatchesCpuBf16) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(101);
}

TEST(RuntimeGpu, LayerMatchesCpuFp8) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(202, {.fp8_qkv = true});
}

TEST(RuntimeGpu, LayerMatchesCpuDeviceMetadata) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(303, {.device_metadata = true});
}

// The CP indexer inside forward_layer (P = 1) and cross-layer selection sharing (period 2:
// layer 2 shares layer 1's selection), against the CPU runtime with the same options.
TEST(RuntimeGpu, LayerMatchesCpuContextParallel) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(313, {.context_parallel = true});
}

TEST(RuntimeGpu, LayerMatchesCpuSelectionSharing) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(323, {.fp8_qkv = true, .share_period = 2});
}

// One GPU runtime with StepGraphs: the same step (caches restored, same inputs) run eagerly and
// replayed gives bit-identical outputs and caches, for several shapes, padded steps, and a
// captured graph replayed with another step's metadata.
TEST(RuntimeGpu, GraphReplayEqualsEager) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const std::vector<Shape> shapes = {{{700, 1500, 0, 2000}, 2},     // 8 rows: bucket 8
                                     {{702, 1502, 0, 2002}, 2},     // same graph, new metadata
                                     {{703, 1503, 90}, 1},          // 3 rows padded to 4
                                     {{1000, 2040}, 4},             // 8 rows of q_len 4
                                     {{5, 130, 257, 400, 555}, 1},  // 5 rows padded to 8
                                     {{77, 1900, 1234}, 1}};        // bucket 4 again
  const Scenario s = make_scenario(404, shapes);
  const ModelConfig& m = s.config.model;
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  // Pristine caches to restore before each run.
  std::vector<DeviceTensor> pristine;
  for (const LayerWeights& w : dev.weights.layers) {
    for (const TensorView& v : {w.kv_cache.data, w.index_cache.data}) {
      DeviceTensor copy(v.dtype, v.sizes());
      CUDA_CHECK(cudaMemcpy(copy.data(), v.data, v.nbytes(), cudaMemcpyDeviceToDevice));
      pristine.push_back(copy);
    }
  }
  auto restore = [&] {
    std::size_t i = 0;
    for (const LayerWeights& w : dev.weights.layers) {
      for (const TensorView& v : {w.kv_cache.data, w.index_cache.data}) {
        CUDA_CHECK(cudaMemcpy(v.data, pristine[i++].data(), v.nbytes(), cudaMemcpyDeviceToDevice));
      }
    }
    CUDA_CHECK(cudaDeviceSynchronize());  // device-to-device cudaMemcpy is asynchronous
  };
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive);
  StepGraphs graphs(rt);
  cudaStream_t stream = static_cast<cudaStream_t>(rt.cuda_stream());
  const int64_t H = m.hidden;

  struct Result {
    std::vector<uint16_t> hidden, residual;
    std::vector<std::vector<uint8_t>> caches;
  };
  auto run_one = [&](std::size_t step, bool graph) {
    restore();
    fill_device_bytes(graphs.hidden(), 0);
    fill_device_bytes(graphs.residual(), 0);
    const StepMeta& meta = s.steps[step];
    const int64_t rows = meta.batch.num_rows();
    upload_into(graphs.hidden(), s.hidden_in[step].data(), s.hidden_in[step].size() * 2);
    upload_into(graphs.residual(), s.residual_in[step].data(), s.residual_in[step].size() * 2);
    upload_into(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
    const bool ran = graph ? graphs.run(meta.batch) : graphs.run_eager(meta.batch);
    EXPECT_TRUE(ran) << rt.stats().last_refusal;
    CUDA_CHECK(cudaStreamSynchronize(stream));
    Result r;
    r.hidden = download<uint16_t>(graphs.hidden());
    r.residual = download<uint16_t>(graphs.residual());
    r.hidden.resize(static_cast<std::size_t>(rows * H));
    r.residual.resize(static_cast<std::size_t>(rows * H));
    for (const LayerWeights& w : dev.weights.layers) {
      r.caches.push_back(download<uint8_t>(w.kv_cache.data));
      r.caches.push_back(download<uint8_t>(w.index_cache.data));
    }
    return r;
  };
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const Result eager = run_one(step, false);
    const Result replay = run_one(step, true);
    EXPECT_EQ(eager.hidden, replay.hidden) << "step " << step;
    EXPECT_EQ(eager.residual, replay.residual) << "step " << step;
    EXPECT_TRUE(eager.caches == replay.caches) << "step " << step << ": caches differ";
    // The step really ran: its outputs are not the inputs.
    EXPECT_NE(eager.residual, s.residual_in[step]) << "step " << step;
  }
  // Shapes (padded requests x q_len): (4, 2), (4, 1), (2, 4), (8, 1) -> 4 graphs.
  EXPECT_EQ(graphs.graphs(), 4);
  EXPECT_EQ(graphs.padded_requests(3, 1), 4);
  EXPECT_EQ(graphs.padded_requests(5, 1), 8);
  const RuntimeStats st = rt.stats();
  EXPECT_EQ(st.graphs_captured, 4);
  EXPECT_EQ(st.graph_replays, static_cast<int64_t>(s.steps.size()));
  EXPECT_EQ(st.layers_run, static_cast<int64_t>(2 * s.steps.size() * s.master.layers.size()));
  EXPECT_GT(st.launches_per_layer, 6);
  graphs.reset();
  rt.close();
}

// prepare while the runtime's stream captures is refused (the flag and the stream itself), and so
// is begin_step (its copies would be captured with stale metadata).
TEST(RuntimeGpu, PrepareAndBeginStepRefusedWhileCapturing) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(505, {{{300, 900}, 1}});
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  cuda::Stream stream;
  RuntimeConfig config = s.config;
  config.cuda_stream = stream.get();
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});

  StepContext capturing;
  capturing.capturing = true;
  try {
    rt.prepare(dev.weights, config, *comm, capturing);
    ADD_FAILURE() << "prepare with StepContext::capturing succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }

  CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  bool threw = false;
  try {
    rt.prepare(dev.weights, config, *comm);
  } catch (const Error& e) {
    threw = true;
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("capturing"), std::string::npos) << e.what();
  }
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  if (graph) cudaGraphDestroy(graph);
  EXPECT_TRUE(threw) << "prepare ran while config.cuda_stream was capturing";
  EXPECT_EQ(rt.state(), RuntimeState::kIdle);

  ASSERT_EQ(rt.prepare(dev.weights, config, *comm), PrepareResult::kActive);
  EXPECT_EQ(rt.cuda_stream(), static_cast<void*>(stream.get()));
  CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  threw = false;
  try {
    rt.begin_step(s.steps[0].batch);
  } catch (const Error& e) {
    threw = true;
    EXPECT_NE(e.message().find("capturing"), std::string::npos) << e.what();
  }
  graph = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  if (graph) cudaGraphDestroy(graph);
  EXPECT_TRUE(threw) << "begin_step ran while the stream was capturing";
  // Eager again: accepted.
  EXPECT_TRUE(rt.begin_step(s.steps[0].batch));
  rt.close();
}

// What the CUDA path does not run falls back (every rank "unsupported", reason named); tensors
// on two devices are an error.
TEST(RuntimeGpu, UnsupportedFallsBackAndMixedDevicesFail) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  {
    RuntimeConfig c = testkit::small_config();  // 32-d heads, blocks of 16
    const MasterModel master = testkit::make_master(c.model, 20, 7, true);
    testkit::RankModel host = testkit::make_rank_model(master, 0, 1, false);
    DeviceModel dev = upload_model(host, 0);
    auto comm = make_single_rank_communicator();
    Runtime rt([](const std::string&) {});
    EXPECT_EQ(rt.prepare(dev.weights, c, *comm), PrepareResult::kFallback);
    const RuntimeStats st = rt.stats();
    ASSERT_FALSE(st.fallback_reasons.empty());
    const std::string reason = st.fallback_reasons.begin()->first;
    EXPECT_NE(reason.find("CUDA backend: head_dim must be 128"), std::string::npos) << reason;
    EXPECT_NE(reason.find("block_size must be 128"), std::string::npos) << reason;
  }
  {
    const Scenario s = make_scenario(606, {{{300}, 1}});
    testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1, false);
    DeviceModel dev = upload_model(host, 0);
    dev.weights.layers[0].input_norm = host.weights.layers[0].input_norm;  // a host tensor
    auto comm = make_single_rank_communicator();
    Runtime rt([](const std::string&) {});
    try {
      rt.prepare(dev.weights, s.config, *comm);
      ADD_FAILURE() << "prepare accepted tensors on two devices";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(e.message().find("input_norm: expected a tensor on cuda:0"), std::string::npos)
          << e.what();
    }
  }
  {
    // TP = 2 through a ThreadGroup with the all-reduce on NCCL: unsupported on both ranks ->
    // fallback (the default, auto, would use peer stores into the other rank's memory).
    Scenario s = make_scenario(707, {{{300}, 1}});
    s.config.tp_allreduce = TpAllReduce::kNccl;
    std::vector<DeviceModel> devs;
    std::vector<testkit::RankModel> hosts;
    for (int r = 0; r < 2; ++r) {
      hosts.push_back(testkit::make_rank_model(s.master, r, 2, false));
      devs.push_back(upload_model(hosts.back(), 0));
    }
    auto group = ThreadGroup::create(2, std::chrono::seconds(60));
    std::vector<PrepareResult> results(2);
    std::vector<std::string> reasons(2);
    const auto errors = run_ranks(group, [&](Communicator& comm) {
      Runtime rt([](const std::string&) {});
      results[static_cast<std::size_t>(comm.rank())] =
          rt.prepare(devs[static_cast<std::size_t>(comm.rank())].weights, s.config, comm);
      const auto st = rt.stats();
      if (!st.fallback_reasons.empty()) {
        reasons[static_cast<std::size_t>(comm.rank())] = st.fallback_reasons.begin()->first;
      }
    });
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(results[static_cast<std::size_t>(r)], PrepareResult::kFallback);
      EXPECT_NE(reasons[static_cast<std::size_t>(r)].find("needs an NcclCommunicator"),
                std::string::npos)
          << reasons[static_cast<std::size_t>(r)];
    }
  }
}

// 1000 prepare / step / detach cycles (every 100th with a captured graph): the device memory in
// use does not grow.
TEST(RuntimeGpu, DetachPrepareCyclesKeepDeviceMemoryStable) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(808, {{{700, 1500, 0, 2000}, 2}});
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  const StepMeta& meta = s.steps[0];
  const int64_t rows = meta.batch.num_rows();
  const int64_t H = s.config.model.hidden;
  DeviceTensor hidden(DType::kBF16, {rows, H}), residual(DType::kBF16, {rows, H});
  DeviceTensor positions(DType::kI64, {rows});
  upload_into(positions.view(), meta.positions.data(), meta.positions.nbytes());
  fill_device_bytes(hidden.view(), 0);
  fill_device_bytes(residual.view(), 0);
  std::vector<LayerCaches> empty;
  for (const LayerWeights& w : dev.weights.layers) empty.push_back(LayerCaches{w.layer, {}, {}});
  std::size_t free_early = 0, free_end = 0, total = 0;
  constexpr int kCycles = 1000;
  for (int cycle = 0; cycle < kCycles; ++cycle) {
    ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive)
        << "cycle " << cycle;
    if (cycle % 100 == 0) {
      StepGraphs graphs(rt);
      upload_into(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
      ASSERT_TRUE(graphs.run(meta.batch));
      CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(rt.cuda_stream())));
    } else {
      ASSERT_TRUE(rt.begin_step(meta.batch));
      for (const LayerWeights& w : dev.weights.layers) {
        rt.forward_layer(w.layer, hidden.view(), residual.view(), positions.view());
      }
    }
    rt.detach(empty);
    ASSERT_EQ(rt.state(), RuntimeState::kClosed);
    if (cycle == 9) CUDA_CHECK(cudaMemGetInfo(&free_early, &total));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemGetInfo(&free_end, &total));
  // Allocator granularity may move a few MiB; a leak of one prepare's buffers per cycle would be
  // hundreds of MiB over 990 cycles.
  EXPECT_GE(free_end + (8u << 20), free_early)
      << "device memory in use grew by " << (free_early - free_end) / 1048576.0 << " MiB over "
      << kCycles - 10 << " cycles";
  // A non-empty replacement is refused (after a fresh prepare).
  ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive);
  std::vector<LayerCaches> full = {
      LayerCaches{dev.weights.layers[0].layer, dev.weights.layers[0].kv_cache, {}}};
  EXPECT_THROW(rt.detach(full), Error);
  rt.close();
}

// ---- Tensor parallelism: ranks as threads ----

// Per step and layer: the input (hidden, residual) and output of TP = 1, and its selections.
struct LayerRecord {
  std::vector<uint16_t> in_hidden, in_residual, out_hidden, out_residual;
  std::vector<int32_t> topk;  // [rows, H, k]
};

// TP = 1 on GPU 0, chained through the layers; every layer recorded.
std::vector<std::vector<LayerRecord>> record_tp1(const Scenario& s) {
  const int64_t H = s.config.model.hidden;
  std::vector<std::vector<LayerRecord>> records(s.steps.size());
  testkit::RankModel host = testkit::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  M3MSA_CHECK_INTERNAL(rt.prepare(dev.weights, s.config, *comm) == PrepareResult::kActive,
                       "TP = 1 prepare: ", rt.stats().to_json());
  DeviceTensor hidden(DType::kBF16, {16, H}), residual(DType::kBF16, {16, H});
  DeviceTensor positions(DType::kI64, {16});
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const StepMeta& meta = s.steps[step];
    const int64_t rows = meta.batch.num_rows();
    const TensorView hv =
        TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView rv =
        TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView pv =
        TensorView::contiguous(positions.data(), DType::kI64, {rows}, Device::cuda(0));
    upload_into(pv, meta.positions.data(), meta.positions.nbytes());
    upload_into(hv, s.hidden_in[step].data(), s.hidden_in[step].size() * 2);
    upload_into(rv, s.residual_in[step].data(), s.residual_in[step].size() * 2);
    M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "TP = 1 refused step ", step);
    for (const testkit::MasterLayer& layer : s.master.layers) {
      LayerRecord rec;
      rec.in_hidden = download<uint16_t>(hv);
      rec.in_residual = download<uint16_t>(rv);
      rt.forward_layer(layer.layer, hv, rv, pv);
      CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(rt.cuda_stream())));
      rec.out_hidden = download<uint16_t>(hv);
      rec.out_residual = download<uint16_t>(rv);
      rec.topk = download<int32_t>(rt.last_layer_trace().topk);
      records[step].push_back(rec);
    }
  }
  rt.close();
  return records;
}

// The indexer beside the q/k/v projection (RuntimeConfig::indexer_overlap) only moves when
// kernels run: off, on and auto (on for the q_len >= 2 steps) give every layer the same bits.
TEST(RuntimeGpu, IndexerOverlapChangesNoResult) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  Scenario s = make_scenario(611);
  s.config.indexer_overlap = IndexerOverlap::kOff;
  const auto serial = record_tp1(s);
  for (IndexerOverlap mode : {IndexerOverlap::kOn, IndexerOverlap::kAuto}) {
    s.config.indexer_overlap = mode;
    const auto overlapped = record_tp1(s);
    ASSERT_EQ(overlapped.size(), serial.size());
    for (std::size_t step = 0; step < serial.size(); ++step) {
      for (std::size_t l = 0; l < serial[step].size(); ++l) {
        const LayerRecord& a = overlapped[step][l];
        const LayerRecord& b = serial[step][l];
        const std::string where = std::string(indexer_overlap_name(mode)) + ", step " +
                                  std::to_string(step) + ", layer " + std::to_string(l);
        EXPECT_EQ(a.out_hidden, b.out_hidden) << where;
        EXPECT_EQ(a.out_residual, b.out_residual) << where;
        EXPECT_EQ(a.topk, b.topk) << where;
        EXPECT_NE(a.out_residual, a.in_residual) << where << ": the layer did not run";
      }
    }
  }
}

// What each rank of a TP = 2 run produced, [rank][step * layers + layer].
struct TpRun {
  std::vector<std::vector<std::vector<uint16_t>>> hidden{2}, residual{2};
  std::vector<std::vector<std::vector<int32_t>>> topk{2};
  std::vector<std::vector<uint16_t>> graph_eager{2}, graph_replay{2};
  std::vector<RuntimeStats> stats{2};
};

// TP = 2 with ranks as threads on `devices`: {0, 1} over NCCL communicators, or {0, 0} (one GPU
// twice) over a ThreadGroup, where the TP all-reduce and the CP exchange use peer stores into
// the other rank's allocation. Every layer starts from the TP = 1 input (teacher forcing); a
// whole step also runs eagerly and through a graph. Copies are stream-ordered on each rank's
// runtime stream: a device-wide synchronize on one rank could wait on the other rank's kernel
// spinning for this rank's next exchange.
TpRun run_tp2(const Scenario& s, const std::vector<std::vector<LayerRecord>>& records,
              const std::vector<int>& devices, const RuntimeConfig& config) {
  const int64_t H = s.config.model.hidden;
  TpRun out;
  std::vector<testkit::RankModel> hosts;
  std::vector<DeviceModel> devs;
  for (int r = 0; r < 2; ++r) {
    hosts.push_back(testkit::make_rank_model(s.master, r, 2, false, config.context_parallel));
    devs.push_back(upload_model(hosts.back(), devices[static_cast<std::size_t>(r)]));
  }
  auto body = [&](Communicator& comm) {
    const int r = comm.rank();
    const auto ur = static_cast<std::size_t>(r);
    const int device = devices[ur];
    cuda::DeviceGuard guard(device);
    Runtime rt([](const std::string&) {});
    M3MSA_CHECK_INTERNAL(rt.prepare(devs[ur].weights, config, comm) == PrepareResult::kActive,
                         "rank ", r, " prepare: ", rt.stats().to_json());
    cudaStream_t stream = static_cast<cudaStream_t>(rt.cuda_stream());
    auto put = [&](const TensorView& v, const void* host, std::size_t bytes) {
      CUDA_CHECK(cudaMemcpyAsync(v.data, host, bytes, cudaMemcpyHostToDevice, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
    };
    auto get16 = [&](const TensorView& v, int64_t count) {
      std::vector<uint16_t> h(static_cast<std::size_t>(count));
      CUDA_CHECK(cudaMemcpyAsync(h.data(), v.data, h.size() * 2, cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      return h;
    };
    DeviceTensor hidden(DType::kBF16, {16, H}, device), residual(DType::kBF16, {16, H}, device);
    DeviceTensor positions(DType::kI64, {16}, device);
    for (std::size_t step = 0; step < s.steps.size(); ++step) {
      const StepMeta& meta = s.steps[step];
      const int64_t rows = meta.batch.num_rows();
      const Device dev = Device::cuda(device);
      const TensorView hv = TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}, dev);
      const TensorView rv = TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}, dev);
      const TensorView pv = TensorView::contiguous(positions.data(), DType::kI64, {rows}, dev);
      put(pv, meta.positions.data(), meta.positions.nbytes());
      M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "rank ", r, " refused step ", step);
      for (std::size_t l = 0; l < s.master.layers.size(); ++l) {
        const LayerRecord& rec = records[step][l];
        put(hv, rec.in_hidden.data(), rec.in_hidden.size() * 2);
        put(rv, rec.in_residual.data(), rec.in_residual.size() * 2);
        rt.forward_layer(s.master.layers[l].layer, hv, rv, pv);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        out.hidden[ur].push_back(get16(hv, rows * H));
        out.residual[ur].push_back(get16(rv, rows * H));
        const TensorView topk = rt.last_layer_trace().topk;
        std::vector<int32_t> t(static_cast<std::size_t>(topk.numel()));
        CUDA_CHECK(
            cudaMemcpyAsync(t.data(), topk.data, t.size() * 4, cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        out.topk[ur].push_back(t);
      }
    }
    rt.check();  // nothing recorded by the exchanges
    // A whole step through a graph at TP = 2 (the all-reduces inside): replay == eager. The same
    // step twice writes the same cache slots with the same values, so the second pass sees the
    // caches the first one left: eager first, then the graph.
    {
      StepGraphs graphs(rt);
      const StepMeta& meta = s.steps[0];
      const int64_t rows = meta.batch.num_rows();
      for (int pass = 0; pass < 2; ++pass) {
        put(graphs.hidden(), s.hidden_in[0].data(), s.hidden_in[0].size() * 2);
        put(graphs.residual(), s.residual_in[0].data(), s.residual_in[0].size() * 2);
        put(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
        M3MSA_CHECK_INTERNAL(pass == 0 ? graphs.run_eager(meta.batch) : graphs.run(meta.batch),
                             "rank ", r, " graph step refused");
        CUDA_CHECK(cudaStreamSynchronize(stream));
        (pass == 0 ? out.graph_eager : out.graph_replay)[ur] = get16(graphs.hidden(), rows * H);
      }
    }
    rt.check();
    out.stats[ur] = rt.stats();
    rt.close();
  };
  if (devices[0] != devices[1]) {
    auto comms = make_nccl_communicators_in_process(devices, std::chrono::seconds(60));
    run_threads(2, [&](int r) { body(*comms[static_cast<std::size_t>(r)]); });
  } else {
    auto group = ThreadGroup::create(2, std::chrono::seconds(60));
    const auto errors = run_ranks(group, body);
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }
  return out;
}

// TP = 2 against TP = 1: ranks bit-identical to each other, outputs within the TP tolerance,
// each rank's selection == TP = 1's selection of its head, graph replay == eager.
void expect_tp2_matches_tp1(const Scenario& s, const std::vector<std::vector<LayerRecord>>& records,
                            const TpRun& tp, const std::string& name) {
  const ModelConfig& m = s.config.model;
  const int64_t H = m.hidden;
  const SparseConfig sc1 = m.sparse(1);
  Check c;
  std::vector<int64_t> selection_mismatches(2, 0);
  std::size_t i = 0;
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const int64_t rows = s.steps[step].batch.num_rows();
    for (std::size_t l = 0; l < s.master.layers.size(); ++l, ++i) {
      const LayerRecord& rec = records[step][l];
      EXPECT_EQ(tp.hidden[0][i], tp.hidden[1][i])
          << name << ": ranks differ: step " << step << " layer " << l;
      EXPECT_EQ(tp.residual[0][i], tp.residual[1][i]) << name << ": ranks differ: step " << step;
      const std::string where = "step " + std::to_string(step) + " layer " + std::to_string(l);
      // A rank has fewer (row, KV head) units than TP = 1, so its attention may take another
      // split plan (more splits merged in another order) and round differently; a one-ulp change
      // can grow downstream in an output that cancels (TP = 1 forced onto the rank's plan gives
      // the same bits). So rows are held to the relative L2 bound, elements to the garbage bound.
      compare_bf16_rows_l2(c, tp.residual[0][i].data(), rec.out_residual.data(), rows, H, {},
                           where + " residual");
      compare_bf16_rows_l2(c, tp.hidden[0][i].data(), rec.out_hidden.data(), rows, H, {},
                           where + " hidden");
      // Rank r attends KV head r: TP = 1's head r.
      for (int r = 0; r < 2; ++r) {
        const std::vector<int32_t>& topk = tp.topk[static_cast<std::size_t>(r)][i];
        for (int64_t row = 0; row < rows; ++row) {
          for (int j = 0; j < sc1.topk; ++j) {
            const int32_t want =
                rec.topk[static_cast<std::size_t>((row * sc1.index_heads + r) * sc1.topk + j)];
            selection_mismatches[static_cast<std::size_t>(r)] +=
                want != topk[static_cast<std::size_t>(row * sc1.topk + j)];
          }
        }
      }
    }
  }
  EXPECT_EQ(c.bad, 0) << name << ": " << c.first << " (worst " << c.worst << " of the tolerance)";
  EXPECT_EQ(selection_mismatches[0], 0) << name << ": rank 0 selections differ from TP=1 head 0";
  EXPECT_EQ(selection_mismatches[1], 0) << name << ": rank 1 selections differ from TP=1 head 1";
  EXPECT_EQ(tp.graph_eager[0], tp.graph_replay[0]) << name << ": graph replay differs from eager";
  EXPECT_EQ(tp.graph_eager[0], tp.graph_eager[1]) << name << ": ranks differ in the graph step";
  std::printf("[ info ] %s vs TP = 1: worst error / tolerance %.3f, all-reduce %s, launches %lld\n",
              name.c_str(), c.worst, tp.stats[0].tp_allreduce.c_str(),
              static_cast<long long>(tp.stats[0].launches_per_layer));
}

// CP on vs CP off at the same TP: selections and outputs bit-identical (docs/context_parallel.md
// "Exactness").
void expect_cp_equals_no_cp(const TpRun& cp, const TpRun& no_cp, const std::string& name) {
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(cp.stats[r].context_parallel) << name;
    EXPECT_EQ(cp.topk[r], no_cp.topk[r]) << name << ": rank " << r << " selections differ";
    EXPECT_EQ(cp.hidden[r], no_cp.hidden[r]) << name << ": rank " << r << " outputs differ";
    EXPECT_EQ(cp.graph_replay[r], no_cp.graph_replay[r]) << name << ": rank " << r << " graph";
  }
}

TEST(RuntimeGpu, TensorParallel2MatchesTp1) {
  M3MSA_RUNTIME_REQUIRE_GPUS(2);
  const Scenario s = make_scenario(909);
  ASSERT_EQ(s.config.model.sparse(2).index_heads, 1);
  const auto records = record_tp1(s);
  RuntimeConfig nccl = s.config;
  nccl.tp_allreduce = TpAllReduce::kNccl;
  const TpRun tp_nccl = run_tp2(s, records, {0, 1}, nccl);
  expect_tp2_matches_tp1(s, records, tp_nccl, "TP=2 nccl");
  EXPECT_EQ(tp_nccl.stats[0].tp_allreduce, "nccl");
  RuntimeConfig peer = s.config;  // auto: peer stores over NVLink
  const TpRun tp_peer = run_tp2(s, records, {0, 1}, peer);
  expect_tp2_matches_tp1(s, records, tp_peer, "TP=2 peer");
  EXPECT_EQ(tp_peer.stats[0].tp_allreduce, "peer");
  // Two ranks' partials summed in rank order: the same bits whichever transport carried them.
  for (std::size_t r = 0; r < 2; ++r) EXPECT_EQ(tp_peer.hidden[r], tp_nccl.hidden[r]) << r;
  for (CpTransport transport : {CpTransport::kPeer, CpTransport::kNccl}) {
    RuntimeConfig cp = peer;
    cp.context_parallel = true;
    cp.cp_transport = transport;
    const TpRun tp_cp = run_tp2(s, records, {0, 1}, cp);
    expect_cp_equals_no_cp(tp_cp, tp_peer, std::string("TP=2 CP ") + cp_transport_name(transport));
  }
}

// The same TP = 2 runs with both ranks on one GPU (the peer all-reduce and the CP peer exchange
// into the other rank's allocation; no NCCL): what a one-GPU machine can check of TP = 2.
TEST(RuntimeGpu, TensorParallel2OnOneGpuMatchesTp1) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(919);
  const auto records = record_tp1(s);
  const TpRun tp = run_tp2(s, records, {0, 0}, s.config);
  expect_tp2_matches_tp1(s, records, tp, "TP=2 on one GPU");
  EXPECT_EQ(tp.stats[0].tp_allreduce, "peer");
  RuntimeConfig cp = s.config;
  cp.context_parallel = true;
  const TpRun tp_cp = run_tp2(s, records, {0, 0}, cp);
  expect_cp_equals_no_cp(tp_cp, tp, "TP=2 CP peer on one GPU");
  RuntimeConfig share = cp;
  share.selection_share_period = 2;
  const TpRun tp_share = run_tp2(s, records, {0, 0}, share);
  // Layer 2 (ordinal 1) attends with layer 1's selection on every rank.
  for (std::size_t r = 0; r < 2; ++r) {
    for (std::size_t i = 1; i < tp_share.topk[r].size(); i += 2) {
      EXPECT_EQ(tp_share.topk[r][i], tp_share.topk[r][i - 1]) << "rank " << r << " layer " << i;
    }
    EXPECT_GT(tp_share.stats[r].sharing_layers_run, 0);
  }
}

// ---- Faults of one rank at TP = 2 (ranks as threads on one GPU, peer all-reduce) ----

// Two runtimes prepared on GPU 0 with a short spin budget, and a runner that gives each rank its
// own script; each rank's error (or none) is returned with the time it took to arrive.
struct FaultRun {
  std::vector<std::string> errors{2};  // "" where the rank returned normally
  std::vector<ErrorCode> codes{2, ErrorCode::kInternal};
  std::vector<double> seconds{2, 0.0};
};

FaultRun run_fault(
    const Scenario& s,
    const std::function<void(int rank, Runtime& rt, const StepMeta& meta, const TensorView& h,
                             const TensorView& r, const TensorView& p)>& script) {
  std::vector<testkit::RankModel> hosts;
  std::vector<DeviceModel> devs;
  for (int r = 0; r < 2; ++r) {
    hosts.push_back(testkit::make_rank_model(s.master, r, 2, false));
    devs.push_back(upload_model(hosts.back(), 0));
  }
  RuntimeConfig config = s.config;
  config.cp_spin_budget = std::chrono::milliseconds(50);
  auto group = ThreadGroup::create(2, std::chrono::milliseconds(1500));
  FaultRun out;
  const int64_t H = s.config.model.hidden;
  run_ranks(group, [&](Communicator& comm) {
    const auto ur = static_cast<std::size_t>(comm.rank());
    Runtime rt([](const std::string&) {});
    const StepMeta& meta = s.steps[0];
    const int64_t rows = meta.batch.num_rows();
    DeviceTensor hidden(DType::kBF16, {rows, H}), residual(DType::kBF16, {rows, H});
    DeviceTensor positions(DType::kI64, {rows});
    M3MSA_CHECK_INTERNAL(rt.prepare(devs[ur].weights, config, comm) == PrepareResult::kActive,
                         "prepare: ", rt.stats().to_json());
    cudaStream_t stream = static_cast<cudaStream_t>(rt.cuda_stream());
    CUDA_CHECK(cudaMemcpyAsync(positions.data(), meta.positions.data(), meta.positions.nbytes(),
                               cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemsetAsync(hidden.data(), 0, hidden.view().nbytes(), stream));
    CUDA_CHECK(cudaMemsetAsync(residual.data(), 0, residual.view().nbytes(), stream));
    // One healthy step first.
    M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "step refused");
    for (const testkit::MasterLayer& layer : s.master.layers) {
      rt.forward_layer(layer.layer, hidden.view(), residual.view(), positions.view());
    }
    rt.check();
    comm.all_gather({}, "test: healthy step done");
    const auto t0 = std::chrono::steady_clock::now();
    try {
      script(comm.rank(), rt, meta, hidden.view(), residual.view(), positions.view());
    } catch (const Error& e) {
      out.errors[ur] = e.what();
      out.codes[ur] = e.code();
    }
    out.seconds[ur] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    try {
      rt.close();  // releases whatever happened (its agreement may fail: the peer is gone)
    } catch (const Error&) {
    }
  });
  return out;
}

// A rank that skips a layer: the peer's all-reduce of that layer never gets its partial, and the
// peer's check() names it within the spin budget; a rank whose caches are detached while the
// other steps: the stepping rank's check() names it, the detaching rank's detach() names the
// stepping rank (it never arrives at the agreement), both within the timeouts; no hang.
TEST(RuntimeGpu, FaultsOfOneRankAreNamedOnTheOther) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(929, {{{700, 1500}, 1}});
  const int last_layer = s.master.layers.back().layer;
  {
    const FaultRun run =
        run_fault(s, [&](int rank, Runtime& rt, const StepMeta& meta, const TensorView& h,
                         const TensorView& r, const TensorView& p) {
          M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "step refused");
          for (const testkit::MasterLayer& layer : s.master.layers) {
            if (rank == 1 && layer.layer == last_layer) continue;  // the fault
            rt.forward_layer(layer.layer, h, r, p);
          }
          rt.check();
        });
    EXPECT_EQ(run.errors[1], "") << "the skipping rank's own calls all matched";
    EXPECT_EQ(run.codes[0], ErrorCode::kTimeout) << run.errors[0];
    EXPECT_NE(run.errors[0].find("rank 1"), std::string::npos) << run.errors[0];
    EXPECT_LT(run.seconds[0], 5.0);
    std::printf("[ info ] skipped layer: rank 0 after %.3f s: %s\n", run.seconds[0],
                run.errors[0].c_str());
  }
  {
    const FaultRun run =
        run_fault(s, [&](int rank, Runtime& rt, const StepMeta& meta, const TensorView& h,
                         const TensorView& r, const TensorView& p) {
          if (rank == 1) {
            std::vector<LayerCaches> empty;
            for (const testkit::MasterLayer& layer : s.master.layers) {
              empty.push_back(LayerCaches{layer.layer, {}, {}});
            }
            rt.detach(empty);  // while rank 0 steps
            return;
          }
          M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "step refused");
          for (const testkit::MasterLayer& layer : s.master.layers) {
            rt.forward_layer(layer.layer, h, r, p);
          }
          rt.check();
        });
    EXPECT_EQ(run.codes[0], ErrorCode::kTimeout) << run.errors[0];
    EXPECT_NE(run.errors[0].find("rank 1"), std::string::npos) << run.errors[0];
    EXPECT_NE(run.errors[1], "") << "detach agreed with a rank that never came";
    EXPECT_NE(run.errors[1].find("rank 0"), std::string::npos) << run.errors[1];
    EXPECT_LT(run.seconds[0], 5.0);
    EXPECT_LT(run.seconds[1], 5.0);
    std::printf(
        "[ info ] detach while stepping: rank 0 after %.3f s: %s; rank 1 after %.3f s: %s\n",
        run.seconds[0], run.errors[0].c_str(), run.seconds[1], run.errors[1].c_str());
  }
}

}  // namespace
}  // namespace m3msa
