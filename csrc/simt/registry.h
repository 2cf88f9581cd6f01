// simt kernel registry: maps an extern "C" entry point's name to a type-erased launcher.
//
// The build generates one translation unit per csrc/<family>.cu that includes the source and
// registers each entry point with `simt::Registration`. The parameter types are deduced here
// from the function pointer, so the Python side can check that what it parsed from the source
// is what the compiler saw.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "simt.h"

namespace simt {

// One parameter, as the compiler sees it. `code` is a NumPy dtype string for scalars
// ("<i4", "<f4", ...), "ptr" for pointers; `elem` is the pointee size (0 for void).
struct ParamType {
  std::string code;
  int elem;
  bool is_const;
};

struct Entry {
  std::string name;
  std::vector<ParamType> params;
  std::function<void(void**)> invoke;  // calls the kernel with params[i] pointing at arg i
};

std::map<std::string, Entry>& registry();

template <typename T>
struct ScalarCode;
template <> struct ScalarCode<int> { static const char* get() { return "<i4"; } };
template <> struct ScalarCode<unsigned> { static const char* get() { return "<u4"; } };
template <> struct ScalarCode<long long> { static const char* get() { return "<i8"; } };
template <> struct ScalarCode<unsigned long long> { static const char* get() { return "<u8"; } };
template <> struct ScalarCode<long> { static const char* get() { return "<i8"; } };
template <> struct ScalarCode<unsigned long> { static const char* get() { return "<u8"; } };
template <> struct ScalarCode<float> { static const char* get() { return "<f4"; } };
template <> struct ScalarCode<double> { static const char* get() { return "<f8"; } };

// The data a pointer parameter reaches: for a pointer table (`T* const*`), the T behind the
// table, since that is what a kernel reads or writes.
template <typename P>
constexpr bool data_is_const() {
  using Q = typename std::remove_cv<P>::type;
  if constexpr (std::is_pointer<Q>::value) return std::is_const<typename std::remove_pointer<Q>::type>::value;
  else return std::is_const<P>::value;
}

template <typename T>
ParamType param_type() {
  if constexpr (std::is_pointer<T>::value) {
    using P = typename std::remove_pointer<T>::type;
    int elem = 0;
    if constexpr (!std::is_void<P>::value) elem = (int)sizeof(P);
    return ParamType{"ptr", elem, data_is_const<P>()};
  } else {
    return ParamType{ScalarCode<T>::get(), (int)sizeof(T), true};
  }
}

template <typename... A, size_t... I>
void call_with(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(*static_cast<typename std::remove_reference<A>::type*>(p[I])...);
}

struct Registration {
  template <typename... A>
  Registration(const char* name, void (*f)(A...)) {
    Entry e;
    e.name = name;
    e.params = {param_type<A>()...};
    e.invoke = [f](void** p) { call_with(f, p, std::index_sequence_for<A...>{}); };
    registry()[name] = std::move(e);
  }
};

// Run `entry` over the whole grid. Throws KernelFault on a fault inside the kernel.
void launch(const Entry& entry, dim3 grid, dim3 block, void** params, size_t shared_mem);

// What the counting build counted in one launch (simt.h: count_ldmatrix), by kind of access.
enum SmemKind { kSmemLoad = 0, kSmemStore = 1, kSmemLdmatrix = 2, kSmemCpAsync = 3, kSmemKinds = 4 };
struct LaunchCounts {
  std::string kernel;
  dim3 grid, block;
  size_t shared_mem = 0;
  uint64_t requests[kSmemKinds] = {};    // warp-wide accesses
  uint64_t wavefronts[kSmemKinds] = {};  // as served, bank conflicts included
  uint64_t ideal[kSmemKinds] = {};       // with no bank conflict
  uint64_t mma = 0;                      // mma.sync m16n8k16 (warp instructions)
};
bool counts_shared_accesses();  // the counting build
void set_counting(bool on);     // throws in a build that does not count
std::vector<LaunchCounts> take_counts();

// Schedule between barriers: in thread-index order (seed == 0) or a random order drawn
// afresh for every block from `seed`.
void set_schedule(uint64_t seed);
uint64_t schedule_seed();

}  // namespace simt
