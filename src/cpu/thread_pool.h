// A tiny fork-join parallel_for for the CPU reference. Work is split into contiguous index ranges,
// one per thread; every index is processed by exactly one call, so results never depend on the
// thread count as long as the body writes only what its own indices own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "m3msa/error.h"

namespace m3msa::cpu::detail {

// threads = 0 means every hardware thread; negative is a caller error.
inline int resolve_threads(int threads) {
  M3MSA_CHECK_ARG(threads >= 0, "threads must be >= 0 (0 = hardware concurrency), got ", threads);
  if (threads > 0) return threads;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

// Calls body(i) for every i in [0, n). The calling thread takes the first range itself, so a
// single-threaded call spawns nothing. The first exception thrown by any body is rethrown here
// after all threads have joined.
template <typename Body>
void parallel_for(int64_t n, int threads, const Body& body) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(resolve_threads(threads), n);
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto run_range = [&](int64_t worker) {
    const int64_t begin = n * worker / workers;
    const int64_t end = n * (worker + 1) / workers;
    try {
      for (int64_t i = begin; i < end; ++i) body(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (int64_t worker = 1; worker < workers; ++worker) pool.emplace_back(run_range, worker);
  run_range(0);
  for (std::thread& thread : pool) thread.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace m3msa::cpu::detail
