// The communicator the runtime is built on: the host agreement (an all-gather of small byte
// records) and the TP reduce of a host float buffer (the CPU backend's all-reduce).
//
// Every collective is called by every rank of the group, in the same order, with the same tag
// (docs/runtime.md: "every rank runs the same layers with the same shapes in the same order"). The
// tag names the call site ("prepare/model", "layer 5 o_proj"); ranks that disagree on it are out of
// lockstep and every rank throws kInternal naming each rank's tag, instead of silently combining
// unrelated buffers. Every blocking wait is bounded: when a peer never arrives, the waiting ranks
// throw kTimeout naming the ranks that did not arrive, and the group is broken (a later
// collective on it throws at once), so no failure becomes a hang.
//
// Implementations:
//  - ThreadGroup: ranks as threads of one process (tests, the CPU demo).
//  - NcclCommunicator: ranks as threads or processes with one GPU each (builds with CUDA; the
//    factories throw kUnsupported otherwise). Records are plain bytes so they can travel through
//    any transport (a length all-gather then a padded byte all-gather).
//
// Determinism: all_reduce_sum adds the ranks' buffers in rank order 0..P-1 in fp32, so every rank
// gets bit-identical results, the same on every run.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace m3msa {

// A host wait longer than this means a peer is gone (or deadlocked); prepare and close are the
// only long collectives and they finish in milliseconds on a healthy group.
inline constexpr std::chrono::milliseconds kDefaultCommTimeout{30000};

using ByteRecord = std::vector<uint8_t>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "threads(rank 1 of 2)", for messages.
  virtual std::string name() const = 0;

  // Host agreement: every rank contributes one record (any length, may be empty) and receives
  // every rank's record, indexed by rank. Records are copied; `record` may be reused at return.
  virtual std::vector<ByteRecord> all_gather(const ByteRecord& record, std::string_view tag) = 0;

  // data[0..count) <- the sum over ranks of every rank's data[0..count), fp32, in rank order.
  // Every rank must pass the same count (kInvalidArgument on every rank naming each count).
  virtual void all_reduce_sum(float* data, std::size_t count, std::string_view tag) = 0;
};

// ---- Ranks as threads ----

// The state the ranks of one in-process group share. Create it once, hand one communicator() to
// each rank's thread. Thread-safe; each Communicator handle is driven by one thread.
class ThreadGroup : public std::enable_shared_from_this<ThreadGroup> {
 public:
  // world_size >= 1; timeout > 0 bounds every wait of every collective.
  static std::shared_ptr<ThreadGroup> create(
      int world_size, std::chrono::milliseconds timeout = kDefaultCommTimeout);
  ~ThreadGroup();
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  int world_size() const;
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);
  // Whether a collective failed (timeout or mismatch) and the ranks are out of lockstep; the
  // message says why. A broken group stays broken: build a new one.
  bool broken() const;
  std::string broken_reason() const;

  // The handle of rank `rank` in [0, world_size). Handles keep the group alive.
  std::unique_ptr<Communicator> communicator(int rank);

  struct State;  // defined in src/comm

 private:
  ThreadGroup(int world_size, std::chrono::milliseconds timeout);
  std::unique_ptr<State> state_;
};

// A communicator of one rank (TP = 1): all_gather returns the record, all_reduce does nothing.
std::unique_ptr<Communicator> make_single_rank_communicator();

// Runs body(comm) for every rank of `group`, one thread per rank, and joins them all. Returns each
// rank's exception (null where the rank returned normally), indexed by rank.
std::vector<std::exception_ptr> run_ranks(const std::shared_ptr<ThreadGroup>& group,
                                          const std::function<void(Communicator&)>& body);

// Runs body(i) for every i in [0, count), one thread each, joins them all, then rethrows the
// exception of the lowest i that threw (if any).
void run_threads(int count, const std::function<void(int)>& body);

// ---- Ranks over NCCL ----

