// Ranks as threads: every collective is two bounded rounds over one shared mailbox.
//
//  round 1 (arrival):   each rank posts a pointer to its input; the last rank to arrive completes
//                       the round and wakes the others; everyone reads every rank's input.
//  round 2 (departure): each rank posts that it has finished reading; only then may a rank reuse
//                       or overwrite its input (all_reduce writes its result into it).
//
// A round's posts are snapshotted when it completes, so a fast rank can start posting the next
// round while slow ranks still read the snapshot: the next round cannot complete (and overwrite
// the snapshot) before every slow rank has posted into it. Tags are fixed-size arrays so the step
// path (the TP reduce of forward_layer) does not allocate once the reduce scratch has grown.
#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "m3msa/comm.h"
#include "m3msa/error.h"

namespace m3msa {

namespace {

constexpr std::size_t kTagCapacity = 64;

struct Post {
  const void* data = nullptr;
  std::size_t bytes = 0;
  std::array<char, kTagCapacity> tag{};
};

Post make_post(const void* data, std::size_t bytes, std::string_view tag) {
  Post post;
  post.data = data;
  post.bytes = bytes;
  const std::size_t n = std::min(tag.size(), kTagCapacity - 1);
  std::memcpy(post.tag.data(), tag.data(), n);
  post.tag[n] = '\0';
  return post;
}

std::string_view tag_of(const Post& post) {
  return std::string_view(post.tag.data());
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (std::size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

}  // namespace

struct ThreadGroup::State {
  int world_size = 1;
  mutable std::mutex mutex;
  std::condition_variable cv;
  std::chrono::milliseconds timeout{kDefaultCommTimeout};
  uint64_t completed_rounds = 0;
  int arrived = 0;
  std::vector<Post> pending;    // this round's posts, by rank
  std::vector<char> posted;     // whether rank r posted into this round
  std::vector<Post> completed;  // snapshot of the last completed round
  bool broken = false;
  ErrorCode broken_code = ErrorCode::kInternal;
  std::string broken_reason;

  // Marks the group broken (first reason wins) and wakes every waiter. Caller holds the mutex.
  void break_group(ErrorCode code, const std::string& reason) {
    if (!broken) {
      broken = true;
      broken_code = code;
      broken_reason = reason;
    }
    cv.notify_all();
  }

  [[noreturn]] void throw_broken(int rank) const {
    throw Error(broken_code, "the group is broken (ranks out of lockstep): " + broken_reason,
                __FILE__, __LINE__, rank);
  }

  // One bounded round. Returns the snapshot of the completed round (valid until this rank posts
  // into the next one).
  const std::vector<Post>& round(int rank, const Post& post, std::string_view what) {
    std::unique_lock<std::mutex> lock(mutex);
    if (broken) throw_broken(rank);
    if (posted[rank]) {
      break_group(ErrorCode::kInternal, "rank " + std::to_string(rank) +
                                            " posted twice into one "
                                            "round (two threads driving one rank?)");
      throw_broken(rank);
    }
    const uint64_t my_round = completed_rounds;
    pending[rank] = post;
    posted[rank] = 1;
    if (++arrived == world_size) {
      completed = pending;  // sized once: no allocation
      std::fill(posted.begin(), posted.end(), 0);
      arrived = 0;
      ++completed_rounds;
      cv.notify_all();
      return completed;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const bool done =
        cv.wait_until(lock, deadline, [&] { return completed_rounds > my_round || broken; });
    if (completed_rounds > my_round) return completed;
    if (!done) {
      std::vector<int> missing;
      for (int r = 0; r < world_size; ++r) {
        if (!posted[r]) missing.push_back(r);
      }
      std::ostringstream message;
      message << what << " '" << tag_of(post) << "': rank " << rank << " timed out after "
              << timeout.count() << " ms: rank" << (missing.size() == 1 ? " " : "s ")
              << rank_list(missing) << " did not arrive ("
              << world_size - static_cast<int>(missing.size()) << " of " << world_size
              << " ranks arrived)";
      break_group(ErrorCode::kTimeout, message.str());
      throw Error(ErrorCode::kTimeout, message.str(), __FILE__, __LINE__, rank);
    }
    throw_broken(rank);
  }

  // Every rank sees the same snapshot, so every rank detects a mismatch and throws.
  void check_tags(int rank, const std::vector<Post>& posts, std::string_view what) {
    bool same = true;
    for (const Post& p : posts) same = same && tag_of(p) == tag_of(posts[0]);
    if (same) return;
    std::ostringstream message;
    message << what << ": ranks called different collectives (out of lockstep):";
    for (int r = 0; r < world_size; ++r)
      message << " rank " << r << " '" << tag_of(posts[r]) << "'";
    {
      std::lock_guard<std::mutex> lock(mutex);
      break_group(ErrorCode::kInternal, message.str());
    }
    throw Error(ErrorCode::kInternal, message.str(), __FILE__, __LINE__, rank);
  }
};

namespace {

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, ThreadGroup::State* state, int rank)
      : group_(std::move(group)), state_(state), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return state_->world_size; }
  std::string name() const override {
    return "threads(rank " + std::to_string(rank_) + " of " + std::to_string(state_->world_size) +
           ")";
  }

  std::vector<ByteRecord> all_gather(const ByteRecord& record, std::string_view tag) override {
    const std::vector<Post>& posts =
        state_->round(rank_, make_post(record.data(), record.size(), tag), "all_gather");
    state_->check_tags(rank_, posts, "all_gather");
    std::vector<ByteRecord> out(posts.size());
    for (std::size_t r = 0; r < posts.size(); ++r) {
      const auto* bytes = static_cast<const uint8_t*>(posts[r].data);
      out[r].assign(bytes, bytes + posts[r].bytes);
    }
    state_->round(rank_, make_post(nullptr, 0, tag), "all_gather (departure)");
    return out;
  }

  void all_reduce_sum(float* data, std::size_t count, std::string_view tag) override {
    if (state_->world_size == 1) return;
    M3MSA_CHECK_ARG(data != nullptr || count == 0, "all_reduce_sum '", tag, "': null data");
    const std::vector<Post>& posts =
        state_->round(rank_, make_post(data, count * sizeof(float), tag), "all_reduce_sum");
    state_->check_tags(rank_, posts, "all_reduce_sum");
    bool same = true;
    for (const Post& p : posts) same = same && p.bytes == posts[0].bytes;
    if (!same) {
      std::ostringstream message;
      message << "all_reduce_sum '" << tag << "': ranks passed different element counts:";
      for (std::size_t r = 0; r < posts.size(); ++r) {
        message << " rank " << r << " " << posts[r].bytes / sizeof(float);
      }
      {
        std::lock_guard<std::mutex> lock(state_->mutex);
        state_->break_group(ErrorCode::kInvalidArgument, message.str());
      }
      throw Error(ErrorCode::kInvalidArgument, message.str(), __FILE__, __LINE__, rank_);
    }
    if (scratch_.size() < count) scratch_.resize(count);
    const auto* first = static_cast<const float*>(posts[0].data);
    std::copy(first, first + count, scratch_.begin());
    for (std::size_t r = 1; r < posts.size(); ++r) {
      const auto* src = static_cast<const float*>(posts[r].data);
      for (std::size_t i = 0; i < count; ++i) scratch_[i] += src[i];
    }
    // Peers may still be reading `data`: overwrite it only after everyone has left round 1.
    state_->round(rank_, make_post(nullptr, 0, tag), "all_reduce_sum (departure)");
    std::copy(scratch_.begin(), scratch_.begin() + static_cast<std::ptrdiff_t>(count), data);
  }

 private:
  std::shared_ptr<ThreadGroup> group_;  // keeps state_ alive
  ThreadGroup::State* state_;
  int rank_;
  std::vector<float> scratch_;  // grows to the largest reduce once, then reused
};

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "single rank"; }
  std::vector<ByteRecord> all_gather(const ByteRecord& record, std::string_view) override {
    return {record};
  }
  void all_reduce_sum(float*, std::size_t, std::string_view) override {}
};

}  // namespace

