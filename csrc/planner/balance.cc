// The balance scheduler core; see balance.h and megatron_hdp/scheduler/balance.py (the
// specification). Every comparison and every floating-point operation below mirrors the
// reference in kind and order, so plans are identical bit for bit.
//
// Where the reference uses general containers, this uses ones that give the same answers
// faster: best fit over rooms indexed directly (per-room min-heaps of bin ids and a bitset
// with find-next-set), stable radix sorts for the item order and the global order, a heap
// of groups of ranks that become free together for the free times, and an ordered set of
// gaps that sorts a gap in only once some pack could use it. Plans are flat arrays
// (PlanArrays), with no allocation per placement.
#include "balance.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace megatron_hdp {
namespace planner {
namespace {

// One item to place: a pack (k == 1) or a ring sequence (k > 1).
struct Item {
  double cost;
  int64_t k;
  int64_t source;  // pack id (k == 1) or sequence index (k > 1)
};

// An idle gap on one rank, ordered as the reference's (length, start, rank) tuples.
struct Gap {
  double length;
  double start;
  int64_t rank;
  bool operator<(const Gap& o) const {
    if (length < o.length) return true;
    if (o.length < length) return false;
    if (start < o.start) return true;
    if (o.start < start) return false;
    return rank < o.rank;
  }
};

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("balance_core: " + message);
}

void validate(const std::vector<int64_t>& lengths, const std::vector<int64_t>& ring_sizes,
              const std::vector<double>& local_cost, const std::vector<double>& ring_cost,
              int64_t pool_size, int64_t capacity, double delta) {
  const size_t n = lengths.size();
  if (ring_sizes.size() != n || local_cost.size() != n || ring_cost.size() != n) {
    fail("lengths, ring_sizes, local_cost and ring_cost must have equal lengths, got " +
         std::to_string(n) + ", " + std::to_string(ring_sizes.size()) + ", " +
         std::to_string(local_cost.size()) + ", " + std::to_string(ring_cost.size()));
  }
  if (pool_size < 1) fail("pool_size must be >= 1, got " + std::to_string(pool_size));
  if (capacity <= 0) {
    fail("capacity (tokens per rank per micro-batch) must be > 0, got " +
         std::to_string(capacity));
  }
  if (std::isnan(delta)) fail("delta must be a number, got NaN");
  for (size_t i = 0; i < n; ++i) {
    const int64_t k = ring_sizes[i];
    const bool bad = lengths[i] < 0 || k < 1 || k > pool_size ||
                     (k == 1 ? lengths[i] > capacity || !std::isfinite(local_cost[i])
                             : !std::isfinite(ring_cost[i]));
    if (!bad) continue;
    // The messages are built only on failure: no allocation per sequence.
    const std::string seq = "sequence " + std::to_string(i);
    if (lengths[i] < 0) fail(seq + " has a negative length " + std::to_string(lengths[i]));
    if (k < 1 || k > pool_size) {
      fail(seq + " has ring size " + std::to_string(k) + ", outside [1, pool_size=" +
           std::to_string(pool_size) + "]");
    }
    if (k == 1) {
      if (lengths[i] > capacity) {
        fail(seq + " has ring size 1 but " + std::to_string(lengths[i]) +
             " tokens, more than the capacity " + std::to_string(capacity));
      }
      fail(seq + " has a non-finite local_cost");
    }
    fail(seq + " has a non-finite ring_cost");
  }
}

void validate_widths(const RingWidths& w, const std::vector<int64_t>& ring_sizes,
                     int64_t pool_size) {
  if (w.empty()) return;
  const size_t n = ring_sizes.size();
  if (w.low.size() != n || w.offsets.size() != n + 1 || w.offsets[0] != 0 ||
      w.offsets[n] != static_cast<int64_t>(w.costs.size())) {
    fail("widths must be (low, offsets, costs) with one low per sequence and n + 1 offsets "
         "from 0 to len(costs)");
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t first = w.offsets[i];
    const int64_t last = w.offsets[i + 1];
    if (last < first) fail("widths offsets decrease at sequence " + std::to_string(i));
    if (last == first) continue;
    const int64_t lo = w.low[i];
    const int64_t hi = lo + last - first - 1;
    if (ring_sizes[i] <= 1 || lo < 2 || hi > pool_size) {
      fail("sequence " + std::to_string(i) + " (ring size " + std::to_string(ring_sizes[i]) +
           ") lists widths " + std::to_string(lo) + ".." + std::to_string(hi) +
           "; widths need a ring sequence and must lie in [2, " + std::to_string(pool_size) +
           "]");
    }
    for (int64_t j = first; j < last; ++j) {
      if (!std::isfinite(w.costs[static_cast<size_t>(j)])) {
        fail("sequence " + std::to_string(i) + " lists a non-finite width cost");
      }
    }
  }
}

// `indices` sorted by (length desc, index asc): a stable LSD radix sort (8-bit digits) of
// the key `capacity - length` in [0, capacity] after ordering the indices ascending. O(n)
// per digit; only the digits that `capacity` needs are sorted.
std::vector<int64_t> decreasing_length_order(const std::vector<int64_t>& lengths,
                                             const std::vector<int64_t>& indices,
                                             int64_t capacity) {
  std::vector<int64_t> order(indices);
  if (!std::is_sorted(order.begin(), order.end())) std::sort(order.begin(), order.end());
  std::vector<int64_t> scratch(order.size());
  std::vector<size_t> count(257);
  const uint64_t max_key = static_cast<uint64_t>(capacity);
  for (unsigned shift = 0; shift < 64 && (max_key >> shift) != 0; shift += 8) {
    std::fill(count.begin(), count.end(), size_t{0});
    for (const int64_t i : order) {
      ++count[((static_cast<uint64_t>(capacity - lengths[i]) >> shift) & 0xFFu) + 1];
    }
    for (size_t d = 1; d < count.size(); ++d) count[d] += count[d - 1];
    for (const int64_t i : order) {
      scratch[count[(static_cast<uint64_t>(capacity - lengths[i]) >> shift) & 0xFFu]++] = i;
    }
    order.swap(scratch);
  }
  return order;
}

inline unsigned lowest_bit(uint64_t bits) { return static_cast<unsigned>(__builtin_ctzll(bits)); }

// A set of positions in [0, n) with find-next-set: 64-ary levels of bit words, level l + 1
// holding one bit per non-zero word of level l (two levels up to 4096 positions, three up
// to 262,144). Set, reset and next are O(levels) word operations.
class NextSetBits {
 public:
  static constexpr size_t kNone = std::numeric_limits<size_t>::max();

