// pybind11 module megatron_hdp._planner: the C++ balance core as a drop-in for
// megatron_hdp.scheduler.balance.balance_core (same signature, returns a list of
// megatron_hdp.scheduler.balance.Placement with `ring`/`seq_indices` as tuples of ints),
// and balance_core_arrays, the same plan as flat numpy arrays (no Python object per
// placement). std::invalid_argument from the core reaches Python as ValueError.
//
// Inputs are numpy arrays (read with one copy, no Python object per element; any integer
// dtype for lengths/ring_sizes, any real dtype for the costs) or sequences (lists and
// tuples of exact ints/floats are read directly; anything else element by element).
#include <Python.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_spread.h"
#include "balance.h"

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------ inputs

template <typename T>
bool read_exact(PyObject* item, T* out);

template <>
bool read_exact<int64_t>(PyObject* item, int64_t* out) {
  if (!PyLong_CheckExact(item)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (overflow != 0) return false;
  *out = static_cast<int64_t>(v);
  return true;
}

template <>
bool read_exact<double>(PyObject* item, double* out) {
  if (PyFloat_CheckExact(item)) {
    *out = PyFloat_AS_DOUBLE(item);
    return true;
  }
  if (!PyLong_CheckExact(item)) return false;
  const double v = PyLong_AsDouble(item);  // float(int): correctly rounded
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return true;
}

// The values of a 1-d numpy array, a list/tuple or any other sequence, as a vector.
// Integer inputs must have an integer dtype (a float array raises TypeError, as a float
// element does); cost inputs any boolean, integer or floating dtype.
template <typename T>
std::vector<T> read_input(py::handle obj, const char* name) {
  constexpr bool kInts = std::is_same<T, int64_t>::value;
  std::vector<T> out;
  if (py::isinstance<py::array>(obj)) {
    const auto arr = py::reinterpret_borrow<py::array>(obj);
    if (arr.ndim() != 1) {
      throw py::type_error(std::string(name) + " must be one-dimensional, got " +
                           std::to_string(arr.ndim()) + " dimensions");
    }
    const char kind = arr.dtype().kind();
    const bool ok = kInts ? (kind == 'i' || kind == 'u')
                          : (kind == 'b' || kind == 'i' || kind == 'u' || kind == 'f');
    if (!ok && arr.size() > 0) {
      throw py::type_error(std::string(name) + " must have " +
                           (kInts ? "an integer" : "a real") + " dtype, got " +
                           std::string(py::str(arr.dtype())));
    }
    const auto values = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(obj);
    if (!values) throw py::error_already_set();
    out.resize(static_cast<size_t>(values.size()));
    if (!out.empty()) std::memcpy(out.data(), values.data(), out.size() * sizeof(T));
    return out;
  }
  if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj.ptr());
    PyObject** items = PySequence_Fast_ITEMS(obj.ptr());
    out.resize(static_cast<size_t>(n));
    Py_ssize_t i = 0;
    while (i < n && read_exact<T>(items[i], &out[static_cast<size_t>(i)])) ++i;
    if (i == n) return out;
  }
  py::detail::make_caster<std::vector<T>> caster;  // element by element, as before
  if (!caster.load(obj, true)) {
    throw py::type_error(std::string(name) + " must be a sequence of " +
                         (kInts ? "ints" : "floats") + " or a numpy array, got " +
                         std::string(py::str(py::type::handle_of(obj))));
  }
  return py::detail::cast_op<std::vector<T>&&>(std::move(caster));
}

// `widths`: None or a (low, offsets, costs) sequence of three arrays.
megatron_hdp::planner::RingWidths read_widths(py::handle widths) {
  megatron_hdp::planner::RingWidths out;
  if (widths.is_none()) return out;
  const auto parts = py::reinterpret_borrow<py::sequence>(widths);
  if (parts.size() != 3) {
    throw py::value_error("widths must be None or (low, offsets, costs), got " +
                          std::to_string(parts.size()) + " parts");
  }
  out.low = read_input<int64_t>(parts[0], "widths low");
  out.offsets = read_input<int64_t>(parts[1], "widths offsets");
  out.costs = read_input<double>(parts[2], "widths costs");
  if (out.offsets.empty()) throw py::value_error("widths offsets must hold n + 1 entries");
  return out;
}

