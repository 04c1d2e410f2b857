// `--timeline` of the benchmarks: one more launch of a configuration with its kernels' stage
// stamps recorded (cuda/timeline.h), printed as a table and returned as JSON for the
// configuration's record. The recorded launch follows a replay of the timed graph and uses the
// input set the replay touched longest ago, so its inputs are as cold as the timed launches'.
// Times are microseconds after the earliest start of any recorded CTA (or work item); they show
// where a latency chain spends its time (the first loads, an arrival, one CTA's merge), which a
// median of whole launches cannot.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/timeline.h"
#include "harness.h"

namespace m3msa::bench {

// Every record of `launches` as {launch, sm, kind, marks: [us after the first start | null]}.
inline nlohmann::json timeline_records(const std::vector<cuda::timeline::Launch>& launches,
                                       const std::vector<uint64_t>& raw) {
  using cuda::timeline::kMarks;
  const uint64_t t0 = cuda::timeline::first_stamp(launches, raw);
  nlohmann::json out = nlohmann::json::array();
  for (size_t li = 0; li < launches.size(); ++li) {
    const cuda::timeline::Launch& l = launches[li];
    for (int64_t u = 0; u < l.units; ++u) {
      const uint64_t* r = cuda::timeline::record_of(l, u, raw);
      nlohmann::json marks = nlohmann::json::array();
      for (size_t m = 0; m < l.marks.size() && m < static_cast<size_t>(kMarks); ++m) {
        if (r[m] == 0) {
          marks.push_back(nullptr);
        } else {
          marks.push_back(cuda::timeline::us_after(r[m], t0));
        }
      }
      const size_t kind = static_cast<size_t>(r[kMarks] >> 32);
      out.push_back({{"launch", li},
                     {"sm", static_cast<uint32_t>(r[kMarks])},
                     {"kind", kind < l.kinds.size() ? l.kinds[kind] : std::to_string(kind)},
                     {"marks", std::move(marks)}});
    }
  }
  return out;
}

// Runs `launch` (one call of the library, eager, on the stream the graph ran on) under a
// recorder; prints `title` and the stage table to stdout. The JSON: one object per row. With
// `records` (a bench's `--timeline-records`), every record too: its launch, SM, kind and the
// microseconds of each mark after the first recorded start (null where not reached), so a stage's
// spread can be laid against where the CTAs ran.
inline nlohmann::json record_timeline(const std::string& title, const std::function<void()>& launch,
                                      nlohmann::json* records = nullptr) {
  cuda::timeline::Recorder recorder;
  {
    cuda::timeline::Scope scope(recorder);
    launch();
  }
  const std::vector<uint64_t> raw = recorder.read();
  const std::vector<cuda::timeline::MarkTimes> rows =
      cuda::timeline::summarize(recorder.launches(), raw);
  if (records != nullptr) *records = timeline_records(recorder.launches(), raw);
  std::printf("timeline: %s (us after the first recorded start)\n", title.c_str());
  if (recorder.launches().empty()) {
    std::printf("  (no recorded kernel: this configuration launches none that stamps)\n");
  }
  Table table({"kernel", "kind", "mark", "reached", "SMs", "first", "median", "last",
               "median since own start", "median stage"});
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : rows) {
    nlohmann::json rec = {{"launch", r.launch},
                          {"kernel", r.kernel},
                          {"kind", r.kind},
                          {"mark", r.mark},
                          {"units", r.units},
                          {"reached", r.reached},
                          {"sms", r.sms},
                          {"first_us", r.first_us},
                          {"median_us", r.median_us},
                          {"last_us", r.last_us},
                          {"median_since_start_us", r.median_since_start_us},
                          {"median_stage_us", r.median_stage_us}};
    table.add(
        {r.kernel, r.kind, r.mark, fmt::format("{}/{}", r.reached, r.units),
         fmt::format("{}", r.sms), fmt::format("{:.2f}", r.first_us),
         fmt::format("{:.2f}", r.median_us), fmt::format("{:.2f}", r.last_us),
         fmt::format("{:.2f}", r.median_since_start_us), fmt::format("{:.2f}", r.median_stage_us)},
        rec);
    out.push_back(std::move(rec));
  }
  if (!rows.empty()) table.print();
  if (recorder.dropped() > 0) {
    std::printf("  (%d launches not recorded: more records than the recorder holds)\n",
                recorder.dropped());
  }
  return out;
}

}  // namespace m3msa::bench
