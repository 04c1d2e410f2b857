// fuzz_runtime: the fused decode runtime's host-side validators, through the public API of
// include/m3msa/runtime.h only: a single-rank CPU runtime (make_single_rank_communicator) over a
// tiny model (hidden 64-256, 1-8 q heads, 1-2 KV heads, head / index dims 8-16, blocks of 4-16
// tokens, top-1..4, 1-3 sparse layers, an optional MLP per layer). The input picks
//  - every RuntimeConfig field (buckets, query lengths, max_requests, max_context, PP, CP,
//    selection_share_period, activation dtype, cache block size, swiglu limit, threads) and
//    hostile values of the model fields the runtime is told about;
//  - each bound tensor's presence, dtype, shape, strides, device and data pointer, the fp8
//    projection scales, the cache scales and the layer ids (missing, twice, dense, out of range);
//  - the StepContext of prepare (capturing, no metadata);
//  - 1-3 begin_step calls with hostile decode / prefill BatchMeta (kinds, q_len, num_reqs,
//    seq_lens, both tables, both slot mappings, every view broken in the same ways) and
//    pad_to_reqs; after each, forward_layer calls with hostile layer ids and hidden / residual /
//    positions views (aliased, other rows, other dtypes, strided, on a GPU, hostile positions);
//  - close or detach (empty, zero-page or live replacement storage), and sometimes a second
//    prepare on the same bindings.
// Contract (fuzz_common.h): every call is accepted or throws m3msa::Error with code
// invalid-argument or unsupported and a message; close() never throws on one rank. Promises
// checked on accepted calls:
//  - prepare: kActive => state active on the CPU backend, stats().bound_layers is exactly the
//    model's sparse layers, the buckets are the config's; kFallback => state fallback with at
//    least one reason; kNotReady => state idle and prepare_not_ready grew; kSkipped only without
//    metadata; an error leaves the runtime idle. A second prepare after close gives the first
//    one's result (active again, or the fallback kept).
//  - begin_step: false => exactly one refusal counter grew by one and nothing was accepted; true
//    => steps_accepted grew, the fixed buffers hold the step (seq_lens and slots copied, padding
//    requests of length 0 and padding rows without slots) at addresses that never change; a throw
//    counts nothing.
//  - forward_layer: accepted only on an open step, a sparse layer id and [rows, hidden] bf16 /
//    [rows] i64 views of that step; then hidden and residual are finite wherever the inputs,
//    weights and caches were finite and small; its selection (last_layer_trace().topk) holds only
//    -1 or blocks visible to the row.
//  - detach: accepted => closed, nothing bound; refused => still active.
// Allocations stay small (every tensor under 128 KiB, the runtime's buffers a few MiB at most) and
// the layer math of one input is bounded (kWorkBudget multiply-adds): about 2.5 ms per input on
// average, 10 ms at most.
//
// The inputs marked R1..R8 reach the runtime defects this target found (docs/reliability.md,
// all fixed in src/runtime and src/core).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "m3msa/batch.h"
#include "m3msa/comm.h"
#include "m3msa/runtime.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/splitmix.h"

// The harness's own bulk loops carry no coverage instrumentation: their edges say nothing about
// the code under test, and instrumented they cost more than the runtime's layers.
#define M3MSA_FUZZ_NO_COVERAGE __attribute__((no_sanitize("coverage")))

namespace m3msa::fuzz {
namespace {

constexpr int64_t kMaxTensorBytes = 1 << 17;  // per tensor the harness allocates
constexpr int64_t kWorkBudget = 200'000;      // multiply-adds of forward_layer per input
constexpr int kMaxReqs = 16;                  // requests the harness builds metadata for
constexpr int64_t kMaxColumns = 64;           // block-table columns the harness builds

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] == '1';
}

// One summary line per input on stderr (to choose seeds).
bool tracing() {
  static const bool on = env_flag("M3MSA_FUZZ_RUNTIME_TRACE");
  return on;
}

// Bulk values the input is too short to spell out.
using Rng = testkit::SplitMix64;

// Element values of weights, caches and activations: small numbers on a coarse grid, and with
// `hostile` set, now and then a NaN, an infinity, a huge or a subnormal value.
struct Values {
  Rng rng;
  bool hostile = false;
  bool used_hostile = false;  // a hostile value was written somewhere
  M3MSA_FUZZ_NO_COVERAGE float next(float scale) {
    const uint64_t r = rng.next();
    if (hostile && (r & 31) == 0) {
      used_hostile = true;
      static constexpr float kSpecial[] = {std::numeric_limits<float>::quiet_NaN(),
                                           std::numeric_limits<float>::infinity(),
                                           -std::numeric_limits<float>::infinity(),
                                           3e38f,
                                           -3e38f,
                                           1e-40f,
                                           448.0f,
                                           -0.0f};
      return kSpecial[(r >> 8) % std::size(kSpecial)];
    }
    return static_cast<float>(static_cast<int>((r >> 8) % 17) - 8) * 0.125f * scale;
  }
};

std::size_t item_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kBF16: return 2;
    case DType::kI64:
    case DType::kU64: return 8;
    default: return 1;  // fp8, u8, and values outside the enum
  }
}

// Where views point: owned by one input.
struct Arena {
  std::vector<std::unique_ptr<uint64_t[]>> blocks;
  void* allocate(int64_t bytes) {
    const std::size_t words = static_cast<std::size_t>(bytes + 15) / 8;
    blocks.emplace_back(new uint64_t[words]());  // zeroed, 8-byte aligned, never null
    return blocks.back().get();
  }
};

// The logical element i (row-major over the view's shape) of a view the harness filled.
struct Content {
  std::function<float(int64_t)> real;     // for float dtypes (and converted for others)
  std::function<int64_t(int64_t)> whole;  // for integer dtypes (and converted for others)
  // Drawn values: a contiguous view may repeat its first kPeriod elements (a copy is much
  // cheaper than drawing every element of a weight matrix).
  bool periodic = false;
};

constexpr int64_t kPeriod = 1021;  // prime: rows of any width do not line up with it

M3MSA_FUZZ_NO_COVERAGE void write_element(const TensorView& v, int64_t offset,
                                          const Content& content, int64_t i) {
  uint8_t* base = static_cast<uint8_t*>(v.data);
  const auto real = [&] {
    return content.real ? content.real(i) : static_cast<float>(content.whole(i));
  };
  const auto whole = [&] {
    if (content.whole) return content.whole(i);
    const float x = content.real(i);  // NaN -> 0, saturating
    return std::isnan(x) ? 0 : static_cast<int64_t>(std::clamp(x, -9.2e18f, 9.2e18f));
  };
  switch (v.dtype) {
    case DType::kF32: reinterpret_cast<float*>(base)[offset] = real(); break;
    case DType::kBF16: reinterpret_cast<uint16_t*>(base)[offset] = float_to_bf16(real()); break;
    case DType::kFP8E4M3: base[offset] = float_to_fp8e4m3(real()); break;
    case DType::kI32:
      reinterpret_cast<int32_t*>(base)[offset] = static_cast<int32_t>(whole());
      break;
    case DType::kI64:
    case DType::kU64: reinterpret_cast<int64_t*>(base)[offset] = whole(); break;
    default: base[offset] = static_cast<uint8_t>(whole()); break;
  }
}

