// The crossbar's reads as AVX-512 VNNI / BF16 XLA FFI custom calls (sidra_core/vnni.py builds and
// registers them). XLA:CPU's int8 dot runs at its float32 speed on hosts without AMX, while
// vpdpbusd does 64 int8 MACs an instruction: 4x the float32 FMA rate.
//
// Per 256-row tile, for each input row and tile column:
//   p = sum_k x_k w_k   (x: INT8 DAC codes, w: int8 whole codes [+ int8 fractions / 254])
//   v = sum_k x_k^2 s_k (x^2 and the cell variances s in bfloat16, float32 sums)
// vpdpbusd multiplies unsigned by signed bytes, so the inputs come as x + 128 and each column
// subtracts 128 sum_k w_k (precomputed). Integer sums are exact: |sum| <= 256 * 255 * 127 < 2^31.
// sidra_tile_dots returns p and v of every tile; sidra_tile_read goes on while they are in L1:
// read noise sqrt(v) z (z: sidra_core.rng.box_muller's draw, bit for bit), the ADC, the tile sum,
// so one MVM writes its (rows, N) result instead of 2 x grid_k arrays of that size for XLA to
// read back (256 x 1024 x 1024: 4.3 -> 3.8 ms).
//
// Layouts (vnni.py packs them): xu uint8 (rows, Kp), x2 bf16 (rows, Kp), Kp = grid_k * 256;
// w int8 (grid_k, NV, T, 64, 16, 4): 16-column vectors, T terms (whole[, fraction]), 4 word lines
// per 32-bit lane; corr int32 (grid_k, NV, T, 16); s bf16 (grid_k, NV, 128, 16, 2);
// outputs p, v float32 (grid_k, rows, N); y float32 (rows, N).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTileRows = 256;
constexpr int kLanes = 16;      // float32 / int32 lanes of a 512-bit vector
constexpr int kPanel = 4;       // vectors (64 columns) per work item
constexpr int kMaxRows = 6;     // rows per register block: 6 x 4 accumulators + 4 weights + 1 input
constexpr int kGroupBytes = 64; // one vector's weights for 4 word lines (int8) or 2 (bf16)

// The dot instructions as inline assembly: GCC 12 compiles their intrinsics with a register copy
// and a stack store per instruction (the accumulator is an input of the builtin, not tied to
// its output), which ran the kernel at a third of the instructions' rate.
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}
inline void dpbf16(__m512& acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

inline __mmask16 column_mask(int valid) {
  return valid >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
}

// MR rows x NV vectors of one tile's partial sums, T terms per vector.
template <int MR, int NV, int T>
void signal_block(const uint8_t* x, int64_t ldx, const int8_t* w, const int32_t* corr, int groups,
                  float* out, int64_t ldo, int valid_cols) {
  constexpr int J = NV * T;
  constexpr int64_t kVecBytes = (kTileRows / 4) * kGroupBytes;  // one (vector, term) over the tile
  __m512i acc[MR][J];
  #pragma GCC unroll 32
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 32
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int g = 0; g < groups; ++g) {
    __m512i b[J];
    #pragma GCC unroll 32
    for (int j = 0; j < J; ++j) b[j] = _mm512_loadu_si512(w + j * kVecBytes + g * kGroupBytes);
    #pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      __builtin_memcpy(&four, x + r * ldx + 4 * g, 4);
      const __m512i a = _mm512_set1_epi32(four);
      #pragma GCC unroll 32
      for (int j = 0; j < J; ++j) dpbusd(acc[r][j], a, b[j]);
    }
  }
  const __m512 step = _mm512_set1_ps(1.0f / 254.0f);
  #pragma GCC unroll 32
  for (int v = 0; v < NV; ++v) {
    const __mmask16 m = column_mask(valid_cols - v * kLanes);
    const __m512i c0 = _mm512_loadu_si512(corr + (v * T) * kLanes);
    #pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v * T], c0));
      if constexpr (T == 2) {
        const __m512i c1 = _mm512_loadu_si512(corr + (v * T + 1) * kLanes);
        // whole + fraction / 254, as a product then a sum (the XLA path's rounding)
        const __m512 frac = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v * T + 1], c1)), step);
        f = _mm512_add_ps(f, frac);
      }
      _mm512_mask_storeu_ps(out + r * ldo + v * kLanes, m, f);
    }
  }
}

