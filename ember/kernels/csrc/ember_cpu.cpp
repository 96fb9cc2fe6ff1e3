// ember's C++ CPU kernels, registered as `torch.ops.ember_cpu.*` (see ember/kernels/__init__.py).
// Built once per machine (ember/kernels/__init__.py runs the compiler) with -O3 -march=native.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#ifdef EMBER_FAST_CALLS
#define PY_SSIZE_T_CLEAN
#include <Python.h>  // before the standard headers, as Python asks
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Widest vector, in floats (scratch padding).
constexpr int64_t kLanesMax = 16;
// fp32 activations: steps of up to this many rows (decodes, batched decodes) run the fused,
// register-blocked GEMV (4 rows x 2 channels per block); larger ones widen the weight and run
// ATen's GEMM. Measured on llama-160m's 85 projections (bf16 weights), AMD EPYC, 2 cores,
// ms per pass, GEMV vs widen + GEMM: forced AVX2 M=32 58.6 vs 67.4, M=64 115.8 vs 120.9,
// M=256 471 vs 396; AVX-512 M=32 45.4 vs 67.8, M=64 80.5 vs 171.8.
constexpr int64_t kGemvMaxRows = 64;
// bf16 activations (native bf16 CPUs): steps above this many rows run ATen's bf16 GEMM
// (oneDNN AVX512-BF16 / AMX; M=32: 19.8 ms per pass against 45.4 for the fp32 GEMV).
constexpr int64_t kBf16GemvMaxRows = 8;
// fp32 weights: the GEMV up to this many rows, ATen's fp32 GEMM above (M=16: 46.1 vs 65.0 ms
// per pass AVX-512, 48.5 vs 62.1 AVX2; M=32: 84.2 vs 83.4 and 108.4 vs 89.9).
constexpr int64_t kFp32GemvMaxRows = 16;
// Weight rows widened per tile on the tiled path (an L2-sized fp32 buffer per thread).
constexpr int64_t kTileRows = 128;
// Steps of more than kGemvMaxRows rows widen the whole weight once and run one GEMM.
constexpr int64_t kWidenMaxElems = int64_t{1} << 25;  // 128 MiB of fp32

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vwiden(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline vfloat vwiden(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
inline vfloat vwiden(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vwiden(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
// The first n (0..16) lanes; the rest read as 0 / left unwritten.
inline vfloat vload_n(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline void vstore_n(float* p, vfloat v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
#define EMBER_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vwiden(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline vfloat vwiden(const c10::BFloat16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline vfloat vwiden(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vwiden(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline float vsum(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vfloat vload_n(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes_below(n)); }
inline void vstore_n(float* p, vfloat v, int64_t n) { _mm256_maskstore_ps(p, lanes_below(n), v); }
#define EMBER_SIMD 1
#endif

#if defined(__AVX512F__)
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vmaxs(vfloat a, float b) { return _mm512_max_ps(a, _mm512_set1_ps(b)); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vround(vfloat a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vfloat vfnma(vfloat a, vfloat b, vfloat c) { return _mm512_fnmadd_ps(a, b, c); }
inline vfloat vpow2_scale(vfloat p, vfloat n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// The kLanes horizontal sums of a[0..kLanes) as one vector (lane j = sum of a[j]), by a
// transpose-and-add tree: 45 shuffles and adds for 16 sums instead of 16 full reductions.
inline vfloat vsum_lanes(const vfloat* a) {
  vfloat b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const vfloat y0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vfloat y1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(EMBER_SIMD)
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vmaxs(vfloat a, float b) { return _mm256_max_ps(a, _mm256_set1_ps(b)); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vround(vfloat a) {
  return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vfloat vfnma(vfloat a, vfloat b, vfloat c) { return _mm256_fnmadd_ps(a, b, c); }
inline vfloat vpow2_scale(vfloat p, vfloat n) {  // p * 2^n, n integral in [-126, 127]
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
inline vfloat vsum_lanes(const vfloat* a) {
  vfloat b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
    c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                       _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
#endif

#ifdef EMBER_SIMD
// exp(x) for x <= 0 (softmax weights): Cephes' degree-6 polynomial on r = x - n ln2, times 2^n.
inline vfloat vexp(vfloat x) {
  x = vmaxs(x, -87.3f);  // keeps 2^n normal
  const vfloat n = vround(vmul(x, vset1(1.44269504f)));
  vfloat r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  vfloat p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset1(1.f)));
  return vpow2_scale(p, n);
}
#endif

inline float to_float(float v) { return v; }
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

// Rows n0..n0+rows-1 of the weight, widened to fp32, into dst [rows, K].
template <typename W>
inline void widen_rows(const W* w, float* dst, int64_t n0, int64_t rows, int64_t K) {
  for (int64_t r = 0; r < rows; ++r) {
    const W* wr = w + (n0 + r) * K;
    float* d = dst + r * K;
    int64_t k = 0;
#ifdef EMBER_SIMD
    // Explicit vectors: the scalar bf16 conversion did not vectorize (0.8 cycles/element).
    for (; k + kLanes <= K; k += kLanes) vstore(d + k, vwiden(wr + k));
#endif
    for (; k < K; ++k) d[k] = to_float(wr[k]);
  }
}

// y[m, n] for rows m0..m0+R-1 of x and channels n0..n1-1, C channels at a time: each weight
// row is read once for all R rows and widened to fp32 in registers; the R*C independent
// accumulators and C concurrent row streams keep enough loads in flight to approach memory
// bandwidth (one row at a time reached about half of it).
template <int R, int C, typename W>
inline void gemv_block(const float* x, const W* w, const float* bias,
                       float* y, int64_t K, int64_t N, int64_t m0, int64_t n) {
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * K;
  const W* wr[C];
  for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * K;
  float acc[R][C];
  int64_t k = 0;
#ifdef EMBER_SIMD
  vfloat va[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) va[r][c] = vzero();
  // Whole cache lines first, each prefetched once: the rows of the next block, page-sized
  // jumps the hardware prefetcher does not follow (measured on 85 llama-160m projections at
  // batch 1: 8.2 -> 3.1-4.7 ms). One prefetch per line, not per vector: a pass over the 85
  // projections 5.37 -> 5.24 ms (bf16, AVX-512), 5.51 -> 5.47 ms AVX2 (medians of 60
  // interleaved passes).
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line, a multiple of kLanes
  for (; k + kLine <= K; k += kLine) {
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[c] + k + C * K), _MM_HINT_T0);
      for (int64_t u = 0; u < kLine; u += kLanes) {
        const vfloat wv = vwiden(wr[c] + k + u);
        for (int r = 0; r < R; ++r) va[r][c] = vfma(vload(xr[r] + k + u), wv, va[r][c]);
      }
    }
  }
  for (; k + kLanes <= K; k += kLanes) {
    for (int c = 0; c < C; ++c) {
      const vfloat wv = vwiden(wr[c] + k);
      for (int r = 0; r < R; ++r) va[r][c] = vfma(vload(xr[r] + k), wv, va[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vsum(va[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
#endif
  for (; k < K; ++k) {
    for (int c = 0; c < C; ++c) {
      const float wv = to_float(wr[c][k]);
      for (int r = 0; r < R; ++r) acc[r][c] += xr[r][k] * wv;
    }
  }
  for (int c = 0; c < C; ++c) {
    const float b = bias ? bias[n + c] : 0.f;
    for (int r = 0; r < R; ++r) y[(m0 + r) * N + n + c] = acc[r][c] + b;
  }
}

template <int R, typename W>
inline void gemv_rows(const float* x, const W* w, const float* bias,
                      float* y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int C = R <= 2 ? 4 : 2;  // R*C accumulators fit the vector registers (AVX2: 16)
  int64_t n = n0;
  for (; n + C <= n1; n += C) gemv_block<R, C>(x, w, bias, y, K, N, m0, n);
  for (; n < n1; ++n) gemv_block<R, 1>(x, w, bias, y, K, N, m0, n);
}

// y [M, N] = x [M, K] @ w^T (+ bias), all fp32 but w; each thread owns a range of output
// channels.
template <typename W>
void gemv(const float* xp, const W* wp, const float* bp, float* yp, int64_t M,
          int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemv_rows<4>(xp, wp, bp, yp, K, N, m, n0, n1);
    switch (M - m) {  // the rest in one more pass
      case 3: gemv_rows<3>(xp, wp, bp, yp, K, N, m, n0, n1); break;
      case 2: gemv_rows<2>(xp, wp, bp, yp, K, N, m, n0, n1); break;
      case 1: gemv_rows<1>(xp, wp, bp, yp, K, N, m, n0, n1); break;
      default: break;
    }
  });
}

// y [M, N] = x [M, K] @ w^T (+ bias) for fp32 x and a bf16 weight in [N, K] (a tied LM head;
// every other fp32-activation linear is packed), fp32 math: the weight is widened to fp32 on the fly, never into a full copy per call.
// - M <= kGemvMaxRows (decodes, batched decodes): the fused GEMV, widening in registers.
// - Larger steps (prefill chunks) with a weight of at most kWidenMaxElems: the weight is
//   widened once into a reused fp32 buffer (a fresh multi-MB tensor per call would be
//   page-faulted in each time), then one multi-threaded GEMM. Engine steps run one at a time,
//   so one buffer serves every layer.
// - Larger weights: each thread widens kTileRows weight rows into an L2-sized fp32 tile and
//   runs one GEMM on it.
template <typename W>
at::Tensor widening_linear(const at::Tensor& x, const W* wp, const float* bp,
                           int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  if (M <= kGemvMaxRows) {
    at::Tensor y = at::empty({M, N}, x.options());
    gemv(xp, wp, bp, y.data_ptr<float>(), M, N, K);
    return y;
  }
  const auto bias_of = [&]() { return at::from_blob(const_cast<float*>(bp), {N}, x.options()); };
  if (N * K <= kWidenMaxElems) {
    static at::Tensor widened;
    if (!widened.defined() || widened.numel() < N * K) {
      widened = at::empty({N * K}, x.options());
    }
    float* dp = widened.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      widen_rows(wp, dp + n0 * K, n0, n1 - n0, K);
    });
    const at::Tensor wt = widened.narrow(0, 0, N * K).view({N, K}).t();
    return bp ? at::addmm(bias_of(), x, wt) : at::mm(x, wt);
  }
  // Tiled. Only out-of-place ops on the scratch tensors: inside a kernel they are inference
  // tensors, which must not be updated in place through the dispatcher.
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor tile = at::empty({kTileRows, K}, x.options());
    float* tp = tile.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      widen_rows(wp, tp, n0, rows, K);
      const at::Tensor part = at::mm(tile.narrow(0, 0, rows), x.t()).contiguous();  // [rows, M]
      const float* pp = part.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        const float b = bp ? bp[n0 + r] : 0.f;
        for (int64_t m = 0; m < M; ++m) yp[m * N + n0 + r] = pp[r * M + m] + b;
      }
    }
  });
  return y;
}

// x [..., K] as a contiguous fp32 [M, K] matrix, and the output shape [..., N].
std::pair<at::Tensor, std::vector<int64_t>> as_matrix(const at::Tensor& x_in, int64_t K,
                                                      int64_t N, const char* op) {
  TORCH_CHECK(x_in.size(-1) == K, op, ": x has ", x_in.size(-1), " features, w ", K);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  return {x_in.reshape({-1, K}).to(at::kFloat).contiguous(), out_shape};
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, at::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

// bf16 weights. fp32 activations (CPUs without native bf16 math): fp32 math at every size,
// widening the weight (`widening_linear`), never ATen's bf16 GEMM (measured ~11 GFLOP/s on
// AVX2 against ~80 for fp32). bf16 activations (native bf16 CPUs): the GEMV for decodes, ATen's
// bf16 GEMM (oneDNN: AMX / AVX512-BF16) for larger steps.
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "bf16_linear: w must be a contiguous bf16 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t M = x_in.numel() / K;
  if (M == 0 || (M > kBf16GemvMaxRows && x_in.scalar_type() != at::kFloat)) {
    return at::linear(x_in, w.to(x_in.scalar_type()), bias);
  }
  if (x_in.scalar_type() == at::kBFloat16 && x_in.is_contiguous() && x_in.size(-1) == K) {
    // bf16 decodes (native bf16 CPUs): widen x and narrow y in plain loops around the GEMV,
    // no ATen conversion ops (two dispatches and two allocations per call, 85 calls a step).
    thread_local std::vector<float> xs, ys;
    xs.resize(M * K);
    ys.resize(M * N);
    const c10::BFloat16* xb = x_in.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xs[i] = static_cast<float>(xb[i]);
    at::Tensor b;
    const float* bp = bias_ptr(bias, b);
    gemv(xs.data(), w.data_ptr<c10::BFloat16>(), bp, ys.data(), M, N, K);
    auto out_shape = x_in.sizes().vec();
    out_shape.back() = N;
    at::Tensor y = at::empty(out_shape, x_in.options());
    c10::BFloat16* yb = y.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) yb[i] = c10::BFloat16(ys[i]);
    return y;
  }
  auto [x, out_shape] = as_matrix(x_in, K, N, "bf16_linear");
  at::Tensor b;
  const float* bp = bias_ptr(bias, b);
  const at::Tensor y = widening_linear(x, w.data_ptr<c10::BFloat16>(), bp, N);
  return y.to(x_in.scalar_type()).view(out_shape);
}

// fp32 weights: the fused GEMV for decode-sized steps (ATen's M=1 GEMM read llama-160m's
// weights at ~14 GB/s of the ~49 GB/s an EPYC's 2 cores stream), ATen's fp32 GEMM above
// kFp32GemvMaxRows.
at::Tensor fp32_linear(const at::Tensor& x_in, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(),
              "fp32_linear: w must be a contiguous float32 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t M = x_in.numel() / K;
  if (M == 0 || M > kFp32GemvMaxRows || x_in.scalar_type() != at::kFloat) {
    return at::linear(x_in, w, bias);
  }
  auto [x, out_shape] = as_matrix(x_in, K, N, "fp32_linear");
  at::Tensor b;
  const float* bp = bias_ptr(bias, b);
  at::Tensor y = at::empty({M, N}, x.options());
  gemv(x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
  return y.view(out_shape);
}

// ---- Packed linears: weights re-laid once at load time into panels, fp32 math ----
//
// A weight [N, K] (fp32, bf16 or int8 with per-channel scales) is stored as [P, K, kPanel]:
// panel p holds output channels p*kPanel .. p*kPanel+kPanel-1 (zeros past N), k-major, so a
// panel is one contiguous stream and its row k is two vectors of weights for consecutive
// channels. A step multiplies it as an outer product: each x value is broadcast against the
// panel row (widened to fp32 in registers) into kRowBlock x 2 vector accumulators, so every
// weight vector read serves kRowBlock rows of x and no horizontal sums are needed (the dot-
// product GEMV above needs one per output). One kernel for every step size: decodes (M = 1,
// memory-bound), batched decodes and prefill chunks (compute-bound), never ATen's bf16 GEMM and
// no widened copy of a weight. Measured on llama-160m's 84 layer projections (bf16 weights,
// AMD EPYC, 2 cores), ms per pass, dot-product GEMV vs packed: AVX-512 M=1 4.34 vs 4.21,
// M=8 8.11 vs 6.03, M=32 27.7 vs 14.0 (344 GFLOP/s), M=128 packed 43.6 (444 GFLOP/s; MKL's
// fp32 GEMM ~200); forced AVX2 M=32 38.1 vs 27.2, M=128 packed 92 (210 GFLOP/s).
#ifdef EMBER_SIMD
constexpr int64_t kPanel = 2 * kLanes;
// Rows of x per register block: 2 * kRowBlock accumulators + 2 weight vectors + 1 broadcast
// fit the vector registers (AVX-512: 32, AVX2: 16).
constexpr int kRowBlock = kLanes == 16 ? 12 : 6;
#else
constexpr int64_t kPanel = 16;
constexpr int kRowBlock = 4;
#endif
// k values per pass over a panel: a panel slice of at most 128 KiB (fp32) stays in L2 while
// every row block of the step uses it.
constexpr int64_t kPanelDepth = 1024;
// How far ahead the panel stream is prefetched (decodes are memory-bound).
#ifndef EMBER_PANEL_PREFETCH
#define EMBER_PANEL_PREFETCH 4096
#endif
constexpr int64_t kPanelPrefetchBytes = EMBER_PANEL_PREFETCH;

// y[m0 .. m0+MR-1, n .. n+cols-1] (+)= x[.., k0:k1] @ panel[k0:k1]; after the last k slice,
// times scales and plus bias (both kPanel long, padded). `first`: y is not read.
template <int MR, typename W>
inline void panel_rows(const float* x, int64_t K, const W* pan, int64_t k0, int64_t k1,
                       float* y, int64_t N, int64_t cols, bool first, const float* sc,
                       const float* bi) {
#ifdef EMBER_SIMD
  vfloat a0[MR], a1[MR];
  const int64_t c0 = std::min<int64_t>(cols, kLanes), c1 = cols - c0;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    a0[r] = first ? vzero() : vload_n(y + r * N, c0);
    a1[r] = first ? vzero() : vload_n(y + r * N + kLanes, c1);
  }
  int64_t k = k0;
  if constexpr (MR == 1) {  // one row: four k at a time, so eight FMA chains are in flight
    vfloat b0[3] = {vzero(), vzero(), vzero()}, b1[3] = {vzero(), vzero(), vzero()};
    for (; k + 4 <= k1; k += 4) {
      const W* w = pan + k * kPanel;
      const char* ahead = reinterpret_cast<const char*>(w) + kPanelPrefetchBytes;
#pragma GCC unroll 8
      for (int64_t l = 0; l < 4 * kPanel * static_cast<int64_t>(sizeof(W)); l += 64) {
        _mm_prefetch(ahead + l, _MM_HINT_T0);
      }
      a0[0] = vfma(vset1(x[k]), vwiden(w), a0[0]);
      a1[0] = vfma(vset1(x[k]), vwiden(w + kLanes), a1[0]);
#pragma GCC unroll 3
      for (int u = 0; u < 3; ++u) {
        const vfloat xb = vset1(x[k + 1 + u]);
        b0[u] = vfma(xb, vwiden(w + (1 + u) * kPanel), b0[u]);
        b1[u] = vfma(xb, vwiden(w + (1 + u) * kPanel + kLanes), b1[u]);
      }
    }
    a0[0] = vadd(vadd(a0[0], b0[0]), vadd(b0[1], b0[2]));
    a1[0] = vadd(vadd(a1[0], b1[0]), vadd(b1[1], b1[2]));
  }
  for (; k < k1; ++k) {
    const char* ahead = reinterpret_cast<const char*>(pan + k * kPanel) + kPanelPrefetchBytes;
#pragma GCC unroll 2
    for (int64_t l = 0; l < kPanel * static_cast<int64_t>(sizeof(W)); l += 64) {
      _mm_prefetch(ahead + l, _MM_HINT_T0);
    }
    const vfloat w0 = vwiden(pan + k * kPanel), w1 = vwiden(pan + k * kPanel + kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const vfloat xb = vset1(x[r * K + k]);
      a0[r] = vfma(xb, w0, a0[r]);
      a1[r] = vfma(xb, w1, a1[r]);
    }
  }
  if (sc) {
    const vfloat s0 = vload(sc), s1 = vload(sc + kLanes), b0 = vload(bi), b1 = vload(bi + kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      a0[r] = vfma(a0[r], s0, b0);
      a1[r] = vfma(a1[r], s1, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    vstore_n(y + r * N, a0[r], c0);
    vstore_n(y + r * N + kLanes, a1[r], c1);
  }
#else
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float acc = first ? 0.f : y[r * N + j];
      for (int64_t k = k0; k < k1; ++k) acc += x[r * K + k] * to_float(pan[k * kPanel + j]);
      y[r * N + j] = sc ? acc * sc[j] + bi[j] : acc;
    }
  }
#endif
}

template <typename W>
using PanelKernel = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t,
                             int64_t, bool, const float*, const float*);

template <typename W, size_t... R>
constexpr std::array<PanelKernel<W>, sizeof...(R)> panel_kernels(std::index_sequence<R...>) {
  return {&panel_rows<static_cast<int>(R) + 1, W>...};
}

// The row blocks [b0, b1) of one task: rows_per rows each (balanced: 8 rows = 4 + 4), the last
// one partial.
struct RowBlocks {
  int64_t b0, b1, rows_per, M;
  template <typename F>
  void each(const F& f) const {  // f(first row, rows)
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * rows_per, rows = std::min(rows_per, M - m0);
      if (rows > 0) f(m0, rows);
    }
  }
};

// The tasks of a packed GEMM [M, K] x panels -> [M, N]: panels (a thread owns a contiguous run
// of them, so decodes stream contiguous memory), split by row blocks too when there are too few
// panels to keep every thread busy. Calls task(panel, first channel, channels, row blocks).
// Large steps go through x a chunk of row blocks at a time (`row_bytes`: bytes of x per row),
// every panel of the thread's run over one chunk before the next: the chunk (128 KiB) stays in
// L2 while the panels pass over it, instead of all of x streaming from L3 or memory once per
// panel. Decodes and small steps are one chunk.
#ifndef EMBER_X_CHUNK
#define EMBER_X_CHUNK (128 * 1024)
#endif
constexpr int64_t kXChunkBytes = EMBER_X_CHUNK;

template <typename Task>
void for_panel_tasks(int64_t M, int64_t N, int64_t row_bytes, const Task& task,
                     int64_t row_block = kRowBlock) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  const int64_t blocks = (M + row_block - 1) / row_block;
  const int64_t rows_per = (M + blocks - 1) / blocks;
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min(blocks, std::max<int64_t>(1, (2 * threads + P - 1) / P));
  const int64_t chunk =
      kXChunkBytes > 0 ? std::max<int64_t>(1, kXChunkBytes / (rows_per * row_bytes)) : blocks;
  at::parallel_for(0, P * splits, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t c0 = 0; c0 < blocks; c0 += chunk) {
      const int64_t c1 = std::min(blocks, c0 + chunk);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = t / splits, s = t % splits, n = p * kPanel;
        const int64_t b0 = std::max(c0, s * blocks / splits);
        const int64_t b1 = std::min(c1, (s + 1) * blocks / splits);
        if (b0 < b1) task(p, n, std::min(kPanel, N - n), RowBlocks{b0, b1, rows_per, M});
      }
    }
  });
}

