// Small-row matmul for CPU decode: y[R, N] = x[R, K] @ w[K, N], float32 accumulation.
//
// The weight stays in hybridjax's own layout ([in, out], row-major), so XLA's prefill reads
// the very same array: nothing is packed or copied at load time. A decode step reads every
// weight once, so this is a streaming problem: walk K in blocks of rows, keep the partial
// sums of a column tile (all rows of x) in a small buffer, and read the weight rows front to
// back. Paths, picked at run time from cpuid (or capped by the `isa` attribute):
//
//   3 avx512bf16  bf16 weights: vdpbf16ps on (w[k, n], w[k+1, n]) pairs, built from two rows
//                 with vpunpck{l,h}wd; float32 x is split into bf16 hi + lo (two dot
//                 products), so x keeps ~16 mantissa bits and only the weight is rounded.
//   2 avx512      every weight dtype: widen to float32, FMA (float32 x, exact products).
//   1 avx2        the same with 8 lanes.
//   0 scalar      plain C++, any CPU.
//
// Weight dtypes: float32, bfloat16, int8 (y = (x @ q) * scale[n], per output channel; x stays
// float: weight-only int8; for int8 x int8 see packed int8 below).
// Work items are (column tile, slice of K): a narrow weight (N = 1024) is cut along K so
// that each item still streams long contiguous rows; the slices' partial sums are added by
// the caller at the end, always in slice order (so results do not depend on the threads).
// Items are claimed from an atomic counter by the calling thread and by helpers scheduled on
// XLA's intra-op pool. The caller waits only for items another thread has claimed (and so is
// running): a helper that starts late finds no work, so a busy pool can never deadlock the call.
//
// `transposed`: w is [..., N, K] (a tied embedding used as the head), read row by row.
//
// Packed bf16 (HjMatmulPacked): w is [..., P, KP * 64] with P = ceil(N / 32), KP = ceil(K / 2),
// prepared once at load (cpu_kernels.pack_bf16): panel j holds columns 32j .. 32j + 31, pair p
// of weight rows (2p, 2p + 1) as 32 (w[2p, c], w[2p + 1, c]) 32-bit lanes, zero-padded. That
// is the operand vdpbf16ps takes, so a panel streams from one contiguous block with no
// shuffles, and the partial sums of the whole panel stay in registers across K (no pass
// buffer to load and store). Items are column tiles over the whole of K (one contiguous block
// each). One thread streamed it at 1.0-1.25x the float32 kernel's bytes/s with one row of x
// (the [K, N] bf16 pair path: 0.7-0.9x) and 1.2-1.4x with eight (benchmarks/README.md).
//
// Packed int8 with int8 activations (HjMatmulQ8, cpu_kernels.matmul_q8): w is int8
// [..., P, KQ * 128] with P = ceil(N / 32), KQ = ceil(K / 4), prepared once at load
// (cpu_kernels.pack_int8): panel j holds columns 32j .. 32j + 31, quad p of weight rows
// (4p .. 4p + 3) as 32 lanes of 4 bytes (w[4p, c] .. w[4p + 3, c]), zero-padded: a 32-byte load
// is 4 consecutive k of 8 columns, the operand of vpmaddubsw. Each row of x is rounded to int8
// per block of `x_block` values (scale max |x| / 127, as llama.cpp's Q8_0 activations), and so is
// each column of w (cpu_kernels.quantize_int8_blocks: one scale per column per block, as Q8_0's
// weights), the scales float16 or float32 [..., P, blocks * 32], panel by panel (block b of panel
// j: its 32 columns' scales), read alongside the panel. The dot of a block is exact in int32, and
// y[n] = sum over blocks of float(dot) * (x's scale * w's scale[n]). On
// AVX2 the float path widens every weight (2 uops per 8) before its FMA and runs compute-bound;
// this one multiplies 32 weights in 4 uops per row of x. Items: column tiles over the whole of
// K, as for packed bf16; slices of K (tests) are whole blocks of x.
//
// Leading (vmap) dimensions: x [..., R, K], w [..., K, N] (scale [..., 1, N]), y [..., R, N]; a
// leading dimension of size 1 broadcasts. When w has no batch, all of x's rows share one
// pass over w.
//
// Indexed (HjMatmulIndexed, the routed experts of a MoE layer): x [B, R, K], w [E, K, N] (or
// [E, N, K]), index [B] int32, y [B, R, N]: batch b multiplies by w[index[b]], read in place
// (a dynamic slice in XLA:CPU would copy the expert first); an index outside [0, E) gives
// zeros and reads nothing (a pad or an unused tile).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define HJ_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define HJ_X86 0
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hj {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
enum WType : int { kF32 = 0, kBF16 = 1, kI8 = 2 };

constexpr int kMaxRows = 8;   // rows per register block
constexpr int64_t kManyRowsTileCols = 1024;  // widest column tile past one block of rows
constexpr int64_t kAvx2WholeRowsCols = 16384;  // widest weight read whole-width by 1-2 rows on AVX2
// Weight rows per pass over a tile's partial sums, by rows of x and weight bytes. Each pass
// loads and stores the sums once, so more rows of x want longer passes; but every weight row
// in a pass is a separate memory stream. Measured on Zen 5 (benchmarks/README.md).
template <int M, typename T>
constexpr int RowBlock() { return M > 4 ? 16 : 8; }

// A pass reads RowBlock weight rows side by side over a tile's columns: that many streams at
// once, more than the hardware prefetcher follows well (a pass ran at 0.55-0.6x of a plain
// sequential read, float32 and bfloat16 alike). So each step also prefetches, into L2, the
// same columns of the next pass's rows: the whole future address stream is in flight, and
// passes ran at 0.8-1.05x of a plain read (benchmarks/README.md, Zen 5, one thread; decode
// 1.37x faster in both dtypes).
template <typename T>
inline void PrefetchNext(const T* p) {
  __builtin_prefetch(p, 0, 2);  // prefetcht1 on x86; prefetches never fault
}

// --- cpu features ---------------------------------------------------------------------

int DetectIsa() {
#if HJ_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kScalar;
  bool osxsave = c & (1u << 27), fma = c & (1u << 12), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!(osxsave && avx)) return kScalar;
  unsigned xlo, xhi;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  bool ymm_os = (xlo & 0x6) == 0x6, zmm_os = (xlo & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return kScalar;
  bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30);
  bool avx512vl = b & (1u << 31);
  unsigned a1 = 0, b1, c1, d1;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  bool bf16 = a1 & (1u << 5);
  if (zmm_os && avx512f && avx512bw && avx512vl && fma) return bf16 ? kAvx512Bf16 : kAvx512;
  if (ymm_os && avx2 && fma && f16c) return kAvx2;  // f16c: packed int8's float16 scales
#endif
  return kScalar;
}

int BestIsa() {
  static const int isa = DetectIsa();
  return isa;
}

// --- one problem: rows of x against one weight matrix ---------------------------------

struct Job {
  int64_t rows, k, n;
  int wtype;
  const float* x;       // [rows, k] float32 (FMA paths)
  const uint32_t* xhi;  // [rows, kp] bf16 pairs (x[2p], x[2p+1]); avx512bf16 path
  const uint32_t* xlo;  // [rows, kp] the rounding remainder of x, or null (x was bf16)
  const void* w;        // [k, n], or [n, k] when transposed
  bool transposed;      // w is [n, k]: a tied embedding [vocab, D] read as the head
  bool packed;          // w is bf16 panels [ceil(n / 32), ceil(k / 2) * 64] (see the top)
  const float* scale;   // [n] (int8) or null
  const void* wscale;   // packed int8: w's block scales [ceil(n / 32), blocks * 32], float16 or float32
  bool wscale_f16;
  // Packed int8 with int8 activations (HjMatmulQ8, see the top): x quantised per block of xblock
  // values, as sign (xq) and magnitude (xu) bytes [rows, 4 * ceil(k / 4)] and scales xs [rows, blocks].
  const int8_t* xq;
  const uint8_t* xu;
  const float* xs;
  int64_t xblock;
  float* y;             // [rows, n]
  float* part;          // [slices, rows, n] partial sums when K is cut into slices, else null
  int pass_rows = 0;    // AVX2, float32, 1-2 rows: weight rows per pass, 4 or 8 (hj::NextPassRows); 0: 4
};

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float F16ToF32(uint16_t h) {  // exact: every float16 is a float32
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return sign ? -std::ldexp(float(m), -24) : std::ldexp(float(m), -24);  // zero, subnormal
  const uint32_t u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Column c's scale for block b of packed int8 (the layout at the top).
inline float WScaleAt(const Job& j, int64_t blocks, int64_t b, int64_t c) {
  const int64_t i = ((c / 32) * blocks + b) * 32 + c % 32;
  return j.wscale_f16 ? F16ToF32(static_cast<const uint16_t*>(j.wscale)[i]) : static_cast<const float*>(j.wscale)[i];
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// x[k0, k1) to int8 with one scale d = max |x| / 127: q = round-half-even(x * (1 / d)), in
// [-127, 127] (never -128: its sign could not move onto a weight). Written as sign-carrying q and
// magnitude |q|; returns d. The NumPy reference does these float32 operations in this order.
inline float QuantizeBlock(const float* x, int64_t k0, int64_t k1, int8_t* q, uint8_t* mag) {
  float amax = 0.f;
  for (int64_t k = k0; k < k1; ++k)  // a NaN sticks (and makes the row's outputs NaN)
    amax = std::fabs(x[k]) > amax || x[k] != x[k] ? std::fabs(x[k]) : amax;
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  for (int64_t k = k0; k < k1; ++k) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[k] * inv)));
    q[k] = int8_t(v);
    mag[k] = uint8_t(v < 0 ? -v : v);
  }
  return d;
}

template <typename T>
inline float WeightAt(const T* w, int64_t i);
template <>
inline float WeightAt<float>(const float* w, int64_t i) { return w[i]; }
template <>
inline float WeightAt<uint16_t>(const uint16_t* w, int64_t i) { return Bf16ToF32(w[i]); }
template <>
inline float WeightAt<int8_t>(const int8_t* w, int64_t i) { return float(w[i]); }