// MR rows x NV vectors of one tile's read-noise variances.
template <int MR, int NV>
void variance_block(const uint16_t* x2, int64_t ldx, const uint16_t* s, int pairs, float* out, int64_t ldo,
                    int valid_cols) {
  constexpr int64_t kVecElems = (kTileRows / 2) * (kGroupBytes / 2);  // bf16 elements of one vector
  __m512 acc[MR][NV];
  #pragma GCC unroll 32
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 32
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int g = 0; g < pairs; ++g) {
    __m512i b[NV];
    #pragma GCC unroll 32
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_si512(s + j * kVecElems + g * (kGroupBytes / 2));
    #pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      int32_t two;
      __builtin_memcpy(&two, x2 + r * ldx + 2 * g, 4);
      const __m512i a = _mm512_set1_epi32(two);
      #pragma GCC unroll 32
      for (int j = 0; j < NV; ++j) dpbf16(acc[r][j], a, b[j]);
    }
  }
  #pragma GCC unroll 32
  for (int j = 0; j < NV; ++j) {
    const __mmask16 m = column_mask(valid_cols - j * kLanes);
    #pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo + j * kLanes, m, acc[r][j]);
  }
}

// Row blocks of kMaxRows, then the remainder, for a fixed vector count.
template <int NV, int T>
void signal_rows(int64_t rows, const uint8_t* x, int64_t ldx, const int8_t* w, const int32_t* corr, int groups,
                 float* out, int64_t ldo, int valid_cols) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    signal_block<kMaxRows, NV, T>(x + r * ldx, ldx, w, corr, groups, out + r * ldo, ldo, valid_cols);
  const auto* xr = x + r * ldx;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 1: signal_block<1, NV, T>(xr, ldx, w, corr, groups, o, ldo, valid_cols); break;
    case 2: signal_block<2, NV, T>(xr, ldx, w, corr, groups, o, ldo, valid_cols); break;
    case 3: signal_block<3, NV, T>(xr, ldx, w, corr, groups, o, ldo, valid_cols); break;
    case 4: signal_block<4, NV, T>(xr, ldx, w, corr, groups, o, ldo, valid_cols); break;
    case 5: signal_block<5, NV, T>(xr, ldx, w, corr, groups, o, ldo, valid_cols); break;
    default: break;
  }
}

template <int NV>
void variance_rows(int64_t rows, const uint16_t* x2, int64_t ldx, const uint16_t* s, int pairs, float* out,
                   int64_t ldo, int valid_cols) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    variance_block<kMaxRows, NV>(x2 + r * ldx, ldx, s, pairs, out + r * ldo, ldo, valid_cols);
  const auto* xr = x2 + r * ldx;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 1: variance_block<1, NV>(xr, ldx, s, pairs, o, ldo, valid_cols); break;
    case 2: variance_block<2, NV>(xr, ldx, s, pairs, o, ldo, valid_cols); break;
    case 3: variance_block<3, NV>(xr, ldx, s, pairs, o, ldo, valid_cols); break;
    case 4: variance_block<4, NV>(xr, ldx, s, pairs, o, ldo, valid_cols); break;
    case 5: variance_block<5, NV>(xr, ldx, s, pairs, o, ldo, valid_cols); break;
    default: break;
  }
}

struct Problem {
  const uint8_t* xu;
  const uint16_t* x2;  // null: no read noise
  const int8_t* w;
  const int32_t* corr;
  const uint16_t* s;
  int64_t rows, k, n, grid_k, nv, kp;
  int terms;
};