// y [M, N] = x [M, K] @ w^T * scales + bias, w packed [P, K, kPanel].
template <typename W>
void packed_gemm(const float* x, const W* wp, const float* scales, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K) {
  static constexpr auto kernels =
      panel_kernels<W>(std::make_index_sequence<static_cast<size_t>(kRowBlock)>());
  for_panel_tasks(M, N, K * sizeof(float), [&](int64_t p, int64_t n, int64_t cols,
                                                const RowBlocks& blocks) {
    alignas(64) float sc[kPanel], bi[kPanel];
    for (int64_t j = 0; j < kPanel; ++j) {
      sc[j] = scales && j < cols ? scales[n + j] : 1.f;
      bi[j] = bias && j < cols ? bias[n + j] : 0.f;
    }
    const W* pan = wp + p * K * kPanel;
    for (int64_t k0 = 0; k0 < K; k0 += kPanelDepth) {
      const int64_t k1 = std::min(K, k0 + kPanelDepth);
      const bool last = k1 == K;
      blocks.each([&](int64_t m0, int64_t rows) {
        kernels[rows - 1](x + m0 * K, K, pan, k0, k1, y + m0 * N + n, N, cols, k0 == 0,
                          last && (scales || bias) ? sc : nullptr, bi);
      });
    }
  });
}

// Panels [P, K, kPanel] of w [N, K]: 64 k of each row at a time, then the next row.
template <typename T>
void pack_panels(const T* src, T* dst, int64_t N, int64_t K) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      T* panel = dst + p * K * kPanel;
      for (int64_t kb = 0; kb < K; kb += 64) {
        const int64_t ke = std::min(K, kb + 64);
        for (int64_t j = 0; j < cols; ++j) {
          const T* row = src + (p * kPanel + j) * K;
          for (int64_t k = kb; k < ke; ++k) panel[k * kPanel + j] = row[k];
        }
      }
    }
  });
}

// w [N, K] -> [ceil(N / kPanel), K, kPanel], same dtype, zeros past N (done once, at load:
// qwen2-0.5b's 358M linear weights: 0.09 s bf16, 0.20 s fp32 on 2 cores).
at::Tensor pack_linear_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2, "pack_linear_weight: w must be 2-D [N, K]");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({P, K, kPanel}, w.options());
  switch (w.scalar_type()) {  // by element size: a copy, not a conversion
    case at::kFloat:
      pack_panels(w.data_ptr<float>(), out.data_ptr<float>(), N, K);
      break;
    case at::kBFloat16:
    case at::kHalf:
      pack_panels(reinterpret_cast<const uint16_t*>(w.data_ptr()),
                  reinterpret_cast<uint16_t*>(out.data_ptr()), N, K);
      break;
    case at::kChar:
      pack_panels(w.data_ptr<int8_t>(), out.data_ptr<int8_t>(), N, K);
      break;
    default: TORCH_CHECK(false, "pack_linear_weight: w must be float32, bfloat16, float16 or int8");
  }
  return out;
}

// ---- bf16 pairs: bf16 activations on CPUs with AVX512-BF16 ----
//
// w [N, K] bf16 -> [P, ceil(K / 2), 2 * kPanel]: for each pair of k, the panel's kPanel
// channels with their two weights adjacent, so one vdpbf16ps multiplies a broadcast pair
// (x[k], x[k+1]) with 16 channels' pairs into fp32 accumulators: 32 multiply-adds per
// instruction, twice the fp32 FMA's (measured here: 499 against 268 GFLOP/s per core). Same
// register blocking as the fp32-math panels; products are exact and sums fp32, y is rounded to
// bf16 once, as oneDNN's bf16 GEMM does. Replaces the [N, K] GEMV and oneDNN (which repacks
// the weight on every call: 464 GFLOP/s at M = 32 on llama-160m against 1240 at M = 2048).
#if defined(__AVX512BF16__) && defined(EMBER_SIMD) && defined(__AVX512F__)
#define EMBER_BF16_PAIRS 1
// k pairs per pass over a panel: a slice of at most 256 KiB stays in L2 while every row block
// of the step uses it; models up to K = 4096 take one slice, so y is written once, in bf16.
constexpr int64_t kPairDepth = 2048;

inline __m512i pair_at(const uint16_t* x) {  // (x[0], x[1]) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm512_set1_epi32(v);
}

inline __m512 vdp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

inline void store_bf16_n(uint16_t* p, __m512 v, int64_t n) {  // round to nearest even
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1),
                           reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// Rows m0 .. m0+MR-1, channels n .. n+cols-1: acc (+)= x[.., 2 j0 : 2 j1] @ panel pairs
// [j0, j1), x rows holding Ke (even) values. Partial sums of an earlier slice are read from
// yf (`first`: none); the last slice adds the bias and writes y in bf16, others write yf.
template <int MR>
inline void pair_rows(const uint16_t* x, int64_t Ke, const uint16_t* pan, int64_t j0,
                      int64_t j1, float* yf, uint16_t* yb, int64_t N, int64_t cols, bool first,
                      bool last, const float* bi) {
  __m512 a0[MR], a1[MR];
  const int64_t c0 = std::min<int64_t>(cols, kLanes), c1 = cols - c0;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    a0[r] = first ? vzero() : vload_n(yf + r * N, c0);
    a1[r] = first ? vzero() : vload_n(yf + r * N + kLanes, c1);
  }
  constexpr int64_t kRow = 2 * kPanel;  // uint16 per pair row of a panel
  int64_t j = j0;
  if constexpr (MR == 1) {  // one row: four pairs at a time, eight dot-product chains
    __m512 b0[3] = {vzero(), vzero(), vzero()}, b1[3] = {vzero(), vzero(), vzero()};
    for (; j + 4 <= j1; j += 4) {
      const uint16_t* w = pan + j * kRow;
      const __m512i x0 = pair_at(x + 2 * j);
      a0[0] = vdp(a0[0], x0, _mm512_loadu_si512(w));
      a1[0] = vdp(a1[0], x0, _mm512_loadu_si512(w + 32));
#pragma GCC unroll 3
      for (int u = 0; u < 3; ++u) {
        const __m512i xu = pair_at(x + 2 * (j + 1 + u));
        b0[u] = vdp(b0[u], xu, _mm512_loadu_si512(w + (1 + u) * kRow));
        b1[u] = vdp(b1[u], xu, _mm512_loadu_si512(w + (1 + u) * kRow + 32));
      }
    }
    a0[0] = vadd(vadd(a0[0], b0[0]), vadd(b0[1], b0[2]));
    a1[0] = vadd(vadd(a1[0], b1[0]), vadd(b1[1], b1[2]));
  }
  for (; j < j1; ++j) {
    const uint16_t* w = pan + j * kRow;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = pair_at(x + r * Ke + 2 * j);
      a0[r] = vdp(a0[r], xb, w0);
      a1[r] = vdp(a1[r], xb, w1);
    }
  }
  if (!last) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      vstore_n(yf + r * N, a0[r], c0);
      vstore_n(yf + r * N + kLanes, a1[r], c1);
    }
    return;
  }
  const vfloat b0 = vload(bi), b1 = vload(bi + kLanes);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    store_bf16_n(yb + r * N, vadd(a0[r], b0), c0);
    if (c1 > 0) store_bf16_n(yb + r * N + kLanes, vadd(a1[r], b1), c1);
  }
}

using PairKernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*,
                            uint16_t*, int64_t, int64_t, bool, bool, const float*);

template <size_t... R>
constexpr std::array<PairKernel, sizeof...(R)> pair_kernels(std::index_sequence<R...>) {
  return {&pair_rows<static_cast<int>(R) + 1>...};
}

// y [M, N] (bf16) = x [M, Ke] (bf16, Ke even) @ pairs + bias; tasks as in packed_gemm. `yf`:
// fp32 [M, N] scratch for partial sums, needed only when Ke / 2 > kPairDepth.
void pairs_gemm(const uint16_t* x, const uint16_t* wp, const float* bias, float* yf,
                uint16_t* y, int64_t M, int64_t N, int64_t Ke) {
  static constexpr auto kernels =
      pair_kernels(std::make_index_sequence<static_cast<size_t>(kRowBlock)>());
  const int64_t J = Ke / 2;
  for_panel_tasks(M, N, Ke * sizeof(uint16_t), [&](int64_t p, int64_t n, int64_t cols,
                                                   const RowBlocks& blocks) {
    alignas(64) float bi[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) bi[c] = bias && c < cols ? bias[n + c] : 0.f;
    const uint16_t* pan = wp + p * J * 2 * kPanel;
    for (int64_t j0 = 0; j0 < J; j0 += kPairDepth) {
      const int64_t j1 = std::min(J, j0 + kPairDepth);
      blocks.each([&](int64_t m0, int64_t rows) {
        kernels[rows - 1](x + m0 * Ke, Ke, pan, j0, j1, yf ? yf + m0 * N + n : nullptr,
                          y + m0 * N + n, N, cols, j0 == 0, j1 == J, bi);
      });
    }
  });
}
#endif

// w [N, K] bf16 -> [ceil(N / kPanel), ceil(K / 2), 2 * kPanel] (zeros past N and K), for
// bf16 activations; raises where the build lacks AVX512-BF16 (`ember.kernels.bf16_pairs`).
at::Tensor pack_bf16_pairs(const at::Tensor& w_in) {
#ifdef EMBER_BF16_PAIRS
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kBFloat16,
              "pack_bf16_pairs: w must be a bf16 [N, K] tensor");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel, J = (K + 1) / 2;
  at::Tensor out = at::zeros({P, J, 2 * kPanel}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      uint16_t* panel = dst + p * J * 2 * kPanel;
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t* row = src + (p * kPanel + c) * K;
        for (int64_t k = 0; k < K; ++k) panel[(k / 2) * 2 * kPanel + 2 * c + (k & 1)] = row[k];
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "pack_bf16_pairs: this build of ember's kernels has no AVX512-BF16");
#endif
}

void check_out_features(const at::Tensor& w, int64_t N) {  // N fills w's last panel
  TORCH_CHECK(N > (w.size(0) - 1) * kPanel && N <= w.size(0) * kPanel,
              "packed_linear: out_features ", N, " does not fit ", w.size(0), " panels");
}

// y [..., N] = x [..., K] @ w^T (* scales) (+ bias) for a weight packed by pack_linear_weight:
// fp32 math; y in x's dtype. `scales`: float32 [N] (int8 weights), else None.
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& w,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& bias, int64_t N) {
#ifdef EMBER_BF16_PAIRS
  if (w.dim() == 3 && w.size(2) == 2 * kPanel) {  // pack_bf16_pairs: bf16 activations
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                    x_in.scalar_type() == at::kBFloat16 && !(scales.has_value() && scales->defined()),
                "packed_linear: a pack_bf16_pairs weight takes bf16 x and no scales");
    check_out_features(w, N);
    const int64_t K = x_in.size(-1), J = w.size(1);
    TORCH_CHECK((K + 1) / 2 == J, "packed_linear: x has ", K, " features, w ", 2 * J);
    auto out_shape = x_in.sizes().vec();
    out_shape.back() = N;
    at::Tensor x = x_in.reshape({-1, K}).contiguous();
    if (K % 2) x = at::constant_pad_nd(x, {0, 1});  // the last pair's second value is 0
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    if (M > 0) {
      at::Tensor b, partial;
      if (J > kPairDepth) partial = at::empty({M, N}, x.options().dtype(at::kFloat));
      pairs_gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                 reinterpret_cast<const uint16_t*>(w.data_ptr()), bias_ptr(bias, b),
                 partial.defined() ? partial.data_ptr<float>() : nullptr,
                 reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, 2 * J);
    }
    return y.view(out_shape);
  }
#endif
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.is_contiguous(),
              "packed_linear: w must be a contiguous [P, K, ", kPanel,
              "] weight from pack_linear_weight (built for this CPU ISA)");
  check_out_features(w, N);
  const int64_t K = w.size(1);
  auto [x, out_shape] = as_matrix(x_in, K, N, "packed_linear");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_shape).to(x_in.scalar_type());
  at::Tensor b, s;
  const float* bp = bias_ptr(bias, b);
  const float* sp = nullptr;
  if (scales.has_value() && scales->defined()) {
    TORCH_CHECK(scales->numel() == N, "packed_linear: scales must hold out_features values");
    s = scales->to(at::kFloat).contiguous();
    sp = s.data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: packed_gemm(xp, w.data_ptr<float>(), sp, bp, yp, M, N, K); break;
    case at::kBFloat16:
      packed_gemm(xp, w.data_ptr<c10::BFloat16>(), sp, bp, yp, M, N, K);
      break;
    case at::kHalf: packed_gemm(xp, w.data_ptr<c10::Half>(), sp, bp, yp, M, N, K); break;
    case at::kChar: packed_gemm(xp, w.data_ptr<int8_t>(), sp, bp, yp, M, N, K); break;
    default: TORCH_CHECK(false, "packed_linear: w must be float32, bfloat16, float16 or int8");
  }
  return y.view(out_shape).to(x_in.scalar_type());
}

// ---- Group-quantized linears: GGUF's Q8_0, Q4_0 and Q4_1, and ember's int4 ----
//
// A weight [N, K] in groups of kGroup = 32 consecutive k of one output channel, each group with
// an fp16 scale d and, for asymmetric 4-bit codes, an fp16 offset m: w = d * q (8-bit codes in
// [-127, 127]), d * (q - 8) (symmetric 4-bit codes in [0, 15]) or d * q + m (asymmetric): the
// values of GGUF's Q8_0, Q4_0 and Q4_1 blocks exactly. Packed in panels of kPanel output
// channels with each channel's codes for 4 (8-bit) or 8 (4-bit) consecutive k in one 32-bit
// lane, the layout integer dot-product instructions read (see ember.compiler.quant.GroupLinear):
// codes [P, K / 4, kPanel, 4] uint8 holding q + 128 (8-bit), or [P, K / 8, kPanel, 4] uint8
// whose byte j holds k = 8i + j in its low nibble and 8i + 4 + j in its high one (4-bit); d and
// m [P, K / kGroup, kPanel] fp16.
//
// As llama.cpp does, each row of x is quantized to int8 per group of 32 (scale max|x| / 127) and
// the products summed in int32: vpdpbusd (AVX512-VNNI / AVX-VNNI: 64 byte products per
// instruction), else vpmaddubsw + vpmaddwd; each group's sum is scaled once, d * dx * sum
// (+ m * dx * sum(xq)). Four to eight times fewer instructions per weight than widening the
// codes to fp32: a 4-bit decode stays memory-bound and prefill runs at the integer rate.
// (Widening to fp32, measured first: llama-160m's 84 projections, AMD EPYC 2 cores, M=1 ms per
// pass: q8_0 3.14, q4_0 2.40, both compute-bound.)
constexpr int64_t kGroup = 32;

#ifdef EMBER_SIMD
#if defined(__AVX512F__)
inline vfloat vhalf(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
inline vfloat vhalf(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#endif


// x [M, K] quantized per group of 32: codes, scale dx (x ~ dx * xq) and sum(xq) per group.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  std::vector<int32_t> half;  // the sum of each group's first 16 (6-bit weights: two scales)
};

inline void quantize_group(const float* x, int8_t* q, float* scale, int32_t* sum,
                           int32_t* half) {
  float amax = 0.f;
  for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
  int32_t s = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[k] * inv));
    q[k] = static_cast<int8_t>(v);
    s += v;
    if (k == kGroup / 2 - 1) *half = s;
  }
  *sum = s;
}

#ifdef EMBER_SIMD
#if defined(__AVX512F__)
inline void quantize_group_simd(const float* x, int8_t* q, float* scale, int32_t* sum,
                               int32_t* half) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // round to nearest even
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  *scale = amax / 127.f;
  *half = _mm512_reduce_add_epi32(q0);
  *sum = *half + _mm512_reduce_add_epi32(q1);
}
#else
inline void quantize_group_simd(const float* x, int8_t* q, float* scale, int32_t* sum,
                               int32_t* half) {
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // int32 -> int8 in order: packs interleave 128-bit lanes, a permute restores the order.
  const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                 _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  const auto hsum = [](__m256i s) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
  };
  *scale = amax / 127.f;
  *half = hsum(_mm256_add_epi32(qi[0], qi[1]));
  *sum = *half + hsum(_mm256_add_epi32(qi[2], qi[3]));
}
#endif
#endif

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantizedRows out{std::vector<int8_t>(M * K), std::vector<float>(M * G),
                    std::vector<int32_t>(M * G), std::vector<int32_t>(M * G)};
  at::parallel_for(0, M * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // group i of the flattened x: row i / G, group i % G
#ifdef EMBER_SIMD
      quantize_group_simd(x + i * kGroup, out.q.data() + i * kGroup, &out.scale[i], &out.sum[i],
                          &out.half[i]);
#else
      quantize_group(x + i * kGroup, out.q.data() + i * kGroup, &out.scale[i], &out.sum[i],
                     &out.half[i]);
#endif
    }
  });
  return out;
}

