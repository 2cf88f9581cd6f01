// The numpy backend's product: out f32 [rows, N] = x f32 [rows, K] @ w [K, N], w read as stored
// (f32, f16 or bf16) and widened exactly, math in f32.
//
// One order per output, fixed by K alone (never by the rows, the column split, the thread count or
// the instruction set): acc = 0, then acc = acc + x[r, k] * w[k, n] for k = 0, 1, ..., K - 1, a
// multiply rounded to f32 and then an add rounded to f32 (the build passes -ffp-contract=off and
// enables no FMA, so nothing fuses them). dspark.ops.product.product_ref is that loop in NumPy and
// gives the same bits. Every lane of a vector does exactly the scalar arithmetic, so the AVX2 build
// (product_avx2.cpp), the baseline build (product_base.cpp) and the scalar tails all agree.
//
// Work. A thread owns columns [c0, c1) and walks them in strips of `strip` columns whose
// accumulators (rows x strip f32, rows padded apart) stay in cache; the result is copied out once.
// * One or two rows (decode): w streams in memory order. Each pass takes four rows of w and adds
//   them to the strip's accumulators (a = a + x0 w0; a = a + x1 w1; ... per vector of columns),
//   with the x values in registers and w prefetched kPrefetchRows ahead.
// * More rows: K in blocks of `kblock` rows of w; tiles of up to kTileRows rows x kPanel columns
//   keep their accumulators in registers over a block, one k at a time in order (`tile`), while
//   they prefetch the next block. Up to kDirectRows rows (verify) the tiles read w in place
//   (`tile` on w); more rows (prefill) first widen the block into panels [kblock][kPanel] contiguous
//   (`pack`) that every tile of rows then reads from cache. A transposed w (a tied LM head) is
//   always packed. Each weight is read from memory once per strip.
//
// This header is compiled once per instruction set, inside namespace DSPARK_CPU_ISA, with the
// vector width and tile shape that set's registers hold (generic GCC/Clang vector extensions).

#include <cstddef>
#include <cstdint>

#if defined(DSPARK_CPU_AVX2)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

// Loops over a tile's rows and vectors must unroll so its accumulators stay in registers.
#define DSPARK_UNROLL _Pragma("GCC unroll 16")

#ifndef DSPARK_LANES  // the baseline: SSE2's sixteen 4-float registers
#define DSPARK_LANES 4
#define DSPARK_TILE_ROWS 4
#define DSPARK_TILE_VECS 2
#define DSPARK_DIRECT_TILE_ROWS 4
#define DSPARK_DIRECT_TILE_VECS 3
#endif

namespace DSPARK_CPU_ISA {

constexpr int kLanes = DSPARK_LANES;          // floats per vector
constexpr int kUnroll = 4;                    // rows of w per pass of `stream`
constexpr int kStreamRows = 2;                // up to this many rows: `stream`; more: tiles
constexpr int kDirectRows = 8;                // up to this many rows, tiles read w in place; more: packed
constexpr int kPrefetchRows = 16;             // rows of w ahead of use that `stream` and `pack` prefetch
constexpr int kTileRows = DSPARK_TILE_ROWS;   // a tile's accumulators: kTileRows x kTileVecs vectors
constexpr int kTileVecs = DSPARK_TILE_VECS;
constexpr int kPanel = kTileVecs * kLanes;    // columns of a packed panel
constexpr int kDirectTileRows = DSPARK_DIRECT_TILE_ROWS;  // the tiles that read w in place
constexpr int kDirectTileVecs = DSPARK_DIRECT_TILE_VECS;
constexpr int kDirectPanel = kDirectTileVecs * kLanes;
constexpr int kPad = 64;                      // floats between accumulator rows beyond the strip

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));

static inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

template <typename To, typename From>
static inline To bits_as(From f);

static inline vf splat(float s) {  // one broadcast instruction where the target has one
#if defined(DSPARK_CPU_AVX2)
  return bits_as<vf>(_mm256_set1_ps(s));
#elif defined(__SSE2__) && DSPARK_LANES == 4
  return bits_as<vf>(_mm_set1_ps(s));
#else
  vf v;
  DSPARK_UNROLL
  for (int i = 0; i < kLanes; ++i) v[i] = s;
  return v;
#endif
}

template <typename To, typename From>
static inline To bits_as(From f) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To t;
  __builtin_memcpy(&t, &f, sizeof t);
  return t;
}

