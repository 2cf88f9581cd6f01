// simt: run unmodified CUDA C++ kernel sources on the CPU.
//
// Each CUDA thread of a block is a fiber on one host thread; blocks run one after
// another (in index order, or in a random order under a schedule seed), so `__shared__` can simply
// be a function-local `static` (one block owns it at a time). Barriers (`__syncthreads*`) and warp ops (`__shfl*`, votes, `__syncwarp`) are
// scheduling points: a fiber that reaches one parks until every thread it waits for arrives.
// Between barriers the scheduler runs fibers in index order, or in a fresh random order per
// launch when asked (see set_schedule), so a missing barrier changes the result.
//
// sm_80's asynchronous copies and warp-level matrix instructions are emulated too (tensor_core.h;
// the device spellings are in ../tensor_core.cuh): cp.async with commit_group / wait_group per
// thread, each copy landing as late as its wait allows (index order) or at a random point up to it
// (random schedule), so a missing wait or a buffer overwritten too early shows; ldmatrix and
// mma.sync m16n8k16 as warp collectives, in the PTX ISA's fragment layouts and a stated order.
//
// What the runtime refuses, with an exception instead of a hang:
//   * blocks over 1024 threads or sm_90's per-dimension limits, dynamic shared memory over
//     sm_90's 227 KiB opt-in limit;
//   * a warp op whose mask names a lane that does not exist, or that exits or waits elsewhere
//     (a warp op reached by part of a warp);
//   * a __syncthreads that some live thread never reaches;
//   * ldmatrix / mma.sync in a warp of fewer than 32 threads, ldmatrix rows or cp.async
//     destinations outside dynamic shared memory or misaligned.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <climits>
#include <cfloat>
#include <string>
#include <type_traits>
#include <vector>
#include <stdexcept>

#define __global__
#define __device__
#define __host__
#define __noinline__ __attribute__((noinline))
// Emulation code that runs as one lane on behalf of the whole warp (warp collectives) must not be
// seen by the counting build's access instrumentation: it is counted as the warp's instruction.
#define SIMT_NOT_INSTRUMENTED __attribute__((no_sanitize_thread))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
// One block runs at a time on the host thread, so block-shared storage is a static local.
#define __shared__ static
#define __constant__ static const

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef dim3 uint3;

namespace simt {

constexpr int kWarpSize = 32;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned kMaxGridDim[3] = {2147483647u, 65535u, 65535u};
constexpr size_t kMaxDynamicSmem = 227 * 1024;  // sm_90 opt-in limit per block

// Raised inside a fiber; carried out of the launch as a C++ exception.
struct KernelFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Thread;
Thread* current_thread();
const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void* dynamic_smem();
[[noreturn]] void fault(const std::string& what);

// Barriers. `kind` distinguishes the reduction forms so mismatched barriers are caught.
enum BarrierKind { kBarPlain = 0, kBarCount = 1, kBarOr = 2, kBarAnd = 3 };
int block_barrier(BarrierKind kind, int predicate);

// Warp ops: every lane in `mask` deposits 8 bytes, waits for the others, and reads them back.
// `op` names the intrinsic, for error messages and to catch divergent warp ops.
const uint64_t* warp_exchange(const char* op, unsigned mask, uint64_t value);
int lane_id();
size_t dynamic_smem_size();

// A collective of all 32 lanes of a full warp (ldmatrix, mma.sync: `.sync.aligned`). Each lane
// passes its operands `in` and where its results go, `out`; when the last lane arrives, `fn`
// runs once over every lane's operands and results, while the other lanes are parked (their
// stacks, where in/out live, stay put).
typedef void (*WarpCollectiveFn)(const void* const* in, void* const* out);
void warp_collective(const char* op, const void* in, void* out, WarpCollectiveFn fn);

// cp.async (see tensor_core.h): a copy is recorded when issued and lands later, at a point
// chosen by the schedule; commit_group and wait_group work as in PTX, per thread.
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int newest_pending);