#ifdef EMBER_SIMD
#if defined(__AVX512F__)
using vint = __m512i;
inline vint iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vint ibcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}
inline vint izero() { return _mm512_setzero_si512(); }
inline vint low_nibbles(vint v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline vint high_nibbles(vint v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
}
inline vfloat icvt(vint v) { return _mm512_cvtepi32_ps(v); }
inline vint isub(vint a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline vint iadd(vint a, vint b) { return _mm512_add_epi32(a, b); }
inline vint flip_bytes(vint v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline vint ior(vint a, vint b) { return _mm512_or_si512(a, b); }
// Bits 4-5 of each byte: the 2-bit field at bit S of each byte of v moved there (6-bit codes).
template <int S>
inline vint high_pair(vint v) {
  const vint mask = _mm512_set1_epi8(0x30);
  if constexpr (S < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - S), mask);
  if constexpr (S == 4) return _mm512_and_si512(v, mask);
  return _mm512_and_si512(_mm512_srli_epi16(v, S - 4), mask);
}
#if defined(__AVX512VNNI__)
#define EMBER_VNNI 1
// acc += unsigned bytes a . signed bytes b, 4 per 32-bit lane.
inline vint dot_u8s8(vint acc, vint a, vint b) { return _mm512_dpbusd_epi32(acc, a, b); }
#else
inline vint dot_u8s8(vint acc, vint a, vint b) {  // a <= 63 (4-, 6-bit codes): no saturation
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
}
// acc += signed bytes a . signed bytes b: |b| . (a with b's sign), so maddubs does not saturate.
inline vint dot_s8s8(vint acc, vint a, vint b) {
  const __mmask64 negative = _mm512_movepi8_mask(b);
  const vint a_signed = _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a);
  return dot_u8s8(acc, _mm512_abs_epi8(b), a_signed);
}
inline vint dot4(vint acc, vint a, vint b) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(a, b)); }
inline vint add4(vint a, vint b) { return _mm512_add_epi16(a, b); }
inline vint sums4(vint acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
inline vint dot_pair(vint acc, vint a, vint b, vint c, vint d) {
  return _mm512_add_epi32(acc, sums4(_mm512_add_epi16(_mm512_maddubs_epi16(a, b), _mm512_maddubs_epi16(c, d))));
}
#endif
#else
using vint = __m256i;
inline vint iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vint ibcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}
inline vint izero() { return _mm256_setzero_si256(); }
inline vint low_nibbles(vint v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline vint high_nibbles(vint v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
}
inline vfloat icvt(vint v) { return _mm256_cvtepi32_ps(v); }
inline vint isub(vint a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline vint iadd(vint a, vint b) { return _mm256_add_epi32(a, b); }
inline vint flip_bytes(vint v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline vint ior(vint a, vint b) { return _mm256_or_si256(a, b); }
template <int S>
inline vint high_pair(vint v) {
  const vint mask = _mm256_set1_epi8(0x30);
  if constexpr (S < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - S), mask);
  if constexpr (S == 4) return _mm256_and_si256(v, mask);
  return _mm256_and_si256(_mm256_srli_epi16(v, S - 4), mask);
}
#if defined(__AVXVNNI__)
#define EMBER_VNNI 1
inline vint dot_u8s8(vint acc, vint a, vint b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#else
inline vint dot_u8s8(vint acc, vint a, vint b) {  // a <= 63 (4-, 6-bit codes): no saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
inline vint dot_s8s8(vint acc, vint a, vint b) {
  return dot_u8s8(acc, _mm256_abs_epi8(b), _mm256_sign_epi8(a, b));
}
inline vint dot4(vint acc, vint a, vint b) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(a, b)); }
inline vint add4(vint a, vint b) { return _mm256_add_epi16(a, b); }
inline vint sums4(vint acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
inline vint dot_pair(vint acc, vint a, vint b, vint c, vint d) {
  return _mm256_add_epi32(acc, sums4(_mm256_add_epi16(_mm256_maddubs_epi16(a, b), _mm256_maddubs_epi16(c, d))));
}
#endif
#endif
// 8-bit codes are stored as q + 128. With VNNI they are the unsigned operand and each group's
// sum is corrected by 128 * sum(xq); without it they are flipped back to signed q once per
// vector (shared by the rows) for the sign trick, which needs no correction.
//
// 4-bit codes: dot4 sums a group's byte products into acc, add4 adds two such sums and sums4
// turns one into int32 channel sums. Without VNNI the pair sums of vpmaddubsw (at most
// 2 * 15 * 127 = 3810) add up in int16 lanes over a group (8 per accumulator: 30480 < 2^15)
// and are widened by one vpmaddwd per group, not one per product: 9 multiply uops per code
// vector, row and group instead of 16. 6-bit codes (up to 63: 2 * 63 * 127 = 16002 per pair
// sum) take two products per widening: dot_pair, acc += a . b + c . d.
#ifdef EMBER_VNNI
inline vint dot4(vint acc, vint a, vint b) { return dot_u8s8(acc, a, b); }
inline vint add4(vint a, vint b) { return iadd(a, b); }
inline vint sums4(vint acc) { return acc; }
inline vint dot_pair(vint acc, vint a, vint b, vint c, vint d) {
  return dot_u8s8(dot_u8s8(acc, a, b), c, d);
}
inline vint codes8(vint v) { return v; }
inline vint dot8(vint acc, vint codes, vint xb) { return dot_u8s8(acc, codes, xb); }
constexpr int32_t kCode8Bias = 128;
#else
inline vint codes8(vint v) { return flip_bytes(v); }
inline vint dot8(vint acc, vint codes, vint xb) { return dot_s8s8(acc, codes, xb); }
constexpr int32_t kCode8Bias = 0;
#endif
// Rows per register block: 4 vectors per row (two int32 group sums, two fp32 sums); 6-bit
// codes take more registers to unpack (a Q6_K LM head at M=128, AVX-512: 6.93 ms in blocks
// of 4 rows, 8.81 in blocks of 6; 3 and 5 were slower than 4 too).
constexpr int kGroupRowBlock = kLanes == 16 ? 6 : 2;
constexpr int kGroup6RowBlock = kLanes == 16 ? 4 : 2;
// Software prefetch of the code stream, AVX2 builds only. Measured on AMD EPYC (Zen 4), 2 cores,
// qwen2-0.5b's 96 layer projections at M=1, pass time against a streaming read of as many bytes
// interleaved in one process (medians over processes): AVX-512 q8_0 0.70 with it, 0.84 without;
// q4_0 0.80 / 0.91; AVX2 q8_0 0.91 / 0.91, q4_0 0.90 / 0.83. The bf16-pair kernels (AVX-512
// only) stream without it too: 0.85 with, 0.99 without; the fp32-math panels were even (kept).
constexpr bool kGroupPrefetch = kLanes == 8;
#else
constexpr int kGroupRowBlock = 4;
constexpr int kGroup6RowBlock = 4;
#endif

#ifdef EMBER_SIMD
// Sums of one lane row of 4-bit (or widened 6-bit) codes, k 8i .. 8i + 7 of a panel's two
// vectors of channels (lo0/lo1: the low four k, hi0/hi1: the high four), times each row's x
// (xg: the group's, a row every K). One row in four chains (s, then e for the high k: a decode
// is latency-bound; the caller adds e to s), more rows in two. `Nibbles`: 4-bit codes, summed
// by dot4 (the caller finishes with sums4); else 6-bit ones, by dot_u8s8 and dot_pair.
template <int MR, bool Nibbles>
inline void nibble_dots(const int8_t* xg, int64_t K, int64_t i, vint lo0, vint lo1, vint hi0,
                        vint hi1, vint* s0, vint* s1, vint& e0, vint& e1) {
  const auto dot = [](vint acc, vint a, vint b) {
    if constexpr (Nibbles) return dot4(acc, a, b);
    else return dot_u8s8(acc, a, b);
  };
  const auto dot2 = [&](vint acc, vint a, vint b, vint c, vint d) {
    if constexpr (Nibbles) return dot(dot(acc, a, b), c, d);
    else return dot_pair(acc, a, b, c, d);
  };
  if constexpr (MR == 1) {
    const vint xl = ibcast(xg + 8 * i), xh = ibcast(xg + 8 * i + 4);
    s0[0] = dot(s0[0], lo0, xl);
    s1[0] = dot(s1[0], lo1, xl);
    e0 = dot(e0, hi0, xh);
    e1 = dot(e1, hi1, xh);
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vint xl = ibcast(xg + r * K + 8 * i), xh = ibcast(xg + r * K + 8 * i + 4);
      s0[r] = dot2(s0[r], lo0, xl, hi0, xh);
      s1[r] = dot2(s1[r], lo1, xl, hi1, xh);
    }
  }
}
#endif

// The code of channel j at k in a panel (the scalar path): q for 8-bit codes, the stored
// q in [0, 15] or [0, 63] for 4- and 6-bit ones (6-bit: its group's nibble as a 4-bit code's,
// then the high pair of its half; see group_rows).
template <int Bits>
inline int group_code(const uint8_t* pan, int64_t k, int64_t j) {
  if constexpr (Bits == 8) return static_cast<int>(pan[((k / 4) * kPanel + j) * 4 + k % 4]) - 128;
  if constexpr (Bits == 6) {
    const uint8_t* q = pan + (k / kGroup) * kGroup * kPanel * 6 / 8;
    const int64_t kk = k % kGroup;
    const uint8_t pairs = q[kGroup * kPanel / 2 + ((kk / 16) * kPanel + j) * 4 + kk % 4];
    return group_code<4>(q, kk, j) | ((pairs >> (2 * ((kk % 16) / 4))) & 3) << 4;
  }
  const uint8_t b = pan[((k / 8) * kPanel + j) * 4 + k % 4];
  return k % 8 < 4 ? b & 15 : b >> 4;
}

// y[m0 .. m0+MR-1, n .. n+cols-1] (+)= x[.., groups g0:g1] @ panel; `first`: y is not read;
// `bi` (the last slice only): plus bias. xq/dx/xs/xh: the rows' quantized x (QuantizedRows),
// row r at xq + r * K, dx + r * G, xs + r * G, xh + r * G.
//
// 6-bit codes (Q6_K: q + 32 in [0, 63], a scale per 16 k) are laid out per group of 32 k as
// the 4-bit codes' nibbles (16 bytes a channel), then their high pairs: the 16 k of each half
// in one 32-bit lane, k = 16h + 4c + t in bits 2c of byte t. Both halves' scales are
// consecutive rows of `dp`; each half's sum is corrected by 32 times its x sum.
template <int MR, int Bits, bool Min>
inline void group_rows(const int8_t* xq, const float* dx, const int32_t* xs, const int32_t* xh,
                       int64_t K, const uint8_t* pan, const uint16_t* dp, const uint16_t* mp,
                       int64_t g0, int64_t g1, float* y, int64_t N, int64_t cols, bool first,
                       const float* bi) {
  const int64_t G = K / kGroup;
  constexpr int64_t kBytes = kGroup * kPanel * Bits / 8;  // codes per group of a panel
#ifdef EMBER_SIMD
  constexpr int64_t kVec = kLanes * 4;  // bytes per code vector (kLanes channels)
  vfloat a0[MR], a1[MR];
  const int64_t c0 = std::min<int64_t>(cols, kLanes), c1 = cols - c0;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    a0[r] = first ? vzero() : vload_n(y + r * N, c0);
    a1[r] = first ? vzero() : vload_n(y + r * N + kLanes, c1);
  }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* q = pan + g * kBytes;
    if constexpr (kGroupPrefetch) {
      const char* ahead = reinterpret_cast<const char*>(q) + kPanelPrefetchBytes;
#pragma GCC unroll 16
      for (int64_t l = 0; l < kBytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
    }
    const int8_t* xg = xq + g * kGroup;
    if constexpr (Bits == 6) {
      const uint8_t* qh = q + kGroup * kPanel / 2;
#pragma GCC unroll 2
      for (int64_t h = 0; h < 2; ++h) {
        vint s0[MR], s1[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) s0[r] = s1[r] = izero();
        vint e0 = izero(), e1 = izero();  // a single row's high-nibble sums
        const vint p0 = iload(qh + 2 * h * kVec), p1 = iload(qh + (2 * h + 1) * kVec);
#pragma GCC unroll 2
        for (int64_t u = 0; u < 2; ++u) {
          const int64_t i = 2 * h + u;
          const vint b0 = iload(q + 2 * i * kVec), b1 = iload(q + (2 * i + 1) * kVec);
          const vint lo0 = ior(low_nibbles(b0), u ? high_pair<4>(p0) : high_pair<0>(p0));
          const vint lo1 = ior(low_nibbles(b1), u ? high_pair<4>(p1) : high_pair<0>(p1));
          const vint hi0 = ior(high_nibbles(b0), u ? high_pair<6>(p0) : high_pair<2>(p0));
          const vint hi1 = ior(high_nibbles(b1), u ? high_pair<6>(p1) : high_pair<2>(p1));
          nibble_dots<MR, false>(xg, K, i, lo0, lo1, hi0, hi1, s0, s1, e0, e1);
        }
        if constexpr (MR == 1) {
          s0[0] = iadd(s0[0], e0);
          s1[0] = iadd(s1[0], e1);
        }
        const uint16_t* dh = dp + (2 * g + h) * kPanel;
        const vfloat d0 = vhalf(dh), d1 = vhalf(dh + kLanes);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int32_t first_half = xh[r * G + g];
          const int32_t xsum = h == 0 ? first_half : xs[r * G + g] - first_half;
          const vfloat sx = vset1(dx[r * G + g]);
          a0[r] = vfma(icvt(isub(s0[r], 32 * xsum)), vmul(d0, sx), a0[r]);
          a1[r] = vfma(icvt(isub(s1[r], 32 * xsum)), vmul(d1, sx), a1[r]);
        }
      }
      continue;
    }
    vint s0[MR], s1[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) s0[r] = s1[r] = izero();
    if constexpr (Bits == 8) {
#pragma GCC unroll 8
      for (int64_t i = 0; i < kGroup / 4; ++i) {
        const vint w0 = codes8(iload(q + 2 * i * kVec)), w1 = codes8(iload(q + (2 * i + 1) * kVec));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const vint xb = ibcast(xg + r * K + 4 * i);
          s0[r] = dot8(s0[r], w0, xb);
          s1[r] = dot8(s1[r], w1, xb);
        }
      }
    } else {
      vint h0 = izero(), h1 = izero();  // a single row's high-nibble sums
#pragma GCC unroll 4
      for (int64_t i = 0; i < kGroup / 8; ++i) {
        const vint b0 = iload(q + 2 * i * kVec), b1 = iload(q + (2 * i + 1) * kVec);
        const vint lo0 = low_nibbles(b0), lo1 = low_nibbles(b1);
        const vint hi0 = high_nibbles(b0), hi1 = high_nibbles(b1);
        nibble_dots<MR, true>(xg, K, i, lo0, lo1, hi0, hi1, s0, s1, h0, h1);
      }
      if constexpr (MR == 1) {
        s0[0] = add4(s0[0], h0);
        s1[0] = add4(s1[0], h1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        s0[r] = sums4(s0[r]);
        s1[r] = sums4(s1[r]);
      }
    }
    const vfloat d0 = vhalf(dp + g * kPanel), d1 = vhalf(dp + g * kPanel + kLanes);
    vfloat m0 = vzero(), m1 = vzero();
    if constexpr (Min) {
      m0 = vhalf(mp + g * kPanel);
      m1 = vhalf(mp + g * kPanel + kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int32_t xsum = xs[r * G + g];
      // sum(xq * q) from the stored codes: 8-bit q + 128 (VNNI), 4-bit q - 8 (symmetric).
      const int32_t bias = Bits == 8 ? kCode8Bias * xsum : (Min ? 0 : 8 * xsum);
      const vfloat sx = vset1(dx[r * G + g]);
      a0[r] = vfma(icvt(isub(s0[r], bias)), vmul(d0, sx), a0[r]);
      a1[r] = vfma(icvt(isub(s1[r], bias)), vmul(d1, sx), a1[r]);
      if constexpr (Min) {
        const vfloat mx = vset1(dx[r * G + g] * static_cast<float>(xsum));
        a0[r] = vfma(m0, mx, a0[r]);
        a1[r] = vfma(m1, mx, a1[r]);
      }
    }
  }
  if (bi) {
    const vfloat b0 = vload(bi), b1 = vload(bi + kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      a0[r] = vadd(a0[r], b0);
      a1[r] = vadd(a1[r], b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    vstore_n(y + r * N, a0[r], c0);
    vstore_n(y + r * N + kLanes, a1[r], c1);
  }
#else
  // A scale per segment of a group (6-bit: two of 16 k), and the offset every stored code
  // carries (Q4_0: 8, 6-bit: 32), taken off each product.
  constexpr int64_t kSegments = Bits == 6 ? 2 : 1, kSpan = kGroup / kSegments;
  constexpr int32_t kOffset = Bits == 6 ? 32 : Bits == 4 && !Min ? 8 : 0;
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float acc = first ? 0.f : y[r * N + j];
      for (int64_t g = g0; g < g1; ++g) {
        const float m = Min ? static_cast<float>(c10::Half(mp[g * kPanel + j], c10::Half::from_bits())) : 0.f;
        for (int64_t s = 0; s < kSegments; ++s) {
          const float d = static_cast<float>(
              c10::Half(dp[(g * kSegments + s) * kPanel + j], c10::Half::from_bits()));
          int32_t dot = 0;
          for (int64_t k = g * kGroup + s * kSpan; k < g * kGroup + (s + 1) * kSpan; ++k) {
            dot += static_cast<int32_t>(xq[r * K + k]) * (group_code<Bits>(pan, k, j) - kOffset);
          }
          const int32_t xsum = xs[r * G + g];  // the offsets (mins: one segment) apply to it
          acc += dx[r * G + g] * (d * static_cast<float>(dot) + m * static_cast<float>(xsum));
        }
      }
      y[r * N + j] = bi ? acc + bi[j] : acc;
    }
  }
#endif
}

using GroupKernel = void (*)(const int8_t*, const float*, const int32_t*, const int32_t*, int64_t,
                             const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t,
                             float*, int64_t, int64_t, bool, const float*);

template <int Bits, bool Min, size_t... R>
constexpr std::array<GroupKernel, sizeof...(R)> group_kernels(std::index_sequence<R...>) {
  return {&group_rows<static_cast<int>(R) + 1, Bits, Min>...};
}

// y [M, N] = x [M, K] @ w^T + bias, w group-quantized and packed (see above).
template <int Bits, bool Min>
void group_gemm(const float* x, const uint8_t* codes, const uint16_t* d, const uint16_t* m,
                const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  static constexpr int kRows = Bits == 6 ? kGroup6RowBlock : kGroupRowBlock;
  static constexpr auto kernels =
      group_kernels<Bits, Min>(std::make_index_sequence<static_cast<size_t>(kRows)>());
  const int64_t G = K / kGroup;
  const int64_t panel_bytes = K * kPanel * Bits / 8;
  const int64_t scale_rows = Bits == 6 ? 2 * G : G;  // 6-bit: a scale per 16 k
  const QuantizedRows xq = quantize_rows(x, M, K);
  for_panel_tasks(
      M, N, K,
      [&](int64_t p, int64_t n, int64_t cols, const RowBlocks& blocks) {
        alignas(64) float bi[kPanel];
        for (int64_t j = 0; j < kPanel; ++j) bi[j] = bias && j < cols ? bias[n + j] : 0.f;
        const uint8_t* pan = codes + p * panel_bytes;
        const uint16_t* dp = d + p * scale_rows * kPanel;
        const uint16_t* mp = m ? m + p * G * kPanel : nullptr;
        for (int64_t ga = 0; ga < G; ga += kPanelDepth / kGroup) {
          const int64_t gb = std::min(G, ga + kPanelDepth / kGroup);
          blocks.each([&](int64_t m0, int64_t rows) {
            kernels[rows - 1](xq.q.data() + m0 * K, xq.scale.data() + m0 * G,
                              xq.sum.data() + m0 * G, xq.half.data() + m0 * G, K, pan, dp, mp,
                              ga, gb, y + m0 * N + n, N, cols, ga == 0,
                              gb == G && bias ? bi : nullptr);
          });
        }
      },
      kRows);
}

// y [..., N] = x [..., K] @ w^T (+ bias) for a group-quantized weight (see above): `codes`
// [P, K / 4, kPanel, 4] (bits 8), [P, K / 8, kPanel, 4] (bits 4) or [P, 6 K / 32, kPanel, 4]
// (bits 6) uint8, `scales` [P, K / 32, kPanel] fp16 (bits 6: [P, K / 16, kPanel]), `mins`
// (bits 4, asymmetric; else None) as the scales. x quantized to int8 per group of 32, int32
// sums, fp32 scaling; y in x's dtype.
at::Tensor group_linear(const at::Tensor& x_in, const at::Tensor& codes,
                        const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                        const std::optional<at::Tensor>& bias, int64_t N, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "group_linear: bits must be 4, 6 or 8, got ",
              bits);
  // 32-bit lanes per group of 32 k: 8 (8-bit), 4 (4-bit), 4 + 2 (6-bit: nibbles, high pairs)
  const int64_t lanes = bits == 8 ? 8 : bits == 6 ? 6 : 4;
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) % lanes == 0 && codes.size(2) == kPanel &&
                  codes.size(3) == 4 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "group_linear: codes must be a contiguous uint8 [P, ", lanes, " K / 32, ", kPanel,
              ", 4] tensor (packed for this CPU ISA)");
  check_out_features(codes, N);
  const int64_t G = codes.size(1) / lanes, K = G * kGroup;
  const bool has_min = mins.has_value() && mins->defined();
  TORCH_CHECK(!has_min || bits == 4, "group_linear: offsets are for 4-bit codes only");
  const int64_t scale_rows = bits == 6 ? 2 * G : G;
  for (const at::Tensor* t : {&scales, has_min ? &*mins : &scales}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == codes.size(0) && t->size(1) == scale_rows &&
                    t->size(2) == kPanel,
                "group_linear: scales and mins must be contiguous fp16 [", codes.size(0), ", ",
                scale_rows, ", ", kPanel, "]");
  }
  TORCH_CHECK(x_in.size(-1) == K, "group_linear: x has ", x_in.size(-1), " features, w ", K);
  // fp32 contiguous x (every compiled step): no reshape, cast or copy ops, y shaped directly.
  const bool direct = x_in.scalar_type() == at::kFloat && x_in.is_contiguous();
  const at::Tensor x = direct ? x_in : x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  const int64_t M = x.numel() / K;
  at::Tensor y = at::empty(out_shape, x.options());
  if (M > 0) {
    at::Tensor b;
    const float* bp = bias_ptr(bias, b);
    const auto* cp = codes.data_ptr<uint8_t>();
    const auto* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    const auto* mp = has_min ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr;
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (bits == 8) {
      group_gemm<8, false>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    } else if (bits == 6) {
      group_gemm<6, false>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    } else if (has_min) {
      group_gemm<4, true>(xp, cp, dp, mp, bp, yp, M, N, K);
    } else {
      group_gemm<4, false>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    }
  }
  return direct ? y : y.to(x_in.scalar_type());
}

