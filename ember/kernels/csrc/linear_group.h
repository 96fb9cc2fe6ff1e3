// Group-quantized linears (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, and ember's int4): activations
// quantized per group of 32, integer dot products.
// One part of ember_cpu.cpp's translation unit (included there, in order; not built alone).
#pragma once

namespace {

// ---- Group-quantized linears: GGUF's Q8_0, Q4_0 and Q4_1, and ember's int4 ----
//
// A weight [N, K] in groups of kGroup = 32 consecutive k of one output channel, each group with
// an fp16 scale d and, for asymmetric 4-bit codes, an fp16 offset m: w = d * q (8-bit codes in
// [-127, 127]), d * (q - 8) (symmetric 4-bit codes in [0, 15]) or d * q + m (asymmetric): the
// values of GGUF's Q8_0, Q4_0 and Q4_1 blocks exactly. Packed in panels of kPanel output
// channels with each channel's codes for 4 (8-bit) or 8 (4-bit) consecutive k in one 32-bit
// lane, the layout integer dot-product instructions read (see ember.model.layers.GroupLinear):
// 8 lanes a group holding q + 128 (8-bit), or 4 whose byte j holds k = 8i + j in its low nibble
// and 8i + 4 + j in its high one (4-bit), each group's kPanel fp16 d (and m) ahead of its lanes
// in one uint8 tensor [P, lanes, kPanel, 4] (see plain_head_rows).
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

// copies = 2: each group's 32 codes followed by their absolute values (row stride 2K), which
// the 8-bit kernels without VNNI broadcast instead of taking each row's |xq| again per vector
// of channels (kX8Copies).
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int copies = 1) {
  const int64_t G = K / kGroup;
  QuantizedRows out{std::vector<int8_t>(M * K * copies), std::vector<float>(M * G),
                    std::vector<int32_t>(M * G), std::vector<int32_t>(M * G)};
  at::parallel_for(0, M * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // group i of the flattened x: row i / G, group i % G
      int8_t* q = out.q.data() + i * kGroup * copies;
#ifdef EMBER_SIMD
      quantize_group_simd(x + i * kGroup, q, &out.scale[i], &out.sum[i], &out.half[i]);
#else
      quantize_group(x + i * kGroup, q, &out.scale[i], &out.sum[i], &out.half[i]);
#endif
      if (copies == 2) {  // one vpabsb a group (vectorized: |q| <= 127 fits int8)
        for (int64_t k = 0; k < kGroup; ++k)
          q[kGroup + k] = static_cast<int8_t>(std::abs(static_cast<int32_t>(q[k])));
      }
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
// The bits of each byte at S (and above, within Mask) moved to bit 4, the rest masked off.
template <int S, int Mask>
inline vint field_to_bit4(vint v) {
  const vint mask = _mm512_set1_epi8(Mask);
  if constexpr (S < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - S), mask);
  if constexpr (S == 4) return _mm512_and_si512(v, mask);
  return _mm512_and_si512(_mm512_srli_epi16(v, S - 4), mask);
}
// Byte j of each 32-bit lane as an int32: zero-extended (u) or sign-extended (s).
inline vint lane_byte_u(vint v, int j) {
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * j)), _mm512_set1_epi32(255));
}
inline vint lane_byte_s(vint v, int j) {
  const vint high = _mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * j));
  return _mm512_sra_epi32(high, _mm_cvtsi32_si128(24));
}
#if defined(__AVX512VNNI__)
#define EMBER_VNNI 1
// acc += unsigned bytes a . signed bytes b, 4 per 32-bit lane.
inline vint dot_u8s8(vint acc, vint a, vint b) { return _mm512_dpbusd_epi32(acc, a, b); }
#else
inline vint dot_u8s8(vint acc, vint a, vint b) {  // a <= 63 (4-, 6-bit codes): no saturation
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
}
// a with b's sign (a's bytes where b is 0 are kept: their product with |b| is 0), for signed
// bytes a . b as |b| . sign8(a, b), which maddubs takes without saturating.
inline vint sign8(vint a, vint b) {
  return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(b), _mm512_setzero_si512(), a);
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
template <int S, int Mask>
inline vint field_to_bit4(vint v) {
  const vint mask = _mm256_set1_epi8(Mask);
  if constexpr (S < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - S), mask);
  if constexpr (S == 4) return _mm256_and_si256(v, mask);
  return _mm256_and_si256(_mm256_srli_epi16(v, S - 4), mask);
}
inline vint lane_byte_u(vint v, int j) {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * j)), _mm256_set1_epi32(255));
}
inline vint lane_byte_s(vint v, int j) {
  const vint high = _mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * j));
  return _mm256_sra_epi32(high, _mm_cvtsi32_si128(24));
}
#if defined(__AVXVNNI__)
#define EMBER_VNNI 1
inline vint dot_u8s8(vint acc, vint a, vint b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#else
inline vint dot_u8s8(vint acc, vint a, vint b) {  // a <= 63 (4-, 6-bit codes): no saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
inline vint sign8(vint a, vint b) { return _mm256_sign_epi8(a, b); }
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
constexpr int32_t kCode8Bias = 128;
constexpr int kX8Copies = 1;
#else
inline vint codes8(vint v) { return flip_bytes(v); }
constexpr int32_t kCode8Bias = 0;
// The sign trick, |xq| . (q with xq's sign), with |xq| stored beside xq by quantize_rows
// (copies = 2) and broadcast from there: a vpabsb less per row and pair of code vectors
// (4 of 4.5 vector ops per 32 products), its int32 sums kept in order by `chain` (GCC had
// summed them as a tree after spilling them: 65 stack accesses in the 2-row kernel, 18 with
// it). AMD EPYC (Zen 4), AVX2 build, 2 threads, llama-160m's 48 projections as Q8_0, 3
// alternated rounds, ms at M = 32 / 128 / 512: before 3.78, 3.77, 3.76 / 15.8, 15.5, 15.1 /
// 64.7, 64.7, 64.7; |xq| stored 3.63, 3.55, 3.57 / 14.1, 14.2, 14.5 / 57.6, 60.1, 62.0; and
// `chain` 3.37, 3.40, 3.37 / 13.0, 13.3, 13.1 / 52.6, 54.1, 54.2 (1.2x at M = 512). Blocks
// of 3 or 4 rows with both: no better than 2.
constexpr int kX8Copies = 2;
#endif
// An accumulator made opaque to the optimizer after a step (an empty asm), so it stays one
// register summed in order. Without VNNI a 4-bit product is vpmaddubsw, then an int16 add
// (8-bit: vpmaddubsw, vpmaddwd, then an int32 add), and GCC reassociates the adds: it
// computed every product of an unrolled group first, spilled them to the stack and summed
// them as a tree (AVX2, 2 rows: 21 stack stores a group for 4-bit codes). With VNNI the
// product accumulates in place, and this is a no-op.
#ifdef EMBER_VNNI
inline void chain(vint&) {}
#else
inline void chain(vint& v) { __asm__("" : "+v"(v)); }
#endif
// Rows per register block: 4 vectors per row (two int32 group sums, two fp32 sums); 6-bit
// codes take more registers to unpack (a Q6_K LM head at M=128, AVX-512: 6.93 ms in blocks
// of 4 rows, 8.81 in blocks of 6; 3 and 5 were slower than 4 too). 4-bit codes on AVX2, with
// `chain`: blocks of 4 rows share each unpacked code vector among twice the rows of 2. AMD
// EPYC (Zen 4), AVX2 build, 2 threads, alternated processes, ms at M = 32 / 512: llama-160m's
// 48 projections as Q4_0 2.98, 2.65 -> 2.36, 2.14 / 48.8, 46.4 -> 38.1, 38.0; Llama-1B's
// gate/up as Q4_K 7.93, 7.79 -> 5.90, 6.22 / 133 -> 105, 103. 4 rows without `chain` gained
// 1.07x (spills), 6 rows with it as much as 4, and `chain` on the 6-bit path cost 5%.
// 6- and 5-bit codes on AVX2 in blocks of 4 rows too (their unpacking, 2.5 ops a code vector
// against 1.5 for 4-bit, shared by twice the rows), same machine and build, 3 alternated
// rounds, GMAC/s at M = 8 / 32 / 512, 2 rows -> 4: Llama-1B's down (2048 x 8192) as Q6_K 95-101
// / 91-103 / 79-103 -> 127-129 / 126-131 / 123-131; a 32768 x 2048 Q6_K head 94 / 98-102 /
// 76-98 -> 121 / 126-131 / 119-127; 4096 x 4096 as Q5_0 126-127 / 126-129 -> 147-154 / 152-162.
constexpr int kGroupRowBlock = kLanes == 16 ? 6 : 2;
constexpr int kGroup6RowBlock = 4;
constexpr int kGroup4RowBlock = kLanes == 16 ? kGroupRowBlock : 4;  // AVX2 only: 4
// Software prefetch of the code stream, for blocks of more than one row only. A single row (a
// decode) reads one stream in address order (plain groups' scales in their heads, super-blocks'
// sub-block scales ahead of their codes), which the hardware prefetchers follow: prefetching it
// 4 KiB ahead lost once the plain groups' scales were inline (AVX2 builds had prefetched at
// every M; AVX-512 ones never). AMD EPYC (Zen 4), 3 alternated rounds, Llama-1B-shaped layers
// at M = 1, AVX2 build, ms a pass, with -> without: 1 thread Q8_0 7.82, 7.61, 7.78 -> 5.25,
// 5.18, 5.46; Q4_0 6.43, 6.51, 5.87 -> 4.92, 5.21, 5.32; Q4_K 6.61, 6.42, 7.01 -> 5.66, 5.86,
// 6.00; per-channel int8 6.76, 6.65, 6.63 -> 5.27, 5.42, 5.24. Blocks of rows do more work per
// byte, and the hardware prefetcher falls behind them: GMAC/s, 2 threads, without -> with,
// AVX2 build at M = 8: Llama-1B's gate/up as Q4_K 102, 104, 141 -> 157, 124, 167, its down as
// Q6_K 65, 68, 88 -> 106, 83, 125; AVX-512 build at M = 4: gate/up 90, 92, 83 -> 136, 164, 123,
// down 57, 82, 72 -> 161, 140, 145 (bandwidth: 33 GB/s), a 4096 x 4096 Q5_0 105, 96, 84 -> 159,
// 159, 181; at M = 8: gate/up 139, 114, 109 -> 207, 236, 210, down 92, 77, 71 -> 143, 172, 139.
template <int MR>
constexpr bool kGroupPrefetch = MR > 1;
#else
constexpr int kGroupRowBlock = 4;
constexpr int kGroup6RowBlock = 4;
constexpr int kGroup4RowBlock = kGroupRowBlock;
constexpr int kX8Copies = 1;
#endif
// quantize_rows' copies of x for a kernel of `Bits`-bit codes.
template <int Bits>
constexpr int x_copies() {
  return Bits == 8 ? kX8Copies : 1;
}

#ifdef EMBER_SIMD
// Bits 4-5 of each byte: the 2-bit field at bit S of each byte moved there (6-bit codes).
template <int S>
inline vint high_pair(vint v) {
  return field_to_bit4<S, 0x30>(v);
}
// Bit 4 of each byte: bit S of each byte moved there (5-bit codes).
template <int S>
inline vint high_bit(vint v) {
  return field_to_bit4<S, 0x10>(v);
}

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
      if constexpr (Nibbles) {
        chain(s0[r]);
        chain(s1[r]);
      }
    }
  }
}
#endif

