// dspark._cpu: native code of the numpy backend. Python (dspark.ops.product) validates the arrays
// and passes their addresses; this module picks the instruction set once, splits the columns
// across a pool of threads and runs product.h there with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace dspark_cpu {
void product_avx2(int, const float*, const void*, int, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                  ptrdiff_t, ptrdiff_t, float*, float*);
void product_base(int, const float*, const void*, int, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                  ptrdiff_t, ptrdiff_t, float*, float*);
void product_avx512(int, const float*, const void*, int, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                    ptrdiff_t, ptrdiff_t, float*, float*);
void product_fp8_avx2(const float*, const uint8_t*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                      ptrdiff_t, ptrdiff_t, ptrdiff_t, float*, float*);
void product_fp8_base(const float*, const uint8_t*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                      ptrdiff_t, ptrdiff_t, ptrdiff_t, float*, float*);
void product_fp8_avx512(const float*, const uint8_t*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                        ptrdiff_t, ptrdiff_t, ptrdiff_t, float*, float*);
void delta_columns(float* S, const float* q, const float* k, const float* v, const float* alpha, const float* beta,
                   const int* indptr, int heads, int dv, int dk, float* out, float* ckpt, int p0, int p1);
void rmsnorm(const float* x, const float* weight, float eps, ptrdiff_t rows, ptrdiff_t n, float* y);
void attention_scores(const float* q, const float* k, int n, int hkv, int g, int L, int D, float* s);
void attention_weighted(const float* p, const float* v, int n, int hkv, int g, int L, int D, float* o);
}  // namespace dspark_cpu

namespace {

using Product = void (*)(int, const float*, const void*, int, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                         ptrdiff_t, ptrdiff_t, ptrdiff_t, float*, float*);

// Each thread's accumulators and panel (product.h), kept between calls.
float* scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

bool has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// What this CPU runs, best first.
std::vector<std::string> isas() {
  std::vector<std::string> out;
  if (has_avx512()) out.push_back("avx512");
  if (has_avx2()) out.push_back("avx2");
  out.push_back("base");
  return out;
}

// "avx512", "avx2" or "base": the best this CPU runs, or DSPARK_CPU_ISA where the CPU runs it
// (tests compare them bitwise; a bench can hold one fixed).
std::string& isa() {
  static std::string name = [] {
    const auto have = isas();
    const char* forced = std::getenv("DSPARK_CPU_ISA");
    for (const auto& h : have)
      if (forced && h == forced) return h;
    return have.front();
  }();
  return name;
}

using ProductFp8 = void (*)(const float*, const uint8_t*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                           ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, float*, float*);

ProductFp8 product_fp8_of(const std::string& name) {
  if (name == "avx512") return dspark_cpu::product_fp8_avx512;
  return name == "avx2" ? dspark_cpu::product_fp8_avx2 : dspark_cpu::product_fp8_base;
}

Product product_of(const std::string& name) {
  if (name == "avx512") return dspark_cpu::product_avx512;
  return name == "avx2" ? dspark_cpu::product_avx2 : dspark_cpu::product_base;
}

// A fixed pool of `workers` threads besides the caller. A job is `chunks` pieces; the caller and
// the workers claim them one at a time until none is left, and the caller returns once every
// piece is done. On a shared machine a worker whose core is busy elsewhere claims nothing and is
// not waited for: the caller (or a worker that runs) takes its pieces. Workers sleep on a
// condition variable between jobs after a short spin (back-to-back products of one step).
class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void run(int workers, int chunks, const std::function<void(int)>& fn) {
    if (workers <= 0 || chunks <= 1) {
      for (int i = 0; i < chunks; ++i) fn(i);
      return;
    }
    grow(workers);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      chunks_ = chunks;
      done_.store(0, std::memory_order_relaxed);
      gen = ++generation_;
      claims_.store(gen << 32, std::memory_order_release);  // this job's generation, piece 0 next
      gen_atomic_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    for (int i; (i = claim(gen, chunks)) >= 0;) {
      fn(i);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
    while (done_.load(std::memory_order_acquire) != chunks) std::this_thread::yield();
  }

 private:
  // The next piece of job `gen`, or -1 when that job has none left or is over. A compare-exchange,
  // not an add: a late worker must not move a newer job's counter.
  int claim(uint64_t gen, int chunks) {
    uint64_t c = claims_.load(std::memory_order_acquire);
    for (;;) {
      if ((c >> 32) != gen || int(c & 0xffffffffu) >= chunks) return -1;
      if (claims_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) return int(c & 0xffffffffu);
    }
  }