// Columns [n0, n1) of every row; `acc` holds rows * (n1 - n0) floats.
template <typename T>
void ScalarTile(const Job& j, int64_t row0, int rows, int64_t n0, int64_t n1, int64_t kb, int64_t ke,
                float* acc) {
  const T* w = static_cast<const T*>(j.w);
  int64_t width = n1 - n0;
  std::memset(acc, 0, sizeof(float) * rows * width);
  for (int64_t k = kb; k < ke; ++k) {
    const T* wr = w + k * j.n;
    for (int r = 0; r < rows; ++r) {
      float xv = j.x[(row0 + r) * j.k + k];
      float* a = acc + r * width;
      for (int64_t c = 0; c < width; ++c) a[c] += xv * WeightAt<T>(wr, n0 + c);
    }
  }
}

// Transposed weight, w [n, k]: each output is a dot product along a contiguous weight row.
template <typename T>
void ScalarTTile(const Job& j, int64_t row0, int rows, int64_t n0, int64_t n1, int64_t, int64_t, float* acc) {
  const T* w = static_cast<const T*>(j.w);
  const int64_t width = n1 - n0;
  for (int64_t c = n0; c < n1; ++c)
    for (int r = 0; r < rows; ++r) {
      const float* x = j.x + (row0 + r) * j.k;
      float s = 0.f;
      for (int64_t k = 0; k < j.k; ++k) s += x[k] * WeightAt<T>(w, c * j.k + k);
      acc[r * width + (c - n0)] = s;
    }
}

// Packed bf16 weight (any CPU): w[k, c] sits at panel c / 32, pair k / 2, lane c % 32, half k % 2.
void ScalarPTile(const Job& j, int64_t row0, int rows, int64_t n0, int64_t n1, int64_t kb, int64_t ke, float* acc) {
  const uint16_t* w = static_cast<const uint16_t*>(j.w);
  const int64_t width = n1 - n0, kp = (j.k + 1) / 2;
  std::memset(acc, 0, sizeof(float) * rows * width);
  for (int64_t k = kb; k < ke; ++k)
    for (int r = 0; r < rows; ++r) {
      const float xv = j.x[(row0 + r) * j.k + k];
      float* a = acc + r * width;
      for (int64_t c = n0; c < n1; ++c) a[c - n0] += xv * Bf16ToF32(w[((c / 32) * kp + k / 2) * 64 + (c % 32) * 2 + (k & 1)]);
    }
}

// Packed int8 (HjMatmulQ8, any CPU): w[k, c] sits at panel c / 32, quad k / 4, lane c % 32, byte
// k % 4. Per block: an exact integer dot, then sum += float(dot) * (x's scale * w's scale).
void ScalarQ8Tile(const Job& j, int64_t row0, int rows, int64_t n0, int64_t n1, int64_t kb, int64_t ke, float* acc) {
  const int8_t* w = static_cast<const int8_t*>(j.w);
  const int64_t width = n1 - n0, kq = (j.k + 3) / 4, blocks = (j.k + j.xblock - 1) / j.xblock;
  std::memset(acc, 0, sizeof(float) * rows * width);
  for (int64_t b0 = kb; b0 < ke; b0 += j.xblock) {  // kb is a whole number of blocks
    const int64_t b1 = b0 + j.xblock < ke ? b0 + j.xblock : ke;
    for (int r = 0; r < rows; ++r) {
      const int8_t* xq = j.xq + (row0 + r) * 4 * kq;
      const float d = j.xs[(row0 + r) * blocks + b0 / j.xblock];
      for (int64_t c = n0; c < n1; ++c) {
        int32_t dot = 0;
        const int8_t* panel = w + (c / 32) * kq * 128 + (c % 32) * 4;
        for (int64_t k = b0; k < b1; ++k) dot += int32_t(xq[k]) * panel[(k / 4) * 128 + (k & 3)];
        const float dd = d * WScaleAt(j, blocks, b0 / j.xblock, c);  // AVX2's order: the paths agree bit for bit
        acc[r * width + (c - n0)] = std::fma(float(dot), dd, acc[r * width + (c - n0)]);
      }
    }
  }
}

#if HJ_X86

#define HJ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define HJ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define HJ_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

// --- avx2: 8 columns per vector; tail columns scalar ----------------------------------

HJ_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
HJ_AVX2 inline __m256 Load8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
HJ_AVX2 inline __m256 Load8(const int8_t* p) {
  long long v;
  std::memcpy(&v, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v)));
}

// Weight rows per pass on AVX2: four for one or two rows of x (a float32 weight may take eight:
// Avx2Tile, NextPassRows). On a Zen 3 (AVX2 only) eight row streams per pass (and eight more
// prefetched) read a float32 weight at 0.74-0.87x of a plain sequential read; four read
// 1.11-1.16x faster than eight (bench_kernel_bw, benchmarks/README.md). The sums are the same:
// each column still runs over k in order, one FMA at a time.
template <int M, typename T>
constexpr int Avx2RowBlock() { return M <= 2 ? 4 : RowBlock<M, T>(); }

// The next pass's rows are prefetched, except for a float32 weight and one or two rows of x: its
// four-row passes over long row segments the hardware prefetcher follows alone, and the
// prefetches cost (on a Zen 3, two threads read the 1024 x 32000 head at 14.2 GB/s with them and
// 19.7 without: benchmarks/README.md). bfloat16 and int8 widen each weight and ran slower
// without them (int8 0.64-0.90x).
template <int M, typename T>
constexpr bool Avx2Prefetch() { return M > 2 || !std::is_same<T, float>::value; }

// V vectors of 8 columns per step, so that each broadcast of x[r, k] feeds V FMAs: with one
// vector per step (V = 1, what 5-8 rows use) every FMA paid a broadcast load beside it, and the
// loop ran compute-bound for a few rows (int8 most: it also widens, two uops per 8 weights), at
// about half the float32 path's bytes/s for int8 (benchmarks/README.md). V is chosen so that the sums
// (M x V) and the weights (V) fit the 16 ymm registers. Per column the sum still runs over k in
// order, one FMA at a time, so the results are those of the one-vector loop, bit for bit.
template <int M, typename T, int V, int RB>
HJ_AVX2 void Avx2WideTile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke, float* acc) {
  static_assert(M * V + V < 16, "sums and weights must fit the ymm registers");
  const T* w = static_cast<const T*>(j.w);
  const int64_t width = n1 - n0, wide_end = n0 + (width / (8 * V)) * (8 * V), vec_end = n0 + (width / 8) * 8;
  const float* x = j.x + row0 * j.k;
  std::memset(acc, 0, sizeof(float) * M * width);
  for (int64_t k0 = kb; k0 < ke; k0 += RB) {
    const int64_t k1 = k0 + RB < ke ? k0 + RB : ke;
    const int64_t next = k1 + (k1 - k0) <= ke ? k1 - k0 : 0;  // the next pass's rows, if whole
    for (int64_t c = n0; c < wide_end; c += 8 * V) {
      float* out = acc + (c - n0);
      __m256 a[M][V];
      for (int r = 0; r < M; ++r)
        for (int g = 0; g < V; ++g) a[r][g] = _mm256_loadu_ps(out + r * width + 8 * g);
      for (int64_t k = k0; k < k1; ++k) {
        const T* p = w + k * j.n + c;
        __m256 wv[V];
        for (int g = 0; g < V; ++g) {
          if (Avx2Prefetch<M, T>() && ((c + 8 * g) * sizeof(T)) % 64 == 0)
            PrefetchNext(p + 8 * g + next * j.n);
          wv[g] = Load8(p + 8 * g);
        }
        for (int r = 0; r < M; ++r) {
          const __m256 xv = _mm256_set1_ps(x[r * j.k + k]);
          for (int g = 0; g < V; ++g) a[r][g] = _mm256_fmadd_ps(xv, wv[g], a[r][g]);
        }
      }
      for (int r = 0; r < M; ++r)
        for (int g = 0; g < V; ++g) _mm256_storeu_ps(out + r * width + 8 * g, a[r][g]);
    }
    for (int64_t c = wide_end; c < vec_end; c += 8) {
      __m256 a[M];
      for (int r = 0; r < M; ++r) a[r] = _mm256_loadu_ps(acc + r * width + (c - n0));
      for (int64_t k = k0; k < k1; ++k) {
        if (Avx2Prefetch<M, T>() && (c * sizeof(T)) % 64 == 0) PrefetchNext(w + (k + next) * j.n + c);
        __m256 wv = Load8(w + k * j.n + c);
        for (int r = 0; r < M; ++r) a[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * j.k + k]), wv, a[r]);
      }
      for (int r = 0; r < M; ++r) _mm256_storeu_ps(acc + r * width + (c - n0), a[r]);
    }
    for (int64_t c = vec_end; c < n1; ++c)
      for (int64_t k = k0; k < k1; ++k) {
        float wv = WeightAt<T>(w, k * j.n + c);
        for (int r = 0; r < M; ++r) acc[r * width + (c - n0)] += x[r * j.k + k] * wv;
      }
  }
}

// V = 4 for 1-2 rows of x, 2 for 3-4 rows, 1 (one vector per step) for more: the sums and the
// weights fit the 16 ymm registers. A float32 weight and one or two rows of x read 4 or 8 weight
// rows per pass, as hj::NextPassRows chose for this CPU (the same bits either way).
template <int M, typename T>
HJ_AVX2 void Avx2Tile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke, float* acc) {
  constexpr int V = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  if (M <= 2 && std::is_same<T, float>::value && j.pass_rows == 8)
    Avx2WideTile<M, T, V, 8>(j, row0, n0, n1, kb, ke, acc);
  else
    Avx2WideTile<M, T, V, Avx2RowBlock<M, T>()>(j, row0, n0, n1, kb, ke, acc);
}

HJ_AVX2 inline float HSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Columns [c, c + C) of M rows of x against w [n, k]: C weight rows read side by side, each
// column's dot in its own register (C x M independent FMA chains, where one chain waited on its
// FMA latency: 8 floats every 4 cycles). Each column's sum runs over k in the same order whatever
// C, so the results do not depend on how columns are grouped.
template <int M, int C, typename T>
HJ_AVX2 inline void Avx2TColumns(const T* __restrict w, const float* __restrict x, int64_t K, int64_t c,
                                 float* __restrict out, int64_t width) {
  const int64_t vec_end = K / 8 * 8;
  __m256 a[C][M];
  for (int i = 0; i < C; ++i)
    for (int r = 0; r < M; ++r) a[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < vec_end; k += 8) {
    __m256 xv[M];
    for (int r = 0; r < M; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int i = 0; i < C; ++i) {
      const __m256 wv = Load8(w + (c + i) * K + k);
      for (int r = 0; r < M; ++r) a[i][r] = _mm256_fmadd_ps(xv[r], wv, a[i][r]);
    }
  }
  for (int i = 0; i < C; ++i)
    for (int r = 0; r < M; ++r) {
      float sum = HSum8(a[i][r]);
      for (int64_t k = vec_end; k < K; ++k) sum += x[r * K + k] * WeightAt<T>(w, (c + i) * K + k);
      out[r * width + i] = sum;
    }
}

