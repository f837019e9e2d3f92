// Spreads attention off the busiest rank of a placed plan, within a step-time limit.
//
// Same contract as the pure-Python specification
// megatron_hdp/scheduler/attention_spread.py::spread_attention_reference: identical moves,
// rings and starts bit for bit (plain IEEE double arithmetic in the reference's order).
#ifndef MEGATRON_HDP_CSRC_PLANNER_ATTENTION_SPREAD_H_
#define MEGATRON_HDP_CSRC_PLANNER_ATTENTION_SPREAD_H_

#include <cstdint>
#include <vector>

namespace megatron_hdp {
namespace planner {

struct SpreadResult {
  std::vector<double> starts;       // re-timed starts, one per item (global order)
  std::vector<int64_t> ring_ranks;  // the rings after the moves, each ascending
  int64_t work = 0;                 // budget spent
};

// Item p (global order) costs costs[p] per member, runs on
// ring_ranks[ring_offsets[p]:ring_offsets[p+1]] (ascending) and weighs weights[p]
// (its sum of s^2; each member carries weights[p] / width). Off the rank with the most
// weight, memberships move to other ranks (alone, or traded with a member of an item on the
// other rank) while the sum of squared loads falls and the re-timed plan ends within
// `limit`, best move first. `budget` bounds the work: a unit per candidate move considered,
// items + memberships per re-timing (a re-timing that would pass it is not started; a
// round of candidates once started is counted whole).
//
// Throws std::invalid_argument for: arrays of unequal length, malformed offsets, an empty
// ring, a rank outside [0, pool_size) or repeated in a ring, pool_size < 1, a negative or
// non-finite cost or weight, a NaN limit, or budget < 0.
SpreadResult spread_attention(const std::vector<double>& costs,
                              const std::vector<int64_t>& ring_offsets,
                              const std::vector<int64_t>& ring_ranks,
                              const std::vector<double>& weights, int64_t pool_size,
                              double limit, int64_t budget);

}  // namespace planner
}  // namespace megatron_hdp

#endif  // MEGATRON_HDP_CSRC_PLANNER_ATTENTION_SPREAD_H_