// Exact f16 -> f32 without F16C: the 15 magnitude bits shifted into place and scaled by 2^112
// (exact; subnormal halves become normal floats); exponent 31 (inf, NaN) maps to 255.
static inline float half_to_float(uint32_t h) {
  const uint32_t mag = (h & 0x7fffu) << 13;
  const uint32_t bits = (h & 0x7c00u) == 0x7c00u ? mag | 0x7f800000u
                                                 : bits_as<uint32_t>(bits_as<float>(mag) * bits_as<float>(0x77800000u));
  return bits_as<float>(bits | ((h & 0x8000u) << 16));
}

enum Dtype { kF32 = 0, kF16 = 1, kBF16 = 2 };

template <int DT> struct Weights;

template <> struct Weights<kF32> {
  using T = float;
  static inline vf vec(const T* p) { return load(p); }
  static inline float one(const T* p) { return *p; }
};

template <> struct Weights<kBF16> {  // a bf16 is the high half of an f32
  using T = uint16_t;
  static inline vf vec(const T* p) {
    vh h;
    __builtin_memcpy(&h, p, sizeof h);
    return bits_as<vf>(__builtin_convertvector(h, vu) << 16);
  }
  static inline float one(const T* p) { return bits_as<float>(uint32_t(*p) << 16); }
};

template <> struct Weights<kF16> {
  using T = uint16_t;
  static inline vf vec(const T* p) {
#if defined(DSPARK_CPU_AVX2)
    return bits_as<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    vh h;
    __builtin_memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu);
    const vu mag = (u & 0x7fffu) << 13;
    const vu scaled = bits_as<vu>(bits_as<vf>(mag) * splat(bits_as<float>(0x77800000u)));
    const vu special = (vu)((u & 0x7c00u) == 0x7c00u);  // all ones where the exponent is 31
    return bits_as<vf>(((scaled & ~special) | ((mag | 0x7f800000u) & special)) | ((u & 0x8000u) << 16));
#endif
  }
  static inline float one(const T* p) { return half_to_float(*p); }
};

// ---- one or two rows: w streamed in memory order ------------------------------------------------
// acc[r][n] (r < R, n < cols) += x[r][j] * w[j][n] for j = 0 .. 3 in order (four rows of w).
template <int DT, int R>
static void quad(const float* x, ptrdiff_t ldx, const typename Weights<DT>::T* w, ptrdiff_t ldw, float* acc,
                 ptrdiff_t lda, int cols, bool fetch) {
  using Wt = Weights<DT>;
  constexpr int kLine = 64 / int(sizeof(typename Wt::T));  // columns per cache line
  const int whole = cols / kLanes * kLanes;
  vf xs[R][kUnroll];
  DSPARK_UNROLL
  for (int r = 0; r < R; ++r)
    DSPARK_UNROLL
    for (int j = 0; j < kUnroll; ++j) xs[r][j] = splat(x[r * ldx + j]);
  for (int n = 0; n < whole; n += kLanes) {
    if (fetch && n % kLine == 0)
      DSPARK_UNROLL
      for (int j = 0; j < kUnroll; ++j) __builtin_prefetch(w + (kPrefetchRows + j) * ldw + n);
    vf b[kUnroll];
    DSPARK_UNROLL
    for (int j = 0; j < kUnroll; ++j) b[j] = Wt::vec(w + j * ldw + n);
    DSPARK_UNROLL
    for (int r = 0; r < R; ++r) {
      vf a = load(acc + r * lda + n);
      DSPARK_UNROLL
      for (int j = 0; j < kUnroll; ++j) a = a + xs[r][j] * b[j];
      store(acc + r * lda + n, a);
    }
  }
  for (int n = whole; n < cols; ++n)
    DSPARK_UNROLL
    for (int r = 0; r < R; ++r) {
      float a = acc[r * lda + n];
      DSPARK_UNROLL
      for (int j = 0; j < kUnroll; ++j) a = a + x[r * ldx + j] * Wt::one(w + j * ldw + n);
      acc[r * lda + n] = a;
    }
}