// Three rows of x or more against w [n, k]: one weight row at a time (M sums in registers), and
// two changes that took a float32 step from 0.5-0.9x of the [K, N] path's bytes/s to 1.0-1.6x
// (bench_kernel_bw.py, AVX2 on Zen 5; 8 rows gained most): x's rows interleaved by 8 floats into
// one buffer (`InterleaveRows`: the M loads of a step are one contiguous run), and the weight row
// prefetched kTAheadBytes ahead (one stream per thread, which the hardware prefetcher alone kept
// too short: a 4-row step read 10 GB/s on one thread). Each column's sum runs over k in the
// order of Avx2TColumns<M, 1>: the same bits.
constexpr int64_t kTAheadBytes = 4096;

// x [M, K] -> [K / V, M, V] (the first K / V * V columns), in a per-thread buffer aligned to 64 B.
template <int M, int V>
const float* InterleaveRows(const float* x, int64_t K) {
  thread_local std::vector<float> buf;
  const int64_t vec_end = K / V * V;
  buf.resize(size_t(vec_end * M + 16));
  float* xi = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  for (int64_t k = 0; k < vec_end; k += V)
    for (int r = 0; r < M; ++r) std::memcpy(xi + k * M + r * V, x + r * K + k, sizeof(float) * V);
  return xi;
}

template <typename T>
inline void PrefetchAhead(const T* p, int64_t k) {
  if ((k * int64_t(sizeof(T))) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + k) + kTAheadBytes, _MM_HINT_T0);
}

template <int M, typename T>
HJ_AVX2 void Avx2TRows(const T* __restrict w, const float* __restrict x, int64_t K, int64_t n0, int64_t n1,
                       float* __restrict out, int64_t width) {
  const int64_t vec_end = K / 8 * 8;
  const float* xi = InterleaveRows<M, 8>(x, K);
  for (int64_t c = n0; c < n1; ++c) {
    const T* wc = w + c * K;
    __m256 a[M];
    for (int r = 0; r < M; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < vec_end; k += 8) {
      PrefetchAhead(wc, k);
      const __m256 wv = Load8(wc + k);
      for (int r = 0; r < M; ++r) a[r] = _mm256_fmadd_ps(_mm256_load_ps(xi + k * M + r * 8), wv, a[r]);
    }
    for (int r = 0; r < M; ++r) {
      float sum = HSum8(a[r]);
      for (int64_t k = vec_end; k < K; ++k) sum += x[r * K + k] * WeightAt<T>(wc, k);
      out[r * width + (c - n0)] = sum;
    }
  }
}

template <int M, typename T>
HJ_AVX2 void Avx2TTile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t, int64_t, float* acc) {
  const T* w = static_cast<const T*>(j.w);
  const int64_t width = n1 - n0;
  const float* x = j.x + row0 * j.k;
  if constexpr (M > 2) {
    Avx2TRows<M, T>(w, x, j.k, n0, n1, acc, width);
  } else {
    constexpr int C = 4;  // C x M sums, C weights and M rows of x in the 16 ymm registers
    const int64_t grouped = n0 + (n1 - n0) / C * C;
    int64_t c = n0;
    for (; c < grouped; c += C) Avx2TColumns<M, C, T>(w, x, j.k, c, acc + (c - n0), width);
    for (; c < n1; ++c) Avx2TColumns<M, 1, T>(w, x, j.k, c, acc + (c - n0), width);
  }
}

// Packed bf16 panels on AVX2 (the layout of the avx512bf16 path, see the top): a 32-bit lane
// holds (w[2p, c], w[2p + 1, c]), so one 32-byte load gives both rows of 8 columns, widened
// by a shift (row 2p) and a mask (row 2p + 1): 1.5 uops per 8 weights against 2 for the
// [K, N] path, and a panel is one contiguous stream. Sums stay in registers over a block of
// pairs; rows of x go in groups of at most 3 (4 ymm of sums each) over that L1-resident block.
// Each column's sum runs over k in order, one FMA at a time, whatever the group: a row's
// result does not depend on the other rows.
template <int G>
HJ_AVX2 inline void Avx2PackedGroup(const uint16_t* __restrict w, const float* __restrict x, int64_t K,
                                    int64_t p0, int64_t p1, float* __restrict acc, int64_t stride) {
  constexpr int64_t kAhead = 512;  // prefetch 1 KB ahead along the panel
  const __m256i odd_mask = _mm256_set1_epi32(int(0xffff0000u));
  __m256 a[G][4];
  for (int r = 0; r < G; ++r)
    for (int g = 0; g < 4; ++g) a[r][g] = _mm256_loadu_ps(acc + r * stride + 8 * g);
  for (int64_t p = p0; p < p1; ++p, w += 64) {
    PrefetchNext(w + kAhead);
    PrefetchNext(w + kAhead + 32);
    const bool has_odd = 2 * p + 1 < K;  // odd K: the last pair's second row is padding
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * g));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
      for (int r = 0; r < G; ++r) {
        a[r][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + 2 * p), even, a[r][g]);
        if (has_odd) a[r][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + 2 * p + 1), odd, a[r][g]);
      }
    }
  }
  for (int r = 0; r < G; ++r)
    for (int g = 0; g < 4; ++g) _mm256_storeu_ps(acc + r * stride + 8 * g, a[r][g]);
}

// acc rows: whole panels (stride rounded up to 32 columns), as on the avx512bf16 path.
template <int M>
HJ_AVX2 void Avx2PackedTile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke, float* acc) {
  constexpr int64_t kBlock = 64;  // pairs per block: 8 KB of panel, re-read from L1 by each row group
  const uint16_t* wbase = static_cast<const uint16_t*>(j.w);
  const int64_t kp = (j.k + 1) / 2, stride = (n1 - n0 + 31) / 32 * 32, K = j.k;
  const float* x = j.x + row0 * K;
  const int64_t pb = kb / 2, pe = (ke + 1) / 2;
  std::memset(acc, 0, sizeof(float) * M * stride);
  for (int64_t panel = n0 / 32; panel * 32 < n1; ++panel) {
    float* out = acc + (panel * 32 - n0);
    for (int64_t p0 = pb; p0 < pe; p0 += kBlock) {
      const int64_t p1 = p0 + kBlock < pe ? p0 + kBlock : pe;
      const uint16_t* w = wbase + (panel * kp + p0) * 64;
      int r = 0;
      for (; r + 3 <= M; r += 3) Avx2PackedGroup<3>(w, x + r * K, K, p0, p1, out + r * stride, stride);
      if (M - r == 2) Avx2PackedGroup<2>(w, x + r * K, K, p0, p1, out + r * stride, stride);
      if (M - r == 1) Avx2PackedGroup<1>(w, x + r * K, K, p0, p1, out + r * stride, stride);
    }
  }
}

// Packed int8 against int8 x on AVX2 (HjMatmulQ8): a 32-bit lane holds 4 consecutive k of one
// column, so one 32-byte load is 4 rows of 8 columns and a broadcast quad of x meets it in
// vpmaddubsw (u8 x s8 -> pairs summed to s16) and vpmaddwd by ones (-> s32): 32 weights in 4
// uops per row of x, against 8 widening uops + 4 FMAs on the float path.
// vpmaddubsw takes one unsigned operand and saturates its pair sums at s16. So x goes in as |x|
// (u8, <= 127) and its sign moves onto w (vpsignb; w in [-127, 127], so -w fits): a pair sums
// to at most 2 * 127 * 127 = 32258 < 32767, never saturating; the s32 sums are exact.
// Per block (one scale of x, one per column of w), the integer sums become float once:
// sum += float(dot) * (d * ws), ws the block's 8 column scales per vector (1 load, 1 multiply).
HJ_AVX2 inline __m256 LoadScales8(const float* p) { return _mm256_loadu_ps(p); }
HJ_AVX2 inline __m256 LoadScales8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int G, typename S>
HJ_AVX2 inline void Avx2Q8Group(const int8_t* __restrict w, const uint8_t* __restrict xu,
                                const int8_t* __restrict xq, int64_t ldx, const float* d, int64_t ldd,
                                const S* ws, int64_t q0, int64_t q1, float* __restrict out, int64_t stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s[G][4];
  for (int r = 0; r < G; ++r)
    for (int g = 0; g < 4; ++g) s[r][g] = _mm256_setzero_si256();
  for (int64_t q = q0; q < q1; ++q, w += 128) {
    PrefetchNext(w + 1024);  // 8 quads ahead along the panel
    PrefetchNext(w + 1024 + 64);
    for (int r = 0; r < G; ++r) {
      int32_t mag, sgn;
      std::memcpy(&mag, xu + r * ldx + 4 * q, 4);
      std::memcpy(&sgn, xq + r * ldx + 4 * q, 4);
      const __m256i xm = _mm256_set1_epi32(mag), xs = _mm256_set1_epi32(sgn);
      for (int g = 0; g < 4; ++g) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * g));
        const __m256i pairs = _mm256_maddubs_epi16(xm, _mm256_sign_epi8(wv, xs));
        s[r][g] = _mm256_add_epi32(s[r][g], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  __m256 wsv[4];
  for (int g = 0; g < 4; ++g) wsv[g] = LoadScales8(ws + 8 * g);
  for (int r = 0; r < G; ++r) {
    const __m256 dv = _mm256_set1_ps(d[r * ldd]);
    for (int g = 0; g < 4; ++g) {
      float* o = out + r * stride + 8 * g;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][g]), _mm256_mul_ps(dv, wsv[g]), _mm256_loadu_ps(o)));
    }
  }
}

