// Per-token preprocessing kernel (docs/spec.md, section 2): Gemma RMSNorm + partial NeoX RoPE of
// every q, k, index_q and index_k head, and the insert of k, v and index_k into the paged caches,
// in one launch. Framework-free: raw pointers and PreprocessParams; launched by preprocess.cu.
//
// Grid (rows, ceil(vectors / 8)); one warp per 128-d vector of a row (q heads, k heads, v heads,
// index_q heads, index_k). It reproduces the CPU reference bit for bit: the sum of squares runs in
// dimension order in one lane with unfused fp32 mul/add (__fmul_rn/__fadd_rn, as the host code is
// compiled), IEEE division and square root, the same two bf16 rounding points, cos/sin of a double
// angle rounded once to fp32 (inv_freq comes from the host's std::pow), and the same fp8 encoder.
// Without the index part (a layer sharing another layer's selection, ops.h) only the q, k and v
// vectors of a row are processed. Dead rows (position < 0) write zeros to q_out / index_q_out and
// nothing to the caches; negative (or out-of-range) slots skip the insert.
// Requirements (checked by the launcher): head_dim and index_dim <= kMaxDim, rope_dim / 2 <=
// kMaxRopeHalf, contiguous tensors (qkv: contiguous rows).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/preprocess_params.h"
#include "m3msa/dtype.h"

