// The balance scheduler core; see balance.h and megatron_hdp/scheduler/balance.py (the
// specification). Every comparison and every floating-point operation below mirrors the
// reference in kind and order, so plans are identical bit for bit.
#include "balance.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>
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
  int64_t first;   // first sequence index (pack[0] or the ring sequence)
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

// (free time, rank); the heap's order is the reference's tuple order.
using FreeSlot = std::pair<double, int64_t>;

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
    const std::string seq = "sequence " + std::to_string(i);
    if (lengths[i] < 0) fail(seq + " has a negative length " + std::to_string(lengths[i]));
    const int64_t k = ring_sizes[i];
    if (k < 1 || k > pool_size) {
      fail(seq + " has ring size " + std::to_string(k) + ", outside [1, pool_size=" +
           std::to_string(pool_size) + "]");
    }
    if (k == 1) {
      if (lengths[i] > capacity) {
        fail(seq + " has ring size 1 but " + std::to_string(lengths[i]) +
             " tokens, more than the capacity " + std::to_string(capacity));
      }
      if (!std::isfinite(local_cost[i])) fail(seq + " has a non-finite local_cost");
    } else if (!std::isfinite(ring_cost[i])) {
      fail(seq + " has a non-finite ring_cost");
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

}  // namespace

std::vector<std::vector<int64_t>> best_fit_decreasing(const std::vector<int64_t>& lengths,
                                                      const std::vector<int64_t>& indices,
                                                      int64_t capacity) {
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
  const std::vector<int64_t> order = decreasing_length_order(lengths, indices, capacity);
  std::vector<std::vector<int64_t>> bins;
  std::set<std::pair<int64_t, int64_t>> rooms;  // (room, bin id); bin ids are unique
  for (const int64_t i : order) {
    const int64_t size = lengths[i];
    auto it = rooms.lower_bound({size, std::numeric_limits<int64_t>::min()});
    if (it == rooms.end()) {
      bins.push_back({i});
      rooms.emplace(capacity - size, static_cast<int64_t>(bins.size()) - 1);
    } else {
      auto node = rooms.extract(it);  // reuse the node: no allocation per item
      node.value().first -= size;
      bins[static_cast<size_t>(node.value().second)].push_back(i);
      rooms.insert(std::move(node));
    }
  }
  return bins;
}

std::vector<Placement> balance_core(const std::vector<int64_t>& lengths,
                                    const std::vector<int64_t>& ring_sizes,
                                    const std::vector<double>& local_cost,
                                    const std::vector<double>& ring_cost, int64_t pool_size,
                                    int64_t capacity, double delta) {
  validate(lengths, ring_sizes, local_cost, ring_cost, pool_size, capacity, delta);
  const int64_t n = static_cast<int64_t>(lengths.size());

  // Items: packs of the ring-size-1 sequences, then one ring item per longer sequence.
  std::vector<int64_t> short_ids;
  for (int64_t i = 0; i < n; ++i) {
    if (ring_sizes[i] == 1) short_ids.push_back(i);
  }
  std::vector<std::vector<int64_t>> packs = best_fit_decreasing(lengths, short_ids, capacity);
  std::vector<Item> items;
  items.reserve(packs.size() + static_cast<size_t>(n - static_cast<int64_t>(short_ids.size())));
  for (size_t p = 0; p < packs.size(); ++p) {
    double cost = 0.0;
    for (const int64_t i : packs[p]) cost += local_cost[i];
    items.push_back({cost, 1, packs[p][0], static_cast<int64_t>(p)});
  }
  for (int64_t i = 0; i < n; ++i) {
    if (ring_sizes[i] > 1) items.push_back({ring_cost[i], ring_sizes[i], i, i});
  }
  // Decreasing cost, then larger ring, then lower first index (a total order: first
  // indices are distinct).
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.cost != b.cost) return a.cost > b.cost;
    if (a.k != b.k) return a.k > b.k;
    return a.first < b.first;
  });

  std::vector<FreeSlot> heap_storage;
  heap_storage.reserve(static_cast<size_t>(pool_size));
  for (int64_t r = 0; r < pool_size; ++r) heap_storage.emplace_back(0.0, r);
  std::priority_queue<FreeSlot, std::vector<FreeSlot>, std::greater<FreeSlot>> free_at(
      std::greater<FreeSlot>(), std::move(heap_storage));
  std::multiset<Gap> gaps;
  const Gap probe_floor{0.0, -std::numeric_limits<double>::infinity(),
                        std::numeric_limits<int64_t>::min()};

  std::vector<Placement> placed(items.size());
  std::vector<FreeSlot> members;
  for (size_t position = 0; position < items.size(); ++position) {
    const Item& item = items[position];
    Placement& out = placed[position];
    out.cost = item.cost;
    if (item.k == 1) {
      Gap probe = probe_floor;
      probe.length = item.cost;
      auto it = gaps.lower_bound(probe);  // shortest gap that holds it
      if (it != gaps.end()) {
        const Gap gap = *it;
        gaps.erase(it);
        const double rest = gap.length - item.cost;
        if (rest > delta) gaps.insert({rest, gap.start + item.cost, gap.rank});
        out.start = gap.start;
        out.ring.assign(1, gap.rank);
      } else {
        const FreeSlot slot = free_at.top();
        free_at.pop();
        free_at.emplace(slot.first + item.cost, slot.second);
        out.start = slot.first;
        out.ring.assign(1, slot.second);
      }
      out.seq_indices = std::move(packs[static_cast<size_t>(item.source)]);
    } else {
      members.clear();
      for (int64_t m = 0; m < item.k; ++m) {
        members.push_back(free_at.top());
        free_at.pop();
      }
      double start = members[0].first;  // max() keeps the first of equal maxima
      for (const FreeSlot& m : members) {
        if (m.first > start) start = m.first;
      }
      out.ring.reserve(members.size());
      for (const FreeSlot& m : members) {
        if (start - m.first > delta) gaps.insert({start - m.first, m.first, m.second});
        free_at.emplace(start + item.cost, m.second);
        out.ring.push_back(m.second);
      }
      std::sort(out.ring.begin(), out.ring.end());
      out.start = start;
      out.seq_indices.assign(1, item.source);
    }
  }

  // Global order: (start, larger ring first, lowest rank, item position).
  std::vector<size_t> order(placed.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&placed](size_t a, size_t b) {
    const Placement& pa = placed[a];
    const Placement& pb = placed[b];
    if (pa.start != pb.start) return pa.start < pb.start;
    if (pa.ring.size() != pb.ring.size()) return pa.ring.size() > pb.ring.size();
    if (pa.ring[0] != pb.ring[0]) return pa.ring[0] < pb.ring[0];
    return a < b;
  });
  std::vector<Placement> result;
  result.reserve(placed.size());
  for (const size_t i : order) result.push_back(std::move(placed[i]));
  return result;
}

}  // namespace planner
}  // namespace megatron_hdp
