// simt runtime: the fiber scheduler behind simt.h. See simt.h for the execution model.
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <unordered_map>

#include "registry.h"
#include "wavefronts.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SIMT_ASAN 1
#else
#define SIMT_ASAN 0
#endif

// Fiber switches. On x86-64 a few instructions save the callee-saved registers, the x87 and SSE
// control words and the stack pointer, and load the other fiber's: no system call (swapcontext
// saves the signal mask with one on every switch, which dominated the runtime of warp-heavy
// kernels). Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void simt_switch_fiber(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl simt_switch_fiber
  .hidden simt_switch_fiber
  .type simt_switch_fiber, @function
simt_switch_fiber:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch_fiber, .-simt_switch_fiber
)");
#endif

namespace simt {

namespace {

// Sanitizer builds use far more stack per frame.
constexpr size_t kStackBytes = SIMT_ASAN ? (512u << 10) : (128u << 10);

#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};

// A fresh fiber's stack, as simt_switch_fiber leaves a parked one: control words, six callee-saved
// registers, then `entry` as the return address, with the stack aligned as at a call.
void context_init(Context& c, char* stack, size_t size, void (*entry)()) {
#if SIMT_ASAN
  __asan_unpoison_memory_region(stack, size);  // the stack's last fiber left its frames' redzones
#endif
  uint64_t* sp = reinterpret_cast<uint64_t*>(stack + size);
  *--sp = 0;  // entry's own return address slot: never used, entry never returns
  *--sp = reinterpret_cast<uint64_t>(entry);
  for (int i = 0; i < 6; ++i) *--sp = 0;
  uint16_t fpu;
  uint32_t sse;
  asm volatile("fnstcw %0" : "=m"(fpu));
  asm volatile("stmxcsr %0" : "=m"(sse));
  *--sp = sse;  // read back by ldmxcsr 8(%rsp): the low 4 bytes
  *--sp = fpu;  // fldcw (%rsp): the low 2 bytes
  c.sp = sp;
}

void context_switch(Context& from, Context& to) { simt_switch_fiber(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};

void context_init(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

enum State { kRunnable, kAtBarrier, kAtWarp, kExited };

// When a cp.async lands. In index order (no schedule seed) always as late as PTX allows, at the
// wait_group that covers it, so a missing wait reads stale shared memory; under a random schedule
// each copy draws one of the three, so a buffer overwritten while others still read it shows too.
enum Landing { kAtWait, kNow, kAtNextSchedulingPoint };

struct AsyncCopy {
  unsigned char* dst;
  const unsigned char* src;
  int bytes, src_bytes;
  int group;  // 0 until committed, then the group's number (1, 2, ...)
  Landing landing;
};

}  // namespace

struct Thread {
  dim3 tid;
  int index = 0;
  int lane = 0;
  int warp = 0;
  State state = kRunnable;
  Context ctx;
  char* stack = nullptr;
  // Pending warp op.
  const char* warp_op = nullptr;
  unsigned warp_mask = 0;
  uint64_t exchanged[kWarpSize];
  // Pending block barrier.
  int bar_result = 0;
  // Pending warp collective: where this lane's results go.
  void* collective_out = nullptr;
  // cp.async copies issued and not landed yet, and the number of groups committed so far.
  std::vector<AsyncCopy> copies;
  int committed = 0;
#if SIMT_ASAN
  void* fake_stack = nullptr;
#endif
};

namespace {

struct Warp {
  unsigned existing = 0;  // lanes that exist in this (possibly partial) warp
  unsigned arrived = 0;
  uint64_t slots[kWarpSize];
};

void land(AsyncCopy& c) {
  if (c.src_bytes) std::memcpy(c.dst, c.src, (size_t)c.src_bytes);
  if (c.bytes > c.src_bytes) std::memset(c.dst + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
}

// Land the copies of `t` that `pred` selects, in issue order.
template <typename Pred>
void land_if(Thread& t, Pred pred) {
  size_t keep = 0;
  for (size_t i = 0; i < t.copies.size(); ++i) {
    if (pred(t.copies[i])) land(t.copies[i]);
    else t.copies[keep++] = t.copies[i];
  }
  t.copies.resize(keep);
}

void land_at_scheduling_point(Thread& t) {
  if (!t.copies.empty()) land_if(t, [](const AsyncCopy& c) { return c.landing == kAtNextSchedulingPoint; });
}

struct BlockState {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<int> runq;
  size_t runq_head = 0;
  int live = 0;
  int bar_arrived = 0;
  int bar_kind = -1;
  int bar_accum = 0;
  dim3 block_idx, block_dim, grid_dim;
  Thread* current = nullptr;
  const Entry* entry = nullptr;
  void** params = nullptr;
  std::vector<unsigned char> smem;
  Context sched_ctx;
  std::string fault;  // set when a fiber faulted; the launch aborts
  std::mt19937_64 rng;
  uint64_t seed = 0;
#if SIMT_ASAN
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake_stack = nullptr;
#endif
};

BlockState g;
std::vector<char*> g_stacks;

// ---- counting (simt.h: count_ldmatrix; the counting build's access hooks at the end) -------------
// One warp-wide access in the making: the lanes that executed instruction `pc` for the k-th time
// since the last __syncthreads, each with its address.
struct PendingAccess {
  int kind = 0;
  int bytes = 0;
  unsigned mask = 0;
  uint64_t addr[kWarpSize];
};
struct AccessKey {
  uintptr_t pc;
  uint32_t occurrence;
  bool operator==(const AccessKey& o) const { return pc == o.pc && occurrence == o.occurrence; }
};
struct AccessKeyHash {
  size_t operator()(const AccessKey& k) const { return std::hash<uintptr_t>()(k.pc * 0x9e3779b97f4a7c15ull + k.occurrence); }
};

struct Counting {
  bool on = false;
  std::vector<LaunchCounts> launches;
  std::vector<std::unordered_map<AccessKey, PendingAccess, AccessKeyHash>> pending;  // per warp
  std::vector<std::unordered_map<uintptr_t, uint32_t>> occurrences;                  // per thread: pc -> count
};
Counting g_count;

void add_access(int kind, const Wavefronts& w) {
  LaunchCounts& c = g_count.launches.back();
  c.requests[kind] += 1;
  c.wavefronts[kind] += (uint64_t)w.wavefronts;
  c.ideal[kind] += (uint64_t)w.ideal;
}

// Every lane of the block is at a __syncthreads (or done): the accesses before it are complete.
void flush_accesses() {
  for (auto& warp : g_count.pending) {
    for (auto& [key, a] : warp) add_access(a.kind, warp_wavefronts(a.addr, a.mask, a.bytes));
    warp.clear();
  }
  for (auto& o : g_count.occurrences) o.clear();
}

void record_access(int kind, const void* addr, int bytes, const void* pc) {
  Thread* t = g.current;
  const uint32_t k = g_count.occurrences[t->index][(uintptr_t)pc]++;
  PendingAccess& a = g_count.pending[t->warp][AccessKey{(uintptr_t)pc, k}];
  if (!a.mask) a.kind = kind, a.bytes = bytes;
  a.mask |= 1u << t->lane;
  a.addr[t->lane] = (uint64_t)(uintptr_t)addr;
}

char* stack_for(int i) {
  while ((int)g_stacks.size() <= i) {
    void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("simt: cannot map a fiber stack");
    g_stacks.push_back(static_cast<char*>(p));
  }
  return g_stacks[i];
}

void make_runnable(Thread& t) {
  t.state = kRunnable;
  g.runq.push_back(t.index);
}

// Park the current fiber and return to the scheduler; resumes when made runnable again.
void park() {
  Thread* t = g.current;
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(&t->fake_stack, g.sched_stack_bottom, g.sched_stack_size);
#endif
  context_switch(t->ctx, g.sched_ctx);
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(t->fake_stack, nullptr, nullptr);
#endif
}

std::string describe(const Thread& t) {
  std::ostringstream s;
  s << "thread (" << t.tid.x << "," << t.tid.y << "," << t.tid.z << ") of block (" << g.block_idx.x << ","
    << g.block_idx.y << "," << g.block_idx.z << ")";
  return s.str();
}

void release_barrier() {
  if (g_count.on) flush_accesses();
  int result = g.bar_kind == kBarCount ? g.bar_accum
               : g.bar_kind == kBarOr  ? (g.bar_accum > 0)
               : g.bar_kind == kBarAnd ? (g.bar_accum == g.bar_arrived)
                                       : 0;
  for (Thread& o : g.threads)
    if (o.state == kAtBarrier) {
      o.bar_result = result;
      if (&o != g.current) make_runnable(o);
      else o.state = kRunnable;
    }
  g.bar_arrived = 0;
  g.bar_accum = 0;
  g.bar_kind = -1;
}

// A lane in `mask` that exited can never arrive: that is a warp op reached by part of a warp.
void check_warp_partners(const Warp& w, unsigned mask, const char* op) {
  int base = g.current->warp * kWarpSize;
  for (int l = 0; l < kWarpSize; ++l) {
    if (!(mask >> l & 1u)) continue;
    const Thread& o = g.threads[base + l];
    if (o.state == kExited)
      fault(std::string(op) + " reached by part of a warp: lane " + std::to_string(l) + " (" + describe(o) +
            ") already exited");
    if (o.state == kAtWarp && o.warp_mask != mask)
      fault(std::string(op) + ": lanes of one warp wait with different masks");
    if (o.state == kAtWarp && std::strcmp(o.warp_op, op) != 0 &&
        !(std::strncmp(o.warp_op, "__shfl", 6) == 0 && std::strncmp(op, "__shfl", 6) == 0))
      fault(std::string(op) + " met " + o.warp_op + " in the same warp: divergent warp ops");
  }
  (void)w;
}

void fiber_main() {
  Thread* t = g.current;
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g.sched_stack_bottom, &g.sched_stack_size);
#endif
  try {
    g.entry->invoke(g.params);
  } catch (const std::exception& e) {
    if (g.fault.empty()) g.fault = e.what();
  }
  // Copies still in flight complete after the thread is gone.
  land_if(*t, [](const AsyncCopy&) { return true; });
  t->state = kExited;
  g.live--;
  if (g.fault.empty()) {
    // Exited threads count as arrived at block barriers (as on sm_70+).
    if (g.bar_arrived > 0 && g.bar_arrived == g.live) release_barrier();
    // ...but never at warp ops: a waiting partner would hang on hardware.
    const Warp& w = g.warps[t->warp];
    int base = t->warp * kWarpSize;
    for (int l = 0; l < kWarpSize; ++l) {
      const Thread* o = (w.existing >> l & 1u) ? &g.threads[base + l] : nullptr;
      if (o && o->state == kAtWarp && (o->warp_mask >> t->lane & 1u)) {
        g.fault = std::string(o->warp_op) + " reached by part of a warp: " + describe(*t) + " exited while " +
                  describe(*o) + " waits for it";
        break;
      }
    }
  }
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(nullptr, g.sched_stack_bottom, g.sched_stack_size);
#endif
  context_switch(t->ctx, g.sched_ctx);  // never resumed
}

int pick_next() {
  if (g.seed == 0 || g.runq.size() - g.runq_head <= 1) return g.runq[g.runq_head++];
  size_t n = g.runq.size() - g.runq_head;
  size_t k = g.runq_head + (size_t)(g.rng() % n);
  std::swap(g.runq[k], g.runq[g.runq_head]);
  return g.runq[g.runq_head++];
}

std::string deadlock_report() {
  std::ostringstream s;
  int at_bar = 0, at_warp = 0;
  const Thread* warp_waiter = nullptr;
  const Thread* bar_waiter = nullptr;
  for (const Thread& t : g.threads) {
    if (t.state == kAtBarrier) { at_bar++; if (!bar_waiter) bar_waiter = &t; }
    if (t.state == kAtWarp) { at_warp++; if (!warp_waiter) warp_waiter = &t; }
  }
  if (warp_waiter)
    s << warp_waiter->warp_op << " reached by part of a warp: " << describe(*warp_waiter)
      << " waits for lanes that are at __syncthreads or elsewhere (" << at_warp << " threads at warp ops, "
      << at_bar << " at __syncthreads)";
  else
    s << "__syncthreads not reached by every live thread: " << at_bar << " of " << g.live
      << " live threads wait, e.g. " << describe(*bar_waiter);
  return s.str();
}

void run_block() {
  int n = (int)g.threads.size();
  g.runq.clear();
  g.runq_head = 0;
  g.live = n;
  g.bar_arrived = 0;
  g.bar_accum = 0;
  g.bar_kind = -1;
  for (Warp& w : g.warps) w.arrived = 0;
  for (int i = 0; i < n; ++i) {
    Thread& t = g.threads[i];
    t.state = kRunnable;
    t.stack = stack_for(i);
    context_init(t.ctx, t.stack, kStackBytes, fiber_main);
    g.runq.push_back(i);
  }
  while (g.runq_head < g.runq.size()) {
    Thread& t = g.threads[pick_next()];
    g.current = &t;
#if SIMT_ASAN
    __sanitizer_start_switch_fiber(&g.sched_fake_stack, t.stack, kStackBytes);
#endif
    context_switch(g.sched_ctx, t.ctx);
#if SIMT_ASAN
    __sanitizer_finish_switch_fiber(g.sched_fake_stack, nullptr, nullptr);
#endif
    g.current = nullptr;
    if (!g.fault.empty()) throw KernelFault(g.entry->name + ": " + g.fault);
    // Compact the queue now and then so it does not grow without bound.
    if (g.runq_head > 4096 && g.runq_head * 2 > g.runq.size()) {
      g.runq.erase(g.runq.begin(), g.runq.begin() + g.runq_head);
      g.runq_head = 0;
    }
  }
  if (g.live > 0) throw KernelFault(g.entry->name + ": " + deadlock_report());
  if (g_count.on) flush_accesses();
}

}  // namespace

std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}

Thread* current_thread() { return g.current; }
const dim3& thread_idx() { return g.current->tid; }
const dim3& block_idx() { return g.block_idx; }
const dim3& block_dim() { return g.block_dim; }
const dim3& grid_dim() { return g.grid_dim; }
void* dynamic_smem() { return g.smem.data(); }
size_t dynamic_smem_size() { return g.smem.size(); }
int lane_id() { return g.current->lane; }

void fault(const std::string& what) {
  if (g.current) throw KernelFault(describe(*g.current) + ": " + what);
  throw KernelFault(what);
}

int block_barrier(BarrierKind kind, int predicate) {
  Thread* t = g.current;
  land_at_scheduling_point(*t);  // __syncthreads does not wait for cp.async; this is only a chance
  if (g.bar_kind >= 0 && g.bar_kind != kind)
    fault("threads of one block wait at different __syncthreads forms");
  g.bar_kind = kind;
  g.bar_arrived++;
  g.bar_accum += predicate != 0;
  t->state = kAtBarrier;
  if (g.bar_arrived == g.live) release_barrier();
  else park();
  return t->bar_result;
}

namespace {

// The body of every warp op: deposit, wait for the lanes of `mask`, and (collectives) let the
// last lane to arrive compute every lane's results.
const uint64_t* warp_arrive(const char* op, unsigned mask, uint64_t value, WarpCollectiveFn fn, void* out) {
  Thread* t = g.current;
  Warp& w = g.warps[t->warp];
  land_at_scheduling_point(*t);
  if (!(mask >> t->lane & 1u)) fault(std::string(op) + ": the calling lane is not in the mask");
  if (mask & ~w.existing)
    fault(std::string(op) + ": the mask names lanes that do not exist in this warp (block of " +
          std::to_string(g.threads.size()) + " threads)");
  check_warp_partners(w, mask, op);
  w.slots[t->lane] = value;
  w.arrived |= 1u << t->lane;
  t->warp_op = op;
  t->warp_mask = mask;
  t->collective_out = out;
  t->state = kAtWarp;
  if ((w.arrived & mask) == mask) {
    int base = t->warp * kWarpSize;
    if (fn) {
      const void* in[kWarpSize];
      void* outs[kWarpSize];
      for (int l = 0; l < kWarpSize; ++l) {
        in[l] = reinterpret_cast<const void*>(w.slots[l]);
        outs[l] = g.threads[base + l].collective_out;
      }
      fn(in, outs);
    }
    for (int l = 0; l < kWarpSize; ++l) {
      if (!(mask >> l & 1u)) continue;
      Thread& o = g.threads[base + l];
      if (!fn)
        for (int s = 0; s < kWarpSize; ++s) o.exchanged[s] = (mask >> s & 1u) ? w.slots[s] : 0;
      if (&o != t) make_runnable(o);
    }
    w.arrived &= ~mask;
    t->state = kRunnable;
  } else {
    park();
  }
  return t->exchanged;
}

}  // namespace

const uint64_t* warp_exchange(const char* op, unsigned mask, uint64_t value) {
  return warp_arrive(op, mask, value, nullptr, nullptr);
}

void warp_collective(const char* op, const void* in, void* out, WarpCollectiveFn fn) {
  if (g.warps[g.current->warp].existing != 0xffffffffu)
    fault(std::string(op) + " needs a whole warp of 32 threads (block of " + std::to_string(g.threads.size()) +
          " threads)");
  warp_arrive(op, 0xffffffffu, reinterpret_cast<uint64_t>(in), fn, out);
}

void check_shared_rows(const char* op, const void* const* rows, int count) {
  const unsigned char* lo = g.smem.data();
  const unsigned char* hi = lo + g.smem.size();
  for (int l = 0; l < count; ++l) {
    const unsigned char* p = *static_cast<const unsigned char* const*>(rows[l]);
    if (reinterpret_cast<uintptr_t>(p) % 16)
      fault(std::string(op) + ": lane " + std::to_string(l) + "'s row address is not 16-byte aligned");
    if (p < lo || p + 16 > hi)
      fault(std::string(op) + ": lane " + std::to_string(l) + "'s row is outside dynamic shared memory");
  }
}

void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  Thread* t = g.current;
  auto* d = static_cast<unsigned char*>(dst);
  if (bytes != 4 && bytes != 8 && bytes != 16) fault("cp.async copies 4, 8 or 16 bytes, not " + std::to_string(bytes));
  if (src_bytes < 0 || src_bytes > bytes) fault("cp.async: src-size " + std::to_string(src_bytes) + " outside [0, cp-size]");
  if (reinterpret_cast<uintptr_t>(dst) % bytes || (src_bytes && reinterpret_cast<uintptr_t>(src) % bytes))
    fault("cp.async: addresses must be aligned to the copy size (" + std::to_string(bytes) + " bytes)");
  if (d < g.smem.data() || d + bytes > g.smem.data() + g.smem.size())
    fault("cp.async: the destination is outside dynamic shared memory");
  Landing landing = g.seed ? static_cast<Landing>(g.rng() % 3) : kAtWait;
  if (g_count.on) record_access(kSmemCpAsync, dst, bytes, __builtin_return_address(0));
  AsyncCopy c{d, static_cast<const unsigned char*>(src), bytes, src_bytes, 0, landing};
  if (landing == kNow) land(c);
  else t->copies.push_back(c);
}

void cp_async_commit() {
  Thread* t = g.current;
  ++t->committed;
  for (AsyncCopy& c : t->copies)
    if (!c.group) c.group = t->committed;
}

void cp_async_wait(int newest_pending) {
  Thread* t = g.current;
  const int done = t->committed - newest_pending;  // groups 1..done must have landed
  land_if(*t, [done](const AsyncCopy& c) { return c.group && c.group <= done; });
}

void count_ldmatrix(const void* const* rows, int matrices) {
  if (!g_count.on) return;
  uint64_t addr[kWarpSize];
  for (int l = 0; l < 8 * matrices; ++l)
    addr[l] = (uint64_t)(uintptr_t)*static_cast<const unsigned char* const*>(rows[l]);
  const unsigned mask = matrices == 4 ? 0xffffffffu : (1u << (8 * matrices)) - 1u;
  add_access(kSmemLdmatrix, warp_wavefronts(addr, mask, 16));  // 16-byte rows: a phase per 8 lanes
}

void count_mma() {
  if (g_count.on) g_count.launches.back().mma += 1;
}

bool counts_shared_accesses() {
#if defined(SIMT_COUNT_SMEM)
  return true;
#else
  return false;
#endif
}

void set_counting(bool on) {
  if (on && !counts_shared_accesses())
    throw std::runtime_error("this build of dspark._simt does not count shared-memory accesses (its kernels are "
                             "not instrumented); the counting build does: dspark.backends.simt_build.counting_env()");
  g_count.on = on;
}

std::vector<LaunchCounts> take_counts() {
  std::vector<LaunchCounts> out;
  out.swap(g_count.launches);
  return out;
}

void set_schedule(uint64_t seed) { g.seed = seed; g.rng.seed(seed); }
uint64_t schedule_seed() { return g.seed; }

void launch(const Entry& entry, dim3 grid, dim3 block, void** params, size_t shared_mem) {
  const unsigned bd[3] = {block.x, block.y, block.z}, gd[3] = {grid.x, grid.y, grid.z};
  const char* axis = "xyz";
  for (int i = 0; i < 3; ++i) {
    if (bd[i] == 0 || bd[i] > kMaxBlockDim[i])
      throw KernelFault(entry.name + ": block." + axis[i] + "=" + std::to_string(bd[i]) + " is outside [1, " +
                        std::to_string(kMaxBlockDim[i]) + "]");
    if (gd[i] > kMaxGridDim[i])
      throw KernelFault(entry.name + ": grid." + axis[i] + "=" + std::to_string(gd[i]) + " exceeds " +
                        std::to_string(kMaxGridDim[i]));
  }
  size_t nthreads = (size_t)block.x * block.y * block.z;
  if (nthreads > (size_t)kMaxThreadsPerBlock)
    throw KernelFault(entry.name + ": a block of " + std::to_string(nthreads) + " threads exceeds 1024");
  if (shared_mem > kMaxDynamicSmem)
    throw KernelFault(entry.name + ": shared_mem=" + std::to_string(shared_mem) + " exceeds sm_90's " +
                      std::to_string(kMaxDynamicSmem) + " bytes");
  if ((size_t)grid.x * grid.y * grid.z == 0) return;

  if (g_count.on) {
    LaunchCounts c;
    c.kernel = entry.name;
    c.grid = grid;
    c.block = block;
    c.shared_mem = shared_mem;
    g_count.launches.push_back(c);
    g_count.pending.assign((nthreads + kWarpSize - 1) / kWarpSize, {});
    g_count.occurrences.assign(nthreads, {});
  }
  g.entry = &entry;
  g.params = params;
  g.fault.clear();
  g.block_dim = block;
  g.grid_dim = grid;
  // Poison dynamic shared memory so a read before a write shows (0xff.. is a NaN / -1).
  g.smem.assign(std::max<size_t>(shared_mem, 16), 0xff);
  g.threads.assign(nthreads, Thread());
  g.warps.assign((nthreads + kWarpSize - 1) / kWarpSize, Warp());
  for (size_t i = 0; i < nthreads; ++i) {
    Thread& t = g.threads[i];
    t.index = (int)i;
    t.lane = (int)(i % kWarpSize);
    t.warp = (int)(i / kWarpSize);
    t.tid = dim3((unsigned)(i % block.x), (unsigned)((i / block.x) % block.y), (unsigned)(i / ((size_t)block.x * block.y)));
    g.warps[t.warp].existing |= 1u << t.lane;
  }
  // Blocks one after another: in index order, or (schedule seed) in a random order, as a GPU's CTAs
  // start and finish in any order, so a kernel whose result depends on which CTA came first (partials
  // added as they complete, say) shows.
  const size_t blocks = (size_t)grid.x * grid.y * grid.z;
  std::vector<size_t> order(blocks);
  for (size_t i = 0; i < blocks; ++i) order[i] = i;
  if (g.seed)
    for (size_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[(size_t)(g.rng() % i)]);
  for (size_t i : order) {
    g.block_idx = dim3((unsigned)(i % grid.x), (unsigned)(i / grid.x % grid.y), (unsigned)(i / ((size_t)grid.x * grid.y)));
    run_block();
  }
  g.entry = nullptr;
}

}  // namespace simt

