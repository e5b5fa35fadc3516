// The crossbar's reads as AVX-512 VNNI / BF16 XLA FFI custom calls (sidra_core/vnni.py builds and
// registers them). XLA:CPU's int8 dot runs at its float32 speed on hosts without AMX, while
// vpdpbusd does 64 int8 MACs an instruction: 4x the float32 FMA rate.
//
// Per 256-row tile, for each input row and tile column:
//   p = sum_k x_k w_k   (x: INT8 DAC codes, w: int8 whole codes [+ int8 fractions / 254])
//   v = (sum_k hi_k s_k x 128 + sum_k lo_k s_k) x step (x^2 = 128 hi + lo in two 7-bit halves, s the
//       cells' variances as integer levels 0..255 of a step per tile column: exact int32 sums, as
//       sidra_core.crossbar._variance's exact float32 ones, so both give the same bits)
// vpdpbusd multiplies unsigned by signed bytes, so the inputs come as x + 128 and each column
// subtracts 128 sum_k w_k (precomputed). Integer sums are exact: |sum| <= 256 * 255 * 127 < 2^31.
// sidra_tile_dots returns p and v of every tile; sidra_mvm is the whole MVM: the DAC of the float
// inputs, then while p and v are in L1, read noise sqrt(v) z (z: sidra_core.rng.box_muller's
// draw, bit for bit), the ADC, the tile sum and the dequantisation, so one MVM reads its float
// inputs and writes its (rows, N) result once (the XLA path runs the DAC and the dequantisation
// as passes of their own).
// sidra_mvm_direct is the same MVM called on host buffers outside XLA (eager reads: any row count,
// no program). sidra_ispp_write is ISPP write-verify (sidra_core.ispp) with sidra_core.rng's draws,
// cell by cell; sidra_program writes a fresh weight's cells whole (stuck map, targets, ISPP, drift
// exponents) and sidra_drift_exponents draws rewritten cells' exponents;
// sidra_snapshot reads a programmed weight into the packed layout below (crossbar._read_array).
//
// Layouts (vnni.py packs them): xu uint8 (rows, Kp), x2 uint8 (rows, 2, Kp): hi then lo, Kp = grid_k * 256
// (the dots' inputs; sidra_mvm makes them from x float32 (rows, K));
// w int8 (grid_k, NV, T, 64, 16, 4): 16-column vectors, T terms (whole[, fraction]), 4 word lines
// per 32-bit lane; corr int32 (grid_k, NV, T, 16); s uint8 (grid_k, NV, 64, 16, 4) as w; step f32 (grid_k, N);
// outputs p, v float32 (grid_k, rows, N); y float32 (rows, N).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <condition_variable>
#include <functional>
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
constexpr int kGroupBytes = 64; // one vector's weights (or variance levels) for 4 word lines
constexpr int kException = -128;  // cells.EXCEPTION: a residual whose cell keeps its exact level

// The dot instruction as inline assembly: GCC 12 compiles its intrinsic with a register copy
// and a stack store per instruction (the accumulator is an input of the builtin, not tied to
// its output), well below the instructions' rate.
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

inline __mmask16 column_mask(int valid) {
  return valid >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
}

// MR rows x NV vectors of one tile's partial sums, T terms per vector.
// w holds one (vector, term) every vec_bytes (a tile's: 64 groups of 64 bytes). Never inlined:
// inside a large caller GCC kept the accumulators on the stack.
template <int MR, int NV, int T>
__attribute__((noinline)) void signal_block(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t vec_bytes, const int32_t* corr,
                  int groups, float* out, int64_t ldo, int valid_cols) {
  constexpr int J = NV * T;
  __m512i acc[MR][J];
  #pragma GCC unroll 32
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 32
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int g = 0; g < groups; ++g) {
    __m512i b[J];
    #pragma GCC unroll 32
    for (int j = 0; j < J; ++j) b[j] = _mm512_loadu_si512(w + j * vec_bytes + g * kGroupBytes);
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

// MR rows x NV vectors of one tile's read-noise variances: each row's x^2 halves (hi at x2, lo at
// x2 + lo_off) against the levels s (the unsigned operand: 0..255), then (hi sum x 128 + lo sum) x
// step in float32 (the XLA path's operations: both sums are exact integers below 2^24).
template <int MR, int NV>
__attribute__((noinline)) void variance_block(const uint8_t* x2, int64_t ldx, int64_t lo_off, const uint8_t* s,
                                              int groups, const float* step, float* out, int64_t ldo, int valid_cols) {
  constexpr int64_t kVecBytes = int64_t{kTileRows / 4} * kGroupBytes;  // one vector's levels in a tile
  __m512i hi[MR][NV], lo[MR][NV];
  #pragma GCC unroll 32
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 32
    for (int j = 0; j < NV; ++j) hi[r][j] = lo[r][j] = _mm512_setzero_si512();
  for (int g = 0; g < groups; ++g) {
    __m512i b[NV];
    #pragma GCC unroll 32
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_si512(s + j * kVecBytes + g * kGroupBytes);
    #pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      int32_t h, l;
      __builtin_memcpy(&h, x2 + r * ldx + 4 * g, 4);
      __builtin_memcpy(&l, x2 + r * ldx + lo_off + 4 * g, 4);
      const __m512i ah = _mm512_set1_epi32(h), al = _mm512_set1_epi32(l);
      #pragma GCC unroll 32
      for (int j = 0; j < NV; ++j) {
        dpbusd(hi[r][j], b[j], ah);
        dpbusd(lo[r][j], b[j], al);
      }
    }
  }
  #pragma GCC unroll 32
  for (int j = 0; j < NV; ++j) {
    const __mmask16 m = column_mask(valid_cols - j * kLanes);
    const __m512 st = _mm512_maskz_loadu_ps(m, step + j * kLanes);
    #pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi[r][j]), _mm512_set1_ps(128.0f)),
                                       _mm512_cvtepi32_ps(lo[r][j]));
      _mm512_mask_storeu_ps(out + r * ldo + j * kLanes, m, _mm512_mul_ps(sum, st));
    }
  }
}

// Row blocks of kMaxRows, then the remainder, for a fixed vector count.
template <int NV, int T>
void signal_rows(int64_t rows, const uint8_t* x, int64_t ldx, const int8_t* w, int64_t vec_bytes, const int32_t* corr,
                 int groups, float* out, int64_t ldo, int valid_cols) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    signal_block<kMaxRows, NV, T>(x + r * ldx, ldx, w, vec_bytes, corr, groups, out + r * ldo, ldo, valid_cols);
  const auto* xr = x + r * ldx;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 1: signal_block<1, NV, T>(xr, ldx, w, vec_bytes, corr, groups, o, ldo, valid_cols); break;
    case 2: signal_block<2, NV, T>(xr, ldx, w, vec_bytes, corr, groups, o, ldo, valid_cols); break;
    case 3: signal_block<3, NV, T>(xr, ldx, w, vec_bytes, corr, groups, o, ldo, valid_cols); break;
    case 4: signal_block<4, NV, T>(xr, ldx, w, vec_bytes, corr, groups, o, ldo, valid_cols); break;
    case 5: signal_block<5, NV, T>(xr, ldx, w, vec_bytes, corr, groups, o, ldo, valid_cols); break;
    default: break;
  }
}

// Up to kPanel vectors of one-term signal rows (the engine's matmul; a tile panel's whole codes).
void signal_panel(int nvb, int64_t rows, const uint8_t* x, int64_t ldx, const int8_t* w, int64_t vec_bytes,
                  const int32_t* corr, int groups, float* out, int64_t ldo, int valid) {
  switch (nvb) {
    case 4: signal_rows<4, 1>(rows, x, ldx, w, vec_bytes, corr, groups, out, ldo, valid); break;
    case 3: signal_rows<3, 1>(rows, x, ldx, w, vec_bytes, corr, groups, out, ldo, valid); break;
    case 2: signal_rows<2, 1>(rows, x, ldx, w, vec_bytes, corr, groups, out, ldo, valid); break;
    default: signal_rows<1, 1>(rows, x, ldx, w, vec_bytes, corr, groups, out, ldo, valid); break;
  }
}

constexpr int kVarRows = 3;  // rows per variance block: 3 x 4 x 2 accumulators + 4 levels + 2 inputs

template <int NV>
void variance_rows(int64_t rows, const uint8_t* x2, int64_t ldx, int64_t lo_off, const uint8_t* s, int groups,
                   const float* step, float* out, int64_t ldo, int valid_cols) {
  int64_t r = 0;
  for (; r + kVarRows <= rows; r += kVarRows)
    variance_block<kVarRows, NV>(x2 + r * ldx, ldx, lo_off, s, groups, step, out + r * ldo, ldo, valid_cols);
  const auto* xr = x2 + r * ldx;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 1: variance_block<1, NV>(xr, ldx, lo_off, s, groups, step, o, ldo, valid_cols); break;
    case 2: variance_block<2, NV>(xr, ldx, lo_off, s, groups, step, o, ldo, valid_cols); break;
    default: break;
  }
}

struct Problem {
  const uint8_t* xu;
  const uint8_t* x2;  // null: no read noise
  const int8_t* w;
  const int32_t* corr;
  const uint8_t* s;
  const float* step;  // (grid_k, N): the variance levels' step per tile column
  int64_t rows, k, n, grid_k, nv, kp;
  int terms;
};

// One tile's partial sums (and variances, to v unless null) of one 64-column panel (vectors v0..)
// for `nrows` input rows from row0, written with leading dimension ldo.
void panel_dots(const Problem& q, int64_t tile, int64_t v0, int64_t row0, int64_t nrows, float* p, float* v,
                int64_t ldo) {
  const int64_t used = std::min<int64_t>(kTileRows, q.k - tile * kTileRows);
  const int groups = static_cast<int>((used + 3) / 4);
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
      if (nvb == 2) signal_rows<2, 2>(nrows, x, q.kp, w, vec_bytes, c, groups, o, ldo, valid);
      else signal_rows<1, 2>(nrows, x, q.kp, w, vec_bytes, c, groups, o, ldo, valid);
    } else {
      signal_panel(nvb, nrows, x, q.kp, w, vec_bytes, c, groups, o, ldo, valid);
    }
  }
  if (q.x2 == nullptr || v == nullptr) return;
  const int nvb = static_cast<int>(std::min<int64_t>(kPanel, q.nv - v0));
  const int valid = static_cast<int>(std::min<int64_t>(nvb * kLanes, q.n - col0));
  const uint8_t* x2 = q.x2 + row0 * 2 * q.kp + tile * kTileRows;
  const uint8_t* s = q.s + (tile * q.nv + v0) * vec_bytes;
  const float* st = q.step + tile * q.n + col0;
  switch (nvb) {
    case 4: variance_rows<4>(nrows, x2, 2 * q.kp, q.kp, s, groups, st, v, ldo, valid); break;
    case 3: variance_rows<3>(nrows, x2, 2 * q.kp, q.kp, s, groups, st, v, ldo, valid); break;
    case 2: variance_rows<2>(nrows, x2, 2 * q.kp, q.kp, s, groups, st, v, ldo, valid); break;
    default: variance_rows<1>(nrows, x2, 2 * q.kp, q.kp, s, groups, st, v, ldo, valid); break;
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

inline __m512i hash_bits(__m512i seed, __m512i counter) {  // rng.bits
  const __m512i h = _mm512_xor_si512(_mm512_mullo_epi32(counter, _mm512_set1_epi32(static_cast<int>(0x9E3779B9u))),
                                     seed);
  return mix32(_mm512_add_epi32(mix32(h), _mm512_xor_si512(seed, _mm512_set1_epi32(0x68E31DA4))));
}

inline __m512 log_poly(__m512 x) {  // rng._log: the exponent and a polynomial of the mantissa
  const __m512i b = _mm512_castps_si512(x);
  const __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(0xFF)),
                                                       _mm512_set1_epi32(127)));
  const __m512 t = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFF)),
                                                                     _mm512_set1_epi32(0x3F800000))),
                                 _mm512_set1_ps(1.0f));
  __m512 p = _mm512_set1_ps(kLog[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kLog[i]));
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.6931471805599453f), _mm512_mul_ps(p, t));
}

