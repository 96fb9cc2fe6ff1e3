// Logits helpers: the structured-output token bitmask and row maxima.
// One part of ember_cpu.cpp's translation unit (included there, in order; not built alone).
#pragma once

namespace {

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

}  // namespace