megatron_hdp::planner::PlanArrays plan(py::handle lengths, py::handle ring_sizes,
                                       py::handle local_cost, py::handle ring_cost,
                                       int64_t pool_size, int64_t capacity, double delta,
                                       py::handle widths) {
  std::vector<int64_t> l = read_input<int64_t>(lengths, "lengths");
  std::vector<int64_t> k = read_input<int64_t>(ring_sizes, "ring_sizes");
  std::vector<double> lc = read_input<double>(local_cost, "local_cost");
  std::vector<double> rc = read_input<double>(ring_cost, "ring_cost");
  megatron_hdp::planner::RingWidths w = read_widths(widths);
  py::gil_scoped_release release;  // the inputs are copies: other threads may run freely
  return megatron_hdp::planner::balance_core_arrays(std::move(l), std::move(k), std::move(lc),
                                                    std::move(rc), pool_size, capacity, delta,
                                                    std::move(w));
}

// ------------------------------------------------------------------------------ outputs

// The Python Placement class and how to make instances of it cheaply.
//
// Placement is a frozen dataclass whose generated __init__ does object.__setattr__ of
// start, cost, ring and seq_indices, in that order, on object.__new__(Placement). The
// direct path does exactly that from C (the attribute names interned once) and skips the
// interpreted __init__. It is used only if the class is still such a dataclass (no
// __post_init__, no own __new__ or __slots__, a generated __init__, these four fields) and
// a first object made both ways compares equal with the same attributes; else every
// object is made by calling the class.
struct PlacementMaker {
  py::object cls;
  bool direct = false;
  py::object names[4];
  py::tuple no_args;

  // A new Placement(start, cost, ring, seqs).
  py::object make(const py::object& start, const py::object& cost, const py::object& ring,
                  const py::object& seqs) const {
    if (!direct) return cls(start, cost, ring, seqs);
    auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
    py::object obj = py::reinterpret_steal<py::object>(type->tp_new(type, no_args.ptr(), nullptr));
    if (!obj) throw py::error_already_set();
    const py::object* values[4] = {&start, &cost, &ring, &seqs};
    for (int f = 0; f < 4; ++f) {
      if (PyObject_GenericSetAttr(obj.ptr(), names[f].ptr(), values[f]->ptr()) != 0) {
        throw py::error_already_set();
      }
    }
    return obj;
  }
};

bool is_plain_dataclass(const py::object& cls, const char* const* fields) {
  if (!PyType_Check(cls.ptr()) || Py_TYPE(cls.ptr()) != &PyType_Type) return false;
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  if (type->tp_new != PyBaseObject_Type.tp_new || type->tp_dictoffset == 0) return false;
  const py::module_ dataclasses = py::module_::import("dataclasses");
  if (!dataclasses.attr("is_dataclass")(cls).cast<bool>()) return false;
  if (py::hasattr(cls, "__post_init__") || py::hasattr(cls, "__slots__")) return false;
  const py::object params = cls.attr("__dataclass_params__");
  if (!params.attr("init").cast<bool>() || !params.attr("frozen").cast<bool>()) return false;
  const py::dict own = cls.attr("__dict__");
  if (!own.contains("__init__")) return false;
  const py::object init = own["__init__"];
  if (!py::hasattr(init, "__code__")) return false;
  const py::object code = init.attr("__code__");
  if (code.attr("co_filename").cast<std::string>() != "<string>" ||
      code.attr("co_name").cast<std::string>() != "__init__") {
    return false;  // not the __init__ that dataclasses generates (with exec)
  }
  py::list names;
  for (const py::handle f : dataclasses.attr("fields")(cls)) names.append(f.attr("name"));
  py::list expected;
  for (int f = 0; f < 4; ++f) expected.append(py::str(fields[f]));
  return names.equal(expected);
}

const PlacementMaker& placement_maker() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<PlacementMaker> storage;
  return storage
      .call_once_and_store_result([]() {
        static const char* const kFields[4] = {"start", "cost", "ring", "seq_indices"};
        PlacementMaker maker;
        maker.cls = py::module_::import("megatron_hdp.scheduler.balance").attr("Placement");
        for (int f = 0; f < 4; ++f) {
          PyObject* name = PyUnicode_InternFromString(kFields[f]);
          if (name == nullptr) throw py::error_already_set();
          maker.names[f] = py::reinterpret_steal<py::object>(name);
        }
        maker.no_args = py::tuple(0);
        maker.direct = is_plain_dataclass(maker.cls, kFields);
        if (maker.direct) {  // the self-test
          const py::object args[4] = {py::float_(1.5), py::float_(-0.0), py::make_tuple(3, 4),
                                      py::make_tuple(7)};
          const py::object made = maker.make(args[0], args[1], args[2], args[3]);
          const py::object called = maker.cls(args[0], args[1], args[2], args[3]);
          const py::object vars = py::module_::import("builtins").attr("vars");
          maker.direct = made.equal(called) && vars(made).equal(vars(called)) &&
                         py::list(vars(made)).equal(py::list(vars(called)));
        }
        return maker;
      })
      .get_stored();
}

