// Dense and packed linears: the widening GEMV (bf16 / fp32 weights), panel-packed fp32-math
// linears (fp32, bf16, int8 per-channel weights) and bf16 pairs (AVX512-BF16).
// One part of ember_cpu.cpp's translation unit (included there, in order; not built alone).
#pragma once

namespace {

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
// How far ahead blocks of rows (MR > 1) prefetch the panel stream. A single row does not: it
// streams one panel in address order, which the hardware prefetchers follow, as in the group
// kernels (`kGroupPrefetch`). AMD EPYC (Zen 4), Llama-1B's 7 layer shapes twice (bf16, 122 MB
// a pass), M = 1, GB/s, variants alternated in one process, without -> with the prefetch:
// AVX2 build 1 thread 16.6, 17.7, 16.5, 18.4 -> 15.8, 14.0, 14.2, 14.3, 2 threads 27.9, 30.9,
// 32.1, 34.2 -> 27.3, 23.3, 29.2, 26.4; fp32 weights 17.2 / 27.1 -> 15.9 / 25.8 (AVX-512) and
// 14.9 / 24.0 -> 14.3 / 23.4 (AVX2). At M = 4 the prefetch gains 1.3x (AVX2, 2 threads 20.3
// against 15.0), at 2, 8 or 16 KiB alike.
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
    if (kPairOrder<W> && !first) vpair(a0[r], a1[r]);
  }
  int64_t k = k0;
  if constexpr (MR == 1) {  // one row: four k at a time, so eight FMA chains are in flight
    vfloat b0[3] = {vzero(), vzero(), vzero()}, b1[3] = {vzero(), vzero(), vzero()};
    for (; k + 4 <= k1; k += 4) {
      const W* w = pan + k * kPanel;
      vfloat w0, w1;
      vwiden_pair(w, w0, w1);
      a0[0] = vfma(vset1(x[k]), w0, a0[0]);
      a1[0] = vfma(vset1(x[k]), w1, a1[0]);
#pragma GCC unroll 3
      for (int u = 0; u < 3; ++u) {
        const vfloat xb = vset1(x[k + 1 + u]);
        vwiden_pair(w + (1 + u) * kPanel, w0, w1);
        b0[u] = vfma(xb, w0, b0[u]);
        b1[u] = vfma(xb, w1, b1[u]);
      }
    }
    a0[0] = vadd(vadd(a0[0], b0[0]), vadd(b0[1], b0[2]));
    a1[0] = vadd(vadd(a1[0], b1[0]), vadd(b1[1], b1[2]));
  }
  for (; k < k1; ++k) {
    if constexpr (MR > 1) {
      const char* ahead = reinterpret_cast<const char*>(pan + k * kPanel) + kPanelPrefetchBytes;
#pragma GCC unroll 2
      for (int64_t l = 0; l < kPanel * static_cast<int64_t>(sizeof(W)); l += 64) {
        _mm_prefetch(ahead + l, _MM_HINT_T0);
      }
    }
    vfloat w0, w1;
    vwiden_pair(pan + k * kPanel, w0, w1);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const vfloat xb = vset1(x[r * K + k]);
      a0[r] = vfma(xb, w0, a0[r]);
      a1[r] = vfma(xb, w1, a1[r]);
    }
  }
  if constexpr (kPairOrder<W>) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) vunpair(a0[r], a1[r]);
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
// every panel of the thread's run over one chunk before the next: the chunk stays in L2 (or
// L3) while the panels pass over it, instead of all of x streaming from memory once per panel;
// each chunk streams the thread's panels once more. Decodes and small steps are one chunk.
// The group kernels (blocks of 2-6 rows of int8 x) take 128 KiB chunks; the dense ones (fp32
// math and bf16 pairs, 12 rows), 2 MiB: 128 KiB held 16-32 rows of a 2048-wide x, so a 128-row
// step streamed a 64 MiB weight (Llama-1B's gate/up, past L3) 4-8 times. AMD EPYC (Zen 4),
// 2 threads, GFLOP/s at M = 128 / 512, 128 KiB -> 2 MiB: bf16 pairs (rows packed as in the
// note at unaliased_rows) 337, 360 / 357, 364 -> 398, 415 / 402, 418; 512 KiB gained less,
// 8 MiB as much as 2 MiB (but is past a small L3). The group kernels with AVX2 forced lost
// with 2 MiB (ms at M = 2048, 128 KiB -> 2 MiB: Q4_0 152, 165 -> 185, 178; Q4_K 415, 420 ->
// 470, 493) and were even natively.
#ifndef EMBER_X_CHUNK
#define EMBER_X_CHUNK (128 * 1024)
#endif
constexpr int64_t kXChunkBytes = EMBER_X_CHUNK;
constexpr int64_t kDenseXChunkBytes = 2048 * 1024;

template <typename Task>
void for_panel_tasks(int64_t M, int64_t N, int64_t row_bytes, const Task& task,
                     int64_t row_block = kRowBlock, int64_t chunk_bytes = kXChunkBytes) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  const int64_t blocks = (M + row_block - 1) / row_block;
  const int64_t rows_per = (M + blocks - 1) / blocks;
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min(blocks, std::max<int64_t>(1, (2 * threads + P - 1) / P));
  const int64_t chunk =
      chunk_bytes > 0 ? std::max<int64_t>(1, chunk_bytes / (rows_per * row_bytes)) : blocks;
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