  void grow(int n) {
    while (int(workers_.size()) < n) workers_.emplace_back([this] { loop(); });
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      // spin a little before sleeping: the next product of a step usually follows within microseconds
      for (int i = 0; i < 20000 && gen_atomic_.load(std::memory_order_acquire) == seen; ++i) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
      const std::function<void(int)>* job;
      int chunks;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
        chunks = chunks_;
      }
      // The job is alive while one of its pieces is claimed and not done (its caller waits for it).
      for (int i; (i = claim(seen, chunks)) >= 0;) {
        (*job)(i);
        done_.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* job_ = nullptr;
  int chunks_ = 0;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> gen_atomic_{0};
  std::atomic<uint64_t> claims_{0};  // generation << 32 | the next piece
  std::atomic<int> done_{0};
  bool stop_ = false;
};

Pool* the_pool = nullptr;  // never destroyed: workers must not be joined at interpreter exit

// A forked child has none of the parent's workers: it starts a pool of its own (the parent's
// is left as it was, its memory unreachable in the child).
void forget_pool_in_child() { the_pool = nullptr; }

Pool& pool() {
  static const bool registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child) == 0;
  (void)registered;
  if (!the_pool) the_pool = new Pool();
  return *the_pool;
}

// out [rows, N] = x [rows, K] @ w [K, N] on `threads` threads, in two column pieces per thread
// (the pool balances them across the threads that get a core). Piece boundaries are whole
// `align`-column panels (48: the AVX-512 tile's panel, two AVX2 and four baseline ones), so only
// the last piece can end in a narrower panel; any split gives the same bits (each output's order
// is fixed by K). `columns(c0, c1, acc, buf)` computes one piece with its thread's scratch.
template <typename Columns>
void split_columns(ptrdiff_t rows, ptrdiff_t N, int threads, ptrdiff_t strip, ptrdiff_t kblock,
                   const Columns& columns) {
  const ptrdiff_t align = 48;
  const ptrdiff_t units = (N + align - 1) / align;
  const int used = int(std::max<ptrdiff_t>(1, std::min<ptrdiff_t>(threads, units)));
  const int parts = int(std::min<ptrdiff_t>(units, used > 1 ? 2 * used : 1));
  // product.h's `acc` (rows x (strip + kPad)) and `buf` (one panel of up to 64 columns, x's block)
  const size_t acc_floats = size_t(rows) * size_t(strip + 64),
               pack_floats = size_t(kblock + 16) * size_t(64 + rows);
  auto part = [&](int i) {
    const ptrdiff_t c0 = std::min(N, units * i / parts * align), c1 = std::min(N, units * (i + 1) / parts * align);
    if (c0 < c1) {
      float* acc = scratch(acc_floats + pack_floats);
      columns(c0, c1, acc, acc + acc_floats);
    }
  };
  py::gil_scoped_release release;
  pool().run(used - 1, parts, part);
}

// The arrays are C-contiguous host arrays that Python checked.
void product(int dtype, const py::array& x, const py::array& w, int layout, py::array& out, ptrdiff_t rows,
             ptrdiff_t K, ptrdiff_t N, int threads, ptrdiff_t strip, ptrdiff_t kblock, const std::string& which) {
  Product fn = product_of(which.empty() ? isa() : which);
  const float* xp = static_cast<const float*>(x.data());
  const void* wp = w.data();
  float* op = static_cast<float*>(out.mutable_data());
  split_columns(rows, N, threads, strip, kblock, [&](ptrdiff_t c0, ptrdiff_t c1, float* acc, float* buf) {
    fn(dtype, xp, wp, layout, op, rows, K, N, c0, c1, strip, kblock, acc, buf);
  });
}

// The same for FP8 weights: q e4m3fn bytes [K, N] and one f32 scale per 128 x 128 block
// (product.h's fp8_columns).
void product_fp8(const py::array& x, const py::array& q, const py::array& scale, py::array& out, ptrdiff_t rows,
                 ptrdiff_t K, ptrdiff_t N, int threads, ptrdiff_t strip, ptrdiff_t kblock, const std::string& which) {
  ProductFp8 fn = product_fp8_of(which.empty() ? isa() : which);
  const float* xp = static_cast<const float*>(x.data());
  const uint8_t* qp = static_cast<const uint8_t*>(q.data());
  const float* sp = static_cast<const float*>(scale.data());
  float* op = static_cast<float*>(out.mutable_data());
  split_columns(rows, N, threads, strip, kblock, [&](ptrdiff_t c0, ptrdiff_t c1, float* acc, float* buf) {
    fn(xp, qp, sp, op, rows, K, N, c0, c1, strip, kblock, acc, buf);
  });
}

template <typename T>
T* ptr(py::array& a) {
  return static_cast<T*>(a.mutable_data());
}

template <typename T>
const T* cptr(const py::array& a) {
  return static_cast<const T*>(a.data());
}

// host_ops.cpp's walk of the gated delta rule (arrays checked by dspark.ops.host) on `threads`
// threads, the (session, head) pairs split into two pieces per thread as the product's columns.
void delta_columns(py::array& S, const py::array& q, const py::array& k, const py::array& v, const py::array& alpha,
                   const py::array& beta, const py::array& indptr, int sessions, int heads, int dv, int dk,
                   py::array& out, py::object ckpt, int threads) {
  py::array ck_array = ckpt.is_none() ? py::array() : ckpt.cast<py::array>();
  float* ck = ckpt.is_none() ? nullptr : ptr<float>(ck_array);
  float* s = ptr<float>(S);
  float* o = ptr<float>(out);
  const int pairs = sessions * heads;
  const int used = std::max(1, std::min(threads, pairs));
  const int parts = std::min(pairs, used > 1 ? 2 * used : 1);
  auto part = [&](int i) {
    dspark_cpu::delta_columns(s, cptr<float>(q), cptr<float>(k), cptr<float>(v), cptr<float>(alpha),
                              cptr<float>(beta), cptr<int>(indptr), heads, dv, dk, o, ck, pairs * i / parts,
                              pairs * (i + 1) / parts);
  };
  py::gil_scoped_release release;
  pool().run(used - 1, parts, part);
}

void rmsnorm(const py::array& x, const py::array& weight, float eps, ptrdiff_t rows, ptrdiff_t n, py::array& y) {
  float* out = ptr<float>(y);
  py::gil_scoped_release release;
  dspark_cpu::rmsnorm(cptr<float>(x), cptr<float>(weight), eps, rows, n, out);
}

void attention_scores(const py::array& q, const py::array& k, int n, int hkv, int g, int L, int D, py::array& s) {
  float* out = ptr<float>(s);
  py::gil_scoped_release release;
  dspark_cpu::attention_scores(cptr<float>(q), cptr<float>(k), n, hkv, g, L, D, out);
}

void attention_weighted(const py::array& p, const py::array& v, int n, int hkv, int g, int L, int D, py::array& o) {
  float* out = ptr<float>(o);
  py::gil_scoped_release release;
  dspark_cpu::attention_weighted(cptr<float>(p), cptr<float>(v), n, hkv, g, L, D, out);
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "dspark's native CPU code for the numpy backend (csrc/cpu)";
  m.def("product", &product, py::arg("dtype"), py::arg("x"), py::arg("w"), py::arg("layout"), py::arg("out"),
        py::arg("rows"),
        py::arg("k"), py::arg("n"), py::arg("threads"), py::arg("strip"), py::arg("kblock"), py::arg("isa") = "",
        "out f32 [rows, N] = x f32 [rows, K] @ w [K, N] (dtype 0 f32, 1 f16, 2 bf16; layout 0: w [K, N]; 1: w given as w^T [N, K]; 2: w panel-major, dspark.ops.product.Panelled)");
  m.def("product_fp8", &product_fp8, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("out"), py::arg("rows"),
        py::arg("k"), py::arg("n"), py::arg("threads"), py::arg("strip"), py::arg("kblock"), py::arg("isa") = "",
        "out f32 [rows, N] = x f32 [rows, K] @ W, W = e4m3(q) * scale per 128 x 128 block (q uint8 [K, N], scale f32 "
        "[ceil(K / 128), ceil(N / 128)]; dspark.ops.product.product_fp8)");
  m.def("isa", [] { return isa(); }, "the instruction set in use: avx512, avx2 or base");
  m.def("delta_columns", &delta_columns, py::arg("S"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alpha"),
        py::arg("beta"), py::arg("indptr"), py::arg("sessions"), py::arg("heads"), py::arg("dv"), py::arg("dk"),
        py::arg("out"), py::arg("ckpt"), py::arg("threads") = 1,
        "the gated delta rule over each session's columns, (session, head) pairs split across threads (dspark.ops.host)");
  m.def("rmsnorm", &rmsnorm, "RMSNorm of rows, NumPy's summation order (dspark.ops.host)");
  m.def("attention_scores", &attention_scores, "q.k halving sums over D (dspark.ops.host)");
  m.def("attention_weighted", &attention_weighted, "p.v halving sums over the keys (dspark.ops.host)");
  py::list have;  // what this CPU runs, best first
  for (const auto& h : isas()) have.append(h);
  m.attr("isas") = py::tuple(have);
}
