// The numpy backend's product: out f32 [rows, N] = x f32 [rows, K] @ w [K, N], w read as stored
// (f32, f16 or bf16) and widened exactly, math in f32.
//
// One order per output, fixed by K alone (never by the rows, the column split, the thread count or
// the instruction set): acc = 0, then acc = acc + x[r, k] * w[k, n] for k = 0, 1, ..., K - 1, a
// multiply rounded to f32 and then an add rounded to f32 (the build passes -ffp-contract=off and
// the AVX-512 build's multiply is an asm statement, so nothing fuses them). dspark.ops.product.
// product_ref is that loop in NumPy and gives the same bits. Every lane of a vector does exactly
// the scalar arithmetic, so the AVX-512 build (product_avx512.cpp), the AVX2 build
// (product_avx2.cpp), the baseline build (product_base.cpp) and the scalar tails all agree.
//
// Work. A thread owns columns [c0, c1) and walks them in strips of `strip` columns whose
// accumulators (rows x strip f32, rows padded apart) stay in cache; the result is copied out once.
// * One or two rows (decode): w streams in memory order. Each pass takes kUnroll rows of w and
//   adds them to the strip's accumulators (a = a + x0 w0; a = a + x1 w1; ... per vector of
//   columns), w prefetched kPrefetchRows ahead.
// * More rows (verify, prefill): K in blocks of `kblock` rows of w; tiles of up to kTileRows rows
//   x kPanel columns keep their accumulators in registers over a block, one k at a time in order
//   (`tile`). The first group of rows reads a panel of w in place and prefetches the same columns
//   of the next block toward L2 (a verify's 8 rows are one group in the AVX-512 build); the next
//   groups read it again from cache. A strip's last panel, when narrower, is read in place by a
//   tile of fewer vectors if its columns are whole vectors; a transposed w (a tied LM head) and
//   a last panel with a partial vector are widened into a contiguous panel first (`pack`). Each
//   weight is read from memory once per strip.
// * A panel-major w (the loader's layout of the numpy backend's trunk matrices, `panel_columns`):
//   each 48-column panel's [K][48] block is contiguous, so the same tiles walk a panel's whole K
//   from one run of memory (a row-major w gives them 192 bytes every N floats, a page every few
//   rows) for any number of rows, the first group of rows fetching 32 rows ahead.
//
// This header is compiled once per instruction set, inside namespace DSPARK_CPU_ISA, with the
// vector width and tile shape that set's registers hold (generic GCC/Clang vector extensions).

#include <cstddef>
#include <cstdint>

#if defined(DSPARK_CPU_AVX2) || defined(DSPARK_CPU_AVX512)
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
#define DSPARK_TILE_VECS 3
#endif

