// Fast calls of the per-layer ops for compiled graphs' wrapper code (with EMBER_FAST_CALLS).
// One part of ember_cpu.cpp's translation unit (included there, after the registrations).
#pragma once

#ifdef EMBER_FAST_CALLS
// Fast calls: the ops that a compiled graph calls once per layer, as Python builtins that go
// straight to the dispatcher's unboxed kernel (`OperatorHandle::typed().call`: profiling and
// dispatch modes are kept), for the generated wrapper code to call instead of
// `torch.ops.ember_cpu.<op>.default` (see `ember.kernels.install_fast_calls`). Python's op call
// costs 1.5-2.3 us more per call (its arguments are converted to a boxed stack of IValues
// against the schema, the GIL is dropped, the boxed kernel unboxes them again), about what a
// decode-size kernel itself takes; a batch-1 step of a 12-layer model makes 60 such calls.
// Here the arguments are read straight from the Python objects: exact tensors, None, int,
// float and bool; any other argument (a tensor subclass, a SymInt) goes to the Python op,
// `fallback`. The GIL is dropped while the kernel runs, as for ATen's own ops.
//
// torch_python's own header (`python_variable.h`) pulls in pybind11 and costs ~10 s of
// compile, so the three symbols used are declared here; the layout of a Python tensor (an
// at::Tensor after the object header) is checked at load by `tensor_impl` against
// `Tensor._cdata`.
extern PyObject* THPVariableClass;
extern PyObject* ParameterClass;
PyObject* THPVariable_Wrap(at::TensorBase&& var);

namespace fast_calls {

struct PyTensor {
  PyObject_HEAD
  at::Tensor cdata;
};

bool is_tensor(PyObject* o) {
  PyTypeObject* t = Py_TYPE(o);
  return t == reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
         t == reinterpret_cast<PyTypeObject*>(ParameterClass);
}

template <typename T>
struct Arg;
template <>
struct Arg<at::Tensor> {
  static bool ok(PyObject* o) { return is_tensor(o); }
  static const at::Tensor& get(PyObject* o) { return reinterpret_cast<PyTensor*>(o)->cdata; }
};
template <>
struct Arg<std::optional<at::Tensor>> {
  static bool ok(PyObject* o) { return o == Py_None || is_tensor(o); }
  static std::optional<at::Tensor> get(PyObject* o) {
    if (o == Py_None) return std::nullopt;
    return reinterpret_cast<PyTensor*>(o)->cdata;
  }
};
template <>
struct Arg<int64_t> {
  static bool ok(PyObject* o) { return PyLong_CheckExact(o); }
  static int64_t get(PyObject* o) { return PyLong_AsLongLong(o); }
};
template <>
struct Arg<double> {
  static bool ok(PyObject* o) { return PyFloat_CheckExact(o) || PyLong_CheckExact(o); }
  static double get(PyObject* o) { return PyFloat_AsDouble(o); }
};
template <>
struct Arg<bool> {
  static bool ok(PyObject* o) { return PyBool_Check(o); }
  static bool get(PyObject* o) { return o == Py_True; }
};

PyObject* wrap(at::Tensor&& t) { return THPVariable_Wrap(std::move(t)); }

// Python's exception for a C++ one, as torch's own bindings map them (no C++ backtrace).
void set_error(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) {
    PyObject* type = PyExc_RuntimeError;
    if (dynamic_cast<const c10::ValueError*>(&e)) type = PyExc_ValueError;
    else if (dynamic_cast<const c10::TypeError*>(&e)) type = PyExc_TypeError;
    else if (dynamic_cast<const c10::IndexError*>(&e)) type = PyExc_IndexError;
    else if (dynamic_cast<const c10::NotImplementedError*>(&e)) type = PyExc_NotImplementedError;
    PyErr_SetString(type, c10e->what_without_backtrace());
  } else {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// One op: its typed handle and the Python op for arguments this path does not read.
template <typename Sig>
struct Entry;
template <typename... A>
struct Entry<at::Tensor(A...)> {
  c10::TypedOperatorHandle<at::Tensor(A...)> op;
  PyObject* fallback;

  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    auto* e = static_cast<Entry*>(PyCapsule_GetPointer(self, nullptr));
    return e->run(args, n, std::index_sequence_for<A...>{});
  }

  template <size_t... I>
  PyObject* run(PyObject* const* args, Py_ssize_t n, std::index_sequence<I...>) {
    if (n != static_cast<Py_ssize_t>(sizeof...(A)) ||
        !(Arg<std::decay_t<A>>::ok(args[I]) && ...))
      return PyObject_Vectorcall(fallback, args, n, nullptr);
    std::tuple<std::decay_t<A>...> values{Arg<std::decay_t<A>>::get(args[I])...};
    if (PyErr_Occurred()) return nullptr;  // an int out of range
    at::Tensor out;
    PyThreadState* state = PyEval_SaveThread();
    try {
      out = op.call(std::get<I>(values)...);
    } catch (const std::exception& err) {
      PyEval_RestoreThread(state);
      set_error(err);
      return nullptr;
    }
    PyEval_RestoreThread(state);
    return wrap(std::move(out));
  }
};

template <typename Sig>
bool add(PyObject* calls, PyObject* fallbacks, const char* name) {
  PyObject* fallback = PyDict_GetItemString(fallbacks, name);  // borrowed
  if (fallback == nullptr) return true;
  // Both live as long as the process, as the ops do.
  auto* def = new PyMethodDef{
      name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Entry<Sig>::call)),
      METH_FASTCALL, nullptr};
  Py_INCREF(fallback);
  auto* entry = new Entry<Sig>{
      c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Sig>(), fallback};
  PyObject* capsule = PyCapsule_New(entry, nullptr, nullptr);
  if (capsule == nullptr) return false;
  PyObject* fn = PyCFunction_New(def, capsule);
  Py_DECREF(capsule);
  if (fn == nullptr) return false;
  const int rc = PyDict_SetItemString(calls, name, fn);
  Py_DECREF(fn);
  return rc == 0;
}

