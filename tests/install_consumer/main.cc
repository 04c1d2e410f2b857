// Selects blocks for a small random batch through the installed library and checks the output is
// well formed: the own (forced) block first, then distinct visible blocks, then -1.
#include <cstdio>
#include <set>

#include "m3msa/backend.h"
#include "m3msa/synthetic.h"

int main() {
  m3msa::SyntheticSpec spec;
  spec.num_reqs = 2;
  spec.max_context = 3000;
  spec.make_kv_cache = false;
  const m3msa::SyntheticCase c = m3msa::make_synthetic_case(spec);
  m3msa::HostTensor topk(m3msa::DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  auto backend = m3msa::make_cpu_backend(1);
  backend->select_topk(c.config, c.indexer_args(topk.view()));
  const int32_t* idx = topk.ptr<int32_t>();
  for (int64_t row = 0; row < c.num_rows(); ++row) {
    const int64_t pos = c.positions.ptr<int64_t>()[row];
    const int64_t nb = pos / c.config.block_size + 1;
    for (int h = 0; h < c.config.index_heads; ++h) {
      const int32_t* sel = idx + (row * c.config.index_heads + h) * c.config.topk;
      if (sel[0] != nb - 1)
        return std::printf("row %lld: own block not first\n", (long long)row), 1;
      std::set<int32_t> seen;
      for (int i = 0; i < c.config.topk; ++i) {
        const bool valid = i < nb;
        if (valid != (sel[i] >= 0) || (valid && (sel[i] >= nb || !seen.insert(sel[i]).second))) {
          return std::printf("row %lld head %d: bad entry %d at %d\n", (long long)row, h, sel[i],
                             i),
                 1;
        }
      }
    }
  }
  std::printf("consumer ok: %s, %lld rows\n", backend->name().c_str(), (long long)c.num_rows());
  return 0;
}