namespace DSPARK_CPU_ISA {

constexpr int kLanes = DSPARK_LANES;          // floats per vector
constexpr int kUnroll = 8;                    // rows of w per pass of `stream`
constexpr int kStreamRows = 2;                // up to this many rows: `stream`; more: tiles
constexpr int kPrefetchRows = 32;             // rows of w ahead of use that `stream` prefetches
constexpr int kTileRows = DSPARK_TILE_ROWS;   // a tile's accumulators: up to kTileRows x kTileVecs vectors
constexpr int kTileVecs = DSPARK_TILE_VECS;
constexpr int kPanel = kTileVecs * kLanes;    // columns of a panel
constexpr int kPad = 64;                      // floats between accumulator rows beyond the strip
static_assert(kPanel <= kPad, "a tile's last panel runs up to kPanel - 1 columns past the strip");

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
#if defined(DSPARK_CPU_AVX512)
  return bits_as<vf>(_mm512_set1_ps(s));
#elif defined(DSPARK_CPU_AVX2)
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

// s[0] * b in every lane. AVX-512 takes the broadcast into the multiply (an operand {1to16}): a
// broadcast of its own would take a slot of the multiply and add pipes on some cores (Zen 4).
static inline vf mul_splat(const float* s, vf b) {
#if defined(DSPARK_CPU_AVX512)
  vf p;
  asm("vmulps %1%{1to16%}, %2, %0" : "=v"(p) : "m"(*s), "v"(b));
  return p;
#else
  return splat(*s) * b;
#endif
}

// A loaded vector held in its register: around mul_splat's asm the compiler would otherwise load
// it again for every row (R loads a k step instead of one).
static inline vf keep(vf v) {
#if defined(DSPARK_CPU_AVX512)
  asm("" : "+v"(v));
#endif
  return v;
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
#if defined(DSPARK_CPU_AVX512)
    return bits_as<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(DSPARK_CPU_AVX2)
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
// acc[r][n] (r < R, n < cols) += x[r][j] * w[j][n] for j = 0 .. kUnroll - 1 in order.
template <int DT, int R>
static void quad(const float* x, ptrdiff_t ldx, const typename Weights<DT>::T* w, ptrdiff_t ldw, float* acc,
                 ptrdiff_t lda, int cols, bool fetch) {
  using Wt = Weights<DT>;
  constexpr int kLine = 64 / int(sizeof(typename Wt::T));  // columns per cache line
  const int whole = cols / kLanes * kLanes;
  for (int n = 0; n < whole; n += kLanes) {
    if (fetch && n % kLine == 0)
      DSPARK_UNROLL
      for (int j = 0; j < kUnroll; ++j) __builtin_prefetch(w + (kPrefetchRows + j) * ldw + n, 0, 2);
    vf b[kUnroll];
    DSPARK_UNROLL
    for (int j = 0; j < kUnroll; ++j) b[j] = keep(Wt::vec(w + j * ldw + n));
    DSPARK_UNROLL
    for (int r = 0; r < R; ++r) {
      vf a = load(acc + r * lda + n);
      DSPARK_UNROLL
      for (int j = 0; j < kUnroll; ++j) a = a + mul_splat(x + r * ldx + j, b[j]);
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

// The same for one row of w (the last K % kUnroll).
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

// ---- three rows and more: register tiles over blocks of w ------------------------------------------
// Toward L2 (prefetcht1), the same columns `ahead` elements on: the next block's row while the
// tiles read this block's (or the next strip's first block in the last block). Prefetches never fault,
// so the address may run past the array: it is computed as an integer.
template <typename T>
static inline void fetch(const T* p, ptrdiff_t ahead) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + ahead * ptrdiff_t(sizeof(T))), 0, 2);
}

// A panel: kn rows of `cols` (<= kPanel) columns of w (row stride ldw), widened into
// panel [kn][kPanel], zero-filled past `cols`, fetching `ahead` (Fetch): a strip's last columns.
template <int DT, bool Fetch>
static void pack(const typename Weights<DT>::T* __restrict w, ptrdiff_t ldw, ptrdiff_t kn, int cols,
                 float* __restrict panel, ptrdiff_t ahead) {
  using Wt = Weights<DT>;
  const int vecs = cols / kLanes;
  for (ptrdiff_t k = 0; k < kn; ++k) {
    const typename Wt::T* row = w + k * ldw;
    float* dst = panel + k * kPanel;
    if constexpr (Fetch)
      for (int n = 0; n < cols; n += kLanes) fetch(row + n, ahead);
    for (int v = 0; v < vecs; ++v) store(dst + v * kLanes, Wt::vec(row + v * kLanes));
    for (int n = vecs * kLanes; n < cols; ++n) dst[n] = Wt::one(row + n);
    for (int n = cols; n < kPanel; ++n) dst[n] = 0.0f;
  }
}

// The same panel from w stored transposed, e = w^T [cols, kn] (row stride lde): a tied LM head, the
// embedding. Four rows of e (columns of w) at a time are read along k; f32 goes through 4 x 4
// transposes where the target has SSE.
template <int DT>
static void pack_transposed(const typename Weights<DT>::T* e, ptrdiff_t lde, ptrdiff_t kn, int cols, float* panel,
                            ptrdiff_t ahead) {
  using Wt = Weights<DT>;
  constexpr int kLine = 64 / int(sizeof(typename Wt::T));
  if (ahead)
    for (int n = 0; n < cols; ++n)
      for (ptrdiff_t k = 0; k < kn; k += kLine) fetch(e + n * lde + k, ahead);
  int n = 0;
#if defined(__SSE__)
  if constexpr (DT == kF32) {
    for (; n + 4 <= cols; n += 4) {
      float* dst = panel + n;
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
  for (; n < kPanel; ++n) {
    float* dst = panel + n;
    if (n < cols) {
      const typename Wt::T* row = e + n * lde;
      for (ptrdiff_t k = 0; k < kn; ++k) dst[k * kPanel] = Wt::one(row + k);
    } else {
      for (ptrdiff_t k = 0; k < kn; ++k) dst[k * kPanel] = 0.0f;
    }
  }
}

// acc [R, V lanes] += x [R, kn] @ w [kn, V lanes] (row stride ldw, as stored, widened per load), k in
// order, the accumulators in registers; w a panel (f32, ldw = kPanel) or read in place, fetching
// `ahead` (Fetch). A function of its own: its k loop is the product's inner loop (csrc/README.md).
template <int DT, int R, int V, bool Fetch>
__attribute__((noinline)) static void tile(const float* __restrict x, ptrdiff_t ldx,
                                           const typename Weights<DT>::T* __restrict w, ptrdiff_t ldw, ptrdiff_t kn,
                                           float* __restrict acc, ptrdiff_t lda, ptrdiff_t ahead) {
  using Wt = Weights<DT>;
  vf a[R][V];
  DSPARK_UNROLL
  for (int r = 0; r < R; ++r)
    DSPARK_UNROLL
    for (int v = 0; v < V; ++v) a[r][v] = load(acc + r * lda + v * kLanes);
  for (ptrdiff_t k = 0; k < kn; ++k) {
    if constexpr (Fetch)
      DSPARK_UNROLL
      for (int v = 0; v < V; ++v) fetch(w + k * ldw + v * kLanes, ahead);
    vf b[V];
    DSPARK_UNROLL
    for (int v = 0; v < V; ++v) b[v] = keep(Wt::vec(w + k * ldw + v * kLanes));
    DSPARK_UNROLL
    for (int r = 0; r < R; ++r)
      DSPARK_UNROLL
      for (int v = 0; v < V; ++v) a[r][v] = a[r][v] + mul_splat(x + r * ldx + k, b[v]);
  }
  DSPARK_UNROLL
  for (int r = 0; r < R; ++r)
    DSPARK_UNROLL
    for (int v = 0; v < V; ++v) store(acc + r * lda + v * kLanes, a[r][v]);
}

// A tile of `rows` <= R rows and `vecs` <= V vectors: the instantiation for exactly that many (a
// strip's last columns, when they are whole vectors, are read in place by a narrower tile).
template <int DT, int R, int V, bool Fetch>
static void tile_of(int rows, int vecs, const float* x, ptrdiff_t ldx, const typename Weights<DT>::T* w,
                    ptrdiff_t ldw, ptrdiff_t kn, float* acc, ptrdiff_t lda, ptrdiff_t ahead) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<DT, R - 1, V, Fetch>(rows, vecs, x, ldx, w, ldw, kn, acc, lda, ahead);
  }
  if constexpr (V > 1) {
    if (vecs < V) return tile_of<DT, R, V - 1, Fetch>(rows, vecs, x, ldx, w, ldw, kn, acc, lda, ahead);
  }
  tile<DT, R, V, Fetch>(x, ldx, w, ldw, kn, acc, lda, ahead);
}

// ---- a thread's columns -------------------------------------------------------------------------
// Columns [c0, c1) of out [rows, N] = x [rows, K] @ w [K, N] (w given as e = w^T [N, K] when
// `transposed`). `acc` holds rows x (strip + kPad) floats (rows of `out` N floats apart could share
// L1 sets, and a load would wait on the store to the row before at the same low address bits);
// `buf` one panel and x's block: (kblock + 16) (kPanel + rows) floats (module.cpp sizes it).
//
// Three rows and more, for each block of kblock rows of w and each panel of kPanel columns: every
// group of rows (up to kTileRows each) reads a whole panel of w in place, the first one from
// memory, the next ones from cache; a transposed w and the columns past the last whole panel are
// widened into `panel` first, where each group reads them. Whatever reads w from memory also
// fetches the same columns of the next block (or the next strip's first) toward L2.
template <int DT>
static void columns(const float* x, const void* w, bool transposed, float* out, ptrdiff_t rows, ptrdiff_t K,
                    ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock, float* acc,
                    float* buf) {
  using T = typename Weights<DT>::T;
  const T* wt = static_cast<const T*>(w);
  const ptrdiff_t lda = strip + kPad;
  const int groups = int((rows + kTileRows - 1) / kTileRows);  // tiles of rows, sizes as even as can be
  float* panel = buf;
  float* xb = buf + kblock * kPanel + 16;  // x's block, rows a line more than kn apart
  const ptrdiff_t ldxb = kblock + 16;
  for (ptrdiff_t n0 = c0; n0 < c1; n0 += strip) {
    const int cols = int(c1 - n0 < strip ? c1 - n0 : strip);
    for (ptrdiff_t r = 0; r < rows; ++r)
      for (ptrdiff_t n = 0; n < cols + kPanel; ++n) acc[r * lda + n] = 0.0f;  // a last panel runs past cols
    if (rows == 1 && !transposed) {
      stream<DT, 1>(x, K, wt + n0, N, K, acc, lda, cols);
    } else if (rows <= kStreamRows && !transposed) {
      stream<DT, 2>(x, K, wt + n0, N, K, acc, lda, cols);
    } else {
      const int panels = (cols + kPanel - 1) / kPanel;
      for (ptrdiff_t k0 = 0; k0 < K; k0 += kblock) {
        const ptrdiff_t kn = K - k0 < kblock ? K - k0 : kblock;
        for (ptrdiff_t r = 0; r < rows; ++r) __builtin_memcpy(xb + r * ldxb, x + r * K + k0, sizeof(float) * kn);
        // what to fetch while this block is read: the next block (w's rows k0 + kblock .., e's
        // columns), else the next strip's first block, else nothing
        const ptrdiff_t ahead = k0 + kn < K ? (transposed ? kblock : kblock * N)
                                : n0 + strip < c1 ? (transposed ? strip * K - k0 : strip - k0 * N) : 0;
        for (int p = 0; p < panels; ++p) {
          const ptrdiff_t n = n0 + ptrdiff_t(p) * kPanel;
          const int pcols = int(n0 + cols - n < kPanel ? n0 + cols - n : kPanel);
          float* ap = acc + ptrdiff_t(p) * kPanel;
          if (!transposed && pcols % kLanes == 0) {  // in place: the first group fetches ahead
            const int vecs = pcols / kLanes;
            for (int g = 0; g < groups; ++g) {
              const ptrdiff_t r0 = rows * g / groups, r1 = rows * (g + 1) / groups;
              const T* wp = wt + k0 * N + n;
              if (ahead && g == 0)
                tile_of<DT, kTileRows, kTileVecs, true>(int(r1 - r0), vecs, xb, ldxb, wp, N, kn, ap, lda, ahead);
              else
                tile_of<DT, kTileRows, kTileVecs, false>(int(r1 - r0), vecs, xb + r0 * ldxb, ldxb, wp, N, kn,
                                                          ap + r0 * lda, lda, 0);
            }
            continue;
          }
          if (transposed) pack_transposed<DT>(wt + n * K + k0, K, kn, pcols, panel, ahead);
          else if (ahead) pack<DT, true>(wt + k0 * N + n, N, kn, pcols, panel, ahead);
          else pack<DT, false>(wt + k0 * N + n, N, kn, pcols, panel, 0);
          for (int g = 0; g < groups; ++g) {
            const ptrdiff_t r0 = rows * g / groups, r1 = rows * (g + 1) / groups;
            tile_of<kF32, kTileRows, kTileVecs, false>(int(r1 - r0), kTileVecs, xb + r0 * ldxb, ldxb, panel, kPanel, kn,
                                                       ap + r0 * lda, lda, 0);
          }
        }
      }
    }
    for (ptrdiff_t r = 0; r < rows; ++r) __builtin_memcpy(out + r * N + n0, acc + r * lda, sizeof(float) * cols);
  }
}

// ---- w panel-major (a weight the loader laid out for this product) --------------------------------
// w's columns [kLayoutPanel p, kLayoutPanel (p + 1)) stored as one [K][kLayoutPanel] block at
// w + kLayoutPanel p K, zero past N (dspark.ops.product.Panelled). A tile walks a block's whole K in
// order from one contiguous run of memory (the k walk of a row-major w strides N floats and crosses
// a page every few rows), fetching kFetchRows rows ahead (into the next block at the end). Each
// group of rows walks the block: the first from memory, the next ones from cache. One and two rows
// take the same tiles (3 vectors of 1 or 2 rows): as fast as `stream` on one row, the same order.
constexpr int kLayoutPanel = 48;  // a multiple of every build's kPanel's vectors (48, 24, 12 columns)
constexpr int kFetchRows = 32;
static_assert(kLayoutPanel % kLanes == 0, "a layout panel holds whole vectors");

template <int DT>
static void panel_columns(const float* x, const void* w, float* out, ptrdiff_t rows, ptrdiff_t K, ptrdiff_t N,
                          ptrdiff_t c0, ptrdiff_t c1, float* acc) {
  using T = typename Weights<DT>::T;
  constexpr ptrdiff_t lda = kLayoutPanel + 16;  // accumulator rows a line apart beyond the panel
  const int groups = int((rows + kTileRows - 1) / kTileRows);
  for (ptrdiff_t n = c0; n < c1; n += kLayoutPanel) {
    const T* wp = static_cast<const T*>(w) + n * K;  // module.cpp's pieces start on a panel
    const int pcols = int(c1 - n < kLayoutPanel ? c1 - n : kLayoutPanel);
    for (ptrdiff_t r = 0; r < rows; ++r)
      for (int j = 0; j < kLayoutPanel; ++j) acc[r * lda + j] = 0.0f;
    for (int j0 = 0; j0 < pcols; j0 += kPanel) {  // whole vectors: the zeros past N are read, not kept
      const int vecs = (pcols - j0 + kLanes - 1) / kLanes < kTileVecs ? (pcols - j0 + kLanes - 1) / kLanes : kTileVecs;
      for (int g = 0; g < groups; ++g) {
        const ptrdiff_t r0 = rows * g / groups, r1 = rows * (g + 1) / groups;
        if (g == 0)
          tile_of<DT, kTileRows, kTileVecs, true>(int(r1 - r0), vecs, x, K, wp + j0, kLayoutPanel, K, acc + j0, lda,
                                                  kFetchRows * kLayoutPanel);
        else
          tile_of<DT, kTileRows, kTileVecs, false>(int(r1 - r0), vecs, x + r0 * K, K, wp + j0, kLayoutPanel, K,
                                                   acc + r0 * lda + j0, lda, 0);
      }
    }
    for (ptrdiff_t r = 0; r < rows; ++r) __builtin_memcpy(out + r * N + n, acc + r * lda, sizeof(float) * pcols);
  }
}

// ---- FP8 weights: q e4m3fn bytes [K, N], one f32 scale per 128 x 128 block ---------------------------
// W[k, n] = fl32(e4m3(q[k, n]) * scale[k / 128][n / 128]), bitwise transformers' f32 dequantization
// (dspark.ops.fp8). Each block of kblock rows of a panel is dequantized into the f32 panel as the
// other dtypes' packed panels are, then the same tiles multiply it, so every output keeps the one
// order of the header; w is read from memory as bytes, once per strip.
constexpr int kFp8Block = 128;

// The e4m3fn decode (csrc/fp8.cuh's e4m3_to_float, dspark.ops.fp8.e4m3_decode): exact in f32.
static inline float e4m3_value(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (b & 0x80u) << 24;
  if (e == 0u) return bits_as<float>(bits_as<uint32_t>(float(m) * bits_as<float>(0x3b000000u)) | sign);
  if (e == 15u && m == 7u) return bits_as<float>(sign | 0x7fc00000u);
  return bits_as<float>(sign | ((e + 120u) << 23) | (m << 20));
}

struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (uint32_t b = 0; b < 256; ++b) v[b] = e4m3_value(b);
  }
};