  explicit NextSetBits(size_t n) {
    size_t words = n;
    do {
      words = (words + 63) / 64;
      levels_.emplace_back(words, uint64_t{0});
    } while (words > 1);
  }

  void set(size_t i) {
    for (std::vector<uint64_t>& level : levels_) {
      uint64_t& word = level[i >> 6];
      const bool had_bits = word != 0;
      word |= uint64_t{1} << (i & 63);
      if (had_bits) return;  // the levels above already mark this word
      i >>= 6;
    }
  }

  void reset(size_t i) {
    for (std::vector<uint64_t>& level : levels_) {
      uint64_t& word = level[i >> 6];
      word &= ~(uint64_t{1} << (i & 63));
      if (word != 0) return;
      i >>= 6;
    }
  }

  // The smallest set position >= i, or kNone.
  size_t next(size_t i) const {
    size_t l = 0;
    for (;; ++l) {  // up: the first level whose word at i has a set bit at or after i
      if (l == levels_.size()) return kNone;
      const size_t w = i >> 6;
      if (w >= levels_[l].size()) return kNone;
      const uint64_t bits = levels_[l][w] & (~uint64_t{0} << (i & 63));
      if (bits != 0) {
        i = (w << 6) | lowest_bit(bits);
        break;
      }
      i = w + 1;
    }
    while (l > 0) {  // down: the lowest set bit of each marked word
      --l;
      i = (i << 6) | lowest_bit(levels_[l][i]);
    }
    return i;
  }

 private:
  std::vector<std::vector<uint64_t>> levels_;
};

// Best fit with rooms indexed directly. The items come from a counting sort by
// `capacity - length`: order[first[key]:first[key + 1]] have length capacity - key, indices
// ascending. rooms[r] is a min-heap of the ids of the bins with room r, `nonempty` marks the
// rooms that have a bin: the smallest room >= size is nonempty.next(size), and its lowest
// bin id is the heap's top.
void best_fit_by_room(const std::vector<int64_t>& first, int64_t capacity,
                      std::vector<int64_t>& bin_of, int64_t& num_bins) {
  // Up to kKeptRooms rooms, the heaps keep their buffers from call to call on this thread
  // (the ring-size search runs the core several times on one batch): no allocation per
  // room after the first run. Between calls at most kKeptEntries heap entries stay
  // allocated, besides the (empty) heaps themselves: 24 bytes per room, 1.5 MB at most.
  constexpr size_t kKeptRooms = size_t{1} << 16;
  constexpr size_t kKeptEntries = size_t{1} << 20;
  thread_local std::vector<std::vector<int64_t>> kept;
  std::vector<std::vector<int64_t>> once;
  const size_t num_rooms = static_cast<size_t>(capacity) + 1;
  std::vector<std::vector<int64_t>>& rooms = num_rooms <= kKeptRooms ? kept : once;
  if (rooms.size() < num_rooms) rooms.resize(num_rooms);
  for (size_t r = 0; r < num_rooms; ++r) rooms[r].clear();
  struct Release {  // on every way out: drop the buffers if they grew too large
    std::vector<std::vector<int64_t>>& rooms;
    ~Release() {
      size_t entries = 0;
      for (const std::vector<int64_t>& heap : rooms) entries += heap.capacity();
      if (entries > kKeptEntries) std::vector<std::vector<int64_t>>().swap(rooms);
    }
  } release{rooms};
  NextSetBits nonempty(static_cast<size_t>(capacity) + 1);
  const std::greater<int64_t> min_heap;
  for (int64_t key = 0; key <= capacity; ++key) {
    const int64_t size = capacity - key;
    for (int64_t j = first[static_cast<size_t>(key)]; j < first[static_cast<size_t>(key) + 1];
         ++j) {
      const size_t found = nonempty.next(static_cast<size_t>(size));
      int64_t bin;
      int64_t room;
      if (found == NextSetBits::kNone) {
        bin = num_bins++;
        room = key;  // capacity - size
      } else {
        std::vector<int64_t>& heap = rooms[found];
        std::pop_heap(heap.begin(), heap.end(), min_heap);
        bin = heap.back();
        heap.pop_back();
        if (heap.empty()) nonempty.reset(found);
        room = static_cast<int64_t>(found) - size;
      }
      std::vector<int64_t>& heap = rooms[static_cast<size_t>(room)];
      if (heap.empty()) nonempty.set(static_cast<size_t>(room));
      heap.push_back(bin);
      std::push_heap(heap.begin(), heap.end(), min_heap);
      bin_of[static_cast<size_t>(j)] = bin;
    }
  }
}

// The same best fit with an ordered set of (room, bin id), for capacities too large to
// index directly.
void best_fit_by_set(const std::vector<int64_t>& lengths, const std::vector<int64_t>& order,
                     int64_t capacity, std::vector<int64_t>& bin_of, int64_t& num_bins) {
  std::set<std::pair<int64_t, int64_t>> rooms;  // (room, bin id); bin ids are unique
  for (size_t j = 0; j < order.size(); ++j) {
    const int64_t size = lengths[order[j]];
    auto it = rooms.lower_bound({size, std::numeric_limits<int64_t>::min()});
    if (it == rooms.end()) {
      bin_of[j] = num_bins++;
      rooms.emplace(capacity - size, bin_of[j]);
    } else {
      auto node = rooms.extract(it);  // reuse the node: no allocation per item
      node.value().first -= size;
      bin_of[j] = node.value().second;
      rooms.insert(std::move(node));
    }
  }
}

// Rooms are indexed directly when that costs about as much memory as the items do.
bool index_rooms_directly(int64_t capacity, size_t num_items) {
  return capacity < 4096 ||
         (capacity <= (int64_t{1} << 22) && static_cast<uint64_t>(capacity) <= 4 * num_items);
}

// An unsigned key whose order is the order of the doubles (not NaN); -0.0 and 0.0, which
// compare equal, get the same key.
inline uint64_t ascending_key(double x) {
  x += 0.0;  // -0.0 + 0.0 == +0.0
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u >> 63) != 0 ? ~u : u | (uint64_t{1} << 63);
}

