// A plain parallel loop for the kit's generators and oracles (results never depend on the split).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace m3msa::testkit {

// Calls body(begin, end) over [0, n) on up to `threads` threads (chunks of at least 64).
inline void parallel_for(int64_t n, int threads,
                         const std::function<void(int64_t, int64_t)>& body) {
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n / 64)));
  if (t <= 1) {
    if (n > 0) body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + t - 1) / t;
  for (int i = 0; i < t; ++i) {
    const int64_t b = i * chunk;
    const int64_t e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back([&, b, e] { body(b, e); });
  }
  for (auto& th : pool) th.join();
}

}  // namespace m3msa::testkit