static const E4m3Table& e4m3_table() {
  static const E4m3Table table;
  return table;
}

typedef uint8_t vb __attribute__((vector_size(kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

// kLanes e4m3 bytes at p as f32, as e4m3_value gives them: the 7 magnitude bits moved to an f32's
// exponent and mantissa and scaled by 2^120 (exact; the subnormals m 2^-9 come out of f32
// subnormals m 2^-129, which nothing here flushes), the sign on top, NaN for 0x7F / 0xFF.
static inline vu widen_bytes(const uint8_t* p) {  // kLanes bytes zero-extended (GCC scalarizes the generic form)
#if defined(DSPARK_CPU_AVX512)
  return bits_as<vu>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(DSPARK_CPU_AVX2)
  return bits_as<vu>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(__SSE2__) && DSPARK_LANES == 4
  int32_t word;
  __builtin_memcpy(&word, p, 4);
  const __m128i zero = _mm_setzero_si128();
  return bits_as<vu>(_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), zero), zero));
#else
  vb b;
  __builtin_memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vu);
#endif
}

static inline vf e4m3_vec(const uint8_t* p) {
  const vu u = widen_bytes(p);
  const vu mag = u & 0x7fu;
  const vu bits = bits_as<vu>(bits_as<vf>(mag << 20) * splat(0x1p120f)) | (u & 0x80u) << 24;
  const vu nan = (vu)(bits_as<vi>(mag) == 0x7f);  // all ones where the byte is a NaN
  return bits_as<vf>((bits & ~nan) | ((0x7fc00000u | (u & 0x80u) << 24) & nan));
}

