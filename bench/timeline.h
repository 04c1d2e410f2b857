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

// Runs `launch` (one call of the library, eager, on the stream the graph ran on) under a
// recorder; prints `title` and the stage table to stdout. The JSON: one object per row.
inline nlohmann::json record_timeline(const std::string& title,
                                      const std::function<void()>& launch) {
  cuda::timeline::Recorder recorder;
  {
    cuda::timeline::Scope scope(recorder);
    launch();
  }
  const std::vector<cuda::timeline::MarkTimes> rows =
      cuda::timeline::summarize(recorder.launches(), recorder.read());
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