ThreadGroup::ThreadGroup(int world_size, std::chrono::milliseconds timeout)
    : state_(std::make_unique<State>()) {
  state_->world_size = world_size;
  state_->timeout = timeout;
  state_->pending.resize(static_cast<std::size_t>(world_size));
  state_->posted.assign(static_cast<std::size_t>(world_size), 0);
  state_->completed.resize(static_cast<std::size_t>(world_size));
}

ThreadGroup::~ThreadGroup() = default;

std::shared_ptr<ThreadGroup> ThreadGroup::create(int world_size,
                                                 std::chrono::milliseconds timeout) {
  M3MSA_CHECK_ARG(world_size >= 1, "ThreadGroup: world_size must be >= 1, got ", world_size);
  M3MSA_CHECK_ARG(timeout.count() > 0, "ThreadGroup: timeout must be > 0 ms, got ",
                  timeout.count());
  return std::shared_ptr<ThreadGroup>(new ThreadGroup(world_size, timeout));
}

int ThreadGroup::world_size() const {
  return state_->world_size;
}

std::chrono::milliseconds ThreadGroup::timeout() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->timeout;
}

void ThreadGroup::set_timeout(std::chrono::milliseconds timeout) {
  M3MSA_CHECK_ARG(timeout.count() > 0, "ThreadGroup: timeout must be > 0 ms, got ",
                  timeout.count());
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->timeout = timeout;
}