// q . k over one head's D values (k widened to fp32), and acc += p * v.
template <typename C>
inline float dot_row(const float* q, const C* k, int64_t D) {
  int64_t d = 0;
  float dot = 0.f;
#ifdef EMBER_SIMD
  vfloat a = vzero();
  for (; d + kLanes <= D; d += kLanes) a = vfma(vload(q + d), vwiden(k + d), a);
  dot = vsum(a);
#endif
  for (; d < D; ++d) dot += q[d] * to_float(k[d]);
  return dot;
}

template <typename C>
inline void add_scaled_row(float* acc, float p, const C* v, int64_t D) {
  int64_t d = 0;
#ifdef EMBER_SIMD
  const vfloat pv = vset1(p);
  for (; d + kLanes <= D; d += kLanes) vstore(acc + d, vfma(pv, vwiden(v + d), vload(acc + d)));
#endif
  for (; d < D; ++d) acc[d] += p * to_float(v[d]);
}

#ifdef EMBER_SIMD
// Scores of up to kLanes cache rows at once: lane j = q . k_j for j < L (k_j = k + j * stride),
// 0 beyond; D a multiple of kLanes. One accumulator per row, summed by one transpose-and-add
// tree rather than one horizontal reduction per row. A full set of rows runs the rows' FMA
// chains interleaved (D-slice outer, row inner): one row's D / kLanes FMAs form a dependent
// chain, and walking the rows one by one ran at the FMA latency (a third of the step's
// attention time at llama-160m's D = 64).
template <typename C>
inline vfloat row_scores(const float* q, const C* k, int64_t stride, int64_t D, int64_t L) {
  vfloat acc[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) acc[j] = vzero();
  if (L == kLanes && D == 4 * kLanes) {  // D = 64 (AVX-512) / 32 (AVX2): in registers
#pragma GCC unroll 4
    for (int64_t d = 0; d < 4 * kLanes; d += kLanes) {
      const vfloat qd = vload(q + d);
      const C* kj = k + d;
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j, kj += stride) acc[j] = vfma(qd, vwiden(kj), acc[j]);
    }
  } else if (L == kLanes) {
    for (int64_t d = 0; d < D; d += kLanes) {
      const vfloat qd = vload(q + d);
      const C* kj = k + d;
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j, kj += stride) acc[j] = vfma(qd, vwiden(kj), acc[j]);
    }
  } else {
    for (int64_t j = 0; j < L; ++j) {
      const C* kj = k + j * stride;
      for (int64_t d = 0; d < D; d += kLanes) acc[j] = vfma(vload(q + d), vwiden(kj + d), acc[j]);
    }
  }
  return vsum_lanes(acc);
}

inline float vmax_all(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#else
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
#endif
}

// max(s[0 : n]), n >= 1, a vector at a time (a scalar max or sum over a block's scores is one
// dependent chain of n operations).
inline float scores_max(const float* s, int64_t n) {
  vfloat m = vset1(-INFINITY);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) m = vmax(m, vload(s + j));
  float mx = vmax_all(m);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// s[j] = exp(s[j] - mx) for j < n; returns their sum.
inline float exp_scores(float* s, int64_t n, float mx) {
  const vfloat mv = vset1(mx);
  vfloat sum = vzero();
  for (int64_t j = 0; j < n; j += kLanes) {
    const vfloat e = vexp(vsub(vload(s + j), mv));
    vstore(s + j, e);
    sum = vadd(sum, n - j >= kLanes ? e : vload_n(s + j, n - j));
  }
  return vsum(sum);
}
#endif

#ifdef EMBER_SIMD
// acc[0 : NV * kLanes] = acc * scale + sum_j p[j] * v_j[0 : NV * kLanes] (v_j = v + j * stride): NV
// independent FMA chains (one chain per D-slice ran at the FMA latency: 16 dependent FMAs per
// 16-row block); under 8 slices, the even and odd rows feed separate chains, summed at the end.
template <int NV, typename C>
inline void add_weighted_rows(float* acc, float scale, const float* p, const C* v,
                              int64_t stride, int64_t count) {
  constexpr int R = NV >= 8 ? 1 : 2;  // row streams
  vfloat a[R][NV];
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    a[0][c] = vmul(vload(acc + c * kLanes), vset1(scale));
    if constexpr (R == 2) a[1][c] = vzero();
  }
  int64_t j = 0;
  for (; j + R <= count; j += R) {
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const vfloat pj = vset1(p[j + r]);
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        a[r][c] = vfma(pj, vwiden(v + (j + r) * stride + c * kLanes), a[r][c]);
      }
    }
  }
  for (; j < count; ++j) {
    const vfloat pj = vset1(p[j]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) a[0][c] = vfma(pj, vwiden(v + j * stride + c * kLanes), a[0][c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    vstore(acc + c * kLanes, R == 2 ? vadd(a[0][c], a[R - 1][c]) : a[0][c]);
  }
}
#endif

// The K and V rows of the cache block a decode attends next (`bytes` of each), fetched while
// the current block is computed: a part of their cache lines at a time (`fetch(part, parts)`),
// between the current block's heads. All of them at once, at the start of the block, queued
// hundreds of misses ahead of the block's own loads and left the loads waiting; spread over
// the block they arrive under its arithmetic. Caches streamed from DRAM, AVX2 build, AMD EPYC
// Zen 5: 32 llama-160m decodes at context 192, 0.48-0.51 -> 0.31-0.32 ms a layer with a
// float32 cache, 0.44 -> 0.21 with bfloat16; one decode at context 2048, 0.15-0.17 -> 0.09-0.10.
// Into L2 (_MM_HINT_T1) instead of L1 measured slower both from DRAM and from L3.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0;
  void fetch(int64_t part, int64_t parts) const {
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t c = lines * part / parts; c < lines * (part + 1) / parts; ++c) {
      _mm_prefetch(k + c * 64, _MM_HINT_T0);
      _mm_prefetch(v + c * 64, _MM_HINT_T0);
    }
  }
};

#ifdef EMBER_SIMD
// One cache block's `count` rows (k, v: the block's first row of K / V, rows `stride` apart,
// KV head h at h * D) attended by every query head: the online softmax's state m, l (per head)
// and acc ([H, D]) updated. Phase by phase over all heads (scores, then maxima and
// corrections, then weights, then the weighted V rows), so the heads' short dependent chains
// (a transpose tree, a max, an exp, a sum) overlap instead of running one after another; a
// head's rescale by its correction is folded into its weighted sum. `s`: scratch of
// H * (round_up(count, kLanes)) + 2 * (H + kLanes) floats. `ahead`: fetched a part per head.
template <typename C>
void attend_block(const C* k, const C* v, int64_t stride, int64_t count, int64_t H,
                  int64_t group, int64_t D, const float* qs, float* acc, float* m, float* l,
                  float* s, const Ahead& ahead) {
  const int64_t sb = (count + kLanes - 1) / kLanes * kLanes;
  float* m_new = s + H * sb;
  float* corr = m_new + H + kLanesMax;
  for (int64_t g = 0; g < H; ++g) {
    ahead.fetch(g, 2 * H);
    const C* kh = k + (g / group) * D;
    for (int64_t j = 0; j < count; j += kLanes) {
      vstore(s + g * sb + j, row_scores(qs + g * D, kh + j * stride, stride, D,
                                        std::min(kLanes, count - j)));
    }
  }
  for (int64_t g = 0; g < H; ++g) m_new[g] = std::max(m[g], scores_max(s + g * sb, count));
  for (int64_t g = 0; g < H; g += kLanes) {  // exp(m - m_new): 0 (as good as) for m = -inf
    vstore(corr + g, vexp(vsub(vload(m + g), vload(m_new + g))));
  }
  for (int64_t g = 0; g < H; ++g) {
    l[g] = l[g] * corr[g] + exp_scores(s + g * sb, count, m_new[g]);
    m[g] = m_new[g];
  }
  for (int64_t g = 0; g < H; ++g) {
    ahead.fetch(H + g, 2 * H);
    const C* vh = v + (g / group) * D;
    float* ag = acc + g * D;
    const float* p = s + g * sb;
    for (int64_t d = 0; d < D;) {  // up to 8 independent FMA chains per block row
      const int64_t left = (D - d) / kLanes;
      if (left >= 8) {
        add_weighted_rows<8>(ag + d, corr[g], p, vh + d, stride, count);
      } else if (left >= 4) {
        add_weighted_rows<4>(ag + d, corr[g], p, vh + d, stride, count);
      } else if (left >= 2) {
        add_weighted_rows<2>(ag + d, corr[g], p, vh + d, stride, count);
      } else {
        add_weighted_rows<1>(ag + d, corr[g], p, vh + d, stride, count);
      }
      d += kLanes * (left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1);
    }
  }
}
#endif

// Decode attention straight from the paged cache: every K/V head of a sequence in one task, so
// a cache block's rows are read as one contiguous run (16 KB a block for llama-160m) rather
// than one head's 256-byte row out of every 1 KB; an online softmax over the task's context,
// read one block at a time in place (scores of the block first, then one rescale per block,
// not per position); the query heads of a GQA group share each K/V row. Too few sequences to
// keep every thread busy: each sequence's context is split into parts of at least
// `split_min_tokens` (flash-decoding), attended in parallel and merged by their log-sum-exp.
// q, out: [T, H, D] float32; cache: [2, num_blocks, block_size, Hkv, D].
// With SIMD and D a multiple of the vector width: kLanes scores per transpose-and-add tree, the
// softmax weights by a vector exp, and the weighted sum of V rows accumulated in registers one
// D-slice at a time.
// One query row: the query token t of sequence seq attends the context positions [lo, hi).
struct QueryRow {
  int64_t t, seq, lo, hi;
};