#ifdef EMBER_SIMD
// The code stream ahead of the group at q (`kBytes` of it), where kGroupPrefetch<MR>.
template <int64_t kBytes, int MR>
inline void prefetch_group(const uint8_t* q) {
  if constexpr (kGroupPrefetch<MR>) {
    const char* ahead = reinterpret_cast<const char*>(q) + kPanelPrefetchBytes;
#pragma GCC unroll 16
    for (int64_t l = 0; l < kBytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
  }
}

// s0/s1[r] = the int32 sums of one group of 8-bit codes (q, stored q + 128) of a panel's two
// vectors of channels times row r's quantized x (xg + r * rs: quantize_rows with kX8Copies),
// uncorrected for the offset.
template <int MR>
inline void group_dots8(const uint8_t* q, const int8_t* xg, int64_t rs, vint* s0, vint* s1) {
  constexpr int64_t kVec = kLanes * 4;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) s0[r] = s1[r] = izero();
#pragma GCC unroll 8
  for (int64_t i = 0; i < kGroup / 4; ++i) {
    const vint w0 = codes8(iload(q + 2 * i * kVec)), w1 = codes8(iload(q + (2 * i + 1) * kVec));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vint xb = ibcast(xg + r * rs + 4 * i);
#ifdef EMBER_VNNI
      s0[r] = dot_u8s8(s0[r], w0, xb);
      s1[r] = dot_u8s8(s1[r], w1, xb);
#else
      const vint xa = ibcast(xg + r * rs + kGroup + 4 * i);  // |xq|
      s0[r] = dot_u8s8(s0[r], xa, sign8(w0, xb));
      s1[r] = dot_u8s8(s1[r], xa, sign8(w1, xb));
      chain(s0[r]);
      chain(s1[r]);
#endif
    }
  }
}
#endif