inline void box_muller(__m512i seed, __m512i counter, __m512& z0, __m512& z1) {
  const __m512i b = hash_bits(seed, counter);
  // r = sqrt(-2 log u1)
  const __m512 r = _mm512_sqrt_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), log_poly(uniform_bits(b))));
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
  float* y = nullptr;  // Mvm: the dequantised tile sum after noise and ADC (rows, N)
  const float* lsb = nullptr;   // (grid_k, N) or null: no ADC
  const float* gain = nullptr;  // (grid_k, N) or null
  uint32_t seed = 0;
  float qmax = 0;
  int64_t panels = 0, blocks = 0;
  // Mvm's DAC: float32 inputs (rows, K) quantised per row into q.xu / q.x2 and `xscale` by the
  // first item that needs a row block (`ready`: 0 not started, 1 in progress, 2 done)
  const float* x = nullptr;
  float dac_qmax = 0;
  float* xscale = nullptr;
  uint8_t* xu = nullptr;
  uint8_t* x2 = nullptr;
  std::atomic<int>* ready = nullptr;
  const float* scale = nullptr;  // (N,) the weight's value of one code per column
  const float* bias = nullptr;   // (N,) or null
  std::unique_ptr<uint8_t[]> xu_buf;  // what xu, x2, xscale and ready point at
  std::unique_ptr<uint8_t[]> x2_buf;
  std::unique_ptr<float[]> xscale_buf;
  std::unique_ptr<std::atomic<int>[]> ready_buf;
};

constexpr int64_t kReadRows = 24;  // rows of one read work item: its tile's sums stay in L1

// TileDots' work item: one tile's 64-column panel for all rows.
void dots_item(const Job& j, int64_t item) {
  const Problem& q = j.q;
  const int64_t tile = item / j.panels, v0 = (item % j.panels) * kPanel;
  const int64_t off = tile * q.rows * q.n + v0 * kLanes;
  panel_dots(q, tile, v0, 0, q.rows, j.p + off, q.x2 ? j.v + off : nullptr, q.n);
}

// One row's INT8 codes as sidra_core.quant.quantise_rows makes them, operation for operation:
// scale = max|x| / qmax (1 for an all-zero row; as XLA computes it, times the constant's
// reciprocal), codes = clip(round half to even(x / scale), +-qmax), stored as codes + 128 (uint8)
// and, unless x2 is null, codes^2 as two 7-bit halves (hi at x2, lo at x2 + kp); entries k..kp get
// code 0. A row holding a NaN or an infinity has no codes: its scale is NaN, so are its outputs.
// Returns the scale.
float quantise_row(const float* x, int64_t k, int64_t kp, float qmax, uint8_t* xu, uint8_t* x2) {
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  __m512 amax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t c = 0; c < k; c += kLanes) {
    const __mmask16 m = column_mask(static_cast<int>(k - c));
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + c));
    amax = _mm512_max_ps(amax, a);
    bad |= _mm512_mask_cmp_ps_mask(m, a, inf, _CMP_NLT_UQ);  // NaN or +-inf
  }
  const float top = _mm512_reduce_max_ps(amax);
  const float s = bad ? __builtin_nanf("") : top > 0 ? top * (1.0f / qmax) : 1.0f;
  const int64_t live = bad ? 0 : k;  // a bad row's codes are all 0
  const __m512 sv = _mm512_set1_ps(s), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  for (int64_t c = 0; c < live; c += kLanes) {
    const __mmask16 m = column_mask(static_cast<int>(live - c));
    const __m512 codes = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(
        _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + c), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    _mm512_mask_cvtepi32_storeu_epi8(xu + c, m, _mm512_add_epi32(_mm512_cvtps_epi32(codes), _mm512_set1_epi32(128)));
    if (x2) {
      const __m512i sq = _mm512_cvtps_epi32(_mm512_mul_ps(codes, codes));  // exact: <= 127^2
      _mm512_mask_cvtepi32_storeu_epi8(x2 + c, m, _mm512_srli_epi32(sq, 7));
      _mm512_mask_cvtepi32_storeu_epi8(x2 + kp + c, m, _mm512_and_si512(sq, _mm512_set1_epi32(127)));
    }
  }
  std::fill(xu + live, xu + kp, uint8_t{128});
  if (x2) {
    std::fill(x2 + live, x2 + kp, uint8_t{0});
    std::fill(x2 + kp + live, x2 + 2 * kp, uint8_t{0});
  }
  return s;
}

// Runs fn once, by the first caller; the others wait for it (briefly, yielding, as the thread
// running it may be descheduled). state: 0 not started, 1 running, 2 done.
template <typename F>
void once(std::atomic<int>& state, F fn) {
  if (state.load(std::memory_order_acquire) == 2) return;
  int expected = 0;
  if (state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    fn();
    state.store(2, std::memory_order_release);
  } else {
    while (state.load(std::memory_order_acquire) != 2) std::this_thread::yield();
  }
}

// Mvm's work item: a 64-column panel of kReadRows rows through every tile: the rows' DAC codes,
// partial sums, read noise (the Box-Muller pair of tiles 2m and 2m + 1 drawn once; of column
// vectors 2c and 2c + 1 for an unpaired last tile), ADC, the
// digital sum and the dequantisation, in the order of sidra_core.crossbar.mvm's XLA path.
void read_item(const Job& j, int64_t item) {
  const Problem& q = j.q;
  const int64_t v0 = (item / j.blocks) * kPanel, row0 = (item % j.blocks) * kReadRows;
  const int64_t nrows = std::min(kReadRows, q.rows - row0);
  const int nvb = static_cast<int>(std::min<int64_t>(kPanel, q.nv - v0));
  const int64_t col0 = v0 * kLanes;
  once(j.ready[item % j.blocks], [&] {  // the block's DAC codes, made by the first item that needs them
    for (int64_t r = row0; r < row0 + nrows; ++r)
      j.xscale[r] = quantise_row(j.x + r * q.k, q.k, q.kp, j.dac_qmax, j.xu + r * q.kp,
                                 j.x2 ? j.x2 + r * 2 * q.kp : nullptr);
  });
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
    // counters as the XLA path's (crossbar._read_normals): row * stride + pair * width + column, in
    // uint32; a row's own block of counters, so its draws do not depend on the rows read with it
    const int64_t blocks32 = (q.n + 31) / 32;
    const uint32_t width = static_cast<uint32_t>(std::max<int64_t>(q.n, blocks32 * 16));
    const uint32_t stride = static_cast<uint32_t>((q.grid_k + 1) / 2) * width;
    const uint32_t base = static_cast<uint32_t>(tile / 2) * width;
    // an even last tile has no partner: its pairs are drawn per 32-column block instead, z0 for the
    // first 16 columns and z1 for the next (half the draws)
    const bool alone = tile % 2 == 0 && tile + 1 == q.grid_k;
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
          if (alone) {  // the pair serves this and the next vector of 16 columns (of one 32-column block)
            if (vec % 2 == 0) {
              const uint32_t first = static_cast<uint32_t>(row0 + r) * stride + base + static_cast<uint32_t>(c / 32) * kLanes;
              __m512 other;
              box_muller(seed, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)), lane), z, other);
              _mm512_store_ps(z1 + at + kLanes, other);  // (kW is a whole number of 32-column blocks)
            } else {
              z = _mm512_load_ps(z1 + at);
            }
          } else if (tile % 2 == 0) {
            const uint32_t first = static_cast<uint32_t>(row0 + r) * stride + base + static_cast<uint32_t>(c);
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
  // dequantised: (sum x row scale) x column scale (+ bias, contracted into one FMA as XLA does)
  for (int64_t r = 0; r < nrows; ++r) {
    const __m512 xs = _mm512_set1_ps(j.xscale[row0 + r]);
    for (int vec = 0; vec < nvb; ++vec) {
      const int64_t c = col0 + vec * kLanes;
      const __mmask16 m = column_mask(static_cast<int>(q.n - c));
      const __m512 a = _mm512_mul_ps(_mm512_load_ps(y + r * kW + vec * kLanes), xs);
      const __m512 sc = _mm512_maskz_loadu_ps(m, j.scale + c);
      const __m512 out = j.bias ? _mm512_fmadd_ps(a, sc, _mm512_maskz_loadu_ps(m, j.bias + c)) : _mm512_mul_ps(a, sc);
      _mm512_mask_storeu_ps(j.y + (row0 + r) * q.n + c, m, out);
    }
  }
}

// The compute engine's INT8 matmul (sidra_core.engine.matmul, mode "int8") of a (B, M, K) by
// b (B, K, N): a's rows and b's columns quantised to INT8 codes (quantise_row's arithmetic), their
// products summed exactly in int32 (a + 128 against b, less 128 sum_k b per column), then
// (sum x row scale) x column scale, as the XLA path computes it (its float32 sums of the codes'
// products are exact up to K = 1040; past that these are the exact INT32 ones).
struct EngineJob {
  const float* a = nullptr;
  const float* b = nullptr;
  float* y = nullptr;
  int64_t m = 0, k = 0, n = 0, kp = 0, nv = 0, blocks = 0;
  float qmax = 0;
  std::unique_ptr<int8_t[]> bp;     // b's codes (B, NV, kp / 4, 16, 4): a tile's layout, kp word lines
  std::unique_ptr<int32_t[]> corr;  // (B, NV, 16): 128 sum_k codes
  std::unique_ptr<float[]> sb;      // (B, NV * 16): column scales
  std::unique_ptr<uint8_t[]> au;    // (B, M, kp): a's codes + 128
  std::unique_ptr<std::atomic<int>[]> ready;  // per batch: b's codes made
};

// The columns of b (K rows of N: element (r, c) at b[r ld + c cs]) as a matmul's right operand: each column's scale
// over K (max|b| / qmax, 1 for an all-zero column; NaN for a column holding a NaN or an
// infinity, whose codes are 0), its codes (XLA divides by a column's scale as a product by its
// reciprocal) packed 4 rows to a 32-bit lane, (NV, kp / 4, 16, 4), and 128 sum_k codes per column.
void pack_columns(const float* b, int64_t k, int64_t n, int64_t ld, int64_t cs, int64_t kp, float qmax,
                  int8_t* dst, int32_t* corr, float* scales) {
  // 16 columns of row r from c: one load, or a gather where the columns are not adjacent (k^T)
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(cs)));
  auto load = [&](__mmask16 m, int64_t r, int64_t c) {
    const float* at = b + r * ld + c * cs;
    return cs == 1 ? _mm512_maskz_loadu_ps(m, at) : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, lanes, at, 4);
  };
  const __m512 inf = _mm512_set1_ps(__builtin_inff()), zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  const __m512 hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  const int64_t nv = (n + kLanes - 1) / kLanes;
  for (int64_t v = 0; v < nv; ++v, corr += kLanes, scales += kLanes) {
    const int64_t c = v * kLanes;
    const __mmask16 m = column_mask(static_cast<int>(n - c));
    __m512 amax = zero;
    __mmask16 bad = 0;
    for (int64_t r = 0; r < k; ++r) {
      const __m512 a = _mm512_abs_ps(load(m, r, c));
      amax = _mm512_max_ps(amax, a);
      bad |= _mm512_mask_cmp_ps_mask(m, a, inf, _CMP_NLT_UQ);
    }
    __m512 sc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(amax, zero, _CMP_GT_OQ), one,
                                     _mm512_mul_ps(amax, _mm512_set1_ps(1.0f / qmax)));
    sc = _mm512_mask_blend_ps(bad, sc, _mm512_set1_ps(__builtin_nanf("")));
    _mm512_storeu_ps(scales, sc);
    const __mmask16 live = m & static_cast<__mmask16>(~bad);
    const __m512 inv = _mm512_div_ps(one, sc);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t g = 0; g < kp / 4; ++g, dst += kGroupBytes) {
      __m512i word = _mm512_setzero_si512();
      for (int t = 0; t < 4 && 4 * g + t < k; ++t) {
        const __m512 codes = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(
            _mm512_mul_ps(load(live, 4 * g + t, c), inv),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
        const __m512i ci = _mm512_maskz_cvtps_epi32(live, codes);
        sum = _mm512_add_epi32(sum, ci);
        word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_and_si512(ci, _mm512_set1_epi32(0xFF)), 8 * t));
      }
      _mm512_storeu_si512(dst, word);
    }
    _mm512_storeu_si512(corr, _mm512_slli_epi32(sum, 7));
  }
}