template <typename C>
void attend_rows(float* op, const float* qp, const at::Tensor& cache,
                 const std::vector<QueryRow>& rows, const int64_t* tables, int64_t max_blocks,
                 int64_t H, float sc, int64_t split_min_tokens) {
  const int64_t NB = cache.size(1), BS = cache.size(2), Hkv = cache.size(3), D = cache.size(4);
  const int64_t group = H / Hkv, n = static_cast<int64_t>(rows.size()), stride = Hkv * D;
  const C* kp = cache.data_ptr<C>();
  const C* vp = kp + NB * BS * Hkv * D;
#ifdef EMBER_SIMD
  const bool simd = D % kLanes == 0;
#else
  const bool simd = false;
#endif
  // Parts per sequence: enough tasks for 4 per thread, none shorter than split_min_tokens.
  const int64_t threads = at::get_num_threads();
  int64_t parts = 1;
  if (n < 4 * threads) {
    int64_t longest = 0;
    for (const QueryRow& r : rows) longest = std::max(longest, r.hi - r.lo);
    const int64_t most = std::max<int64_t>(1, longest / std::max<int64_t>(split_min_tokens, 1));
    parts = std::min((4 * threads + n - 1) / n, most);
  }
  // Each part's unnormalized sums: [n * parts, H, D] and its softmax max and sum [n * parts, H].
  std::vector<float> part_acc, part_m, part_l;
  if (parts > 1) {
    part_acc.resize(n * parts * H * D);
    part_m.resize(n * parts * H);
    part_l.resize(n * parts * H);
  }
  at::parallel_for(0, n * parts, 1, [&](int64_t u0, int64_t u1) {
    // m padded to whole vectors (attend_block reads it a vector of heads at a time)
    std::vector<float> acc(H * D), qs(H * D), m(H + kLanesMax), l(H),
        s(H * (BS + kLanesMax) + 2 * (H + kLanesMax));
    // Task u's sequence and positions [lo, hi): its part of the context [first, len), split
    // at block boundaries.
    auto span = [&](int64_t u, int64_t& lo, int64_t& hi) {
      const int64_t q_i = u / parts, part = u % parts;
      const int64_t first = rows[q_i].lo, len = rows[q_i].hi;
      const int64_t b0 = first / BS, blocks = (len - 1) / BS + 1 - b0;
      lo = std::max(first, (b0 + blocks * part / parts) * BS);
      hi = std::min(len, (b0 + blocks * (part + 1) / parts) * BS);
      return rows[q_i].seq;
    };
    // The rows [from, to) of sequence seq's block at position `from` (none when from >= to).
    auto rows_at = [&](int64_t seq, int64_t from, int64_t to) {
      Ahead a;
      if (from >= to) return a;
      const int64_t blk = tables[seq * max_blocks + from / BS];
      const int64_t off = from % BS, count = std::min(BS - off, to - from);
      a.k = reinterpret_cast<const char*>(kp + (blk * BS + off) * stride);
      a.v = reinterpret_cast<const char*>(vp + (blk * BS + off) * stride);
      a.bytes = count * stride * static_cast<int64_t>(sizeof(C));
      return a;
    };
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t q_i = u / parts, t = rows[q_i].t;
      int64_t lo, hi, next_lo = 0, next_hi = 0;
      const int64_t i = span(u, lo, hi);
      const int64_t next_i = u + 1 < u1 ? span(u + 1, next_lo, next_hi) : 0;
      for (int64_t e = 0; e < H; ++e) {  // state e: query head e
        const float* qr = qp + (t * H + e) * D;
        for (int64_t d = 0; d < D; ++d) qs[e * D + d] = qr[d] * sc;
        m[e] = -INFINITY;
        l[e] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = lo; start < hi;) {
        const int64_t off = start % BS, count = std::min(BS - off, hi - start);
        const int64_t blk = tables[i * max_blocks + start / BS];
        // Ahead of the hardware prefetcher: this task's next block, or the next task's first.
        const Ahead ahead = start + count < hi ? rows_at(i, start + count, hi)
                                               : rows_at(next_i, next_lo, next_hi);
#ifdef EMBER_SIMD
        if (simd) {
          attend_block(kp + (blk * BS + off) * stride, vp + (blk * BS + off) * stride, stride,
                       count, H, group, D, qs.data(), acc.data(), m.data(), l.data(), s.data(),
                       ahead);
          start += count;
          continue;
        }
#endif
        ahead.fetch(0, 1);
        for (int64_t g = 0; g < H; ++g) {
          const int64_t h = g / group;
          const C* kb = kp + ((blk * BS + off) * Hkv + h) * D;
          const C* vb = vp + ((blk * BS + off) * Hkv + h) * D;
          const float* qg = qs.data() + g * D;
          float* ag = acc.data() + g * D;
          float mx = m[g];
          for (int64_t j = 0; j < count; ++j) s[j] = dot_row(qg, kb + j * stride, D);
          for (int64_t j = 0; j < count; ++j) mx = std::max(mx, s[j]);
          if (mx > m[g]) {  // a new maximum: rescale what is summed so far
            const float correction = std::exp(m[g] - mx);
            l[g] *= correction;
            for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
            m[g] = mx;
          }
          for (int64_t j = 0; j < count; ++j) {
            const float p = std::exp(s[j] - mx);
            l[g] += p;
            add_scaled_row(ag, p, vb + j * stride, D);
          }
        }
        start += count;
      }
      if (parts > 1) {  // merged below
        std::copy(acc.begin(), acc.end(), part_acc.begin() + u * H * D);
        std::copy(m.begin(), m.begin() + H, part_m.begin() + u * H);
        std::copy(l.begin(), l.end(), part_l.begin() + u * H);
        continue;
      }
      for (int64_t e = 0; e < H; ++e) {
        float* o = op + (t * H + e) * D;
        const float inv = l[e] > 0.f ? 1.f / l[e] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[e * D + d] * inv;
      }
    }
  });
  if (parts == 1) return;
  // out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M), M the parts' largest max (a part
  // with no positions has m = -inf and weight 0).
  at::parallel_for(0, n * H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t q_i = r / H, e = r % H;
      float* o = op + (rows[q_i].t * H + e) * D;
      float mx = -INFINITY, total = 0.f;
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part_m[(q_i * parts + p) * H + e]);
      std::fill(o, o + D, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t u = q_i * parts + p;
        if (part_l[u * H + e] == 0.f) continue;
        const float w = std::exp(part_m[u * H + e] - mx);
        total += part_l[u * H + e] * w;
        const float* a = part_acc.data() + (u * H + e) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += a[d] * w;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

// An index tensor's values as contiguous int64: its own data when it is that already, else
// widened into `buf` (the runner's int32 metadata) without an ATen allocation per call.
const int64_t* as_int64(const at::Tensor& t, std::vector<int64_t>& buf) {
  if (t.scalar_type() == at::kLong && t.is_contiguous()) return t.data_ptr<int64_t>();
  buf.resize(t.numel());
  if (t.scalar_type() == at::kInt && t.is_contiguous()) {
    const int32_t* p = t.data_ptr<int32_t>();
    std::copy(p, p + t.numel(), buf.begin());
  } else {
    const at::Tensor l = t.to(at::kLong).contiguous();
    std::copy(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel(), buf.begin());
  }
  return buf.data();
}

// cache[0 / 1] rows at `slot_mapping` = key / value rows ([T, Hkv, D], cast to the cache's
// dtype): plain row copies, no indexing dispatch.
void write_slots(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& slot_mapping) {
  const int64_t rows = cache.size(1) * cache.size(2), row = cache.size(3) * cache.size(4);
  const int64_t T = slot_mapping.numel(), elem = cache.element_size();
  TORCH_CHECK(key.numel() == T * row && value.numel() == T * row,
              "paged_attention_cpu: key/value must hold one [Hkv, D] row per slot");
  std::vector<int64_t> slots_buf;
  const int64_t* sp = as_int64(slot_mapping, slots_buf);
  const at::Tensor k = key.to(cache.scalar_type()).contiguous();
  const at::Tensor v = value.to(cache.scalar_type()).contiguous();
  char* base = static_cast<char*>(cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < rows, "paged_attention_cpu: slot ", sp[t],
                " is outside the cache's ", rows, " slots");
    std::memcpy(base + sp[t] * row * elem, kp + t * row * elem, row * elem);
    std::memcpy(base + (rows + sp[t]) * row * elem, vp + t * row * elem, row * elem);
  }
}

// A prefill chunk's rows reordered so that every contiguous run of them holds about its share
// of the work: at::parallel_for hands each thread one contiguous range, and a causal chunk's
// rows in order put its short contexts on the first thread and its long ones on the last (a
// 128-token prefill: 3x the positions on one of two threads). Alternately the shortest and the
// longest rows left, so neighbours' costs sum to about the same; the rows stay with their
// sequence's (whose K/V rows they share in cache).
void balance_chunk(std::vector<QueryRow>& rows, size_t first, size_t last) {
  std::vector<QueryRow> by_cost(rows.begin() + first, rows.begin() + last);
  std::stable_sort(by_cost.begin(), by_cost.end(), [](const QueryRow& a, const QueryRow& b) {
    return a.hi - a.lo < b.hi - b.lo;
  });
  size_t lo = 0, hi = by_cost.size();
  for (size_t i = first; i < last; ++i) rows[i] = (i - first) % 2 ? by_cost[--hi] : by_cost[lo++];
}

// Prefill chunks of a step are attended here too (`chunks`) while their query rows' contexts
// add up to at most this many positions; past it (long prompts, long prefixes) they are left
// to the PyTorch code, whose SDPA reuses each K/V row across the query rows of a chunk.
// 2^18: a step of 2,048 tokens of ~40-token texts (an embedding batch) is ~80,000; a
// 128-token prompt 8,256.
constexpr int64_t kChunkRowsMaxPositions = int64_t{1} << 18;

// Write the step's K/V, then attend every decode and, with `chunks`, the prefill chunks (each
// of their query rows as a row of its own: positions [0, p] causal or the whole sequence,
// within the sliding window) unless too long; returns 1 when chunks are left.
int64_t attend_step(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                    const at::Tensor& value, at::Tensor& cache, const at::Tensor& slot_mapping,
                    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables, double scale, int64_t sliding_window,
                    int64_t split_min_tokens, bool causal, bool chunks) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && cache.is_contiguous(),
              "paged_attention_cpu: out must be contiguous float32, the cache contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16,
              "paged_attention_cpu: the cache must be float32 or bfloat16");
  const int64_t H = query.size(1);
  write_slots(cache, key, value, slot_mapping);
  std::vector<int64_t> qsl_buf, lens_buf, tables_buf;
  const int64_t* qsl = as_int64(query_start_loc, qsl_buf);
  const int64_t* lens = as_int64(seq_lens, lens_buf);
  std::vector<QueryRow> rows, chunk_rows;
  int64_t flags = 0, chunk_positions = 0;
  for (int64_t i = 0; i < seq_lens.numel(); ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    if (q_len > 1) flags |= 1;
    if (q_len > 1 && !chunks) continue;
    for (int64_t j = 0; j < q_len; ++j) {  // query row j sits at position p
      const int64_t p = lens[i] - q_len + j;
      const int64_t hi = causal ? p + 1 : lens[i];
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
      if (q_len == 1) {
        rows.push_back({qsl[i], i, lo, hi});
      } else {
        chunk_rows.push_back({qsl[i] + j, i, lo, hi});
        chunk_positions += hi - lo;
      }
    }
  }
  if (!chunk_rows.empty() && chunk_positions <= kChunkRowsMaxPositions) {
    const size_t first = rows.size();
    rows.insert(rows.end(), chunk_rows.begin(), chunk_rows.end());
    flags = 0;
    for (size_t i = first, j = first; i < rows.size(); i = j) {  // one chunk at a time
      while (j < rows.size() && rows[j].seq == rows[i].seq) ++j;
      balance_chunk(rows, i, j);
    }
  }
  if (rows.empty()) return flags;
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const int64_t* tables = as_int64(block_tables, tables_buf);
  const int64_t max_blocks = block_tables.size(1);
  const float sc = static_cast<float>(scale);
  if (cache.scalar_type() == at::kFloat) {
    attend_rows<float>(out.data_ptr<float>(), q.data_ptr<float>(), cache, rows, tables,
                       max_blocks, H, sc, split_min_tokens);
  } else {
    attend_rows<c10::BFloat16>(out.data_ptr<float>(), q.data_ptr<float>(), cache, rows, tables,
                               max_blocks, H, sc, split_min_tokens);
  }
  return flags;
}

// The torch backend's paged attention for the common case, in one call: write the step's K/V
// into the cache, then attend every decode (one new token) in place from the blocks into
// `out` (float32, zeros). Returns flags for what is left to the PyTorch code: 1 = prefill
// chunks / prefix hits are present (2, decodes, is never left: a decode whose context is
// worth splitting is split here, into parts of at least split_min_tokens).
int64_t paged_attention_cpu(at::Tensor out, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, at::Tensor cache,
                            const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables,
                            double scale, int64_t sliding_window, int64_t split_min_tokens) {
  return attend_step(out, query, key, value, cache, slot_mapping, query_start_loc, seq_lens,
                     block_tables, scale, sliding_window, split_min_tokens, true, false);
}

// The shortest part of a decode's context that the flash-decoding split makes: two blocks of
// 16, so a batch-1 decode over llama-160m's 140-token W-LAT context already gives two threads
// four parts (the value itself was not tuned against others).
constexpr int64_t kSplitMinTokens = 32;

// `ember::paged_attention` (the torch backend's op, contract in ember.attention.ops) with the
// common case in C++: a decode step runs no Python at all (the Python op's own wrapper cost
// ~10 us per layer). What `paged_attention_cpu` leaves (prefill chunks, split decodes) and
// soft-capped models go to the PyTorch code through the dispatcher
// (`ember::paged_attention_rest` / `ember::paged_attention`, ember.attention.torch_cpu).
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, at::Tensor cache,
                           const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables,
                           double scale, int64_t sliding_window, double softcap, bool causal) {
  if (softcap > 0) {
    static const auto python_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("ember::paged_attention", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, double, int64_t, double,
                              bool)>();
    return python_op.call(query, key, value, cache, slot_mapping, query_start_loc, seq_lens,
                          block_tables, scale, sliding_window, softcap, causal);
  }
  at::Tensor out = at::zeros(query.sizes(), query.options().dtype(at::kFloat));
  const int64_t left =
      attend_step(out, query, key, value, cache, slot_mapping, query_start_loc, seq_lens,
                  block_tables, scale, sliding_window, kSplitMinTokens, causal, true);
  if (left != 0) {
    static const auto rest =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("ember::paged_attention_rest", "")
            .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                        int64_t, double, bool, int64_t)>();
    rest.call(out, query, cache, query_start_loc, seq_lens, block_tables, scale, sliding_window,
              softcap, causal, left);
  }
  return query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type());
}

