// The CPU model of the CP "peer" exchange (docs/context_parallel.md, include/m3msa/cp_model.h).
// Ranks are threads; what a GPU keeps in peer-mapped device memory lives here in a buffer set of
// atomics that every rank's thread can store into. The order of operations mirrors the CUDA
// transport on purpose: nominate, tag, store (release), spin (acquire, bounded), strip, select.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "m3msa/cp_model.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"

namespace m3msa {

namespace cp_detail {

// What every rank must agree on before sharing a buffer set. index_heads is not part of the
// buffer key (the layout does not depend on it) but a rank placing heads differently would send
// nominations to the wrong consumers, so the agreement checks it too.
struct AgreedShape {
  CpBufferKey key;
  int index_heads = 0;

  bool operator==(const AgreedShape&) const = default;
  std::string to_string() const {
    return detail::concat("(world_size=", key.world_size, ", index_heads=", index_heads,
                          ", merged_heads=", key.merged_heads, ", max_rows=", key.max_rows,
                          ", topk=", key.topk, ")");
  }
};

// One buffer set: every rank's candidate buffer, generation counter and error word.
struct BufferSet {
  CpBufferKey key;
  // Per consumer rank: [2 parities][P sources][merged heads][max_rows][k] keys, zeroed once at
  // creation and never cleared: a zero tag never matches, old tags are told apart by the tag.
  std::vector<std::unique_ptr<std::atomic<uint64_t>[]>> candidates;
  // Per rank; only that rank's thread touches its entry, so plain integers suffice.
  std::vector<uint32_t> generation;
  std::vector<std::optional<CpTimeoutRecord>> error;

  explicit BufferSet(const CpBufferKey& buffer_key)
      : key(buffer_key),
        generation(static_cast<std::size_t>(buffer_key.world_size), 0u),
        error(static_cast<std::size_t>(buffer_key.world_size)) {
    const std::size_t slots = key.bytes_per_rank() / sizeof(uint64_t);
    for (int r = 0; r < key.world_size; ++r) {
      candidates.push_back(std::make_unique<std::atomic<uint64_t>[]>(slots));  // value-init: 0
    }
  }

  // The k slots of (consumer's buffer, parity, source shard, consumer-local head, row).
  std::atomic<uint64_t>* slots(int consumer, int parity, int source, int local_head, int row) {
    const std::size_t index =
        ((((static_cast<std::size_t>(parity) * key.world_size + source) * key.merged_heads +
           local_head) *
              key.max_rows +
          row) *
         static_cast<std::size_t>(key.topk));
    return candidates[static_cast<std::size_t>(consumer)].get() + index;
  }
};

}  // namespace cp_detail

struct CpuCpWorld::State {
  int world_size = 0;
  std::mutex mutex;  // guards everything below (host-side setup only, never the exchange)
  std::condition_variable posted;
  std::vector<std::shared_ptr<cp_detail::BufferSet>> sets;
  // Host agreement: steps[s][r] is what rank r posted in its s-th setup step.
  std::vector<std::vector<std::optional<cp_detail::AgreedShape>>> steps;
  std::vector<std::size_t> steps_taken;  // per rank
};

CpuCpWorld::CpuCpWorld(int world_size) : state_(std::make_unique<State>()) {
  M3MSA_CHECK_ARG(world_size >= 1, "CP: world size must be >= 1, got ", world_size);
  state_->world_size = world_size;
  state_->steps_taken.assign(static_cast<std::size_t>(world_size), 0);
}

CpuCpWorld::~CpuCpWorld() = default;

int CpuCpWorld::world_size() const {
  return state_->world_size;
}

int CpuCpWorld::num_buffer_sets() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int>(state_->sets.size());
}