// Every logical element (row-major over the shape) of a view with allocated data.
M3MSA_FUZZ_NO_COVERAGE void fill_elements(const TensorView& v, const Content& content) {
  int64_t numel = 1;
  for (int d = 0; d < v.ndim; ++d) numel *= v.shape[d];
  if (v.is_contiguous()) {
    const int64_t drawn = content.periodic ? std::min(numel, kPeriod) : numel;
    for (int64_t i = 0; i < drawn; ++i) write_element(v, i, content, i);
    const std::size_t item = item_size(v.dtype);
    uint8_t* base = static_cast<uint8_t*>(v.data);
    for (int64_t i = drawn; i < numel; i += kPeriod) {
      const int64_t n = std::min(kPeriod, numel - i);
      std::memcpy(base + static_cast<std::size_t>(i) * item, base,
                  static_cast<std::size_t>(n) * item);
    }
    return;
  }
  // Strided (the runtime takes none of these today): drawn values only for the first kPeriod
  // elements, zeros after them.
  const int64_t drawn = content.periodic ? std::min(numel, kPeriod) : numel;
  for (int64_t i = 0; i < drawn; ++i) {
    int64_t rest = i;
    int64_t offset = 0;
    for (int d = v.ndim - 1; d >= 0; --d) {
      offset += (rest % v.shape[d]) * v.strides[d];
      rest /= v.shape[d];
    }
    write_element(v, offset, content, i);
  }
}

// An extent the harness never allocates for (paired with a null data pointer when too big).
int64_t hostile_extent(FuzzedDataProvider& in) {
  if (in.ConsumeBool()) return hostile_i64(in);  // element counts that overflow int64 (R3)
  return in.PickValueInArray<int64_t>(
      {-1, -7, 0, 1, 65, 1 << 20, int64_t{1} << 31, int64_t{1} << 40, -(int64_t{1} << 40)});
}

DType hostile_dtype(FuzzedDataProvider& in) {
  return in.ConsumeIntegralInRange<int>(0, 7) == 7
             ? static_cast<DType>(in.ConsumeIntegral<int>())
             : static_cast<DType>(in.ConsumeIntegralInRange<int>(0, 6));
}

Device hostile_device(FuzzedDataProvider& in) {
  if (in.ConsumeBool()) return Device::cuda(0);
  Device d;
  // Types outside the enum and host tensors with an index (R8).
  d.type = static_cast<DeviceType>(in.ConsumeIntegralInRange<int>(-1, 3));
  d.index = hostile_int(in, 8);
  return d;
}

struct Made {
  TensorView view;
  bool exact = true;  // the requested dtype, shape and contiguous layout on the host
};

// A tensor the runtime expects as `dtype`[`shape`] on the host: mostly exactly that, sometimes
// broken (not given, `alt_dtype` or any dtype, an extent off by one, zero or hostile, another
// rank, padded or swapped strides, on a GPU, null data). Data is allocated for every element the
// view can address, unless that is more than kMaxTensorBytes (or an extent is negative): then the
// data pointer is null (the runtime must refuse the view before reading it).
Made make_tensor(FuzzedDataProvider& in, Arena& arena, DType dtype, std::vector<int64_t> shape,
                 const Content& content, DType alt_dtype, int break_rate = 24) {
  Made made;
  Device device = Device::cpu();
  bool null_data = false;
  int layout = 0;  // 0 contiguous, 1 padded, 2 swapped
  const int choice = in.ConsumeIntegralInRange<int>(0, break_rate);
  const int dim =
      shape.empty() ? 0 : in.ConsumeIntegralInRange<int>(0, static_cast<int>(shape.size()) - 1);
  switch (choice) {
    case 1: return {TensorView{}, false};
    case 2: dtype = alt_dtype; break;
    case 3: dtype = hostile_dtype(in); break;
    case 4:
      if (!shape.empty())
        shape[dim] = std::max<int64_t>(0, shape[dim] + (in.ConsumeBool() ? 1 : -1));
      break;
    case 5:
      if (in.ConsumeBool() && !shape.empty()) {
        shape.pop_back();
      } else if (shape.size() < static_cast<std::size_t>(kMaxDims)) {
        shape.push_back(in.ConsumeIntegralInRange<int64_t>(0, 2));
      }
      break;
    case 6:
      if (!shape.empty()) shape[dim] = hostile_extent(in);
      break;
    case 7: layout = in.ConsumeBool() ? 1 : 2; break;
    case 8: device = hostile_device(in); break;
    case 9: null_data = true; break;
    case 10:
      if (!shape.empty()) shape[dim] = 0;
      break;
    default: break;
  }
  TensorView& v = made.view;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;  // contiguous strides, saturating at 2^40 (such views get no data)
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[static_cast<std::size_t>(d)];
    v.strides[d] = stride;
    stride = std::min<int64_t>(stride * std::clamp<int64_t>(v.shape[d], 1, int64_t{1} << 20),
                               int64_t{1} << 40);
  }
  if (layout == 1 && v.ndim > 0) {  // dims [0, dim] twice as far apart: a padded layout
    for (int d = 0; d <= dim; ++d) v.strides[d] *= 2;
  } else if (layout == 2 && v.ndim >= 2) {
    std::swap(v.strides[v.ndim - 1], v.strides[v.ndim - 2]);
  }
  made.exact = choice == 0 || choice > 10;
  // The bytes the view can address.
  bool negative = false;
  bool empty = false;
  __int128 span = 1;
  for (int d = 0; d < v.ndim; ++d) {
    negative = negative || v.shape[d] < 0;
    empty = empty || v.shape[d] == 0;
    if (v.shape[d] > 0) span += static_cast<__int128>(v.shape[d] - 1) * v.strides[d];
  }
  const __int128 bytes = span * static_cast<__int128>(item_size(dtype));
  if (null_data || (!negative && !empty && bytes > kMaxTensorBytes)) {
    v.data = nullptr;
    made.exact = made.exact && empty;
    return made;
  }
  v.data = arena.allocate(negative || empty ? 16 : static_cast<int64_t>(bytes));
  if (negative || empty) return made;
  fill_elements(v, content);
  return made;
}

Content reals(Values& values, float scale) {
  return {[&values, scale](int64_t) { return values.next(scale); }, {}, true};
}

// A value that is `plausible` most of the time, another small one or an edge value sometimes.
int pick_int(FuzzedDataProvider& in, int plausible, int lo, int hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 12:
    case 13: return in.ConsumeIntegralInRange<int>(lo, hi);
    case 14: return hostile_int(in, hi);
    case 15:
      return in.PickValueInArray<int>({0, -1, std::numeric_limits<int>::min(),
                                       std::numeric_limits<int>::max(), -(1 << 30), 1 << 30});
    default: return plausible;
  }
}

// A size that the runtime turns into buffers: plausible, small, or a value it must refuse
// (negative, zero) or a big one it must refuse rather than allocate (R5).
int64_t pick_size(FuzzedDataProvider& in, int64_t plausible, int64_t lo, int64_t hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 12:
    case 13: return in.ConsumeIntegralInRange<int64_t>(lo, hi);
    case 14:
      return in.PickValueInArray<int64_t>({0, -1, -(1 << 30), std::numeric_limits<int>::min()});
    case 15: return hostile_int(in, static_cast<int>(hi));  // unbounded buffers (R5)
    default: return plausible;
  }
}

struct Model {
  ModelConfig config;  // what the tensors are built for
  int64_t kv_pages = 1;
  int64_t index_pages = 1;
  std::vector<bool> mlp;  // per sparse layer
  std::vector<bool> moe;  // per sparse layer (never with the MLP)
  bool moe_fp8 = false;   // MXFP8 experts (else bf16)
  bool dense = false;     // the dense layers [0, first_sparse_layer) are bound too
  int first_bound() const { return dense ? 0 : config.first_sparse_layer; }
};