// Structured outputs: logits[i, v] = -inf wherever bit v of bitmask[i] (int32 words, bit v % 32
// of word v / 32, xgrammar's and llguidance's layout) is 0. One pass over the bits; a row reads
// V / 8 bytes of mask and writes only the masked logits.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_token_bitmask: logits must be a contiguous float32 [rows, vocab]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(0) == logits.size(0) && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous int32 [rows, words]");
  const int64_t rows = logits.size(0), V = logits.size(1), W = bitmask.size(1);
  const int64_t n = std::min(V, W * 32);
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t words = (n + 31) / 32;
  // Rows x words in one parallel loop: a 262k-id row is 8k words, worth two threads.
  at::parallel_for(0, rows * words, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / words, w = i % words;
      float* l = logits.data_ptr<float>() + r * V;
      const uint32_t* b = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + r * W;
      uint32_t off = ~b[w];
      if (w * 32 + 32 > n) off &= (n - w * 32 == 32) ? ~0u : ((1u << (n - w * 32)) - 1);
      while (off) {
        l[w * 32 + __builtin_ctz(off)] = ninf;
        off &= off - 1;
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {  // ids past the mask's words: never allowed
    float* l = logits.data_ptr<float>() + r * V;
    for (int64_t v = n; v < V; ++v) l[v] = ninf;
  }
}

// The largest value of each row of x [M, V] (fp32) and the first index holding it, as
// torch.max(x, dim=-1) gives them, in one vectorized pass plus a scan for the index; NaN (index
// 0) for a row holding a NaN. The sampler's greedy tokens and its check for rows nothing can
// be sampled from, which ATen's max with indices takes ~20 us a 32k-id row for.
std::tuple<at::Tensor, at::Tensor> row_max(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) > 0,
              "row_max: x must be a non-empty fp32 [M, V] tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), V = x.size(1);
  at::Tensor values = at::empty({M}, x.options());
  at::Tensor indices = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * V;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t v = 0;
#if defined(EMBER_SIMD) && defined(__AVX512F__)
      __m512 acc = _mm512_set1_ps(best);
      __mmask16 unordered = 0;
      for (; v + 16 <= V; v += 16) {
        const __m512 r = _mm512_loadu_ps(row + v);
        unordered |= _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
        acc = _mm512_max_ps(acc, r);
      }
      nan = unordered != 0;
      best = _mm512_reduce_max_ps(acc);
#elif defined(EMBER_SIMD)
      __m256 acc = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
      for (; v + 8 <= V; v += 8) {
        const __m256 r = _mm256_loadu_ps(row + v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
        acc = _mm256_max_ps(acc, r);
      }
      nan = _mm256_movemask_ps(unordered) != 0;
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      for (float l : lanes) best = std::max(best, l);
#endif
      for (; v < V; ++v) {
        if (std::isnan(row[v])) nan = true;
        else best = std::max(best, row[v]);
      }
      if (nan) {
        vp[m] = std::numeric_limits<float>::quiet_NaN();
        ip[m] = 0;
        continue;
      }
      int64_t k = 0;
#if defined(EMBER_SIMD) && defined(__AVX512F__)
      const __m512 b = _mm512_set1_ps(best);
      for (; k + 16 <= V; k += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + k), b, _CMP_EQ_OQ);
        if (hit) {
          k += __builtin_ctz(hit);
          break;
        }
      }
#elif defined(EMBER_SIMD)
      const __m256 b = _mm256_set1_ps(best);
      for (; k + 8 <= V; k += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + k), b, _CMP_EQ_OQ));
        if (hit) {
          k += __builtin_ctz(hit);
          break;
        }
      }
#endif
      while (row[k] != best) ++k;  // the scalar tail (a hit above stops here at once)
      vp[m] = best;
      ip[m] = k;
    }
  });
  return {values, indices};
}

// ---------------------------------------------------------------------------------------------
// Loading group-quantized weights (`GroupLinear`): rows of codes, or of GGUF blocks straight
// from the file, written into the panels in one pass (the torch re-layout took ~6 ops per
// chunk of rows: qwen2-0.5b Q4_0 loaded in 3.3 s against llama.cpp's 0.6 s).

// Writes channel `row`'s stored bytes (the `GroupLinear` layout before panels, `Q` 32-bit
// lanes) into panel lanes: lane j of channel n goes to codes[n / P][j][n % P].
inline void scatter_lanes(uint8_t* codes, int64_t Q, int64_t P, int64_t row,
                          const uint8_t* stored) {
  uint32_t* panel = reinterpret_cast<uint32_t*>(codes) + (row / P) * Q * P + row % P;
  for (int64_t j = 0; j < Q; ++j) std::memcpy(panel + j * P, stored + 4 * j, 4);
}

// A group's 32 4-bit codes `q` (one per byte, low nibbles read) as 16 stored bytes: byte
// 4i + j holds k = 8i + j in its low nibble and 8i + 4 + j in its high one.
inline void store_nibbles(const uint8_t* q, uint8_t* out) {
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      out[4 * i + j] = (q[8 * i + j] & 15) | (q[8 * i + 4 + j] & 15) << 4;
}

// One channel's stored bytes from its codes (one per value: int8 q for 8 bits, uint8 for 4
// and 6; see `GroupLinear`).
void store_codes(const uint8_t* q, int64_t K, int64_t bits, uint8_t* out) {
  if (bits == 8) {
    for (int64_t k = 0; k < K; ++k) out[k] = q[k] ^ 0x80;  // int8 q + 128
    return;
  }
  const int64_t step = bits == 4 ? 16 : 24;  // stored bytes per group of 32
  for (int64_t g = 0; g < K / 32; ++g, q += 32, out += step) {
    store_nibbles(q, out);
    if (bits == 6) {  // the high pairs of each 16 k: k = 16h + 4c + j in bits 2c of byte j
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j) {
          uint8_t b = 0;
          for (int c = 0; c < 4; ++c) b |= ((q[16 * h + 4 * c + j] >> 4) & 3) << (2 * c);
          out[16 + 4 * h + j] = b;
        }
    }
  }
}

// GGUF block types `group_pack_blocks` reads: name, values per block, bytes per block, code
// bits of the panels they fill, whether those carry offsets, and the decoder in store_blocks
// (kPlain: an fp16 scale, an fp16 offset where `offsets`, then the codes: Q8_0, Q4_0, Q4_1).
// The table of which types are packed how is mirrored by ember.compiler.quant.BLOCK_TYPES;
// each call checks its panels against this one.
enum class BlockDecoder { kPlain, kQ4K, kQ6K, kQ5_0 };
struct BlockType {
  const char* name;
  int64_t values, bytes, bits;
  bool offsets;
  BlockDecoder decoder;
};
constexpr BlockType kBlockTypes[] = {
    {"Q8_0", 32, 34, 8, false, BlockDecoder::kPlain},
    {"Q4_0", 32, 18, 4, false, BlockDecoder::kPlain},
    {"Q4_1", 32, 20, 4, true, BlockDecoder::kPlain},
    {"Q4_K", 256, 144, 4, true, BlockDecoder::kQ4K},
    {"Q6_K", 256, 210, 6, false, BlockDecoder::kQ6K},
    {"Q5_0", 32, 22, 8, false, BlockDecoder::kQ5_0},
};

inline uint16_t half_bits(float x) { return c10::Half(x).x; }  // round to nearest even

// 16 floats as fp16 bits, rounded to nearest even as half_bits: F16C where the build has it
// (every x86-64-v3 or native build here), else c10::Half's software conversion.
inline void half_bits16(const float* f, uint16_t* h) {
#ifdef __F16C__
  for (int i = 0; i < 16; i += 8) {
    const __m128i v = _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), v);
  }
#else
  for (int i = 0; i < 16; ++i) h[i] = half_bits(f[i]);
#endif
}

// One group's 16 stored nibble bytes (byte 4i + j = q[8i + j] | q[8i + 4 + j] << 4, as
// store_nibbles) from 32 bytes holding its codes q_t in bits shift .. shift + 3 of byte t
// (Q4_K's and Q6_K's low nibbles): 32-bit word operations, no byte loop.
inline void nibble_group(const uint8_t* src, int shift, uint8_t* out) {
  constexpr uint32_t lo = 0x0F0F0F0Fu;
  uint32_t w[8], s[4];
  std::memcpy(w, src, 32);
  for (int i = 0; i < 4; ++i) s[i] = (w[2 * i] >> shift & lo) | (w[2 * i + 1] >> shift & lo) << 4;
  std::memcpy(out, s, 16);
}

// One channel's stored bytes, fp16 scales d[g * P] (and offsets m[g * P]) from its blocks:
// Q8_0 (fp16 d, 32 int8 q), Q4_0 (fp16 d, 16 bytes: q_t in the low nibble of byte t, q_16+t
// in its high one), Q4_1 (fp16 d and m, then as Q4_0) exactly; Q4_K (fp16 d and dmin, 12
// bytes of 6-bit sc and m per 32 values, 128 bytes of nibbles: sub-blocks 2i and 2i + 1 in
// the low and high nibbles of bytes 32i..32i + 31) as d sc and -dmin m rounded to fp16; Q6_K
// (128 bytes of low nibbles, 64 of high pairs, 16 int8 sc, fp16 d) as codes q in [0, 63]
// with scales d sc per 16 values rounded to fp16 (ggml's dequantizers' order); Q5_0 (fp16 d,
// 32 high bits, 16 bytes of low nibbles as Q4_0's) exactly as 8-bit codes q - 16 (all 0
// where d is 0, as the converter writes them).
void store_blocks(const uint8_t* blocks, int64_t K, const BlockType& type, uint8_t* out,
                  uint16_t* d, uint16_t* m, int64_t P) {
  for (int64_t blk = 0; blk < K / type.values; ++blk) {
    const uint8_t* b = blocks + blk * type.bytes;
    if (type.decoder == BlockDecoder::kQ4K) {
      const float dd = c10::detail::fp16_ieee_to_fp32_value(b[0] | b[1] << 8);
      const float dmin = c10::detail::fp16_ieee_to_fp32_value(b[2] | b[3] << 8);
      const uint8_t* sm = b + 4;
      float f[16];  // the 8 scales, then the 8 offsets
      for (int j = 0; j < 8; ++j) {  // ggml's get_scale_min_k4
        const int sc = j < 4 ? sm[j] & 63 : (sm[j + 4] & 15) | (sm[j - 4] >> 6) << 4;
        const int mn = j < 4 ? sm[j + 4] & 63 : (sm[j + 4] >> 4) | (sm[j] >> 6) << 4;
        f[j] = dd * float(sc);
        f[8 + j] = -dmin * float(mn);
      }
      uint16_t h[16];
      half_bits16(f, h);
      for (int j = 0; j < 8; ++j) {
        d[(8 * blk + j) * P] = h[j];
        m[(8 * blk + j) * P] = h[8 + j];
      }
      for (int g = 0; g < 8; ++g)  // sub-block g: the low (even g) or high nibbles
        nibble_group(b + 16 + 32 * (g / 2), 4 * (g % 2), out + blk * 128 + 16 * g);
      continue;
    }
    if (type.decoder == BlockDecoder::kQ6K) {
      // Value 128 h + 32 s + t (s, t < 32 in each half h): its low nibble in bits 4 (s / 2)
      // of ql[64 h + 32 (s % 2) + t], its high pair in bits 2 s of qh[32 h + t]. That is
      // group 4 h + s: nibbles as nibble_group's; pair bytes 4 c + j of each 16 k, four a
      // stored byte (k = 16 u + 4 c + j in bits 2c of byte 4 u + j), from 32-bit words.
      const uint8_t *ql = b, *qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float dd = c10::detail::fp16_ieee_to_fp32_value(b[208] | b[209] << 8);
      float f[16];
      for (int j = 0; j < 16; ++j) f[j] = dd * float(sc[j]);
      uint16_t h16[16];
      half_bits16(f, h16);
      for (int j = 0; j < 16; ++j) d[(16 * blk + j) * P] = h16[j];
      for (int g = 0; g < 8; ++g) {
        const int h = g / 4, s = g % 4;
        uint8_t* o = out + blk * 192 + 24 * g;
        nibble_group(ql + 64 * h + 32 * (s % 2), 4 * (s / 2), o);
        uint32_t w[8], pairs[2] = {0, 0};
        std::memcpy(w, qh + 32 * h, 32);
        for (int u = 0; u < 2; ++u)
          for (int c = 0; c < 4; ++c)
            pairs[u] |= (w[4 * u + c] >> (2 * s) & 0x03030303u) << (2 * c);
        std::memcpy(o + 16, pairs, 8);
      }
      continue;
    }
    if (type.decoder == BlockDecoder::kQ5_0) {
      std::memcpy(d + blk * P, b, 2);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const bool zero = ((b[0] | b[1] << 8) & 0x7fff) == 0;
      for (int t = 0; t < 32; ++t) {
        const int low = t < 16 ? b[6 + t] & 15 : b[6 + t - 16] >> 4;
        const int code = (low | (qh >> t & 1) << 4) - 16;
        out[32 * blk + t] = uint8_t(zero ? 0 : code) ^ 0x80;
      }
      continue;
    }
    const int64_t head = type.offsets ? 4 : 2;
    std::memcpy(d + blk * P, b, 2);
    if (type.offsets) std::memcpy(m + blk * P, b + 2, 2);
    const uint8_t* c = b + head;
    if (type.bits == 8) {
      for (int k = 0; k < 32; ++k) out[32 * blk + k] = c[k] ^ 0x80;
      continue;
    }
    // stored byte 4i + j = q[8i + j] | q[8i + 4 + j] << 4, q_t = c[t] & 15, q_16+t = c[t] >> 4
    uint32_t w[4];
    std::memcpy(w, c, 16);
    const uint32_t lo = 0x0F0F0F0Fu;
    const uint32_t s[4] = {(w[0] & lo) | (w[1] & lo) << 4, (w[2] & lo) | (w[3] & lo) << 4,
                           (w[0] >> 4 & lo) | (w[1] & ~lo), (w[2] >> 4 & lo) | (w[3] & ~lo)};
    std::memcpy(out + 16 * blk, s, 16);
  }
}

