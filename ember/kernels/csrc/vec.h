// Shared SIMD helpers: fp32 vectors (AVX-512 or AVX2), widening loads, exp, to_float.
// One part of ember_cpu.cpp's translation unit (included there, in order; not built alone).
#pragma once

namespace {

// Widest vector, in floats (scratch padding).
constexpr int64_t kLanesMax = 16;

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

#ifdef EMBER_SIMD
// The 2 * kLanes consecutive weights at p, widened to fp32 as two vectors. `kPairOrder<W>`
// false: lo holds weights 0..kLanes-1 and hi the rest. True (bf16): one load and two unpacks
// against zero (no shifts), which leave the halves interleaved by 128-bit lane (lo: 0-3, 8-11,
// ...; hi: 4-7, 12-15, ...); `vunpair` takes such a pair to the weights' order and `vpair` back,
// once per block of accumulators. One 32-byte load and 2 shuffles per 16 weights on AVX2,
// against 2 loads, 2 zero-extends and 2 shifts. AMD EPYC (Zen 4), 1 thread, a 1024 x 2048
// bf16 panel weight from L3, M = 1: 44.0-46.9 -> 50.0-50.4 GB/s (AVX2), 43 -> 65 GFLOP/s
// (AVX-512 without AVX512-BF16); from memory, Llama-1B's layer shapes: 1.04-1.06x (AVX2, the
// prefetch off in both), 1.01-1.05x (AVX-512).
template <typename W>
constexpr bool kPairOrder = false;
template <typename W>
inline void vwiden_pair(const W* p, vfloat& lo, vfloat& hi) {
  lo = vwiden(p);
  hi = vwiden(p + kLanes);
}
template <>
constexpr bool kPairOrder<c10::BFloat16> = true;
#if defined(__AVX512F__)
template <>
inline void vwiden_pair(const c10::BFloat16* p, vfloat& lo, vfloat& hi) {
  const __m512i v = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v));
}
inline void vunpair(vfloat& lo, vfloat& hi) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const vfloat a = _mm512_permutex2var_ps(lo, i0, hi), b = _mm512_permutex2var_ps(lo, i1, hi);
  lo = a;
  hi = b;
}
inline void vpair(vfloat& lo, vfloat& hi) {
  const __m512i i0 =
      _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i i1 =
      _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vfloat a = _mm512_permutex2var_ps(lo, i0, hi), b = _mm512_permutex2var_ps(lo, i1, hi);
  lo = a;
  hi = b;
}
#else
template <>
inline void vwiden_pair(const c10::BFloat16* p, vfloat& lo, vfloat& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
inline void vunpair(vfloat& lo, vfloat& hi) {  // its own inverse with 8 lanes
  const vfloat a = _mm256_permute2f128_ps(lo, hi, 0x20), b = _mm256_permute2f128_ps(lo, hi, 0x31);
  lo = a;
  hi = b;
}
inline void vpair(vfloat& lo, vfloat& hi) { vunpair(lo, hi); }
#endif
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

}  // namespace