// The same for one row of w (the last K % 4).
template <int DT, int R>
static void single(const float* x, ptrdiff_t ldx, const typename Weights<DT>::T* w, float* acc, ptrdiff_t lda,
                   int cols) {
  using Wt = Weights<DT>;
  const int whole = cols / kLanes * kLanes;
  vf xs[R];
  DSPARK_UNROLL
  for (int r = 0; r < R; ++r) xs[r] = splat(x[r * ldx]);
  for (int n = 0; n < whole; n += kLanes) {
    const vf b = Wt::vec(w + n);
    DSPARK_UNROLL
    for (int r = 0; r < R; ++r) store(acc + r * lda + n, load(acc + r * lda + n) + xs[r] * b);
  }
  for (int n = whole; n < cols; ++n)
    DSPARK_UNROLL
    for (int r = 0; r < R; ++r) acc[r * lda + n] = acc[r * lda + n] + x[r * ldx] * Wt::one(w + n);
}

// acc [R, cols] += x [R, K] @ w [K, cols], k in order.
template <int DT, int R>
static void stream(const float* x, ptrdiff_t ldx, const typename Weights<DT>::T* w, ptrdiff_t ldw, ptrdiff_t K,
                   float* acc, ptrdiff_t lda, int cols) {
  ptrdiff_t k = 0;
  for (; k + kUnroll <= K; k += kUnroll)
    quad<DT, R>(x + k, ldx, w + k * ldw, ldw, acc, lda, cols, k + kPrefetchRows + kUnroll <= K);
  for (; k < K; ++k) single<DT, R>(x + k, ldx, w + k * ldw, acc, lda, cols);
}

// ---- many rows: packed panels, register tiles ---------------------------------------------------
// Panels sit a line more than their size apart: a row of w stores one vector into every panel, and
// panels a power of two apart would all land in one L1 set.
static inline ptrdiff_t panel_stride(ptrdiff_t kn) { return kn * kPanel + 16; }

// w [kn, cols] (row stride ldw) widened into panels [cols / kPanel][kn][kPanel] kPanelStride(kn)
// floats apart, the last one zero-filled past `cols`. Rows are read whole, in order, kPrefetchRows
// ahead prefetched (the tiles of the block before have fetched most of them already).
template <int DT>
static void pack(const typename Weights<DT>::T* w, ptrdiff_t ldw, ptrdiff_t kn, int cols, float* buf) {
  using Wt = Weights<DT>;
  constexpr int kLine = 64 / int(sizeof(typename Wt::T));
  const int whole = cols / kPanel;
  for (ptrdiff_t k = 0; k < kn; ++k) {
    const typename Wt::T* row = w + k * ldw;
    for (int n = 0; n < cols; n += kLine) __builtin_prefetch(row + kPrefetchRows * ldw + n);
    float* dst = buf + k * kPanel;
    for (int p = 0; p < whole; ++p, dst += panel_stride(kn))
      DSPARK_UNROLL
      for (int v = 0; v < kTileVecs; ++v) store(dst + v * kLanes, Wt::vec(row + p * kPanel + v * kLanes));
    for (int n = whole * kPanel; n < cols; ++n) dst[n - whole * kPanel] = Wt::one(row + n);
    for (int n = cols; n < (cols + kPanel - 1) / kPanel * kPanel; ++n) dst[n - whole * kPanel] = 0.0f;
  }
}

// The same panels from w stored transposed, e = w^T [N, K] (row stride lde): a tied LM head, the
// embedding. Four rows of e (columns of w) at a time are read along k; f32 goes through 4 x 4
// transposes where the target has SSE.
template <int DT>
static void pack_transposed(const typename Weights<DT>::T* e, ptrdiff_t lde, ptrdiff_t kn, int cols, float* buf) {
  using Wt = Weights<DT>;
  const int padded = (cols + kPanel - 1) / kPanel * kPanel;
  int n = 0;
#if defined(__SSE__)
  if constexpr (DT == kF32) {
    for (; n + 4 <= cols && (n % kPanel) + 4 <= kPanel; n += 4) {
      float* dst = buf + (n / kPanel) * panel_stride(kn) + n % kPanel;
      const float* r0 = e + n * lde;
      ptrdiff_t k = 0;
      for (; k + 4 <= kn; k += 4) {
        __m128 a = _mm_loadu_ps(r0 + k), b = _mm_loadu_ps(r0 + lde + k), c = _mm_loadu_ps(r0 + 2 * lde + k),
               d = _mm_loadu_ps(r0 + 3 * lde + k);
        _MM_TRANSPOSE4_PS(a, b, c, d);
        _mm_storeu_ps(dst + k * kPanel, a);
        _mm_storeu_ps(dst + (k + 1) * kPanel, b);
        _mm_storeu_ps(dst + (k + 2) * kPanel, c);
        _mm_storeu_ps(dst + (k + 3) * kPanel, d);
      }
      for (; k < kn; ++k)
        for (int i = 0; i < 4; ++i) dst[k * kPanel + i] = r0[i * lde + k];
    }
  }
#endif
  for (; n < padded; ++n) {
    float* dst = buf + (n / kPanel) * panel_stride(kn) + n % kPanel;
    if (n < cols) {
      const typename Wt::T* row = e + n * lde;
      for (ptrdiff_t k = 0; k < kn; ++k) dst[k * kPanel] = Wt::one(row + k);
    } else {
      for (ptrdiff_t k = 0; k < kn; ++k) dst[k * kPanel] = 0.0f;
    }
  }
}