// Counting (the counting build only, SIMT_COUNT_SMEM: dspark/backends/simt_build.py counting_env).
// Per launch, while switched on: every warp-wide shared-memory access (plain loads and stores, each
// seen through the compiler's access instrumentation; ldmatrix; cp.async's shared side), its
// wavefronts with bank conflicts (simt/wavefronts.h) and without, and the mma.sync issued. A warp's
// access is the k-th execution of one instruction by each of its lanes between two __syncthreads
// (lanes that run it fewer times are inactive in the later ones), as a warp issues it on hardware.
// The plain build is not instrumented: it counts nothing and refuses to be asked.
void count_ldmatrix(const void* const* rows, int matrices);
void count_mma();

}  // namespace simt

#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())
#define warpSize 32

// ---- barriers ------------------------------------------------------------------------------
inline void __syncthreads() { simt::block_barrier(simt::kBarPlain, 0); }
inline int __syncthreads_count(int p) { return simt::block_barrier(simt::kBarCount, p); }
inline int __syncthreads_or(int p) { return simt::block_barrier(simt::kBarOr, p); }
inline int __syncthreads_and(int p) { return simt::block_barrier(simt::kBarAnd, p); }
// One host thread runs everything in program order: fences have nothing left to order.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __syncwarp(unsigned mask = 0xffffffffu) { simt::warp_exchange("__syncwarp", mask, 0); }

// ---- warp shuffles and votes -----------------------------------------------------------------
namespace simt {
template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type over 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
template <typename T>
inline T shuffle(const char* op, unsigned mask, T v, int src_lane, int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fault(std::string(op) + ": width must be a power of two in [1, 32]");
  const uint64_t* slots = warp_exchange(op, mask, to_bits(v));
  if (src_lane < 0) return v;
  if (!(mask >> src_lane & 1u))
    fault(std::string(op) + ": source lane " + std::to_string(src_lane) + " is not in the mask");
  return from_bits<T>(slots[src_lane]);
}
}  // namespace simt

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  int lane = simt::lane_id();
  int s = (lane & ~(width - 1)) + (src & (width - 1));
  return simt::shuffle("__shfl_sync", mask, v, s, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  int lane = simt::lane_id();
  int s = lane ^ lane_mask;
  // Outside the caller's segment the hardware returns the caller's own value.
  if ((s & ~(width - 1)) != (lane & ~(width - 1))) s = -1;
  return simt::shuffle("__shfl_xor_sync", mask, v, s, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  int lane = simt::lane_id();
  int s = lane + (int)delta;
  if ((s & ~(width - 1)) != (lane & ~(width - 1))) s = -1;
  return simt::shuffle("__shfl_down_sync", mask, v, s, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  int lane = simt::lane_id();
  int s = lane - (int)delta;
  if (s < 0 || (s & ~(width - 1)) != (lane & ~(width - 1))) s = -1;
  return simt::shuffle("__shfl_up_sync", mask, v, s, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  const uint64_t* slots = simt::warp_exchange("__ballot_sync", mask, pred != 0);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && slots[l]) r |= 1u << l;
  return r;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }
inline unsigned __activemask() { return 0xffffffffu; }

// ---- atomics: fibers never preempt each other, so a plain read-modify-write is atomic ---------
template <typename T>
inline T atomicAdd(T* a, T v) { T o = *a; *a = o + v; return o; }
template <typename T>
inline T atomicSub(T* a, T v) { T o = *a; *a = o - v; return o; }
template <typename T>
inline T atomicMin(T* a, T v) { T o = *a; *a = v < o ? v : o; return o; }
template <typename T>
inline T atomicMax(T* a, T v) { T o = *a; *a = v > o ? v : o; return o; }
template <typename T>
inline T atomicExch(T* a, T v) { T o = *a; *a = v; return o; }
template <typename T>
inline T atomicCAS(T* a, T cmp, T v) { T o = *a; if (o == cmp) *a = v; return o; }
template <typename T>
inline T atomicOr(T* a, T v) { T o = *a; *a = o | v; return o; }
template <typename T>
inline T atomicAnd(T* a, T v) { T o = *a; *a = o & v; return o; }

// ---- math and bit intrinsics ------------------------------------------------------------------
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
template <typename T>
inline T __ldg(const T* p) { return *p; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// ---- vector types -----------------------------------------------------------------------------
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(4) ushort2 { unsigned short x, y; };
struct alignas(8) ushort4 { unsigned short x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

#include "tensor_core.h"