namespace {

using Clock = std::chrono::steady_clock;

// Spin policy of one bounded wait. A GPU thread just spins; on a CPU the P rank threads may
// outnumber the cores (P = 8 on two), so a waiter backs off to let the peer it waits for run.
// The clock is read once when a slot is first found missing and then every kSpinsPerClockCheck
// spins, so a slot that has already arrived costs one load and no clock read.
constexpr uint32_t kSpinsPerClockCheck = 64;
constexpr uint32_t kBusySpins = 64;
constexpr uint32_t kYieldSpins = 2048;
constexpr std::chrono::microseconds kBackoffSleep{20};

// Waits until `slot` carries `tag`; returns false when the budget ran out. `value` is the last
// value loaded either way (on expiry its tag is the "seen tag" of the error record).
bool wait_for_tag(const std::atomic<uint64_t>& slot, uint32_t tag, Clock::duration budget,
                  uint64_t& value) {
  value = slot.load(std::memory_order_acquire);
  if (key_tag(value) == tag) return true;
  const Clock::time_point start = Clock::now();
  for (uint32_t spins = 1;; ++spins) {
    value = slot.load(std::memory_order_acquire);
    if (key_tag(value) == tag) return true;
    if (spins % kSpinsPerClockCheck == 0 && Clock::now() - start >= budget) return false;
    if (spins >= kYieldSpins) {
      std::this_thread::sleep_for(kBackoffSleep);
    } else if (spins >= kBusySpins) {
      std::this_thread::yield();
    }
  }
}

int64_t budget_us(const CpConfig& cp) {
  return static_cast<int64_t>(cp.spin_budget.count());
}

// Both CP paths write the default form only (the CPU reference writes every form).
void check_default_selection(const SelectionOptions& selection) {
  M3MSA_CHECK_SUPPORTED(selection.is_default(),
                        "CP indexer: the selection is written token-major in descending key order "
                        "only, got order ",
                        selection_order_name(selection.order), ", major ",
                        selection_major_name(selection.major));
}

}  // namespace

struct CpuCpRank::Impl {
  std::shared_ptr<CpuCpWorld> world;
  int rank = 0;
  SparseConfig config;
  CpConfig cp;
  std::vector<int> heads;  // merged (global) heads, ascending
  cp_detail::AgreedShape shape;
  // Per global head: (consumer rank, the head's index among that consumer's merged heads).
  std::vector<std::vector<std::pair<int, int>>> destinations;
  std::shared_ptr<cp_detail::BufferSet> set;  // null until the setup step
  bool failed = false;
  HostTensor nominations;  // [max_rows, H, k] u64, this shard's keys of the current call
  HostTensor full_width;   // [max_rows, H, k] i32, only to give cpu::nominate a valid topk_idx
  std::vector<uint64_t> candidates;

  void setup();
  void select(int layer, const IndexerArgs& args);
  // Tags and sends this call's nominations, then merges the heads of this rank into out.
  void exchange(int layer, int64_t rows, int32_t* out);
};

// The collective setup step: post this rank's shape, wait (bounded) for every rank's, compare,
// then find or create the shared buffer set. Ranks never touch a buffer set before agreeing on
// it, so a mismatch is an error here instead of a hang in the exchange.
void CpuCpRank::Impl::setup() {
  CpuCpWorld::State& state = *world->state_;
  const int world_size = state.world_size;
  const Clock::time_point deadline = Clock::now() + cp.spin_budget;
  std::unique_lock<std::mutex> lock(state.mutex);
  const std::size_t step = state.steps_taken[static_cast<std::size_t>(rank)]++;
  if (state.steps.size() <= step) {
    state.steps.resize(step + 1, std::vector<std::optional<cp_detail::AgreedShape>>(
                                     static_cast<std::size_t>(world_size)));
  }
  std::vector<std::optional<cp_detail::AgreedShape>>& posts = state.steps[step];
  posts[static_cast<std::size_t>(rank)] = shape;
  state.posted.notify_all();
  const auto everyone_posted = [&posts] {
    return std::all_of(posts.begin(), posts.end(),
                       [](const auto& post) { return post.has_value(); });
  };
  if (!state.posted.wait_until(lock, deadline, everyone_posted)) {
    std::string missing;
    int num_missing = 0;
    for (int r = 0; r < world_size; ++r) {
      if (!posts[static_cast<std::size_t>(r)]) {
        missing += detail::concat(num_missing++ == 0 ? "" : ", ", r);
      }
    }
    throw Error(ErrorCode::kTimeout,
                detail::concat(num_missing == 1 ? "rank " : "ranks ", missing,
                               " never joined CP setup step ", step, " within the spin budget of ",
                               budget_us(cp), " us (this rank asked for ", shape.to_string(), ")"),
                __FILE__, __LINE__, rank);
  }
  for (int r = 0; r < world_size; ++r) {
    const cp_detail::AgreedShape& other = *posts[static_cast<std::size_t>(r)];
    if (other != shape) {
      throw Error(ErrorCode::kInvalidArgument,
                  detail::concat("CP setup step ", step, ": rank ", r, " asked for ",
                                 other.to_string(), " but this rank asked for ", shape.to_string(),
                                 "; every rank must build its CP indexer with the same world "
                                 "size, index heads, max_rows and topk"),
                  __FILE__, __LINE__, rank);
    }
  }
  for (const auto& existing : state.sets) {
    if (existing->key == shape.key) {
      set = existing;
      return;
    }
  }
  set = std::make_shared<cp_detail::BufferSet>(shape.key);
  state.sets.push_back(set);
}