struct Fetch {  // the next block's rows, one cache line every `every` steps of the tiles' k loops
  const char* row;   // the row being fetched
  ptrdiff_t ld;      // bytes between rows
  ptrdiff_t bytes;   // bytes of a row to fetch
  ptrdiff_t col, rows_left;
  int every, phase;
  inline void step() {
    if (rows_left > 0 && ++phase >= every) {
      phase = 0;
      __builtin_prefetch(row + col, 0, 1);  // toward L2: L1 keeps the block in use
      col += 64;
      if (col >= bytes) col = 0, row += ld, --rows_left;
    }
  }
};

// acc [R, V lanes] += x [R, kn] @ w [kn, V lanes] (row stride ldw, as stored, widened per load), k in
// order, accumulators in registers: w a packed panel (f32, ldw = V lanes) or read in place.
template <int DT, int R, int V>
static void tile(const float* x, ptrdiff_t ldx, const typename Weights<DT>::T* w, ptrdiff_t ldw, ptrdiff_t kn,
                  float* acc, ptrdiff_t lda, Fetch* f) {
  using Wt = Weights<DT>;
  vf a[R][V];
  DSPARK_UNROLL
  for (int r = 0; r < R; ++r)
    DSPARK_UNROLL
    for (int v = 0; v < V; ++v) a[r][v] = load(acc + r * lda + v * kLanes);
  for (ptrdiff_t k = 0; k < kn; ++k) {
    f->step();
    vf b[V];
    DSPARK_UNROLL
    for (int v = 0; v < V; ++v) b[v] = Wt::vec(w + k * ldw + v * kLanes);
    DSPARK_UNROLL
    for (int r = 0; r < R; ++r) {
      const vf s = splat(x[r * ldx + k]);
      DSPARK_UNROLL
      for (int v = 0; v < V; ++v) a[r][v] = a[r][v] + s * b[v];
    }
  }
  DSPARK_UNROLL
  for (int r = 0; r < R; ++r)
    DSPARK_UNROLL
    for (int v = 0; v < V; ++v) store(acc + r * lda + v * kLanes, a[r][v]);
}

// A tile of `rows` <= R rows: the instantiation for exactly that many.
template <int DT, int R, int V>
static void tile_of(int rows, const float* x, ptrdiff_t ldx, const typename Weights<DT>::T* w, ptrdiff_t ldw,
                    ptrdiff_t kn, float* acc, ptrdiff_t lda, Fetch* f) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<DT, R - 1, V>(rows, x, ldx, w, ldw, kn, acc, lda, f);
  }
  tile<DT, R, V>(x, ldx, w, ldw, kn, acc, lda, f);
}