// y (rows x n, leading dimension ldy) = the exact sums of INT8 codes (as codes + 128, rows of kp)
// against n columns packed by pack_columns, as float32: the engine's INT8 matmuls.
void code_matmul(int64_t rows, const uint8_t* x, int64_t kp, const int8_t* bp, const int32_t* corr, int64_t n,
                 float* y, int64_t ldy) {
  const int64_t nv = (n + kLanes - 1) / kLanes, vec_bytes = kp * kLanes;
  for (int64_t v0 = 0; v0 < nv; v0 += kPanel) {
    const int nvb = static_cast<int>(std::min<int64_t>(kPanel, nv - v0));
    const int valid = static_cast<int>(std::min<int64_t>(nvb * kLanes, n - v0 * kLanes));
    signal_panel(nvb, rows, x, kp, bp + v0 * vec_bytes, vec_bytes, corr + v0 * kLanes, static_cast<int>(kp / 4),
                 y + v0 * kLanes, ldy, valid);
  }
}

// Those sums x each row's scale sa, then x each column's sb (the XLA path's order), in place.
void rescale(float* y, int64_t ldy, int64_t rows, int64_t n, const float* sa, const float* sb) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 xs = _mm512_set1_ps(sa[r]);
    float* out = y + r * ldy;
    for (int64_t c = 0; c < n; c += kLanes) {
      const __mmask16 m = column_mask(static_cast<int>(n - c));
      _mm512_mask_storeu_ps(out + c, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, out + c), xs),
                                                      _mm512_loadu_ps(sb + c)));
    }
  }
}

// The engine matmul's work item: kReadRows rows of one batch against all of its columns.
void engine_item(const EngineJob& j, int64_t item) {
  const int64_t batch = item / j.blocks, row0 = (item % j.blocks) * kReadRows;
  const int64_t nrows = std::min(kReadRows, j.m - row0);
  once(j.ready[batch], [&] {  // the batch's b, packed by the first item that needs it
    pack_columns(j.b + batch * j.k * j.n, j.k, j.n, j.n, 1, j.kp, j.qmax, j.bp.get() + batch * j.nv * j.kp * kLanes,
                 j.corr.get() + batch * j.nv * kLanes, j.sb.get() + batch * j.nv * kLanes);
  });
  float sa[kReadRows];
  uint8_t* au = j.au.get() + (batch * j.m + row0) * j.kp;
  for (int64_t r = 0; r < nrows; ++r)
    sa[r] = quantise_row(j.a + (batch * j.m + row0 + r) * j.k, j.k, j.kp, j.qmax, au + r * j.kp, nullptr);
  float* y = j.y + (batch * j.m + row0) * j.n;
  code_matmul(nrows, au, j.kp, j.bp.get() + batch * j.nv * j.kp * kLanes, j.corr.get() + batch * j.nv * kLanes, j.n,
              y, j.n);
  rescale(y, j.n, nrows, j.n, sa, j.sb.get() + batch * j.nv * kLanes);
}

// exp(x) for 16 lanes (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, a degree-7 polynomial; within
// ~1 ulp of libm). Softmax calls it on x - max <= 0; below -87.3 it gives e^-87.3 ~ 1e-38.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // (operand order: a NaN passes)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// A value in the engine's format (sidra_core.engine._round): 0 float32, 1 float16, 2 bfloat16, to
// nearest even, beyond the range to inf. bfloat16 by integer rounding as XLA converts (the
// conversion instruction would flush subnormals): + 0x7fff + the kept lowest bit; NaN stays NaN.
inline __m512 to_format(__m512 v, int format) {
  if (format == 0) return v;
  if (format == 1) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), high);
  const __m512i nan = _mm512_or_si512(_mm512_and_si512(u, high), _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan));
}

// The engine's storage rounding (sidra_core.engine.round_to): to_format, but finite values
// saturate at the format's largest; inf and NaN pass.
inline __m512 store_round(__m512 v, int format) {
  if (format == 0) return v;
  const float big = format == 1 ? 65504.0f : 3.38953139e38f;
  const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ);
  v = _mm512_mask_blend_ps(finite, v, _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-big)), _mm512_set1_ps(big)));
  return to_format(v, format);
}

// erf(x) for 16 lanes: the odd / even rational interpolant Eigen and XLA:CPU use (a few ulp),
// +-1 from |x| >= 3.8325 on.
inline __m512 erf_ps(__m512 x) {
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_fmadd_ps(x2, _mm512_set1_ps(0.00022905065861350646f), _mm512_set1_ps(0.0034082910107109506f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(0.050955695062380861f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(0.18520832239976145f));
  p = _mm512_mul_ps(x, _mm512_fmadd_ps(x2, p, _mm512_set1_ps(1.128379143519084f)));
  __m512 q = _mm512_fmadd_ps(x2, _mm512_set1_ps(-1.1791602954361697e-7f), _mm512_set1_ps(0.000023547966471313185f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(0.0010179625278914885f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(0.014070470171167667f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(0.11098505178285362f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(0.49746925110067538f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(1.0f));
  const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(3.832506856900711f), _CMP_GE_OQ);
  const __m512 one = _mm512_castsi512_ps(_mm512_or_si512(  // +-1 with x's sign (integer ops: no AVX-512 DQ)
      _mm512_castps_si512(_mm512_set1_ps(1.0f)),
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
  return _mm512_mask_mov_ps(_mm512_div_ps(p, q), big, one);
}

// tanh(x) for 16 lanes: Eigen's and XLA:CPU's rational interpolant on x clamped to +-7.9988 (where
// it reaches +-1), x itself for |x| < 0.0004.
inline __m512 tanh_ps(__m512 x) {
  constexpr float kNum[] = {-2.76076847742355e-16f, 2.00018790482477e-13f, -8.60467152213735e-11f,
                            5.12229709037114e-08f,  1.48572235717979e-05f, 6.37261928875436e-04f,
                            4.89352455891786e-03f};
  constexpr float kDen[] = {1.19825839466702e-06f, 1.18534705686654e-04f, 2.26843463243900e-03f,
                            4.89352518554385e-03f};
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(7.99881172180175781f),  // (operand order: a NaN passes)
                                 _mm512_max_ps(_mm512_set1_ps(-7.99881172180175781f), x));
  const __m512 x2 = _mm512_mul_ps(c, c);
  __m512 p = _mm512_set1_ps(kNum[0]), q = _mm512_set1_ps(kDen[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(kNum[i]));
  for (int i = 1; i < 4; ++i) q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(kDen[i]));
  const __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(0.0004f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_div_ps(_mm512_mul_ps(c, p), q), small, x);
}

// The engine's element-wise non-linearities (sidra_core.engine.ELEMENTWISE), in kMapOps' order.
enum MapOp { kRelu, kGelu, kGeluTanh, kTanh, kSigmoid, kSilu, kMapOps };

inline __m512 sigmoid_ps(__m512 x) {  // 1 / (1 + e^-x): e^-x overflows to inf for x < -88.7, giving 0
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

inline __m512 map_op(__m512 x, int op) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  switch (op) {
    case kRelu: {  // 0 where x < 0, else x (NaN and -0 pass), told by the bits of x x 1 (subnormals flushed)
      const __m512i b = _mm512_castps_si512(_mm512_mul_ps(x, one));
      const __mmask16 neg = _mm512_cmpgt_epi32_mask(b, _mm512_set1_epi32(INT32_MIN)) &
                            _mm512_cmple_epi32_mask(b, _mm512_set1_epi32(static_cast<int>(0xFF800000u)));
      return _mm512_mask_mov_ps(x, neg, _mm512_setzero_ps());
    }
    case kGelu:
      return _mm512_mul_ps(_mm512_mul_ps(half, x),
                           _mm512_add_ps(one, erf_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.7071067811865476f)))));
    case kGeluTanh: {
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), x), x);
      const __m512 t = tanh_ps(_mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(x, cube)));
      return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, t));
    }
    case kTanh:
      return tanh_ps(x);
    case kSigmoid:
      return sigmoid_ps(x);
    default:
      return _mm512_mul_ps(x, sigmoid_ps(x));
  }
}


// The engine's attention without a mask (sidra_core.engine.attention): for each batch and head,
// scores = INT8 matmul(q, k^T) x scale stored in the engine format, the safe softmax (float32
// exponentials and sum, stored in the format; a row whose maximum is -inf gives zeros), then the
// INT8 matmul with v; the scores never leave the item. Rows of q, k, v and the output are D
// contiguous floats at (b, h, s) -> b bs + h hs + s ss (BHSD or BSHD layouts alike).
struct AttentionJob {
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  float* y = nullptr;
  int64_t heads = 0, sq = 0, sk = 0, d = 0, dv = 0;
  int64_t qs[3] = {}, ks[3] = {}, vs[3] = {}, ys[3] = {};  // strides of b, h, s
  float scale = 0, qmax = 0;
  int format = 0;
  // an optional mask over the scores, per (batch item, query, key) with strides ms (b, h, q; keys
  // contiguous): bool (keep where nonzero, else -inf) or float (added), before the rounding
  const uint8_t* keep = nullptr;
  const float* add = nullptr;
  bool contract = true;  // false: the mask follows a select (a causal one), which XLA does not fuse into
  int64_t ms[3] = {};
};

void attention_item(const AttentionJob& j, int64_t item) {
  const int64_t bi = item / j.heads, hi = item % j.heads;
  const float* q = j.q + bi * j.qs[0] + hi * j.qs[1];
  const float* k = j.k + bi * j.ks[0] + hi * j.ks[1];
  const float* v = j.v + bi * j.vs[0] + hi * j.vs[1];
  float* y = j.y + bi * j.ys[0] + hi * j.ys[1];
  const int64_t dp = (j.d + 3) / 4 * 4, tp = (j.sk + 3) / 4 * 4;
  const int64_t nt = (j.sk + kLanes - 1) / kLanes, nd = (j.dv + kLanes - 1) / kLanes;
  std::vector<uint8_t> qu(j.sq * dp), pu(j.sq * tp);
  std::vector<int8_t> kp(nt * dp * kLanes), vp(nd * tp * kLanes);
  std::vector<int32_t> kc(nt * kLanes), vc(nd * kLanes);
  std::vector<float> sa(j.sq), sp(j.sq), sb(nt * kLanes), svs(nd * kLanes), sc(j.sq * nt * kLanes);
  // q k^T: q's rows, k's rows as the columns of k^T
  for (int64_t r = 0; r < j.sq; ++r) sa[r] = quantise_row(q + r * j.qs[2], j.d, dp, j.qmax, &qu[r * dp], nullptr);
  pack_columns(k, j.d, j.sk, 1, j.ks[2], dp, j.qmax, kp.data(), kc.data(), sb.data());
  const int64_t ldc = nt * kLanes;
  code_matmul(j.sq, qu.data(), dp, kp.data(), kc.data(), j.sk, sc.data(), ldc);
  // each row: rescale, x scale, store; the softmax; its INT8 codes
  const __m512 scale = _mm512_set1_ps(j.scale), ninf = _mm512_set1_ps(-__builtin_inff());
  const int64_t mask_at = bi * j.ms[0] + hi * j.ms[1];
  for (int64_t r = 0; r < j.sq; ++r) {
    float* row = &sc[r * ldc];
    const __m512 xs = _mm512_set1_ps(sa[r]);
    __m512 mx = ninf;
    for (int64_t c = 0; c < j.sk; c += kLanes) {
      const __mmask16 m = column_mask(static_cast<int>(j.sk - c));
      __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row + c), xs), _mm512_loadu_ps(&sb[c]));
      if (j.add) {  // s * scale + mask, the product contracted into the sum where XLA:CPU does so
        const __m512 a = _mm512_maskz_loadu_ps(m, j.add + mask_at + r * j.ms[2] + c);
        t = j.contract ? _mm512_fmadd_ps(t, scale, a) : _mm512_add_ps(_mm512_mul_ps(t, scale), a);
      } else {
        t = _mm512_mul_ps(t, scale);
      }
      if (j.keep) {
        const __m128i b = _mm_maskz_loadu_epi8(m, j.keep + mask_at + r * j.ms[2] + c);
        t = _mm512_mask_mov_ps(ninf, _mm_test_epi8_mask(b, b), t);
      }
      t = store_round(t, j.format);
      _mm512_storeu_ps(row + c, t);
      mx = _mm512_mask_max_ps(mx, m, mx, t);
    }
    const float top = _mm512_reduce_max_ps(mx);
    const __m512 tv = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < j.sk; c += kLanes) {
      const __mmask16 m = column_mask(static_cast<int>(j.sk - c));
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + c), tv)));
      _mm512_storeu_ps(row + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    const bool masked = top == -__builtin_inff();
    for (int64_t c = 0; c < j.sk; c += kLanes) {
      const __m512 p = masked ? _mm512_setzero_ps() : store_round(_mm512_div_ps(_mm512_loadu_ps(row + c), total), j.format);
      _mm512_storeu_ps(row + c, p);
    }
    sp[r] = quantise_row(row, j.sk, tp, j.qmax, &pu[r * tp], nullptr);
  }
  // p v: v's columns over the keys, the output in place of q's rows
  pack_columns(v, j.sk, j.dv, j.vs[2], 1, tp, j.qmax, vp.data(), vc.data(), svs.data());
  code_matmul(j.sq, pu.data(), tp, vp.data(), vc.data(), j.dv, y, j.ys[2]);
  rescale(y, j.ys[2], j.sq, j.dv, sp.data(), svs.data());
}

