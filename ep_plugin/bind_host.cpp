// Python binding of the host kernels (host_matmul.h): host_matmul, host_matmul_nbits,
// host_cpu, the jobs of a graph's host nodes (HostJobs), and the benchmark's private
// entries. Arguments are checked with the GIL
// held (TypeError for a wrong dtype, ValueError for a shape, a layout or a setting);
// the product runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "bindings.h"
#include "host_jobs.h"
#include "host_matmul.h"
#include "host_pool.h"

namespace offload::bind {
namespace {

using offload::host::isa_name;

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string dtype_of(const py::array& a) { return py::str(a.dtype().attr("name")); }

// float16/float32 (and bfloat16 where allowed) as a HostDType; TypeError otherwise.
int32_t float_dtype(const py::array& a, const char* what, bool bf16) {
  const std::string d = dtype_of(a);
  if (d == "float32") return HOST_F32;
  if (d == "float16") return HOST_F16;
  if (bf16 && d == "bfloat16") return HOST_BF16;
  throw py::type_error(std::string(what) + " must be " + (bf16 ? "float16, bfloat16 (ml_dtypes) or float32" :
                                                                 "float16 or float32") + ", got " + d);
}

void need_layout(const py::array& a, const char* what) {
  namespace d = py::detail;
  const int need = d::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | d::npy_api::NPY_ARRAY_ALIGNED_;
  if ((d::array_proxy(a.ptr())->flags & need) != need)
    throw py::value_error(std::string(what) + " must be C-contiguous and aligned (np.ascontiguousarray(" + what +
                          ") makes it so)");
}

void need_dims(const py::array& a, const char* what, py::ssize_t ndim, const char* layout) {
  if (a.ndim() != ndim)
    throw py::value_error(std::string(what) + " must be " + layout + ", got shape " + shape_of(a));
}

int32_t parse_isa(const py::object& isa) {
  if (isa.is_none()) return HOST_ISA_AUTO;
  if (py::isinstance<py::str>(isa)) {
    const std::string s = isa.cast<std::string>();
    for (int32_t i : {HOST_ISA_SCALAR, HOST_ISA_AVX2, HOST_ISA_AVX512})
      if (s == isa_name(i)) return i;
  }
  throw py::value_error("isa must be None, 'scalar', 'avx2' or 'avx512', got " + std::string(py::repr(isa)));
}

int32_t parse_threads(const py::object& t) {
  if (t.is_none()) return 0;
  const int logical = offload::host::cpu_topology().logical_cpus;
  if (!py::isinstance<py::int_>(t) || py::isinstance<py::bool_>(t))
    throw py::type_error("threads must be None or an int, got " + std::string(py::repr(t)));
  const long long v = t.cast<long long>();
  if (v < 1 || v > logical)
    throw py::value_error("threads must be None or in [1, " + std::to_string(logical) +
                          "] (the CPUs this process may use), got " + std::to_string(v));
  return int32_t(v);
}

int32_t parse_split(const std::string& s) {
  if (s == "auto") return HOST_SPLIT_AUTO;
  if (s == "columns") return HOST_SPLIT_COLUMNS;
  if (s == "rows") return HOST_SPLIT_ROWS;
  throw py::value_error("split must be 'auto', 'columns' or 'rows', got '" + s + "'");
}

py::array run_job(HostMatmulJob& job, const py::array& x) {
  const std::string why = offload::host::check(job);
  if (!why.empty()) throw py::value_error(why);
  py::array y(x.dtype(), std::vector<py::ssize_t>{py::ssize_t(job.m), py::ssize_t(job.weight.n)});
  job.y = y.mutable_data();
  {
    py::gil_scoped_release free;
    offload::host::run(job);
  }
  return y;
}

HostMatmulJob job_for_x(const py::array& x, int64_t k, const py::object& threads, const py::object& isa) {
  need_dims(x, "x", 2, "2-D [M, K]");
  HostMatmulJob job{};
  job.x_dtype = float_dtype(x, "x", false);
  need_layout(x, "x");
  if (x.shape(1) != k)
    throw py::value_error("x is " + shape_of(x) + " but the weight's K is " + std::to_string(k));
  job.m = x.shape(0);
  job.x = x.data();
  job.threads = parse_threads(threads);
  job.isa = parse_isa(isa);
  return job;
}

py::array dense(const py::array& x, const py::array& w, const py::object& threads, const py::object& isa,
                int32_t split) {
  need_dims(w, "w", 2, "2-D [K, N]");
  const int32_t wd = float_dtype(w, "w", true);
  need_layout(w, "w");
  HostMatmulJob job = job_for_x(x, w.shape(0), threads, isa);
  job.weight = HostWeight{HOST_DENSE, wd, w.shape(0), w.shape(1), w.data(), nullptr, nullptr, 0};
  job.split = split;
  return run_job(job, x);
}

py::array nbits(const py::array& x, const py::array& b, const py::array& scales, const py::object& zero_points,
                int64_t k, int64_t n, int64_t block_size, const py::object& threads, const py::object& isa) {
  if (block_size < 16 || (block_size & (block_size - 1)))
    throw py::value_error("block_size must be a power of two >= 16, got " + std::to_string(block_size));
  if (k < 1 || n < 1)
    throw py::value_error("k and n must be >= 1, got k=" + std::to_string(k) + ", n=" + std::to_string(n));
  HostMatmulJob job = job_for_x(x, k, threads, isa);
  const int64_t blocks = (k + block_size - 1) / block_size, zp_cols = (blocks + 1) / 2;
  if (dtype_of(b) != "uint8") throw py::type_error("b_quant must be uint8, got " + dtype_of(b));
  if (b.ndim() != 3 || b.shape(0) != n || b.shape(1) != blocks || b.shape(2) != block_size / 2)
    throw py::value_error("b_quant must be [N, n_blocks, block_size / 2] = (" + std::to_string(n) + ", " +
                          std::to_string(blocks) + ", " + std::to_string(block_size / 2) + "), got " + shape_of(b));
  need_layout(b, "b_quant");
  const int32_t sd = float_dtype(scales, "scales", false);
  if (sd != job.x_dtype)
    throw py::type_error("scales must have x's dtype (" + dtype_of(x) + "), got " + dtype_of(scales));
  const bool flat = scales.ndim() == 1 && scales.shape(0) == n * blocks;
  if (!flat && !(scales.ndim() == 2 && scales.shape(0) == n && scales.shape(1) == blocks))
    throw py::value_error("scales must be [N * n_blocks] = (" + std::to_string(n * blocks) + ",) or [N, n_blocks], "
                          "got " + shape_of(scales));
  need_layout(scales, "scales");
  const uint8_t* zp = nullptr;
  if (!zero_points.is_none()) {
    if (!py::isinstance<py::array>(zero_points))
      throw py::type_error("zero_points must be None or a uint8 numpy array");
    const py::array z = zero_points.cast<py::array>();
    if (dtype_of(z) != "uint8")
      throw py::type_error("zero_points must be uint8 (two 4-bit values a byte), got " + dtype_of(z));
    const bool zflat = z.ndim() == 1 && z.shape(0) == n * zp_cols;
    if (!zflat && !(z.ndim() == 2 && z.shape(0) == n && z.shape(1) == zp_cols))
      throw py::value_error("zero_points must be [N, ceil(n_blocks / 2)] = (" + std::to_string(n) + ", " +
                            std::to_string(zp_cols) + ") or flat, got " + shape_of(z));
    need_layout(z, "zero_points");
    zp = static_cast<const uint8_t*>(z.data());
  }
  job.weight = HostWeight{HOST_NBITS4, sd, k, n, b.data(), scales.data(), zp, block_size};
  return run_job(job, x);
}

int32_t x_dtype_of(const std::string& d) {
  if (d == "float32") return HOST_F32;
  if (d == "float16") return HOST_F16;
  throw py::value_error("x_dtype must be 'float16' or 'float32', got '" + d + "'");
}

// Writes job i of `jobs`; returns "" when it can run, else why not (it is written either
// way: a host node that runs it records the refusal in its status). x and y must lie in
// the jobs' pinned region, which the graph's copies fill and read.
std::string set_job(HostJobs& jobs, size_t i, const std::string& kind, int64_t k, int64_t n, uint64_t data,
                    uint64_t scales, uint64_t zero_points, int64_t block_size, const std::string& x_dtype, int64_t m,
                    uint64_t x, uint64_t y, const py::object& threads, const py::object& isa) {
  HostMatmulJob& job = jobs.at(i);
  HostMatmulJob j{};
  j.x_dtype = x_dtype_of(x_dtype);
  if (kind == "int4") {
    j.weight = HostWeight{HOST_NBITS4, j.x_dtype, k, n, reinterpret_cast<const void*>(uintptr_t(data)),
                          reinterpret_cast<const void*>(uintptr_t(scales)),
                          reinterpret_cast<const uint8_t*>(uintptr_t(zero_points)), block_size};
  } else {
    int32_t wd = kind == "float32" ? HOST_F32 : kind == "float16" ? HOST_F16 : kind == "bfloat16" ? HOST_BF16 : -1;
    if (wd < 0) throw py::value_error("kind must be 'float16', 'bfloat16', 'float32' or 'int4', got '" + kind + "'");
    j.weight = HostWeight{HOST_DENSE, wd, k, n, reinterpret_cast<const void*>(uintptr_t(data)), nullptr, nullptr, 0};
  }
  j.threads = parse_threads(threads);
  j.isa = parse_isa(isa);
  j.split = HOST_SPLIT_AUTO;
  j.m = m;
  j.x = reinterpret_cast<const void*>(uintptr_t(x));
  j.y = reinterpret_cast<void*>(uintptr_t(y));
  const uint64_t item = j.x_dtype == HOST_F32 ? 4 : 2;
  // Rows of more bytes than 64 bits count are not inside any region (the product must not wrap).
  const auto inside = [&](uint64_t p, int64_t rows, int64_t cols) {
    uint64_t bytes = 0;
    return !__builtin_mul_overflow(uint64_t(rows), uint64_t(cols), &bytes) &&
           !__builtin_mul_overflow(bytes, item, &bytes) && jobs.holds(p, bytes);
  };
  if (m >= 1 && k >= 1 && !inside(x, m, k))
    throw py::value_error("x's " + std::to_string(m) + " x " + std::to_string(k) + " values are not inside the jobs' "
                          "pinned region");
  if (m >= 1 && n >= 1 && !inside(y, m, n))
    throw py::value_error("y's " + std::to_string(m) + " x " + std::to_string(n) + " values are not inside the jobs' "
                          "pinned region");
  j.status = -1;
  std::snprintf(j.error, sizeof(j.error), "the job has not run");
  const std::string why = offload::host::check(j);
  job = j;
  return why;
}

}  // namespace

void bind_host(py::module_& m) {
  py::class_<HostJobs, std::shared_ptr<HostJobs>>(m, "HostJobs")
      .def(py::init<std::shared_ptr<PhysicalBackend>, size_t, uint64_t>(), py::arg("backend").none(false),
           py::arg("count"),
           py::arg("pinned_bytes"), Drain(),
           "`count` host MatMul jobs for a graph's host nodes and `pinned_bytes` of zeroed page-locked host memory "
           "for their X and Y rows; a graph given them holds them while it lives")
      .def("__len__", &HostJobs::size)
      .def_property_readonly("pinned", &HostJobs::pinned, "the pinned region's address (page-aligned)")
      .def_property_readonly("pinned_bytes", &HostJobs::pinned_bytes)
      .def(
          "address", [](HostJobs& j, size_t i) { return uint64_t(reinterpret_cast<uintptr_t>(&j.at(i))); },
          py::arg("index"), "the address of job `index` (a HostMatmulJob, host_matmul_job_run's argument)")
      .def("set", &set_job, py::arg("index"), py::arg("kind"), py::arg("k"), py::arg("n"), py::arg("data"),
           py::arg("scales") = 0, py::arg("zero_points") = 0, py::arg("block_size") = 0, py::kw_only(),
           py::arg("x_dtype"), py::arg("m"), py::arg("x"), py::arg("y"), py::arg("threads") = py::none(),
           py::arg("isa") = py::none(), Drain(),
           "writes job `index`: y [m, n] = x [m, k] @ W, W of `kind` ('float16', 'bfloat16', 'float32', or 'int4' "
           "for MatMulNBits: data = B, scales of x_dtype, zero_points 0 for none) at host addresses; x and y in the "
           "pinned region. Returns '' when the job can run, else why not (it is written either way)")
      .def(
          "first_failed",
          [](HostJobs& j) {
            for (size_t i = 0; i < j.size(); ++i)
              if (j.at(i).status != 0) return int64_t(i);
            return int64_t(-1);
          },
          "the index of the first job whose status is not 0 (done), or -1: one call a step")
      .def(
          "status",
          [](HostJobs& j, size_t i) {
            const HostMatmulJob& job = j.at(i);
            return py::make_tuple(job.status, std::string(job.error, strnlen(job.error, sizeof(job.error))));
          },
          py::arg("index"),
          "(status, message) of job `index` as its last run left it: 0 done, -1 not run, else refused and why; read "
          "it once the replays that run it have finished");

  m.def(
      "host_matmul",
      [](const py::array& x, const py::array& w, const py::object& threads, const py::object& isa) {
        return dense(x, w, threads, isa, HOST_SPLIT_AUTO);
      },
      py::arg("x"), py::arg("w"), py::kw_only(), py::arg("threads") = py::none(), py::arg("isa") = py::none(),
      Drain(), "y = x @ w on the host's cores: x [M, K] float16/float32, w [K, N] float16/bfloat16/float32; fp32 sums");
  m.def("host_matmul_nbits", &nbits, py::arg("x"), py::arg("b_quant"), py::arg("scales"), py::arg("zero_points"),
        py::kw_only(), py::arg("k"), py::arg("n"), py::arg("block_size"), py::arg("threads") = py::none(),
        py::arg("isa") = py::none(), Drain(),
        "y = x @ W for MatMulNBits's 4-bit W (B [N, n_blocks, block_size/2], scales, optional packed zero points)");
  m.def(
      "host_cpu",
      [] {
        const auto& topo = offload::host::cpu_topology();
        py::list avail;
        for (int32_t i : offload::host::isa_available()) avail.append(isa_name(i));
        py::dict d;
        d["isa"] = isa_name(offload::host::isa_best());
        d["isa_available"] = avail;
        d["physical_cores"] = topo.physical_cores;
        d["logical_cpus"] = topo.logical_cpus;
        d["threads"] = offload::host::default_threads();
        d["pool_workers"] = offload::host::pool_workers();
        d["spin_us"] = offload::host::pool_spin_us();
        return d;
      },
      Drain(),
      "the host kernels' CPU: the ISA chosen and those available, cores, CPUs, the pool's threads, and how long "
      "(microseconds) its threads spin after a job before they sleep");
  m.def(
      "host_set_spin_us", [](int64_t us) { offload::host::pool_set_spin_us(us); }, py::arg("us"),
      "sets how long (microseconds, 0 .. 1000000) the host pool's threads spin after a job for the next one before "
      "they sleep (default 1000, or ONNX_OFFLOAD_HOST_SPIN_US)");
  m.def(
      "_host_matmul_split",
      [](const py::array& x, const py::array& w, const std::string& split, const py::object& threads,
         const py::object& isa) { return dense(x, w, threads, isa, parse_split(split)); },
      py::arg("x"), py::arg("w"), py::arg("split"), py::kw_only(), py::arg("threads") = py::none(),
      py::arg("isa") = py::none(), Drain(), "host_matmul with the split between threads forced (the benchmark's)");
  m.def(
      "_host_job_entry",
      [] {
        return py::make_tuple(reinterpret_cast<uintptr_t>(&host_matmul_job_run), sizeof(HostMatmulJob),
                              offsetof(HostMatmulJob, status));
      },
      "(address of host_matmul_job_run, sizeof(HostMatmulJob), offsetof(status)): the C entry for a CUDA host node");
  m.def(
      "_host_pool_sleeping", [] { return offload::host::pool_sleeping(); },
      "worker threads of the host pool asleep now, past their spin bound (the tests')");
  m.def(
      "_host_read",
      [](const py::array& buf, const py::object& threads) {
        need_layout(buf, "buf");
        const int32_t t = parse_threads(threads);
        const size_t bytes = size_t(buf.nbytes()) & ~size_t(7);
        const void* p = buf.data();
        py::gil_scoped_release free;
        return offload::host::read_bytes(p, bytes, t);
      },
      py::arg("buf"), py::kw_only(), py::arg("threads") = py::none(), Drain(),
      "reads buf on the host kernels' pool (the benchmark's bound); returns a checksum");
}

}  // namespace offload::bind