// Stably sorts `order` (indices into `keys`) by key, ascending: LSD radix sort with 11-bit
// digits on (key, index) pairs, skipping the digits in which all keys agree.
void stable_sort_by_key(std::vector<int64_t>& order, const std::vector<uint64_t>& keys) {
  constexpr unsigned kBits = 11;
  constexpr size_t kBuckets = size_t{1} << kBits;
  constexpr unsigned kDigits = (64 + kBits - 1) / kBits;
  using Entry = std::pair<uint64_t, int64_t>;
  const size_t n = order.size();
  std::vector<Entry> entries(n);
  uint64_t any = 0;
  uint64_t all = ~uint64_t{0};
  for (size_t j = 0; j < n; ++j) {
    const uint64_t key = keys[static_cast<size_t>(order[j])];
    entries[j] = {key, order[j]};
    any |= key;
    all &= key;
  }
  const uint64_t varying = any ^ all;
  std::vector<unsigned> shifts;
  for (unsigned d = 0; d < kDigits; ++d) {
    if (((varying >> (d * kBits)) & (kBuckets - 1)) != 0) shifts.push_back(d * kBits);
  }
  if (shifts.empty()) return;  // all keys are equal
  std::vector<size_t> count(shifts.size() * kBuckets, 0);
  for (const Entry& e : entries) {  // every digit's histogram in one pass
    for (size_t d = 0; d < shifts.size(); ++d) {
      ++count[d * kBuckets + ((e.first >> shifts[d]) & (kBuckets - 1))];
    }
  }
  std::vector<Entry> scratch(n);
  for (size_t d = 0; d < shifts.size(); ++d) {
    size_t* first = &count[d * kBuckets];
    size_t sum = 0;
    for (size_t bucket = 0; bucket < kBuckets; ++bucket) {
      const size_t c = first[bucket];
      first[bucket] = sum;
      sum += c;
    }
    for (const Entry& e : entries) scratch[first[(e.first >> shifts[d]) & (kBuckets - 1)]++] = e;
    entries.swap(scratch);
  }
  for (size_t j = 0; j < n; ++j) order[j] = entries[j].second;
}

// Ranks that become free at the same time, consumed in ascending rank order: ranks
// store[pos:end], the next of which is `rank`. A heap of such groups ordered by
// (time, rank) pops (free time, rank) pairs in exactly the order of a heap of the pairs,
// but a ring's k members enter it as one group. `key` is ascending_key(time): free times
// are never NaN or -0.0 (they are sums of finite costs starting from 0.0), so the key
// orders them as the doubles compare and gives the time back exactly.
struct Group {
  uint64_t key;
  int64_t rank;
  int64_t pos;
  int64_t end;
};

inline bool earlier(const Group& a, const Group& b) {
  return a.key < b.key || (a.key == b.key && a.rank < b.rank);
}