// ---- Super-blocks: GGUF's Q4_K and Q6_K kept as the file holds them ----
//
// A weight whose K is a multiple of 256 may be laid out in super-blocks of 8 groups (256 k),
// as GGUF's k-quants are: per super-block and panel, 4 lanes of sub-block scales per
// channel, then the 8 groups' codes as above (4-bit nibbles, or 6-bit nibbles and high
// pairs), one stream read in order; one fp16 scale d per super-block and channel in `scales`
// [P, K / 256, kPanel] (4-bit: and one fp16 offset scale dm = -dmin in `mins`, shaped as
// scales).
// - 4-bit (Q4_K, w = d sc q + dm m): lanes 0-1 hold the 8 groups' 6-bit scales sc (group
//   4l + j in byte j of lane l), lanes 2-3 their offsets m. 36 lanes a super-block: 4.5 bits
//   a weight plus 32 bits of d and dm per 256, against 5 as a Q4_1 group (fp16 d sc and
//   dm m per 32).
// - 6-bit (Q6_K, w = d sc (q - 32)): lanes 0-3 hold the 16 int8 scales of 16 k (sub-block
//   s = 2g + h of group g's half h in byte s % 4 of lane s / 4). 52 lanes: 6.5 bits plus 16
//   per 256, against 7 with an fp16 scale per 16.
// Each group's scale is d times its sub-block's, in fp32, converted once per super-block
// (super_scales).
constexpr int64_t kSuperGroups = 8;
template <int Bits>
constexpr int64_t super_lanes() {
  return Bits == 6 ? 52 : 36;
}
// ---- Plain groups: their scales in the code stream ----
//
// Groups not in super-blocks (Q8_0, Q4_0, Q4_1, Q5_0, and 6-bit codes with a scale per 16 k)
// carry their fp16 scales in the code stream, as GGUF's blocks do: each group of a panel is
// its head, `plain_head_rows` rows of kPanel fp16 (d; with offsets d, then m; 6-bit: d of
// each half of 16 k), then its codes, and a panel is its groups back to back, padded to a
// whole 32-bit lane per channel. One stream in address order: with the scales in a tensor of
// their own beside the codes, a register-only loop over 512-byte groups (Q4_0's at AVX-512's
// panel) read 26 GB/s on one core of an AMD EPYC (Zen 4) with one such side stream and 22
// with two (Q4_1's), against 33-34.5 with them inline.
constexpr int64_t plain_head_rows(int64_t bits, bool min) { return bits == 6 || min ? 2 : 1; }
// A plain group's bytes per channel: its head's, then its codes'.
constexpr int64_t plain_group_bytes(int64_t bits, bool min) {
  return 2 * plain_head_rows(bits, min) + kGroup * bits / 8;
}
// 32-bit lanes per channel of a plain panel of G groups.
constexpr int64_t plain_lanes(int64_t G, int64_t bits, bool min) {
  return (G * plain_group_bytes(bits, min) + 3) / 4;
}
// Plain group g's head (its scales) from the start of its panel.
template <int Bits, bool Min>
inline const uint16_t* group_head(const uint8_t* pan, int64_t g) {
  return reinterpret_cast<const uint16_t*>(pan + g * plain_group_bytes(Bits, Min) * kPanel);
}
// Group g's codes from the start of its panel.
template <int Bits, bool Min, bool Super>
constexpr int64_t group_offset(int64_t g) {
  constexpr int64_t kBytes = kGroup * kPanel * Bits / 8;
  if constexpr (Super)
    return (g / kSuperGroups) * super_lanes<Bits>() * 4 * kPanel + 4 * 4 * kPanel +
           (g % kSuperGroups) * kBytes;
  return g * plain_group_bytes(Bits, Min) * kPanel + plain_head_rows(Bits, Min) * 2 * kPanel;
}
// The sub-block scale lanes of the super-block holding group g.
template <int Bits>
inline const uint8_t* sub_scale_lanes(const uint8_t* pan, int64_t g) {
  return pan + (g / kSuperGroups) * super_lanes<Bits>() * 4 * kPanel;
}