// ---- a thread's columns -------------------------------------------------------------------------
// Columns [c0, c1) of out [rows, N] = x [rows, K] @ w [K, N] (w given as e = w^T [N, K] when
// `transposed`: always packed). `acc` holds rows x (strip + kPad) floats (rows of `out` N floats
// apart could share L1 sets, and a load would wait on the store to the row before at the same low
// address bits), `buf` the panels of a block.
template <int DT>
static void columns(const float* x, const void* w, bool transposed, float* out, ptrdiff_t rows, ptrdiff_t K,
                    ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc,
                    float* buf) {
  using T = typename Weights<DT>::T;
  const T* wt = static_cast<const T*>(w);
  const ptrdiff_t lda = strip + kPad;
  for (ptrdiff_t n0 = c0; n0 < c1; n0 += strip) {
    const int cols = int(c1 - n0 < strip ? c1 - n0 : strip);
    const ptrdiff_t used = cols + kPanel;  // a packed tile's last panel adds zeros past cols
    for (ptrdiff_t r = 0; r < rows; ++r)
      for (ptrdiff_t n = 0; n < used; ++n) acc[r * lda + n] = 0.0f;
    if (rows == 1 && !transposed) {
      stream<DT, 1>(x, K, wt + n0, N, K, acc, lda, cols);
    } else if (rows <= kStreamRows && !transposed) {
      stream<DT, 2>(x, K, wt + n0, N, K, acc, lda, cols);
    } else {
      // Up to kDirectRows rows, tiles read w's whole panels of kDirectPanel columns where they are
      // (at most two passes over a block the tiles before fetched into L2: packing would cost more
      // than it saves); the columns past them, and every column for more rows, are packed.
      const int direct = transposed || rows > kDirectRows ? 0 : cols / kDirectPanel;
      const int packed_cols = cols - direct * kDirectPanel, panels = (packed_cols + kPanel - 1) / kPanel;
      const int groups = int((rows + kTileRows - 1) / kTileRows);  // tiles of rows, sizes as even as can be
      const int direct_groups = int((rows + kDirectTileRows - 1) / kDirectTileRows);
      for (ptrdiff_t k0 = 0; k0 < K; k0 += kblock) {
        const ptrdiff_t kn = K - k0 < kblock ? K - k0 : kblock;
        const ptrdiff_t d0 = n0 + direct * kDirectPanel;  // the first packed column
        if (transposed) pack_transposed<DT>(wt + d0 * K + k0, K, kn, packed_cols, buf);
        else pack<DT>(wt + k0 * N + d0, N, kn, packed_cols, buf);
        float* xb = buf + panels * panel_stride(kn);  // x's block, rows a line more than kn apart
        const ptrdiff_t ldxb = kn + 16;
        for (ptrdiff_t r = 0; r < rows; ++r) __builtin_memcpy(xb + r * ldxb, x + r * K + k0, sizeof(float) * kn);
        // the next block: rows k1 .. of w's columns n0 ..; of e, rows n0 .. from column k1
        const ptrdiff_t k1 = k0 + kn, next = K - k1 < kblock ? K - k1 : kblock, sz = ptrdiff_t(sizeof(T));
        const ptrdiff_t fetch_rows = transposed ? (next > 0 ? cols : 0) : next;
        const ptrdiff_t row_bytes = (transposed ? next : cols) * sz, lines = fetch_rows * ((row_bytes + 63) / 64);
        const ptrdiff_t steps = (ptrdiff_t(panels) * groups + ptrdiff_t(direct) * direct_groups) * kn;
        Fetch f{reinterpret_cast<const char*>(transposed ? wt + n0 * K + k1 : wt + k1 * N + n0), (transposed ? K : N) * sz,
                row_bytes, 0, fetch_rows, int(lines > 0 && steps > lines ? steps / lines : 1), 0};
        for (int p = 0; p < direct; ++p)
          for (int g = 0; g < direct_groups; ++g) {
            const ptrdiff_t r0 = rows * g / direct_groups, r1 = rows * (g + 1) / direct_groups;
            tile_of<DT, kDirectTileRows, kDirectTileVecs>(int(r1 - r0), xb + r0 * ldxb, ldxb,
                                                          wt + k0 * N + n0 + p * kDirectPanel, N, kn,
                                                          acc + r0 * lda + p * kDirectPanel, lda, &f);
          }
        for (int p = 0; p < panels; ++p)
          for (int g = 0; g < groups; ++g) {
            const ptrdiff_t r0 = rows * g / groups, r1 = rows * (g + 1) / groups;
            tile_of<kF32, kTileRows, kTileVecs>(int(r1 - r0), xb + r0 * ldxb, ldxb, buf + p * panel_stride(kn),
                                                kPanel, kn, acc + r0 * lda + (d0 - n0) + p * kPanel, lda, &f);
          }
      }
    }
    for (ptrdiff_t r = 0; r < rows; ++r) __builtin_memcpy(out + r * N + n0, acc + r * lda, sizeof(float) * cols);
  }
}

// This instruction set's entry point (module.cpp picks one at run time).
inline void product_columns(int dtype, const float* x, const void* w, bool transposed, float* out, ptrdiff_t rows,
                            ptrdiff_t K, ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock,
                            float* acc, float* buf) {
  switch (dtype) {
    case kF32: return columns<kF32>(x, w, transposed, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
    case kF16: return columns<kF16>(x, w, transposed, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
    default: return columns<kBF16>(x, w, transposed, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
  }
}

}  // namespace DSPARK_CPU_ISA
