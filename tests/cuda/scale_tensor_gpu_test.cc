// fp8 k / v scales given as device f32 scalars (KVCache::k_scale_tensor, v_scale_tensor) are read
// when the kernels run: attention and the cache insert equal the host-float path bit for bit, and
// a captured CUDA graph replays with each new value.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "cuda/attention.h"
#include "m3msa/cuda_backend.h"

namespace m3msa {
namespace {

using attntest::DevTensor;
using attntest::to_dev;
using attntest::to_host;

struct Scalars {
  cuda::DeviceBuffer k{sizeof(float)};
  cuda::DeviceBuffer v{sizeof(float)};
  void set(float k_value, float v_value, cudaStream_t stream) {
    // Pageable host sources: the copies finish before they return (safe while a graph waits).
    CUDA_CHECK(cudaMemcpyAsync(k.data(), &k_value, sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(v.data(), &v_value, sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  void attach(KVCache& cache) const {
    cache.k_scale_tensor = TensorView::contiguous(k.data(), DType::kF32, {1}, Device::cuda(0));
    cache.v_scale_tensor = TensorView::contiguous(v.data(), DType::kF32, {1}, Device::cuda(0));
  }
};

TEST(CudaScaleTensors, AttentionReadsDeviceScalarsAndAGraphSeesNewValues) {
  M3MSA_REQUIRE_GPU();
  SyntheticSpec spec;
  spec.num_reqs = 5;
  spec.q_len = 2;
  spec.min_context = 100;
  spec.max_context = 30000;
  spec.kv_dtype = DType::kFP8E4M3;
  spec.seed = 23;
  SyntheticCase c = make_synthetic_case(spec);
  const SparseConfig& cfg = c.config;
  attntest::DevAttention dev(c);
  DevTensor topk = to_dev(attntest::random_selection(c, 4));
  cuda::DeviceBuffer ws = attntest::attention_workspace(cfg);
  cuda::Stream stream;
  DevTensor out = attntest::poisoned(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
  auto run = [&](const KVCache& kv) {
    AttentionArgs a = dev.args(topk.view, out.view);
    a.kv_cache = kv;
    cuda::launch_attention(cfg, a, ws.data(), ws.bytes(), stream.get());
  };
  auto eager = [&](float k_scale, float v_scale) {
    run(KVCache(dev.kv_cache.view, k_scale, v_scale));
    stream.synchronize();
    return to_host(out.view);
  };

  Scalars scalars;
  KVCache by_device(dev.kv_cache.view, 100.0f, 100.0f);  // the floats are overridden
  scalars.attach(by_device);
  scalars.set(0.5f, 0.25f, stream.get());
  run(by_device);
  stream.synchronize();
  EXPECT_TRUE(attntest::bitwise_equal(to_host(out.view), eager(0.5f, 0.25f)));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  run(by_device);
  CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (const auto& [k, v] : {std::pair{0.5f, 0.25f}, {2.0f, 0.125f}, {0.0625f, 3.0f}}) {
    const HostTensor want = eager(k, v);
    scalars.set(k, v, stream.get());
    CUDA_CHECK(cudaMemset(out.view.data, 0xFF, out.view.nbytes()));
    CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.synchronize();
    EXPECT_TRUE(attntest::bitwise_equal(to_host(out.view), want))
        << "k_scale " << k << " v_scale " << v;
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace m3msa
