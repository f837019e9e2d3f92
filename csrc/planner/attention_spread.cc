// See attention_spread.h. Mirrors spread_attention_reference step by step: the same loads
// summed in the same order, the same candidate moves and keys, the same re-timing.
#include "attention_spread.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace megatron_hdp {
namespace planner {
namespace {

constexpr double kMinGain = 1e-12;  // attention_spread.MIN_GAIN

using Rings = std::vector<std::vector<int64_t>>;

// The end of the plan with these rings, items run in the global order; starts if asked.
double retime(const std::vector<double>& costs, const Rings& rings, int64_t pool_size,
              std::vector<double>* starts) {
  std::vector<double> ready(static_cast<size_t>(pool_size), 0.0);
  double end_max = 0.0;
  for (size_t p = 0; p < rings.size(); ++p) {
    double start = ready[static_cast<size_t>(rings[p][0])];
    for (int64_t r : rings[p]) start = std::max(start, ready[static_cast<size_t>(r)]);
    const double end = start + costs[p];
    for (int64_t r : rings[p]) ready[static_cast<size_t>(r)] = end;
    if (starts != nullptr) (*starts)[p] = start;
    end_max = std::max(end_max, end);
  }
  return end_max;
}

// `ring` with member `from` replaced by `to`, kept ascending.
void swap_member(std::vector<int64_t>* ring, int64_t from, int64_t to) {
  for (int64_t& r : *ring) {
    if (r == from) r = to;
  }
  std::sort(ring->begin(), ring->end());
}

struct Move {
  double peak;
  double neg_gain;
  int64_t p, b, q;
  double d;
  bool operator<(const Move& o) const {
    return std::tie(peak, neg_gain, p, b, q) < std::tie(o.peak, o.neg_gain, o.p, o.b, o.q);
  }
};

void check(const std::vector<double>& costs, const std::vector<int64_t>& offsets,
           const std::vector<int64_t>& ranks, const std::vector<double>& weights,
           int64_t pool_size, double limit, int64_t budget) {
  const size_t n = costs.size();
  if (pool_size < 1) throw std::invalid_argument("pool_size must be >= 1");
  if (weights.size() != n || offsets.size() != n + 1) {
    throw std::invalid_argument("costs, weights and ring_offsets (one entry more) differ in length");
  }
  if (offsets[0] != 0 || offsets[n] != static_cast<int64_t>(ranks.size())) {
    throw std::invalid_argument("ring_offsets must start at 0 and end at len(ring_ranks)");
  }
  std::vector<char> seen(static_cast<size_t>(pool_size), 0);
  for (size_t p = 0; p < n; ++p) {
    if (!(std::isfinite(costs[p]) && costs[p] >= 0.0)) {
      throw std::invalid_argument("cost of item " + std::to_string(p) + " is negative or not finite");
    }
    if (!(std::isfinite(weights[p]) && weights[p] >= 0.0)) {
      throw std::invalid_argument("weight of item " + std::to_string(p) +
                                  " is negative or not finite");
    }
    if (offsets[p + 1] <= offsets[p]) {
      throw std::invalid_argument("item " + std::to_string(p) + " has an empty ring");
    }
    for (int64_t j = offsets[p]; j < offsets[p + 1]; ++j) {
      const int64_t r = ranks[static_cast<size_t>(j)];
      if (r < 0 || r >= pool_size || seen[static_cast<size_t>(r)]) {
        throw std::invalid_argument("item " + std::to_string(p) + " names rank " +
                                    std::to_string(r) + " outside the pool or twice");
      }
      seen[static_cast<size_t>(r)] = 1;
    }
    for (int64_t j = offsets[p]; j < offsets[p + 1]; ++j) seen[static_cast<size_t>(ranks[j])] = 0;
  }
  if (std::isnan(limit)) throw std::invalid_argument("limit is NaN");
  if (budget < 0) throw std::invalid_argument("budget must be >= 0");
}

}  // namespace

SpreadResult spread_attention(const std::vector<double>& costs,
                              const std::vector<int64_t>& ring_offsets,
                              const std::vector<int64_t>& ring_ranks,
                              const std::vector<double>& weights, int64_t pool_size,
                              double limit, int64_t budget) {
  check(costs, ring_offsets, ring_ranks, weights, pool_size, limit, budget);
  const size_t n = costs.size();
  const size_t pool = static_cast<size_t>(pool_size);
  Rings rings(n);
  std::vector<double> shares(n);
  std::vector<double> load(pool, 0.0);
  for (size_t p = 0; p < n; ++p) {
    rings[p].assign(ring_ranks.begin() + ring_offsets[p], ring_ranks.begin() + ring_offsets[p + 1]);
    shares[p] = weights[p] / static_cast<double>(rings[p].size());
    for (int64_t r : rings[p]) load[static_cast<size_t>(r)] += shares[p];
  }
  SpreadResult out;
  std::vector<std::vector<int64_t>> items_on(pool);
  std::vector<char> in_p(pool), has_a(n);
  std::vector<Move> moves;
  const int64_t eval_work = static_cast<int64_t>(n + ring_ranks.size());
  while (out.work < budget) {
    std::vector<int64_t> order(pool);
    for (size_t r = 0; r < pool; ++r) order[r] = static_cast<int64_t>(r);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return load[x] > load[y]; });
    const int64_t a = order[0];
    const double la = load[a];
    for (auto& v : items_on) v.clear();
    for (size_t p = 0; p < n; ++p) {
      for (int64_t r : rings[p]) items_on[static_cast<size_t>(r)].push_back(static_cast<int64_t>(p));
    }
    std::fill(has_a.begin(), has_a.end(), 0);
    for (int64_t p : items_on[a]) has_a[p] = 1;
    moves.clear();
    for (int64_t p : items_on[a]) {
      for (int64_t r : rings[p]) in_p[r] = 1;
      for (int64_t b = 0; b < pool_size; ++b) {
        if (in_p[b]) continue;
        double other = -INFINITY;  // the highest load off a and b
        for (size_t t = 0; t < std::min<size_t>(3, pool); ++t) {
          if (order[t] != a && order[t] != b) {
            other = load[order[t]];
            break;
          }
        }
        const double lb = load[b];
        auto consider = [&](int64_t q, double d) {
          ++out.work;
          if (d <= 0.0) return;
          const double new_a = la - d, new_b = lb + d;
          const double gain = (la * la + lb * lb) - (new_a * new_a + new_b * new_b);
          if (gain <= kMinGain * la * la) return;
          const double peak = std::max(std::max(new_a, new_b), other);
          moves.push_back(Move{peak, -gain, p, b, q, d});
        };
        consider(-1, shares[p]);
        for (int64_t q : items_on[b]) {
          if (!has_a[q]) consider(q, shares[p] - shares[q]);
        }
      }
      for (int64_t r : rings[p]) in_p[r] = 0;
    }
    std::sort(moves.begin(), moves.end());
    bool taken = false;
    for (const Move& m : moves) {
      if (out.work + eval_work > budget) break;
      const std::vector<int64_t> old_p = rings[m.p];
      const std::vector<int64_t> old_q = m.q >= 0 ? rings[m.q] : std::vector<int64_t>();
      swap_member(&rings[m.p], a, m.b);
      if (m.q >= 0) swap_member(&rings[m.q], m.b, a);
      const double end = retime(costs, rings, pool_size, nullptr);
      out.work += eval_work;
      if (end <= limit) {
        load[a] -= m.d;
        load[m.b] += m.d;
        taken = true;
        break;
      }
      rings[m.p] = old_p;
      if (m.q >= 0) rings[m.q] = old_q;
    }
    if (!taken) break;
  }
  out.starts.assign(n, 0.0);
  retime(costs, rings, pool_size, &out.starts);
  out.ring_ranks.reserve(ring_ranks.size());
  for (const auto& ring : rings) out.ring_ranks.insert(out.ring_ranks.end(), ring.begin(), ring.end());
  return out;
}

}  // namespace planner
}  // namespace megatron_hdp