bool ThreadGroup::broken() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->broken;
}

std::string ThreadGroup::broken_reason() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->broken_reason;
}

std::unique_ptr<Communicator> ThreadGroup::communicator(int rank) {
  M3MSA_CHECK_ARG(rank >= 0 && rank < state_->world_size, "ThreadGroup: rank must be in [0, ",
                  state_->world_size, "), got ", rank);
  return std::make_unique<ThreadCommunicator>(shared_from_this(), state_.get(), rank);
}

std::unique_ptr<Communicator> make_single_rank_communicator() {
  return std::make_unique<SingleRankCommunicator>();
}

namespace {

// body(i) on one thread per i; each thread's exception (null where it returned normally).
std::vector<std::exception_ptr> run_threads_collecting(int count,
                                                       const std::function<void(int)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(count));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      try {
        body(i);
      } catch (...) {
        errors[static_cast<std::size_t>(i)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

}  // namespace

std::vector<std::exception_ptr> run_ranks(const std::shared_ptr<ThreadGroup>& group,
                                          const std::function<void(Communicator&)>& body) {
  M3MSA_CHECK_ARG(group != nullptr, "run_ranks: null group");
  return run_threads_collecting(group->world_size(), [&](int r) {
    std::unique_ptr<Communicator> comm = group->communicator(r);
    body(*comm);
  });
}

void run_threads(int count, const std::function<void(int)>& body) {
  M3MSA_CHECK_ARG(count >= 0, "run_threads: count must be >= 0, got ", count);
  for (const std::exception_ptr& error : run_threads_collecting(count, body)) {
    if (error) std::rethrow_exception(error);
  }
}

// ---- Records ----

RecordWriter& RecordWriter::u8(uint8_t value) {
  bytes_.push_back(value);
  return *this;
}

RecordWriter& RecordWriter::i64(int64_t value) {
  const auto u = static_cast<uint64_t>(value);
  for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<uint8_t>(u >> (8 * i)));
  return *this;
}

RecordWriter& RecordWriter::str(std::string_view value) {
  i64(static_cast<int64_t>(value.size()));
  bytes_.insert(bytes_.end(), value.begin(), value.end());
  return *this;
}

RecordReader::RecordReader(const ByteRecord& bytes, std::string what)
    : bytes_(&bytes), what_(std::move(what)) {}

void RecordReader::need(std::size_t n) {
  M3MSA_CHECK_INTERNAL(offset_ + n <= bytes_->size(), what_, ": record truncated (needs ",
                       offset_ + n, " bytes, has ", bytes_->size(), ")");
}

uint8_t RecordReader::u8() {
  need(1);
  return (*bytes_)[offset_++];
}

int64_t RecordReader::i64() {
  need(8);
  uint64_t u = 0;
  for (int i = 0; i < 8; ++i) u |= static_cast<uint64_t>((*bytes_)[offset_ + i]) << (8 * i);
  offset_ += 8;
  return static_cast<int64_t>(u);
}

std::string RecordReader::str() {
  const int64_t n = i64();
  M3MSA_CHECK_INTERNAL(n >= 0, what_, ": negative string length ", n);
  need(static_cast<std::size_t>(n));
  std::string out(reinterpret_cast<const char*>(bytes_->data() + offset_),
                  static_cast<std::size_t>(n));
  offset_ += static_cast<std::size_t>(n);
  return out;
}

}  // namespace m3msa