inline double time_of_key(uint64_t key) {
  const uint64_t u = (key >> 63) != 0 ? key & ~(uint64_t{1} << 63) : ~key;
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The free ranks: a 4-ary min-heap of groups.
class FreeRanks {
 public:
  FreeRanks(int64_t pool_size, std::vector<int64_t>& store) : store_(store) {
    store_.resize(static_cast<size_t>(pool_size));
    std::iota(store_.begin(), store_.end(), int64_t{0});
    heap_.reserve(64);
    heap_.push_back({ascending_key(0.0), 0, 0, pool_size});
  }

  // Pops the k earliest (free time, rank) pairs, appending the ranks to store and the
  // times to `times` in pop order. The ranks of one group that precede every other
  // group's next rank leave in one step.
  void pop_many(int64_t k, std::vector<double>& times) {
    while (k > 0) {
      const Group top = heap_[0];
      int64_t take = std::min(k, top.end - top.pos);
      const size_t n = heap_.size();
      if (n > 1 && take > 1) {
        size_t best = 1;  // the earliest other group is a child of the root
        for (size_t c = 2; c <= kArity && c < n; ++c) {
          if (earlier(heap_[c], heap_[best])) best = c;
        }
        if (heap_[best].key == top.key) {  // same time: only the ranks below its rank
          const int64_t bound = heap_[best].rank;
          int64_t fit = 1;  // top.rank < bound
          while (fit < take && store_[static_cast<size_t>(top.pos + fit)] < bound) ++fit;
          take = fit;
        }
      }
      const double time = time_of_key(top.key);
      for (int64_t j = 0; j < take; ++j) {
        const int64_t rank = store_[static_cast<size_t>(top.pos + j)];
        store_.push_back(rank);
        times.push_back(time);
      }
      k -= take;
      if (top.pos + take < top.end) {
        const int64_t pos = top.pos + take;
        replace_top({top.key, store_[static_cast<size_t>(pos)], pos, top.end});
      } else {
        const Group last = heap_.back();
        heap_.pop_back();
        if (!heap_.empty()) replace_top(last);
      }
    }
  }

  // Pops the earliest (free time, rank) and adds that rank back as free from
  // time + cost, kept at store[pos]; returns the time it was free from.
  double pop_and_push_back(double cost, int64_t pos) {
    const Group top = heap_[0];
    const double time = time_of_key(top.key);
    const Group back{ascending_key(time + cost), top.rank, pos, pos + 1};
    if (top.pos + 1 < top.end) {
      const int64_t next = top.pos + 1;
      replace_top({top.key, store_[static_cast<size_t>(next)], next, top.end});
      push(back);
    } else {
      replace_top(back);
    }
    return time;
  }

  int64_t next_rank() const { return heap_[0].rank; }

  // Adds the ranks store[pos:end] (ascending) as free from `time`.
  void push(double time, int64_t pos, int64_t end) {
    push({ascending_key(time), store_[static_cast<size_t>(pos)], pos, end});
  }

 private:
  static constexpr size_t kArity = 4;

  void push(const Group& g) {
    size_t i = heap_.size();
    heap_.emplace_back();
    while (i > 0) {
      const size_t parent = (i - 1) / kArity;
      if (!earlier(g, heap_[parent])) break;
      heap_[i] = heap_[parent];
      i = parent;
    }
    heap_[i] = g;
  }

  // Puts `g` at the root and restores the heap order below it.
  void replace_top(const Group& g) {
    const size_t n = heap_.size();
    size_t i = 0;
    for (;;) {
      const size_t first = kArity * i + 1;
      if (first >= n) break;
      const size_t last = std::min(first + kArity, n);
      size_t best = first;
      for (size_t c = first + 1; c < last; ++c) {
        if (earlier(heap_[c], heap_[best])) best = c;
      }
      if (!earlier(heap_[best], g)) break;
      heap_[i] = heap_[best];
      i = best;
    }
    heap_[i] = g;
  }

  std::vector<int64_t>& store_;
  std::vector<Group> heap_;
};

// Rule 8 looks for a ring's window among this many of the shortest gaps that hold it.
inline size_t window_scan(int64_t width) { return 64 + 4 * static_cast<size_t>(width); }

// The idle gaps, an ordered multiset by (length, start, rank) that answers "the first gap
// that is not less than (cost, -inf, min)", i.e. the shortest gap of length >= cost (ties:
// earlier start, lower rank). New gaps wait in a max-heap by length and are sorted in only
// once a query could pick them (length >= its cost): a gap shorter than every later pack
// is never sorted. Every waiting gap is less than the probe of the current query, so the
// answer from the sorted part is the answer over all gaps. The sorted part is a list of
// sorted blocks of at most kMaxBlock gaps, each block's last gap in `lasts_` for the
// search. Equal gaps are interchangeable.
class GapSet {
 public:
  struct Position {
    size_t block;
    size_t index;
  };

  void insert(const Gap& gap) {
    waiting_.push_back(gap);
    std::push_heap(waiting_.begin(), waiting_.end(), shorter);
  }

  // The shortest gap that holds `cost`; check with found().
  Position first_fit(double cost) {
    const Gap probe{cost, -std::numeric_limits<double>::infinity(),
                    std::numeric_limits<int64_t>::min()};
    while (!waiting_.empty() && !(waiting_.front() < probe)) {
      std::pop_heap(waiting_.begin(), waiting_.end(), shorter);
      sort_in(waiting_.back());
      waiting_.pop_back();
    }
    const size_t b = static_cast<size_t>(
        std::lower_bound(lasts_.begin(), lasts_.end(), probe) - lasts_.begin());
    if (b == blocks_.size()) return {b, 0};
    const std::vector<Gap>& block = blocks_[b];
    return {b, static_cast<size_t>(std::lower_bound(block.begin(), block.end(), probe) -
                                   block.begin())};
  }

  // Rule 8 of balance.py: the earliest window of `width` gaps that each cover
  // [t, t + cost], t being a gap's start, with t + cost < finish, among the
  // window_scan(width) shortest gaps that hold `cost`. On success fills `chosen` with the
  // `width` gaps that end first (ties: lower rank) and returns true with `t` in `at`.
  // Only gaps that start early enough can take part (start + cost < finish).
  bool find_window(int64_t width, double cost, double finish, double& at,
                   std::vector<Gap>& chosen) {
    const Position from = first_fit(cost);  // sorts in every gap that could hold it
    if (!found(from)) return false;
    window_.clear();
    size_t scanned = 0;
    const size_t limit = window_scan(width);
    for (size_t b = from.block; b < blocks_.size() && scanned < limit; ++b) {
      const std::vector<Gap>& block = blocks_[b];
      for (size_t j = b == from.block ? from.index : 0; j < block.size() && scanned < limit;
           ++j, ++scanned) {
        if (block[j].start + cost < finish) window_.push_back(block[j]);
      }
    }
    if (window_.size() < static_cast<size_t>(width)) return false;
    std::sort(window_.begin(), window_.end(), [](const Gap& a, const Gap& b) {
      return a.start < b.start || (a.start == b.start && a.rank < b.rank);
    });
    // Min-heap of the gaps that began by t, by (end, rank).
    open_.clear();
    const auto later = [](const Open& a, const Open& b) {
      return a.end > b.end || (a.end == b.end && a.rank > b.rank);
    };
    for (size_t j = 0; j < window_.size();) {
      const double t = window_[j].start;
      for (; j < window_.size() && window_[j].start == t; ++j) {
        open_.push_back({window_[j].start + window_[j].length, window_[j].rank, j});
        std::push_heap(open_.begin(), open_.end(), later);
      }
      const double end = t + cost;
      if (!(end < finish)) return false;
      while (!open_.empty() && open_.front().end < end) {
        std::pop_heap(open_.begin(), open_.end(), later);
        open_.pop_back();
      }
      if (open_.size() >= static_cast<size_t>(width)) {
        std::sort(open_.begin(), open_.end(), [&later](const Open& a, const Open& b) {
          return later(b, a);
        });
        chosen.clear();
        for (int64_t c = 0; c < width; ++c) {
          chosen.push_back(window_[open_[static_cast<size_t>(c)].index]);
        }
        at = t;
        return true;
      }
    }
    return false;
  }

  // Removes a gap that find_window returned.
  void erase_gap(const Gap& gap) { erase(find(gap)); }

  bool empty() const { return waiting_.empty() && blocks_.empty(); }

  bool found(const Position& at) const { return at.block < blocks_.size(); }
  const Gap& at(const Position& at) const { return blocks_[at.block][at.index]; }

  void erase(const Position& at) {
    std::vector<Gap>& block = blocks_[at.block];
    block.erase(block.begin() + static_cast<std::ptrdiff_t>(at.index));
    if (block.empty()) {
      blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(at.block));
      lasts_.erase(lasts_.begin() + static_cast<std::ptrdiff_t>(at.block));
    } else {
      lasts_[at.block] = block.back();
    }
  }

 private:
  static constexpr size_t kMaxBlock = 128;

  struct Open {
    double end;
    int64_t rank;
    size_t index;  // into window_
  };

  // The position of a gap that is sorted in (it must be).
  Position find(const Gap& gap) const {
    const size_t b = static_cast<size_t>(
        std::lower_bound(lasts_.begin(), lasts_.end(), gap) - lasts_.begin());
    const std::vector<Gap>& block = blocks_[b];
    return {b, static_cast<size_t>(std::lower_bound(block.begin(), block.end(), gap) -
                                   block.begin())};
  }

  // The heap order: by length (as keys, a strict weak order even for NaN).
  static bool shorter(const Gap& a, const Gap& b) {
    return ascending_key(a.length) < ascending_key(b.length);
  }

  void sort_in(const Gap& gap) {
    if (blocks_.empty()) {
      blocks_.emplace_back();
      blocks_.back().reserve(kMaxBlock + 1);
      blocks_.back().push_back(gap);
      lasts_.push_back(gap);
      return;
    }
    size_t b = static_cast<size_t>(std::lower_bound(lasts_.begin(), lasts_.end(), gap) -
                                   lasts_.begin());
    if (b == blocks_.size()) --b;  // larger than every gap: the last block's end
    std::vector<Gap>& block = blocks_[b];
    block.insert(std::upper_bound(block.begin(), block.end(), gap), gap);
    lasts_[b] = block.back();
    if (block.size() > kMaxBlock) {  // split in halves
      std::vector<Gap> upper;
      upper.reserve(kMaxBlock + 1);
      upper.assign(block.begin() + kMaxBlock / 2, block.end());
      block.resize(kMaxBlock / 2);
      lasts_[b] = block.back();
      lasts_.insert(lasts_.begin() + static_cast<std::ptrdiff_t>(b) + 1, upper.back());
      blocks_.insert(blocks_.begin() + static_cast<std::ptrdiff_t>(b) + 1, std::move(upper));
    }
  }

  std::vector<Gap> waiting_;  // max-heap by length
  std::vector<Gap> window_;   // scratch of take_window
  std::vector<Open> open_;
  std::vector<std::vector<Gap>> blocks_;
  std::vector<Gap> lasts_;
};

}  // namespace