// One tile's partial sums (and variances, to v unless null) of one 64-column panel (vectors v0..)
// for `nrows` input rows from row0, written with leading dimension ldo.
void panel_dots(const Problem& q, int64_t tile, int64_t v0, int64_t row0, int64_t nrows, float* p, float* v,
                int64_t ldo) {
  const int64_t used = std::min<int64_t>(kTileRows, q.k - tile * kTileRows);
  const int groups = static_cast<int>((used + 3) / 4), pairs = static_cast<int>((used + 1) / 2);
  const int64_t col0 = v0 * kLanes;
  const uint8_t* x = q.xu + row0 * q.kp + tile * kTileRows;
  const int64_t vec_bytes = int64_t{kTileRows / 4} * kGroupBytes;
  // signal: kPanel / terms vectors at a time (4 accumulators per row)
  const int step = q.terms == 2 ? 2 : 4;
  for (int64_t vv = v0; vv < std::min(q.nv, v0 + kPanel); vv += step) {
    const int nvb = static_cast<int>(std::min<int64_t>(step, q.nv - vv));
    const int valid = static_cast<int>(std::min<int64_t>(nvb * kLanes, q.n - vv * kLanes));
    const int8_t* w = q.w + (tile * q.nv + vv) * q.terms * vec_bytes;
    const int32_t* c = q.corr + (tile * q.nv + vv) * q.terms * kLanes;
    float* o = p + (vv - v0) * kLanes;
    if (q.terms == 2) {
      if (nvb == 2) signal_rows<2, 2>(nrows, x, q.kp, w, c, groups, o, ldo, valid);
      else signal_rows<1, 2>(nrows, x, q.kp, w, c, groups, o, ldo, valid);
    } else {
      switch (nvb) {
        case 4: signal_rows<4, 1>(nrows, x, q.kp, w, c, groups, o, ldo, valid); break;
        case 3: signal_rows<3, 1>(nrows, x, q.kp, w, c, groups, o, ldo, valid); break;
        case 2: signal_rows<2, 1>(nrows, x, q.kp, w, c, groups, o, ldo, valid); break;
        default: signal_rows<1, 1>(nrows, x, q.kp, w, c, groups, o, ldo, valid); break;
      }
    }
  }
  if (q.x2 == nullptr || v == nullptr) return;
  const int nvb = static_cast<int>(std::min<int64_t>(kPanel, q.nv - v0));
  const int valid = static_cast<int>(std::min<int64_t>(nvb * kLanes, q.n - col0));
  const uint16_t* x2 = q.x2 + row0 * q.kp + tile * kTileRows;
  const uint16_t* s = q.s + (tile * q.nv + v0) * (kTileRows / 2) * (kGroupBytes / 2);
  switch (nvb) {
    case 4: variance_rows<4>(nrows, x2, q.kp, s, pairs, v, ldo, valid); break;
    case 3: variance_rows<3>(nrows, x2, q.kp, s, pairs, v, ldo, valid); break;
    case 2: variance_rows<2>(nrows, x2, q.kp, s, pairs, v, ldo, valid); break;
    default: variance_rows<1>(nrows, x2, q.kp, s, pairs, v, ldo, valid); break;
  }
}

// sidra_core.rng.box_muller for 16 counters, operation for operation as XLA:CPU compiles it (LLVM
// contracts each product feeding a sum into one FMA), so both give the same bits.
inline __m512i mix32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

inline __m512 uniform_bits(__m512i b) {  // ((b >> 9) + 0.5) / 2^23, in (0, 1)
  return _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 9)), _mm512_set1_ps(0.5f)),
                       _mm512_set1_ps(1.0f / (1 << 23)));
}

constexpr float kLog[] = {-0.0064535442f, 0.0360884937f, -0.0953293897f, 0.1676540711f, -0.2407338084f,
                          0.3317990258f, -0.4998741238f, 0.9999964239f};
