// Stage timestamps of the decode kernels, for latency studies (`m3msa bench ... --timeline`).
//
// A kernel of one dependent chain (the attention at one request, the split indexer, the persistent
// MoE) spends its time in a few stages: loads that wait on loads, an arrival, one CTA's merge. A
// Recorder makes the launches of the thread that activates it (Scope) stamp each stage with
// %globaltimer: one record per CTA (or per work item of a persistent kernel), kMarks stamps and a
// tag (the SM, and the record's kind, e.g. the CTA that merged). Without an active Recorder the
// launchers pass a null pointer and every mark is skipped on one uniform branch (timeline.cuh).
// summarize() turns the records into when each stage ended, relative to the first record's start.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace m3msa::cuda::timeline {

inline constexpr int kMarks = 7;           // stamps per record (ns; 0: the mark was not reached)
inline constexpr int kWords = kMarks + 1;  // + the tag: SM id (low 32 bits), kind (high 32 bits)

// One recorded launch: its records' place in the buffer and what their marks and kinds mean.
struct Launch {
  std::string kernel;              // e.g. "attention"
  std::vector<std::string> marks;  // names of marks 0 .. marks.size() - 1 (mark 0: the start)
  std::vector<std::string> kinds;  // names of the record kinds (tag's high word); at least one
  int64_t units = 0;               // records: CTAs (grid order), or work items
  int64_t first = 0;               // index of the first record in the buffer
};

class Recorder {
 public:
  // A zeroed device buffer of `capacity` records (kWords u64 each) on the current device.
  explicit Recorder(int64_t capacity = int64_t{1} << 16);
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // The records of one launch of `units` records, or null when they do not fit (the launch runs
  // unrecorded; dropped() counts it).
  uint64_t* reserve(std::string kernel, std::vector<std::string> marks, int64_t units,
                    std::vector<std::string> kinds = {"cta"});
  const std::vector<Launch>& launches() const { return launches_; }
  int dropped() const { return dropped_; }
  // Every reserved record, after the device has finished (synchronizes it).
  std::vector<uint64_t> read() const;

 private:
  void* buffer_ = nullptr;
  int64_t capacity_ = 0;
  int64_t used_ = 0;
  int dropped_ = 0;
  std::vector<Launch> launches_;
};

// Launches of this host thread are recorded into `recorder` while the Scope lives (scopes nest;
// the innermost wins). A launch captured into a CUDA graph under a Scope keeps its records: every
// replay stamps the same ones (the last replay's stamps remain), so the recorder must outlive the
// graph.
class Scope {
 public:
  explicit Scope(Recorder& recorder);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Recorder* previous_;
};

// A kernel's list of mark or kind names (kAttentionMarks, ...) as records_for takes it.
template <std::size_t N>
std::vector<std::string> names(const char* const (&list)[N]) {
  return std::vector<std::string>(list, list + N);
}

// The active recorder's records for one launch, or null (no recorder, or no room): what a
// launcher stores in its params' timeline pointer.
uint64_t* records_for(const char* kernel, std::vector<std::string> marks, int64_t units,
                      std::vector<std::string> kinds = {"cta"});

// One (launch, kind, mark) of a recording: when the records of that kind reached the mark,
// in microseconds after t0 (the earliest start of any record of the recording).
struct MarkTimes {
  int launch = 0;
  std::string kernel;
  std::string kind;
  std::string mark;
  int64_t units = 0;    // records of this kind
  int64_t reached = 0;  // of them, records that stamped this mark
  int sms = 0;          // distinct SMs among them
  double first_us = 0;
  double median_us = 0;
  double last_us = 0;
  double median_since_start_us = 0;  // median over records of (this mark - the record's start)
  // Median over records of (this mark - the record's latest earlier stamped mark): how long the
  // stage that ends here took within a record (0 for the first mark).
  double median_stage_us = 0;
};

// Record `u` of launch `l` in `records` (as Recorder::read returns them), checked against their
// size.
const uint64_t* record_of(const Launch& l, int64_t u, const std::vector<uint64_t>& records);
// The earliest stamp of any record of `launches` (the t0 of summarize), 0 where none was stamped.
uint64_t first_stamp(const std::vector<Launch>& launches, const std::vector<uint64_t>& records);
// Microseconds from `base` to `t` (negative where `t` is earlier).
double us_after(uint64_t t, uint64_t base);

// Per launch, per kind present, per mark that some record reached, in that order. `records` as
// Recorder::read returns them.
std::vector<MarkTimes> summarize(const std::vector<Launch>& launches,
                                 const std::vector<uint64_t>& records);

}  // namespace m3msa::cuda::timeline