void CpuCpRank::Impl::select(int layer, const IndexerArgs& args) {
  M3MSA_CHECK_ARG(!failed, "CP rank ", rank,
                  ": an earlier call failed and the ranks are out of lockstep; rebuild the world");
  const int64_t rows = args.batch.num_rows();
  M3MSA_CHECK_ARG(rows >= 0 && rows <= cp.max_rows, "CP: the batch has ", rows,
                  " rows, outside [0, CpConfig.max_rows = ", cp.max_rows, "]");
  const int num_heads = config.index_heads;
  const int k = config.topk;
  check_default_selection(args.selection);
  check_tensor(args.topk_idx, "topk_idx", DType::kI32,
               {rows, static_cast<int64_t>(heads.size()), k});
  check_device(args.topk_idx, "topk_idx", Device::cpu());
  IndexerArgs full_args = args;
  full_args.topk_idx = TensorView::contiguous(full_width.data(), DType::kI32, {rows, num_heads, k});
  validate(config, full_args, Device::cpu());

  // Score before touching shared state: an argument error found while scoring (bad table
  // contents) leaves this rank's counter and the agreement where they were.
  if (rows > 0) {
    cpu::nominate(config, full_args, rank, cp.world_size,
                  TensorView::contiguous(nominations.data(), DType::kU64, {rows, num_heads, k}),
                  cp.threads);
  }

  // Everything below changes shared state: a failure leaves this rank out of step with the others.
  try {
    if (!set) setup();
    exchange(layer, rows, args.topk_idx.ptr<int32_t>());
  } catch (...) {
    failed = true;
    throw;
  }
}

void CpuCpRank::Impl::exchange(int layer, int64_t rows, int32_t* out) {
  const int world_size = cp.world_size;
  const int num_heads = config.index_heads;
  const int k = config.topk;
  const int max_rows = cp.max_rows;
  const int num_merged = static_cast<int>(heads.size());

  const uint64_t* keys = nominations.ptr<uint64_t>();
  const uint32_t generation = ++set->generation[static_cast<std::size_t>(rank)];
  const uint32_t tag = generation_tag(generation);
  const int parity = static_cast<int>(generation & 1u);

  // Send: every row of the buffer, live or not, so every consumer's counter-matched wait is met.
  for (int row = 0; row < max_rows; ++row) {
    for (int head = 0; head < num_heads; ++head) {
      const uint64_t* source =
          row < rows ? keys + (static_cast<std::size_t>(row) * num_heads + head) * k : nullptr;
      for (const auto& [consumer, local_head] : destinations[static_cast<std::size_t>(head)]) {
        std::atomic<uint64_t>* slots = set->slots(consumer, parity, rank, local_head, row);
        for (int i = 0; i < k; ++i) {
          // An empty nomination still carries the tag: it is how the consumer knows it arrived.
          const uint64_t key = source != nullptr ? source[i] : kNoCandidate;
          slots[i].store(with_tag(key, tag), std::memory_order_release);
        }
      }
    }
  }

  // Merge: rows in order so a row's selection starts as soon as its own candidates land.
  for (int row = 0; row < max_rows; ++row) {
    for (int local_head = 0; local_head < num_merged; ++local_head) {
      candidates.clear();
      for (int source = 0; source < world_size; ++source) {
        const std::atomic<uint64_t>* slots = set->slots(rank, parity, source, local_head, row);
        for (int i = 0; i < k; ++i) {
          uint64_t value = 0;
          if (!wait_for_tag(slots[i], tag, cp.spin_budget, value)) {
            const CpTimeoutRecord record{layer,  row, heads[static_cast<std::size_t>(local_head)],
                                         source, tag, key_tag(value)};
            set->error[static_cast<std::size_t>(rank)] = record;
            throw Error(ErrorCode::kTimeout,
                        detail::concat("rank ", source, " never delivered layer ", layer, " row ",
                                       row, " head ", record.head, " (expected tag ", tag,
                                       ", saw tag ", record.seen_tag,
                                       ") within the spin budget of ", budget_us(cp), " us"),
                        __FILE__, __LINE__, rank);
          }
          candidates.push_back(with_tag(value, 0));
        }
      }
      // Rows past the live batch were waited for only to keep the slots and counters in step.
      if (row >= rows) continue;
      const std::vector<uint64_t> best = cpu::top_keys(candidates, k);
      cpu::keys_to_indices(best.data(), static_cast<int>(best.size()),
                           out + (static_cast<std::size_t>(row) * num_merged + local_head) * k, k);
    }
  }
}

