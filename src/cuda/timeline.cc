// The timeline recorder (timeline.h): a device buffer of records, the thread's active recorder,
// and the summary of a recording.
#include "cuda/timeline.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

#include "cuda/common.cuh"
#include "m3msa/error.h"

namespace m3msa::cuda::timeline {

namespace {

thread_local Recorder* t_active = nullptr;

double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  const double lower = *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid));
  return 0.5 * (lower + upper);
}

}  // namespace

Recorder::Recorder(int64_t capacity) : capacity_(capacity) {
  M3MSA_CHECK_ARG(capacity >= 1, "timeline capacity must be >= 1 record, got ", capacity);
  const size_t bytes = static_cast<size_t>(capacity) * kWords * sizeof(uint64_t);
  CUDA_CHECK(cudaMalloc(&buffer_, bytes));
  CUDA_CHECK(cudaMemset(buffer_, 0, bytes));
}

Recorder::~Recorder() {
  if (t_active == this) t_active = nullptr;
  if (buffer_ != nullptr) cudaFree(buffer_);
}

uint64_t* Recorder::reserve(std::string kernel, std::vector<std::string> marks, int64_t units,
                            std::vector<std::string> kinds) {
  M3MSA_CHECK_ARG(!marks.empty() && marks.size() <= static_cast<size_t>(kMarks),
                  "timeline: kernel ", kernel, " names ", marks.size(), " marks, expected 1..",
                  kMarks);
  M3MSA_CHECK_ARG(!kinds.empty(), "timeline: kernel ", kernel, " names no record kind");
  if (units <= 0) return nullptr;
  if (units > capacity_ - used_) {
    ++dropped_;
    return nullptr;
  }
  Launch launch;
  launch.kernel = std::move(kernel);
  launch.marks = std::move(marks);
  launch.kinds = std::move(kinds);
  launch.units = units;
  launch.first = used_;
  launches_.push_back(std::move(launch));
  used_ += units;
  return static_cast<uint64_t*>(buffer_) + (used_ - units) * kWords;
}

std::vector<uint64_t> Recorder::read() const {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint64_t> out(static_cast<size_t>(used_) * kWords);
  if (!out.empty()) {
    CUDA_CHECK(
        cudaMemcpy(out.data(), buffer_, out.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  }
  return out;
}

Scope::Scope(Recorder& recorder) : previous_(t_active) {
  t_active = &recorder;
}
Scope::~Scope() {
  t_active = previous_;
}

uint64_t* records_for(const char* kernel, std::vector<std::string> marks, int64_t units,
                      std::vector<std::string> kinds) {
  if (t_active == nullptr) return nullptr;
  return t_active->reserve(kernel, std::move(marks), units, std::move(kinds));
}

const uint64_t* record_of(const Launch& l, int64_t u, const std::vector<uint64_t>& records) {
  const size_t at = static_cast<size_t>(l.first + u) * kWords;
  M3MSA_CHECK_ARG(at + kWords <= records.size(), "timeline: records hold ", records.size(),
                  " words, launch of ", l.kernel, " needs ", at + kWords);
  return records.data() + at;
}

uint64_t first_stamp(const std::vector<Launch>& launches, const std::vector<uint64_t>& records) {
  uint64_t t0 = std::numeric_limits<uint64_t>::max();
  for (const Launch& l : launches) {
    for (int64_t u = 0; u < l.units; ++u) {
      const uint64_t* r = record_of(l, u, records);
      for (int m = 0; m < kMarks; ++m) {
        if (r[m] != 0) t0 = std::min(t0, r[m]);
      }
    }
  }
  return t0 == std::numeric_limits<uint64_t>::max() ? 0 : t0;
}

double us_after(uint64_t t, uint64_t base) {
  return t >= base ? static_cast<double>(t - base) * 1e-3 : -static_cast<double>(base - t) * 1e-3;
}

std::vector<MarkTimes> summarize(const std::vector<Launch>& launches,
                                 const std::vector<uint64_t>& records) {
  const uint64_t t0 = first_stamp(launches, records);
  std::vector<MarkTimes> out;
  if (t0 == 0) return out;  // nothing was stamped
  for (size_t li = 0; li < launches.size(); ++li) {
    const Launch& l = launches[li];
    for (size_t kind = 0; kind < l.kinds.size(); ++kind) {
      int64_t units = 0;
      for (int64_t u = 0; u < l.units; ++u)
        units += (record_of(l, u, records)[kMarks] >> 32) == kind;
      if (units == 0) continue;
      for (size_t m = 0; m < l.marks.size(); ++m) {
        std::vector<double> at;
        std::vector<double> since_start;
        std::vector<double> stage;
        std::set<uint32_t> sms;
        for (int64_t u = 0; u < l.units; ++u) {
          const uint64_t* r = record_of(l, u, records);
          if ((r[kMarks] >> 32) != kind || r[m] == 0) continue;
          at.push_back(us_after(r[m], t0));
          if (r[0] != 0) since_start.push_back(us_after(r[m], r[0]));
          for (size_t prev = m; prev-- > 0;) {
            if (r[prev] != 0) {
              stage.push_back(us_after(r[m], r[prev]));
              break;
            }
          }
          sms.insert(static_cast<uint32_t>(r[kMarks]));
        }
        if (at.empty()) continue;
        MarkTimes t;
        t.launch = static_cast<int>(li);
        t.kernel = l.kernel;
        t.kind = l.kinds[kind];
        t.mark = l.marks[m];
        t.units = units;
        t.reached = static_cast<int64_t>(at.size());
        t.sms = static_cast<int>(sms.size());
        t.first_us = *std::min_element(at.begin(), at.end());
        t.last_us = *std::max_element(at.begin(), at.end());
        t.median_us = median_of(at);
        t.median_since_start_us = median_of(since_start);
        t.median_stage_us = median_of(stage);
        out.push_back(std::move(t));
      }
    }
  }
  return out;
}

}  // namespace m3msa::cuda::timeline