// acc rows: whole panels. Rows of x go in pairs over each block of the panel (L1-resident after
// the first pair), so the integer sums of a pair (8 ymm) and the weights fit the registers.
template <int M, typename S>
HJ_AVX2 void Avx2Q8TileOf(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke, float* acc) {
  const int8_t* wbase = static_cast<const int8_t*>(j.w);
  const S* sbase = static_cast<const S*>(j.wscale);
  const int64_t kq = (j.k + 3) / 4, stride = (n1 - n0 + 31) / 32 * 32, blocks = (j.k + j.xblock - 1) / j.xblock;
  const int8_t* xq = j.xq + row0 * 4 * kq;
  const uint8_t* xu = j.xu + row0 * 4 * kq;
  const float* xs = j.xs + row0 * blocks;
  std::memset(acc, 0, sizeof(float) * M * stride);
  for (int64_t panel = n0 / 32; panel * 32 < n1; ++panel) {
    float* out = acc + (panel * 32 - n0);
    for (int64_t b0 = kb; b0 < ke; b0 += j.xblock) {  // kb is a whole number of blocks
      const int64_t b1 = b0 + j.xblock < ke ? b0 + j.xblock : ke, q0 = b0 / 4, q1 = (b1 + 3) / 4;
      const int8_t* w = wbase + (panel * kq + q0) * 128;
      const float* d = xs + b0 / j.xblock;
      const S* ws = sbase + (panel * blocks + b0 / j.xblock) * 32;
      const int64_t ldx = 4 * kq;
      int r = 0;
      for (; r + 2 <= M; r += 2)
        Avx2Q8Group<2>(w, xu + r * ldx, xq + r * ldx, ldx, d + r * blocks, blocks, ws, q0, q1, out + r * stride,
                       stride);
      if (r < M)
        Avx2Q8Group<1>(w, xu + r * ldx, xq + r * ldx, ldx, d + r * blocks, blocks, ws, q0, q1, out + r * stride,
                       stride);
    }
  }
}

template <int M>
HJ_AVX2 void Avx2Q8Tile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke, float* acc) {
  (j.wscale_f16 ? Avx2Q8TileOf<M, uint16_t> : Avx2Q8TileOf<M, float>)(j, row0, n0, n1, kb, ke, acc);
}

// --- avx512: 16 columns per vector, masked tail ---------------------------------------

HJ_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
HJ_AVX512 inline __m512 Load16(const uint16_t* p) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
HJ_AVX512 inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
HJ_AVX512 inline __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
HJ_AVX512 inline __m512 Load16(const uint16_t* p, __mmask16 m) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
HJ_AVX512 inline __m512 Load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// Rows k0 .. k0 + B - 1 of w against columns [c, c + 16) of M rows of x.
// Masked (the last, partial chunk) or not: a masked load costs more on some cores.
template <int M, int B, bool kMasked, typename T>
HJ_AVX512 inline void Avx512Step(const T* __restrict w, int64_t n, const float* __restrict x,
                                 int64_t ldx, int64_t k0, int64_t next, int64_t c, __mmask16 m,
                                 float* __restrict acc, int64_t width) {
  __m512 a[M];
  for (int r = 0; r < M; ++r)
    a[r] = kMasked ? _mm512_maskz_loadu_ps(m, acc + r * width) : _mm512_loadu_ps(acc + r * width);
  for (int b = 0; b < B; ++b) {
    if (sizeof(T) == 4 || (c * sizeof(T)) % 64 == 0) PrefetchNext(w + (k0 + b + next) * n + c);
    __m512 wv = kMasked ? Load16(w + (k0 + b) * n + c, m) : Load16(w + (k0 + b) * n + c);
    for (int r = 0; r < M; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k0 + b]), wv, a[r]);
  }
  for (int r = 0; r < M; ++r) {
    if (kMasked) _mm512_mask_storeu_ps(acc + r * width, m, a[r]);
    else _mm512_storeu_ps(acc + r * width, a[r]);
  }
}

template <int M, typename T>
HJ_AVX512 void Avx512Tile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke,
                          float* acc) {
  const T* w = static_cast<const T*>(j.w);
  const int64_t width = n1 - n0, n = j.n, K = j.k, full = n0 + width / 16 * 16;
  const float* x = j.x + row0 * K;
  const __mmask16 all = 0xffff, tail = __mmask16((1u << ((n1 - full) & 15)) - 1);
  constexpr int B = RowBlock<M, T>();
  std::memset(acc, 0, sizeof(float) * M * width);
  int64_t k0 = kb;
  for (; k0 + B <= ke; k0 += B) {
    const int64_t next = k0 + 2 * B <= ke ? B : 0;
    for (int64_t c = n0; c < full; c += 16)
      Avx512Step<M, B, false>(w, n, x, K, k0, next, c, all, acc + (c - n0), width);
    if (tail) Avx512Step<M, B, true>(w, n, x, K, k0, next, full, tail, acc + (full - n0), width);
  }
  for (; k0 < ke; ++k0) {
    for (int64_t c = n0; c < full; c += 16) Avx512Step<M, 1, false>(w, n, x, K, k0, 0, c, all, acc + (c - n0), width);
    if (tail) Avx512Step<M, 1, true>(w, n, x, K, k0, 0, full, tail, acc + (full - n0), width);
  }
}

// Columns [c, c + C) of M rows of x against w [n, k] (as Avx2TColumns: C x M independent FMA
// chains; each column's sum in the same order whatever C).
template <int M, int C, typename T>
HJ_AVX512 inline void Avx512TColumns(const T* __restrict w, const float* __restrict x, int64_t K, int64_t c,
                                     float* __restrict out, int64_t width) {
  const int64_t full = K / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (K - full)) - 1);
  __m512 a[C][M];
  for (int i = 0; i < C; ++i)
    for (int r = 0; r < M; ++r) a[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += 16) {
    __m512 xv[M];
    for (int r = 0; r < M; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
    for (int i = 0; i < C; ++i) {
      const __m512 wv = Load16(w + (c + i) * K + k);
      for (int r = 0; r < M; ++r) a[i][r] = _mm512_fmadd_ps(xv[r], wv, a[i][r]);
    }
  }
  if (tail) {
    __m512 xv[M];
    for (int r = 0; r < M; ++r) xv[r] = _mm512_maskz_loadu_ps(tail, x + r * K + full);
    for (int i = 0; i < C; ++i) {
      const __m512 wv = Load16(w + (c + i) * K + full, tail);
      for (int r = 0; r < M; ++r) a[i][r] = _mm512_fmadd_ps(xv[r], wv, a[i][r]);
    }
  }
  for (int i = 0; i < C; ++i)
    for (int r = 0; r < M; ++r) out[r * width + i] = _mm512_reduce_add_ps(a[i][r]);
}

// Three rows or more: as Avx2TRows (x interleaved, the weight row prefetched; each column's sum
// in Avx512TColumns<M, 1>'s order).
template <int M, typename T>
HJ_AVX512 void Avx512TRows(const T* __restrict w, const float* __restrict x, int64_t K, int64_t n0, int64_t n1,
                           float* __restrict out, int64_t width) {
  const int64_t full = K / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (K - full)) - 1);
  const float* xi = InterleaveRows<M, 16>(x, K);
  for (int64_t c = n0; c < n1; ++c) {
    const T* wc = w + c * K;
    __m512 a[M];
    for (int r = 0; r < M; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 16) {
      PrefetchAhead(wc, k);
      const __m512 wv = Load16(wc + k);
      for (int r = 0; r < M; ++r) a[r] = _mm512_fmadd_ps(_mm512_load_ps(xi + k * M + r * 16), wv, a[r]);
    }
    if (tail) {
      const __m512 wv = Load16(wc + full, tail);
      for (int r = 0; r < M; ++r) a[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + r * K + full), wv, a[r]);
    }
    for (int r = 0; r < M; ++r) out[r * width + (c - n0)] = _mm512_reduce_add_ps(a[r]);
  }
}

template <int M, typename T>
HJ_AVX512 void Avx512TTile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t, int64_t, float* acc) {
  const T* w = static_cast<const T*>(j.w);
  const int64_t width = n1 - n0;
  const float* x = j.x + row0 * j.k;
  if constexpr (M > 2) {
    Avx512TRows<M, T>(w, x, j.k, n0, n1, acc, width);
  } else {
    constexpr int C = 4;  // C x M sums, C weights and M rows of x in the 32 zmm registers
    const int64_t grouped = n0 + (n1 - n0) / C * C;
    int64_t c = n0;
    for (; c < grouped; c += C) Avx512TColumns<M, C, T>(w, x, j.k, c, acc + (c - n0), width);
    for (; c < n1; ++c) Avx512TColumns<M, 1, T>(w, x, j.k, c, acc + (c - n0), width);
  }
}

// --- avx512bf16: vdpbf16ps over (w[k], w[k+1]) pairs, 32 columns per step -------------

// Pairs p0 .. p0 + B - 1 (weight rows 2p, 2p + 1) against 32 columns from c, M rows of x.
// Two weight rows interleaved per 16-bit lane: lo holds columns {0-3, 8-11, 16-19, 24-27} of
// the 32, hi the others (vpunpck works within 128-bit lanes); undone once per tile.
template <int M, int B, bool kSplit, bool kMasked>
HJ_AVX512BF16 inline void DpStep(const uint16_t* __restrict w, int64_t n, int64_t k,
                                 const uint32_t* __restrict xh, const uint32_t* __restrict xl,
                                 int64_t kp, int64_t p0, int64_t next, int64_t c, __mmask32 m,
                                 float* __restrict acc, int64_t stride) {
  __m512 lo_acc[M], hi_acc[M];
  for (int r = 0; r < M; ++r) {
    lo_acc[r] = _mm512_load_ps(acc + r * stride);
    hi_acc[r] = _mm512_load_ps(acc + r * stride + 16);
  }
  for (int b = 0; b < B; ++b) {
    const int64_t p = p0 + b;
    const uint16_t* w0 = w + 2 * p * n + c;
    PrefetchNext(w0 + 2 * next * n);  // the same columns of the next pass's two rows
    PrefetchNext(w0 + (2 * next + 1) * n);
    __m512i a = kMasked ? _mm512_maskz_loadu_epi16(m, w0) : _mm512_loadu_si512(w0);
    __m512i z;  // odd K: the last pair's second row is zero
    if (2 * p + 1 < k) z = kMasked ? _mm512_maskz_loadu_epi16(m, w0 + n) : _mm512_loadu_si512(w0 + n);
    else z = _mm512_setzero_si512();
    __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, z);
    __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, z);
    for (int r = 0; r < M; ++r) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(int(xh[r * kp + p]));
      lo_acc[r] = _mm512_dpbf16_ps(lo_acc[r], lo, xv);
      hi_acc[r] = _mm512_dpbf16_ps(hi_acc[r], hi, xv);
      if (kSplit) {
        __m512bh xr = (__m512bh)_mm512_set1_epi32(int(xl[r * kp + p]));
        lo_acc[r] = _mm512_dpbf16_ps(lo_acc[r], lo, xr);
        hi_acc[r] = _mm512_dpbf16_ps(hi_acc[r], hi, xr);
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    _mm512_store_ps(acc + r * stride, lo_acc[r]);
    _mm512_store_ps(acc + r * stride + 16, hi_acc[r]);
  }
}

