// fuzz_config: bytes -> SparseConfig / ModelConfig fields (and a tensor-parallel size) ->
// validate(). Contract: accept, or throw m3msa::Error naming the field; never crash, never UB.
// An accepted config must be internally consistent (the invariants below are what kernels and
// the CPU reference rely on without re-checking).
#include <cmath>
#include <cstdint>

#include "fuzz_common.h"
#include "m3msa/config.h"

namespace m3msa::fuzz {
namespace {

void fill(FuzzedDataProvider& in, SparseConfig& c) {
  c.q_heads = hostile_int(in);
  c.kv_heads = hostile_int(in, 16);
  c.head_dim = hostile_int(in, 256);
  c.index_heads = in.ConsumeBool() ? c.kv_heads : hostile_int(in, 16);
  c.index_dim = hostile_int(in, 256);
  c.block_size = hostile_int(in, 256);
  c.topk = hostile_int(in, 2048);
  c.init_blocks = hostile_int(in, 8);
  c.local_blocks = hostile_int(in, 8);
  c.rope_dim = hostile_int(in, 256);
  c.rope_theta = hostile_double(in);
  c.rms_eps = hostile_float(in);
}

void check_accepted(const SparseConfig& c) {
  FUZZ_CHECK(c.q_heads > 0 && c.kv_heads > 0 && c.q_heads % c.kv_heads == 0);
  FUZZ_CHECK(c.group_size() * c.kv_heads == c.q_heads);
  // Equal, or a multiple in the view of a context-parallel rank (config.h).
  FUZZ_CHECK(c.index_heads >= c.kv_heads && c.index_heads % c.kv_heads == 0);
  FUZZ_CHECK(c.head_dim > 0 && c.index_dim > 0 && c.block_size > 0);
  FUZZ_CHECK(c.topk > 0 && c.init_blocks >= 0 && c.local_blocks >= 0);
  FUZZ_CHECK(int64_t{c.init_blocks} + c.local_blocks <= c.topk);
  FUZZ_CHECK(c.rope_dim >= 0 && c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim &&
             c.rope_dim <= c.index_dim);
  FUZZ_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 0, "rope_theta %g", c.rope_theta);
  FUZZ_CHECK(std::isfinite(c.rms_eps) && c.rms_eps > 0, "rms_eps %g",
             static_cast<double>(c.rms_eps));
  const float scale = c.softmax_scale();
  FUZZ_CHECK(std::isfinite(scale) && scale > 0);
  FUZZ_CHECK(c.qkv_width() > 0);
  FUZZ_CHECK(!c.to_string().empty());
}

}  // namespace
}  // namespace m3msa::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace m3msa;
  using namespace m3msa::fuzz;
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    SparseConfig c;
    fill(in, c);
    if (accepts([&] { c.validate(); })) check_accepted(c);
    return 0;
  }
  ModelConfig m;
  m.hidden = hostile_int(in, 8192);
  m.num_layers = hostile_int(in, 64);
  m.first_sparse_layer = hostile_int(in, 8);
  m.q_heads = hostile_int(in);
  m.kv_heads = hostile_int(in, 16);
  m.head_dim = hostile_int(in, 256);
  m.index_heads = in.ConsumeBool() ? m.kv_heads : hostile_int(in, 16);
  m.index_dim = hostile_int(in, 256);
  m.block_size = hostile_int(in, 256);
  m.topk = hostile_int(in, 2048);
  m.init_blocks = hostile_int(in, 8);
  m.local_blocks = hostile_int(in, 8);
  m.rope_dim = hostile_int(in, 256);
  m.rope_theta = hostile_double(in);
  m.rms_eps = hostile_float(in);
  m.intermediate = hostile_int(in, 1 << 16);
  m.num_experts = hostile_int(in, 256);
  m.experts_per_token = hostile_int(in, 16);
  m.moe_intermediate = hostile_int(in, 1 << 16);
  m.shared_experts = hostile_int(in, 4);
  m.dense_intermediate = hostile_int(in, 1 << 16);
  m.routed_scaling = hostile_float(in);
  m.activation_limit = hostile_float(in);
  const int tp_size = hostile_int(in, 16);
  if (accepts([&] { m.validate(); })) {
    FUZZ_CHECK(m.num_layers > 0 && m.first_sparse_layer >= 0 &&
               m.first_sparse_layer < m.num_layers);
    FUZZ_CHECK(m.num_sparse_layers() > 0 && m.hidden > 0 && m.intermediate >= 0);
    FUZZ_CHECK(m.index_heads == m.kv_heads);
    check_accepted(m.sparse(1));
  }
  // The MoE split (docs/spec.md section 8): an error, or a rank view that validates whenever the
  // whole model does, with the intermediates split evenly.
  MoeConfig moe;
  if (accepts([&] { moe = m.moe(tp_size); }) && accepts([&] { m.validate(); })) {
    FUZZ_CHECK(accepts([&] { moe.validate(); }), "tp %d MoE split of a valid model is invalid: %s",
               tp_size, moe.to_string().c_str());
    FUZZ_CHECK(int64_t{moe.intermediate} * tp_size == m.moe_intermediate);
    FUZZ_CHECK(moe.shared_intermediate == m.shared_experts * moe.intermediate);
  }
  // Splitting for tensor parallelism: either an error, or a per-rank config that validates
  // whenever the whole model does, with the head counts split as docs/spec.md section 1 says.
  SparseConfig rank;
  if (accepts([&] { rank = m.sparse(tp_size); })) {
    bool model_ok = accepts([&] { m.validate(); });
    bool rank_ok = accepts([&] { rank.validate(); });
    if (model_ok) {
      FUZZ_CHECK(rank_ok, "tp %d split of a valid model is invalid: %s", tp_size,
                 rank.to_string().c_str());
      FUZZ_CHECK(rank.q_heads * tp_size == m.q_heads);
      FUZZ_CHECK(tp_size <= m.kv_heads ? rank.kv_heads * tp_size == m.kv_heads
                                       : rank.kv_heads == 1);
      // The CP view keeps every index head on every rank and stays valid.
      const SparseConfig cp_rank = m.sparse(tp_size, true);
      FUZZ_CHECK(accepts([&] { cp_rank.validate(); }), "CP view of a valid model is invalid: %s",
                 cp_rank.to_string().c_str());
      FUZZ_CHECK(cp_rank.index_heads == m.index_heads && cp_rank.kv_heads == rank.kv_heads);
    }
  }
  return 0;
}