// sin(a) / a and cos(a) Taylor coefficients, highest order first, rounded from double as
// rng._SIN and rng._COS are
constexpr float kSin[] = {static_cast<float>(-1.0 / 39916800), static_cast<float>(1.0 / 362880),
                          static_cast<float>(-1.0 / 5040), static_cast<float>(1.0 / 120),
                          static_cast<float>(-1.0 / 6), 1.0f};
constexpr float kCos[] = {static_cast<float>(1.0 / 479001600), static_cast<float>(-1.0 / 3628800),
                          static_cast<float>(1.0 / 40320), static_cast<float>(-1.0 / 720),
                          static_cast<float>(1.0 / 24), -0.5f, 1.0f};

inline void box_muller(__m512i seed, __m512i counter, __m512& z0, __m512& z1) {
  const __m512i h = _mm512_xor_si512(_mm512_mullo_epi32(counter, _mm512_set1_epi32(static_cast<int>(0x9E3779B9u))),
                                     seed);
  const __m512i b = mix32(_mm512_add_epi32(mix32(h), _mm512_xor_si512(seed, _mm512_set1_epi32(0x68E31DA4))));
  // r = sqrt(-2 log u1), the log from the exponent and a polynomial of the mantissa
  const __m512i ub = _mm512_castps_si512(uniform_bits(b));
  const __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(ub, 23), _mm512_set1_epi32(0xFF)),
                                                       _mm512_set1_epi32(127)));
  const __m512 t = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(ub, _mm512_set1_epi32(0x7FFFFF)),
                                                                     _mm512_set1_epi32(0x3F800000))),
                                 _mm512_set1_ps(1.0f));
  __m512 p = _mm512_set1_ps(kLog[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kLog[i]));
  const __m512 lg = _mm512_fmadd_ps(e, _mm512_set1_ps(0.6931471805599453f), _mm512_mul_ps(p, t));
  const __m512 r = _mm512_sqrt_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), lg));
  // the angle 2 pi t from re-mixed bits; sine and cosine of its half by the double-angle formulas
  const __m512i b2 = mix32(_mm512_xor_si512(b, _mm512_set1_epi32(0x5BD1E995)));
  const __m512 a = _mm512_mul_ps(_mm512_set1_ps(3.14159265358979f),
                                 _mm512_sub_ps(uniform_bits(b2), _mm512_set1_ps(0.5f)));
  const __m512 a2 = _mm512_mul_ps(a, a);
  __m512 ps = _mm512_set1_ps(kSin[0]), pc = _mm512_set1_ps(kCos[0]);
  for (int i = 1; i < 6; ++i) ps = _mm512_fmadd_ps(ps, a2, _mm512_set1_ps(kSin[i]));
  for (int i = 1; i < 7; ++i) pc = _mm512_fmadd_ps(pc, a2, _mm512_set1_ps(kCos[i]));
  const __m512 sn = _mm512_mul_ps(a, ps);
  z0 = _mm512_mul_ps(r, _mm512_fmadd_ps(pc, pc, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(sn, sn))));
  z1 = _mm512_mul_ps(r, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), sn), pc));
}

struct Job {
  Problem q;
  float* p = nullptr;  // TileDots: every tile's sums and variances (grid_k, rows, N)
  float* v = nullptr;
  float* y = nullptr;  // TileRead: the tile sum after noise and ADC (rows, N)
  const float* lsb = nullptr;   // (grid_k, N) or null: no ADC
  const float* gain = nullptr;  // (grid_k, N) or null
  uint32_t seed = 0;
  float qmax = 0;
  int64_t panels = 0, blocks = 0;
};

constexpr int64_t kReadRows = 24;  // rows of one read work item: its tile's sums stay in L1

// TileDots' work item: one tile's 64-column panel for all rows.
void dots_item(const Job& j, int64_t item) {
  const Problem& q = j.q;
  const int64_t tile = item / j.panels, v0 = (item % j.panels) * kPanel;
  const int64_t off = tile * q.rows * q.n + v0 * kLanes;
  panel_dots(q, tile, v0, 0, q.rows, j.p + off, q.x2 ? j.v + off : nullptr, q.n);
}