// acc layout per row: for each 32-column chunk, 16 "lo" floats then 16 "hi" floats.
template <int M, bool kSplit>
HJ_AVX512BF16 void Bf16DpTile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke,
                              float* acc) {
  const uint16_t* w = static_cast<const uint16_t*>(j.w);
  const int64_t width = n1 - n0, stride = (width + 31) / 32 * 32, kp = (j.k + 1) / 2;
  const int64_t full = n0 + width / 32 * 32, n = j.n, K = j.k;
  const __mmask32 tail = __mmask32((1ull << ((n1 - full) & 31)) - 1);
  const uint32_t* xh = j.xhi + row0 * kp;
  const uint32_t* xl = kSplit ? j.xlo + row0 * kp : nullptr;
  constexpr int B = RowBlock<M, uint16_t>() / 2;
  std::memset(acc, 0, sizeof(float) * M * stride);
  // Pairs [pb, pe): a slice starts on an even row (the planner cuts K in whole row blocks).
  const int64_t pb = kb / 2, pe = (ke + 1) / 2;
  int64_t p0 = pb;
  for (; p0 + B <= pe; p0 += B) {
    const int64_t next = p0 + 2 * B <= pe ? B : 0;
    for (int64_t c = n0; c < full; c += 32)
      DpStep<M, B, kSplit, false>(w, n, K, xh, xl, kp, p0, next, c, 0, acc + (c - n0), stride);
    if (tail) DpStep<M, B, kSplit, true>(w, n, K, xh, xl, kp, p0, next, full, tail, acc + (full - n0), stride);
  }
  for (; p0 < pe; ++p0) {
    for (int64_t c = n0; c < full; c += 32)
      DpStep<M, 1, kSplit, false>(w, n, K, xh, xl, kp, p0, 0, c, 0, acc + (c - n0), stride);
    if (tail) DpStep<M, 1, kSplit, true>(w, n, K, xh, xl, kp, p0, 0, full, tail, acc + (full - n0), stride);
  }
  // Undo the pair interleave in place: [lo | hi] -> columns 0..31 of the chunk.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < M; ++r)
    for (int64_t c = 0; c < stride; c += 32) {
      float* ac = acc + r * stride + c;
      __m512 lo = _mm512_load_ps(ac), hi = _mm512_load_ps(ac + 16);
      _mm512_store_ps(ac, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_store_ps(ac + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

// Transposed bf16 weight: a weight row's consecutive k are already the pairs vdpbf16ps takes,
// and the x pair buffer read as bf16 is x itself (zero-padded to even K).
template <int M, bool kSplit>
HJ_AVX512BF16 void Bf16DpTTile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t, int64_t, float* acc) {
  const uint16_t* w = static_cast<const uint16_t*>(j.w);
  const int64_t K = j.k, kp = (K + 1) / 2, width = n1 - n0, full = K / 32 * 32;
  const __mmask32 tail = __mmask32((1ull << (K - full)) - 1);
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(j.xhi + row0 * kp);
  const uint16_t* xl = kSplit ? reinterpret_cast<const uint16_t*>(j.xlo + row0 * kp) : nullptr;
  for (int64_t c = n0; c < n1; ++c) {
    const uint16_t* wr = w + c * K;
    __m512 a[M];
    for (int r = 0; r < M; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k <= full; k += 32) {
      if (k == full && !tail) break;
      const __mmask32 m = k < full ? __mmask32(0xffffffffu) : tail;
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, wr + k);
      for (int r = 0; r < M; ++r) {
        a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, xh + r * 2 * kp + k));
        if (kSplit)
          a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, xl + r * 2 * kp + k));
      }
    }
    for (int r = 0; r < M; ++r) acc[r * width + (c - n0)] = _mm512_reduce_add_ps(a[r]);
  }
}

// Packed bf16 weight: panels [n0 / 32, ceil(n1 / 32)), pairs [kb / 2, ceil(ke / 2)); each panel is
// one contiguous run of 128 bytes per pair, summed in registers and stored once. One chain of
// vdpbf16ps per 16 columns and row (unrolling to two chains streamed no faster from memory, and
// would make a row's sums depend on how many rows share the call). acc rows: whole panels.
template <int M, bool kSplit>
HJ_AVX512BF16 void Bf16PackedTile(const Job& j, int64_t row0, int64_t n0, int64_t n1, int64_t kb, int64_t ke,
                                  float* acc) {
  constexpr int64_t kAhead = 512;  // prefetch 1 KB ahead along the panel (0, 1 and 4 KB ran alike)
  const uint16_t* wbase = static_cast<const uint16_t*>(j.w);
  const int64_t kp = (j.k + 1) / 2, stride = (n1 - n0 + 31) / 32 * 32;
  const uint32_t* xh = j.xhi + row0 * kp;
  const uint32_t* xl = kSplit ? j.xlo + row0 * kp : nullptr;
  const int64_t pb = kb / 2, pe = (ke + 1) / 2;
  for (int64_t panel = n0 / 32; panel * 32 < n1; ++panel) {
    const uint16_t* w = wbase + (panel * kp + pb) * 64;
    __m512 a[M][2];
    for (int r = 0; r < M; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t p = pb; p < pe; ++p, w += 64) {
      PrefetchNext(w + kAhead);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
      for (int r = 0; r < M; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(xh[r * kp + p]));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], w0, xv);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], w1, xv);
        if (kSplit) {
          const __m512bh xr = (__m512bh)_mm512_set1_epi32(int(xl[r * kp + p]));
          a[r][0] = _mm512_dpbf16_ps(a[r][0], w0, xr);
          a[r][1] = _mm512_dpbf16_ps(a[r][1], w1, xr);
        }
      }
    }
    float* out = acc + (panel * 32 - n0);
    for (int r = 0; r < M; ++r) {
      _mm512_storeu_ps(out + r * stride, a[r][0]);
      _mm512_storeu_ps(out + r * stride + 16, a[r][1]);
    }
  }
}

#endif  // HJ_X86

// --- dispatch ---------------------------------------------------------------------------

using TileFn = void (*)(const Job&, int64_t, int64_t, int64_t, int64_t, int64_t, float*);

#define HJ_ROWS_SWITCH(...)  \
  switch (rows) {            \
    case 1: return __VA_ARGS__<1>; \
    case 2: return __VA_ARGS__<2>; \
    case 3: return __VA_ARGS__<3>; \
    case 4: return __VA_ARGS__<4>; \
    case 5: return __VA_ARGS__<5>; \
    case 6: return __VA_ARGS__<6>; \
    case 7: return __VA_ARGS__<7>; \
    case 8: return __VA_ARGS__<8>; \
  }

#if HJ_X86
template <typename T> struct Paths {
  template <int M> static constexpr TileFn avx512 = Avx512Tile<M, T>;
  template <int M> static constexpr TileFn avx512_t = Avx512TTile<M, T>;
  template <int M> static constexpr TileFn avx2 = Avx2Tile<M, T>;
  template <int M> static constexpr TileFn avx2_t = Avx2TTile<M, T>;
};
struct Avx2PackedPaths {
  template <int M> static constexpr TileFn tile = Avx2PackedTile<M>;
  template <int M> static constexpr TileFn q8 = Avx2Q8Tile<M>;
};
template <bool kSplit> struct DpPaths {
  template <int M> static constexpr TileFn dp = Bf16DpTile<M, kSplit>;
  template <int M> static constexpr TileFn dp_t = Bf16DpTTile<M, kSplit>;
  template <int M> static constexpr TileFn dp_p = Bf16PackedTile<M, kSplit>;
};
#endif

// The vectorised tile for this path, weight dtype and row count (null: use the scalar one).
template <typename T>
TileFn VectorTile(int isa, bool transposed, int rows) {
#if HJ_X86
  if (isa >= kAvx512) {
    if (transposed) { HJ_ROWS_SWITCH(Paths<T>::template avx512_t) }
    else { HJ_ROWS_SWITCH(Paths<T>::template avx512) }
  } else if (isa == kAvx2) {
    if (transposed) { HJ_ROWS_SWITCH(Paths<T>::template avx2_t) }
    else { HJ_ROWS_SWITCH(Paths<T>::template avx2) }
  }
#endif
  return nullptr;
}

template <bool kSplit>
TileFn DpTile(bool transposed, bool packed, int rows) {
#if HJ_X86
  if (packed) { HJ_ROWS_SWITCH(DpPaths<kSplit>::template dp_p) }
  if (transposed) { HJ_ROWS_SWITCH(DpPaths<kSplit>::template dp_t) }
  else { HJ_ROWS_SWITCH(DpPaths<kSplit>::template dp) }
#endif
  return nullptr;
}

// Packed panels read by a path without vdpbf16ps: AVX2 widens bf16 pairs and multiplies int8
// quads as integers, on AVX-512 CPUs too (null: plain C++).
inline TileFn PackedTile(int isa, int wtype, int rows) {
#if HJ_X86
  if (isa >= kAvx2 && wtype == kI8) { HJ_ROWS_SWITCH(Avx2PackedPaths::template q8) }
  if (isa >= kAvx2) { HJ_ROWS_SWITCH(Avx2PackedPaths::template tile) }
#endif
  return nullptr;
}

// One unit of work: a block of <= kMaxRows rows of one job against one column tile.
struct Item {
  int job;
  int64_t row0;
  int rows;
  int64_t n0, n1;
  int64_t kb, ke;  // rows of w (a slice of K)
  int slice;       // which partial-sum buffer, when the job is sliced
};

