// Host side of the preprocessing kernel: validation, the RoPE frequency table (computed here in
// double with the same std::pow expression as the CPU reference) and the launch.
#include <cuda_runtime.h>

#include <cmath>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/preprocess.h"
#include "cuda/preprocess_kernel.cuh"
#include "cuda/preprocess_params.h"
#include "m3msa/error.h"

namespace m3msa::cuda {
namespace {

void check_contiguous(const TensorView& view, const char* name) {
  M3MSA_CHECK_ARG(view.is_contiguous(), name, " must be contiguous, got ", describe(view));
}

}  // namespace

void launch_preprocess(const SparseConfig& config, const PreprocessArgs& args, cudaStream_t stream,
                       PreprocessPart part) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  validate(config, args, Device::cuda(device));
  check_kv_cache_cuda(args.kv_cache, "kv_cache");
  if (args.index_cache.data.defined()) check_index_cache_cuda(args.index_cache, "index_cache");
  M3MSA_CHECK_SUPPORTED(
      config.head_dim <= preprocess::kMaxDim && config.index_dim <= preprocess::kMaxDim,
      "CUDA preprocessing supports head_dim and index_dim <= ", preprocess::kMaxDim, ", got ",
      config.head_dim, " and ", config.index_dim);
  M3MSA_CHECK_SUPPORTED(config.rope_dim / 2 <= kMaxRopeHalf,
                        "CUDA preprocessing supports rope_dim <= ", 2 * kMaxRopeHalf, ", got ",
                        config.rope_dim);
  const bool index = args.has_index_part();
  M3MSA_CHECK_ARG(index || part != PreprocessPart::kIndex,
                  "preprocess: the index part was asked for but args have none");
  for (const auto& [view, name] : {std::pair{args.q_norm, "q_norm"},
                                   {args.k_norm, "k_norm"},
                                   {args.positions, "positions"},
                                   {args.batch.slot_mapping, "batch.slot_mapping"},
                                   {args.q_out, "q_out"}}) {
    check_contiguous(view, name);
  }
  if (index) {
    for (const auto& [view, name] : {std::pair{args.index_q_norm, "index_q_norm"},
                                     {args.index_k_norm, "index_k_norm"},
                                     {args.batch.index_slot_mapping, "batch.index_slot_mapping"},
                                     {args.index_q_out, "index_q_out"}}) {
      check_contiguous(view, name);
    }
  }
  M3MSA_CHECK_ARG(args.qkv.strides[1] == 1, "qkv rows must be contiguous, got ",
                  describe(args.qkv));

  const int64_t rows = args.batch.num_rows();
  if (rows == 0) return;
  narrow_int(rows, "preprocess rows (grid.x)");

  PreprocessParams p;
  p.qkv = static_cast<const uint16_t*>(args.qkv.data);
  p.q_norm = static_cast<const uint16_t*>(args.q_norm.data);
  p.k_norm = static_cast<const uint16_t*>(args.k_norm.data);
  p.index_q_norm = static_cast<const uint16_t*>(args.index_q_norm.data);
  p.index_k_norm = static_cast<const uint16_t*>(args.index_k_norm.data);
  p.positions = static_cast<const int64_t*>(args.positions.data);
  p.slot_mapping = static_cast<const int64_t*>(args.batch.slot_mapping.data);
  p.index_slot_mapping = static_cast<const int64_t*>(args.batch.index_slot_mapping.data);
  p.kv_cache = args.kv_cache.data.data;
  p.index_cache = args.index_cache.data.data;
  p.q_out = static_cast<uint16_t*>(args.q_out.data);
  p.index_q_out = static_cast<uint16_t*>(args.index_q_out.data);
  p.num_rows = rows;
  p.qkv_row_stride = args.qkv.strides[0];
  p.kv_slots = args.kv_cache.pages() * config.block_size;
  p.index_slots = index ? args.index_cache.pages() * config.block_size : 0;
  p.q_heads = config.q_heads;
  p.kv_heads = config.kv_heads;
  p.index_heads = config.index_heads;
  // The vectors of a row: q heads, k heads, v heads, then (the index part) index_q heads and
  // index_k.
  const int attention_vectors = config.q_heads + 2 * config.kv_heads;
  p.num_vectors = attention_vectors +
                  (index && part != PreprocessPart::kAttention ? config.index_heads + 1 : 0);
  p.first_vector = part == PreprocessPart::kIndex ? attention_vectors : 0;
  p.head_dim = config.head_dim;
  p.index_dim = config.index_dim;
  p.block_size = config.block_size;
  p.rope_half = config.rope_dim / 2;
  p.kv_fp8 = args.kv_cache.data.dtype == DType::kFP8E4M3 ? 1 : 0;
  p.index_fp8 = args.index_cache.data.dtype == DType::kFP8E4M3 ? 1 : 0;
  p.rms_eps = config.rms_eps;
  p.k_scale = args.kv_cache.k_scale;
  p.v_scale = args.kv_cache.v_scale;
  for (int i = 0; i < p.rope_half; ++i) {
    // The reference's expression, so the table is bit-identical.
    p.inv_freq[i] = std::pow(config.rope_theta, -2.0 * static_cast<double>(i) / config.rope_dim);
  }

  const int vectors = p.num_vectors - p.first_vector;
  const dim3 grid(static_cast<unsigned>(rows),
                  static_cast<unsigned>((vectors + preprocess::kWarps - 1) / preprocess::kWarps));
  preprocess::preprocess_qkv_kernel<<<grid, preprocess::kThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::cuda
