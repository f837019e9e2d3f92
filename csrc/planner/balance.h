// The balance scheduler core (ByteScale Alg. 2, DP-Balance) in C++17.
//
// Same contract as the pure-Python specification
// megatron_hdp/scheduler/balance.py::balance_core: identical placements, identical start
// times bit for bit (plain IEEE double arithmetic in the reference's order) and the same
// global order. No Python dependency; bindings.cc exposes it as megatron_hdp._planner.
#ifndef MEGATRON_HDP_CSRC_PLANNER_BALANCE_H_
#define MEGATRON_HDP_CSRC_PLANNER_BALANCE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace megatron_hdp {
namespace planner {

// One placed item: its start, per-member cost, ring (ranks ascending) and sequences
// (a pack's sequences in packing order; a ring item holds exactly one sequence).
struct Placement {
  double start = 0.0;
  double cost = 0.0;
  std::vector<int64_t> ring;
  std::vector<int64_t> seq_indices;
};

// All placements of a plan as flat arrays, in the global order. Placement p starts at
// starts[p], costs costs[p] per member, runs on ring_ranks[ring_offsets[p]:ring_offsets[p+1]]
// (ascending) and holds seq_indices[seq_offsets[p]:seq_offsets[p+1]] (packing order).
// ring_offsets and seq_offsets have size() + 1 entries and start at 0.
struct PlanArrays {
  std::vector<double> starts;
  std::vector<double> costs;
  std::vector<int64_t> ring_offsets{0};
  std::vector<int64_t> ring_ranks;
  std::vector<int64_t> seq_offsets{0};
  std::vector<int64_t> seq_indices;
  size_t size() const { return starts.size(); }
};

// Widths a ring sequence may run on (balance.py rule 7): sequence i may take any width
// low[i] + j for j < offsets[i + 1] - offsets[i], at per-member cost costs[offsets[i] + j].
// Empty (no offsets): every ring keeps its ring size. An empty range keeps it too.
struct RingWidths {
  std::vector<int64_t> low;
  std::vector<int64_t> offsets;
  std::vector<double> costs;
  bool empty() const { return offsets.empty(); }
};

// Bins of a packing as flat arrays: bin b holds items[offsets[b]:offsets[b+1]].
struct Bins {
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> items;
  size_t size() const { return offsets.size() - 1; }
};

// Best-fit decreasing: packs `indices` (sizes from `lengths`) into bins of `capacity`.
// Items are taken by (length desc, index asc); each goes into the bin with the least room
// that still holds it (ties: the earliest bin). Bins are returned in creation order, each
// bin's indices in insertion order. O(n + capacity) with rooms indexed directly (per-room
// min-heaps of bin ids and a two-level bitset over rooms) when the capacity is small next
// to n, else O(n log n) with an ordered set. Throws std::invalid_argument unless
// capacity > 0 and every index is in range with a size in [0, capacity].
Bins best_fit_decreasing_bins(const std::vector<int64_t>& lengths,
                              const std::vector<int64_t>& indices, int64_t capacity);

// The same packing as a vector of bins.
std::vector<std::vector<int64_t>> best_fit_decreasing(const std::vector<int64_t>& lengths,
                                                      const std::vector<int64_t>& indices,
                                                      int64_t capacity);

// Places every sequence and returns the placements in the global order
// (start, larger ring first, lowest rank, item position) as flat arrays.
//
// lengths: tokens of each sequence; ring_sizes: ranks each sequence needs (1 = packed);
// local_cost: cost of a sequence alone on one rank (summed for packs); ring_cost: per-member
// cost on its ring (used when the ring size is > 1); pool_size: ranks in the pool;
// capacity: tokens per rank per micro-batch; delta: idle gaps at most this long stay idle;
// widths: the widths each ring sequence may run on (chosen at placement: the width whose
// ring finishes first, ties to the narrower; nominal ring_sizes/ring_cost set the order).
//
// The inputs are taken by value: move them in and they are freed as soon as they are read.
//
// Throws std::invalid_argument for: arrays of unequal length, pool_size < 1, capacity <= 0,
// a negative length, a ring size outside [1, pool_size], a ring-size-1 sequence longer than
// the capacity, a non-finite cost that the plan would use, a NaN delta, or widths that are
// malformed, outside [2, pool_size] or given to a sequence of ring size 1.
PlanArrays balance_core_arrays(std::vector<int64_t> lengths, std::vector<int64_t> ring_sizes,
                               std::vector<double> local_cost, std::vector<double> ring_cost,
                               int64_t pool_size, int64_t capacity, double delta = 0.0,
                               RingWidths widths = {});

// The same plan as one Placement per item, in the global order.
std::vector<Placement> balance_core(const std::vector<int64_t>& lengths,
                                    const std::vector<int64_t>& ring_sizes,
                                    const std::vector<double>& local_cost,
                                    const std::vector<double>& ring_cost, int64_t pool_size,
                                    int64_t capacity, double delta = 0.0,
                                    const RingWidths& widths = {});

}  // namespace planner
}  // namespace megatron_hdp

#endif  // MEGATRON_HDP_CSRC_PLANNER_BALANCE_H_