void check_group_panels(const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t row, int64_t n,
                        int64_t bits, const char* op) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, op, ": bits must be 4, 6 or 8");
  TORCH_CHECK(codes.dim() == 4 && codes.size(3) == 4 && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(),
              op, ": codes must be contiguous uint8 panels [P, lanes, panel, 4]");
  const int64_t P = codes.size(2);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(2) == P &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              op, ": scales must be contiguous fp16 [P, groups, panel]");
  TORCH_CHECK(!mins || (mins->sizes() == scales.sizes() && mins->scalar_type() == at::kHalf &&
                        mins->is_contiguous()),
              op, ": mins must be shaped as scales");
  TORCH_CHECK(row >= 0 && row % P == 0 && row + n <= codes.size(0) * P, op, ": rows [", row,
              ", ", row + n, ") do not start a panel or do not fit the panels");
}

// Rows [row, row + n) of a `GroupLinear`'s panels from codes q [n, K] (int8 for 8 bits, else
// uint8), fp16 scales d [n, K / 32] (6 bits: [n, K / 16]) and offsets m (4 bits).
void group_pack_codes(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                      int64_t row, const at::Tensor& q_in, const at::Tensor& d_in,
                      const c10::optional<at::Tensor>& m_in, int64_t bits) {
  const char* op = "group_pack_codes";
  TORCH_CHECK(q_in.dim() == 2, op, ": codes must be 2-D [n, K]");
  const int64_t n = q_in.size(0), K = q_in.size(1);
  check_group_panels(codes, scales, mins, row, n, bits, op);
  TORCH_CHECK(q_in.scalar_type() == (bits == 8 ? at::kChar : at::kByte), op,
              ": codes must be int8 for 8 bits, uint8 for 4 and 6");
  const int64_t Q = codes.size(1), P = codes.size(2), per = bits == 6 ? 16 : 32;
  TORCH_CHECK(K % 32 == 0 && Q * 4 == K * bits / 8 && scales.size(1) == K / per, op,
              ": codes [", n, ", ", K, "] do not match the panels");
  TORCH_CHECK(d_in.sizes() == at::IntArrayRef({n, K / per}) && d_in.scalar_type() == at::kHalf,
              op, ": scales must be fp16 [n, K / ", per, "]");
  TORCH_CHECK(mins.has_value() == m_in.has_value() &&
                  (!m_in || (m_in->sizes() == d_in.sizes() && m_in->scalar_type() == at::kHalf)),
              op, ": offsets must be given for offset panels only, shaped as scales");
  const at::Tensor q = q_in.contiguous(), d = d_in.contiguous();
  const at::Tensor m = m_in ? m_in->contiguous() : at::Tensor();
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = m.defined() ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr;
  auto* cp = codes.data_ptr<uint8_t>();
  auto* sp = reinterpret_cast<uint16_t*>(scales.data_ptr());
  auto* op_m = mins ? reinterpret_cast<uint16_t*>(mins->data_ptr()) : nullptr;
  const int64_t G = K / per, first = row / P, panels = (n + P - 1) / P;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> stored(Q * 4);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = p * P; r < std::min(n, (p + 1) * P); ++r) {
        store_codes(qp + r * K, K, bits, stored.data());
        scatter_lanes(cp, Q, P, row + r, stored.data());
        const int64_t base = (first + p) * G * P + r % P;
        for (int64_t g = 0; g < G; ++g) {
          sp[base + g * P] = dp[r * G + g];
          if (mp) op_m[base + g * P] = mp[r * G + g];
        }
      }
  });
}

// Rows [row, row + n) of a `GroupLinear`'s panels straight from a GGUF tensor's bytes
// `blocks` [n, row bytes] of `type` (see `kBlockTypes` and `store_blocks`).
void group_pack_blocks(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                       int64_t row, const at::Tensor& blocks_in, c10::string_view type_name) {
  const char* op = "group_pack_blocks";
  const BlockType* type = nullptr;
  for (const BlockType& t : kBlockTypes)
    if (type_name == t.name) type = &t;
  TORCH_CHECK(type != nullptr, op, ": unknown block type ", type_name);
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte, op,
              ": blocks must be uint8 [n, row bytes]");
  const int64_t n = blocks_in.size(0);
  check_group_panels(codes, scales, mins, row, n, type->bits, op);
  TORCH_CHECK(mins.has_value() == type->offsets, op, ": ", type->name, " panels ",
              type->offsets ? "need" : "have no", " offsets");
  const int64_t Q = codes.size(1), P = codes.size(2), G = scales.size(1);
  const int64_t K = G * (type->bits == 6 ? 16 : 32);
  TORCH_CHECK(K % type->values == 0 && blocks_in.size(1) == K / type->values * type->bytes &&
                  Q * 4 == K * type->bits / 8,
              op, ": rows of ", blocks_in.size(1), " bytes are not ", K / type->values, " ",
              type->name, " blocks of ", type->bytes, " bytes");
  const at::Tensor blocks = blocks_in.contiguous();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  auto* cp = codes.data_ptr<uint8_t>();
  auto* sp = reinterpret_cast<uint16_t*>(scales.data_ptr());
  auto* mp = mins ? reinterpret_cast<uint16_t*>(mins->data_ptr()) : nullptr;
  const int64_t first = row / P, panels = (n + P - 1) / P;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> stored(Q * 4);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = p * P; r < std::min(n, (p + 1) * P); ++r) {
        const int64_t base = (first + p) * G * P + r % P;
        store_blocks(bp + r * row_bytes, K, *type, stored.data(), sp + base,
                     mp ? mp + base : nullptr, P);
        scatter_lanes(cp, Q, P, row + r, stored.data());
      }
  });
}

}  // namespace

TORCH_LIBRARY(ember_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def(
      "paged_attention_cpu(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
      "Tensor(b!) cache, Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, float scale, int sliding_window, int split_min_tokens) -> int");
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
      "float scale, int sliding_window, float softcap, bool causal) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.def("row_max(Tensor x) -> (Tensor, Tensor)");
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("pack_bf16_pairs(Tensor w) -> Tensor");
  m.def(
      "packed_linear(Tensor x, Tensor w, Tensor? scales, Tensor? bias, int out_features) -> "
      "Tensor");
  m.def(
      "group_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, "
      "int out_features, int bits) -> Tensor");
  m.def(
      "group_pack_codes(Tensor(a!) codes, Tensor(b!) scales, Tensor(c!)? mins, int row, "
      "Tensor q, Tensor d, Tensor? m, int bits) -> ()");
  m.def(
      "group_pack_blocks(Tensor(a!) codes, Tensor(b!) scales, Tensor(c!)? mins, int row, "
      "Tensor blocks, str type) -> ()");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("fp32_linear", &fp32_linear);
  m.impl("paged_attention_cpu", &paged_attention_cpu);
  m.impl("paged_attention", &paged_attention);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("row_max", &row_max);
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("group_linear", &group_linear);
  m.impl("group_pack_codes", &group_pack_codes);
  m.impl("group_pack_blocks", &group_pack_blocks);
}

#ifdef EMBER_FAST_CALLS
// Fast calls: the ops that a compiled graph calls once per layer, as Python builtins that go
// straight to the dispatcher's unboxed kernel (`OperatorHandle::typed().call`: profiling and
// dispatch modes are kept), for the generated wrapper code to call instead of
// `torch.ops.ember_cpu.<op>.default` (see `ember.kernels.install_fast_calls`). Python's op call
// costs 1.5-2.3 us more per call (its arguments are converted to a boxed stack of IValues
// against the schema, the GIL is dropped, the boxed kernel unboxes them again), about what a
// decode-size kernel itself takes; a batch-1 step of a 12-layer model makes 60 such calls.
// Here the arguments are read straight from the Python objects: exact tensors, None, int,
// float and bool; any other argument (a tensor subclass, a SymInt) goes to the Python op,
// `fallback`. The GIL is dropped while the kernel runs, as for ATen's own ops.
//
// torch_python's own header (`python_variable.h`) pulls in pybind11 and costs ~10 s of
// compile, so the three symbols used are declared here; the layout of a Python tensor (an
// at::Tensor after the object header) is checked at load by `tensor_impl` against
// `Tensor._cdata`.
extern PyObject* THPVariableClass;
extern PyObject* ParameterClass;
PyObject* THPVariable_Wrap(at::TensorBase&& var);

namespace fast_calls {

struct PyTensor {
  PyObject_HEAD
  at::Tensor cdata;
};

bool is_tensor(PyObject* o) {
  PyTypeObject* t = Py_TYPE(o);
  return t == reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
         t == reinterpret_cast<PyTypeObject*>(ParameterClass);
}

template <typename T>
struct Arg;
template <>
struct Arg<at::Tensor> {
  static bool ok(PyObject* o) { return is_tensor(o); }
  static const at::Tensor& get(PyObject* o) { return reinterpret_cast<PyTensor*>(o)->cdata; }
};
template <>
struct Arg<std::optional<at::Tensor>> {
  static bool ok(PyObject* o) { return o == Py_None || is_tensor(o); }
  static std::optional<at::Tensor> get(PyObject* o) {
    if (o == Py_None) return std::nullopt;
    return reinterpret_cast<PyTensor*>(o)->cdata;
  }
};
template <>
struct Arg<int64_t> {
  static bool ok(PyObject* o) { return PyLong_CheckExact(o); }
  static int64_t get(PyObject* o) { return PyLong_AsLongLong(o); }
};
template <>
struct Arg<double> {
  static bool ok(PyObject* o) { return PyFloat_CheckExact(o) || PyLong_CheckExact(o); }
  static double get(PyObject* o) { return PyFloat_AsDouble(o); }
};
template <>
struct Arg<bool> {
  static bool ok(PyObject* o) { return PyBool_Check(o); }
  static bool get(PyObject* o) { return o == Py_True; }
};

PyObject* wrap(at::Tensor&& t) { return THPVariable_Wrap(std::move(t)); }

// Python's exception for a C++ one, as torch's own bindings map them (no C++ backtrace).
void set_error(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) {
    PyObject* type = PyExc_RuntimeError;
    if (dynamic_cast<const c10::ValueError*>(&e)) type = PyExc_ValueError;
    else if (dynamic_cast<const c10::TypeError*>(&e)) type = PyExc_TypeError;
    else if (dynamic_cast<const c10::IndexError*>(&e)) type = PyExc_IndexError;
    else if (dynamic_cast<const c10::NotImplementedError*>(&e)) type = PyExc_NotImplementedError;
    PyErr_SetString(type, c10e->what_without_backtrace());
  } else {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// One op: its typed handle and the Python op for arguments this path does not read.
template <typename Sig>
struct Entry;
template <typename... A>
struct Entry<at::Tensor(A...)> {
  c10::TypedOperatorHandle<at::Tensor(A...)> op;
  PyObject* fallback;

  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    auto* e = static_cast<Entry*>(PyCapsule_GetPointer(self, nullptr));
    return e->run(args, n, std::index_sequence_for<A...>{});
  }

  template <size_t... I>
  PyObject* run(PyObject* const* args, Py_ssize_t n, std::index_sequence<I...>) {
    if (n != static_cast<Py_ssize_t>(sizeof...(A)) ||
        !(Arg<std::decay_t<A>>::ok(args[I]) && ...))
      return PyObject_Vectorcall(fallback, args, n, nullptr);
    std::tuple<std::decay_t<A>...> values{Arg<std::decay_t<A>>::get(args[I])...};
    if (PyErr_Occurred()) return nullptr;  // an int out of range
    at::Tensor out;
    PyThreadState* state = PyEval_SaveThread();
    try {
      out = op.call(std::get<I>(values)...);
    } catch (const std::exception& err) {
      PyEval_RestoreThread(state);
      set_error(err);
      return nullptr;
    }
    PyEval_RestoreThread(state);
    return wrap(std::move(out));
  }
};

template <typename Sig>
bool add(PyObject* calls, PyObject* fallbacks, const char* name) {
  PyObject* fallback = PyDict_GetItemString(fallbacks, name);  // borrowed
  if (fallback == nullptr) return true;
  // Both live as long as the process, as the ops do.
  auto* def = new PyMethodDef{
      name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Entry<Sig>::call)),
      METH_FASTCALL, nullptr};
  Py_INCREF(fallback);
  auto* entry = new Entry<Sig>{
      c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Sig>(), fallback};
  PyObject* capsule = PyCapsule_New(entry, nullptr, nullptr);
  if (capsule == nullptr) return false;
  PyObject* fn = PyCFunction_New(def, capsule);
  Py_DECREF(capsule);
  if (fn == nullptr) return false;
  const int rc = PyDict_SetItemString(calls, name, fn);
  Py_DECREF(fn);
  return rc == 0;
}

PyObject* tensor_impl(PyObject*, PyObject* arg) {
  if (!is_tensor(arg)) {
    PyErr_SetString(PyExc_TypeError, "tensor_impl: expected a torch.Tensor");
    return nullptr;
  }
  return PyLong_FromVoidPtr(reinterpret_cast<PyTensor*>(arg)->cdata.unsafeGetTensorImpl());
}

using Opt = const std::optional<at::Tensor>&;
using T = const at::Tensor&;

}  // namespace fast_calls

// {op name: builtin} for the ops named in `fallbacks` ({name: Python op}), plus "tensor_impl";
// called through ctypes.PyDLL, holding the GIL.
extern "C" PyObject* ember_cpu_fast_calls(PyObject* fallbacks) {
  using namespace fast_calls;
  static PyMethodDef impl_def = {"tensor_impl", &tensor_impl, METH_O, nullptr};
  PyObject* calls = PyDict_New();
  if (calls == nullptr) return nullptr;
  try {
    PyObject* impl = PyCFunction_New(&impl_def, nullptr);
    const bool ok =
        impl != nullptr && PyDict_SetItemString(calls, "tensor_impl", impl) == 0 &&
        add<at::Tensor(T, T, T, Opt, Opt, int64_t, int64_t)>(calls, fallbacks,
                                                              "ember_cpu::group_linear") &&
        add<at::Tensor(T, T, Opt, Opt, int64_t)>(calls, fallbacks, "ember_cpu::packed_linear") &&
        add<at::Tensor(T, T, Opt)>(calls, fallbacks, "ember_cpu::bf16_linear") &&
        add<at::Tensor(T, T, Opt)>(calls, fallbacks, "ember_cpu::fp32_linear") &&
        add<at::Tensor(T, T, T, at::Tensor, T, T, T, T, double, int64_t, double, bool)>(
            calls, fallbacks, "ember_cpu::paged_attention");
    Py_XDECREF(impl);
    if (!ok) {
      Py_DECREF(calls);
      return nullptr;
    }
  } catch (const std::exception& err) {
    set_error(err);
    Py_DECREF(calls);
    return nullptr;
  }
  return calls;
}
#endif  // EMBER_FAST_CALLS
