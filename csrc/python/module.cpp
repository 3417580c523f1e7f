// braid._C: thin pybind11 bindings. ConfigError becomes ValueError, every other
// braid::Error RuntimeError.

#include <pybind11/stl.h>

#include "bindings.h"
#include "braid/core/allocator.h"
#include "braid/core/log.h"
#include "braid/kernels/ops.h"

namespace braid::python {

void bind_core(py::module_& m) {
  py::class_<Tensor>(
      m, "Tensor", py::buffer_protocol(),
      "A contiguous braid tensor (CPU or CUDA). Exchange it with numpy/torch through "
      "DLPack: np.from_dlpack(t) (read-only), torch.from_dlpack(t); CPU tensors also "
      "expose the buffer protocol, so np.asarray(t) is a writable view (bf16 as uint16).")
      .def_buffer([](const Tensor& t) {
        BRAID_CONFIG_CHECK(t.device().is_cpu(), "the buffer protocol is for CPU tensors; ",
                           t.device().str(), " tensors go through DLPack (torch.from_dlpack)");
        static const char* formats[] = {"f", "H", "e", "i", "q", "B"};
        std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
        std::vector<py::ssize_t> strides(shape.size());
        py::ssize_t stride = py::ssize_t(dtype_size(t.dtype()));
        for (size_t i = shape.size(); i-- > 0;) {
          strides[i] = stride;
          stride *= shape[i];
        }
        return py::buffer_info(t.nbytes() ? t.data() : nullptr, py::ssize_t(dtype_size(t.dtype())),
                               formats[int(t.dtype())], py::ssize_t(shape.size()), shape, strides);
      })
      .def_property_readonly(
          "shape",
          [](const Tensor& t) { return std::vector<int64_t>(t.shape().begin(), t.shape().end()); })
      .def_property_readonly("dtype", [](const Tensor& t) { return dtype_name(t.dtype()); })
      .def_property_readonly("device", [](const Tensor& t) { return t.device().str(); })
      .def_property_readonly("numel", &Tensor::numel)
      .def("__len__", [](const Tensor& t) { return t.dim() ? t.size(0) : 0; })
      .def("__repr__", [](const Tensor& t) { return t.str(); })
      .def("__dlpack__", [](const Tensor& t, py::kwargs) { return to_dlpack(t); })
      .def("__dlpack_device__",
           [](const Tensor& t) {
             return py::make_tuple(t.device().is_cpu() ? 1 : 2, t.device().index);
           })
      .def(
          "to",
          [](const Tensor& t, const std::string& device) { return t.to(device_from_name(device)); },
          py::arg("device"))
      .def("clone", &Tensor::clone)
      .def(
          "copy_", [](Tensor& t, py::handle src) { t.copy_from(as_tensor(src)); }, py::arg("src"),
          "Copies src (a braid tensor or any DLPack producer of the same dtype and numel) into t.");

  m.def("from_dlpack", &from_dlpack, py::arg("obj"),
        "A braid Tensor sharing memory with any DLPack producer (numpy array, torch tensor).");
  m.def(
      "cpu_blas",
      [] {
        const ops::CpuBlas blas = ops::cpu_blas();
        py::dict d;
        d["library"] = blas.library;
        d["kernels"] = blas.kernels;
        d["chosen_by"] = blas.chosen_by;
        return d;
      },
      "OpenBLAS, the CPU GEMM, as braid loaded it (loading it first if no GEMM has yet): the "
      "file, its kernels (openblas_get_corename) and how they were chosen.");
  m.def("cuda_available", &cuda_available);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_device_name", &cuda_device_name, py::arg("index") = 0);
  m.def(
      "memory_stats",
      [](const std::string& device) {
        MemoryStats s = memory_stats(device_from_name(device));
        py::dict d;
        d["current_bytes"] = s.current_bytes;
        d["peak_bytes"] = s.peak_bytes;
        d["reserved_bytes"] = s.reserved_bytes;
        return d;
      },
      py::arg("device") = "cpu");
  m.def(
      "reset_peak_memory",
      [](const std::string& device) { reset_peak_memory(device_from_name(device)); },
      py::arg("device") = "cpu");
  m.def(
      "empty_cache", [](const std::string& device) { empty_cache(device_from_name(device)); },
      py::arg("device") = "cpu",
      "Gives the device allocator's cached free blocks back (torch.cuda.empty_cache()).");
  m.def("set_log_level",
        [](const std::string& name) { log::set_level(log::level_from_name(name)); });
}

}  // namespace braid::python

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  m.doc() = "braid: C++/CUDA training runtime (bindings)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const braid::ConfigError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const braid::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  braid::python::bind_core(m);
  braid::python::bind_model(m);
  braid::python::bind_parallel(m);
  braid::python::bind_engine(m);
  braid::python::bind_checkpoint(m);
  braid::python::bind_data(m);
  braid::python::bind_gpt_data(m);
  braid::python::bind_schedule(m);
}
