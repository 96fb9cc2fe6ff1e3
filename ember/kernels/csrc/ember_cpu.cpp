// ember's C++ CPU kernels, registered as `torch.ops.ember_cpu.*` (see ember/kernels/__init__.py).
// Built once per machine (ember/kernels/__init__.py runs the compiler) with -O3 -march=native.
// One translation unit (one build, one registration list below); the kernels live in one file
// per family, included in order: vec.h (shared SIMD helpers), linear_dense.h (dense and packed
// linears), linear_group.h (group-quantized linears), moe.h (their mixtures of experts),
// attention.h (paged attention), logits.h,
// packing.h (weights into panels), fast_calls.h (Python fast calls).
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
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
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
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec.h"
#include "linear_dense.h"
#include "linear_group.h"
#include "moe.h"
#include "attention.h"
#include "logits.h"
#include "packing.h"

TORCH_LIBRARY(ember_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
      "float scale, int sliding_window, float softcap, bool causal) -> Tensor");
  // The same kernel with the cache's write left out of the schema, for compiled regions
  // (`ember.compile.regions`): a region's subgraph cannot hold a mutating custom op in
  // torch 2.13. vLLM's attention op hides its cache the same way (it reads it from a context).
  m.def(
      "paged_attention_opaque(Tensor query, Tensor key, Tensor value, Tensor kv_cache, "
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
      "moe_experts(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_codes, "
      "Tensor gate_scales, Tensor? gate_mins, int gate_rows, int gate_bits, Tensor? up_codes, "
      "Tensor? up_scales, Tensor? up_mins, int up_rows, int up_bits, Tensor down_codes, "
      "Tensor down_scales, Tensor? down_mins, int down_rows, int down_bits, str activation) "
      "-> Tensor");
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
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_opaque", &paged_attention);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("row_max", &row_max);
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("group_linear", &group_linear);
  m.impl("moe_experts", &moe_experts);
  m.impl("group_pack_codes", &group_pack_codes);
  m.impl("group_pack_blocks", &group_pack_blocks);
}

#include "fast_calls.h"