// Items are taken from a shared counter by the caller and the helper threads. The caller waits
// only for items in progress: a helper that comes late finds none and drops the job.
struct Work {
  std::function<void(int64_t)> item;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  void drain(bool helper = false);
};

// Calls running now. XLA runs independent thunks at once, one per core of its own pool: while
// more than one call runs, the callers already use the cores and a helper steps back (more
// threads than cores make each call wait for a descheduled one).
std::atomic<int> g_active{0};

void Work::drain(bool helper) {
  for (;;) {
    if (helper && g_active.load(std::memory_order_relaxed) > 1) return;
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    if (i >= items) return;
    item(i);
    done.fetch_add(1, std::memory_order_release);
  }
}

// The kernel's own helper threads (one fewer than the CPUs this process may use): a condition
// variable wakes one far sooner than XLA's intra-op pool starts a task scheduled from the
// calling thread. Several calls may run at once
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
    // it waited for needed when more threads than cores were busy.
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

// The engine matmul sums a whole row in one int32: 255 x 127 x K stays below 2^31.
constexpr int64_t kMaxEngineK = 65536;

// The packed weights (w, corr, s, step), checked; false: not the layout vnni.py packs.
bool weights(ffi::Buffer<ffi::S8>& w, ffi::Buffer<ffi::S32>& corr, ffi::Buffer<ffi::U8>& s, ffi::Buffer<ffi::F32>& step,
             int64_t k, int64_t n, int64_t terms, int64_t noise, Problem& q) {
  const auto wd = w.dimensions();
  if (wd.size() != 6 || (terms != 1 && terms != 2) || wd[2] != terms || k > wd[0] * kTileRows) return false;
  if (noise && (s.element_count() != wd[0] * wd[1] * kTileRows * kLanes || step.element_count() != wd[0] * n))
    return false;
  q.w = w.typed_data();
  q.corr = corr.typed_data();
  q.s = s.typed_data();
  q.step = step.typed_data();
  q.k = k;
  q.n = n;
  q.grid_k = wd[0];
  q.nv = wd[1];
  q.kp = wd[0] * kTileRows;
  q.terms = static_cast<int>(terms);
  return true;
}

// All items of a job of `macs` multiply-accumulates, shared with the helpers when it is large
// enough to pay for waking them.
void execute(const std::shared_ptr<Work>& work, int64_t macs) {
  if (work->items == 0) return;
  const bool alone = g_active.fetch_add(1, std::memory_order_relaxed) == 0;
  if (alone && work->items > 1 && macs >= kParallelMacs && Helpers::get().count() > 0) {
    Helpers::get().run(work);
  } else {
    work->drain();
  }
  if (g_active.fetch_sub(1, std::memory_order_relaxed) == 2 && Helpers::get().count() > 0) Helpers::get().wake();
}

constexpr int64_t kMapItem = 16384;  // elements of one work item

// Subnormal inputs and results as zeros (MXCSR's DAZ and FTZ) while in scope, as XLA:CPU computes
// and runs its custom calls: the engine's kernels then give the same bits called from XLA or
// directly, on any thread.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

// y = op(x) over n elements, the input and the result each in the engine's format.
void run_map(const float* x, int64_t n, int op, int format, float* y) {
  auto work = std::make_shared<Work>();
  work->items = (n + kMapItem - 1) / kMapItem;
  work->item = [=](int64_t item) {
    FlushDenormals flush;
    const int64_t lo = item * kMapItem, hi = std::min(n, lo + kMapItem);
    for (int64_t i = lo; i < hi; i += kLanes) {
      const __mmask16 m = column_mask(static_cast<int>(hi - i));
      const __m512 v = to_format(_mm512_maskz_loadu_ps(m, x + i), format);
      _mm512_mask_storeu_ps(y + i, m, to_format(map_op(v, op), format));
    }
  };
  execute(work, n * 64);
}

// Layer norm (rms = false) or RMS norm of `rows` rows of `width` floats: the input in the engine's
// format, mean and variance (of x - mean) summed in float32, 1 / sqrt(var + eps), x w + b with w
// and b optional (null), the result in the format; each row's mean (0 for RMS) and 1/std too.
void run_norm(const float* x, int64_t rows, int64_t width, const float* w, const float* b, float eps, bool rms,
              int format, float* y, float* mean, float* rstd) {
  auto work = std::make_shared<Work>();
  const int64_t per = std::max<int64_t>(1, kMapItem / std::max<int64_t>(width, 1));
  work->items = (rows + per - 1) / per;
  work->item = [=](int64_t item) {
    FlushDenormals flush;
    for (int64_t r = item * per; r < std::min(rows, (item + 1) * per); ++r) {
      const float* in = x + r * width;
      float* out = y + r * width;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < width; c += kLanes) {
        const __mmask16 m = column_mask(static_cast<int>(width - c));
        const __m512 v = to_format(_mm512_maskz_loadu_ps(m, in + c), format);
        acc = rms ? _mm512_fmadd_ps(v, v, acc) : _mm512_add_ps(acc, v);
      }
      const float mu = rms ? 0.0f : _mm512_reduce_add_ps(acc) / static_cast<float>(width);
      const __m512 mv = _mm512_set1_ps(mu);
      float var = rms ? _mm512_reduce_add_ps(acc) / static_cast<float>(width) : 0.0f;
      if (!rms) {
        acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < width; c += kLanes) {
          const __mmask16 m = column_mask(static_cast<int>(width - c));
          const __m512 d = _mm512_maskz_sub_ps(m, to_format(_mm512_maskz_loadu_ps(m, in + c), format), mv);
          acc = _mm512_fmadd_ps(d, d, acc);
        }
        var = _mm512_reduce_add_ps(acc) / static_cast<float>(width);
      }
      const float rs = 1.0f / std::sqrt(var + eps);
      const __m512 rv = _mm512_set1_ps(rs);
      for (int64_t c = 0; c < width; c += kLanes) {
        const __mmask16 m = column_mask(static_cast<int>(width - c));
        __m512 t = _mm512_mul_ps(_mm512_sub_ps(to_format(_mm512_maskz_loadu_ps(m, in + c), format), mv), rv);
        if (w) t = _mm512_mul_ps(t, _mm512_maskz_loadu_ps(m, w + c));
        if (b) t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(m, b + c));
        _mm512_mask_storeu_ps(out + c, m, to_format(t, format));
      }
      mean[r] = mu;
      rstd[r] = rs;
    }
  };
  execute(work, rows * width * 32);
}

// The element-wise op `op` (MapOp) of x in the engine's `format`.
ffi::Error EngineMap(ffi::Buffer<ffi::F32> x, int64_t op, int64_t format, ffi::ResultBuffer<ffi::F32> y) {
  if (op < 0 || op >= kMapOps || format < 0 || format > 2)
    return ffi::Error::InvalidArgument("sidra_engine_map: unknown op or format");
  run_map(x.typed_data(), x.element_count(), static_cast<int>(op), static_cast<int>(format), y->typed_data());
  return ffi::Error::Success();
}

// run_norm of x (rows, width) with w and b of `width` floats or empty, eps one float (an operand:
// a traced value in the jitted op).
ffi::Error EngineNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> b,
                      ffi::Buffer<ffi::F32> eps, int64_t rms, int64_t format, ffi::ResultBuffer<ffi::F32> y,
                      ffi::ResultBuffer<ffi::F32> mean, ffi::ResultBuffer<ffi::F32> rstd) {
  const auto xd = x.dimensions();
  const int64_t nw = w.element_count(), nb = b.element_count();
  if (xd.size() != 2 || (nw && nw != xd[1]) || (nb && nb != xd[1]) || eps.element_count() != 1 || format < 0 ||
      format > 2)
    return ffi::Error::InvalidArgument("sidra_engine_norm: unexpected operand layout");
  run_norm(x.typed_data(), xd[0], xd[1], nw ? w.typed_data() : nullptr, nb ? b.typed_data() : nullptr,
           eps.typed_data()[0], rms != 0,
           static_cast<int>(format), y->typed_data(), mean->typed_data(), rstd->typed_data());
  return ffi::Error::Success();
}

int64_t macs(const Problem& q) { return q.rows * q.k * q.n * (q.terms + (q.x2 ? 2 : 0)); }

ffi::Error TileDots(ffi::Buffer<ffi::U8> xu, ffi::Buffer<ffi::U8> x2, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::S32> corr, ffi::Buffer<ffi::U8> s, ffi::Buffer<ffi::F32> step, int64_t k,
                    int64_t n, int64_t terms, int64_t noise, ffi::ResultBuffer<ffi::F32> p,
                    ffi::ResultBuffer<ffi::F32> v) {
  auto job = std::make_shared<Job>();
  Job& j = *job;
  const auto xd = xu.dimensions();
  if (!weights(w, corr, s, step, k, n, terms, noise, j.q) || xd.size() != 2 || xd[1] != j.q.kp ||
      (noise && x2.element_count() != 2 * xd[0] * j.q.kp))
    return ffi::Error::InvalidArgument("sidra_tile_dots: unexpected operand layout");
  j.q.xu = xu.typed_data();
  j.q.x2 = noise ? x2.typed_data() : nullptr;
  j.q.rows = xd[0];
  j.p = p->typed_data();
  j.v = v->typed_data();
  j.panels = (j.q.nv + kPanel - 1) / kPanel;
  auto work = std::make_shared<Work>();
  work->item = [job](int64_t i) { dots_item(*job, i); };
  work->items = j.q.rows ? j.q.grid_k * j.panels : 0;
  execute(work, macs(j.q));
  return ffi::Error::Success();
}

// The whole MVM on float32 inputs x (rows, K): the DAC (codes of +-dac_qmax per row), then
// y (rows, N) = sum over tiles of ADC(p + sqrt(v) z) (the ADC only with `lsb`, the gain only with
// `gain`; both (grid_k, N) or null), times each row's DAC scale and the column `scale` (N,),
// plus `bias` (N,) if not null. q holds the packed weights (weights()).
void run_mvm(const Problem& q, int64_t rows, const float* x, const float* lsb, const float* gain,
             const float* scale, const float* bias, uint32_t seed, float qmax, float dac_qmax, float* y) {
  auto job = std::make_shared<Job>();
  Job& j = *job;
  j.q = q;
  j.q.rows = rows;
  j.x = x;
  j.dac_qmax = dac_qmax;
  // the DAC codes, owned by the job (a helper may still hold it after the call returns)
  j.xu_buf.reset(new uint8_t[rows * j.q.kp]);
  if (q.s) j.x2_buf.reset(new uint8_t[rows * 2 * j.q.kp]);
  j.xscale_buf.reset(new float[rows]);
  j.q.xu = j.xu = j.xu_buf.get();
  j.q.x2 = j.x2 = j.x2_buf.get();
  j.xscale = j.xscale_buf.get();
  j.y = y;
  j.lsb = lsb;
  j.gain = gain;
  j.scale = scale;
  j.bias = bias;
  j.seed = seed;
  j.qmax = qmax;
  j.panels = (j.q.nv + kPanel - 1) / kPanel;
  j.blocks = (rows + kReadRows - 1) / kReadRows;
  j.ready_buf.reset(new std::atomic<int>[j.blocks]);
  for (int64_t b = 0; b < j.blocks; ++b) j.ready_buf[b].store(0, std::memory_order_relaxed);
  j.ready = j.ready_buf.get();
  auto work = std::make_shared<Work>();
  work->item = [job](int64_t i) { read_item(*job, i); };
  work->items = j.panels * j.blocks;
  execute(work, macs(j.q));
}

