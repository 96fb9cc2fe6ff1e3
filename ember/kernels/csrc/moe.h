// Mixture-of-experts layers over group-quantized experts (ember/model/layers/experts.py):
// each projection's experts stacked as [E, ...] `group_linear` panels.
namespace {

at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t e, int64_t rows,
                         int64_t bits) {
  std::optional<at::Tensor> m;
  if (mins.has_value() && mins->defined()) m = mins->select(0, e);
  return group_linear(x, codes.select(0, e), scales.select(0, e), m, std::nullopt, rows, bits);
}

// y [T, H] = sum over k of w[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = index[t, k]; ids
// outside [0, E) add nothing (expert parallelism's sentinels). Without `up_codes` the gate's
// panels hold gate and up side by side (gate_rows = 2 I). The tokens are sorted by expert
// (a counting sort, stable), each expert a step routed rows to runs its rows as one
// `group_linear` call per projection, and the weighted outputs are summed in fp32 in expert
// order: what `moe_experts_ref` (experts.py) computes, without a Python call per op.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                       const at::Tensor& gate_codes, const at::Tensor& gate_scales,
                       const std::optional<at::Tensor>& gate_mins, int64_t gate_rows,
                       int64_t gate_bits, const std::optional<at::Tensor>& up_codes,
                       const std::optional<at::Tensor>& up_scales,
                       const std::optional<at::Tensor>& up_mins, int64_t up_rows, int64_t up_bits,
                       const at::Tensor& down_codes, const at::Tensor& down_scales,
                       const std::optional<at::Tensor>& down_mins, int64_t down_rows,
                       int64_t down_bits, c10::string_view activation) {
  TORCH_CHECK(x.dim() == 2, "moe_experts: x must be [tokens, hidden]");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == x.size(0) && weights.sizes() == index.sizes(),
              "moe_experts: top_k_index and top_k_weights must be [tokens, k]");
  const bool act_silu = activation == "silu" || activation == "swish";
  const bool act_gelu = activation == "gelu";
  const bool act_tanh = activation == "gelu_pytorch_tanh";
  TORCH_CHECK(act_silu || act_gelu || act_tanh, "moe_experts: unknown activation ", activation);
  const bool apart = up_codes.has_value() && up_codes->defined();
  TORCH_CHECK(!apart || (up_scales.has_value() && up_scales->defined()),
              "moe_experts: up_codes without up_scales");
  const int64_t E = gate_codes.size(0);
  TORCH_CHECK(down_codes.size(0) == E && (!apart || up_codes->size(0) == E),
              "moe_experts: the projections hold different numbers of experts");
  const int64_t T = index.size(0), k = index.size(1);
  const at::Tensor ids = index.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  // counting sort of the (token, slot) pairs by expert, stable
  std::vector<int64_t> starts(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = idp[i];
    if (e >= 0 && e < E) ++starts[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  const at::Tensor order = at::empty({starts[E]}, at::kLong);
  int64_t* op = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = idp[i];
    if (e >= 0 && e < E) op[next[e]++] = i;
  }
  const at::Tensor token_of = order.div(k, "floor");
  const at::Tensor weight_of = weights.reshape({-1}).index_select(0, order).to(at::kFloat);
  at::Tensor out = at::zeros({T, x.size(1)}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t a = starts[e], count = starts[e + 1] - a;
    if (count == 0) continue;
    const at::Tensor tokens = token_of.narrow(0, a, count);
    const at::Tensor xe = x.index_select(0, tokens);
    at::Tensor h = expert_linear(xe, gate_codes, gate_scales, gate_mins, e, gate_rows, gate_bits);
    at::Tensor g, u;
    if (apart) {
      g = h;
      u = expert_linear(xe, *up_codes, *up_scales, up_mins, e, up_rows, up_bits);
    } else {
      const int64_t half = h.size(-1) / 2;
      g = h.narrow(-1, 0, half);
      u = h.narrow(-1, half, half);
    }
    const at::Tensor a_g = act_silu ? at::silu(g) : at::gelu(g, act_tanh ? "tanh" : "none");
    const at::Tensor y =
        expert_linear(a_g.mul(u), down_codes, down_scales, down_mins, e, down_rows, down_bits);
    out.index_add_(0, tokens, y.to(at::kFloat).mul(weight_of.narrow(0, a, count).unsqueeze(1)));
  }
  return out.to(x.scalar_type());
}

}  // namespace