Bins best_fit_decreasing_bins(const std::vector<int64_t>& lengths,
                              const std::vector<int64_t>& indices, int64_t capacity) {
  if (capacity <= 0) fail("capacity must be > 0, got " + std::to_string(capacity));
  for (const int64_t i : indices) {
    if (i < 0 || static_cast<size_t>(i) >= lengths.size()) {
      fail("index " + std::to_string(i) + " is outside the lengths");
    }
    if (lengths[i] < 0 || lengths[i] > capacity) {
      fail("sequence " + std::to_string(i) + " has " + std::to_string(lengths[i]) +
           " tokens, outside [0, capacity=" + std::to_string(capacity) + "]");
    }
  }
  std::vector<int64_t> order;
  std::vector<int64_t> bin_of(indices.size());
  int64_t num_bins = 0;
  if (index_rooms_directly(capacity, indices.size())) {
    // A counting sort by capacity - length, indices ascending within a length.
    std::vector<int64_t> first(static_cast<size_t>(capacity) + 2, 0);
    for (const int64_t i : indices) ++first[static_cast<size_t>(capacity - lengths[i]) + 1];
    for (size_t key = 1; key < first.size(); ++key) first[key] += first[key - 1];
    std::vector<int64_t> ascending(indices);
    if (!std::is_sorted(ascending.begin(), ascending.end())) {
      std::sort(ascending.begin(), ascending.end());
    }
    order.resize(indices.size());
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (const int64_t i : ascending) {
      order[static_cast<size_t>(fill[static_cast<size_t>(capacity - lengths[i])]++)] = i;
    }
    best_fit_by_room(first, capacity, bin_of, num_bins);
  } else {
    order = decreasing_length_order(lengths, indices, capacity);
    best_fit_by_set(lengths, order, capacity, bin_of, num_bins);
  }
  // Bins in creation order, each in insertion order: a stable counting sort by bin.
  Bins bins;
  bins.offsets.assign(static_cast<size_t>(num_bins) + 1, 0);
  for (const int64_t b : bin_of) ++bins.offsets[static_cast<size_t>(b) + 1];
  for (size_t b = 1; b < bins.offsets.size(); ++b) bins.offsets[b] += bins.offsets[b - 1];
  bins.items.resize(order.size());
  std::vector<int64_t> fill(bins.offsets.begin(), bins.offsets.end() - 1);
  for (size_t j = 0; j < order.size(); ++j) {
    bins.items[static_cast<size_t>(fill[static_cast<size_t>(bin_of[j])]++)] = order[j];
  }
  return bins;
}