// The fp32 scales of a super-block's sub-blocks for a panel: out[s][c] = d sc_s (Q4_K: s < 8,
// then the offsets' dm m_s at 8 + s; Q6_K: the 16 int8 sc), as the kernel reaches each
// super-block: a single row into its own stack array, more rows into the panel slice's
// array, filled by the slice's first row block for the others. llama-160m's projections, AMD
// EPYC (AVX-512), per pass against fp16 scales per group: each group converting its own (a
// variable byte shift per vector and group) ran 1.5x slower at M = 1; a pass over the
// slice's scales before its row blocks, 1.45x slower at M = 1 (it breaks the one stream);
// every row block converting them, Q6_K 1.07x (AVX-512) and 1.2x (forced AVX2) slower at
// M = 32 and 128, against 1.06x and 1.13x shared.
#ifdef EMBER_SIMD
template <int Bits, bool Min>
__attribute__((always_inline)) inline void super_scales(const uint8_t* pan, const uint16_t* dp,
                                                        const uint16_t* mp, int64_t g,
                                                        float (*out)[kPanel]) {
  constexpr int64_t kVec = kLanes * 4;
  const uint8_t* lanes = sub_scale_lanes<Bits>(pan, g);
  const int64_t sb = (g / kSuperGroups) * kPanel;
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    const vfloat d = vhalf(dp + sb + v * kLanes);
    const vfloat dm = Min ? vhalf(mp + sb + v * kLanes) : vzero();
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const vint b = iload(lanes + (2 * l + v) * kVec);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int s = 4 * l + j;
        const vint code = Bits == 6 ? lane_byte_s(b, j) : lane_byte_u(b, j);
        vstore(out[s] + v * kLanes, vmul(Bits == 4 && s >= 8 ? dm : d, icvt(code)));
      }
    }
  }
}
#endif

