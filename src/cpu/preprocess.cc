// The CPU reference of per-token preprocessing (docs/spec.md section 2): per-head Gemma RMSNorm,
// partial NeoX RoPE, and the insert of k, v and index_k into the paged caches.
//
// Numerics:
//  - RMSNorm in fp32: sum of x^2 in dimension order, mean = sum / n, r = 1 / sqrtf(mean + eps),
//    y = (x * r) * (1 + w), rounded to bf16.
//  - RoPE: inv_freq[i] = theta^(-2i / rope_dim) and the angle pos * inv_freq[i] in double, cos and
//    sin in double rounded once to fp32 (an fp32 angle is already off by ~0.03 rad at position 1e6,
//    far more than a bf16 output can hide); the rotation itself in fp32 with separately rounded
//    products, x' = x*c - y*s, y' = y*c + x*s, rounded to bf16. (No FMA contraction: the library
//    is built for baseline x86-64, which has no FMA; the CUDA kernel uses __fmul_rn to match.)
//  - v is copied unchanged. Caches get float_to_bf16(value) or float_to_fp8e4m3(value / scale).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/cache_access.h"
#include "cpu/thread_pool.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"

namespace m3msa::cpu {
namespace {

void validate_preprocess(const SparseConfig& config, const PreprocessArgs& args) {
  validate(config, args, Device::cpu());
  // Preprocessing reads no block table; only the lengths and slots are checked.
  BatchMeta used = args.batch;
  used.index_block_table = {};
  used.kv_block_table = {};
  const bool index = args.has_index_part();
  if (!index) used.index_slot_mapping = {};  // a layer sharing another layer's selection
  validate_batch_contents(used, config, index ? args.index_cache.pages() : 0,
                          args.kv_cache.pages());
  check_unique_slots(args.batch.slot_mapping, args.positions, "batch.slot_mapping");
  if (index) {
    check_unique_slots(args.batch.index_slot_mapping, args.positions, "batch.index_slot_mapping");
  }
}

// cos and sin of the rope_dim / 2 rotation angles at `pos`.
void rope_table(const SparseConfig& config, int64_t pos, std::vector<float>& cos_out,
                std::vector<float>& sin_out) {
  const int half = config.rope_dim / 2;
  cos_out.resize(static_cast<std::size_t>(half));
  sin_out.resize(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i) {
    const double inv_freq =
        std::pow(config.rope_theta, -2.0 * static_cast<double>(i) / config.rope_dim);
    const double angle = static_cast<double>(pos) * inv_freq;
    cos_out[i] = static_cast<float>(std::cos(angle));
    sin_out[i] = static_cast<float>(std::sin(angle));
  }
}

// Gemma RMSNorm of one head x[0..n) with weights w, rounded to bf16, then (when cos/sin are given)
// NeoX RoPE on dims [0, rope_dim) rounded to bf16 again. out holds bf16-exact floats.
void norm_rope_head(const uint16_t* x, const uint16_t* weight, int n, int rope_dim,
                    const std::vector<float>* cos_table, const std::vector<float>* sin_table,
                    float* out, float eps) {
  float sum_sq = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float v = bf16_to_float(x[i]);
    sum_sq += v * v;
  }
  const float mean = sum_sq / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int i = 0; i < n; ++i) {
    out[i] = round_to_bf16(bf16_to_float(x[i]) * r * (1.0f + bf16_to_float(weight[i])));
  }
  if (cos_table == nullptr) return;
  const int half = rope_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float a = out[i];
    const float b = out[i + half];
    const float c = (*cos_table)[i];
    const float s = (*sin_table)[i];
    out[i] = round_to_bf16(a * c - b * s);
    out[i + half] = round_to_bf16(b * c + a * s);
  }
}

void store_bf16(const float* values, int n, uint16_t* out) {
  for (int i = 0; i < n; ++i) out[i] = float_to_bf16(values[i]);
}

}  // namespace

void insert_index_k(IndexCache& cache, int64_t slot, const float* index_k, int index_dim) {
  if (slot < 0) return;
  const TensorView& data = cache.data;
  M3MSA_CHECK_ARG(data.ndim == 3 && index_dim == data.shape[2], "index_dim ", index_dim,
                  " does not match index_cache ", describe(data));
  M3MSA_CHECK_ARG(slot < data.shape[0] * data.shape[1], "slot ", slot, " is past index_cache (",
                  data.shape[0], " pages of ", data.shape[1], " tokens)");
  const int64_t offset =
      slot / data.shape[1] * data.strides[0] + slot % data.shape[1] * data.strides[1];
  for (int d = 0; d < index_dim; ++d) {
    if (data.dtype == DType::kBF16) {
      data.ptr<uint16_t>()[offset + d] = float_to_bf16(index_k[d]);
    } else {
      data.ptr<uint8_t>()[offset + d] = float_to_fp8e4m3(index_k[d]);
    }
  }
}