Model make_model(FuzzedDataProvider& in) {
  Model model;
  ModelConfig& m = model.config;
  m.kv_heads = in.ConsumeIntegralInRange<int>(1, 2);
  m.index_heads = m.kv_heads;
  m.q_heads = m.kv_heads * in.PickValueInArray<int>({1, 2, 4});
  m.head_dim = in.PickValueInArray<int>({8, 16});
  m.index_dim = in.PickValueInArray<int>({8, 16});
  m.hidden = in.PickValueInArray<int>({64, 128, 256});
  m.block_size = in.PickValueInArray<int>({4, 8, 16});
  m.topk = in.ConsumeIntegralInRange<int>(1, 4);
  m.local_blocks = in.ConsumeIntegralInRange<int>(0, 1);
  m.init_blocks = in.ConsumeIntegralInRange<int>(0, m.topk - m.local_blocks);
  m.rope_dim = in.PickValueInArray<int>({8, 0, 4});
  m.rope_theta = 10000.0;
  m.rms_eps = 1e-6f;
  m.first_sparse_layer = in.ConsumeIntegralInRange<int>(0, 1);
  m.num_layers = m.first_sparse_layer + in.ConsumeIntegralInRange<int>(1, 3);
  m.intermediate = in.PickValueInArray<int>({0, 32, 64});
  const int mlp_bits = in.ConsumeIntegralInRange<int>(0, 7);
  for (int i = 0; i < m.num_sparse_layers(); ++i) {
    model.mlp.push_back(m.intermediate > 0 && ((mlp_bits >> i) & 1) != 0);
  }
  model.kv_pages = in.ConsumeIntegralInRange<int64_t>(1, 24);
  model.index_pages = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(1, 24) : model.kv_pages;
  // The mixture of experts (docs/spec.md section 8), small; which layers bind it.
  m.num_experts = in.PickValueInArray<int>({4, 8});
  m.experts_per_token = in.ConsumeIntegralInRange<int>(1, 2);
  m.moe_intermediate = in.PickValueInArray<int>({32, 64});
  m.shared_experts = in.ConsumeIntegralInRange<int>(0, 1);
  const int moe_bits = in.ConsumeIntegralInRange<int>(0, 7);
  for (int i = 0; i < m.num_sparse_layers(); ++i) {
    model.moe.push_back(!model.mlp[static_cast<std::size_t>(i)] && ((moe_bits >> i) & 1) != 0);
  }
  model.moe_fp8 = in.ConsumeBool();
  // The dense layers (docs/spec.md section 8): their MLP in the experts' format.
  m.dense_intermediate = in.PickValueInArray<int>({32, 64});
  model.dense = m.first_sparse_layer > 0 && in.ConsumeBool();
  return model;
}

// One hostile edit of the model as the runtime is told about it (the tensors keep the real one).
void edit_model(FuzzedDataProvider& in, ModelConfig& m) {
  switch (in.ConsumeIntegralInRange<int>(0, 31)) {
    case 1: m.hidden = hostile_int(in, 300); break;
    case 2:
      m.num_layers = hostile_int(in, 8);  // huge counts (R4)
      break;
    case 3: m.first_sparse_layer = hostile_int(in, 4); break;
    case 4: m.q_heads = hostile_int(in, 8); break;
    case 5: m.kv_heads = hostile_int(in, 4); break;
    case 6: m.index_heads = hostile_int(in, 4); break;
    case 7: m.head_dim = hostile_int(in, 32); break;
    case 8: m.index_dim = hostile_int(in, 32); break;
    case 9: m.block_size = hostile_int(in, 32); break;
    case 10: m.topk = hostile_int(in, 1024); break;
    case 11: m.init_blocks = hostile_int(in, 4); break;
    case 12: m.local_blocks = hostile_int(in, 4); break;
    case 13: m.rope_dim = hostile_int(in, 16); break;
    case 14: m.rope_theta = hostile_double(in); break;
    case 15: m.rms_eps = hostile_float(in); break;
    case 16:
      m.intermediate = hostile_int(in, 128);  // big widths without MLP weights (R2)
      break;
    case 17: m.num_experts = hostile_int(in, 16); break;
    case 18: m.experts_per_token = hostile_int(in, 8); break;
    case 19: m.moe_intermediate = hostile_int(in, 128); break;
    case 20: m.shared_experts = hostile_int(in, 2); break;
    case 21: m.routed_scaling = hostile_float(in); break;
    case 22: m.dense_intermediate = hostile_int(in, 128); break;
    default: break;
  }
}

RuntimeConfig make_config(FuzzedDataProvider& in, const Model& model) {
  RuntimeConfig c;
  c.model = model.config;
  edit_model(in, c.model);
  if (in.ConsumeIntegralInRange<int>(0, 7) == 7) edit_model(in, c.model);
  c.pipeline_parallel_size = pick_int(in, 1, 0, 4);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 15) c.activation_dtype = hostile_dtype(in);
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 13: c.cache_block_size = model.config.block_size; break;
    case 14: c.cache_block_size = model.config.block_size * 2; break;
    case 15: c.cache_block_size = hostile_int(in, 32); break;
    default: c.cache_block_size = 0; break;
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 3) {
    // Any list: ascending small buckets mostly, a broken order or a refused value sometimes.
    c.token_buckets.clear();
    const int n = in.ConsumeIntegralInRange<int>(0, 5);
    int last = 0;
    for (int i = 0; i < n; ++i) {
      int bucket = static_cast<int>(
          std::min<int64_t>(int64_t{last} + in.ConsumeIntegralInRange<int>(1, 8), 64));
      switch (in.ConsumeIntegralInRange<int>(0, 7)) {
        case 6: bucket = in.ConsumeIntegralInRange<int>(-2, 16); break;
        case 7: bucket = static_cast<int>(pick_size(in, bucket, 1, 32)); break;
        default: break;
      }
      c.token_buckets.push_back(bucket);
      last = std::max(last, bucket);
    }
  }
  if (in.ConsumeIntegralInRange<int>(0, 3) == 3) {
    c.query_lens.clear();
    const int n = in.ConsumeIntegralInRange<int>(0, 4);
    for (int i = 0; i < n; ++i) c.query_lens.push_back(pick_int(in, i + 1, 1, 9));
  }
  c.max_requests = static_cast<int>(pick_size(in, 4, 1, kMaxReqs));
  const int64_t tokens = model.kv_pages * model.config.block_size;
  c.max_context = pick_size(in, std::min<int64_t>(tokens, 256), 1, 2048);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 15) c.max_context = hostile_i64(in);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 15) {
    // Refused as needing block ids past the cap: never allocated. INT64_MAX (R1): rounded up to
    // whole blocks without overflowing.
    c.max_context = in.PickValueInArray<int64_t>(
        {int64_t{1} << 50, int64_t{1} << 62, std::numeric_limits<int64_t>::max()});
  }
  c.context_parallel = in.ConsumeIntegralInRange<int>(0, 15) == 15;
  c.selection_share_period = pick_int(in, 1, 0, 4);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 15) c.swiglu_limit = hostile_float(in);
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 13: c.threads = 0; break;
    case 14: c.threads = 2; break;
    case 15: c.threads = in.PickValueInArray<int>({-1, std::numeric_limits<int>::min()}); break;
    default: c.threads = 1; break;
  }
  return c;
}