inline float half_value(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Byte `sub` of channel j's sub-block scale lanes in the super-block holding group g.
template <int Bits>
inline uint8_t sub_scale_byte(const uint8_t* pan, int64_t g, int64_t sub, int64_t j) {
  return sub_scale_lanes<Bits>(pan, g)[((sub / 4) * kPanel + j) * 4 + sub % 4];
}

// Channel j's scale of segment s (6-bit: the half of 16 k) of group g (the scalar path), and
// (4-bit with offsets) its offset scale.
template <int Bits, bool Min, bool Super>
inline float group_scale(const uint8_t* pan, const uint16_t* dp, int64_t g, int64_t s,
                         int64_t j) {
  if constexpr (Super) {
    const int64_t sub = Bits == 6 ? 2 * (g % kSuperGroups) + s : g % kSuperGroups;
    const uint8_t b = sub_scale_byte<Bits>(pan, g, sub, j);
    const float sc = static_cast<float>(Bits == 6 ? static_cast<int8_t>(b) : b);
    return half_value(dp[(g / kSuperGroups) * kPanel + j]) * sc;
  }
  return half_value(group_head<Bits, Min>(pan, g)[s * kPanel + j]);
}
template <int Bits, bool Min, bool Super>
inline float group_min(const uint8_t* pan, const uint16_t* mp, int64_t g, int64_t j) {
  if constexpr (Super) {
    const uint8_t m = sub_scale_byte<Bits>(pan, g, kSuperGroups + g % kSuperGroups, j);
    return half_value(mp[(g / kSuperGroups) * kPanel + j]) * static_cast<float>(m);
  }
  return half_value(group_head<Bits, Min>(pan, g)[kPanel + j]);
}

// The code of channel j at k in a panel (the scalar path): q for 8-bit codes, the stored
// q in [0, 15] or [0, 63] for 4- and 6-bit ones (6-bit: its group's nibble as a 4-bit code's,
// then the high pair of its half; see group_rows).
template <int Bits>
inline int group_code(const uint8_t* pan, int64_t k, int64_t j) {
  if constexpr (Bits == 8) return static_cast<int>(pan[((k / 4) * kPanel + j) * 4 + k % 4]) - 128;
  if constexpr (Bits == 5) {  // the high bits' lane, then the nibbles'
    const uint8_t* q = pan + (k / kGroup) * kGroup * kPanel * 5 / 8;
    const int64_t kk = k % kGroup;
    const uint8_t bits = q[j * 4 + kk % 4];
    return group_code<4>(q + 4 * kPanel, kk, j) | ((bits >> (2 * (kk / 8) + (kk % 8) / 4)) & 1)
                                                      << 4;
  }
  if constexpr (Bits == 6) {  // per half of 16 k: its pairs' lane, then its 2 nibble lanes
    const int64_t kk = k % kGroup;
    const uint8_t* q = pan + (k / kGroup) * kGroup * kPanel * 6 / 8 + (kk / 16) * 12 * kPanel;
    const uint8_t pairs = q[j * 4 + kk % 4];
    return group_code<4>(q + 4 * kPanel, kk % 16, j) | ((pairs >> (2 * ((kk % 16) / 4))) & 3)
                                                           << 4;
  }
  const uint8_t b = pan[((k / 8) * kPanel + j) * 4 + k % 4];
  return k % 8 < 4 ? b & 15 : b >> 4;
}

// y[m0 .. m0+MR-1, n .. n+cols-1] (+)= x[.., groups g0:g1] @ panel; `first`: y is not read;
// `bi` (the last slice only): plus bias. xq/dx/xs/xh: the rows' quantized x (QuantizedRows),
// row r at xq + r * K, dx + r * G, xs + r * G, xh + r * G.
//
// 6-bit codes (Q6_K: q + 32 in [0, 63], a scale per 16 k) are laid out per half of 16 k of a
// group as the high pairs of its 16 k in one 32-bit lane (k = 16h + 4c + t in bits 2c of byte
// t), then its two lanes of the 4-bit codes' nibbles; 5-bit ones (Q5_0) per group as the lane
// of high bits, then the nibbles. Both halves' scales are consecutive rows of `dp`; each
// half's sum is corrected by 32 times its x sum.
//
// The kernel reads a group's lines in address order. With the high pairs after the nibbles
// (lines 8, 9, 0-3, 10, 11, 4-7 of a 12-line AVX-512 group) the hardware prefetcher fell
// behind: a register-only loop reading 115 MB in that order with no other work streamed 16-18
// GB/s on one core of an AMD EPYC (Zen 4) against 26-29 in address order.
template <int MR, int Bits, bool Min, bool Super>
inline void group_rows(const int8_t* xq, const float* dx, const int32_t* xs, const int32_t* xh,
                       int64_t K, const uint8_t* pan, const uint16_t* dp, const uint16_t* mp,
                       int64_t g0, int64_t g1, float* y, int64_t N, int64_t cols, bool first,
                       const float* bi, float* __restrict sup, bool fill) {
  const int64_t G = K / kGroup;
  constexpr int kXCopies = x_copies<Bits>();
#ifdef EMBER_SIMD
  constexpr int64_t kVec = kLanes * 4;  // bytes per code vector (kLanes channels)
  vfloat a0[MR], a1[MR];
  // super-blocks: the sub-block scales (super_scales) of the super-block being read, in
  // `local` for a single row, else in the slice's `sup`, filled by its first row block
  alignas(64) float local[Super && MR == 1 ? 16 : 1][kPanel];
  const int64_t c0 = std::min<int64_t>(cols, kLanes), c1 = cols - c0;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    a0[r] = first ? vzero() : vload_n(y + r * N, c0);
    a1[r] = first ? vzero() : vload_n(y + r * N + kLanes, c1);
  }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* q = pan + group_offset<Bits, Min, Super>(g);
    // plain groups: the scales' rows ahead of the codes (the head)
    const uint16_t* head = Super ? nullptr : group_head<Bits, Min>(pan, g);
    if constexpr (Super) {
      prefetch_group<kGroup * kPanel * Bits / 8, MR>(q);
    } else {
      prefetch_group<plain_group_bytes(Bits, Min) * kPanel, MR>(
          reinterpret_cast<const uint8_t*>(head));
    }
    const int8_t* xg = xq + g * kGroup * kXCopies;
    // super-blocks: the sub-block scales of group g's (super_scales)
    float(*super)[kPanel] = local;
    if constexpr (Super) {
      if constexpr (MR > 1) {
        super = reinterpret_cast<float(*)[kPanel]>(sup) +
                16 * (g / kSuperGroups - g0 / kSuperGroups);
      }
      if ((MR == 1 || fill) && (g == g0 || g % kSuperGroups == 0))
        super_scales<Bits, Min>(pan, dp, mp, g, super);
    }
    if constexpr (Bits == 5) {
      // The 4-bit codes' nibbles, each or'ed with its high bit: k = 8i + t (low nibble of
      // byte t of lane i) takes bit 2i of byte t of the high lane, k = 8i + 4 + t bit 2i + 1.
      const uint8_t* qn = q + 2 * kVec;  // the high bits' lane first, then the nibbles
      const vint p0 = iload(q), p1 = iload(q + kVec);
      vint s0[MR], s1[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) s0[r] = s1[r] = izero();
      vint e0 = izero(), e1 = izero();  // a single row's high-nibble sums
      const auto step = [&](auto i_const) {
        constexpr int i = decltype(i_const)::value;
        const vint b0 = iload(qn + 2 * i * kVec), b1 = iload(qn + (2 * i + 1) * kVec);
        const vint lo0 = ior(low_nibbles(b0), high_bit<2 * i>(p0));
        const vint lo1 = ior(low_nibbles(b1), high_bit<2 * i>(p1));
        const vint hi0 = ior(high_nibbles(b0), high_bit<2 * i + 1>(p0));
        const vint hi1 = ior(high_nibbles(b1), high_bit<2 * i + 1>(p1));
        nibble_dots<MR, false>(xg, K, i, lo0, lo1, hi0, hi1, s0, s1, e0, e1);
      };
      step(std::integral_constant<int, 0>{});
      step(std::integral_constant<int, 1>{});
      step(std::integral_constant<int, 2>{});
      step(std::integral_constant<int, 3>{});
      if constexpr (MR == 1) {
        s0[0] = iadd(s0[0], e0);
        s1[0] = iadd(s1[0], e1);
      }
      const vfloat d0 = vhalf(head), d1 = vhalf(head + kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {  // stored q in [0, 31]: the value is d (q - 16)
        const vfloat sx = vset1(dx[r * G + g]);
        a0[r] = vfma(icvt(isub(s0[r], 16 * xs[r * G + g])), vmul(d0, sx), a0[r]);
        a1[r] = vfma(icvt(isub(s1[r], 16 * xs[r * G + g])), vmul(d1, sx), a1[r]);
      }
      continue;
    }
    if constexpr (Bits == 6) {
#pragma GCC unroll 2
      for (int64_t h = 0; h < 2; ++h) {
        vint s0[MR], s1[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) s0[r] = s1[r] = izero();
        vint e0 = izero(), e1 = izero();  // a single row's high-nibble sums
        const uint8_t* qb = q + h * 6 * kVec;  // the half's pairs, then its nibbles
        const vint p0 = iload(qb), p1 = iload(qb + kVec);
#pragma GCC unroll 2
        for (int64_t u = 0; u < 2; ++u) {
          const int64_t i = 2 * h + u;
          const vint b0 = iload(qb + (2 + 2 * u) * kVec), b1 = iload(qb + (3 + 2 * u) * kVec);
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
        vfloat d0, d1;
        if constexpr (Super) {
          const float* ds = super[2 * (g % kSuperGroups) + h];
          d0 = vload(ds);
          d1 = vload(ds + kLanes);
        } else {
          const uint16_t* dh = head + h * kPanel;
          d0 = vhalf(dh);
          d1 = vhalf(dh + kLanes);
        }
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
    if constexpr (Bits == 8) {
      group_dots8<MR>(q, xg, K * kXCopies, s0, s1);
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) s0[r] = s1[r] = izero();
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
    vfloat d0, d1, m0 = vzero(), m1 = vzero();
    if constexpr (Super) {
      const int64_t sub = g % kSuperGroups;
      d0 = vload(super[sub]);
      d1 = vload(super[sub] + kLanes);
      if constexpr (Min) {
        m0 = vload(super[kSuperGroups + sub]);
        m1 = vload(super[kSuperGroups + sub] + kLanes);
      }
    } else {
      d0 = vhalf(head);
      d1 = vhalf(head + kLanes);
      if constexpr (Min) {
        m0 = vhalf(head + kPanel);
        m1 = vhalf(head + kPanel + kLanes);
      }
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
  constexpr int32_t kOffset = Bits == 6 ? 32 : Bits == 5 ? 16 : Bits == 4 && !Min ? 8 : 0;
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float acc = first ? 0.f : y[r * N + j];
      for (int64_t g = g0; g < g1; ++g) {
        const float m = Min ? group_min<Bits, Min, Super>(pan, mp, g, j) : 0.f;
        const uint8_t* q = pan + group_offset<Bits, Min, Super>(g);
        for (int64_t s = 0; s < kSegments; ++s) {
          const float d = group_scale<Bits, Min, Super>(pan, dp, g, s, j);
          int32_t dot = 0;
          for (int64_t k = s * kSpan; k < (s + 1) * kSpan; ++k) {
            dot += static_cast<int32_t>(xq[r * K + g * kGroup + k]) *
                   (group_code<Bits>(q, k, j) - kOffset);
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
                             float*, int64_t, int64_t, bool, const float*, float*, bool);

template <int Bits, bool Min, bool Super, size_t... R>
constexpr std::array<GroupKernel, sizeof...(R)> group_kernels(std::index_sequence<R...>) {
  return {&group_rows<static_cast<int>(R) + 1, Bits, Min, Super>...};
}

// y [M, N] = x [M, K] @ w^T + bias, w group-quantized and packed (see above).
template <int Bits, bool Min, bool Super = false>
void group_gemm(const float* x, const uint8_t* codes, const uint16_t* d, const uint16_t* m,
                const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  static constexpr int kRows = Bits == 6 || Bits == 5 ? kGroup6RowBlock
                               : Bits == 4                ? kGroup4RowBlock
                                                          : kGroupRowBlock;
  static constexpr auto kernels =
      group_kernels<Bits, Min, Super>(std::make_index_sequence<static_cast<size_t>(kRows)>());
  const int64_t G = K / kGroup;
  const int64_t panel_bytes = (Super ? G / kSuperGroups * super_lanes<Bits>()
                                     : plain_lanes(G, Bits, Min)) * 4 * kPanel;
  // super-blocks: a row of d (and dm) per 256 k; plain groups have theirs in their heads
  const int64_t scale_rows = Super ? G / kSuperGroups : 0;
  constexpr int kXCopies = x_copies<Bits>();
  const QuantizedRows xq = quantize_rows(x, M, K, kXCopies);
  for_panel_tasks(
      M, N, K,
      [&](int64_t p, int64_t n, int64_t cols, const RowBlocks& blocks) {
        alignas(64) float bi[kPanel];
        for (int64_t j = 0; j < kPanel; ++j) bi[j] = bias && j < cols ? bias[n + j] : 0.f;
        const uint8_t* pan = codes + p * panel_bytes;
        const uint16_t* dp = Super ? d + p * scale_rows * kPanel : nullptr;
        const uint16_t* mp = Super && m ? m + p * scale_rows * kPanel : nullptr;
        // super-blocks: a slice's sub-block scales, filled by its first row block for the rest
        alignas(64) float sup[Super ? kPanelDepth / 256 * 16 : 1][kPanel];
        for (int64_t ga = 0; ga < G; ga += kPanelDepth / kGroup) {
          const int64_t gb = std::min(G, ga + kPanelDepth / kGroup);
          bool fill = true;
          blocks.each([&](int64_t m0, int64_t rows) {
            kernels[rows - 1](xq.q.data() + m0 * K * kXCopies, xq.scale.data() + m0 * G,
                              xq.sum.data() + m0 * G, xq.half.data() + m0 * G, K, pan, dp, mp,
                              ga, gb, y + m0 * N + n, N, cols, ga == 0,
                              gb == G && bias ? bi : nullptr, &sup[0][0], fill);
            fill = false;
          });
        }
      },
      kRows);
}

// x [..., K] as fp32 rows [M, K] and an empty y [..., N] in fp32: fp32 contiguous x (every
// compiled step) is used as it is, with no reshape, cast or copy op, and y shaped directly;
// `direct` says so (else y is cast back to x's dtype by the caller).
struct FloatRows {
  at::Tensor x, y;
  int64_t M;
  bool direct;
};

inline FloatRows float_rows(const at::Tensor& x_in, int64_t K, int64_t N) {
  const bool direct = x_in.scalar_type() == at::kFloat && x_in.is_contiguous();
  at::Tensor x = direct ? x_in : x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t M = x.numel() / K;
  return {std::move(x), std::move(y), M, direct};
}

// ---- Per-channel int8 weights with integer dot products (ember's quantization="int8") ----
//
// codes as the 8-bit group layout ([P, K / 4, kPanel, 4] uint8 holding q + 128), one fp32
// scale per output channel (w = d * q), x quantized per group of 32 as above:
// y = d * sum_g dx_g * sum(xq_g * q_g). One fp32 FMA per group per vector of channels, the
// scale once at the end; 8 bits per weight (Q8_0's groups carry 8.5).
template <int MR>
inline void channel_rows(const int8_t* xq, const float* dx, const int32_t* xs, int64_t K,
                         const uint8_t* pan, const float* dp, int64_t g0, int64_t g1, float* y,
                         int64_t N, int64_t cols, bool first, const float* bi) {
  const int64_t G = K / kGroup;
  constexpr int64_t kBytes = kGroup * kPanel;  // codes per group of a panel
#ifdef EMBER_SIMD
  vfloat a0[MR], a1[MR];
  const int64_t c0 = std::min<int64_t>(cols, kLanes), c1 = cols - c0;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vzero();
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* q = pan + g * kBytes;
    prefetch_group<kBytes, MR>(q);
    const int8_t* xg = xq + g * kGroup * kX8Copies;
    vint s0[MR], s1[MR];
    group_dots8<MR>(q, xg, K * kX8Copies, s0, s1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int32_t bias = kCode8Bias * xs[r * G + g];
      const vfloat sx = vset1(dx[r * G + g]);
      a0[r] = vfma(icvt(isub(s0[r], bias)), sx, a0[r]);
      a1[r] = vfma(icvt(isub(s1[r], bias)), sx, a1[r]);
    }
  }
  const vfloat d0 = vload(dp), d1 = vload(dp + kLanes);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    vfloat p0 = first ? vzero() : vload_n(y + r * N, c0);
    vfloat p1 = first ? vzero() : vload_n(y + r * N + kLanes, c1);
    if (bi) {
      p0 = vadd(p0, vload(bi));
      p1 = vadd(p1, vload(bi + kLanes));
    }
    vstore_n(y + r * N, vfma(a0[r], d0, p0), c0);
    vstore_n(y + r * N + kLanes, vfma(a1[r], d1, p1), c1);
  }
#else
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.f;
      for (int64_t g = g0; g < g1; ++g) {
        int32_t dot = 0;
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
          dot += static_cast<int32_t>(xq[r * K + k]) * group_code<8>(pan, k, j);
        }
        acc += dx[r * G + g] * static_cast<float>(dot);
      }
      const float prev = (first ? 0.f : y[r * N + j]) + (bi ? bi[j] : 0.f);
      y[r * N + j] = prev + dp[j] * acc;
    }
  }
#endif
}

using ChannelKernel = void (*)(const int8_t*, const float*, const int32_t*, int64_t,
                               const uint8_t*, const float*, int64_t, int64_t, float*, int64_t,
                               int64_t, bool, const float*);

template <size_t... R>
constexpr std::array<ChannelKernel, sizeof...(R)> channel_kernels(std::index_sequence<R...>) {
  return {&channel_rows<static_cast<int>(R) + 1>...};
}

// y [..., N] = x [..., K] @ (d * q)^T (+ bias): `codes` [P, K / 4, kPanel, 4] uint8 (q + 128),
// `scales` fp32 [P * kPanel] (zeros past N). Called by packed_linear for such a weight.
at::Tensor int8_dot_linear(const at::Tensor& x_in, const at::Tensor& codes,
                           const std::optional<at::Tensor>& scales,
                           const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) % (kGroup / 4) == 0 && codes.size(2) == kPanel &&
                  codes.size(3) == 4 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "packed_linear: int8 codes must be a contiguous uint8 [P, K / 4, ", kPanel,
              ", 4] tensor, K a multiple of 32 (packed for this CPU ISA)");
  check_out_features(codes, N);
  const int64_t K = codes.size(1) * 4, G = K / kGroup, P = codes.size(0);
  TORCH_CHECK(scales.has_value() && scales->defined() && scales->scalar_type() == at::kFloat &&
                  scales->is_contiguous() && scales->numel() == P * kPanel,
              "packed_linear: int8 codes need contiguous fp32 scales of ", P * kPanel,
              " values (one per channel, zeros past out_features)");
  TORCH_CHECK(x_in.size(-1) == K, "packed_linear: x has ", x_in.size(-1), " features, w ", K);
  auto [x, y, M, direct] = float_rows(x_in, K, N);
  if (M > 0) {
    static constexpr auto kernels =
        channel_kernels(std::make_index_sequence<static_cast<size_t>(kGroupRowBlock)>());
    at::Tensor b;
    const float* bp = bias_ptr(bias, b);
    const auto* cp = codes.data_ptr<uint8_t>();
    const float* sp = scales->data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K, kX8Copies);
    for_panel_tasks(
        M, N, K,
        [&](int64_t p, int64_t n, int64_t cols, const RowBlocks& blocks) {
          alignas(64) float bi[kPanel];
          for (int64_t j = 0; j < kPanel; ++j) bi[j] = bp && j < cols ? bp[n + j] : 0.f;
          const uint8_t* pan = cp + p * K * kPanel;
          for (int64_t ga = 0; ga < G; ga += kPanelDepth / kGroup) {
            const int64_t gb = std::min(G, ga + kPanelDepth / kGroup);
            blocks.each([&](int64_t m0, int64_t rows) {
              kernels[rows - 1](xq.q.data() + m0 * K * kX8Copies, xq.scale.data() + m0 * G,
                                xq.sum.data() + m0 * G, K, pan, sp + p * kPanel, ga, gb,
                                yp + m0 * N + n, N, cols, ga == 0, gb == G && bp ? bi : nullptr);
            });
          }
        },
        kGroupRowBlock);
  }
  return direct ? y : y.to(x_in.scalar_type());
}