// Communicator over NCCL (the transport of the CUDA CP indexer's NCCL transports, cp_cuda.h, and
// of the GPU runtime's collectives): all_gather of byte records (a length all-gather, then a padded
// byte all-gather, through persistent device buffers and pinned host staging) and all_reduce_sum,
// plus the raw ncclComm_t for device-side collectives. Every wait is bounded by `timeout`: the host
// never blocks in a CUDA call that waits for a collective (copies go to pinned memory and the
// stream is polled together with ncclCommGetAsyncError), and on expiry the communicator aborts
// its NCCL communicator (ncclCommAbort, itself bounded) and throws kTimeout; the communicator is
// then broken. The factories set NCCL_RUNTIME_CONNECT=0 (unless the environment sets it), so
// every NCCL connection is made inside ncclCommInit*: a later collective never blocks the host in
// a lazy connection to a peer that is not there. Destruction is bounded too: a destroy or abort
// that does not return within `timeout` is left behind (logged), never waited for.
class NcclCommunicator : public Communicator {
 public:
  ~NcclCommunicator() override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string name() const override;
  std::vector<ByteRecord> all_gather(const ByteRecord& record, std::string_view tag) override;
  void all_reduce_sum(float* data, std::size_t count, std::string_view tag) override;

  int device() const { return device_; }
  void* nccl_comm() const { return comm_; }  // ncclComm_t (null once aborted or abandoned)
  // Waits (bounded by timeout) for `stream` (a cudaStream_t), polling NCCL's async error; throws
  // kTimeout after aborting the communicator, kInternal on an NCCL error.
  void wait(void* stream, std::string_view what);
  // Throws kInternal (and marks the communicator broken) if NCCL reports an asynchronous error.
  void check_async_error(std::string_view what);
  // Aborts the NCCL communicator (bounded by timeout; ncclCommAbort unblocks the kernels of its
  // collectives still waiting for a peer) and marks the communicator broken.
  void abort(std::string_view why);
  // For survivors of a rank that died: marks the communicator broken and forgets the NCCL
  // communicator and its buffers without destroying them (ncclCommDestroy / ncclCommAbort may
  // wait for the dead rank); they stay allocated until the process exits.
  void abandon();
  bool broken() const { return broken_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  struct Impl;

 private:
  friend std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators_in_process(
      const std::vector<int>&, std::chrono::milliseconds);
  friend std::unique_ptr<NcclCommunicator> make_nccl_communicator_from_env(
      std::chrono::milliseconds);
  NcclCommunicator(void* comm, int rank, int world_size, int device,
                   std::chrono::milliseconds timeout);
  void* comm_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  int device_ = 0;
  std::chrono::milliseconds timeout_;
  bool broken_ = false;
  bool abandoned_ = false;
  std::unique_ptr<Impl> impl_;
};

// Ranks as threads of one process, one GPU each (ncclCommInitAll); element r is rank r, driven by
// one thread. devices.size() is the world size.
std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators_in_process(
    const std::vector<int>& devices, std::chrono::milliseconds timeout = kDefaultCommTimeout);

// Ranks as processes: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK, default RANK)
// from the environment; rank 0 serves the ncclUniqueId over TCP on MASTER_ADDR:MASTER_PORT, the
// others fetch it (bounded by timeout). The device is LOCAL_RANK % the visible device count.
std::unique_ptr<NcclCommunicator> make_nccl_communicator_from_env(
    std::chrono::milliseconds timeout = kDefaultCommTimeout);

// ---- Record helpers (the host agreement speaks bytes) ----

// A tiny append-only writer / bounds-checked reader for agreement records.
class RecordWriter {
 public:
  RecordWriter& u8(uint8_t value);
  RecordWriter& i64(int64_t value);
  RecordWriter& str(std::string_view value);
  ByteRecord take() { return std::move(bytes_); }

 private:
  ByteRecord bytes_;
};

class RecordReader {
 public:
  // `what` names the record in the kInternal error thrown on a truncated or malformed record.
  RecordReader(const ByteRecord& bytes, std::string what);
  uint8_t u8();
  int64_t i64();
  std::string str();
  bool done() const { return offset_ == bytes_->size(); }

 private:
  void need(std::size_t n);
  const ByteRecord* bytes_;
  std::string what_;
  std::size_t offset_ = 0;
};

}  // namespace m3msa