// TileRead's work item: a 64-column panel of kReadRows rows through every tile: partial sums,
// read noise (the Box-Muller pair of tiles 2m and 2m + 1 drawn once), ADC and the digital sum,
// in the order of sidra_core.crossbar.mvm's XLA path.
void read_item(const Job& j, int64_t item) {
  const Problem& q = j.q;
  const int64_t v0 = (item / j.blocks) * kPanel, row0 = (item % j.blocks) * kReadRows;
  const int64_t nrows = std::min(kReadRows, q.rows - row0);
  const int nvb = static_cast<int>(std::min<int64_t>(kPanel, q.nv - v0));
  const int64_t col0 = v0 * kLanes;
  constexpr int kW = kPanel * kLanes;
  alignas(64) float p[kReadRows * kW], v[kReadRows * kW], z1[kReadRows * kW], y[kReadRows * kW];
  if (q.n - col0 < kW) {  // a panel past the last column: its dead lanes hold zeros, not stack garbage
    std::fill(p, p + kReadRows * kW, 0.0f);
    std::fill(v, v + kReadRows * kW, 0.0f);
  }
  const bool noise = q.x2 != nullptr;
  const __m512i seed = _mm512_set1_epi32(static_cast<int>(j.seed));
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 qmax = _mm512_set1_ps(j.qmax), qmin = _mm512_set1_ps(-j.qmax);
  for (int64_t tile = 0; tile < q.grid_k; ++tile) {
    panel_dots(q, tile, v0, row0, nrows, p, noise ? v : nullptr, kW);
    // counters as the XLA path's: row-major over (rows, N) per tile pair, wrapping in uint32
    const uint32_t base = static_cast<uint32_t>(tile / 2) * static_cast<uint32_t>(q.rows) * static_cast<uint32_t>(q.n);
    for (int vec = 0; vec < nvb; ++vec) {
      const int64_t c = col0 + vec * kLanes;
      const __mmask16 m = column_mask(static_cast<int>(q.n - c));
      const __m512 lsb = j.lsb ? _mm512_maskz_loadu_ps(m, j.lsb + tile * q.n + c) : _mm512_setzero_ps();
      const __m512 gain = j.gain ? _mm512_maskz_loadu_ps(m, j.gain + tile * q.n + c) : _mm512_setzero_ps();
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t at = r * kW + vec * kLanes;
        __m512 s = _mm512_load_ps(p + at);
        if (noise) {
          __m512 z;
          if (tile % 2 == 0) {
            const uint32_t first = base + static_cast<uint32_t>((row0 + r) * q.n + c);
            __m512 other;
            box_muller(seed, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)), lane), z, other);
            _mm512_store_ps(z1 + at, other);
          } else {
            z = _mm512_load_ps(z1 + at);
          }
          s = _mm512_fmadd_ps(_mm512_sqrt_ps(_mm512_load_ps(v + at)), z, s);
        }
        // the ADC: round half to even, clip to +-qmax codes, back to the step (XLA's order)
        __m512 codes = s, step = _mm512_set1_ps(1.0f);
        if (j.lsb) {
          codes = _mm512_min_ps(_mm512_max_ps(
              _mm512_roundscale_ps(_mm512_div_ps(s, lsb), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), qmin), qmax);
          step = lsb;
        }
        if (j.gain) {
          codes = j.lsb ? _mm512_mul_ps(codes, lsb) : codes;
          step = gain;
        }
        __m512 out;
        if (!j.lsb && !j.gain) out = tile == 0 ? s : _mm512_add_ps(_mm512_load_ps(y + at), s);
        else out = tile == 0 ? _mm512_mul_ps(codes, step) : _mm512_fmadd_ps(codes, step, _mm512_load_ps(y + at));
        _mm512_store_ps(y + at, out);
      }
    }
  }
  for (int64_t r = 0; r < nrows; ++r)
    for (int vec = 0; vec < nvb; ++vec) {
      const int64_t c = col0 + vec * kLanes;
      _mm512_mask_storeu_ps(j.y + (row0 + r) * q.n + c, column_mask(static_cast<int>(q.n - c)),
                            _mm512_load_ps(y + r * kW + vec * kLanes));
    }
}