CpuCpRank::CpuCpRank(std::shared_ptr<CpuCpWorld> world, int rank, const SparseConfig& config,
                     const CpConfig& cp)
    : impl_(std::make_unique<Impl>()) {
  M3MSA_CHECK_ARG(world != nullptr, "CP: world must not be null");
  config.validate();
  M3MSA_CHECK_ARG(cp.world_size == world->world_size(), "CP: CpConfig.world_size (", cp.world_size,
                  ") differs from the world's size (", world->world_size(), ")");
  M3MSA_CHECK_ARG(rank >= 0 && rank < cp.world_size, "CP: rank must be in [0, ", cp.world_size,
                  "), got ", rank);
  M3MSA_CHECK_ARG(cp.max_rows >= 1, "CpConfig.max_rows must be >= 1, got ", cp.max_rows);
  M3MSA_CHECK_ARG(cp.spin_budget.count() > 0, "CpConfig.spin_budget must be > 0 us, got ",
                  cp.spin_budget.count());
  M3MSA_CHECK_ARG(cp.threads >= 0, "CpConfig.threads must be >= 0, got ", cp.threads);
  validate_cp_placement(cp.world_size, config.index_heads);

  Impl& impl = *impl_;
  impl.world = std::move(world);
  impl.rank = rank;
  impl.config = config;
  impl.cp = cp;
  impl.heads = cp_merged_heads(cp.world_size, config.index_heads, rank);
  impl.shape.key = {cp.world_size, static_cast<int>(impl.heads.size()), cp.max_rows, config.topk};
  impl.shape.index_heads = config.index_heads;
  impl.destinations.resize(static_cast<std::size_t>(config.index_heads));
  for (int head = 0; head < config.index_heads; ++head) {
    for (int consumer : cp_consumers(cp.world_size, config.index_heads, head)) {
      const std::vector<int> consumer_heads =
          cp_merged_heads(cp.world_size, config.index_heads, consumer);
      const auto at = std::find(consumer_heads.begin(), consumer_heads.end(), head);
      impl.destinations[static_cast<std::size_t>(head)].emplace_back(
          consumer, static_cast<int>(at - consumer_heads.begin()));
    }
  }
  impl.nominations = HostTensor(DType::kU64, {cp.max_rows, config.index_heads, config.topk});
  impl.full_width = HostTensor(DType::kI32, {cp.max_rows, config.index_heads, config.topk});
  impl.candidates.reserve(static_cast<std::size_t>(cp.world_size) * config.topk);
}

CpuCpRank::~CpuCpRank() = default;
CpuCpRank::CpuCpRank(CpuCpRank&&) noexcept = default;
CpuCpRank& CpuCpRank::operator=(CpuCpRank&&) noexcept = default;

void CpuCpRank::select(int layer, const IndexerArgs& args) {
  try {
    impl_->select(layer, args);
  } catch (const Error& error) {
    // Validation helpers do not know the rank; a rank's errors always carry it.
    if (error.rank() >= 0) throw;
    throw error.with_rank(impl_->rank);
  }
}

int CpuCpRank::rank() const {
  return impl_->rank;
}

const std::vector<int>& CpuCpRank::merged_heads() const {
  return impl_->heads;
}

CpBufferKey CpuCpRank::buffer_key() const {
  return impl_->shape.key;
}

