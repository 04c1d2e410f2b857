// m3msa bench layer: one layer of the fused decode runtime (runtime.h, CUDA backend) under
// CUDA-graph replay, at M3's attention dimensions (hidden 6144, 64 q heads, 4 KV heads,
// 4 index heads, head and index dim 128, blocks of 128, top-16). --layer-kind sparse,dense picks
// which of M3's layers (default sparse); each kind has its own rows (column and JSON field
// `kind`).
//
// Sparse layers (no MLP unless --moe). Per configuration (TP x CP x weights x tokens x q_len x
// context): every rank binds `--layers` distinct sparse layers (their own weights and caches, so no
// layer finds another's bytes in the 60 MB L2), StepGraphs captures the whole step once, and each
// replay runs all of them; the time of one layer = replay time / layers (CUDA events on rank 0's
// stream; ranks as threads, one GPU each; the TP all-reduce as `--allreduce` says: auto = the
// one-shot peer all-reduce on one host). Median and noise ((p90 - p10) / median) over the
// replays.
//
// Floor (per rank): (projection weights + norms + the cache bytes a layer must read) / 4.57 TB/s,
// plus one all-reduce of the layer's o_proj output (rows x hidden f32), the faster of NCCL and
// the one-shot peer all-reduce, each measured alone in the same run at TP > 1. Cache bytes: the
// index-K cache of every visible block of every request (1/P of them per rank with CP on) and,
// per request and KV head of the rank, min(topk, blocks) selected K and V blocks (rows of one
// request are assumed to share them: a lower bound). With --share-period F > 1 the floor counts
// the index columns and the index-K read of one layer in F. ratio = median / floor.
//
// With --moe bf16 / mxfp8 every layer also runs M3's mixture of experts (128 experts of width
// 3072 / P, top-4, one shared expert; docs/spec.md section 8) and the floor adds the bytes of the
// experts the step reads: the router, the shared expert and, for t token rows under uniform
// routing, E (1 - (1 - k / E)^t) distinct routed experts (their w13, w2 and MXFP8 scales), plus
// one more all-reduce. --rank-of P runs one rank's shapes of TP P on one GPU (q heads / P, KV and
// index heads max(1, 4 / P), expert and dense intermediates / P; no all-reduce).
//
// Dense layers (--layer-kind dense; M3's layers 0..first_sparse_layer-1 = 0-2): the [q | k | v]
// projection, dense causal attention over every visible key, o_proj, then the dense SwiGLU-OAI
// MLP of width 12288 / P, in the format --moe names (bf16, or MXFP8 with e8m0 scales). The
// runtime binds the dense layers all or none, and every sparse layer, so every rank binds M3's
// three dense layers (their own weights and caches; their weights alone are over twice the L2 at
// every rank shape) and the single sparse layer the model then has (no MoE; bound, never run). The
// step is staged with begin_step, padded to the bucket as StepGraphs pads it, and forward_layer of
// the three dense layers is captured into one graph on the runtime's stream, over StepGraphs' fixed
// buffers (StepGraphs' own graph would hold the sparse layer too); the time of one dense layer =
// replay time / 3, timed as above. --moe is required for dense rows: --layer-kind dense with
// --moe off alone is refused (a dense layer has no FFN-less form and no format is assumed);
// with --moe off,mxfp8 the dense rows run for mxfp8 only. --layers, --share-period and
// --overlap do not apply (no indexer): dense rows run for the first --cp and --overlap values
// only and report overlap "none".
// Floor (per rank): (the [q | k | v] and o_proj weights (+ fp8 per-channel scales), the input,
// post-attention, q and k norms, the dense MLP's w13 and w2 of this rank's 12288 / P columns
// (bf16, or fp8 codes + one e8m0 scale byte per 32) and the K and V rows of every visible key of
// every request (context tokens each, the rank's KV heads; no index cache)) / 4.57 TB/s, plus at
// TP > 1 two all-reduces of rows x hidden f32 (o_proj's and the MLP's), each the faster of NCCL
// and the one-shot peer all-reduce as above.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nccl.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench_registry.h"
#include "comm/nccl_check.h"
#include "comm/peer_allreduce.h"
#include "cuda/common.cuh"
#include "fill.h"
#include "harness.h"
#include "m3msa/backend.h"
#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/error.h"
#include "m3msa/moe.h"
#include "m3msa/runtime.h"
#include "m3msa/testing/splitmix.h"
#include "moe_floor.h"