ffi::Error Mvm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::S32> corr, ffi::Buffer<ffi::U8> s,
               ffi::Buffer<ffi::F32> step, ffi::Buffer<ffi::F32> lsb, ffi::Buffer<ffi::F32> gain,
               ffi::Buffer<ffi::F32> scale,
               ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::U32> seed, int64_t k, int64_t n, int64_t terms,
               int64_t noise, float qmax, float dac_qmax, ffi::ResultBuffer<ffi::F32> y) {
  Problem q;
  const auto xd = x.dimensions();
  if (!weights(w, corr, s, step, k, n, terms, noise, q) || xd.size() != 2 || xd[1] != k ||
      seed.element_count() != 1 || scale.element_count() != n ||
      (bias.element_count() != 0 && bias.element_count() != n))
    return ffi::Error::InvalidArgument("sidra_mvm: unexpected operand layout");
  if (!noise) q.s = nullptr;
  run_mvm(q, xd[0], x.typed_data(), lsb.element_count() ? lsb.typed_data() : nullptr,
          gain.element_count() ? gain.typed_data() : nullptr, scale.typed_data(),
          bias.element_count() ? bias.typed_data() : nullptr, seed.typed_data()[0], qmax, dac_qmax,
          y->typed_data());
  return ffi::Error::Success();
}

// The engine's INT8 matmul y (B, M, N) of a (B, M, K) and b (B, K, N), codes of +-qmax (EngineJob).
ffi::Error EngineMatmul(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, float qmax, ffi::ResultBuffer<ffi::F32> y) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 3 || bd.size() != 3 || ad[0] != bd[0] || ad[2] != bd[1] || ad[2] > kMaxEngineK)
    return ffi::Error::InvalidArgument("sidra_engine_matmul: unexpected operand layout");
  auto job = std::make_shared<EngineJob>();
  EngineJob& j = *job;
  const int64_t batches = ad[0];
  j.a = a.typed_data();
  j.b = b.typed_data();
  j.y = y->typed_data();
  j.m = ad[1];
  j.k = ad[2];
  j.n = bd[2];
  j.kp = (j.k + 3) / 4 * 4;
  j.nv = (j.n + kLanes - 1) / kLanes;
  j.blocks = (j.m + kReadRows - 1) / kReadRows;
  j.qmax = qmax;
  if (batches * j.m * j.n == 0) return ffi::Error::Success();
  j.bp.reset(new int8_t[batches * j.nv * j.kp * kLanes]);
  j.corr.reset(new int32_t[batches * j.nv * kLanes]);
  j.sb.reset(new float[batches * j.nv * kLanes]);
  j.au.reset(new uint8_t[batches * j.m * j.kp]);
  j.ready.reset(new std::atomic<int>[batches]);
  for (int64_t i = 0; i < batches; ++i) j.ready[i].store(0, std::memory_order_relaxed);
  auto work = std::make_shared<Work>();
  work->item = [job](int64_t i) { engine_item(*job, i); };
  work->items = batches * j.blocks;
  execute(work, batches * j.m * j.k * j.n);
  return ffi::Error::Success();
}

// The attention of `batches` x `heads` (q: sq x d, k: sk x d, v: sk x dv each), in (B, H, S, D)
// layout with heads_first, else (B, S, H, D); y as q with dv.
void run_attention(const float* q, const float* k, const float* v, float* y, int64_t batches, int64_t heads,
                   int64_t sq, int64_t sk, int64_t d, int64_t dv, bool heads_first, float scale, int format,
                   float qmax, const uint8_t* keep = nullptr, const float* add = nullptr, bool contract = true) {
  if (batches * heads * sq * dv == 0) return;
  auto job = std::make_shared<AttentionJob>();
  AttentionJob& j = *job;
  j.keep = keep;
  j.add = add;
  j.contract = contract;
  j.ms[0] = heads * sq * sk;  // a mask holds (batches, heads, sq, sk)
  j.ms[1] = sq * sk;
  j.ms[2] = sk;
  j.q = q;
  j.k = k;
  j.v = v;
  j.y = y;
  j.heads = heads;
  j.sq = sq;
  j.sk = sk;
  j.d = d;
  j.dv = dv;
  auto strides = [&](int64_t s, int64_t d, int64_t* out) {  // b, h, s strides of a (., ., ., d) array
    out[0] = j.heads * s * d;
    out[1] = heads_first ? s * d : d;
    out[2] = heads_first ? d : j.heads * d;
  };
  strides(j.sq, j.d, j.qs);
  strides(j.sk, j.d, j.ks);
  strides(j.sk, j.dv, j.vs);
  strides(j.sq, j.dv, j.ys);
  j.scale = scale;
  j.qmax = qmax;
  j.format = format;
  auto work = std::make_shared<Work>();
  work->item = [job](int64_t i) { attention_item(*job, i); };
  work->items = batches * j.heads;
  execute(work, batches * j.heads * j.sq * j.sk * (j.d + j.dv));
}

// The engine's attention (AttentionJob) of q (B, A1, A2, D), k (B, A1, A2, D), v (B, A1, A2, Dv):
// heads_first: (B, H, S, D), else (B, S, H, D). format: the engine's storage (store_round).
// keep (uint8) / add (float32): a mask of (B, H, S_q, S_k) as run_attention takes it, or empty.
ffi::Error Attention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::U8> keep, ffi::Buffer<ffi::F32> add, float scale, int64_t heads_first,
                     int64_t format, float qmax, int64_t contract, ffi::ResultBuffer<ffi::F32> y) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int hx = heads_first ? 1 : 2, sx = heads_first ? 2 : 1;
  const int64_t scores = qd.size() == 4 && kd.size() == 4 ? qd[0] * qd[hx] * qd[sx] * kd[sx] : -1;
  const int64_t nk = keep.element_count(), na = add.element_count();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || qd[0] != kd[0] || qd[0] != vd[0] ||
      qd[hx] != kd[hx] || qd[hx] != vd[hx] || kd[sx] != vd[sx] || qd[3] != kd[3] || format < 0 || format > 2 ||
      qd[3] > kMaxEngineK || kd[sx] > kMaxEngineK || (nk && na) || (nk && nk != scores) || (na && na != scores))
    return ffi::Error::InvalidArgument("sidra_attention: unexpected operand layout");
  run_attention(q.typed_data(), k.typed_data(), v.typed_data(), y->typed_data(), qd[0], qd[hx], qd[sx], kd[sx],
                qd[3], vd[3], heads_first != 0, scale, static_cast<int>(format), qmax,
                nk ? keep.typed_data() : nullptr, na ? add.typed_data() : nullptr, contract != 0);
  return ffi::Error::Success();
}

constexpr int64_t kPackVectors = 8;  // column vectors a work item of PackTiles packs

// 16 columns of 4 word lines of a (rows, ld) byte array: each row's bytes widened to 32-bit lanes
// and shifted into place (one 64-byte store per group); rows past `live` and columns past the mask
// load as zeros. Returns the columns' sums of the bytes read as int8.
__m512i pack_groups(const uint8_t* col, int64_t ld, int64_t live, __mmask16 m, uint8_t* dst) {
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
  return sum;
}

// The layouts above from per-tile arrays: w int8 (grid_k, 256, T N), s uint8 levels (grid_k, 256, N)
// (empty without read noise). Word lines past K and columns past N are zeros; corr = 128 sum_k w.
// The layouts above from per-tile bytes: src (grid_k, 256, ld) holding `terms` blocks of n columns
// (whole codes [, fractions]) from its first column, vs (grid_k, 256, n) variance levels (null: none).
void pack_tiles(const uint8_t* src, int64_t ld, const uint8_t* vs, int64_t gk, int64_t n, int64_t nv, int64_t k,
                int64_t terms, uint8_t* dst, int32_t* c, uint8_t* vd) {
  // A work item packs kPackVectors column vectors of one tile (each vector's output is its own)
  const int64_t blocks = (nv + kPackVectors - 1) / kPackVectors;
  auto work = std::make_shared<Work>();
  work->items = gk * blocks;
  work->item = [=](int64_t item) {
    const int64_t tile = item / blocks, v0 = item % blocks * kPackVectors, v1 = std::min(nv, v0 + kPackVectors);
    const int64_t live = std::clamp<int64_t>(k - tile * kTileRows, 0, kTileRows);
    for (int64_t v = v0; v < v1; ++v) {
      const __mmask16 m = column_mask(static_cast<int>(n - v * kLanes));
      const int64_t at = tile * nv + v;
      for (int64_t t = 0; t < terms; ++t) {
        const __m512i sum = pack_groups(src + tile * kTileRows * ld + t * n + v * kLanes, ld, live, m,
                                        dst + (at * terms + t) * kTileRows * kLanes);
        _mm512_storeu_si512(c + (at * terms + t) * kLanes, _mm512_slli_epi32(sum, 7));  // 128 sum_k w
      }
      if (vs != nullptr) pack_groups(vs + tile * kTileRows * n + v * kLanes, n, live, m, vd + at * kTileRows * kLanes);
    }
  };
  execute(work, gk * nv * (terms + (vs != nullptr)) * kTileRows * kLanes * 16);
}