struct Plan {
  std::vector<Job> jobs;
  std::vector<Item> items;
  int isa;
  bool split;  // avx512bf16 with float32 x
  int64_t tile_floats;  // partial-sum buffer size per item
  std::atomic<int64_t> next{0}, done{0};
  // Owned copies of x in the layouts the paths read.
  std::vector<float> xf;
  std::vector<uint32_t> xhi, xlo;
  std::vector<int8_t> xq;   // packed int8: x quantised per block (sign and magnitude bytes), scales
  std::vector<uint8_t> xu;
  std::vector<float> xs;
  std::vector<float> part;  // partial sums of K slices, [jobs][slices][rows][n]
};

void RunItem(const Plan& plan, const Item& it, float* acc) {
  const Job& j = plan.jobs[it.job];
  const bool dp = plan.isa == kAvx512Bf16 && j.wtype == kBF16;
  TileFn fn = dp ? (plan.split ? DpTile<true>(j.transposed, j.packed, it.rows)
                                : DpTile<false>(j.transposed, j.packed, it.rows))
              : j.packed ? PackedTile(plan.isa, j.wtype, it.rows)
              : j.wtype == kF32 ? VectorTile<float>(plan.isa, j.transposed, it.rows)
              : j.wtype == kBF16 ? VectorTile<uint16_t>(plan.isa, j.transposed, it.rows)
                                 : VectorTile<int8_t>(plan.isa, j.transposed, it.rows);
  if (fn) {  // vectorised
    fn(j, it.row0, it.n0, it.n1, it.kb, it.ke, acc);
  } else if (j.packed && j.wtype == kI8) {
    ScalarQ8Tile(j, it.row0, it.rows, it.n0, it.n1, it.kb, it.ke, acc);
  } else if (j.packed) {
    ScalarPTile(j, it.row0, it.rows, it.n0, it.n1, it.kb, it.ke, acc);
  } else if (j.wtype == kF32) {
    (j.transposed ? ScalarTTile<float> : ScalarTile<float>)(j, it.row0, it.rows, it.n0, it.n1, it.kb, it.ke, acc);
  } else if (j.wtype == kBF16) {
    (j.transposed ? ScalarTTile<uint16_t> : ScalarTile<uint16_t>)(j, it.row0, it.rows, it.n0, it.n1, it.kb, it.ke,
                                                                  acc);
  } else {
    (j.transposed ? ScalarTTile<int8_t> : ScalarTile<int8_t>)(j, it.row0, it.rows, it.n0, it.n1, it.kb, it.ke, acc);
  }
  // acc rows have stride >= width (the bf16 pair path rounds it up to whole 32-column chunks).
  const int64_t width = it.n1 - it.n0;
  const bool whole_panels = (dp && !j.transposed) || (j.packed && fn);
  const int64_t stride = whole_panels ? (width + 31) / 32 * 32 : width;
  for (int r = 0; r < it.rows; ++r) {
    const float* src = acc + r * stride;
    if (j.part) {  // a slice of K: its partial sums, added up (and scaled) by the caller
      std::memcpy(j.part + (int64_t(it.slice) * j.rows + it.row0 + r) * j.n + it.n0, src, sizeof(float) * width);
      continue;
    }
    float* dst = j.y + (it.row0 + r) * j.n + it.n0;
    if (j.scale) {
      for (int64_t c = 0; c < width; ++c) dst[c] = src[c] * j.scale[it.n0 + c];
    } else {
      std::memcpy(dst, src, sizeof(float) * width);
    }
  }
}

// y = the slices' partial sums added in slice order (then scaled, for int8).
void AddSlices(const Plan& plan, int64_t slices) {
  for (const Job& j : plan.jobs)
    for (int64_t r = 0; r < j.rows; ++r) {
      float* y = j.y + r * j.n;
      const float* p = j.part + r * j.n;
      std::memcpy(y, p, sizeof(float) * j.n);
      for (int64_t s = 1; s < slices; ++s)
        for (int64_t c = 0; c < j.n; ++c) y[c] += p[s * j.rows * j.n + c];
      if (j.scale)
        for (int64_t c = 0; c < j.n; ++c) y[c] *= j.scale[c];
    }
}

// --- weight rows per pass of the AVX2 float32 decode stream, chosen per CPU by timing ---------
//
// One or two rows of x against a float32 weight of >= 256 KB and up to kAvx2WholeRowsCols
// columns (decode's projections) stream four slices of K, each over the whole width, front to
// back without prefetches, a pass reading 4 or 8 weight rows side by side. The sums are the same
// bits either way; which reads faster is the CPU's: on a Zen 3 four rows per pass read 1.11-1.16x
// faster than eight, on a Zen 5 (capped to AVX2) eight made a float32 step 1.10x faster
// (benchmarks/README.md). So, unless one is forced (HjSetAvx2PassRows), the first calls of each
// weight shape alternate the two, and once each has run kPassTrials times the one with the
// shortest call serves every later call of that shape.
constexpr int kPassTrials = 8;

struct PassTrial {
  int64_t k, n;
  int runs[2];         // calls with 4, 8 rows per pass
  int64_t best_ns[2];  // the shortest of each
  int chosen;          // 4 or 8; 0 while measuring
};

std::atomic<int> forced_pass_rows{0};  // 4 or 8; 0: measure
std::mutex trials_mu;
std::vector<PassTrial> trials;  // one per weight shape met (a model has a handful)

PassTrial& TrialOf(int64_t k, int64_t n) {  // under trials_mu
  for (PassTrial& t : trials)
    if (t.k == k && t.n == n) return t;
  trials.push_back(PassTrial{k, n, {0, 0}, {INT64_MAX, INT64_MAX}, 0});
  return trials.back();
}

// Rows per pass for the next call with a [k, n] weight: the forced, the chosen, or the next trial.
int NextPassRows(int64_t k, int64_t n) {
  const int forced = forced_pass_rows.load(std::memory_order_relaxed);
  if (forced) return forced;
  std::lock_guard<std::mutex> lock(trials_mu);
  const PassTrial& t = TrialOf(k, n);
  if (t.chosen) return t.chosen;
  return t.runs[0] <= t.runs[1] ? 4 : 8;
}

// A call with `pass_rows` took `ns`: count it, and choose once both have run kPassTrials times.
void RecordPassRows(int64_t k, int64_t n, int pass_rows, int64_t ns) {
  if (forced_pass_rows.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(trials_mu);
  PassTrial& t = TrialOf(k, n);
  if (t.chosen) return;
  const int i = pass_rows == 8;
  ++t.runs[i];
  t.best_ns[i] = std::min(t.best_ns[i], ns);
  if (t.runs[0] >= kPassTrials && t.runs[1] >= kPassTrials) t.chosen = t.best_ns[1] < t.best_ns[0] ? 8 : 4;
}

// Claim items until none are left.
// Items run by helper threads, process-wide (a test reads it to see the pool at work).
std::atomic<int64_t> helper_items{0};

void Drain(Plan& plan, bool helper) {
  float* acc = static_cast<float*>(
      ::operator new(sizeof(float) * plan.tile_floats, std::align_val_t(64)));
  const int64_t total = int64_t(plan.items.size());
  int64_t ran = 0;
  for (;;) {
    int64_t i = plan.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= total) break;
    RunItem(plan, plan.items[i], acc);
    ++ran;
    plan.done.fetch_add(1, std::memory_order_release);
  }
  if (helper && ran) helper_items.fetch_add(ran, std::memory_order_relaxed);
  ::operator delete(acc, std::align_val_t(64));
}

}  // namespace hj

// --- the XLA FFI handler ------------------------------------------------------------------

namespace {

using hj::Job;
using hj::Plan;

int WTypeOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return hj::kF32;
    case ffi::DataType::BF16: return hj::kBF16;
    case ffi::DataType::S8: return hj::kI8;
    default: return -1;
  }
}

int64_t Prod(ffi::AnyBuffer::Dimensions d, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= d[i];
  return p;
}

// Flat index into an operand's leading dims (size 1 broadcasts) for flat batch index b of y.
int64_t BatchIndex(ffi::AnyBuffer::Dimensions d, ffi::AnyBuffer::Dimensions yd, size_t nb, int64_t b) {
  int64_t index = 0, stride = 1;
  for (size_t i = nb; i-- > 0;) {
    const int64_t yi = b % yd[i];
    b /= yd[i];
    index += (d[i] == 1 ? 0 : yi) * stride;
    stride *= d[i];
  }
  return index;
}

