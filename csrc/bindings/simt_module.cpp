// dspark._simt: the kernels of csrc/ compiled for the host, behind CuPy's launch convention.
//
// Python packs the arguments (one 8-byte slot each: a pointer, or a scalar's bytes) after
// checking them against the parsed signature; this module only unpacks and launches.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../simt/registry.h"

namespace py = pybind11;

namespace {

void launch(const std::string& name, std::tuple<unsigned, unsigned, unsigned> grid,
            std::tuple<unsigned, unsigned, unsigned> block, py::bytes packed, size_t shared_mem) {
  auto& reg = simt::registry();
  auto it = reg.find(name);
  if (it == reg.end()) throw py::key_error("no simt kernel named '" + name + "'");
  std::string raw = packed;
  const simt::Entry& e = it->second;
  if (raw.size() != 8 * e.params.size())
    throw py::value_error(name + ": expected " + std::to_string(e.params.size()) + " packed arguments");
  std::vector<uint64_t> slots(e.params.size());
  std::memcpy(slots.data(), raw.data(), raw.size());
  std::vector<void*> params(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) params[i] = &slots[i];
  simt::launch(e, dim3(std::get<0>(grid), std::get<1>(grid), std::get<2>(grid)),
               dim3(std::get<0>(block), std::get<1>(block), std::get<2>(block)), params.data(), shared_mem);
}

py::dict kernels() {
  py::dict out;
  for (auto& [name, e] : simt::registry()) {
    py::list params;
    for (auto& p : e.params) params.append(py::make_tuple(p.code, p.elem, p.is_const));
    out[py::str(name)] = params;
  }
  return out;
}

// The counting build's per-launch counts (simt.h: count_ldmatrix), taken once.
py::list take_counts() {
  static const char* kinds[simt::kSmemKinds] = {"load", "store", "ldmatrix", "cp_async"};
  py::list out;
  for (const simt::LaunchCounts& c : simt::take_counts()) {
    py::dict d;
    d["kernel"] = c.kernel;
    d["grid"] = py::make_tuple(c.grid.x, c.grid.y, c.grid.z);
    d["block"] = py::make_tuple(c.block.x, c.block.y, c.block.z);
    d["shared_mem"] = c.shared_mem;
    for (int k = 0; k < simt::kSmemKinds; ++k)
      d[kinds[k]] = py::make_tuple(c.requests[k], c.wavefronts[k], c.ideal[k]);
    d["mma"] = c.mma;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_simt, m) {
  m.doc() = "dspark kernels executed on the CPU: one fiber per CUDA thread";
  static py::exception<simt::KernelFault> fault_type(m, "KernelFault", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const simt::KernelFault& e) {
      py::set_error(fault_type, e.what());
    }
  });
  m.def("launch", &launch, py::arg("name"), py::arg("grid"), py::arg("block"), py::arg("packed"),
        py::arg("shared_mem"));
  m.def("kernels", &kernels, "name -> [(code, elem_size, is_const)] as the compiler deduced them");
  m.def("set_schedule", &simt::set_schedule, py::arg("seed"),
        "0: blocks in index order, threads in index order between barriers; otherwise both in a random order from this seed");
  m.def("schedule_seed", &simt::schedule_seed);
  m.def("set_counting", &simt::set_counting, py::arg("on"),
        "count each launch's shared-memory wavefronts and mma.sync (the counting build only)");
  m.def("take_counts", &take_counts,
        "the counts of every launch since the last call: kernel, grid, block, shared_mem, mma, and per kind "
        "(load, store, ldmatrix, cp_async) (warp-wide accesses, wavefronts, wavefronts without bank conflicts)");
  m.attr("counts_shared_accesses") = simt::counts_shared_accesses();
#if defined(__SANITIZE_ADDRESS__)
  m.attr("asan") = true;
#else
  m.attr("asan") = false;
#endif
}