// Rows [k0, k0 + kn) of columns [n, n + cols) of W into panel [kn][kPanel], zero past cols. n is
// a multiple of kLanes (panels start on one), so a vector of columns lies in one 128-column block.
static void pack_fp8(const uint8_t* q, ptrdiff_t N, const float* scale, ptrdiff_t blocks_n, ptrdiff_t k0,
                     ptrdiff_t kn, ptrdiff_t n, int cols, float* panel) {
  const float* lut = e4m3_table().v;
  const int vecs = cols / kLanes;
  for (ptrdiff_t k = 0; k < kn; ++k) {
    const uint8_t* row = q + (k0 + k) * N + n;
    const float* s = scale + (k0 + k) / kFp8Block * blocks_n;
    float* dst = panel + k * kPanel;
    for (int v = 0; v < vecs; ++v)
      store(dst + v * kLanes, e4m3_vec(row + v * kLanes) * splat(s[(n + v * kLanes) / kFp8Block]));
    for (int j = vecs * kLanes; j < cols; ++j) dst[j] = lut[row[j]] * s[(n + j) / kFp8Block];
    for (int j = cols; j < kPanel; ++j) dst[j] = 0.0f;
  }
}

// Columns [c0, c1) of out [rows, N] = x [rows, K] @ W [K, N]: `columns`' tiled walk over blocks of
// kblock rows and panels of kPanel columns, every panel dequantized first (pack_fp8).
static void fp8_columns(const float* x, const uint8_t* q, const float* scale, float* out, ptrdiff_t rows,
                        ptrdiff_t K, ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock,
                        float* acc, float* buf) {
  const ptrdiff_t lda = strip + kPad, blocks_n = (N + kFp8Block - 1) / kFp8Block;
  const int groups = int((rows + kTileRows - 1) / kTileRows);
  float* panel = buf;
  float* xb = buf + kblock * kPanel + 16;
  const ptrdiff_t ldxb = kblock + 16;
  for (ptrdiff_t n0 = c0; n0 < c1; n0 += strip) {
    const int cols = int(c1 - n0 < strip ? c1 - n0 : strip);
    for (ptrdiff_t r = 0; r < rows; ++r)
      for (ptrdiff_t n = 0; n < cols + kPanel; ++n) acc[r * lda + n] = 0.0f;
    const int panels = (cols + kPanel - 1) / kPanel;
    for (ptrdiff_t k0 = 0; k0 < K; k0 += kblock) {
      const ptrdiff_t kn = K - k0 < kblock ? K - k0 : kblock;
      for (ptrdiff_t r = 0; r < rows; ++r) __builtin_memcpy(xb + r * ldxb, x + r * K + k0, sizeof(float) * kn);
      for (int p = 0; p < panels; ++p) {
        const ptrdiff_t n = n0 + ptrdiff_t(p) * kPanel;
        const int pcols = int(n0 + cols - n < kPanel ? n0 + cols - n : kPanel);
        pack_fp8(q, N, scale, blocks_n, k0, kn, n, pcols, panel);
        for (int g = 0; g < groups; ++g) {
          const ptrdiff_t r0 = rows * g / groups, r1 = rows * (g + 1) / groups;
          tile_of<kF32, kTileRows, kTileVecs, false>(int(r1 - r0), kTileVecs, xb + r0 * ldxb, ldxb, panel, kPanel, kn,
                                                     acc + ptrdiff_t(p) * kPanel + r0 * lda, lda, 0);
        }
      }
    }
    for (ptrdiff_t r = 0; r < rows; ++r) __builtin_memcpy(out + r * N + n0, acc + r * lda, sizeof(float) * cols);
  }
}

// This instruction set's entry point (module.cpp picks one at run time). layout: 0 w [K, N] as
// stored, 1 w given as e = w^T [N, K], 2 w panel-major (panel_columns).
inline void product_columns(int dtype, const float* x, const void* w, int layout, float* out, ptrdiff_t rows,
                            ptrdiff_t K, ptrdiff_t N, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t strip, ptrdiff_t kblock,
                            float* acc, float* buf) {
  if (layout == 2) {
    switch (dtype) {
      case kF32: return panel_columns<kF32>(x, w, out, rows, K, N, c0, c1, acc);
      case kF16: return panel_columns<kF16>(x, w, out, rows, K, N, c0, c1, acc);
      default: return panel_columns<kBF16>(x, w, out, rows, K, N, c0, c1, acc);
    }
  }
  const bool transposed = layout == 1;
  switch (dtype) {
    case kF32: return columns<kF32>(x, w, transposed, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
    case kF16: return columns<kF16>(x, w, transposed, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
    default: return columns<kBF16>(x, w, transposed, out, rows, K, N, c0, c1, strip, kblock, acc, buf);
  }
}

}  // namespace DSPARK_CPU_ISA