// Python ints for ranks, each made once per call (a rank is in many rings) unless the pool
// is much larger than the plan's rings.
class RankInts {
 public:
  RankInts(int64_t pool_size, size_t ring_ranks)
      : ints_(static_cast<uint64_t>(pool_size) <= ring_ranks + 65536 ? pool_size : 0,
              nullptr) {}
  ~RankInts() {
    for (PyObject* v : ints_) Py_XDECREF(v);
  }
  RankInts(const RankInts&) = delete;
  RankInts& operator=(const RankInts&) = delete;

  // A new reference to the int `rank`.
  PyObject* get(int64_t rank) {
    if (static_cast<size_t>(rank) >= ints_.size()) return make(rank);
    PyObject*& slot = ints_[static_cast<size_t>(rank)];
    if (slot == nullptr) slot = make(rank);
    Py_INCREF(slot);
    return slot;
  }

 private:
  static PyObject* make(int64_t value) {
    PyObject* v = PyLong_FromLongLong(static_cast<long long>(value));
    if (v == nullptr) throw py::error_already_set();
    return v;
  }

  std::vector<PyObject*> ints_;
};

// Pauses the cyclic garbage collector while the placements are made (the GIL is held
// throughout, and the previous state is restored): they hold no cycles, and the
// collections that hundreds of thousands of new tuples and objects would trigger scan them
// over and over (about a sixth of the old call's time at 16,384 ranks).
class GcPause {
 public:
  GcPause() : was_enabled_(PyGC_Disable()) {}
  ~GcPause() {
    if (was_enabled_) PyGC_Enable();
  }
  GcPause(const GcPause&) = delete;
  GcPause& operator=(const GcPause&) = delete;

 private:
  int was_enabled_;
};

py::object steal(PyObject* obj) {
  if (obj == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(obj);
}

py::list balance_core(py::handle lengths, py::handle ring_sizes, py::handle local_cost,
                      py::handle ring_cost, int64_t pool_size, int64_t capacity, double delta,
                      py::handle widths) {
  const PlacementMaker& maker = placement_maker();
  const megatron_hdp::planner::PlanArrays placed =
      plan(lengths, ring_sizes, local_cost, ring_cost, pool_size, capacity, delta, widths);
  const size_t m = placed.size();
  GcPause pause;
  RankInts ranks(pool_size, placed.ring_ranks.size());
  py::list out(m);
  for (size_t q = 0; q < m; ++q) {
    const int64_t r0 = placed.ring_offsets[q];
    const int64_t r1 = placed.ring_offsets[q + 1];
    py::object ring = steal(PyTuple_New(static_cast<Py_ssize_t>(r1 - r0)));
    for (int64_t j = r0; j < r1; ++j) {
      PyTuple_SET_ITEM(ring.ptr(), static_cast<Py_ssize_t>(j - r0),
                       ranks.get(placed.ring_ranks[static_cast<size_t>(j)]));
    }
    const int64_t s0 = placed.seq_offsets[q];
    const int64_t s1 = placed.seq_offsets[q + 1];
    py::object seqs = steal(PyTuple_New(static_cast<Py_ssize_t>(s1 - s0)));
    for (int64_t j = s0; j < s1; ++j) {
      PyObject* v = PyLong_FromLongLong(static_cast<long long>(placed.seq_indices[j]));
      if (v == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(seqs.ptr(), static_cast<Py_ssize_t>(j - s0), v);
    }
    py::object start = steal(PyFloat_FromDouble(placed.starts[q]));
    py::object cost = steal(PyFloat_FromDouble(placed.costs[q]));
    py::object obj = maker.make(start, cost, ring, seqs);
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(q), obj.release().ptr());
  }
  return out;
}

// A 1-d numpy array that takes over the vector's buffer (no copy).
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& values) {
  auto owned = std::make_unique<std::vector<T>>(std::move(values));
  const py::ssize_t size = static_cast<py::ssize_t>(owned->size());
  T* data = owned->data();
  py::capsule owner(owned.get(), [](void* p) { delete static_cast<std::vector<T>*>(p); });
  owned.release();
  return py::array_t<T>({size}, {static_cast<py::ssize_t>(sizeof(T))}, data, owner);
}