PyObject* tensor_impl(PyObject*, PyObject* arg) {
  if (!is_tensor(arg)) {
    PyErr_SetString(PyExc_TypeError, "tensor_impl: expected a torch.Tensor");
    return nullptr;
  }
  return PyLong_FromVoidPtr(reinterpret_cast<PyTensor*>(arg)->cdata.unsafeGetTensorImpl());
}

using Opt = const std::optional<at::Tensor>&;
using T = const at::Tensor&;

}  // namespace fast_calls

// {op name: builtin} for the ops named in `fallbacks` ({name: Python op}), plus "tensor_impl";
// called through ctypes.PyDLL, holding the GIL.
extern "C" PyObject* ember_cpu_fast_calls(PyObject* fallbacks) {
  using namespace fast_calls;
  static PyMethodDef impl_def = {"tensor_impl", &tensor_impl, METH_O, nullptr};
  PyObject* calls = PyDict_New();
  if (calls == nullptr) return nullptr;
  try {
    PyObject* impl = PyCFunction_New(&impl_def, nullptr);
    const bool ok =
        impl != nullptr && PyDict_SetItemString(calls, "tensor_impl", impl) == 0 &&
        add<at::Tensor(T, T, T, Opt, Opt, int64_t, int64_t)>(calls, fallbacks,
                                                              "ember_cpu::group_linear") &&
        add<at::Tensor(T, T, Opt, Opt, int64_t)>(calls, fallbacks, "ember_cpu::packed_linear") &&
        add<at::Tensor(T, T, Opt)>(calls, fallbacks, "ember_cpu::bf16_linear") &&
        add<at::Tensor(T, T, Opt)>(calls, fallbacks, "ember_cpu::fp32_linear") &&
        add<at::Tensor(T, T, T, at::Tensor, T, T, T, T, double, int64_t, double, bool)>(
            calls, fallbacks, "ember_cpu::paged_attention") &&
        add<at::Tensor(T, T, T, at::Tensor, T, T, T, T, double, int64_t, double, bool)>(
            calls, fallbacks, "ember_cpu::paged_attention_opaque");
    Py_XDECREF(impl);
    if (!ok) {
      Py_DECREF(calls);
      return nullptr;
    }
  } catch (const std::exception& err) {
    set_error(err);
    Py_DECREF(calls);
    return nullptr;
  }
  return calls;
}
#endif  // EMBER_FAST_CALLS