uint32_t CpuCpRank::generation() const {
  return impl_->set ? impl_->set->generation[static_cast<std::size_t>(impl_->rank)] : 0u;
}

std::optional<CpTimeoutRecord> CpuCpRank::last_timeout() const {
  if (!impl_->set) return std::nullopt;
  return impl_->set->error[static_cast<std::size_t>(impl_->rank)];
}

CpuCpGroup::CpuCpGroup(const SparseConfig& config, const CpConfig& cp)
    : config_(config), cp_(cp), world_(std::make_shared<CpuCpWorld>(cp.world_size)) {
  ranks_.reserve(static_cast<std::size_t>(cp.world_size));
  for (int r = 0; r < cp.world_size; ++r) ranks_.emplace_back(world_, r, config, cp);
}

CpuCpRank& CpuCpGroup::rank(int rank) {
  M3MSA_CHECK_ARG(rank >= 0 && rank < world_size(), "CP: rank must be in [0, ", world_size(),
                  "), got ", rank);
  return ranks_[static_cast<std::size_t>(rank)];
}

const std::vector<int>& CpuCpGroup::merged_heads(int rank) const {
  M3MSA_CHECK_ARG(rank >= 0 && rank < world_size(), "CP: rank must be in [0, ", world_size(),
                  "), got ", rank);
  return ranks_[static_cast<std::size_t>(rank)].merged_heads();
}

void CpuCpGroup::select(int rank, int layer, const IndexerArgs& args) {
  this->rank(rank).select(layer, args);
}

void cp_select_all(CpuCpGroup& group, int layer, const IndexerArgs& args) {
  const SparseConfig& config = group.config();
  const int world_size = group.world_size();
  const int num_heads = config.index_heads;
  const int k = config.topk;
  const int64_t rows = args.batch.num_rows();
  check_default_selection(args.selection);
  check_tensor(args.topk_idx, "topk_idx", DType::kI32, {rows, num_heads, k});
  check_device(args.topk_idx, "topk_idx", Device::cpu());

  std::vector<HostTensor> outputs;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    outputs.emplace_back(
        DType::kI32,
        std::vector<int64_t>{rows, static_cast<int64_t>(group.merged_heads(r).size()), k});
  }
  const auto run_rank = [&](int r) {
    try {
      IndexerArgs rank_args = args;
      rank_args.topk_idx = outputs[static_cast<std::size_t>(r)].view();
      group.select(r, layer, rank_args);
    } catch (...) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world_size));
  for (int r = 1; r < world_size; ++r) threads.emplace_back(run_rank, r);
  run_rank(0);
  for (std::thread& thread : threads) thread.join();

  // A failing rank makes its peers time out; report the failure itself, not the echoes.
  std::exception_ptr first_timeout;
  for (const std::exception_ptr& error : errors) {
    if (!error) continue;
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kTimeout) throw;
      if (!first_timeout) first_timeout = error;
    }
  }
  if (first_timeout) std::rethrow_exception(first_timeout);

  int32_t* full = args.topk_idx.ptr<int32_t>();
  for (int head = 0; head < num_heads; ++head) {
    const std::vector<int> consumers = cp_consumers(world_size, num_heads, head);
    for (std::size_t c = 0; c < consumers.size(); ++c) {
      const int r = consumers[c];
      const std::vector<int>& merged = group.merged_heads(r);
      const int num_merged = static_cast<int>(merged.size());
      const int local_head =
          static_cast<int>(std::find(merged.begin(), merged.end(), head) - merged.begin());
      const int32_t* part = outputs[static_cast<std::size_t>(r)].ptr<int32_t>();
      for (int64_t row = 0; row < rows; ++row) {
        const int32_t* from = part + (row * num_merged + local_head) * k;
        int32_t* to = full + (row * num_heads + head) * k;
        if (c == 0) {
          std::memcpy(to, from, static_cast<std::size_t>(k) * sizeof(int32_t));
        } else {
          M3MSA_CHECK_INTERNAL(
              std::memcmp(to, from, static_cast<std::size_t>(k) * sizeof(int32_t)) == 0,
              "consumers ", consumers[0], " and ", r, " of head ", head, " disagree on row ", row);
        }
      }
    }
  }
}

}  // namespace m3msa