ffi::Error PackTiles(ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::U8> s, int64_t k, int64_t terms, int64_t noise,
                     ffi::ResultBuffer<ffi::S8> wp, ffi::ResultBuffer<ffi::S32> corr,
                     ffi::ResultBuffer<ffi::U8> sp) {
  const auto wd = w.dimensions();
  const auto pd = wp->dimensions();
  if (wd.size() != 3 || wd[1] != kTileRows || pd.size() != 6 || pd[2] != terms)
    return ffi::Error::InvalidArgument("sidra_pack_tiles: unexpected operand layout");
  pack_tiles(reinterpret_cast<const uint8_t*>(w.typed_data()), wd[2], noise ? s.typed_data() : nullptr, wd[0],
             wd[2] / terms, pd[1], k, terms, reinterpret_cast<uint8_t*>(wp->typed_data()), corr->typed_data(),
             sp->typed_data());
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// ISPP write-verify (sidra_core.ispp), cell by cell: each cell's pulses run to its end in a loop,
// 16 cells a vector lane each, instead of XLA's chunks of 6 pulses over every active cell with a
// compaction between chunks. Every draw is keyed by (seed, cell id, pulse), so the order changes
// nothing: the arithmetic is sidra_core.rng's and ispp's, operation for operation as XLA:CPU
// compiles them (each product feeding a sum contracted into one FMA), the same bits.

inline uint32_t mix32s(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

inline uint32_t hash_bits(uint32_t seed, uint32_t counter) {  // rng.bits
  return mix32s(mix32s(counter * 0x9E3779B9u ^ seed) + (seed ^ 0x68E31DA4u));
}

inline float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t as_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float log_poly(float x) {  // rng._log
  const uint32_t b = as_bits(x);
  const float e = static_cast<float>(static_cast<int32_t>((b >> 23) & 0xFF) - 127);
  const float t = as_float((b & 0x7FFFFF) | 0x3F800000) - 1.0f;
  float p = kLog[0];
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = std::fma(p, t, kLog[i]);
  return std::fma(e, 0.6931471805599453f, p * t);
}

constexpr float kErfinv1[] = {2.81022636e-08f, 3.43273939e-07f, -3.5233877e-06f, -4.39150654e-06f, 0.00021858087f,
                              -0.00125372503f, -0.00417768164f, 0.246640727f, 1.50140941f};
constexpr float kErfinv2[] = {-0.000200214257f, 0.000100950558f, 0.00134934322f, -0.00367342844f, 0.00573950773f,
                              -0.0076224613f, 0.00943887047f, 1.00167406f, 2.83297682f};

inline float erfinv(float x) {  // rng._erfinv
  const float w = -log_poly((1.0f - x) * (1.0f + x));
  const float w1 = w - 2.5f;
  float p1 = kErfinv1[0];
#pragma GCC unroll 8
  for (int i = 1; i < 9; ++i) p1 = std::fma(p1, w1, kErfinv1[i]);
  const float w2 = std::sqrt(w) - 3.0f;
  float p2 = kErfinv2[0];
#pragma GCC unroll 8
  for (int i = 1; i < 9; ++i) p2 = std::fma(p2, w2, kErfinv2[i]);
  return (w < 5.0f ? p1 : p2) * x;
}

constexpr float kRoot2 = 1.4142135623730951f;

inline float uniform(uint32_t seed, uint32_t counter) {  // rng.uniform: [0, 1) with 23 random bits
  return as_float((hash_bits(seed, counter) >> 9) | 0x3F800000u) - 1.0f;
}

inline float open_uniform(uint32_t seed, uint32_t counter) {  // rng.normal's uniform on (-1, 1)
  return (static_cast<float>(hash_bits(seed, counter) >> 9) + 0.5f) * (2.0f / (1 << 23)) - 1.0f;
}

inline float normal(uint32_t seed, uint32_t counter) {  // rng.normal
  return kRoot2 * erfinv(open_uniform(seed, counter));
}

// crossbar._draw_nu: a cell's drift exponent max(mean + std z, 0), z = rng.normal(seed, id), as
// XLA:CPU computes it: std folded into z's factor root 2 (k = std * root 2), the sum one FMA.
inline float drift_exponent(uint32_t seed, uint32_t id, float k, float mean) {
  return std::max(std::fma(k, erfinv(open_uniform(seed, id)), mean), 0.0f);
}

// ispp's parameters, in its order (_first_verify's are the subset it names).
struct IsppParams {
  float tol_u, read_sigma, step0, ramp, c2c;
  int32_t max_pulses;
  float g_min_u, relax, g_min, span;
};

constexpr int64_t kIsppCells = 4096;  // cells of one work item

inline __m512 erfinv(__m512 x) {  // rng._erfinv; its tail polynomial only where a lane needs it
  const __m512 w = _mm512_castsi512_ps(_mm512_xor_si512(
      _mm512_castps_si512(log_poly(_mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), x),
                                                 _mm512_add_ps(_mm512_set1_ps(1.0f), x)))),
      _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 w1 = _mm512_sub_ps(w, _mm512_set1_ps(2.5f));
  __m512 p = _mm512_set1_ps(kErfinv1[0]);
  for (int i = 1; i < 9; ++i) p = _mm512_fmadd_ps(p, w1, _mm512_set1_ps(kErfinv1[i]));
  const __mmask16 tail = _mm512_cmp_ps_mask(w, _mm512_set1_ps(5.0f), _CMP_NLT_UQ);
  if (tail) {
    const __m512 w2 = _mm512_sub_ps(_mm512_sqrt_ps(w), _mm512_set1_ps(3.0f));
    __m512 p2 = _mm512_set1_ps(kErfinv2[0]);
    for (int i = 1; i < 9; ++i) p2 = _mm512_fmadd_ps(p2, w2, _mm512_set1_ps(kErfinv2[i]));
    p = _mm512_mask_mov_ps(p, tail, p2);
  }
  return _mm512_mul_ps(p, x);
}

// Cells [0, m) written towards their targets: their pulses given, and their final G (siemens) where
// they got a pulse, stored at their index `to` in g and pulses, as ispp._pulse_chunk's steps
// repeated until each cell is done, then its relaxation. A vector's 16 lanes step 16 cells at once;
// a lane whose cell is done takes the next one (an expanding load).
void write_verify(const float* u0, const float* target0, const uint32_t* ids, const int32_t* to, int32_t m,
                  uint32_t seed, const float* relax_z, const IsppParams& a, float* g, int32_t* pulses) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
  const __m512 fzero = _mm512_setzero_ps(), fone = _mm512_set1_ps(1.0f);
  const __m512 scale = _mm512_set1_ps(2.0f / (1 << 16)), root2 = _mm512_set1_ps(kRoot2);
  __m512 u = fzero, target = fzero;
  __m512i id = zero, cell = zero, dest = zero, n = zero, ramp_n = zero, last_dir = zero;
  __mmask16 idle = 0xFFFF;
  int32_t next = 0;
  for (;;) {
    if (idle && next < m) {  // the idle lanes take the next cells, in order
      const int lanes = __builtin_popcount(idle), take = std::min(lanes, static_cast<int>(m - next));
      unsigned fill = idle;
      if (take < lanes) {  // the last cells: the lowest `take` idle lanes
        fill = 0;
        for (unsigned rest = idle; __builtin_popcount(fill) < take; rest &= rest - 1) fill |= rest & (0u - rest);
      }
      cell = _mm512_mask_expand_epi32(cell, fill, _mm512_add_epi32(lane, _mm512_set1_epi32(next)));
      u = _mm512_mask_expandloadu_ps(u, fill, u0 + next);
      target = _mm512_mask_expandloadu_ps(target, fill, target0 + next);
      id = _mm512_mask_expandloadu_epi32(id, fill, ids + next);
      dest = _mm512_mask_expandloadu_epi32(dest, fill, to + next);
      n = _mm512_mask_mov_epi32(n, fill, zero);
      ramp_n = _mm512_mask_mov_epi32(ramp_n, fill, zero);
      last_dir = _mm512_mask_mov_epi32(last_dir, fill, zero);
      next += take;
      idle = static_cast<__mmask16>(idle & ~fill);
    }
    if (idle == 0xFFFF) return;
    // one verify read and, unless it passes, one pulse: both draws from one hash (rng.normal_pair)
    const __m512i b = hash_bits(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(seed)),
                                                 _mm512_mullo_epi32(n, _mm512_set1_epi32(static_cast<int>(2654435761u)))),
                                id);
    const __m512 read_draw = _mm512_mul_ps(root2, erfinv(_mm512_sub_ps(
        _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 16)), _mm512_set1_ps(0.5f)), scale), fone)));
    const __m512 c2c_draw = _mm512_mul_ps(root2, erfinv(_mm512_sub_ps(
        _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xFFFF))),
                                    _mm512_set1_ps(0.5f)), scale), fone)));
    const __m512 g_read = _mm512_fmadd_ps(
        _mm512_mul_ps(_mm512_add_ps(u, _mm512_set1_ps(a.g_min_u)), _mm512_set1_ps(a.read_sigma)), read_draw, u);
    const __m512 err = _mm512_sub_ps(target, g_read);
    const __mmask16 fin = _mm512_cmp_ps_mask(_mm512_abs_ps(err), _mm512_set1_ps(a.tol_u), _CMP_LE_OQ) |
                          _mm512_cmp_epi32_mask(n, _mm512_set1_epi32(a.max_pulses), _MM_CMPINT_NLT);
    const __mmask16 up = _mm512_cmp_ps_mask(err, fzero, _CMP_GT_OQ);
    const __m512i direction = _mm512_mask_mov_epi32(_mm512_set1_epi32(-1), up, one);
    const __m512i ramp = _mm512_maskz_add_epi32(_mm512_cmpeq_epi32_mask(direction, last_dir), ramp_n, one);
    const __m512 step = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_set1_ps(a.step0), _mm512_fmadd_ps(_mm512_set1_ps(a.ramp), _mm512_cvtepi32_ps(ramp), fone)),
        _mm512_max_ps(_mm512_fmadd_ps(_mm512_set1_ps(a.c2c), c2c_draw, fone), fzero));
    const __m512 du = _mm512_mask_mov_ps(
        _mm512_mul_ps(_mm512_sub_ps(fzero, step), u), up, _mm512_mul_ps(step, _mm512_sub_ps(fone, u)));
    const __m512 moved = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(u, du), fzero), fone);
    const __mmask16 pulse = static_cast<__mmask16>(~fin & ~idle), done = static_cast<__mmask16>(fin & ~idle);
    u = _mm512_mask_mov_ps(u, pulse, moved);
    ramp_n = _mm512_mask_mov_epi32(ramp_n, pulse, ramp);
    last_dir = _mm512_mask_mov_epi32(last_dir, pulse, direction);
    n = _mm512_mask_add_epi32(n, pulse, n, one);
    if (done) {  // relaxation right after the last verify, then the cell's G and pulses out
      __m512 settled = u;
      if (a.relax != 0) {
        const __m512 z = _mm512_mask_i32gather_ps(fzero, done, cell, relax_z, 4);
        settled = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(
            _mm512_mul_ps(_mm512_add_ps(u, _mm512_set1_ps(a.g_min_u)), _mm512_set1_ps(a.relax)), z, u), fzero), fone);
      }
      // (a cell that passes before its first pulse keeps its G exactly)
      const __mmask16 moved_cell = _mm512_mask_cmpgt_epi32_mask(done, n, zero);
      _mm512_mask_i32scatter_ps(g, moved_cell, dest,
                                _mm512_fmadd_ps(settled, _mm512_set1_ps(a.span), _mm512_set1_ps(a.g_min)), 4);
      _mm512_mask_i32scatter_epi32(pulses, done, dest, n, 4);
      idle |= done;
    }
  }
}

// ispp.program_cells on cells [0, n) (at most kIsppCells): each cell's final G and pulses given.
// Every cell gets a verify read first; one that passes keeps its G with no pulse, a stuck one that
// fails is pulsed max_pulses times without moving (a controller gives up only then), the others are
// written to their end (write_verify), gathered into one run so its lanes stay full.
void ispp_cells(const float* g0, const float* g1, const uint8_t* stuck, const uint32_t* ids, int64_t n,
                uint32_t seed, uint32_t relax_seed, const IsppParams& a, float* g, int32_t* pulses) {
  alignas(64) float u[kIsppCells], target[kIsppCells], relax_z[kIsppCells];
  alignas(64) uint32_t id[kIsppCells];
  alignas(64) int32_t cell[kIsppCells];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i verify_seed = _mm512_set1_epi32(static_cast<int>(mix32s(seed)));
  const __m512 g_min = _mm512_set1_ps(a.g_min), span = _mm512_set1_ps(a.span), fone = _mm512_set1_ps(1.0f);
  int32_t m = 0;  // the cells to write, gathered
  for (int64_t i = 0; i < n; i += kLanes) {  // the first verify read, 16 cells at a time
    const __mmask16 valid = n - i >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 from = _mm512_maskz_loadu_ps(valid, g0 + i), to = _mm512_maskz_loadu_ps(valid, g1 + i);
    const __m512i cid = _mm512_maskz_loadu_epi32(valid, ids + i);
    const __m512 ui = _mm512_div_ps(_mm512_sub_ps(from, g_min), span);
    const __m512 ti = _mm512_div_ps(_mm512_sub_ps(to, g_min), span);
    const __m512 z = _mm512_mul_ps(_mm512_set1_ps(kRoot2), erfinv(_mm512_sub_ps(_mm512_mul_ps(
        _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(hash_bits(verify_seed, cid), 9)), _mm512_set1_ps(0.5f)),
        _mm512_set1_ps(2.0f / (1 << 23))), fone)));
    const __m512 g_read = _mm512_fmadd_ps(
        _mm512_mul_ps(_mm512_add_ps(ui, _mm512_set1_ps(a.g_min_u)), _mm512_set1_ps(a.read_sigma)), z, ui);
    const __mmask16 failed = _mm512_mask_cmp_ps_mask(valid, _mm512_abs_ps(_mm512_sub_ps(ti, g_read)),
                                                     _mm512_set1_ps(a.tol_u), _CMP_GT_OQ);
    const __mmask16 held = stuck == nullptr ? 0 : _mm512_mask_test_epi32_mask(
        failed, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, stuck + i)), _mm512_set1_epi32(0xFF));
    const __mmask16 write = static_cast<__mmask16>(failed & ~held);
    _mm512_mask_storeu_ps(g + i, valid, from);  // unless written below
    _mm512_mask_storeu_epi32(pulses + i, valid, _mm512_maskz_mov_epi32(held, _mm512_set1_epi32(a.max_pulses)));
    _mm512_mask_compressstoreu_epi32(cell + m, write, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i))));
    _mm512_mask_compressstoreu_ps(u + m, write, ui);
    _mm512_mask_compressstoreu_ps(target + m, write, ti);
    _mm512_mask_compressstoreu_epi32(id + m, write, cid);
    m += __builtin_popcount(write);
  }
  if (a.relax != 0)  // each cell's relaxation draw, keyed by its id alone: all at once
    for (int32_t j = 0; j < m; ++j) relax_z[j] = normal(relax_seed, id[j]);
  write_verify(u, target, id, cell, m, seed, relax_z, a, g, pulses);
}