void insert_kv(KVCache& cache, int64_t slot, int kv_head, const float* k, const float* v,
               int head_dim) {
  if (slot < 0) return;
  const TensorView parts[2] = {cache.keys(), cache.values()};
  const TensorView& first = parts[0];
  M3MSA_CHECK_ARG(first.ndim == 4 && head_dim == first.shape[3], "head_dim ", head_dim,
                  " does not match kv_cache ", describe(first));
  M3MSA_CHECK_ARG(kv_head >= 0 && kv_head < first.shape[1], "kv_head must be in [0, ",
                  first.shape[1], "), got ", kv_head);
  const int64_t block_size = first.shape[2];
  M3MSA_CHECK_ARG(slot < first.shape[0] * block_size, "slot ", slot, " is past kv_cache (",
                  first.shape[0], " pages of ", block_size, " tokens)");
  const int64_t page = slot / block_size;
  const int64_t offset = slot % block_size;
  for (int part = 0; part < 2; ++part) {
    const TensorView& data = parts[part];
    const float* values = part == 0 ? k : v;
    const float scale = part == 0 ? cache.host_k_scale() : cache.host_v_scale();
    const int64_t base =
        page * data.strides[0] + kv_head * data.strides[1] + offset * data.strides[2];
    for (int d = 0; d < head_dim; ++d) {
      if (data.dtype == DType::kBF16) {
        data.ptr<uint16_t>()[base + d] = float_to_bf16(values[d]);
      } else {
        data.ptr<uint8_t>()[base + d] = float_to_fp8e4m3(values[d] / scale);
      }
    }
  }
}

void preprocess(const SparseConfig& config, const PreprocessArgs& args, int threads) {
  validate_preprocess(config, args);
  const int qh = config.q_heads;
  const int kvh = config.kv_heads;
  const int ih = config.index_heads;
  const int hd = config.head_dim;
  const int id = config.index_dim;
  const int64_t width = config.qkv_width();
  const int64_t k_at = int64_t{qh} * hd;
  const int64_t v_at = k_at + int64_t{kvh} * hd;
  const int64_t index_q_at = v_at + int64_t{kvh} * hd;
  const int64_t index_k_at = index_q_at + int64_t{ih} * id;
  const bool rope = config.rope_dim > 0;
  const bool index = args.has_index_part();

  detail::parallel_for(args.batch.num_rows(), threads, [&](int64_t row) {
    uint16_t* q_out = args.q_out.ptr<uint16_t>() + row * qh * hd;
    uint16_t* index_q_out = index ? args.index_q_out.ptr<uint16_t>() + row * ih * id : nullptr;
    const int64_t pos = args.positions.ptr<const int64_t>()[row];
    if (pos < 0) {
      std::fill(q_out, q_out + int64_t{qh} * hd, float_to_bf16(0.0f));
      if (index) std::fill(index_q_out, index_q_out + int64_t{ih} * id, float_to_bf16(0.0f));
      return;
    }
    const uint16_t* in = args.qkv.ptr<const uint16_t>() + row * width;
    std::vector<float> cos_table;
    std::vector<float> sin_table;
    rope_table(config, pos, cos_table, sin_table);
    const std::vector<float>* c = rope ? &cos_table : nullptr;
    const std::vector<float>* s = rope ? &sin_table : nullptr;
    std::vector<float> head(static_cast<std::size_t>(std::max(hd, id)));
    std::vector<float> value(static_cast<std::size_t>(hd));

    for (int h = 0; h < qh; ++h) {
      norm_rope_head(in + int64_t{h} * hd, args.q_norm.ptr<const uint16_t>(), hd, config.rope_dim,
                     c, s, head.data(), config.rms_eps);
      store_bf16(head.data(), hd, q_out + int64_t{h} * hd);
    }
    for (int h = 0; index && h < ih; ++h) {
      norm_rope_head(in + index_q_at + int64_t{h} * id, args.index_q_norm.ptr<const uint16_t>(), id,
                     config.rope_dim, c, s, head.data(), config.rms_eps);
      store_bf16(head.data(), id, index_q_out + int64_t{h} * id);
    }
    // Slots are distinct across live rows (checked above), so these writes never overlap.
    KVCache kv_cache = args.kv_cache;
    const int64_t slot = args.batch.slot_mapping.ptr<const int64_t>()[row];
    for (int h = 0; h < kvh; ++h) {
      norm_rope_head(in + k_at + int64_t{h} * hd, args.k_norm.ptr<const uint16_t>(), hd,
                     config.rope_dim, c, s, head.data(), config.rms_eps);
      detail::load_bf16(in + v_at + int64_t{h} * hd, hd, value.data());
      insert_kv(kv_cache, slot, h, head.data(), value.data(), hd);
    }
    if (!index) return;
    IndexCache index_cache = args.index_cache;
    norm_rope_head(in + index_k_at, args.index_k_norm.ptr<const uint16_t>(), id, config.rope_dim, c,
                   s, head.data(), config.rms_eps);
    insert_index_k(index_cache, args.batch.index_slot_mapping.ptr<const int64_t>()[row],
                   head.data(), id);
  });
}

}  // namespace m3msa::cpu