// y [..., N] = x [..., K] @ w^T (+ bias) for a group-quantized weight (see above): plain
// groups, `codes` [P, L, kPanel, 4] uint8 with L = plain_lanes(K / 32, bits, offsets): each
// group's head of fp16 scales (and offsets), then its codes (8-bit: 8 lanes a group, 4-bit: 4,
// 5-bit: 5, 6-bit: 6); `scales` (and `mins`, given for 4-bit codes with offsets) empty fp16
// [P, 0, kPanel], saying so. Or super-blocks (bits 4 with offsets, or 6): codes [P, 36 K / 256
// (bits 6: 52 K / 256), kPanel, 4], scales and mins [P, K / 256, kPanel] fp16; told apart by
// those shapes. x quantized to int8 per group of 32, int32 sums, fp32 scaling; y in x's dtype.
at::Tensor group_linear(const at::Tensor& x_in, const at::Tensor& codes,
                        const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                        const std::optional<at::Tensor>& bias, int64_t N, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "group_linear: bits must be 4, 5, 6 or 8, got ", bits);
  const bool has_min = mins.has_value() && mins->defined();
  TORCH_CHECK(!has_min || bits == 4, "group_linear: offsets are for 4-bit codes only");
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kPanel && codes.size(3) == 4 &&
                  codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "group_linear: codes must be a contiguous uint8 [P, lanes, ", kPanel,
              ", 4] tensor (packed for this CPU ISA)");
  // super-blocks: 36 (4-bit) or 52 (6-bit) lanes per 256 k, one scale row per 256 k
  const int64_t super_lanes_ = bits == 6 ? super_lanes<6>() : super_lanes<4>();
  const bool super = ((bits == 4 && has_min) || bits == 6) && scales.dim() == 3 &&
                     scales.size(1) > 0 && scales.size(1) * super_lanes_ == codes.size(1);
  const int64_t G = super ? codes.size(1) / super_lanes_ * kSuperGroups
                          : codes.size(1) * 4 / plain_group_bytes(bits, has_min);
  TORCH_CHECK(G > 0 && (super || plain_lanes(G, bits, has_min) == codes.size(1)),
              "group_linear: ", codes.size(1), " lanes a channel are not ",
              super ? "super-blocks" : "groups", " of ", bits, "-bit codes");
  check_out_features(codes, N);
  const int64_t K = G * kGroup;
  const int64_t scale_rows = super ? G / kSuperGroups : 0;
  for (const at::Tensor* t : {&scales, has_min ? &*mins : &scales}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == codes.size(0) && t->size(1) == scale_rows &&
                    t->size(2) == kPanel,
                "group_linear: scales and mins must be contiguous fp16 [", codes.size(0), ", ",
                scale_rows, ", ", kPanel, "]", super ? "" : " (plain groups: in the codes)");
  }
  TORCH_CHECK(x_in.size(-1) == K, "group_linear: x has ", x_in.size(-1), " features, w ", K);
  auto [x, y, M, direct] = float_rows(x_in, K, N);
  if (M > 0) {
    at::Tensor b;
    const float* bp = bias_ptr(bias, b);
    const auto* cp = codes.data_ptr<uint8_t>();
    const auto* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    const auto* mp = has_min ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr;
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (super && bits == 6) {
      group_gemm<6, false, true>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    } else if (super) {
      group_gemm<4, true, true>(xp, cp, dp, mp, bp, yp, M, N, K);
    } else if (bits == 8) {
      group_gemm<8, false>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    } else if (bits == 6) {
      group_gemm<6, false>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    } else if (bits == 5) {
      group_gemm<5, false>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    } else if (has_min) {
      group_gemm<4, true>(xp, cp, dp, mp, bp, yp, M, N, K);
    } else {
      group_gemm<4, false>(xp, cp, dp, nullptr, bp, yp, M, N, K);
    }
  }
  return direct ? y : y.to(x_in.scalar_type());
}

}  // namespace