struct Bound {
  ModelWeights weights;
  bool clean = true;  // every bound value finite and small, every scale in [1/64, 64]
};

// A scale: sane most of the time, a hostile float sometimes.
float pick_scale(FuzzedDataProvider& in, bool& clean) {
  if (in.ConsumeIntegralInRange<int>(0, 15) == 15) {
    const float s = hostile_float(in);
    clean = clean && std::isfinite(s) && s >= 1.0f / 64 && s <= 64.0f;
    return s;
  }
  return in.PickValueInArray<float>({1.0f, 0.5f, 2.0f, 1.0f / 64, 64.0f});
}

Bound make_weights(FuzzedDataProvider& in, Arena& arena, Values& values, const Model& model) {
  Bound out;
  const ModelConfig& m = model.config;
  const SparseConfig sc = m.sparse(1);
  const int64_t H = m.hidden;
  const int64_t W = sc.qkv_width();
  const int64_t attn = int64_t{sc.q_heads} * sc.head_dim;
  const int64_t I = m.intermediate;
  const float in_scale = 1.0f / std::sqrt(static_cast<float>(H));
  for (int i = 0; i < m.num_sparse_layers(); ++i) {
    LayerWeights w;
    w.layer = m.first_sparse_layer + i;
    const DType qkv_dtype =
        in.ConsumeIntegralInRange<int>(0, 3) == 3 ? DType::kFP8E4M3 : DType::kBF16;
    const DType o_dtype =
        in.ConsumeIntegralInRange<int>(0, 3) == 3 ? DType::kFP8E4M3 : DType::kBF16;
    const DType other_weight = qkv_dtype == DType::kBF16 ? DType::kFP8E4M3 : DType::kBF16;
    w.qkv_proj =
        make_tensor(in, arena, qkv_dtype, {W, H}, reals(values, in_scale), other_weight).view;
    Content scales{[&](int64_t) { return values.hostile ? values.next(1.0f) : 0.03125f; }, {}};
    if (qkv_dtype == DType::kFP8E4M3 || in.ConsumeIntegralInRange<int>(0, 15) == 15) {
      w.qkv_proj_scale = make_tensor(in, arena, DType::kF32, {W}, scales, DType::kBF16).view;
    }
    w.o_proj = make_tensor(in, arena, o_dtype, {H, attn}, reals(values, in_scale),
                           o_dtype == DType::kBF16 ? DType::kFP8E4M3 : DType::kBF16)
                   .view;
    if (o_dtype == DType::kFP8E4M3 || in.ConsumeIntegralInRange<int>(0, 15) == 15) {
      w.o_proj_scale = make_tensor(in, arena, DType::kF32, {H}, scales, DType::kBF16).view;
    }
    const Content norm = reals(values, 0.5f);
    w.q_norm = make_tensor(in, arena, DType::kBF16, {sc.head_dim}, norm, DType::kF32).view;
    w.k_norm = make_tensor(in, arena, DType::kBF16, {sc.head_dim}, norm, DType::kF32).view;
    w.index_q_norm = make_tensor(in, arena, DType::kBF16, {sc.index_dim}, norm, DType::kF32).view;
    w.index_k_norm = make_tensor(in, arena, DType::kBF16, {sc.index_dim}, norm, DType::kF32).view;
    w.input_norm = make_tensor(in, arena, DType::kBF16, {H}, norm, DType::kF32).view;
    w.post_attention_norm = make_tensor(in, arena, DType::kBF16, {H}, norm, DType::kF32).view;
    const DType kv_dtype = in.ConsumeBool() ? DType::kFP8E4M3 : DType::kBF16;
    w.kv_cache.data = make_tensor(in, arena, kv_dtype,
                                  {model.kv_pages, sc.kv_heads, 2, sc.block_size, sc.head_dim},
                                  reals(values, 1.0f), DType::kF32)
                          .view;
    w.kv_cache.k_scale = pick_scale(in, out.clean);
    w.kv_cache.v_scale = pick_scale(in, out.clean);
    const DType index_dtype = in.ConsumeBool() ? DType::kFP8E4M3 : DType::kBF16;
    w.index_cache.data =
        make_tensor(in, arena, index_dtype, {model.index_pages, sc.block_size, sc.index_dim},
                    reals(values, 1.0f), DType::kF32)
            .view;
    const bool mlp = model.mlp[static_cast<std::size_t>(i)];
    const int mlp_choice = in.ConsumeIntegralInRange<int>(0, 15);
    if (mlp || mlp_choice == 15) {
      const int64_t width = std::max<int64_t>(I, 8);
      if (mlp_choice != 14) {
        w.mlp_gate_up = make_tensor(in, arena, DType::kBF16, {2 * width, H},
                                    reals(values, 4.0f * in_scale), DType::kFP8E4M3)
                            .view;
      }
      if (mlp_choice != 13) {
        w.mlp_down =
            make_tensor(in, arena, DType::kBF16, {H, width}, reals(values, 0.25f), DType::kFP8E4M3)
                .view;
      }
    }
    // The MoE: router, routed experts, shared expert; bf16 or MXFP8 with e8m0 scales.
    const int moe_choice = in.ConsumeIntegralInRange<int>(0, 15);
    if (model.moe[static_cast<std::size_t>(i)] || moe_choice == 15) {
      const int64_t E = m.num_experts;
      const DType wd = model.moe_fp8 ? DType::kFP8E4M3 : DType::kBF16;
      const DType alt = model.moe_fp8 ? DType::kBF16 : DType::kFP8E4M3;
      const Content e8m0{{}, [&values](int64_t i) {
                           if (!values.hostile) return int64_t{118} + i % 8;
                           const float v = std::fabs(values.next(255.0f));
                           return std::isfinite(v) ? static_cast<int64_t>(std::min(v, 255.0f))
                                                   : int64_t{255};
                         }};
      w.router_weight =
          make_tensor(in, arena, DType::kF32, {E, H}, reals(values, in_scale), DType::kBF16).view;
      if (moe_choice != 14) {
        w.router_bias =
            make_tensor(in, arena, DType::kF32, {E}, reals(values, 0.05f), DType::kBF16).view;
      }
      auto set = [&](ExpertWeights& x, std::vector<int64_t> lead, int64_t inter) {
        std::vector<int64_t> s13 = lead, s2 = lead;
        s13.insert(s13.end(), {2 * inter, H});
        s2.insert(s2.end(), {H, inter});
        x.w13 = make_tensor(in, arena, wd, s13, reals(values, 4.0f * in_scale), alt).view;
        x.w2 = make_tensor(in, arena, wd, s2, reals(values, 0.25f), alt).view;
        if (model.moe_fp8 || moe_choice == 13) {
          s13.back() /= kMxfp8Block;
          s2.back() = std::max<int64_t>(inter / kMxfp8Block, 1);
          x.w13_scale = make_tensor(in, arena, DType::kU8, s13, e8m0, DType::kI32).view;
          x.w2_scale = make_tensor(in, arena, DType::kU8, s2, e8m0, DType::kI32).view;
        }
      };
      set(w.experts, {E}, m.moe_intermediate);
      if (m.shared_experts > 0 || moe_choice == 12) {
        set(w.shared_expert, {}, int64_t{std::max(m.shared_experts, 1)} * m.moe_intermediate);
      }
    }
    out.weights.layers.push_back(w);
  }
  // The dense layers (model.dense): q | k | v, no index part, the dense MLP; hostile edits
  // sometimes (an index tensor bound, a sparse layer's FFN, a missing or misshapen MLP part).
  std::vector<LayerWeights> dense_layers;
  for (int id = 0; model.dense && id < m.first_sparse_layer; ++id) {
    LayerWeights w = out.weights.layers.front();  // norms, o_proj, kv_cache as a sparse layer's
    w.layer = id;
    const int64_t DW = int64_t{sc.q_heads + 2 * sc.kv_heads} * sc.head_dim;
    const DType qkv_dtype = w.qkv_proj.dtype == DType::kFP8E4M3 ? DType::kFP8E4M3 : DType::kBF16;
    w.qkv_proj = make_tensor(in, arena, qkv_dtype, {DW, H}, reals(values, in_scale),
                             qkv_dtype == DType::kBF16 ? DType::kFP8E4M3 : DType::kBF16)
                     .view;
    if (qkv_dtype == DType::kFP8E4M3) {
      Content scales{[&](int64_t) { return 0.03125f; }, {}};
      w.qkv_proj_scale = make_tensor(in, arena, DType::kF32, {DW}, scales, DType::kBF16).view;
    } else {
      w.qkv_proj_scale = {};
    }
    const int hostile = in.ConsumeIntegralInRange<int>(0, 15);
    if (hostile != 15) w.index_q_norm = {};
    if (hostile != 14) w.index_k_norm = {};
    if (hostile != 13) w.index_cache = {};
    if (hostile != 12) w.mlp_gate_up = w.mlp_down = {};
    if (hostile != 11) {
      w.router_weight = w.router_bias = {};
      w.experts = w.shared_expert = {};
    }
    const DType wd = model.moe_fp8 ? DType::kFP8E4M3 : DType::kBF16;
    const DType alt = model.moe_fp8 ? DType::kBF16 : DType::kFP8E4M3;
    const int64_t D =
        hostile == 10 ? std::max(m.dense_intermediate, 8) + 32 : std::max(m.dense_intermediate, 8);
    const Content e8m0{{}, [](int64_t i) { return int64_t{118} + i % 8; }};
    if (hostile != 9) {
      w.dense_mlp.w13 =
          make_tensor(in, arena, wd, {2 * D, H}, reals(values, 4.0f * in_scale), alt).view;
    }
    w.dense_mlp.w2 = make_tensor(in, arena, wd, {H, D}, reals(values, 0.25f), alt).view;
    if (model.moe_fp8 || hostile == 8) {
      w.dense_mlp.w13_scale =
          make_tensor(in, arena, DType::kU8, {2 * D, H / kMxfp8Block}, e8m0, DType::kI32).view;
      if (hostile != 7) {
        w.dense_mlp.w2_scale =
            make_tensor(in, arena, DType::kU8, {H, std::max<int64_t>(D / kMxfp8Block, 1)}, e8m0,
                        DType::kI32)
                .view;
      }
    }
    dense_layers.push_back(w);
  }
  if (in.ConsumeIntegralInRange<int>(0, 15) == 15 && !dense_layers.empty()) {
    dense_layers.pop_back();  // a partial set of dense layers
  }
  out.weights.layers.insert(out.weights.layers.begin(), dense_layers.begin(), dense_layers.end());

  // Layer ids: missing, twice, out of order, a dense or out-of-range id.
  std::vector<LayerWeights>& layers = out.weights.layers;
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 11: std::reverse(layers.begin(), layers.end()); break;
    case 12: layers.pop_back(); break;
    case 13: layers.push_back(layers.front()); break;
    case 14: layers.back().layer = hostile_int(in, m.num_layers + 1); break;
    case 15:
      layers.push_back(layers.front());
      layers.back().layer = m.first_sparse_layer - 1;
      break;
    default: break;
  }
  out.clean = out.clean && !values.used_hostile;
  return out;
}