py::tuple balance_core_arrays(py::handle lengths, py::handle ring_sizes, py::handle local_cost,
                              py::handle ring_cost, int64_t pool_size, int64_t capacity,
                              double delta, py::handle widths) {
  megatron_hdp::planner::PlanArrays placed =
      plan(lengths, ring_sizes, local_cost, ring_cost, pool_size, capacity, delta, widths);
  return py::make_tuple(to_numpy(std::move(placed.starts)), to_numpy(std::move(placed.costs)),
                        to_numpy(std::move(placed.ring_offsets)),
                        to_numpy(std::move(placed.ring_ranks)),
                        to_numpy(std::move(placed.seq_offsets)),
                        to_numpy(std::move(placed.seq_indices)));
}

// A list or tuple of exact Python ints as an int64 array, or None where any element is not
// one (bools, numpy integers, floats, ints beyond int64) or `obj` is not a list or tuple:
// the caller then takes its element-by-element path, which names the bad value.
py::object exact_int_array(py::handle obj) {
  if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr())) return py::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj.ptr());
  PyObject** items = PySequence_Fast_ITEMS(obj.ptr());
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!read_exact<int64_t>(items[i], &out[static_cast<size_t>(i)])) return py::none();
  }
  return to_numpy(std::move(out));
}

py::tuple spread_attention(py::handle costs, py::handle ring_offsets, py::handle ring_ranks,
                           py::handle weights, int64_t pool_size, double limit,
                           int64_t budget) {
  std::vector<double> c = read_input<double>(costs, "costs");
  std::vector<int64_t> o = read_input<int64_t>(ring_offsets, "ring_offsets");
  std::vector<int64_t> r = read_input<int64_t>(ring_ranks, "ring_ranks");
  std::vector<double> w = read_input<double>(weights, "weights");
  megatron_hdp::planner::SpreadResult out;
  {
    py::gil_scoped_release release;
    out = megatron_hdp::planner::spread_attention(c, o, r, w, pool_size, limit, budget);
  }
  return py::make_tuple(to_numpy(std::move(out.starts)), to_numpy(std::move(out.ring_ranks)),
                        out.work);
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() =
      "C++ balance scheduler core: a drop-in for "
      "megatron_hdp.scheduler.balance.balance_core (identical plans).";
  m.def("balance_core", &balance_core, py::arg("lengths"), py::arg("ring_sizes"),
        py::arg("local_cost"), py::arg("ring_cost"), py::kw_only(), py::arg("pool_size"),
        py::arg("capacity"), py::arg("delta") = 0.0, py::arg("widths") = py::none(),
        "Place every sequence; return Placement objects sorted into the global order.\n\n"
        "Same contract as megatron_hdp.scheduler.balance.balance_core; raises ValueError "
        "for invalid input. The inputs may be sequences or 1-d numpy arrays. The GIL is "
        "released while the plan is computed.");
  m.def("exact_int_array", &exact_int_array, py::arg("values"),
        "A list or tuple of exact ints as an int64 numpy array in one pass; None if any "
        "element is not an exact int within int64 (bools and numpy integers included) or "
        "values is not a list or tuple.");
  m.def("balance_core_arrays", &balance_core_arrays, py::arg("lengths"), py::arg("ring_sizes"),
        py::arg("local_cost"), py::arg("ring_cost"), py::kw_only(), py::arg("pool_size"),
        py::arg("capacity"), py::arg("delta") = 0.0, py::arg("widths") = py::none(),
        "The plan of balance_core as flat numpy arrays, without a Python object per "
        "placement.\n\n"
        "Returns (starts, costs, ring_offsets, ring_ranks, seq_offsets, seq_indices): "
        "placement p (in the global order) starts at starts[p] (float64), costs costs[p] "
        "per member, runs on ring_ranks[ring_offsets[p]:ring_offsets[p + 1]] and holds "
        "seq_indices[seq_offsets[p]:seq_offsets[p + 1]] (int64; the offsets have one "
        "entry more than there are placements and start at 0).");
  m.def("spread_attention", &spread_attention, py::arg("costs"), py::arg("ring_offsets"),
        py::arg("ring_ranks"), py::arg("weights"), py::kw_only(), py::arg("pool_size"),
        py::arg("limit"), py::arg("budget"),
        "Move ring members off the rank with the most attention while the plan ends within "
        "limit; (starts, ring_ranks, work spent).\n\n"
        "Same contract as megatron_hdp.scheduler.attention_spread."
        "spread_attention_reference; raises ValueError for invalid input. The GIL is "
        "released while it runs.");
}