std::vector<std::vector<int64_t>> best_fit_decreasing(const std::vector<int64_t>& lengths,
                                                      const std::vector<int64_t>& indices,
                                                      int64_t capacity) {
  const Bins bins = best_fit_decreasing_bins(lengths, indices, capacity);
  std::vector<std::vector<int64_t>> out(bins.size());
  for (size_t b = 0; b < bins.size(); ++b) {
    out[b].assign(bins.items.begin() + bins.offsets[b], bins.items.begin() + bins.offsets[b + 1]);
  }
  return out;
}

namespace {

// Packs of the ring-size-1 sequences (best-fit decreasing).
Bins pack_short_sequences(const std::vector<int64_t>& lengths,
                          const std::vector<int64_t>& ring_sizes, int64_t capacity) {
  std::vector<int64_t> short_ids;
  short_ids.reserve(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (ring_sizes[i] == 1) short_ids.push_back(static_cast<int64_t>(i));
  }
  return best_fit_decreasing_bins(lengths, short_ids, capacity);
}

// The items, the packs and one ring item per sequence of ring size > 1, in the order of
// placement: decreasing cost, then larger ring, then lower first sequence index (pack[0]
// or the ring's sequence; a total order, as first indices are distinct).
std::vector<Item> sorted_items(const Bins& packs, const std::vector<int64_t>& ring_sizes,
                               const std::vector<double>& local_cost,
                               const std::vector<double>& ring_cost) {
  const size_t n = ring_sizes.size();
  // Items in order of their first sequence index.
  std::vector<int64_t> pack_starting_at(n, -1);
  std::vector<double> pack_cost(packs.size());
  size_t rings = 0;
  for (size_t p = 0; p < packs.size(); ++p) {
    double cost = 0.0;
    for (int64_t j = packs.offsets[p]; j < packs.offsets[p + 1]; ++j) {
      cost += local_cost[static_cast<size_t>(packs.items[static_cast<size_t>(j)])];
    }
    pack_cost[p] = cost;
    pack_starting_at[static_cast<size_t>(packs.items[static_cast<size_t>(packs.offsets[p])])] =
        static_cast<int64_t>(p);
  }
  for (size_t i = 0; i < n; ++i) rings += ring_sizes[i] > 1 ? 1 : 0;
  std::vector<Item> by_first;
  by_first.reserve(packs.size() + rings);
  int64_t max_k = 1;
  for (size_t i = 0; i < n; ++i) {
    const int64_t p = pack_starting_at[i];
    if (ring_sizes[i] > 1) {
      by_first.push_back({ring_cost[i], ring_sizes[i], static_cast<int64_t>(i)});
      max_k = std::max(max_k, ring_sizes[i]);
    } else if (p >= 0) {
      by_first.push_back({pack_cost[static_cast<size_t>(p)], 1, p});
    }
  }
  // Stable radix sorts of that order by the larger ring, then by decreasing cost.
  const size_t m = by_first.size();
  std::vector<int64_t> order(m);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::vector<uint64_t> keys(m);
  for (size_t p = 0; p < m; ++p) keys[p] = static_cast<uint64_t>(max_k - by_first[p].k);
  stable_sort_by_key(order, keys);
  for (size_t p = 0; p < m; ++p) keys[p] = ~ascending_key(by_first[p].cost);
  stable_sort_by_key(order, keys);
  std::vector<Item> items(m);
  for (size_t p = 0; p < m; ++p) items[p] = by_first[static_cast<size_t>(order[p])];
  return items;
}

}  // namespace