ffi::Error MatmulCore(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      std::optional<ffi::AnyBuffer> scale, std::optional<ffi::AnyBuffer> index,
                      ffi::Result<ffi::AnyBuffer> y, int64_t isa_cap, int64_t max_threads,
                      int64_t tile_cols, int64_t k_slices, bool transposed, bool packed = false,
                      int64_t x_block = 0) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() < 2 || wd.size() != xd.size() || yd.size() != xd.size())
    return ffi::Error::InvalidArgument("hj_matmul: x [..., R, K], w [..., K, N], y [..., R, N] of equal rank");
  const size_t nb = xd.size() - 2;
  const int32_t* experts = nullptr;
  if (index) {
    auto id = index->dimensions();
    if (xd.size() != 3 || index->element_type() != ffi::DataType::S32 || id.size() != 1 ||
        id[0] != yd[0] || xd[0] != yd[0] || scale)
      return ffi::Error::InvalidArgument("hj_matmul_indexed: x [B, R, K], w [E, K, N], index [B] int32, no scale");
    experts = static_cast<const int32_t*>(index->untyped_data());
  }
  const int64_t R = xd[nb], K = xd[nb + 1], N = packed ? yd[nb + 1] : wd[transposed ? nb : nb + 1];
  if (packed && x_block > 0) {  // int8 quads
    if (wd[nb] != (N + 31) / 32 || wd[nb + 1] != (K + 3) / 4 * 128 || yd[nb] != R ||
        w.element_type() != ffi::DataType::S8 || transposed || x_block % 4 || x_block > 1024)
      return ffi::Error::InvalidArgument(
          "hj_matmul_q8: x [..., R, K], w int8 [..., ceil(N / 32), ceil(K / 4) * 128], y [..., R, N], "
          "x_block a multiple of 4 up to 1024");
  } else if (packed) {  // N comes from y: the panels pad it to a multiple of 32
    if (wd[nb] != (N + 31) / 32 || wd[nb + 1] != (K + 1) / 2 * 64 || yd[nb] != R ||
        w.element_type() != ffi::DataType::BF16 || transposed)
      return ffi::Error::InvalidArgument(
          "hj_matmul_packed: x [..., R, K], w bfloat16 [..., ceil(N / 32), ceil(K / 2) * 64], y [..., R, N]");
  } else if (wd[transposed ? nb + 1 : nb] != K || yd[nb] != R || yd[nb + 1] != N) {
    return ffi::Error::InvalidArgument("hj_matmul: shapes do not fit x [..., R, K] @ w [..., K, N] (or w^T)");
  }
  const int wtype = WTypeOf(w.element_type());
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  if (wtype < 0 || !(x_bf16 || x.element_type() == ffi::DataType::F32) ||
      y->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("hj_matmul: x float32/bfloat16, w float32/bfloat16/int8, y float32");
  if ((wtype == hj::kI8) != scale.has_value())
    return ffi::Error::InvalidArgument("hj_matmul: int8 weights take a scale, others none");
  const bool q8 = packed && wtype == hj::kI8;
  const int64_t blocks = q8 ? (K + x_block - 1) / x_block : 0;
  if (scale) {
    auto sd = scale->dimensions();
    const auto st = scale->element_type();
    if (q8 && (sd.size() != xd.size() || sd[nb] != (N + 31) / 32 || sd[nb + 1] != blocks * 32 ||
               !(st == ffi::DataType::F16 || st == ffi::DataType::F32)))
      return ffi::Error::InvalidArgument(
          "hj_matmul_q8: scale must be float16 or float32 [..., ceil(N / 32), ceil(K / x_block) * 32]");
    if (!q8 && (sd.size() != xd.size() || sd[nb] != 1 || sd[nb + 1] != N || st != ffi::DataType::F32))
      return ffi::Error::InvalidArgument("hj_matmul: scale must be float32 [..., 1, N]");
    for (size_t i = 0; i < nb; ++i)
      if (sd[i] != 1 && sd[i] != yd[i])
        return ffi::Error::InvalidArgument("hj_matmul: leading dims must equal y's or be 1");
  }
  for (size_t i = 0; i < nb; ++i)
    if ((xd[i] != 1 && xd[i] != yd[i]) || (!experts && wd[i] != 1 && wd[i] != yd[i]))
      return ffi::Error::InvalidArgument("hj_matmul: leading dims must equal y's or be 1");

  auto plan = std::make_shared<Plan>();
  const int best = hj::BestIsa();
  plan->isa = isa_cap < 0 || isa_cap > best ? best : int(isa_cap);
  if (isa_cap > best)
    return ffi::Error::InvalidArgument("hj_matmul: this CPU lacks the requested instruction set");
  const bool dp = plan->isa == hj::kAvx512Bf16 && wtype == hj::kBF16;
  plan->split = dp && !x_bf16;

  // Batch: y's leading dims, flattened. A weight without batch serves all of x's rows at once.
  const int64_t batch = Prod(yd, 0, nb);
  const bool w_shared = !experts && Prod(wd, 0, nb) == 1 && (!scale || Prod(scale->dimensions(), 0, nb) == 1);
  const int64_t num_experts = experts ? wd[0] : 0;
  const int64_t groups = w_shared ? 1 : batch;
  const int64_t rows_per_group = w_shared ? batch * R : R;
  const int64_t total_rows = batch * R;
  const int64_t kp = (K + 1) / 2;
  if (dp) {
    plan->xhi.resize(total_rows * kp);
    if (plan->split) plan->xlo.resize(total_rows * kp);
  } else {
    plan->xf.resize(total_rows * K);
  }
  const int64_t k4 = (K + 3) / 4 * 4;
  const void* xs = x.untyped_data();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t src = (BatchIndex(xd, yd, nb, b) * R + r) * K, dst = b * R + r;
      for (int64_t k = 0; k < K; ++k) {
        float v = x_bf16 ? hj::Bf16ToF32(static_cast<const uint16_t*>(xs)[src + k])
                         : static_cast<const float*>(xs)[src + k];
        if (!dp) {
          plan->xf[dst * K + k] = v;
          continue;
        }
        uint16_t h = x_bf16 ? static_cast<const uint16_t*>(xs)[src + k] : hj::F32ToBf16(v);
        uint32_t shift = (k & 1) ? 16 : 0;
        if (!(k & 1)) plan->xhi[dst * kp + k / 2] = 0;
        plan->xhi[dst * kp + k / 2] |= uint32_t(h) << shift;
        if (plan->split) {
          uint16_t l = hj::F32ToBf16(v - hj::Bf16ToF32(h));
          if (!(k & 1)) plan->xlo[dst * kp + k / 2] = 0;
          plan->xlo[dst * kp + k / 2] |= uint32_t(l) << shift;
        }
      }
    }

  if (q8) {
    plan->xq.assign(total_rows * k4, 0);
    plan->xu.assign(total_rows * k4, 0);
    plan->xs.resize(total_rows * blocks);
    for (int64_t r = 0; r < total_rows; ++r)
      for (int64_t bl = 0; bl < blocks; ++bl)
        plan->xs[r * blocks + bl] = hj::QuantizeBlock(plan->xf.data() + r * K, bl * x_block,
                                                      std::min(K, (bl + 1) * x_block), plan->xq.data() + r * k4,
                                                      plan->xu.data() + r * k4);
  }

  const size_t wbytes = wtype == hj::kF32 ? 4 : wtype == hj::kBF16 ? 2 : 1;
  float* yp = static_cast<float*>(y->untyped_data());
  int64_t live_groups = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (experts && (experts[g] < 0 || experts[g] >= num_experts)) {  // routed nowhere: zeros
      std::memset(yp + g * rows_per_group * N, 0, sizeof(float) * rows_per_group * N);
      continue;
    }
    ++live_groups;
    Job j;
    j.rows = rows_per_group;
    j.k = K;
    j.n = N;
    j.wtype = wtype;
    j.transposed = transposed;
    j.packed = packed;
    const int64_t row_off = g * rows_per_group;
    j.x = dp ? nullptr : plan->xf.data() + row_off * K;
    j.xhi = dp ? plan->xhi.data() + row_off * kp : nullptr;
    j.xlo = plan->split ? plan->xlo.data() + row_off * kp : nullptr;
    j.xq = q8 ? plan->xq.data() + row_off * k4 : nullptr;
    j.xu = q8 ? plan->xu.data() + row_off * k4 : nullptr;
    j.xs = q8 ? plan->xs.data() + row_off * blocks : nullptr;
    j.xblock = x_block;
    const int64_t wi = experts ? experts[g] : w_shared ? 0 : BatchIndex(wd, yd, nb, g);
    const int64_t w_elems = packed ? wd[nb] * wd[nb + 1] : K * N;
    j.w = static_cast<const char*>(w.untyped_data()) + wi * w_elems * wbytes;
    const int64_t si = scale && !w_shared ? BatchIndex(scale->dimensions(), yd, nb, g) : 0;
    j.scale = scale && !q8 ? static_cast<const float*>(scale->untyped_data()) + si * N : nullptr;
    j.wscale_f16 = q8 && scale->element_type() == ffi::DataType::F16;
    j.wscale = q8 ? static_cast<const char*>(scale->untyped_data()) +
                        si * scale->dimensions()[nb] * blocks * 32 * (j.wscale_f16 ? 2 : 4)
                  : nullptr;
    j.y = yp + row_off * N;
    j.part = nullptr;
    plan->jobs.push_back(j);
  }

  // Helpers only when there is enough weight to stream (scheduling costs a few microseconds).
  const int64_t weight_bytes = live_groups * K * N * int64_t(wbytes);
  int64_t threads = pool.num_threads();
  if (max_threads > 0 && threads > max_threads) threads = max_threads;
  if (threads < 1 || weight_bytes < (int64_t(1) << 18)) threads = 1;

  // Work items, from the shape alone (never the thread count, so results do not depend on
  // it): about four per weight of >= 256 KB, whole 32-column chunks at least 1024 wide (long
  // row segments stream best), the weight cut along K when it has too few columns for four
  // tiles (N = 1024: four slices of K). Four items let two threads share the work and one
  // that is descheduled on a busy machine hand work over. `tile_cols` / `k_slices` force a
  // tiling (tests use small ones to reach every edge).
  const bool big = K * N * int64_t(wbytes) >= (int64_t(1) << 18);
  // A float32 weight of up to kAvx2WholeRowsCols columns on AVX2, one or two rows of x (decode):
  // four items, each the whole width over a slice of K, so that an item is one block of whole
  // weight rows read front to back (without prefetches: Avx2Prefetch). On a Zen 3 one row read
  // 1024x2048 and 1024x3072 weights 1.19-1.34x faster than in 1024-column tiles
  // (benchmarks/README.md). The slices depend on the shape alone, so a row's result does not
  // depend on the others; more rows take the narrower tiles below over the same slices. A wider
  // weight (a head) keeps the tiles below: over whole rows it ran alike with one or two rows,
  // and 0.85-0.96x with four.
  // Weight rows per pass (4 or 8) are chosen per CPU by timing (hj::NextPassRows above).
  const bool avx2_rows = big && !packed && !transposed && wtype == hj::kF32 && plan->isa == hj::kAvx2 &&
                         N <= hj::kAvx2WholeRowsCols;
  const int pass_rows = avx2_rows && rows_per_group <= 2 ? hj::NextPassRows(K, N) : 0;
  for (Job& job : plan->jobs) job.pass_rows = pass_rows;
  const auto started = std::chrono::steady_clock::now();
  int64_t tc = N;
  if (tile_cols > 0) {
    tc = tile_cols;
  } else if (avx2_rows && rows_per_group <= 2) {
    tc = N;
  } else if (big && (packed || transposed)) {
    // Packed or transposed: a tile over the whole of K is one contiguous block, so cut only
    // columns, into four at least (slices of K made each panel a run of a few KB: 0.8x the bytes/s
    // of whole panels; a transposed N = 1024 as one item ran on one thread, 0.7x the [K, N] read).
    const int64_t want_tiles = (N + 8191) / 8192 > 4 ? (N + 8191) / 8192 : 4;
    tc = (N + want_tiles - 1) / want_tiles;
  } else if (big) {
    int64_t want_tiles = N / 1024 < 4 ? N / 1024 : (N + 8191) / 8192 > 4 ? (N + 8191) / 8192 : 4;
    if (want_tiles < 1) want_tiles = 1;
    tc = (N + want_tiles - 1) / want_tiles;
  }
  tc = (tc + 31) / 32 * 32;
  if (tc < 32) tc = 32;
  const int64_t tiles = (N + tc - 1) / tc;
  int64_t slices = k_slices > 0 ? k_slices : avx2_rows ? 4 : big && !packed ? (4 + tiles - 1) / tiles : 1;
  if (transposed || K < 32) slices = 1;  // transposed tiles read whole rows of K
  if (slices > K / 16) slices = K / 16 > 0 ? K / 16 : 1;
  // Slice length: whole 16-row blocks (even, so a bf16 pair never straddles two slices); for
  // packed int8, whole blocks of x (a block's integer dot is never cut).
  const int64_t unit = q8 ? x_block * 16 / std::gcd(x_block, int64_t(16)) : 16;
  const int64_t ks = ((K + slices - 1) / slices + unit - 1) / unit * unit;
  slices = (K + ks - 1) / ks;
  // More rows than one block: narrower tiles, so that a block's partial sums stay in L1 while
  // the weight streams (with 8000-column tiles, sums in L2, the 32000-column head at 16 rows ran
  // at 0.78x XLA's speed; with 1024, 1.45x). Column tiles never change a sum, so the K slices
  // above stay those of the shape's own tiling and a row's result is the same at any row count.
  if (tile_cols <= 0 && rows_per_group > hj::kMaxRows && tc > hj::kManyRowsTileCols) tc = hj::kManyRowsTileCols;
  const int64_t item_tiles = (N + tc - 1) / tc;
  if (slices > 1) {
    plan->part.resize(plan->jobs.size() * slices * rows_per_group * N);
    for (size_t g = 0; g < plan->jobs.size(); ++g) plan->jobs[g].part = plan->part.data() + g * slices * rows_per_group * N;
  }
  // A tile's blocks of rows are neighbours in the list: the threads that take them read the
  // same weight bytes at about the same time, so more than kMaxRows rows stream the weight from
  // memory about once (blocks of rows outermost read it once per block: with both changes the
  // 131 MB head at 16 rows went from 2.2x its 8-row time to 0.9x). Each item's sums are the same
  // either way.
  for (int g = 0; g < int(plan->jobs.size()); ++g)
    for (int64_t t = 0; t < item_tiles; ++t)
      for (int64_t sl = 0; sl < slices; ++sl)
        for (int64_t r0 = 0; r0 < rows_per_group; r0 += hj::kMaxRows) {
          int rows = int(rows_per_group - r0 < hj::kMaxRows ? rows_per_group - r0 : hj::kMaxRows);
          int64_t n1 = (t + 1) * tc < N ? (t + 1) * tc : N;
          int64_t ke = (sl + 1) * ks < K ? (sl + 1) * ks : K;
          plan->items.push_back(hj::Item{g, r0, rows, t * tc, n1, sl * ks, ke, int(sl)});
        }
  plan->tile_floats = std::min<int64_t>(hj::kMaxRows, rows_per_group) * tc;
  if (plan->items.empty() || K == 0) {
    if (!experts || K == 0) std::memset(yp, 0, sizeof(float) * batch * R * N);
    return ffi::Error::Success();
  }
  if (threads > int64_t(plan->items.size())) threads = int64_t(plan->items.size());
  for (int64_t t = 1; t < threads; ++t) {
    std::shared_ptr<Plan> keep = plan;
    pool.Schedule([keep] { hj::Drain(*keep, /*helper=*/true); });
  }
  hj::Drain(*plan, /*helper=*/false);
  const int64_t total = int64_t(plan->items.size());
  for (int spins = 0; plan->done.load(std::memory_order_acquire) < total; ++spins) {
    if (spins < 1024) {
#if HJ_X86
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
  if (slices > 1) hj::AddSlices(*plan, slices);
  if (pass_rows && tile_cols <= 0)  // (a forced tiling is a test's, not a measurement)
    hj::RecordPassRows(K, N, pass_rows, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::steady_clock::now() - started).count());
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  std::optional<ffi::AnyBuffer> scale, ffi::Result<ffi::AnyBuffer> y,
                  int64_t isa_cap, int64_t max_threads, int64_t tile_cols, int64_t k_slices, bool transposed) {
  return MatmulCore(pool, x, w, scale, std::nullopt, y, isa_cap, max_threads, tile_cols, k_slices, transposed);
}