// ---- the counting build's access hooks ----------------------------------------------------------
// Its kernel translation units are compiled with GCC's -fsanitize=thread instrumentation and no
// sanitizer runtime: every load and store the compiler emits calls one of these with its address,
// from the instruction's own site (the return address names it). Only addresses in shared memory
// count: the launch's dynamic shared memory, and the kernels' `__shared__` statics, which the build
// links between the two markers below (every .bss of the kernel units, in link order).
#if defined(SIMT_COUNT_SMEM)
extern "C" char simt_static_shared_begin[], simt_static_shared_end[];

namespace simt {
namespace {
inline void shared_access(const void* p, int bytes, const void* pc, bool write) {
  if (!g_count.on || !g.current) return;
  const auto* a = static_cast<const unsigned char*>(p);
  const bool dynamic = a >= g.smem.data() && a < g.smem.data() + g.smem.size();
  const bool stat = a >= reinterpret_cast<unsigned char*>(simt_static_shared_begin) &&
                    a < reinterpret_cast<unsigned char*>(simt_static_shared_end);
  if (dynamic || stat) record_access(write ? kSmemStore : kSmemLoad, p, bytes, pc);
}
}  // namespace
}  // namespace simt

#define SIMT_ACCESS_HOOKS(N)                                                                                         \
  extern "C" void __tsan_read##N(void* p) { simt::shared_access(p, N, __builtin_return_address(0), false); }          \
  extern "C" void __tsan_write##N(void* p) { simt::shared_access(p, N, __builtin_return_address(0), true); }          \
  extern "C" void __tsan_unaligned_read##N(void* p) { simt::shared_access(p, N, __builtin_return_address(0), false); } \
  extern "C" void __tsan_unaligned_write##N(void* p) { simt::shared_access(p, N, __builtin_return_address(0), true); }
SIMT_ACCESS_HOOKS(1)
SIMT_ACCESS_HOOKS(2)
SIMT_ACCESS_HOOKS(4)
SIMT_ACCESS_HOOKS(8)
SIMT_ACCESS_HOOKS(16)
extern "C" void __tsan_read_range(void* p, unsigned long n) {
  simt::shared_access(p, (int)n, __builtin_return_address(0), false);
}
extern "C" void __tsan_write_range(void* p, unsigned long n) {
  simt::shared_access(p, (int)n, __builtin_return_address(0), true);
}
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
#endif
