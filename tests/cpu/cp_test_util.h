// Shared pieces of the CP model tests: small configurations, random cases drawn to hit the corner
// contexts of the sharded selection, an exact selection comparison, and a watchdog so a hang in
// the exchange fails the suite instead of stalling it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "m3msa/config.h"
#include "m3msa/cp_model.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/synthetic.h"

namespace m3msa::cp_test {

// Tiny heads and dimensions: the protocol does not care about D, and small D lets thousands of
// cases with contexts of thousands of blocks run in seconds.
inline SparseConfig small_config(int topk, int init_blocks, int local_blocks, int block_size,
                                 int heads = 4) {
  SparseConfig config;
  config.q_heads = heads;
  config.kv_heads = heads;
  config.index_heads = heads;
  config.head_dim = 8;
  config.index_dim = 16;
  config.rope_dim = 0;
  config.block_size = block_size;
  config.topk = topk;
  config.init_blocks = init_blocks;
  config.local_blocks = local_blocks;
  return config;
}

// A context length (tokens) drawn to cover what sharding makes special: fewer blocks than ranks,
// exactly k and k + 1 blocks (where nominations start to be cut), one token, and a long tail up to
// a few thousand blocks.
inline int64_t draw_context(std::mt19937_64& rng, const SparseConfig& config, int world_size) {
  const int64_t bs = config.block_size;
  const int64_t k = config.topk;
  auto range = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  if (u < 0.08) return 1;
  if (u < 0.22) return range(1, std::max<int64_t>(1, world_size - 1) * bs);  // < P blocks
  if (u < 0.34) return range((k - 1) * bs + 1, k * bs);                      // exactly k blocks
  if (u < 0.42) return range(k * bs + 1, (k + 1) * bs);                      // k + 1 blocks
  // Log-uniform number of blocks in [1, 3000].
  const double blocks =
      std::exp(std::uniform_real_distribution<double>(0.0, std::log(3000.0))(rng));
  const int64_t nb = std::max<int64_t>(1, static_cast<int64_t>(blocks));
  return range((nb - 1) * bs + 1, nb * bs);
}

// A random decode (mostly) or prefill batch of at most max_rows rows, with padding requests and
// either index cache dtype.
inline SyntheticSpec draw_spec(std::mt19937_64& rng, const SparseConfig& config, int world_size,
                               int max_rows) {
  auto range = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  SyntheticSpec spec;
  spec.config = config;
  spec.make_kv_cache = false;
  spec.index_dtype = range(0, 1) ? DType::kFP8E4M3 : DType::kBF16;
  spec.seed = rng();
  if (range(0, 6) == 0) {
    spec.kind = BatchKind::kPrefill;
    spec.num_reqs = static_cast<int>(range(1, 3));
    int64_t rows_left = max_rows;
    for (int r = 0; r < spec.num_reqs; ++r) {
      const int64_t chunk = range(0, std::min<int64_t>(rows_left, 6));
      rows_left -= chunk;
      spec.chunk_lens.push_back(chunk);
      spec.context_lens.push_back(draw_context(rng, config, world_size) - 1);
    }
    return spec;
  }
  spec.kind = BatchKind::kDecode;
  spec.q_len = static_cast<int>(range(1, std::min(4, max_rows)));
  spec.num_reqs = static_cast<int>(range(range(0, 9) == 0 ? 0 : 1, max_rows / spec.q_len));
  for (int r = 0; r < spec.num_reqs; ++r) {
    const bool padding = range(0, 6) == 0;
    spec.seq_lens.push_back(
        padding ? 0 : std::max<int64_t>(draw_context(rng, config, world_size), spec.q_len));
  }
  return spec;
}

inline std::string describe_spec(const SyntheticSpec& spec) {
  std::ostringstream out;
  out << (spec.kind == BatchKind::kDecode ? "decode" : "prefill") << " reqs=" << spec.num_reqs
      << " q_len=" << spec.q_len << " index=" << dtype_name(spec.index_dtype)
      << " seed=" << spec.seed << " lens=[";
  const std::vector<int64_t>& lens =
      spec.kind == BatchKind::kDecode ? spec.seq_lens : spec.context_lens;
  for (std::size_t i = 0; i < lens.size(); ++i) out << (i ? "," : "") << lens[i];
  out << "] " << spec.config.to_string();
  return out.str();
}

// make_synthetic_case, with empty batches made valid: a zero-request batch leaves the per-request
// tensors unallocated, so their views must be given the right dtype and shape by hand.
inline SyntheticCase make_case(const SyntheticSpec& spec) {
  SyntheticCase c = make_synthetic_case(spec);
  if (c.batch.num_reqs == 0) {
    if (c.batch.kind == BatchKind::kDecode) {
      c.batch.seq_lens = TensorView::contiguous(nullptr, DType::kI32, {0});
    } else {
      c.batch.context_lens = TensorView::contiguous(nullptr, DType::kI32, {0});
    }
  }
  return c;
}

// The one-GPU answer: cpu::select_topk, [rows, H, k].
inline HostTensor reference_selection(const SyntheticCase& c) {
  HostTensor expected(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  cpu::select_topk(c.config, c.indexer_args(expected.view()), 1);
  return expected;
}

// Exact comparison of two [rows, H, k] selections, naming the first difference.
inline ::testing::AssertionResult same_selection(const HostTensor& expected,
                                                 const HostTensor& got) {
  if (expected.shape() != got.shape()) {
    return ::testing::AssertionFailure() << "shapes differ";
  }
  const int64_t heads = expected.shape()[1];
  const int64_t k = expected.shape()[2];
  const int32_t* want = expected.ptr<int32_t>();
  const int32_t* have = got.ptr<int32_t>();
  for (int64_t i = 0; i < expected.numel(); ++i) {
    if (want[i] == have[i]) continue;
    const int64_t row = i / (heads * k);
    const int64_t head = i / k % heads;
    std::ostringstream want_row, have_row;
    for (int64_t j = 0; j < k; ++j) {
      want_row << ' ' << want[(row * heads + head) * k + j];
      have_row << ' ' << have[(row * heads + head) * k + j];
    }
    return ::testing::AssertionFailure()
           << "row " << row << " head " << head << " entry " << i % k << ": expected ["
           << want_row.str() << " ], got [" << have_row.str() << " ]";
  }
  return ::testing::AssertionSuccess();
}

// Runs fn on its own thread; if it has not finished within `limit`, the exchange hung and the
// process aborts (a hung thread cannot be reclaimed, and a stalled suite hides the failure).
inline void run_bounded(std::chrono::milliseconds limit, const std::function<void()>& fn) {
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::exception_ptr error;
  std::thread worker([&] {
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    done.set_value();
  });
  if (finished.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "CP test: still running after %lld ms: the exchange hung\n",
                 static_cast<long long>(limit.count()));
    std::abort();
  }
  worker.join();
  if (error) std::rethrow_exception(error);
}

// Runs body(rank) on one thread per listed rank and joins them all.
inline void on_ranks(const std::vector<int>& ranks, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int rank : ranks) threads.emplace_back(body, rank);
  for (std::thread& thread : threads) thread.join();
}

inline std::vector<int> all_ranks(int world_size) {
  std::vector<int> ranks(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) ranks[static_cast<std::size_t>(r)] = r;
  return ranks;
}

}  // namespace m3msa::cp_test
