// pybind11 module megatron_hdp._planner: the C++ balance core as a drop-in for
// megatron_hdp.scheduler.balance.balance_core (same signature, returns a list of
// megatron_hdp.scheduler.balance.Placement with `ring`/`seq_indices` as tuples of ints).
// std::invalid_argument from the core reaches Python as ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "balance.h"

namespace py = pybind11;

namespace {

// The Python Placement class, imported once per interpreter.
py::object placement_class() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
  return storage
      .call_once_and_store_result([]() {
        return py::module_::import("megatron_hdp.scheduler.balance").attr("Placement");
      })
      .get_stored();
}

py::tuple int_tuple(const std::vector<int64_t>& values) {
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(static_cast<long long>(values[i]));
    if (item == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), item);  // steals the reference
  }
  return out;
}

py::list balance_core(const std::vector<int64_t>& lengths, const std::vector<int64_t>& ring_sizes,
                      const std::vector<double>& local_cost, const std::vector<double>& ring_cost,
                      int64_t pool_size, int64_t capacity, double delta) {
  const py::object placement = placement_class();
  std::vector<megatron_hdp::planner::Placement> placed;
  {
    py::gil_scoped_release release;
    placed = megatron_hdp::planner::balance_core(lengths, ring_sizes, local_cost, ring_cost,
                                                 pool_size, capacity, delta);
  }
  py::list out(placed.size());
  for (size_t i = 0; i < placed.size(); ++i) {
    const auto& p = placed[i];
    py::object obj = placement(p.start, p.cost, int_tuple(p.ring), int_tuple(p.seq_indices));
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), obj.release().ptr());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() =
      "C++ balance scheduler core: a drop-in for "
      "megatron_hdp.scheduler.balance.balance_core (identical plans).";
  m.def("balance_core", &balance_core, py::arg("lengths"), py::arg("ring_sizes"),
        py::arg("local_cost"), py::arg("ring_cost"), py::kw_only(), py::arg("pool_size"),
        py::arg("capacity"), py::arg("delta") = 0.0,
        "Place every sequence; return Placement objects sorted into the global order.\n\n"
        "Same contract as megatron_hdp.scheduler.balance.balance_core; raises ValueError "
        "for invalid input. The GIL is released while the plan is computed.");
}
