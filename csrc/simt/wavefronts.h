// simt: shared-memory wavefronts of one warp-wide access, for the counting build (runtime.cpp,
// dspark/backends/simt_build.py: counting_env).
//
// Shared memory is 32 banks of 4-byte words (word w in bank w % 32); one wavefront serves at most
// one word per bank, to any number of lanes (a word read by several lanes is a broadcast: free).
// An access wider than 4 bytes is split into phases of 128 bytes: 8-byte accesses into half warps
// (lanes 0-15, 16-31), 16-byte ones into quarter warps (the CUDA programming guide's rule for
// compute capability 5.x and later; how Hopper merges phases whose lanes all read one address is
// not documented: counted as split, an upper bound there). A phase takes as many wavefronts as the
// bank holding the most distinct words among its lanes' words, at least one if any lane is active;
// an access takes the sum over its phases. ldmatrix: one phase per 8x8 matrix, its eight 16-byte
// rows given by lanes 8 i .. 8 i + 7. Hand-counted cases: tests/kernels/test_simt_wavefronts.py.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace simt {

inline int lanes_per_phase(int bytes) { return bytes <= 4 ? 32 : bytes <= 8 ? 16 : 8; }

struct Wavefronts {
  int wavefronts = 0;  // as the hardware serves the access
  int ideal = 0;       // with no bank conflict: distinct words / 32, rounded up, per phase
};

// One phase: the lanes [lo, hi) of `mask`, lane l addressing bytes [addr[l], addr[l] + bytes).
inline Wavefronts phase_wavefronts(const uint64_t* addr, unsigned mask, int lo, int hi, int bytes) {
  uint64_t words[32 * 8];
  std::vector<uint64_t> spill;  // a range access wider than 28 bytes per lane
  int n = 0;
  for (int l = lo; l < hi; ++l) {
    if (!(mask >> l & 1u)) continue;
    for (uint64_t w = addr[l] >> 2; w <= (addr[l] + bytes - 1) >> 2; ++w) {
      if (n < 32 * 8) words[n++] = w;
      else spill.push_back(w);
    }
  }
  if (!n) return {};
  std::vector<uint64_t> all(words, words + n);
  all.insert(all.end(), spill.begin(), spill.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  int per_bank[32] = {0}, most = 0;
  for (uint64_t w : all) most = std::max(most, ++per_bank[w & 31]);
  return {most, (int)((all.size() + 31) / 32)};
}

// A warp-wide access of `bytes` per lane (1, 2, 4, 8, 16, or wider for a range).
inline Wavefronts warp_wavefronts(const uint64_t* addr, unsigned mask, int bytes) {
  Wavefronts out;
  const int step = lanes_per_phase(bytes);
  for (int lo = 0; lo < 32; lo += step) {
    const Wavefronts w = phase_wavefronts(addr, mask, lo, lo + step, bytes);
    out.wavefronts += w.wavefronts;
    out.ideal += w.ideal;
  }
  return out;
}

}  // namespace simt