// body(lo, hi) over cells [0, n) in work items of kIsppCells, `cost` MACs' worth a cell.
template <class Body>
void for_cells(int64_t n, int64_t cost, Body body) {
  auto work = std::make_shared<Work>();
  work->items = (n + kIsppCells - 1) / kIsppCells;
  work->item = [=](int64_t item) {
    const int64_t lo = item * kIsppCells;
    body(lo, std::min(n, lo + kIsppCells));
  };
  execute(work, n * cost);
}

}  // namespace

// ispp.program_cells: cells from g0 towards g1 (siemens, flat), each cell's final G and pulses
// given (ispp_cells). params: tol_u, read_sigma, step0, ramp, c2c, g_min_u, relax, g_min, span.
extern "C" void sidra_ispp_write(const float* g0, const float* g1, const uint8_t* stuck, const uint32_t* ids,
                                 int64_t n, uint32_t seed, uint32_t relax_seed, const float* params,
                                 int32_t max_pulses, float* g, int32_t* pulses) {
  const IsppParams a{params[0], params[1], params[2], params[3], params[4], max_pulses,
                     params[5], params[6], params[7], params[8]};
  for_cells(n, 512, [=](int64_t lo, int64_t hi) {
    ispp_cells(g0 + lo, g1 + lo, stuck == nullptr ? nullptr : stuck + lo, ids + lo, hi - lo, seed, relax_seed, a,
               g + lo, pulses + lo);
  });
}

// crossbar.program of INT8 codes (kp x np, padded to the tile grid) onto fresh tiles, both planes of
// a work item's cells at once: each cell's physical id (its tile from tile_ids, row-major over the
// grid_k x grid_n tiles of rows x cols), the planes' stuck maps (crossbar._stuck_map), the targets
// g_min + max(+-code, 0) dG with a stuck cell's partner set to keep the pair's difference
// (crossbar._pair_targets), write-verify from G_min (a stuck cell from its rail; ISPP off: the
// target written at once, one pulse where it differs), and the drift exponents of the cells written
// and not stuck (crossbar._nu; nu null: not drawn). seeds: stuck, ISPP and relaxation, drift, each
// for (plus, minus). params: stuck off, off + on rate, dG, g_min, g_max, nu mean, nu std, then
// sidra_ispp_write's. With g_levels ({g_min, step}) the conductances are written as uint16 levels
// (cells.Levels.encode: rint((G - g_min) / step) within [0, 127 x 512]) and, with res, their int8
// residuals against the codes' targets in steps of 2^shift levels (cells.Levels.residuals), else
// as float32 siemens; bits (nullable): per plane a bit per cell written and not stuck
// (cells.pack_bits' order).
extern "C" void sidra_program(const int8_t* codes, int64_t kp, int64_t np_, int64_t rows, int64_t cols,
                              const uint32_t* tile_ids, int64_t grid_n, const uint32_t* seeds, const float* params,
                              int32_t max_pulses, int32_t ispp, const float* g_levels, int32_t shift, void* g_plus,
                              void* g_minus, int8_t* res_plus, int8_t* res_minus, float* nu_plus, float* nu_minus,
                              int8_t* stuck_plus, int8_t* stuck_minus, int32_t* writes_plus, int32_t* writes_minus,
                              uint8_t* bits_plus, uint8_t* bits_minus) {
  const float off = params[0], off_on = params[1], dg = params[2], g_min = params[3], g_max = params[4];
  const float nu_mean = params[5], nu_k = params[6] * kRoot2;
  const IsppParams a{params[7], params[8], params[9], params[10], params[11], max_pulses,
                     params[12], params[13], params[14], params[15]};
  void* const g_out[2] = {g_plus, g_minus};
  int8_t* const res_out[2] = {res_plus, res_minus};
  float* const nu_out[2] = {nu_plus, nu_minus};
  uint8_t* const bits_out[2] = {bits_plus, bits_minus};
  int8_t* const stuck_out[2] = {stuck_plus, stuck_minus};
  int32_t* const writes_out[2] = {writes_plus, writes_minus};
  const uint32_t tile_cells = static_cast<uint32_t>(rows * cols);
  for_cells(kp * np_, 512, [=](int64_t lo, int64_t hi) {
    const int64_t n = hi - lo;
    alignas(64) float start[2][kIsppCells], target[2][kIsppCells];
    alignas(64) uint32_t id[kIsppCells];
    alignas(64) uint8_t stuck[2][kIsppCells];
    alignas(64) int8_t state[2][kIsppCells];
    for (int64_t i = lo, r = lo / np_, c = lo % np_; i < hi;) {  // ids, a run of one tile's row at a time
      const int64_t run = std::min({hi - i, np_ - c, cols - c % cols});
      const uint32_t first = tile_ids[(r / rows) * grid_n + c / cols] * tile_cells +
                             static_cast<uint32_t>((r % rows) * cols + c % cols);
      for (int64_t j = 0; j < run; ++j) id[i - lo + j] = first + static_cast<uint32_t>(j);
      i += run;
      c += run;
      if (c == np_) c = 0, ++r;
    }
    for (int p = 0; p < 2; ++p) {  // stuck cells, and where each cell starts: G_min or its rail
      int8_t* __restrict s = state[p];
      uint8_t* __restrict is_stuck = stuck[p];
      float* __restrict g0 = start[p];
      const uint32_t seed = seeds[p];
      for (int64_t i = 0; i < n; ++i) {  // off <= off_on: -1 below off, +1 from off to off_on
        const float v = uniform(seed, id[i]);
        const int below_off = v < off, below_on = v < off_on;
        s[i] = static_cast<int8_t>(below_on - 2 * below_off);
        is_stuck[i] = static_cast<uint8_t>(below_on);
        g0[i] = below_on > below_off ? g_max : g_min;
      }
      std::memcpy(stuck_out[p] + lo, s, n);
    }
    {  // targets; a cell stuck alone: its partner holds the pair's difference against the stuck rail
      const int8_t* __restrict code = codes + lo;
      const uint8_t* __restrict stuck_p = stuck[0];
      const uint8_t* __restrict stuck_m = stuck[1];
      const float* __restrict start_p = start[0];
      const float* __restrict start_m = start[1];
      float* __restrict tp = target[0];
      float* __restrict tm = target[1];
      for (int64_t i = 0; i < n; ++i) {
        const float c = static_cast<float>(code[i]);
        const float p = std::max(c, 0.0f) * dg + g_min, m = std::max(-c, 0.0f) * dg + g_min, diff = p - m;
        const int sp = stuck_p[i], sm = stuck_m[i];  // 0 or 1
        const float held_p = std::min(std::max(start_m[i] + diff, g_min), g_max);
        const float held_m = std::min(std::max(start_p[i] - diff, g_min), g_max);
        tp[i] = sm > sp ? held_p : p;
        tm[i] = sp > sm ? held_m : m;
      }
    }
    for (int p = 0; p < 2; ++p) {
      alignas(64) float g_cells[kIsppCells];
      float* __restrict g = g_levels != nullptr ? g_cells : static_cast<float*>(g_out[p]) + lo;
      int32_t* __restrict writes = writes_out[p] + lo;
      if (ispp) {
        ispp_cells(start[p], target[p], stuck[p], id, n, seeds[2 + p], seeds[4 + p], a, g, writes);
      } else {
        for (int64_t i = 0; i < n; ++i) {
          g[i] = stuck[p][i] ? start[p][i] : target[p][i];
          writes[i] = start[p][i] != target[p][i];
        }
      }
      if (g_levels != nullptr) {
        uint16_t* __restrict q = static_cast<uint16_t*>(g_out[p]) + lo;
        const float lv_min = g_levels[0], lv_step = g_levels[1], top = 127.0f * 512.0f;
        for (int64_t i = 0; i < n; ++i)
          q[i] = static_cast<uint16_t>(std::min(std::max(std::rint((g[i] - lv_min) / lv_step), 0.0f), top));
        if (res_out[p] != nullptr) {  // the nearest step of 2^shift levels from the target, halves to even
          int8_t* __restrict res = res_out[p] + lo;
          const int8_t* __restrict code = codes + lo;
          const int32_t half = shift > 0 ? 1 << (shift - 1) : 0, mask = (1 << shift) - 1, sign = p == 0 ? 1 : -1;
          for (int64_t i = 0; i < n; ++i) {
            const int32_t d = static_cast<int32_t>(q[i]) - std::max(sign * code[i], 0) * 512, rem = d & mask;
            const int32_t r = (d >> shift) + (shift > 0 && (rem > half || (rem == half && ((d >> shift) & 1))));
            res[i] = static_cast<int8_t>(r < -127 || r > 127 ? kException : r);
          }
        }
      }
      if (bits_out[p] != nullptr) {  // lo is a multiple of 8: whole bytes, the first bit the highest
        uint8_t* __restrict out = bits_out[p] + lo / 8;
        for (int64_t i = 0; i < n; i += 8) {
          uint8_t byte = 0;
          for (int64_t j = 0; j < 8; ++j)
            byte |= static_cast<uint8_t>(i + j < n && writes[i + j] > 0 && !stuck[p][i + j]) << (7 - j);
          out[i / 8] = byte;
        }
      }
      if (nu_out[p] != nullptr) {  // a fresh exponent for each cell written and not stuck
        float* __restrict nu = nu_out[p] + lo;
        const uint32_t seed = seeds[6 + p];
        for (int64_t i = 0; i < n; ++i) {
          const float z = drift_exponent(seed, id[i], nu_k, nu_mean);
          nu[i] = writes[i] > 0 && !stuck[p][i] ? z : 0.0f;
        }
      }
    }
  });
}

// crossbar._draw_nu: each cell's drift exponent (drift_exponent).
extern "C" void sidra_drift_exponents(const uint32_t* ids, int64_t n, uint32_t seed, float mean, float std,
                                      float* nu) {
  const float k = std * kRoot2;
  for_cells(n, 64, [=](int64_t lo, int64_t hi) {
    const uint32_t* __restrict cid = ids;
    float* __restrict out = nu;
    for (int64_t i = lo; i < hi; ++i) out[i] = drift_exponent(seed, cid[i], k, mean);
  });
}

// crossbar._exp: e^x = 2^n e^r, x = n ln2 + r (ln2 in two parts), e^r by its Taylor polynomial.
constexpr float kExpTaylor[] = {static_cast<float>(1.0 / 5040), static_cast<float>(1.0 / 720),
                                static_cast<float>(1.0 / 120), static_cast<float>(1.0 / 24),
                                static_cast<float>(1.0 / 6), 0.5f, 1.0f, 1.0f};