ffi::Error MatmulPacked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                        int64_t isa_cap, int64_t max_threads, int64_t tile_cols, int64_t k_slices) {
  return MatmulCore(pool, x, w, std::nullopt, std::nullopt, y, isa_cap, max_threads, tile_cols, k_slices,
                    /*transposed=*/false, /*packed=*/true);
}

ffi::Error MatmulQ8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                    ffi::Result<ffi::AnyBuffer> y, int64_t isa_cap, int64_t max_threads, int64_t tile_cols,
                    int64_t k_slices, int64_t x_block) {
  if (x_block <= 0) return ffi::Error::InvalidArgument("hj_matmul_q8: x_block must be positive");
  return MatmulCore(pool, x, w, scale, std::nullopt, y, isa_cap, max_threads, tile_cols, k_slices,
                    /*transposed=*/false, /*packed=*/true, x_block);
}

ffi::Error MatmulIndexed(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer index,
                         ffi::Result<ffi::AnyBuffer> y, int64_t isa_cap, int64_t max_threads,
                         int64_t tile_cols, int64_t k_slices, bool transposed) {
  return MatmulCore(pool, x, w, std::nullopt, index, y, isa_cap, max_threads, tile_cols, k_slices, transposed);
}

}  // namespace

// The symbols Python loads (the library is built with hidden visibility).
#define HJ_EXPORT extern "C" __attribute__((visibility("default")))
HJ_EXPORT XLA_FFI_Error* HjMatmul(XLA_FFI_CallFrame* call_frame);
HJ_EXPORT XLA_FFI_Error* HjMatmulIndexed(XLA_FFI_CallFrame* call_frame);
HJ_EXPORT XLA_FFI_Error* HjMatmulPacked(XLA_FFI_CallFrame* call_frame);
HJ_EXPORT XLA_FFI_Error* HjMatmulQ8(XLA_FFI_CallFrame* call_frame);
HJ_EXPORT int HjBestIsa();
HJ_EXPORT int64_t HjHelperItems();
HJ_EXPORT void HjSetAvx2PassRows(int pass_rows);
HJ_EXPORT int HjAvx2PassRows(int64_t k, int64_t n);
HJ_EXPORT uint64_t HjStreamRead(const void* p, int64_t bytes, int threads);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .OptionalArg<ffi::AnyBuffer>()  // scale (int8 only)
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("tile_cols")
                                  .Attr<int64_t>("k_slices")
                                  .Attr<bool>("transposed"));

int HjBestIsa() { return hj::BestIsa(); }
int64_t HjHelperItems() { return hj::helper_items.load(std::memory_order_relaxed); }

// Force the AVX2 float32 decode stream's weight rows per pass (4 or 8), or measure them
// again (0): every shape's trials start over.
void HjSetAvx2PassRows(int pass_rows) {
  std::lock_guard<std::mutex> lock(hj::trials_mu);
  hj::trials.clear();
  hj::forced_pass_rows.store(pass_rows, std::memory_order_relaxed);
}

// The weight rows per pass a [k, n] float32 weight takes there: 4 or 8 (the forced one, or the one
// chosen); 0 while still measuring, or for a shape not met.
int HjAvx2PassRows(int64_t k, int64_t n) {
  const int forced = hj::forced_pass_rows.load(std::memory_order_relaxed);
  if (forced) return forced;
  std::lock_guard<std::mutex> lock(hj::trials_mu);
  for (const hj::PassTrial& t : hj::trials)
    if (t.k == k && t.n == n) return t.chosen;
  return 0;
}

// A plain sequential read of `bytes` (the benchmarks' bandwidth reference): `threads` contiguous
// parts, each xor-folded 32 bytes at a time; returns the fold so the reads are not optimised out.
namespace hj {
#if HJ_X86
HJ_AVX2 uint64_t ReadPart(const char* p, int64_t bytes) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_xor_si256(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  uint64_t out[4];
  std::memcpy(out, &a, 32);
  for (; i < bytes; ++i) out[0] ^= uint8_t(p[i]);
  return out[0] ^ out[1] ^ out[2] ^ out[3];
}
#else
uint64_t ReadPart(const char* p, int64_t bytes) {
  uint64_t s = 0;
  for (int64_t i = 0; i < bytes; ++i) s ^= uint8_t(p[i]);
  return s;
}
#endif
}  // namespace hj

uint64_t HjStreamRead(const void* p, int64_t bytes, int threads) {
  if (threads < 1) threads = 1;
  const char* base = static_cast<const char*>(p);
  const int64_t part = (bytes / threads + 63) / 64 * 64;
  std::vector<uint64_t> folds(threads, 0);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    const int64_t b = t * part < bytes ? t * part : bytes, e = (t + 1) * part < bytes ? (t + 1) * part : bytes;
    pool.emplace_back([&folds, base, b, e, t] { folds[t] = hj::ReadPart(base + b, e - b); });
  }
  folds[0] = hj::ReadPart(base, part < bytes ? part : bytes);
  for (auto& th : pool) th.join();
  uint64_t s = 0;
  for (uint64_t f : folds) s ^= f;
  return s;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjMatmulIndexed, MatmulIndexed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [B, R, K]
                                  .Arg<ffi::AnyBuffer>()  // w [E, K, N] (or [E, N, K])
                                  .Arg<ffi::AnyBuffer>()  // index [B] int32
                                  .Ret<ffi::AnyBuffer>()  // y [B, R, N]
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("tile_cols")
                                  .Attr<int64_t>("k_slices")
                                  .Attr<bool>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjMatmulPacked, MatmulPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., R, K]
                                  .Arg<ffi::AnyBuffer>()  // w bf16 [..., ceil(N / 32), ceil(K / 2) * 64]
                                  .Ret<ffi::AnyBuffer>()  // y [..., R, N]
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("tile_cols")
                                  .Attr<int64_t>("k_slices"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjMatmulQ8, MatmulQ8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., R, K]
                                  .Arg<ffi::AnyBuffer>()  // w int8 [..., ceil(N / 32), ceil(K / 4) * 128]
                                  .Arg<ffi::AnyBuffer>()  // w's block scales [..., ceil(N / 32), blocks * 32]
                                  .Ret<ffi::AnyBuffer>()  // y [..., R, N]
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("tile_cols")
                                  .Attr<int64_t>("k_slices")
                                  .Attr<int64_t>("x_block"));