namespace m3msa::cuda::preprocess {

inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kMaxDim = 512;

enum VectorKind : int { kQ = 0, kK = 1, kV = 2, kIndexQ = 3, kIndexK = 4 };

__global__ void __launch_bounds__(kThreads)
    preprocess_qkv_kernel(const __grid_constant__ PreprocessParams p) {
  __shared__ float s_vec[kWarps][kMaxDim];
  __shared__ float s_cos[kMaxRopeHalf];
  __shared__ float s_sin[kMaxRopeHalf];

  const int64_t row = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t pos = p.positions[row];

  if (pos >= 0) {
    for (int i = threadIdx.x; i < p.rope_half; i += kThreads) {
      const double angle = static_cast<double>(pos) * p.inv_freq[i];
      double sn, cs;
      sincos(angle, &sn, &cs);
      s_cos[i] = static_cast<float>(cs);
      s_sin[i] = static_cast<float>(sn);
    }
  }
  __syncthreads();

  // Which vector this warp handles.
  int vec = p.first_vector + blockIdx.y * kWarps + warp;
  if (vec >= p.num_vectors) return;
  VectorKind kind;
  int head;
  if (vec < p.q_heads) {
    kind = kQ;
    head = vec;
  } else if ((vec -= p.q_heads) < p.kv_heads) {
    kind = kK;
    head = vec;
  } else if ((vec -= p.kv_heads) < p.kv_heads) {
    kind = kV;
    head = vec;
  } else if ((vec -= p.kv_heads) < p.index_heads) {
    kind = kIndexQ;
    head = vec;
  } else {
    kind = kIndexK;
    head = 0;
  }
  const bool is_index = kind == kIndexQ || kind == kIndexK;
  const int n = is_index ? p.index_dim : p.head_dim;

  // Destination (nullptr: nothing to write).
  uint16_t* out_bf16 = nullptr;  // q_out / index_q_out / bf16 cache
  uint8_t* out_fp8 = nullptr;
  float fp8_scale = 1.0f;
  if (kind == kQ) {
    out_bf16 = p.q_out + (row * p.q_heads + head) * int64_t{p.head_dim};
  } else if (kind == kIndexQ) {
    out_bf16 = p.index_q_out + (row * p.index_heads + head) * int64_t{p.index_dim};
  } else if (pos >= 0) {
    const int64_t slot = kind == kIndexK ? p.index_slot_mapping[row] : p.slot_mapping[row];
    const int64_t slots = kind == kIndexK ? p.index_slots : p.kv_slots;
    if (slot >= 0 && slot < slots) {
      const int64_t page = slot / p.block_size;
      const int64_t within = slot - page * p.block_size;
      int64_t offset;
      if (kind == kIndexK) {
        offset = page * p.index_strides[0] + within * p.index_strides[1];
      } else {
        const int64_t* strides = kind == kK ? p.k_strides : p.v_strides;
        offset = page * strides[0] + head * strides[1] + within * strides[2];
      }
      const bool fp8 = kind == kIndexK ? p.index_fp8 != 0 : p.kv_fp8 != 0;
      void* base = kind == kIndexK ? p.index_cache : kind == kK ? p.k_cache : p.v_cache;
      if (fp8) {
        out_fp8 = static_cast<uint8_t*>(base) + offset;
        fp8_scale = kind == kK   ? (p.k_scale_ptr != nullptr ? *p.k_scale_ptr : p.k_scale)
                    : kind == kV ? (p.v_scale_ptr != nullptr ? *p.v_scale_ptr : p.v_scale)
                                 : 1.0f;
      } else {
        out_bf16 = static_cast<uint16_t*>(base) + offset;
      }
    }
  }
  if (out_bf16 == nullptr && out_fp8 == nullptr) return;

  if (pos < 0) {  // dead row: zeros for the query outputs (the caches were skipped above)
    for (int i = lane; i < n; i += 32) out_bf16[i] = 0;
    return;
  }

  int64_t in_offset;
  const int64_t k_at = int64_t{p.q_heads} * p.head_dim;
  const int64_t v_at = k_at + int64_t{p.kv_heads} * p.head_dim;
  const int64_t iq_at = v_at + int64_t{p.kv_heads} * p.head_dim;
  const int64_t ik_at = iq_at + int64_t{p.index_heads} * p.index_dim;
  const uint16_t* weight = nullptr;
  switch (kind) {
    case kQ:
      in_offset = int64_t{head} * p.head_dim;
      weight = p.q_norm;
      break;
    case kK:
      in_offset = k_at + int64_t{head} * p.head_dim;
      weight = p.k_norm;
      break;
    case kV: in_offset = v_at + int64_t{head} * p.head_dim; break;
    case kIndexQ:
      in_offset = iq_at + int64_t{head} * p.index_dim;
      weight = p.index_q_norm;
      break;
    default:
      in_offset = ik_at;
      weight = p.index_k_norm;
      break;
  }
  const uint16_t* in = p.qkv + row * p.qkv_row_stride + in_offset;

  auto store = [&](int i, float value) {
    if (out_fp8 != nullptr) {
      out_fp8[i] = float_to_fp8e4m3(fp8_scale == 1.0f ? value : __fdiv_rn(value, fp8_scale));
    } else {
      out_bf16[i] = float_to_bf16(value);
    }
  };

  if (kind == kV) {  // copied unchanged
    for (int i = lane; i < n; i += 32) store(i, bf16_to_float(in[i]));
    return;
  }

  float* x = s_vec[warp];
  for (int i = lane; i < n; i += 32) x[i] = bf16_to_float(in[i]);
  __syncwarp();
  float sum_sq = 0.0f;
  if (lane == 0) {
    for (int i = 0; i < n; ++i) sum_sq = __fadd_rn(sum_sq, __fmul_rn(x[i], x[i]));
  }
  sum_sq = __shfl_sync(0xFFFFFFFFu, sum_sq, 0);
  const float mean = __fdiv_rn(sum_sq, static_cast<float>(n));
  const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.rms_eps)));
  __syncwarp();
  for (int i = lane; i < n; i += 32) {
    const float w = bf16_to_float(weight[i]);
    x[i] = round_to_bf16(__fmul_rn(__fmul_rn(x[i], r), __fadd_rn(1.0f, w)));
  }
  __syncwarp();
  const int half = p.rope_half;
  for (int i = lane; i < n; i += 32) {
    float y = x[i];
    if (i < half) {
      y = round_to_bf16(__fsub_rn(__fmul_rn(x[i], s_cos[i]), __fmul_rn(x[i + half], s_sin[i])));
    } else if (i < 2 * half) {
      const int j = i - half;
      y = round_to_bf16(__fadd_rn(__fmul_rn(x[i], s_cos[j]), __fmul_rn(x[j], s_sin[j])));
    }
    store(i, y);
  }
}

}  // namespace m3msa::cuda::preprocess