PlanArrays balance_core_arrays(std::vector<int64_t> lengths, std::vector<int64_t> ring_sizes,
                               std::vector<double> local_cost, std::vector<double> ring_cost,
                               int64_t pool_size, int64_t capacity, double delta,
                               RingWidths widths) {
  validate(lengths, ring_sizes, local_cost, ring_cost, pool_size, capacity, delta);
  validate_widths(widths, ring_sizes, pool_size);
  const int64_t n = static_cast<int64_t>(lengths.size());

  const Bins packs = pack_short_sequences(lengths, ring_sizes, capacity);
  const std::vector<Item> items = sorted_items(packs, ring_sizes, local_cost, ring_cost);
  // The inputs are no longer needed: a lower peak of memory, fewer fresh pages.
  std::vector<int64_t>().swap(lengths);
  std::vector<int64_t>().swap(ring_sizes);
  std::vector<double>().swap(local_cost);
  std::vector<double>().swap(ring_cost);
  const size_t m = items.size();
  size_t members = 0;  // ranks over all items
  for (const Item& item : items) members += static_cast<size_t>(item.k);
  std::vector<uint64_t> keys(m);
  std::vector<int64_t> width(m);      // each item's ring size as placed
  std::vector<double> item_cost(m);   // and its per-member cost at that size

  // store: the ranks 0..pool_size-1, then each item's ring (ascending) in item order.
  std::vector<int64_t> store;
  store.reserve(static_cast<size_t>(pool_size) + members);
  FreeRanks free_at(pool_size, store);
  std::vector<int64_t> ring_begin(m);
  std::vector<double> starts(m);
  GapSet gaps;

  std::vector<double> member_times;
  std::vector<Gap> window_gaps, trial_gaps;
  for (size_t position = 0; position < m; ++position) {
    const Item& item = items[position];
    ring_begin[position] = static_cast<int64_t>(store.size());
    width[position] = item.k;
    item_cost[position] = item.cost;
    if (item.k == 1) {
      const GapSet::Position it = gaps.first_fit(item.cost);  // shortest gap that holds it
      if (gaps.found(it)) {
        const Gap gap = gaps.at(it);
        gaps.erase(it);
        const double rest = gap.length - item.cost;
        if (rest > delta) gaps.insert({rest, gap.start + item.cost, gap.rank});
        starts[position] = gap.start;
        store.push_back(gap.rank);
      } else {
        store.push_back(free_at.next_rank());
        starts[position] =
            free_at.pop_and_push_back(item.cost, static_cast<int64_t>(store.size()) - 1);
      }
    } else {
      // The k earliest ranks; the ring starts when the last of them is free. With a
      // range of widths, k is the width whose ring finishes first (ties: the narrower).
      const size_t begin = store.size();
      member_times.clear();
      int64_t k = item.k;
      double cost = item.cost;
      const size_t seq = static_cast<size_t>(item.source);
      const bool ranged = !widths.empty() && widths.offsets[seq + 1] > widths.offsets[seq];
      if (ranged) {
        const int64_t first = widths.offsets[seq];
        const int64_t count = widths.offsets[seq + 1] - first;
        const int64_t low = widths.low[seq];
        free_at.pop_many(low + count - 1, member_times);
        double finish = 0.0;
        for (int64_t j = 0; j < count; ++j) {
          const double c = widths.costs[static_cast<size_t>(first + j)];
          const double end = member_times[static_cast<size_t>(low + j - 1)] + c;
          if (j == 0 || end < finish) {
            k = low + j;
            cost = c;
            finish = end;
          }
        }
      } else {
        free_at.pop_many(k, member_times);
      }
      // Rule 8: a window of idle gaps that finishes the ring strictly earlier.
      double finish = member_times[static_cast<size_t>(k) - 1] + cost;
      bool in_gaps = false;
      double window_start = 0.0;
      const int64_t options = ranged ? widths.offsets[seq + 1] - widths.offsets[seq] : 1;
      const bool waits = member_times[static_cast<size_t>(k) - 1] - member_times[0] > delta;
      for (int64_t j = 0; j < options && waits && !gaps.empty(); ++j) {
        const int64_t w = ranged ? widths.low[seq] + j : item.k;
        const double c = ranged ? widths.costs[static_cast<size_t>(widths.offsets[seq] + j)]
                                : item.cost;
        double t = 0.0;
        if (gaps.find_window(w, c, finish, t, trial_gaps)) {
          window_gaps.swap(trial_gaps);
          finish = t + c;
          k = w;
          cost = c;
          window_start = t;
          in_gaps = true;
        }
      }
      if (in_gaps) {
        for (size_t j = 0; j < member_times.size();) {  // every popped rank goes back
          size_t e = j + 1;
          while (e < member_times.size() && member_times[e] == member_times[j]) ++e;
          free_at.push(member_times[j], static_cast<int64_t>(begin + j),
                       static_cast<int64_t>(begin + e));
          j = e;
        }
        const double t = window_start;
        for (const Gap& gap : window_gaps) gaps.erase_gap(gap);
        ring_begin[position] = static_cast<int64_t>(store.size());
        for (const Gap& gap : window_gaps) {
          if (t - gap.start > delta) gaps.insert({t - gap.start, gap.start, gap.rank});
          const double rest = gap.start + gap.length - (t + cost);
          if (rest > delta) gaps.insert({rest, t + cost, gap.rank});
          store.push_back(gap.rank);
        }
        std::sort(store.begin() + ring_begin[position], store.end());
        starts[position] = window_start;
        width[position] = k;
        item_cost[position] = cost;
        continue;
      }
      const size_t taken = begin + static_cast<size_t>(k);
      double start = member_times[0];  // max() keeps the first of equal maxima
      for (size_t j = 0; j < static_cast<size_t>(k); ++j) {
        if (member_times[j] > start) start = member_times[j];
      }
      for (size_t j = 0; j < static_cast<size_t>(k); ++j) {
        const double t = member_times[j];
        if (start - t > delta) gaps.insert({start - t, t, store[begin + j]});
      }
      // Ranks popped but not taken go back as free as they were, one group per free time
      // (they left in (time, rank) order, so each run is ascending).
      for (size_t j = static_cast<size_t>(k); j < member_times.size();) {
        size_t e = j + 1;
        while (e < member_times.size() && member_times[e] == member_times[j]) ++e;
        free_at.push(member_times[j], static_cast<int64_t>(begin + j),
                     static_cast<int64_t>(begin + e));
        j = e;
      }
      std::sort(store.begin() + static_cast<std::ptrdiff_t>(begin),
                store.begin() + static_cast<std::ptrdiff_t>(taken));
      free_at.push(start + cost, static_cast<int64_t>(begin), static_cast<int64_t>(taken));
      starts[position] = start;
      width[position] = k;
      item_cost[position] = cost;
    }
  }
  int64_t max_k = 1;
  size_t ring_ranks = 0;
  for (size_t p = 0; p < m; ++p) {
    max_k = std::max(max_k, width[p]);
    ring_ranks += static_cast<size_t>(width[p]);
  }

  // Global order: (start, larger ring first, lowest rank, item position): stable sorts of
  // the positions by lowest rank, then by the larger ring, then by start.
  std::vector<int64_t> order(m);
  std::iota(order.begin(), order.end(), int64_t{0});
  for (size_t p = 0; p < m; ++p) {
    keys[p] = static_cast<uint64_t>(store[static_cast<size_t>(ring_begin[p])]);
  }
  stable_sort_by_key(order, keys);
  for (size_t p = 0; p < m; ++p) keys[p] = static_cast<uint64_t>(max_k - width[p]);
  stable_sort_by_key(order, keys);
  for (size_t p = 0; p < m; ++p) keys[p] = ascending_key(starts[p]);
  stable_sort_by_key(order, keys);

  PlanArrays out;
  out.starts.resize(m);
  out.costs.resize(m);
  out.ring_offsets.resize(m + 1);
  out.seq_offsets.resize(m + 1);
  out.ring_ranks.resize(ring_ranks);
  out.seq_indices.resize(static_cast<size_t>(n));
  int64_t ring_at = 0;
  int64_t seq_at = 0;
  for (size_t q = 0; q < m; ++q) {
    const size_t p = static_cast<size_t>(order[q]);
    const Item& item = items[p];
    out.starts[q] = starts[p];
    out.costs[q] = item_cost[p];
    for (int64_t j = ring_begin[p]; j < ring_begin[p] + width[p]; ++j) {
      out.ring_ranks[static_cast<size_t>(ring_at++)] = store[static_cast<size_t>(j)];
    }
    if (item.k == 1) {
      const size_t b = static_cast<size_t>(item.source);
      for (int64_t j = packs.offsets[b]; j < packs.offsets[b + 1]; ++j) {
        out.seq_indices[static_cast<size_t>(seq_at++)] = packs.items[static_cast<size_t>(j)];
      }
    } else {
      out.seq_indices[static_cast<size_t>(seq_at++)] = item.source;
    }
    out.ring_offsets[q + 1] = ring_at;
    out.seq_offsets[q + 1] = seq_at;
  }
  return out;
}

std::vector<Placement> balance_core(const std::vector<int64_t>& lengths,
                                    const std::vector<int64_t>& ring_sizes,
                                    const std::vector<double>& local_cost,
                                    const std::vector<double>& ring_cost, int64_t pool_size,
                                    int64_t capacity, double delta, const RingWidths& widths) {
  const PlanArrays plan = balance_core_arrays(lengths, ring_sizes, local_cost, ring_cost,
                                              pool_size, capacity, delta, widths);
  std::vector<Placement> out(plan.size());
  for (size_t q = 0; q < plan.size(); ++q) {
    Placement& p = out[q];
    p.start = plan.starts[q];
    p.cost = plan.costs[q];
    p.ring.assign(plan.ring_ranks.begin() + plan.ring_offsets[q],
                  plan.ring_ranks.begin() + plan.ring_offsets[q + 1]);
    p.seq_indices.assign(plan.seq_indices.begin() + plan.seq_offsets[q],
                         plan.seq_indices.begin() + plan.seq_offsets[q + 1]);
  }
  return out;
}

}  // namespace planner
}  // namespace megatron_hdp
