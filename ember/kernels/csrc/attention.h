// Paged attention: decode and prefill from the paged K/V cache, and its writes.
// One part of ember_cpu.cpp's translation unit (included there, in order; not built alone).
#pragma once

namespace {

// An int8 cache (kv_cache_dtype="int8") holds each K/V head's row as its D codes followed by
// the row's fp32 scale (4 bytes, per token and head): a row's pitch is D + 4, and its values
// are code * scale. float32 and bfloat16 caches hold the D values (pitch D, scale 1).
template <typename C>
constexpr bool kScaledRows = std::is_same_v<C, int8_t>;
constexpr int64_t kRowScaleBytes = 4;

template <typename C>
inline float row_scale(const C* row, int64_t D) {
  if constexpr (kScaledRows<C>) {
    float scale;
    std::memcpy(&scale, row + D, sizeof scale);
    return scale;
  } else {
    return 1.f;
  }
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

// acc[0 : D] = acc * scale + sum_j p[j] * v_j[0 : D] for one head (D a multiple of kLanes):
// `add_weighted_rows` a D-slice of up to 8 vectors at a time (up to 8 independent FMA chains
// per row). Always inlined: as a call, a 48 x 42-token chunk step took 2.11-2.19 ms against
// 1.91-1.94 with the loop written out at each caller.
template <typename C>
__attribute__((always_inline)) inline void add_weighted_head(float* acc, float scale,
                                                             const float* p, const C* v,
                                                             int64_t stride, int64_t count,
                                                             int64_t D) {
  for (int64_t d = 0; d < D;) {
    const int64_t left = (D - d) / kLanes;
    if (left >= 8) {
      add_weighted_rows<8>(acc + d, scale, p, v + d, stride, count);
    } else if (left >= 4) {
      add_weighted_rows<4>(acc + d, scale, p, v + d, stride, count);
    } else if (left >= 2) {
      add_weighted_rows<2>(acc + d, scale, p, v + d, stride, count);
    } else {
      add_weighted_rows<1>(acc + d, scale, p, v + d, stride, count);
    }
    d += kLanes * (left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1);
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
                  int64_t group, int64_t D, int64_t Dp, const float* qs, float* acc, float* m,
                  float* l, float* s, const Ahead& ahead) {
  const int64_t sb = (count + kLanes - 1) / kLanes * kLanes;
  float* m_new = s + H * sb;
  float* corr = m_new + H + kLanesMax;
  for (int64_t g = 0; g < H; ++g) {
    ahead.fetch(g, 2 * H);
    const C* kh = k + (g / group) * Dp;
    for (int64_t j = 0; j < count; j += kLanes) {
      vstore(s + g * sb + j, row_scores(qs + g * D, kh + j * stride, stride, D,
                                        std::min(kLanes, count - j)));
    }
    if constexpr (kScaledRows<C>) {  // codes' dot products times each K row's scale
      for (int64_t j = 0; j < count; ++j) s[g * sb + j] *= row_scale(kh + j * stride, D);
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
    const C* vh = v + (g / group) * Dp;
    if constexpr (kScaledRows<C>) {  // each weight times its V row's scale (l is summed)
      for (int64_t j = 0; j < count; ++j) s[g * sb + j] *= row_scale(vh + j * stride, D);
    }
    add_weighted_head(acc + g * D, corr[g], s + g * sb, vh, stride, count, D);
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
                 int64_t H, int64_t D, float sc, int64_t split_min_tokens) {
  const int64_t NB = cache.size(1), BS = cache.size(2), Hkv = cache.size(3), Dp = cache.size(4);
  const int64_t group = H / Hkv, n = static_cast<int64_t>(rows.size()), stride = Hkv * Dp;
  const C* kp = cache.data_ptr<C>();
  const C* vp = kp + NB * BS * Hkv * Dp;
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
                       count, H, group, D, Dp, qs.data(), acc.data(), m.data(), l.data(),
                       s.data(), ahead);
          start += count;
          continue;
        }
#endif
        ahead.fetch(0, 1);
        for (int64_t g = 0; g < H; ++g) {
          const int64_t h = g / group;
          const C* kb = kp + (blk * BS + off) * stride + h * Dp;
          const C* vb = vp + (blk * BS + off) * stride + h * Dp;
          const float* qg = qs.data() + g * D;
          float* ag = acc.data() + g * D;
          float mx = m[g];
          for (int64_t j = 0; j < count; ++j) {
            s[j] = dot_row(qg, kb + j * stride, D) * row_scale(kb + j * stride, D);
          }
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
            add_scaled_row(ag, p * row_scale(vb + j * stride, D), vb + j * stride, D);
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

// A prefill chunk of a step (see attend_chunks); declared for every build, as attend_step
// lists them before it knows whether tiles run.
struct Chunk {
  int64_t seq, t0, q_len, len;
};

#ifdef EMBER_SIMD
// s[0 : NV * kLanes] = sc * (q . k_j) for the positions j of NV vectors of a chunk's
// transposed K rows (kt: [D, Lp] from their first position): one broadcast of q[d] shared by
// NV independent FMA chains.
template <int NV>
inline void chunk_scores(const float* q, const float* kt, int64_t Lp, int64_t D, float sc,
                         float* s) {
  vfloat a[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) a[v] = vzero();
  for (int64_t d = 0; d < D; ++d, kt += Lp) {
    const vfloat b = vset1(q[d]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) a[v] = vfma(b, vload(kt + v * kLanes), a[v]);
  }
  const vfloat scale = vset1(sc);
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) vstore(s + v * kLanes, vmul(a[v], scale));
}

// A prefill chunk (its query rows t0 .. t0 + q_len - 1, at positions len - q_len ..) of
// sequence seq, attended by the query heads of one K/V head h: the chunk's K rows are gathered
// once, transposed ([D, L] in fp32), and its V rows ([L, D]), so every query row's scores are
// D broadcast FMAs per kLanes positions (no transpose-and-add tree per block, as a decode's
// are) and its weighted sum one FMA per position and D-slice. The rows r = slice, slice +
// slices, ... only (a causal chunk's short and long rows interleaved: equal work per slice).
// `kt`, `vv`, `s`: scratch of D * round_up(len, kLanes), len * D and round_up(len, kLanes) +
// kLanes floats.
template <typename C>
void attend_chunk_head(float* op, const float* qp, const C* kp, const C* vp,
                       const int64_t* table, int64_t BS, int64_t Hkv, int64_t H, int64_t D,
                       int64_t Dp, int64_t h, int64_t t0, int64_t q_len, int64_t len, int64_t slice,
                       int64_t slices, bool causal, int64_t sliding_window, float sc, float* kt,
                       float* vv, float* s) {
  const int64_t Lp = (len + kLanes - 1) / kLanes * kLanes, stride = Hkv * Dp;
  const int64_t group = H / Hkv;
  // The context every row reads: [0, len) (a sliding window starts later, never earlier).
  for (int64_t j = 0; j < len; ++j) {
    const int64_t slot = table[j / BS] * BS + j % BS;
    const C* kr = kp + slot * stride + h * Dp;
    const C* vr = vp + slot * stride + h * Dp;
    if constexpr (kScaledRows<C>) {  // dequantized as gathered
      const vfloat vs = vset1(row_scale(vr, D));
      const float ks = row_scale(kr, D);
      for (int64_t d = 0; d < D; d += kLanes) vstore(vv + j * D + d, vmul(vwiden(vr + d), vs));
      for (int64_t d = 0; d < D; ++d) kt[d * Lp + j] = to_float(kr[d]) * ks;
    } else {
      for (int64_t d = 0; d < D; d += kLanes) vstore(vv + j * D + d, vwiden(vr + d));
      for (int64_t d = 0; d < D; ++d) kt[d * Lp + j] = to_float(kr[d]);
    }
  }
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * Lp + len, kt + (d + 1) * Lp, 0.f);
  for (int64_t r = slice; r < q_len; r += slices) {
    const int64_t p = len - q_len + r;
    const int64_t hi = causal ? p + 1 : len;
    const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
    const int64_t j0 = lo / kLanes * kLanes;  // whole vectors of positions from here
    for (int64_t g = h * group; g < (h + 1) * group; ++g) {
      const float* q = qp + ((t0 + r) * H + g) * D;
      for (int64_t j = j0; j < hi; j += 4 * kLanes) {
        switch (std::min<int64_t>(4, (hi - j + kLanes - 1) / kLanes)) {
          case 4: chunk_scores<4>(q, kt + j, Lp, D, sc, s + j); break;
          case 3: chunk_scores<3>(q, kt + j, Lp, D, sc, s + j); break;
          case 2: chunk_scores<2>(q, kt + j, Lp, D, sc, s + j); break;
          default: chunk_scores<1>(q, kt + j, Lp, D, sc, s + j); break;
        }
      }
      const float mx = scores_max(s + lo, hi - lo);  // positions before lo are not read
      const float l = exp_scores(s + lo, hi - lo, mx);
      float* o = op + ((t0 + r) * H + g) * D;
      std::fill(o, o + D, 0.f);
      add_weighted_head(o, 0.f, s + lo, vv + lo * D, D, hi - lo, D);
      const vfloat inv = vset1(l > 0.f ? 1.f / l : 0.f);
      for (int64_t d = 0; d < D; d += kLanes) vstore(o + d, vmul(vload(o + d), inv));
    }
  }
}

// A step's prefill chunks (sequence, first query token, query rows, context length) attended
// by `attend_chunk_head`, in parallel over (chunk, K/V head, slice of rows) tasks: enough
// slices for 4 tasks a thread, none under 16 rows. q, out: [T, H, D] float32.
template <typename C>
void attend_chunks(float* op, const float* qp, const at::Tensor& cache,
                   const std::vector<Chunk>& chunks, const int64_t* tables, int64_t max_blocks,
                   int64_t H, int64_t D, float sc, bool causal, int64_t sliding_window) {
  const int64_t NB = cache.size(1), BS = cache.size(2), Hkv = cache.size(3), Dp = cache.size(4);
  const C* kp = cache.data_ptr<C>();
  const C* vp = kp + NB * BS * Hkv * Dp;
  const int64_t n = static_cast<int64_t>(chunks.size()), threads = at::get_num_threads();
  int64_t longest = 0, shortest = INT64_MAX;
  for (const Chunk& c : chunks) {
    longest = std::max(longest, c.len);
    shortest = std::min(shortest, c.q_len);
  }
  const int64_t want = (4 * threads + n * Hkv - 1) / (n * Hkv);
  const int64_t slices = std::max<int64_t>(1, std::min(want, shortest / 16));
  const int64_t Lp = (longest + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, n * Hkv * slices, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> kt(D * Lp), vv(longest * D), s(Lp + kLanes);
    for (int64_t u = u0; u < u1; ++u) {
      const Chunk& c = chunks[u / (Hkv * slices)];
      const int64_t h = u / slices % Hkv, slice = u % slices;
      attend_chunk_head(op, qp, kp, vp, tables + c.seq * max_blocks, BS, Hkv, H, D, Dp, h,
                        c.t0, c.q_len, c.len, slice, slices, causal, sliding_window, sc,
                        kt.data(), vv.data(), s.data());
    }
  });
}
#endif

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

// One K/V head's row x[0 : D] as int8 codes and their scale (`kScaledRows`): scale =
// max |x| / 127, code = round-half-even(x * (127 / max |x|)), all 0 for a zero row. The same
// arithmetic as ember.attention.ops.quantize_kv_rows, so both writers store the same bytes.
inline void quantize_kv_row(const float* x, int64_t D, int8_t* out) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float q = std::nearbyint(x[d] * inv);
    out[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  const float scale = amax / 127.f;
  std::memcpy(out + D, &scale, sizeof scale);
}

// cache[0 / 1] rows at `slot_mapping` = key / value rows ([T, Hkv, D], cast to the cache's
// dtype, or quantized per token and head for an int8 cache): plain row copies, no indexing
// dispatch.
void write_slots(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& slot_mapping) {
  const int64_t rows = cache.size(1) * cache.size(2), Hkv = cache.size(3);
  const int64_t T = slot_mapping.numel(), D = key.size(-1);
  const bool int8 = cache.scalar_type() == at::kChar;
  TORCH_CHECK(cache.size(4) == D + (int8 ? kRowScaleBytes : 0),
              "paged_attention: the cache's rows hold ", cache.size(4),
              " values, K/V heads ", D);
  const int64_t row = Hkv * cache.size(4), elem = cache.element_size();
  TORCH_CHECK(key.numel() == T * Hkv * D && value.numel() == T * Hkv * D,
              "paged_attention: key/value must hold one [Hkv, D] row per slot");
  std::vector<int64_t> slots_buf;
  const int64_t* sp = as_int64(slot_mapping, slots_buf);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < rows, "paged_attention: slot ", sp[t],
                " is outside the cache's ", rows, " slots");
  }
  char* base = static_cast<char*>(cache.data_ptr());
  if (int8) {
    const at::Tensor k = key.to(at::kFloat).contiguous(), v = value.to(at::kFloat).contiguous();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    int8_t* cp = reinterpret_cast<int8_t*>(base);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t src = (t * Hkv + h) * D, dst = sp[t] * row + h * (D + kRowScaleBytes);
        quantize_kv_row(kp + src, D, cp + dst);
        quantize_kv_row(vp + src, D, cp + rows * row + dst);
      }
    }
    return;
  }
  const at::Tensor k = key.to(cache.scalar_type()).contiguous();
  const at::Tensor v = value.to(cache.scalar_type()).contiguous();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
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
              "paged_attention: out must be contiguous float32, the cache contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16 ||
                  cache.scalar_type() == at::kChar,
              "paged_attention: the cache must be float32, bfloat16 or int8");
  const int64_t H = query.size(1), D = query.size(2);
  write_slots(cache, key, value, slot_mapping);
  std::vector<int64_t> qsl_buf, lens_buf, tables_buf;
  const int64_t* qsl = as_int64(query_start_loc, qsl_buf);
  const int64_t* lens = as_int64(seq_lens, lens_buf);