// ---- Steps ----

struct StepInput {
  BatchMeta batch;
  bool padded = false;  // begin_step(batch, pad) instead of begin_step(batch)
  int pad = 0;
};

int saturate(int64_t v) {
  return static_cast<int>(
      std::clamp<int64_t>(v, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
}

int64_t pick_length(FuzzedDataProvider& in, int64_t lo, int64_t hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 13: return 0;  // a padding request
    case 14: return hostile_int(in, static_cast<int>(std::min<int64_t>(hi, 1 << 20)));
    case 15: return in.ConsumeIntegralInRange<int64_t>(0, hi + 2);
    default: return in.ConsumeIntegralInRange<int64_t>(lo, std::max(lo, hi));
  }
}

StepInput make_step(FuzzedDataProvider& in, Arena& arena, const RuntimeConfig& c,
                    const Model& model, Rng& rng) {
  StepInput s;
  BatchMeta& b = s.batch;
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 14: b.kind = BatchKind::kPrefill; break;
    case 15: b.kind = static_cast<BatchKind>(hostile_int(in, 3)); break;
    default: b.kind = BatchKind::kDecode; break;
  }
  const int served_q = c.query_lens.empty()
                           ? 1
                           : c.query_lens[static_cast<std::size_t>(in.ConsumeIntegralInRange<int>(
                                 0, static_cast<int>(c.query_lens.size()) - 1))];
  b.q_len = pick_int(in, served_q, 1, 9);
  const int q = std::clamp(b.q_len, 1, kMaxQueryLen);
  const int fit = std::clamp(c.max_requests, 1, kMaxReqs);
  b.num_reqs = pick_int(in, in.ConsumeIntegralInRange<int>(1, std::max(1, std::min(fit, 16 / q))),
                        0, kMaxReqs + 1);
  const int n = std::clamp(b.num_reqs, 0, kMaxReqs);  // requests the data is built for
  const int bs = model.config.block_size;
  const int64_t pages = std::min(model.kv_pages, model.index_pages);
  const int64_t max_len = std::max<int64_t>(
      q,
      std::min<int64_t>(pages * bs / std::max(n, 1), std::clamp<int64_t>(c.max_context, 1, 4096)));

  std::vector<int64_t> lens(static_cast<std::size_t>(n));
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    lens[static_cast<std::size_t>(r)] = pick_length(in, q, max_len);
    longest = std::max(longest, lens[static_cast<std::size_t>(r)]);
  }
  int64_t cols =
      std::clamp<int64_t>((std::clamp<int64_t>(longest, 0, 1 << 20) + bs - 1) / bs, 1, kMaxColumns);
  if (in.ConsumeIntegralInRange<int>(0, 7) == 7)
    cols = in.ConsumeIntegralInRange<int64_t>(0, kMaxColumns);
  const bool cols_empty = cols == 0;
  cols = std::max<int64_t>(cols, 1);
  // Page tables: request r, block k -> a page; distinct while the pages last, then aliased; a
  // fuzz-chosen rate (out of 256) of hostile entries.
  const int bad_tables =
      in.ConsumeIntegralInRange<int>(0, 7) == 7 ? in.ConsumeIntegralInRange<int>(1, 64) : 0;
  const int bad_slots =
      in.ConsumeIntegralInRange<int>(0, 7) == 7 ? in.ConsumeIntegralInRange<int>(1, 64) : 0;
  const int64_t shift = in.ConsumeIntegralInRange<int64_t>(0, 31);
  auto page_of = [&](int64_t pool, int r, int64_t k, int64_t salt) -> int64_t {
    return (shift + salt + int64_t{r} * cols + k) % pool;
  };
  std::vector<int32_t> index_table(static_cast<std::size_t>(n * cols));
  std::vector<int32_t> kv_table(static_cast<std::size_t>(n * cols));
  for (int r = 0; r < n; ++r) {
    for (int64_t k = 0; k < cols; ++k) {
      const std::size_t at = static_cast<std::size_t>(r * cols + k);
      index_table[at] = static_cast<int32_t>(page_of(model.index_pages, r, k, 0));
      kv_table[at] = static_cast<int32_t>(page_of(model.kv_pages, r, k, 5));
      if (rng.below(256) < bad_tables) index_table[at] = static_cast<int32_t>(rng.next());
      if (rng.below(256) < bad_tables) {
        kv_table[at] = static_cast<int32_t>(rng.below(3)) - 1 +
                       static_cast<int32_t>(model.kv_pages) * static_cast<int32_t>(rng.below(2));
      }
    }
  }
  const int64_t rows = int64_t{n} * q;
  std::vector<int64_t> slots(static_cast<std::size_t>(rows), -1);
  std::vector<int64_t> index_slots(static_cast<std::size_t>(rows), -1);
  for (int r = 0; r < n; ++r) {
    const int64_t len = lens[static_cast<std::size_t>(r)];
    for (int j = 0; j < q; ++j) {
      const int64_t pos = len - q + j;
      const std::size_t row = static_cast<std::size_t>(r * q + j);
      if (len <= 0 || pos < 0 || pos / bs >= cols) continue;
      const std::size_t at = static_cast<std::size_t>(r * cols + pos / bs);
      slots[row] = int64_t{kv_table[at]} * bs + pos % bs;
      index_slots[row] = int64_t{index_table[at]} * bs + pos % bs;
      if (rng.below(256) < bad_slots)
        slots[row] = static_cast<int64_t>(rng.next() >> rng.below(64));
      if (rng.below(256) < bad_slots) {  // a repeated slot (or its own)
        index_slots[row] =
            index_slots[static_cast<std::size_t>(rng.below(static_cast<int64_t>(row) + 1))];
      }
    }
  }
  const int64_t reqs = b.num_reqs;
  const int64_t claimed_rows = int64_t{b.num_reqs} * b.q_len;
  auto at_or = [](const auto& vec, int64_t i, int64_t fallback) -> int64_t {
    return i >= 0 && i < static_cast<int64_t>(vec.size())
               ? static_cast<int64_t>(vec[static_cast<std::size_t>(i)])
               : fallback;
  };
  const Content seq_content{{}, [&](int64_t i) { return at_or(lens, i, 0); }};
  b.seq_lens = make_tensor(in, arena, DType::kI32, {reqs}, seq_content, DType::kI64).view;
  // Tables with (if asked) no columns, else the built ones (rows past n: -1).
  const int64_t table_cols = cols_empty ? 0 : cols;
  const Content index_content{{}, [&](int64_t i) { return at_or(index_table, i, -1); }};
  const Content kv_content{{}, [&](int64_t i) { return at_or(kv_table, i, -1); }};
  b.index_block_table =
      make_tensor(in, arena, DType::kI32, {reqs, table_cols}, index_content, DType::kI64).view;
  b.kv_block_table =
      make_tensor(in, arena, DType::kI32, {reqs, table_cols}, kv_content, DType::kI64).view;
  const Content slot_content{{}, [&](int64_t i) { return at_or(slots, i, -1); }};
  const Content index_slot_content{{}, [&](int64_t i) { return at_or(index_slots, i, -1); }};
  b.slot_mapping =
      make_tensor(in, arena, DType::kI64, {claimed_rows}, slot_content, DType::kI32).view;
  b.index_slot_mapping =
      make_tensor(in, arena, DType::kI64, {claimed_rows}, index_slot_content, DType::kI32).view;
  if (b.kind != BatchKind::kDecode || in.ConsumeIntegralInRange<int>(0, 15) == 15) {
    // Prefill fields (a decode batch ignores them).
    b.num_tokens = pick_int(in, static_cast<int>(rows), 0, 32);
    std::vector<int64_t> cu(static_cast<std::size_t>(n) + 1, 0);
    for (int r = 0; r < n; ++r)
      cu[static_cast<std::size_t>(r) + 1] = cu[static_cast<std::size_t>(r)] + q;
    const Content cu_content{{}, [&](int64_t i) { return at_or(cu, i, 0); }};
    b.cu_seqlens_q = make_tensor(in, arena, DType::kI32, {reqs + 1}, cu_content, DType::kI64).view;
    b.context_lens = make_tensor(in, arena, DType::kI32, {reqs}, seq_content, DType::kI64).view;
  }
  s.padded = true;
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 12: s.pad = b.num_reqs; break;
    case 13: s.pad = saturate(int64_t{b.num_reqs} + in.ConsumeIntegralInRange<int>(1, 4)); break;
    case 14: s.pad = saturate(int64_t{b.num_reqs} - 1); break;
    case 15: s.pad = hostile_int(in, 32); break;
    default: s.padded = false; break;
  }
  return s;
}