// Items are taken from a shared counter by the caller and the helper threads. The caller waits
// only for items in progress: a helper that comes late finds none and drops the job.
struct Work {
  Job job;
  void (*item)(const Job&, int64_t);
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  void drain(bool helper = false);
};

// Calls running now. XLA runs independent thunks at once, one per core of its own pool: while
// more than one call runs, the callers already use the cores and a helper steps back (three
// threads on two cores made each call wait for a descheduled one: MVM programs 10-40 % slower).
std::atomic<int> g_active{0};

void Work::drain(bool helper) {
  for (;;) {
    if (helper && g_active.load(std::memory_order_relaxed) > 1) return;
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    if (i >= items) return;
    item(job, i);
    done.fetch_add(1, std::memory_order_release);
  }
}

// The kernel's own helper threads (one fewer than the CPUs this process may use). XLA's
// intra-op pool took ~3 ms to start a task scheduled from the calling thread on this VM; a
// condition variable wakes a helper in tens of microseconds. Several calls may run at once
// (XLA runs independent thunks in parallel): every queued job is open to every helper.
class Helpers {
 public:
  static Helpers& get() {
    static Helpers* h = new Helpers();  // never destroyed: detached threads outlive static teardown
    return *h;
  }
  int count() const { return static_cast<int>(threads_); }
  // A call ended: helpers that stepped back for it may go on (the lock orders this wake-up
  // after their check of g_active).
  void wake() {
    { std::lock_guard<std::mutex> l(m_); }
    cv_.notify_all();
  }
  void run(const std::shared_ptr<Work>& w) {
    {
      std::lock_guard<std::mutex> l(m_);
      jobs_.push_back(w);
    }
    cv_.notify_all();
    w->drain();
    retire(w);
    // Until a helper finishes this job's last items: other calls' items (XLA may run several
    // at once), else give the core away. A caller that spun instead held a core the helper
    // it waited for needed when more threads than cores were busy (VM scheduling: ms-long waits).
    while (w->done.load(std::memory_order_acquire) < w->items) {
      std::shared_ptr<Work> other = queued();
      if (other) {
        other->drain();
        retire(other);
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  Helpers() {
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    threads_ = std::max(0, cpus - 1);
    for (unsigned t = 0; t < threads_; ++t) std::thread([this] { loop(); }).detach();
  }
  std::shared_ptr<Work> queued() {
    std::lock_guard<std::mutex> l(m_);
    return jobs_.empty() ? nullptr : jobs_.back();
  }
  void retire(const std::shared_ptr<Work>& w) {
    std::lock_guard<std::mutex> l(m_);
    jobs_.erase(std::remove(jobs_.begin(), jobs_.end(), w), jobs_.end());
  }
  void loop() {
    for (;;) {
      std::shared_ptr<Work> w;
      {
        std::unique_lock<std::mutex> l(m_);
        cv_.wait(l, [this] { return !jobs_.empty() && g_active.load(std::memory_order_relaxed) <= 1; });
        w = jobs_.back();
      }
      w->drain(true);
      if (w->next.load(std::memory_order_relaxed) >= w->items) retire(w);
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Work>> jobs_;
  unsigned threads_ = 0;
};

// Below this many MACs a call runs on the calling thread alone: waking a helper costs more.
constexpr int64_t kParallelMacs = int64_t{1} << 22;

// The operands common to both calls, checked; false: not the layout vnni.py packs.
bool problem(ffi::Buffer<ffi::U8>& xu, ffi::Buffer<ffi::BF16>& x2, ffi::Buffer<ffi::S8>& w,
             ffi::Buffer<ffi::S32>& corr, ffi::Buffer<ffi::BF16>& s, int64_t k, int64_t n, int64_t terms,
             int64_t noise, Problem& q) {
  const auto xd = xu.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 6 || (terms != 1 && terms != 2) || wd[2] != terms) return false;
  q = Problem{xu.typed_data(),
              noise ? reinterpret_cast<const uint16_t*>(x2.typed_data()) : nullptr,
              w.typed_data(),
              corr.typed_data(),
              reinterpret_cast<const uint16_t*>(s.typed_data()),
              xd[0], k, n, wd[0], wd[1], xd[1], static_cast<int>(terms)};
  return true;
}

// All items of a job, shared with the helpers when it is large enough to pay for waking them.
void execute(const std::shared_ptr<Work>& work) {
  const Problem& q = work->job.q;
  if (q.rows == 0 || work->items == 0) return;
  const int64_t macs = q.rows * q.k * q.n * (q.terms + (q.x2 ? 2 : 0));
  const bool alone = g_active.fetch_add(1, std::memory_order_relaxed) == 0;
  if (alone && work->items > 1 && macs >= kParallelMacs && Helpers::get().count() > 0) {
    Helpers::get().run(work);
  } else {
    work->drain();
  }
  if (g_active.fetch_sub(1, std::memory_order_relaxed) == 2 && Helpers::get().count() > 0) Helpers::get().wake();
}

ffi::Error TileDots(ffi::Buffer<ffi::U8> xu, ffi::Buffer<ffi::BF16> x2, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::S32> corr, ffi::Buffer<ffi::BF16> s, int64_t k, int64_t n, int64_t terms,
                    int64_t noise, ffi::ResultBuffer<ffi::F32> p, ffi::ResultBuffer<ffi::F32> v) {
  auto work = std::make_shared<Work>();
  Job& j = work->job;
  if (!problem(xu, x2, w, corr, s, k, n, terms, noise, j.q))
    return ffi::Error::InvalidArgument("sidra_tile_dots: unexpected operand layout");
  j.p = p->typed_data();
  j.v = v->typed_data();
  j.panels = (j.q.nv + kPanel - 1) / kPanel;
  work->item = dots_item;
  work->items = j.q.grid_k * j.panels;
  execute(work);
  return ffi::Error::Success();
}

// The whole read but the DAC and the dequantisation: y (rows, N) = sum over tiles of
// ADC(p + sqrt(v) z) (the ADC only with `lsb`, the gain only with `gain`; both (grid_k, N) or empty).
ffi::Error TileRead(ffi::Buffer<ffi::U8> xu, ffi::Buffer<ffi::BF16> x2, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::S32> corr, ffi::Buffer<ffi::BF16> s, ffi::Buffer<ffi::F32> lsb,
                    ffi::Buffer<ffi::F32> gain, ffi::Buffer<ffi::U32> seed, int64_t k, int64_t n, int64_t terms,
                    int64_t noise, float qmax, ffi::ResultBuffer<ffi::F32> y) {
  auto work = std::make_shared<Work>();
  Job& j = work->job;
  if (!problem(xu, x2, w, corr, s, k, n, terms, noise, j.q) || seed.element_count() != 1)
    return ffi::Error::InvalidArgument("sidra_tile_read: unexpected operand layout");
  j.y = y->typed_data();
  j.lsb = lsb.element_count() ? lsb.typed_data() : nullptr;
  j.gain = gain.element_count() ? gain.typed_data() : nullptr;
  j.seed = seed.typed_data()[0];
  j.qmax = qmax;
  j.panels = (j.q.nv + kPanel - 1) / kPanel;
  j.blocks = (j.q.rows + kReadRows - 1) / kReadRows;
  work->item = read_item;
  work->items = j.panels * j.blocks;
  execute(work);
  return ffi::Error::Success();
}

// The layouts above from per-tile arrays: w int8 (grid_k, 256, T N), s bf16 (grid_k, 256, N) (empty
// without read noise). Word lines past K and columns past N are zeros; corr = 128 sum_k w.
ffi::Error PackTiles(ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::BF16> s, int64_t k, int64_t terms, int64_t noise,
                     ffi::ResultBuffer<ffi::S8> wp, ffi::ResultBuffer<ffi::S32> corr,
                     ffi::ResultBuffer<ffi::BF16> sp) {
  const auto wd = w.dimensions();
  const auto pd = wp->dimensions();
  if (wd.size() != 3 || wd[1] != kTileRows || pd.size() != 6 || pd[2] != terms)
    return ffi::Error::InvalidArgument("sidra_pack_tiles: unexpected operand layout");
  const int64_t gk = wd[0], n = wd[2] / terms, nv = pd[1], ld = wd[2];
  const int8_t* src = w.typed_data();
  int8_t* dst = wp->typed_data();
  int32_t* c = corr->typed_data();
  // 16 columns of 4 word lines: each row's bytes widened to 32-bit lanes and shifted into place
  // (one 64-byte store per group); rows past K and columns past N load as zeros.
  for (int64_t tile = 0; tile < gk; ++tile) {
    const int64_t live = std::clamp<int64_t>(k - tile * kTileRows, 0, kTileRows);
    for (int64_t v = 0; v < nv; ++v) {
      const __mmask16 m = column_mask(static_cast<int>(n - v * kLanes));
      for (int64_t t = 0; t < terms; ++t) {
        const int8_t* col = src + tile * kTileRows * ld + t * n + v * kLanes;
        __m512i sum = _mm512_setzero_si512();
        for (int64_t row = 0; row < kTileRows; row += 4, dst += kGroupBytes) {
          __m512i word = _mm512_setzero_si512();
          for (int j = 0; j < 4; ++j) {
            const __m128i b = row + j < live ? _mm_maskz_loadu_epi8(m, col + (row + j) * ld) : _mm_setzero_si128();
            sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(b));
            word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 8 * j));
          }
          _mm512_storeu_si512(dst, word);
        }
        _mm512_storeu_si512(c, _mm512_slli_epi32(sum, 7));  // 128 sum_k w
        c += kLanes;
      }
    }
  }
  if (!noise) return ffi::Error::Success();
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(s.typed_data());
  uint16_t* vd = reinterpret_cast<uint16_t*>(sp->typed_data());
  for (int64_t tile = 0; tile < gk; ++tile) {
    const int64_t live = std::clamp<int64_t>(k - tile * kTileRows, 0, kTileRows);
    for (int64_t v = 0; v < nv; ++v) {
      const __mmask16 m = column_mask(static_cast<int>(n - v * kLanes));
      const uint16_t* col = vs + tile * kTileRows * n + v * kLanes;
      for (int64_t row = 0; row < kTileRows; row += 2, vd += kGroupBytes / 2) {
        const __m256i lo = row < live ? _mm256_maskz_loadu_epi16(m, col + row * n) : _mm256_setzero_si256();
        const __m256i hi = row + 1 < live ? _mm256_maskz_loadu_epi16(m, col + (row + 1) * n) : _mm256_setzero_si256();
        _mm512_storeu_si512(vd, _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                                _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
      }
    }
  }
  return ffi::Error::Success();
}

// The operands of both dot kernels (xu, x2, w, corr, s; see `problem`).
auto DotOperands() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::S8>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::BF16>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraPackTiles, PackTiles,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("terms")
                                  .Attr<int64_t>("noise")
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraTileDots, TileDots,
                              DotOperands()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("terms")
                                  .Attr<int64_t>("noise")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraTileRead, TileRead,
                              DotOperands()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("terms")
                                  .Attr<int64_t>("noise")
                                  .Attr<float>("qmax")
                                  .Ret<ffi::Buffer<ffi::F32>>());