#ifdef EMBER_SIMD
  // Chunks by tiles of their own (`attend_chunks`) where D fills whole vectors, else each
  // query row as a row of its own.
  const bool tiles = query.size(2) % kLanes == 0;
#else
  const bool tiles = false;
#endif
  std::vector<QueryRow> rows, chunk_rows;
  std::vector<Chunk> chunk_list;
  int64_t flags = 0, chunk_positions = 0;
  for (int64_t i = 0; i < seq_lens.numel(); ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    if (q_len > 1) flags |= 1;
    if (q_len > 1 && !chunks) continue;
    if (q_len > 1 && tiles) chunk_list.push_back({i, qsl[i], q_len, lens[i]});
    for (int64_t j = 0; j < q_len; ++j) {  // query row j sits at position p
      const int64_t p = lens[i] - q_len + j;
      const int64_t hi = causal ? p + 1 : lens[i];
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
      if (q_len == 1) {
        rows.push_back({qsl[i], i, lo, hi});
      } else {
        if (!tiles) chunk_rows.push_back({qsl[i] + j, i, lo, hi});
        chunk_positions += hi - lo;
      }
    }
  }
  if (chunk_positions > kChunkRowsMaxPositions) {  // left to the PyTorch code (flags)
    chunk_list.clear();
  } else if (!chunk_list.empty()) {
    flags = 0;
  } else if (!chunk_rows.empty()) {
    const size_t first = rows.size();
    rows.insert(rows.end(), chunk_rows.begin(), chunk_rows.end());
    flags = 0;
    for (size_t i = first, j = first; i < rows.size(); i = j) {  // one chunk at a time
      while (j < rows.size() && rows[j].seq == rows[i].seq) ++j;
      balance_chunk(rows, i, j);
    }
  }
  if (rows.empty() && chunk_list.empty()) return flags;
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const int64_t* tables = as_int64(block_tables, tables_buf);
  const int64_t max_blocks = block_tables.size(1);
  const float sc = static_cast<float>(scale);
  float* o = out.data_ptr<float>();
  const float* qd = q.data_ptr<float>();
  auto attend = [&](auto cache_type) {
    using C = decltype(cache_type);
    if (!rows.empty()) {
      attend_rows<C>(o, qd, cache, rows, tables, max_blocks, H, D, sc, split_min_tokens);
    }
#ifdef EMBER_SIMD
    if (!chunk_list.empty()) {
      attend_chunks<C>(o, qd, cache, chunk_list, tables, max_blocks, H, D, sc, causal,
                       sliding_window);
    }
#endif
  };
  switch (cache.scalar_type()) {
    case at::kFloat: attend(float{}); break;
    case at::kBFloat16: attend(c10::BFloat16{}); break;
    default: attend(int8_t{}); break;
  }
  return flags;
}

// The shortest part of a decode's context that the flash-decoding split makes: two blocks of
// 16, so a batch-1 decode over llama-160m's 140-token W-LAT context already gives two threads
// four parts (the value itself was not tuned against others).
constexpr int64_t kSplitMinTokens = 32;

// `ember::paged_attention` (the torch backend's op, contract in ember.attention.ops) with the
// common case in C++: a decode step runs no Python at all (the Python op's own wrapper cost
// ~10 us per layer). What `attend_step` leaves (prefill chunks, split decodes) and
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

}  // namespace