// x [M, K] (a contiguous matrix) with its rows `ld` elements apart, for the register blocks,
// which broadcast from up to kRowBlock rows at once. Rows whose byte stride is a multiple of
// 1 KiB (K = 2048 or 8192 in fp32 or bf16) fall in a few L1 sets (64 sets of 64-byte lines on
// current x86 cores, so rows 4 KiB apart share one set of 8-12 ways), and the block's lines
// evict each other: those are copied to a stride one line longer. The group kernels' blocks of
// 2-6 rows of int8 x showed no such loss. With the 2 MiB chunks of x (kDenseXChunkBytes), AMD
// EPYC (Zen 4), 2 threads, GFLOP/s at M = 128 / 512, two alternated rounds, before -> after:
// - bf16 pairs, N = 16384, K = 2048: 285, 272 / 284, 280 -> 420, 409 / 445, 431; N = 2048,
//   K = 8192: 240, 231 / 235, 250 -> 427, 421 / 438, 432; N = 4096, K = 768: 446, 440 / 445,
//   448 -> 431, 442 / 445, 438 (unchanged: neither applies).
// - fp32 math with AVX2 forced, K = 2048: 167, 162 / 155, 153 -> 193, 187 / 189, 182.
// The stride alone (128 KiB chunks) took the pairs from 263 to 341 (K = 2048) and 213 to 321
// (K = 8192) at M = 128. Copying each block's rows into one sequential stream (the packing of A
// in a GEMM) ran no faster than the longer stride once x came in 2 MiB chunks (K = 2048, M = 128
// / 512: 400, 403 / 423, 429 packed, 402, 407 / 426, 427 strided).
struct StridedRows {
  at::Tensor x;
  int64_t ld;
};
inline StridedRows unaliased_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), bytes = x.element_size();
  if (M <= 4 || (K * bytes) % 1024 != 0) return {x, K};
  const int64_t ld = K + 64 / bytes;
  at::Tensor padded = at::empty({M, ld}, x.options());
  padded.narrow(1, 0, K).copy_(x);
  return {padded, ld};
}

// y [M, N] = x [M, K] (rows ld apart) @ w^T * scales + bias, w packed [P, K, kPanel].
template <typename W>
void packed_gemm(const float* x, int64_t ld, const W* wp, const float* scales, const float* bias,
                 float* y, int64_t M, int64_t N, int64_t K) {
  static constexpr auto kernels =
      panel_kernels<W>(std::make_index_sequence<static_cast<size_t>(kRowBlock)>());
  for_panel_tasks(M, N, ld * sizeof(float), [&](int64_t p, int64_t n, int64_t cols,
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
        kernels[rows - 1](x + m0 * ld, ld, pan, k0, k1, y + m0 * N + n, N, cols, k0 == 0,
                          last && (scales || bias) ? sc : nullptr, bi);
      });
    }
  }, kRowBlock, kDenseXChunkBytes);
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

// y [M, N] (bf16) = x [M, Ke] (bf16, Ke even, rows ld apart) @ pairs + bias; tasks as in
// packed_gemm. `yf`: fp32 [M, N] scratch for partial sums, needed only when Ke / 2 > kPairDepth.
void pairs_gemm(const uint16_t* x, int64_t ld, const uint16_t* wp, const float* bias, float* yf,
                uint16_t* y, int64_t M, int64_t N, int64_t Ke) {
  static constexpr auto kernels =
      pair_kernels(std::make_index_sequence<static_cast<size_t>(kRowBlock)>());
  const int64_t J = Ke / 2;
  for_panel_tasks(M, N, ld * sizeof(uint16_t), [&](int64_t p, int64_t n, int64_t cols,
                                                   const RowBlocks& blocks) {
    alignas(64) float bi[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) bi[c] = bias && c < cols ? bias[n + c] : 0.f;
    const uint16_t* pan = wp + p * J * 2 * kPanel;
    for (int64_t j0 = 0; j0 < J; j0 += kPairDepth) {
      const int64_t j1 = std::min(J, j0 + kPairDepth);
      blocks.each([&](int64_t m0, int64_t rows) {
        kernels[rows - 1](x + m0 * ld, ld, pan, j0, j1, yf ? yf + m0 * N + n : nullptr,
                          y + m0 * N + n, N, cols, j0 == 0, j1 == J, bi);
      });
    }
  }, kRowBlock, kDenseXChunkBytes);
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
// fp32 math; y in x's dtype. `scales`: float32 [N] (int8 weights), else None. A 4-d uint8 w is
// per-channel int8 codes for integer dot products (`int8_dot_linear`).
// Per-channel int8 codes in quad panels: integer dot products (linear_group.h).
at::Tensor int8_dot_linear(const at::Tensor& x_in, const at::Tensor& codes,
                           const std::optional<at::Tensor>& scales,
                           const std::optional<at::Tensor>& bias, int64_t N);

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& w,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& bias, int64_t N) {
  if (w.dim() == 4) return int8_dot_linear(x_in, w, scales, bias, N);
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
      const StridedRows rows = unaliased_rows(x);
      pairs_gemm(reinterpret_cast<const uint16_t*>(rows.x.data_ptr()), rows.ld,
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
  const StridedRows rows = unaliased_rows(x);
  const float* xp = rows.x.data_ptr<float>();
  const int64_t ld = rows.ld;
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: packed_gemm(xp, ld, w.data_ptr<float>(), sp, bp, yp, M, N, K); break;
    case at::kBFloat16:
      packed_gemm(xp, ld, w.data_ptr<c10::BFloat16>(), sp, bp, yp, M, N, K);
      break;
    case at::kHalf: packed_gemm(xp, ld, w.data_ptr<c10::Half>(), sp, bp, yp, M, N, K); break;
    case at::kChar: packed_gemm(xp, ld, w.data_ptr<int8_t>(), sp, bp, yp, M, N, K); break;
    default: TORCH_CHECK(false, "packed_linear: w must be float32, bfloat16, float16 or int8");
  }
  return y.view(out_shape).to(x_in.scalar_type());
}

}  // namespace