int64_t total_refusals(const RuntimeStats& s) {
  int64_t total = 0;
  for (int64_t r : s.refusals) total += r;
  return total;
}

M3MSA_FUZZ_NO_COVERAGE bool all_finite_bf16(const TensorView& v, int64_t count, float limit) {
  const uint16_t* p = static_cast<const uint16_t*>(v.data);
  for (int64_t i = 0; i < count; ++i) {
    const float x = bf16_to_float(p[i]);
    if (!std::isfinite(x) || std::fabs(x) > limit) return false;
  }
  return true;
}

}  // namespace
}  // namespace m3msa::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace m3msa;
  using namespace m3msa::fuzz;
  FuzzedDataProvider in(data, size);
  Arena arena;
  Values values{Rng{in.ConsumeIntegral<uint64_t>()}, in.ConsumeIntegralInRange<int>(0, 7) == 7};
  Rng rng{in.ConsumeIntegral<uint64_t>()};

  const Model model = make_model(in);
  const RuntimeConfig config = make_config(in, model);
  const Bound bound = make_weights(in, arena, values, model);
  StepContext context;
  context.capturing = in.ConsumeIntegralInRange<int>(0, 31) == 31;
  context.has_metadata = in.ConsumeIntegralInRange<int>(0, 31) != 31;

  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string& line) { FUZZ_CHECK(!line.empty(), "an empty log line"); });
  const ModelConfig& m = config.model;  // read only where prepare validated it
  // Every value the harness wrote is finite and small, every scale sane: outputs must be finite.
  const bool clean = !values.hostile && bound.clean;

  // ---- prepare ----
  PrepareResult first = PrepareResult::kSkipped;
  const bool prepared = accepts([&] { first = rt.prepare(bound.weights, config, *comm, context); });
  RuntimeStats stats = rt.stats();
  if (!prepared) {
    FUZZ_CHECK(rt.state() == RuntimeState::kIdle, "a failed prepare left the runtime %s",
               runtime_state_name(rt.state()));
    FUZZ_CHECK(stats.bound_layers.empty());
  } else {
    switch (first) {
      case PrepareResult::kActive: {
        FUZZ_CHECK(rt.state() == RuntimeState::kActive);
        FUZZ_CHECK(stats.backend == "cpu" && stats.tp_size == 1 && rt.device() == Device::cpu(),
                   "active on backend %s, device %s, tp %d", stats.backend.c_str(),
                   device_name(rt.device()).c_str(), stats.tp_size);
        std::vector<int> sparse;
        for (int l = m.first_sparse_layer; l < m.num_layers; ++l) sparse.push_back(l);
        std::vector<int> all = sparse;
        for (int l = m.first_sparse_layer - 1; l >= 0; --l) all.insert(all.begin(), l);
        FUZZ_CHECK(stats.bound_layers == sparse || stats.bound_layers == all,
                   "bound %zu layers, the model has %zu sparse and %d dense layers",
                   stats.bound_layers.size(), sparse.size(), m.first_sparse_layer);
        FUZZ_CHECK(stats.buckets == config.token_buckets);
        FUZZ_CHECK(stats.bucket_steps.size() == config.token_buckets.size());
        for (const LayerWeights& w : bound.weights.layers) {  // R6
          FUZZ_CHECK(w.kv_cache.pages() >= 0 && w.index_cache.pages() >= 0,
                     "layer %d: bound a cache of %lld / %lld pages", w.layer,
                     (long long)w.kv_cache.pages(), (long long)w.index_cache.pages());
        }
        break;
      }
      case PrepareResult::kFallback:
        FUZZ_CHECK(rt.state() == RuntimeState::kFallback);
        FUZZ_CHECK(!stats.fallback_reasons.empty(), "a fallback without a reason");
        for (const auto& [reason, count] : stats.fallback_reasons) {
          FUZZ_CHECK(!reason.empty() && count == 1);
        }
        break;
      case PrepareResult::kNotReady:
        FUZZ_CHECK(rt.state() == RuntimeState::kIdle && stats.prepare_not_ready == 1);
        break;
      case PrepareResult::kSkipped:
        FUZZ_CHECK(!context.has_metadata && rt.state() == RuntimeState::kIdle);
        FUZZ_CHECK(stats.prepare_calls == 0 && stats.prepare_skipped == 1);
        break;
    }
  }
  const bool active = prepared && first == PrepareResult::kActive;
  if (active) {
    // A second prepare of an active runtime returns at once.
    FUZZ_CHECK(rt.prepare(bound.weights, config, *comm, context) == PrepareResult::kActive);
  }

  // ---- steps ----
  int64_t work = 0;
  int64_t layers_ok = 0;
  int64_t steps_ok = 0;
  const void* fixed_seq_lens = nullptr;
  const int steps = in.ConsumeIntegralInRange<int>(1, 3);
  for (int step = 0; step < steps; ++step) {
    const StepInput s = make_step(in, arena, config, model, rng);
    const RuntimeStats before = rt.stats();
    bool open = false;
    const bool ok =
        accepts([&] { open = s.padded ? rt.begin_step(s.batch, s.pad) : rt.begin_step(s.batch); });
    const RuntimeStats after = rt.stats();
    if (!ok) {
      FUZZ_CHECK(total_refusals(after) == total_refusals(before),
                 "a throwing begin_step counted a refusal");
      FUZZ_CHECK(after.steps_accepted == before.steps_accepted);
    } else if (!open) {
      int grew = 0;
      for (int r = 0; r < kNumStepRefusals; ++r) {
        const int64_t d = after.refusals[static_cast<std::size_t>(r)] -
                          before.refusals[static_cast<std::size_t>(r)];
        FUZZ_CHECK(d == 0 || d == 1, "refusal counter %d moved by %lld", r, (long long)d);
        grew += static_cast<int>(d);
      }
      FUZZ_CHECK(grew == 1, "a refused step grew %d refusal counters", grew);
      FUZZ_CHECK(after.steps_accepted == before.steps_accepted);
      FUZZ_CHECK(!after.last_refusal.empty());
      if (!active)
        FUZZ_CHECK(after.refusal_count(StepRefusal::kNotActive) ==
                   before.refusal_count(StepRefusal::kNotActive) + 1);
    } else {
      FUZZ_CHECK(active, "an inactive runtime accepted a step");
      ++steps_ok;
      FUZZ_CHECK(total_refusals(after) == total_refusals(before));
      FUZZ_CHECK(after.steps_accepted == before.steps_accepted + 1);
      const BatchMeta& fixed = rt.step_metadata();
      const int pad = s.padded ? s.pad : s.batch.num_reqs;
      FUZZ_CHECK(s.batch.kind == BatchKind::kDecode && fixed.kind == BatchKind::kDecode);
      FUZZ_CHECK(fixed.num_reqs == pad && fixed.q_len == s.batch.q_len);
      FUZZ_CHECK(std::find(config.query_lens.begin(), config.query_lens.end(), s.batch.q_len) !=
                 config.query_lens.end());
      FUZZ_CHECK(s.batch.num_reqs <= config.max_requests && pad <= config.max_requests);
      FUZZ_CHECK(fixed.num_rows() >= 1 && fixed.num_rows() <= config.token_buckets.back());
      if (fixed_seq_lens == nullptr) fixed_seq_lens = fixed.seq_lens.data;
      FUZZ_CHECK(fixed.seq_lens.data == fixed_seq_lens, "the fixed metadata buffers moved");
      const int32_t* in_lens = s.batch.seq_lens.ptr<const int32_t>();
      const int32_t* lens = fixed.seq_lens.ptr<const int32_t>();
      const int64_t rows = int64_t{s.batch.num_reqs} * s.batch.q_len;
      for (int r = 0; r < pad; ++r) {
        FUZZ_CHECK(lens[r] == (r < s.batch.num_reqs ? in_lens[r] : 0), "seq_lens[%d] not copied",
                   r);
        FUZZ_CHECK(lens[r] <= config.max_context, "accepted a request longer than max_context");
      }
      for (int64_t row = 0; row < fixed.num_rows(); ++row) {
        const int64_t want = row < rows ? s.batch.slot_mapping.ptr<const int64_t>()[row] : -1;
        FUZZ_CHECK(fixed.slot_mapping.ptr<const int64_t>()[row] == want, "slot %lld not copied",
                   (long long)row);
        const int64_t want_index =
            row < rows ? s.batch.index_slot_mapping.ptr<const int64_t>()[row] : -1;
        FUZZ_CHECK(fixed.index_slot_mapping.ptr<const int64_t>()[row] == want_index);
      }
    }

    // forward_layer calls: the bound layers in order, or hostile ids.
    const ModelConfig& real = model.config;
    const int calls = in.ConsumeIntegralInRange<int>(0, 7) == 7
                          ? in.ConsumeIntegralInRange<int>(0, 4)
                          : real.num_layers - model.first_bound();
    const BatchMeta& fixed = rt.step_metadata();
    const int64_t rows = open ? fixed.num_rows() : in.ConsumeIntegralInRange<int64_t>(0, 4);
    const int64_t H = real.hidden;
    const Made hidden =
        make_tensor(in, arena, DType::kBF16, {rows, H}, reals(values, 2.0f), DType::kF32, 40);
    const Made residual =
        make_tensor(in, arena, DType::kBF16, {rows, H}, reals(values, 2.0f), DType::kF32, 40);
    const int q_len = open ? fixed.q_len : 1;
    const int bad_positions =
        in.ConsumeIntegralInRange<int>(0, 7) == 7 ? in.ConsumeIntegralInRange<int>(1, 64) : 0;
    const Content position_content{{}, [&](int64_t row) -> int64_t {
                                     if (rng.below(64) < bad_positions) {
                                       return static_cast<int64_t>(rng.next());
                                     }
                                     if (!open || row >= rows) return row;
                                     const int32_t len =
                                         fixed.seq_lens.ptr<const int32_t>()[row / q_len];
                                     return len <= 0 ? -1 : int64_t{len} - q_len + row % q_len;
                                   }};
    const Made positions =
        make_tensor(in, arena, DType::kI64, {rows}, position_content, DType::kI32, 40);
    for (int call = 0; call < calls; ++call) {
      int layer = model.first_bound() + call;
      if (in.ConsumeIntegralInRange<int>(0, 15) == 15) layer = hostile_int(in, real.num_layers + 1);
      TensorView h = hidden.view;
      TensorView res = residual.view;
      const TensorView pos = positions.view;
      bool exact = hidden.exact && residual.exact && positions.exact;
      switch (in.ConsumeIntegralInRange<int>(0, 15)) {
        case 15:
          res = h;
          exact = false;
          break;
        case 14: std::swap(h, res); break;
        default: break;
      }
      // The layer math of an accepted call, bounded per input.
      const SparseConfig sc = real.sparse(1);
      const int64_t cost =
          rows *
          (H * sc.qkv_width() + H * sc.q_heads * sc.head_dim +
           3 * H * std::max(real.intermediate, 1) +
           3 * H * int64_t{real.experts_per_token + real.shared_experts} * real.moe_intermediate +
           3 * H * int64_t{std::max(real.dense_intermediate, 8) + 32} +
           H * int64_t{real.num_experts} +
           int64_t{sc.q_heads} * sc.head_dim * model.kv_pages * real.block_size +
           int64_t{sc.index_heads} * sc.index_dim * model.index_pages * real.block_size);
      if (open && work + cost > kWorkBudget) break;
      work += cost;
      const bool finite_in = clean && exact && all_finite_bf16(h, rows * H, 1e4f) &&
                             all_finite_bf16(res, rows * H, 1e4f);
      const int64_t layers_before = rt.stats().layers_run;
      std::vector<uint16_t> saved;  // finding 7: a refused call must leave its inputs alone
      if (exact && h.data != nullptr && res.data != nullptr) {  // R7
        saved.assign(static_cast<const uint16_t*>(h.data),
                     static_cast<const uint16_t*>(h.data) + rows * H);
        saved.insert(saved.end(), static_cast<const uint16_t*>(res.data),
                     static_cast<const uint16_t*>(res.data) + rows * H);
      }
      std::string why;
      const bool ran = accepts([&] {
        try {
          rt.forward_layer(layer, h, res, pos);
        } catch (const Error& e) {
          why = e.message();
          throw;
        }
      });
      FUZZ_CHECK(rt.stats().layers_run == layers_before + (ran ? 1 : 0));
      if (!ran) {
        if (!saved.empty()) {
          FUZZ_CHECK(std::equal(saved.begin(), saved.begin() + rows * H,
                                static_cast<const uint16_t*>(h.data)) &&
                         std::equal(saved.begin() + rows * H, saved.end(),
                                    static_cast<const uint16_t*>(res.data)),
                     "a refused forward_layer changed hidden or residual (%s)", why.c_str());
        }
        continue;
      }
      ++layers_ok;
      FUZZ_CHECK(open, "forward_layer ran without an accepted step");
      const bool dense_layer = layer < m.first_sparse_layer;
      FUZZ_CHECK((layer >= m.first_sparse_layer || rt.stats().bound_layers.front() == 0) &&
                     layer >= 0 && layer < m.num_layers,
                 "ran layer %d", layer);
      FUZZ_CHECK(h.dtype == DType::kBF16 && res.dtype == DType::kBF16 && pos.dtype == DType::kI64);
      FUZZ_CHECK(h.ndim == 2 && h.shape[0] == rows && h.shape[1] == H && h.data != res.data);
      if (finite_in) {
        FUZZ_CHECK(all_finite_bf16(h, rows * H, std::numeric_limits<float>::max()),
                   "layer %d: hidden is not finite for finite, small inputs", layer);
        FUZZ_CHECK(all_finite_bf16(res, rows * H, std::numeric_limits<float>::max()),
                   "layer %d: residual is not finite for finite, small inputs", layer);
      }
      // The selection: -1 or a block the row can see (a dense layer selects nothing).
      if (dense_layer) continue;
      const Runtime::LayerTrace trace = rt.last_layer_trace();
      FUZZ_CHECK(trace.topk.ndim == 3 && trace.topk.shape[0] == rows);
      const int64_t per_row = trace.topk.shape[1] * trace.topk.shape[2];
      for (int64_t row = 0; row < rows; ++row) {
        const int32_t len = fixed.seq_lens.ptr<const int32_t>()[row / fixed.q_len];
        const int64_t nb =
            len <= 0 ? 0
                     : visible_blocks(int64_t{len} - fixed.q_len + row % fixed.q_len, m.block_size);
        for (int64_t i = 0; i < per_row; ++i) {
          const int32_t id = trace.topk.ptr<const int32_t>()[row * per_row + i];
          FUZZ_CHECK(id == -1 || (id >= 0 && id < nb), "row %lld selects block %d of %lld",
                     (long long)row, id, (long long)nb);
        }
      }
    }
  }

  // ---- detach / close, and a second prepare ----
  const int ending = in.ConsumeIntegralInRange<int>(0, 15);
  if (ending >= 8) {
    std::vector<LayerCaches> replacement;
    for (int i = 0; i < model.config.num_sparse_layers(); ++i) {
      LayerCaches c;
      c.layer = model.config.first_sparse_layer + i;
      if (ending >= 13) {
        const SparseConfig sc = model.config.sparse(1);
        const int64_t pages = in.PickValueInArray<int64_t>({0, 1, 0, 2});
        c.kv_cache.data = make_tensor(in, arena, DType::kBF16,
                                      {pages, sc.kv_heads, 2, sc.block_size, sc.head_dim},
                                      reals(values, 1.0f), DType::kFP8E4M3)
                              .view;
        c.index_cache.data =
            make_tensor(in, arena, DType::kBF16, {pages, sc.block_size, sc.index_dim},
                        reals(values, 1.0f), DType::kFP8E4M3)
                .view;
      }
      replacement.push_back(c);
    }
    const RuntimeState state_before = rt.state();
    if (accepts([&] { rt.detach(replacement); })) {
      FUZZ_CHECK(rt.state() ==
                 (state_before == RuntimeState::kActive ? RuntimeState::kClosed : state_before));
      FUZZ_CHECK(rt.stats().bound_layers.empty());
    } else {
      FUZZ_CHECK(rt.state() == state_before, "a refused detach changed the state");
    }
  }
  try {
    rt.close();
    rt.close();
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, "close threw on one rank: %s", e.what());
  }
  FUZZ_CHECK(rt.state() != RuntimeState::kActive && rt.stats().bound_layers.empty());
  if (prepared && (first == PrepareResult::kActive || first == PrepareResult::kFallback) &&
      in.ConsumeIntegralInRange<int>(0, 3) == 3) {
    PrepareResult second = PrepareResult::kSkipped;
    FUZZ_CHECK(accepts([&] { second = rt.prepare(bound.weights, config, *comm, context); }),
               "the same bindings prepared once and failed the second time");
    FUZZ_CHECK(second == first, "prepared %s, then %s", prepare_result_name(first),
               prepare_result_name(second));
    rt.close();
  }
  if (tracing()) {
    const RuntimeStats end = rt.stats();
    std::fprintf(stderr, "trace: work %lld prepare %s%s steps %lld layers %lld refusals",
                 (long long)work, prepared ? prepare_result_name(first) : "error",
                 bound.clean ? "" : " (hostile values)", (long long)steps_ok, (long long)layers_ok);
    for (int64_t r : end.refusals) std::fprintf(stderr, " %lld", (long long)r);
    std::fprintf(stderr, "\n");
  }
  return 0;
}