inline float exp_poly(float x) {
  const float n = std::min(std::max(std::floor(std::fma(x, 1.4426950408889634f, 0.5f)), -126.0f), 127.0f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = kExpTaylor[0];
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = std::fma(p, r, kExpTaylor[i]);
  return p * as_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

constexpr uint32_t kDitherSeed = 0x5EED;  // crossbar._DITHER_SEED

// crossbar._read_array for a packed read (crossbar.snapshot's native path) of a weight written at
// once, without IR drop or drift compensation: each cell's G drifted as crossbar._drift_kernel
// drifts it, G exp(-nu age) (nu null: no drift), the weights in code units (G+ - G-) / dg as
// (whole, fraction in 1/254) int8 pairs, the read-noise variances var_c (G+^2 + G-^2) as dithered
// levels 0..255 of a step per tile column (_variance_levels), packed as PackTiles packs them (one
// term where no weight has a fraction). Operation for operation as XLA:CPU compiles those steps
// (a division as a product with the divisor's inverse, contracted into a following sum), so both give the same
// bits. gp, gm, nu: (gk 256, gn cols) float32; wp, corr sized for two terms; sp, step null
// without read noise. Returns the terms packed.
// Cells as sidra_core.cells holds them: with `g_levels` ({g_min, step}) gp, gm are int8 residuals
// (cells.Residuals) of the codes' target levels in steps of 2^shift levels, the cells of
// exc_idx (sorted flat indices, exc_n per plane) at their levels exc_level, G = level x step + g_min
// (Levels.expand, Levels.decode); with `bits` (per plane, cells.pack_bits) nu is drawn for
// each cell whose bit is set (drift_exponent of its id, ProgrammedWeight.exponents: tile_ids, the
// planes' nu_seeds and nu_params {std, mean}), 0 for the others, instead of read from nu_p, nu_m.
extern "C" int sidra_snapshot(const void* gp, const void* gm, const float* nu_p, const float* nu_m, float age_p,
                              float age_m, int64_t gk, int64_t gn, int64_t cols, int64_t k, int64_t n, float dg,
                              float var_c, const float* g_levels, const int8_t* codes, int32_t shift,
                              const int64_t* exc_idx_p, const uint16_t* exc_level_p, int64_t exc_n_p,
                              const int64_t* exc_idx_m, const uint16_t* exc_level_m, int64_t exc_n_m,
                              const uint8_t* bits_p, const uint8_t* bits_m,
                              const uint32_t* tile_ids, const uint32_t* nu_seeds, const float* nu_params, int8_t* wp,
                              int32_t* corr, uint8_t* sp, float* step) {
  const int64_t ld = gn * cols, nv = (n + kLanes - 1) / kLanes;
  const float inv_dg = 1.0f / dg;
  std::vector<int8_t> pair(gk * kTileRows * 2 * n);
  std::vector<uint8_t> levels(sp != nullptr ? gk * kTileRows * n : 0);
  std::atomic<bool> fraction{false};
  int8_t* pairs = pair.data();
  uint8_t* level = levels.data();
  std::atomic<bool>* any_fraction = &fraction;
  auto work = std::make_shared<Work>();
  work->items = gk * gn;
  work->item = [=](int64_t item) {
    const int64_t tk = item / gn, c0 = item % gn * cols, m = std::max<int64_t>(0, std::min(n, c0 + cols) - c0);
    alignas(64) float x[kTileRows], y[kTileRows], d[kTileRows];
    std::vector<float> var(sp != nullptr ? kTileRows * m : 0), top(m, 0.0f);
    bool has_fraction = false;
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int64_t row = tk * kTileRows + r;
      float* __restrict xp = x;
      float* __restrict yp = y;
      float* __restrict dp = d;
      for (int p = 0; p < 2; ++p) {  // the row's cells of each plane, drifted
        float* __restrict out = p == 0 ? xp : yp;
        if (g_levels != nullptr) {
          const int64_t i0 = row * ld + c0;
          const int8_t* __restrict res = static_cast<const int8_t*>(p == 0 ? gp : gm) + i0;
          const int8_t* __restrict code = codes + i0;
          const int32_t unit = 1 << shift, sign = p == 0 ? 1 : -1;
          for (int64_t c = 0; c < m; ++c) {
            const int32_t level = std::max(sign * code[c], 0) * 512 + res[c] * unit;
            out[c] = static_cast<float>(level) * g_levels[1] + g_levels[0];
          }
          const int64_t* const idx = p == 0 ? exc_idx_p : exc_idx_m;
          const uint16_t* const exact = p == 0 ? exc_level_p : exc_level_m;
          const int64_t* const end = idx + (p == 0 ? exc_n_p : exc_n_m);
          for (const int64_t* e = std::lower_bound(idx, end, i0); e < end && *e < i0 + m; ++e)
            out[*e - i0] = static_cast<float>(exact[e - idx]) * g_levels[1] + g_levels[0];
        } else {
          const float* __restrict a = static_cast<const float*>(p == 0 ? gp : gm) + row * ld + c0;
          for (int64_t c = 0; c < m; ++c) out[c] = a[c];
        }
        const float age = p == 0 ? age_p : age_m;
        if (bits_p != nullptr) {
          const uint8_t* __restrict bits = p == 0 ? bits_p : bits_m;
          const uint32_t seed = nu_seeds[p];
          const float nu_k = nu_params[0] * kRoot2;  // as sidra_drift_exponents
          const uint32_t id0 = tile_ids[item] * static_cast<uint32_t>(kTileRows * cols) + static_cast<uint32_t>(r * cols);
          const int64_t i0 = row * ld + c0;
          // the drifting cells (bit set) gathered, their exponents drawn in a loop without branches
          // (vectorised); the others keep G (a factor of exp(-0 age) = 1 exactly)
          alignas(64) int32_t at[kTileRows];
          alignas(64) float z[kTileRows], f[kTileRows];
          int64_t drifting = 0;
          for (int64_t c = 0; c < m; ++c) {
            const int64_t i = i0 + c;
            at[drifting] = static_cast<int32_t>(c);
            drifting += (bits[i >> 3] >> (7 - (i & 7))) & 1;
          }
          for (int64_t j = 0; j < drifting; ++j)
            z[j] = drift_exponent(seed, id0 + static_cast<uint32_t>(at[j]), nu_k, nu_params[1]);
          for (int64_t j = 0; j < drifting; ++j) f[j] = exp_poly(-z[j] * age);
          for (int64_t j = 0; j < drifting; ++j) out[at[j]] = out[at[j]] * f[j];
        } else if (nu_p != nullptr) {
          const float* __restrict nu = (p == 0 ? nu_p : nu_m) + row * ld + c0;
          for (int64_t c = 0; c < m; ++c) out[c] = out[c] * exp_poly(-nu[c] * age);
        }
      }
      for (int64_t c = 0; c < m; ++c) dp[c] = xp[c] - yp[c];
      alignas(64) float q[kTileRows], f[kTileRows];
      float* __restrict qp = q;
      float* __restrict fp = f;
      float* __restrict v = var.data() + r * m;
      float* __restrict t = top.data();
      for (int64_t c = 0; c < m; ++c) {
        const float w = dp[c] * inv_dg;
        qp[c] = std::min(std::max(std::rint(w), -127.0f), 127.0f);
        fp[c] = std::rint((w - qp[c]) * 254.0f);
      }
      if (sp != nullptr)
        for (int64_t c = 0; c < m; ++c) {
          v[c] = var_c * std::fma(xp[c], xp[c], yp[c] * yp[c]);
          t[c] = std::max(t[c], v[c]);
        }
      int8_t* __restrict whole = pairs + row * 2 * n + c0;
      int8_t* __restrict frac = whole + n;
      int nonzero = 0;
      for (int64_t c = 0; c < m; ++c) {
        whole[c] = static_cast<int8_t>(qp[c]);
        frac[c] = static_cast<int8_t>(fp[c]);
        nonzero |= fp[c] != 0.0f;
      }
      has_fraction |= nonzero != 0;
    }
    if (has_fraction) any_fraction->store(true, std::memory_order_relaxed);
    if (sp == nullptr) return;
    for (int64_t c = c0; c < c0 + m; ++c) {  // the step of each tile column, then its cells' levels
      const float s = top[c - c0] * (1.0f / 255.0f);
      step[tk * n + c] = s > 0.0f ? s : 1.0f;
    }
    for (int64_t r = 0; r < kTileRows; ++r) {
      const uint32_t base = static_cast<uint32_t>((tk * kTileRows + r) * n);
      uint8_t* __restrict out = level + (tk * kTileRows + r) * n;
      const float* __restrict v = var.data() + r * m;
      const float* __restrict st = step + tk * n;
      for (int64_t c = c0; c < c0 + m; ++c) {
        const float u = uniform(kDitherSeed, base + static_cast<uint32_t>(c));
        out[c] = static_cast<uint8_t>(std::min(std::floor(std::fma(v[c - c0], 1.0f / st[c], u)), 255.0f));
      }
    }
  };
  execute(work, gk * gn * cols * kTileRows * 64);
  const int64_t terms = fraction.load() ? 2 : 1;
  pack_tiles(reinterpret_cast<const uint8_t*>(pairs), 2 * n, sp != nullptr ? level : nullptr, gk, n, nv, k, terms,
             reinterpret_cast<uint8_t*>(wp), corr, sp);
  return static_cast<int>(terms);
}

// The MVM of Mvm called directly on host buffers (no XLA program: any row count, no compile).
// w, corr, s as vnni.pack lays them out, grid_k tiles of nv vectors; s, step null without read
// noise; lsb, gain, bias null when absent. Returns 0, or 1 for a layout Mvm would refuse.
extern "C" int sidra_mvm_direct(const float* x, int64_t rows, const int8_t* w, const int32_t* corr,
                                const uint8_t* s, const float* step, int64_t grid_k, int64_t nv, int64_t k,
                                int64_t n, int64_t terms, const float* lsb, const float* gain, const float* scale,
                                const float* bias, uint32_t seed, float qmax, float dac_qmax, float* y) {
  if ((terms != 1 && terms != 2) || k > grid_k * kTileRows || n > nv * kLanes || rows < 0) return 1;
  Problem q{nullptr, nullptr, w, corr, s, step, rows, k, n, grid_k, nv, grid_k * kTileRows, static_cast<int>(terms)};
  if (rows) run_mvm(q, rows, x, lsb, gain, scale, bias, seed, qmax, dac_qmax, y);
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraPackTiles, PackTiles,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("terms")
                                  .Attr<int64_t>("noise")
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraTileDots, TileDots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("terms")
                                  .Attr<int64_t>("noise")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraMvm, Mvm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("terms")
                                  .Attr<int64_t>("noise")
                                  .Attr<float>("qmax")
                                  .Attr<float>("dac_qmax")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraEngineMatmul, EngineMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("qmax")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("heads_first")
                                  .Attr<int64_t>("format")
                                  .Attr<float>("qmax")
                                  .Attr<int64_t>("contract")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The attention called directly on host buffers (C-contiguous float32 q, k, v, y in the layout
// heads_first picks; no XLA program, so any lengths), with an optional mask of (batches, heads,
// sq, sk): `keep` bool (uint8) or `add` float32 (`contract`: s x scale + add as one FMA), at most
// one. Returns 0, or 1 for what it refuses.
extern "C" int sidra_attention_direct(const float* q, const float* k, const float* v, int64_t batches, int64_t heads,
                                      int64_t sq, int64_t sk, int64_t d, int64_t dv, int64_t heads_first, float scale,
                                      int64_t format, float qmax, const uint8_t* keep, const float* add,
                                      int64_t contract, float* y) {
  if (format < 0 || format > 2 || d > kMaxEngineK || sk > kMaxEngineK || batches < 0 || heads < 0 || sq < 0 ||
      sk < 0 || (keep && add))
    return 1;
  run_attention(q, k, v, y, batches, heads, sq, sk, d, dv, heads_first != 0, scale, static_cast<int>(format), qmax,
                keep, add, contract != 0);
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraEngineMap, EngineMap,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("format")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SidraEngineNorm, EngineNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("rms")
                                  .Attr<int64_t>("format")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// EngineMap and EngineNorm called directly on host buffers (C-contiguous float32; w, b null when
// absent). Return 0, or 1 for an unknown op or format.
extern "C" int sidra_engine_map(const float* x, int64_t n, int64_t op, int64_t format, float* y) {
  if (op < 0 || op >= kMapOps || format < 0 || format > 2 || n < 0) return 1;
  run_map(x, n, static_cast<int>(op), static_cast<int>(format), y);
  return 0;
}

extern "C" int sidra_engine_norm(const float* x, int64_t rows, int64_t width, const float* w, const float* b, float eps,
                                 int64_t rms, int64_t format, float* y, float* mean, float* rstd) {
  if (format < 0 || format > 2 || rows < 0 || width < 0) return 1;
  run_norm(x, rows, width, w, b, eps, rms != 0, static_cast<int>(format), y, mean, rstd);
  return 0;
}
