// Caches in the layouts engines use (cache.h KVLayout), filled from a cache of ours, for the tests
// and benchmarks that hold every layout to the packed layout's bits.
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/cache.h"
#include "m3msa/tensor.h"

namespace m3msa::testkit {

// The shape of a cache of `layout` (cache.h) holding pages x kv_heads x block_size x head_dim.
std::vector<int64_t> kv_layout_shape(KVLayout layout, int64_t pages, int64_t kv_heads,
                                     int64_t block_size, int64_t head_dim);

// Copies every K and V row of `from` into `to` (same logical shape and dtype, host views).
void copy_kv_cache(const KVCache& from, const KVCache& to);
void copy_index_cache(const IndexCache& from, const IndexCache& to);

// A host cache of `layout` holding the same K and V as the packed cache `ours`
// [pages, kv_heads, 2, block_size, head_dim]; bytes outside K and V (none in these layouts) are 0.
HostTensor relayout_kv_cache(const HostTensor& ours, KVLayout layout);

// A view of heads [first_head, first_head + kv_heads) of a packed cache `wide` that has more
// heads than that (the way a head shard of a wider cache is read in place).
TensorView kv_head_subview(const HostTensor& wide, int64_t first_head, int64_t kv_heads);

}  // namespace m3msa::testkit