namespace m3msa::bench {
namespace {

// The step shapes the runtime of every run is prepared for (RuntimeConfig): --tokens and --q-len
// are checked against them.
const std::vector<int> kTokenBuckets = {1, 2, 4, 8, 16};
const std::vector<int> kQueryLens = {1, 2, 4};
constexpr int kMaxRequests = 16;

struct Config {
  std::string kind = "sparse";  // sparse | dense (M3's layers [0, first_sparse_layer))
  int tp = 1;
  bool cp = false;
  int share_period = 1;
  TpAllReduce allreduce = TpAllReduce::kAuto;
  IndexerOverlap overlap = IndexerOverlap::kAuto;
  DType weights = DType::kBF16;
  DType kv = DType::kBF16;
  int tokens = 1;
  int q_len = 1;
  int64_t context = 0;
  int layers = 4;
  std::string moe = "off";  // off | bf16 | mxfp8 (a dense layer: its MLP's format, never off)
  int rank_of = 1;          // > 1: one rank's shapes of TP rank_of, on one GPU
};

struct Result {
  Timing timing;
  int64_t launches = 0;
  double weight_bytes = 0;
  double cache_bytes = 0;
  double allreduce_us = 0;       // the faster all-reduce alone (the floor's)
  double nccl_allreduce_us = 0;  // each alone (TP > 1)
  double peer_allreduce_us = 0;
  std::string allreduce_used;  // what the runtime ran ("none", "nccl", "peer")
  double floor_us = 0;
  double moe_bytes = 0;        // the experts' share of weight_bytes
  double dense_mlp_bytes = 0;  // the dense MLP's share of weight_bytes (dense layers)
  int layers = 0;              // layers per replay: the time of one = replay time / layers
};

bool is_dense(const Config& c) {
  return c.kind == "dense";
}

ModelConfig m3_model(const Config& c) {
  ModelConfig m;  // M3 defaults
  // A dense run binds the one sparse layer the model must have besides its dense layers.
  m.num_layers = m.first_sparse_layer + (is_dense(c) ? 1 : c.layers);
  m.intermediate = 0;
  if (c.rank_of > 1) {
    m.q_heads /= c.rank_of;
    m.kv_heads = std::max(1, m.kv_heads / c.rank_of);
    m.index_heads = m.kv_heads;
    m.moe_intermediate /= c.rank_of;
    m.dense_intermediate /= c.rank_of;
  }
  return m;
}

// The MoE bytes one rank reads per layer for `tokens` rows under uniform routing: the distinct
// routed experts, the shared expert and the fp32 router with its bias.
double moe_step_bytes(const ModelConfig& m, int tp, bool fp8, int tokens) {
  const MoeConfig mc = m.moe(tp);
  const double E = mc.num_experts;
  return expected_distinct_experts(mc, tokens) *
             static_cast<double>(expert_bytes(mc.hidden, mc.intermediate, fp8)) +
         static_cast<double>(expert_bytes(mc.hidden, mc.shared_intermediate, fp8)) +
         4.0 * E * (mc.hidden + 1);
}

// One rank's bound model: random weights and caches in device memory it owns.
struct RankModel {
  std::vector<cuda::DeviceBuffer> buffers;
  ModelWeights weights;
};

TensorView device_view(void* data, DType dtype, std::vector<int64_t> shape, int device) {
  return TensorView::contiguous(data, dtype, shape, Device::cuda(device));
}

// Random weights in the experts' format (w13 [..., 2 I, K] rows [gate | up], w2 [..., K, I]),
// bf16 or MXFP8; MXFP8 scales of 2^-5 keep unit-variance codes' sums O(1).
ExpertWeights random_expert_weights(bool fp8, std::vector<int64_t> w13_shape,
                                    std::vector<int64_t> w2_shape, RankModel& r, int device,
                                    uint64_t& seed) {
  const DType wd = fp8 ? DType::kFP8E4M3 : DType::kBF16;
  auto weights = [&](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    r.buffers.emplace_back(static_cast<std::size_t>(n) * dtype_size(wd));
    fill_random(r.buffers.back().data(), n, fp8, seed++, nullptr);
    return device_view(r.buffers.back().data(), wd, shape, device);
  };
  auto scales = [&](std::vector<int64_t> shape) {
    if (!fp8) return TensorView{};
    shape.back() /= kMxfp8Block;
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    r.buffers.emplace_back(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemset(r.buffers.back().data(), 127 - 5, static_cast<std::size_t>(n)));
    return device_view(r.buffers.back().data(), DType::kU8, shape, device);
  };
  return {weights(w13_shape), scales(w13_shape), weights(w2_shape), scales(w2_shape)};
}

// Random experts of one layer: the router spreads the rows over the experts.
void bind_moe(const Config& c, const ModelConfig& m, LayerWeights& w, RankModel& r, int device,
              uint64_t seed) {
  const MoeConfig mc = m.moe(c.tp);
  const bool fp8 = c.moe == "mxfp8";
  const int64_t E = mc.num_experts, H = mc.hidden;
  auto host_f32 = [&](std::vector<int64_t> shape, float scale) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    testkit::SplitMix64 rng(seed++);
    std::vector<float> host(static_cast<std::size_t>(n));
    for (float& v : host) v = rng.signed_unit() * scale;
    r.buffers.emplace_back(host.size() * sizeof(float));
    CUDA_CHECK(cudaMemcpy(r.buffers.back().data(), host.data(), host.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
    return device_view(r.buffers.back().data(), DType::kF32, shape, device);
  };
  w.router_weight = host_f32({E, H}, 2.0f / std::sqrt(static_cast<float>(H)));
  w.router_bias = host_f32({E}, 0.01f);
  const int64_t I = mc.intermediate, S = mc.shared_intermediate;
  w.experts = random_expert_weights(fp8, {E, 2 * I, H}, {E, H, I}, r, device, seed);
  if (S > 0) w.shared_expert = random_expert_weights(fp8, {2 * S, H}, {H, S}, r, device, seed);
}

RankModel build_rank(const Config& c, const ModelConfig& m, int device, int64_t pages,
                     uint64_t seed, cudaStream_t stream) {
  const SparseConfig sc = m.sparse(c.tp, c.cp);
  const int64_t H = m.hidden;
  const int64_t W = sc.qkv_width();
  const int64_t A = int64_t{sc.q_heads} * sc.head_dim;
  const bool fp8 = c.weights == DType::kFP8E4M3;
  const bool dense_run = is_dense(c);
  const int sparse_layers = dense_run ? 1 : c.layers;
  RankModel r;
  r.buffers.reserve(static_cast<std::size_t>(sparse_layers + m.first_sparse_layer) * 16);
  auto random = [&](DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    r.buffers.emplace_back(static_cast<std::size_t>(n) * dtype_size(dtype));
    fill_random(r.buffers.back().data(), n, dtype == DType::kFP8E4M3, seed++, stream);
    return device_view(r.buffers.back().data(), dtype, shape, device);
  };
  auto scales = [&](int64_t n) {
    // Per-channel scales of unit-variance fp8 weights: keep projections O(1) per term.
    std::vector<float> host(static_cast<std::size_t>(n), 1.0f / 64.0f);
    r.buffers.emplace_back(static_cast<std::size_t>(n) * sizeof(float));
    CUDA_CHECK(cudaMemcpy(r.buffers.back().data(), host.data(), host.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
    return device_view(r.buffers.back().data(), DType::kF32, {n}, device);
  };
  // A dense layer (runtime.h, LayerWeights): [q | k | v] rows, no index part, its dense MLP in
  // the format --moe names.
  const int64_t dense_W = rank_layout(m, 0, c.tp, c.cp).dense_qkv_width;
  auto bind_layer = [&](int id, bool dense) {
    LayerWeights w;
    w.layer = id;
    const int64_t rows = dense ? dense_W : W;
    w.qkv_proj = random(c.weights, {rows, H});
    if (fp8) w.qkv_proj_scale = scales(rows);
    w.q_norm = random(DType::kBF16, {sc.head_dim});
    w.k_norm = random(DType::kBF16, {sc.head_dim});
    if (!dense) {
      w.index_q_norm = random(DType::kBF16, {sc.index_dim});
      w.index_k_norm = random(DType::kBF16, {sc.index_dim});
    }
    w.input_norm = random(DType::kBF16, {H});
    w.post_attention_norm = random(DType::kBF16, {H});
    w.o_proj = random(c.weights, {H, A});
    if (fp8) w.o_proj_scale = scales(H);
    w.kv_cache.data = random(c.kv, {pages, sc.kv_heads, 2, sc.block_size, sc.head_dim});
    w.kv_cache.k_scale = c.kv == DType::kFP8E4M3 ? 0.5f : 1.0f;
    w.kv_cache.v_scale = c.kv == DType::kFP8E4M3 ? 0.5f : 1.0f;
    if (dense) {
      const int64_t D = m.dense_intermediate / c.tp;
      w.dense_mlp = random_expert_weights(c.moe == "mxfp8", {2 * D, H}, {H, D}, r, device, seed);
    } else {
      w.index_cache.data = random(DType::kBF16, {pages, sc.block_size, sc.index_dim});
      if (c.moe != "off" && !dense_run) bind_moe(c, m, w, r, device, seed++);
    }
    r.weights.layers.push_back(w);
  };
  for (int i = 0; i < sparse_layers; ++i) bind_layer(m.first_sparse_layer + i, false);
  if (dense_run) {
    for (int id = 0; id < m.first_sparse_layer; ++id) bind_layer(id, true);
  }
  // The fills ran on `stream`, the scale copies on the legacy stream: wait for both.
  CUDA_CHECK(cudaDeviceSynchronize());
  return r;
}

// Host metadata of the step: every request at `context` tokens, own pages r * nb + b.
struct StepMeta {
  HostTensor seq_lens, index_table, kv_table, slots, positions;
  BatchMeta batch;
};

StepMeta make_step(int reqs, int q_len, int64_t context, int block_size) {
  StepMeta s;
  const int64_t nb = (context + block_size - 1) / block_size;
  const int64_t rows = int64_t{reqs} * q_len;
  s.seq_lens = HostTensor(DType::kI32, {reqs});
  s.index_table = HostTensor(DType::kI32, {reqs, nb});
  s.kv_table = HostTensor(DType::kI32, {reqs, nb});
  s.slots = HostTensor(DType::kI64, {rows});
  s.positions = HostTensor(DType::kI64, {rows});
  for (int r = 0; r < reqs; ++r) {
    s.seq_lens.ptr<int32_t>()[r] = static_cast<int32_t>(context);
    for (int64_t b = 0; b < nb; ++b) {
      s.index_table.ptr<int32_t>()[r * nb + b] = static_cast<int32_t>(r * nb + b);
      s.kv_table.ptr<int32_t>()[r * nb + b] = static_cast<int32_t>(r * nb + b);
    }
    for (int j = 0; j < q_len; ++j) {
      const int64_t pos = context - q_len + j;
      s.positions.ptr<int64_t>()[r * q_len + j] = pos;
      s.slots.ptr<int64_t>()[r * q_len + j] =
          (r * nb + pos / block_size) * block_size + pos % block_size;
    }
  }
  s.batch.kind = BatchKind::kDecode;
  s.batch.num_reqs = reqs;
  s.batch.q_len = q_len;
  s.batch.seq_lens = s.seq_lens.view();
  s.batch.index_block_table = s.index_table.view();
  s.batch.kv_block_table = s.kv_table.view();
  s.batch.slot_mapping = s.slots.view();
  s.batch.index_slot_mapping = s.slots.view();  // the same pages layout in both caches
  return s;
}

// One all-reduce of `count` f32 per rank alone, NCCL's or the one-shot peer all-reduce's, timed
// as a graph of 20 calls (median per call, rank 0).
double measure_allreduce(std::vector<std::unique_ptr<NcclCommunicator>>& comms, int64_t count,
                         bool peer) {
  const int world = static_cast<int>(comms.size());
  std::vector<double> per_call(static_cast<std::size_t>(world), 0.0);
  run_threads(world, [&](int r) {
    NcclCommunicator& comm = *comms[static_cast<std::size_t>(r)];
    cuda::DeviceGuard guard(comm.device());
    cuda::Stream stream;
    cuda::DeviceBuffer buf(static_cast<std::size_t>(count) * sizeof(float));
    CUDA_CHECK(cudaMemset(buf.data(), 0, buf.bytes()));
    std::unique_ptr<PeerAllReduce> one_shot;
    if (peer) {
      PeerAllReduceConfig config;
      config.max_count = count;
      one_shot = std::make_unique<PeerAllReduce>(comm, comm.device(), config);
    }
    auto reduce = [&](int call) {
      if (one_shot) {
        one_shot->run(buf.as<float>(), count, call, stream.get());
      } else {
        M3MSA_NCCL_CHECK(ncclAllReduce(buf.data(), buf.data(), static_cast<std::size_t>(count),
                                       ncclFloat32, ncclSum,
                                       static_cast<ncclComm_t>(comm.nccl_comm()), stream.get()));
      }
    };
    auto wait = [&] {
      if (one_shot) {
        one_shot->check(stream.get());
      } else {
        comm.wait(stream.get(), "bench layer: all-reduce");
      }
    };
    reduce(0);
    wait();
    constexpr int kCalls = 20;
    cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
      for (int i = 0; i < kCalls; ++i) reduce(i);
    });
    const Timing t = time_graph(graph, stream.get(), kCalls, 2, 10);
    wait();
    per_call[static_cast<std::size_t>(r)] = t.median_us;
  });
  return per_call[0];
}

Result run_config(const Config& c, std::vector<std::unique_ptr<NcclCommunicator>>& comms, int reps,
                  uint64_t seed) {
  const ModelConfig m = m3_model(c);
  const int reqs = c.tokens / c.q_len;
  const int64_t nb = (c.context + m.block_size - 1) / m.block_size;
  const int64_t pages = int64_t{reqs} * nb + 1;
  RuntimeConfig config;
  config.model = m;
  config.token_buckets = kTokenBuckets;
  config.query_lens = kQueryLens;
  config.max_requests = kMaxRequests;
  config.max_context = nb * m.block_size;
  config.context_parallel = c.cp;
  config.selection_share_period = c.share_period;
  config.tp_allreduce = c.allreduce;
  config.indexer_overlap = c.overlap;
  const StepMeta meta = make_step(reqs, c.q_len, c.context, m.block_size);
  const SparseConfig sc = m.sparse(c.tp, c.cp);

  Result res;
  res.layers = is_dense(c) ? m.first_sparse_layer : c.layers;
  std::vector<Timing> timings(static_cast<std::size_t>(c.tp));
  std::vector<int64_t> launches(static_cast<std::size_t>(c.tp), 0);
  run_threads(c.tp, [&](int r) {
    const int device = r;
    cuda::DeviceGuard guard(device);
    cuda::Stream stream;
    RuntimeConfig rank_config = config;
    rank_config.cuda_stream = stream.get();
    RankModel model =
        build_rank(c, m, device, pages, seed + 1000 * static_cast<uint64_t>(r), stream.get());
    std::unique_ptr<Communicator> single;
    Communicator* comm = nullptr;
    if (c.tp == 1) {
      single = make_single_rank_communicator();
      comm = single.get();
    } else {
      comm = comms[static_cast<std::size_t>(r)].get();
    }
    Runtime rt([](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
    const PrepareResult prepared = rt.prepare(model.weights, rank_config, *comm);
    M3MSA_CHECK(prepared == PrepareResult::kActive, ErrorCode::kInternal,
                "bench layer: prepare returned ", prepare_result_name(prepared), ": ",
                rt.stats().to_json());
    {
      StepGraphs graphs(rt);
      const int64_t rows = meta.batch.num_rows();
      fill_random(graphs.hidden().data, rows * m.hidden, false, seed + 7, stream.get());
      fill_random(graphs.residual().data, rows * m.hidden, false, seed + 8, stream.get());
      CUDA_CHECK(cudaMemcpyAsync(graphs.positions().data, meta.positions.data(),
                                 meta.positions.nbytes(), cudaMemcpyHostToDevice, stream.get()));
      // Dense layers: StepGraphs' graph holds every bound layer (the sparse one too), so the
      // step is staged and padded as StepGraphs does and the dense layers alone are captured,
      // over its buffers, as an engine captures the runtime.
      cuda::Graph dense_graph;
      if (is_dense(c)) {
        const int padded = graphs.padded_requests(meta.batch.num_reqs, meta.batch.q_len);
        M3MSA_CHECK(rt.begin_step(meta.batch, padded), ErrorCode::kInternal,
                    "bench layer: step refused: ", rt.stats().last_refusal);
        const int64_t padded_rows = int64_t{padded} * meta.batch.q_len;
        if (padded_rows > rows) {
          CUDA_CHECK(cudaMemsetAsync(graphs.positions().ptr<int64_t>() + rows, 0xFF,
                                     sizeof(int64_t) * static_cast<std::size_t>(padded_rows - rows),
                                     stream.get()));
        }
        const Device dev = Device::cuda(device);
        const TensorView hidden = TensorView::contiguous(graphs.hidden().data, DType::kBF16,
                                                         {padded_rows, m.hidden}, dev);
        const TensorView residual = TensorView::contiguous(graphs.residual().data, DType::kBF16,
                                                           {padded_rows, m.hidden}, dev);
        const TensorView positions =
            TensorView::contiguous(graphs.positions().data, DType::kI64, {padded_rows}, dev);
        dense_graph = cuda::Graph::capture(stream.get(), [&] {
          for (int layer = 0; layer < m.first_sparse_layer; ++layer) {
            rt.forward_layer(layer, hidden, residual, positions);
          }
        });
        dense_graph.launch(stream.get());
      } else {
        M3MSA_CHECK(graphs.run(meta.batch), ErrorCode::kInternal,
                    "bench layer: step refused: ", rt.stats().last_refusal);
      }
      auto replay = [&] {
        if (is_dense(c)) {
          dense_graph.launch(stream.get());
        } else {
          graphs.replay_last();
        }
      };
      for (int i = 0; i < 3; ++i) replay();
      CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      cuda::Event start, stop;
      std::vector<double> per_layer_us;
      for (int i = 0; i < reps; ++i) {
        start.record(stream.get());
        replay();
        stop.record(stream.get());
        per_layer_us.push_back(stop.elapsed_ms_since(start) * 1000.0 / res.layers);
      }
      Timing t;
      t.median_us = percentile(per_layer_us, 0.5);
      t.p10_us = percentile(per_layer_us, 0.1);
      t.p90_us = percentile(per_layer_us, 0.9);
      t.reps = reps;
      timings[static_cast<std::size_t>(r)] = t;
      launches[static_cast<std::size_t>(r)] = rt.stats().launches_per_layer;
      rt.check();  // the exchanges recorded nothing
      if (r == 0) res.allreduce_used = rt.stats().tp_allreduce;
    }
    rt.close();
  });
  res.timing = timings[0];
  res.launches = launches[0];

  const double welem = c.weights == DType::kFP8E4M3 ? 1.0 : 2.0;
  const double H = m.hidden;
  const double A = static_cast<double>(sc.q_heads) * sc.head_dim;
  const double kv_elem = c.kv == DType::kFP8E4M3 ? 1.0 : 2.0;
  // The [q | k | v] projection of width W and o_proj (+ fp8 per-channel scales), and the bf16
  // norm weights (the input and post-attention norms, and `head_norms` per-head ones).
  auto projection_bytes = [&](double W, double head_norms) {
    return (W * H + H * A) * welem + (c.weights == DType::kFP8E4M3 ? (W + H) * 4.0 : 0.0) +
           (2.0 * H + head_norms) * 2.0;
  };
  if (is_dense(c)) {
    const double W = static_cast<double>(rank_layout(m, 0, c.tp, c.cp).dense_qkv_width);
    res.weight_bytes = projection_bytes(W, 2.0 * sc.head_dim);
    res.dense_mlp_bytes =
        static_cast<double>(expert_bytes(m.hidden, m.dense_intermediate / c.tp, c.moe == "mxfp8"));
    res.weight_bytes += res.dense_mlp_bytes;
    // Dense attention reads the K and V rows of every visible key, once per request and KV head.
    res.cache_bytes = reqs * static_cast<double>(sc.kv_heads) * static_cast<double>(c.context) *
                      2.0 * sc.head_dim * kv_elem;
  } else {
    // Per layer on average: one layer in share_period runs the index columns and the indexer.
    const double indexer_share = 1.0 / c.share_period;
    const double index_cols = (static_cast<double>(sc.index_heads) + 1) * sc.index_dim;
    const double W = static_cast<double>(sc.qkv_width()) - (1.0 - indexer_share) * index_cols;
    res.weight_bytes = projection_bytes(W, 2.0 * sc.head_dim + 2.0 * sc.index_dim);
    const double block_tokens = sc.block_size;
    // With CP each rank reads its round-robin shard: ceil(nb / P) blocks.
    const double index_blocks = c.cp ? std::ceil(static_cast<double>(nb) / c.tp) : nb;
    const double index_bytes =
        indexer_share * reqs * index_blocks * block_tokens * sc.index_dim * 2.0;
    const double kv_bytes = reqs * static_cast<double>(sc.kv_heads) *
                            std::min<double>(sc.topk, static_cast<double>(nb)) * 2.0 *
                            block_tokens * sc.head_dim * kv_elem;
    res.cache_bytes = index_bytes + kv_bytes;
    if (c.moe != "off") {
      res.moe_bytes = moe_step_bytes(m, c.tp, c.moe == "mxfp8", c.tokens);
      res.weight_bytes += res.moe_bytes;
    }
  }
  if (c.tp > 1) {
    const int64_t count = int64_t{c.tokens} * m.hidden;
    res.nccl_allreduce_us = measure_allreduce(comms, count, /*peer=*/false);
    res.peer_allreduce_us = measure_allreduce(comms, count, /*peer=*/true);
    res.allreduce_us = std::min(res.nccl_allreduce_us, res.peer_allreduce_us);
    // The FFN's all-reduce (the MoE's or the dense MLP's): the same size.
    if (c.moe != "off" || is_dense(c)) res.allreduce_us *= 2;
  }
  res.floor_us =
      (res.weight_bytes + res.cache_bytes) / (kReadCeilingTBs * 1e12) * 1e6 + res.allreduce_us;
  return res;
}

// A TP size P (or --rank-of P) whose per-rank shapes M3 has: P splits the attention heads
// (ModelConfig::sparse) and, where an FFN runs, the expert and dense MLP intermediates into
// whole MXFP8 blocks.
void check_rank_split(const char* flag, int P, bool ffn) {
  const ModelConfig m;
  with_flag(flag, [&] { return m.sparse(P); });
  if (ffn) require_ffn_split(flag, P);
}

int run_layer_bench(int argc, char** argv) {
  CLI::App app{
      "one sparse or dense layer of the fused decode runtime (graph replay, M3 dimensions)"};
  std::string kinds = "sparse";
  std::string tokens = "1,4,16";
  std::string q_lens = "1,4";
  std::string contexts = "16384,131072";
  std::string tps = "1,2";
  std::string cps = "off,on";
  std::string allreduce = "auto";
  int share_period = 1;
  std::string overlap = "auto";
  std::string weights = "bf16,fp8";
  std::string kv = "bf16";
  std::string moe = "off";
  std::string rank_of = "1";
  int layers = 4;
  int reps = 30;
  uint64_t seed = 1;
  bool quick = false;
  std::string json_path;
  std::string commit = "unknown";
  app.add_option("--layer-kind", kinds,
                 "comma-separated: sparse, dense (M3's dense layers 0-2: dense causal attention "
                 "and the dense MLP of width 12288 / P, its weights in the format --moe names; "
                 "dense needs --moe bf16 and/or mxfp8)");
  app.add_option("--tokens", tokens, "comma-separated token rows per step (requests * q_len)");
  app.add_option("--q-len", q_lens, "comma-separated query lengths");
  app.add_option("--context", contexts, "comma-separated context lengths (tokens)");
  app.add_option("--tp", tps, "comma-separated TP sizes (ranks as threads, one GPU each)");
  app.add_option("--cp", cps, "comma-separated context parallelism settings: off, on");
  app.add_option("--allreduce", allreduce, "TP all-reduce: auto (peer on one host), nccl, peer");
  app.add_option("--share-period", share_period,
                 "cross-layer selection sharing period (1: every layer runs its indexer)");
  app.add_option("--overlap", overlap,
                 "comma-separated RuntimeConfig::indexer_overlap settings: auto, off, on (the "
                 "indexer beside the q/k/v projection; with --cp on the runtime is serial)");
  app.add_option("--weights", weights, "comma-separated projection weight dtypes: bf16, fp8");
  app.add_option("--kv", kv, "KV cache dtype: bf16 or fp8");
  app.add_option("--moe", moe,
                 "comma-separated: off, bf16, mxfp8 (M3's mixture of experts after the attention "
                 "block, its experts in that format; for dense layers the dense MLP's format)");
  app.add_option("--rank-of", rank_of,
                 "comma-separated P: one rank's shapes of TP P on one GPU (with --tp 1)");
  app.add_option("--layers", layers,
                 "distinct sparse layers per captured step (L2 rotation; dense layers: M3's 3)");
  app.add_option("--reps", reps, "graph replays per configuration (median over them)");
  app.add_option("--seed", seed, "random seed");
  app.add_flag("--quick", quick,
               "subset: tokens 1,16 x q_len 1 x 128K, TP 1,2, CP off and on, bf16 and fp8");
  app.add_option("--json", json_path, "write the results as JSON here");
  app.add_option("--commit", commit, "commit id recorded in the JSON (default $M3MSA_COMMIT)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  // Every value is checked here, before the device and the first measurement.
  const std::vector<std::string> kind_list =
      choice_list("--layer-kind", kinds, {"sparse", "dense"});
  const std::vector<std::string> moe_list = choice_list("--moe", moe, {"off", "bf16", "mxfp8"});
  // Whether an FFN runs (the MoE, or the MLP of a dense layer, which has no FFN-less form): in a
  // --moe weight format.
  const bool ffn_format = std::any_of(moe_list.begin(), moe_list.end(),
                                      [](const std::string& v) { return v != "off"; });
  for (const std::string& kind : kind_list) {
    require_flag(kind != "dense" || ffn_format, "--layer-kind",
                 fmt::format("dense needs the dense MLP's weight format: --moe bf16 and/or mxfp8 "
                             "(got --moe {})",
                             moe));
  }
  std::vector<int> token_list = int_list("--tokens", tokens, 1, kTokenBuckets.back());
  std::vector<int> q_len_list = int_choice_list("--q-len", q_lens, kQueryLens);
  std::vector<int64_t> context_list =
      int_list<int64_t>("--context", contexts, 1, std::numeric_limits<int32_t>::max());
  const int max_q_len = *std::max_element(q_len_list.begin(), q_len_list.end());
  for (int64_t context : context_list) {
    require_flag(context >= max_q_len, "--context",
                 fmt::format("{} tokens are fewer than --q-len {}", context, max_q_len));
  }
  const std::vector<int> tp_values = int_list("--tp", tps, 1);
  for (int tp : tp_values) check_rank_split("--tp", tp, ffn_format);
  const std::vector<bool> cp_list = [&] {
    std::vector<bool> out;
    for (const std::string& v : choice_list("--cp", cps, {"on", "off"})) out.push_back(v == "on");
    return out;
  }();
  const TpAllReduce allreduce_mode =
      with_flag("--allreduce", [&] { return parse_tp_allreduce(allreduce); });
  require_range("--share-period", share_period, 1);
  const std::vector<IndexerOverlap> overlap_list =
      parsed_list("--overlap", overlap, parse_indexer_overlap);
  const std::vector<DType> weight_dtypes =
      dtype_list("--weights", weights, {DType::kBF16, DType::kFP8E4M3});
  const DType kv_dtype = dtype_flag("--kv", kv, {DType::kBF16, DType::kFP8E4M3});
  const std::vector<int> rank_of_list = int_list("--rank-of", rank_of, 1);
  for (int P : rank_of_list) check_rank_split("--rank-of", P, ffn_format);
  require_range("--layers", layers, 1);
  require_range("--reps", reps, 1);
  if (quick) {
    token_list = {1, 16};
    q_len_list = {1};
    context_list = {131072};
    reps = std::min(reps, 20);
  }
  require_output_path("--json", json_path);
  require_device("bench layer");
  const int gpus = cuda_device_count();
  std::vector<int> tp_list;
  for (int tp : tp_values) {
    if (tp > gpus) {
      std::fprintf(stderr, "bench layer: TP %d skipped: %d GPU(s) visible\n", tp, gpus);
      continue;
    }
    tp_list.push_back(tp);
  }
  const std::string device = device_description();
  const ResultFile results("layer", argc, argv, json_path, commit);
  std::printf(
      "m3msa bench layer on %s; read ceiling %.2f TB/s; M3 attention dims, layer kinds %s, %d "
      "sparse layers per graph, kv %s, MoE %s, share period %d; per layer under graph replay\n",
      device.c_str(), kReadCeilingTBs, kinds.c_str(), layers, dtype_name(kv_dtype), moe.c_str(),
      share_period);
  Table table({"kind",  "tp",        "rank of", "moe",     "cp",        "weights", "tokens",
               "q_len", "reqs",      "context", "overlap", "median us", "noise",   "launches",
               "MB",    "allreduce", "nccl us", "peer us", "floor us",  "ratio"});
  for (int tp : tp_list) {
    std::vector<std::unique_ptr<NcclCommunicator>> comms;
    if (tp > 1) {
      std::vector<int> devices;
      for (int r = 0; r < tp; ++r) devices.push_back(r);
      comms = make_nccl_communicators_in_process(devices);
    }
    for (const std::string& kind : kind_list) {
      const bool dense = kind == "dense";
      for (bool cp : cp_list) {
        for (DType w : weight_dtypes) {
          for (int64_t context : context_list) {
            for (int q : q_len_list) {
              for (int t : token_list) {
                for (IndexerOverlap with_overlap : overlap_list) {
                  for (const std::string& moe_mode : moe_list) {
                    for (int rank_shape : rank_of_list) {
                      if (t % q != 0) continue;                // tokens = requests * q_len
                      if (rank_shape > 1 && tp > 1) continue;  // rank shapes run on one GPU
                      Config c;
                      // With CP the runtime is serial: one row, not two identical ones.
                      if (cp && with_overlap != overlap_list.front()) continue;
                      // A dense layer has no indexer (CP and the overlap change nothing in it) and
                      // always an MLP.
                      if (dense && (cp != cp_list.front() || with_overlap != overlap_list.front() ||
                                    moe_mode == "off")) {
                        continue;
                      }
                      c.kind = kind;
                      c.overlap = with_overlap;
                      c.tp = tp;
                      c.cp = cp;
                      c.share_period = share_period;
                      c.allreduce = allreduce_mode;
                      c.weights = w;
                      c.kv = kv_dtype;
                      c.tokens = t;
                      c.q_len = q;
                      c.context = context;
                      c.layers = layers;
                      c.moe = moe_mode;
                      c.rank_of = rank_shape;
                      const Result r = run_config(c, comms, reps, seed);
                      const double us = r.timing.median_us;
                      const double mb = (r.weight_bytes + r.cache_bytes) / 1e6;
                      const std::string overlap_used = dense ? "none"
                                                       : cp  ? "serial"
                                                             : indexer_overlap_name(with_overlap);
                      std::vector<std::string> cells = {
                          kind,
                          fmt::format("{}", tp),
                          fmt::format("{}", rank_shape),
                          moe_mode,
                          cp ? "on" : "off",
                          dtype_name(w),
                          fmt::format("{}", t),
                          fmt::format("{}", q),
                          fmt::format("{}", t / q),
                          fmt::format("{}", context),
                          overlap_used,
                          fmt::format("{:.2f}", us),
                          fmt::format("{:.1f}%", 100.0 * r.timing.noise()),
                          fmt::format("{}", r.launches),
                          fmt::format("{:.1f}", mb),
                          r.allreduce_used,
                          fmt::format("{:.2f}", r.nccl_allreduce_us),
                          fmt::format("{:.2f}", r.peer_allreduce_us),
                          fmt::format("{:.2f}", r.floor_us),
                          fmt::format("{:.2f}", us / r.floor_us)};
                      std::fprintf(stderr, "%s\n",
                                   fmt::format("{}", fmt::join(cells, " ")).c_str());
                      const double tbs = (r.weight_bytes + r.cache_bytes) / (us * 1e-6) / 1e12;
                      table.add(cells, {{"bench", "layer"},
                                        {"kind", kind},
                                        {"tp", tp},
                                        {"rank_of", rank_shape},
                                        {"moe", moe_mode},
                                        {"moe_bytes", r.moe_bytes},
                                        {"dense_mlp_bytes", r.dense_mlp_bytes},
                                        {"cp", cp},
                                        {"share_period", share_period},
                                        {"allreduce", r.allreduce_used},
                                        {"nccl_allreduce_us", r.nccl_allreduce_us},
                                        {"peer_allreduce_us", r.peer_allreduce_us},
                                        {"weights", dtype_name(w)},
                                        {"kv", dtype_name(kv_dtype)},
                                        {"tokens", t},
                                        {"q_len", q},
                                        {"requests", t / q},
                                        {"context", context},
                                        {"indexer_overlap", overlap_used},
                                        {"layers_per_graph", r.layers},
                                        {"median_us", us},
                                        {"p10_us", r.timing.p10_us},
                                        {"p90_us", r.timing.p90_us},
                                        {"noise", r.timing.noise()},
                                        {"launches_per_layer", r.launches},
                                        {"weight_bytes", r.weight_bytes},
                                        {"cache_bytes", r.cache_bytes},
                                        {"allreduce_us", r.allreduce_us},
                                        {"floor_us", r.floor_us},
                                        {"ratio", us / r.floor_us},
                                        {"tb_per_s", tbs},
                                        {"pct_of_read_ceiling", 100.0 * tbs / kReadCeilingTBs},
                                        {"device", device},
                                        {"commit", results.commit()}});
                      table.last_record().update(
                          measured_fields(r.timing, r.weight_bytes + r.cache_bytes, r.floor_us));
                      results.write(table.records(),
                                    false);  // a stopped run keeps what it measured
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  table.print();
  results.write(table.records());
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "layer", "one sparse or dense layer of the fused runtime (graph replay)", run_layer_bench);

}  // namespace
}  // namespace m3msa::bench
