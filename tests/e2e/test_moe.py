"""Mixture-of-experts models with their experts kept quantized (`ember.model.layers.experts`):
the `ember_cpu::moe_experts` op against per-token oracles, MoE GGUF files (Qwen3-MoE, Qwen2-MoE with
its shared expert) against HF on the file's own values, `quantization="int8"` / "int4" on an
HF MoE checkpoint, and one compiled engine."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from ember import LLM, SamplingParams, kernels
from ember.model.gguf.convert import _row_chunks
from ember.model.layers.experts import (
    ACTIVATIONS,
    QuantizedExperts,
    StackedPanels,
    _quantized,
    moe_experts_ref,
)
from ember.model.layers.group import GroupLinear
from ember.tools.bench import teacher_forced_ranks
from ember.tools.checkpoints import build_checkpoint
from ember.tools.gguf_writer import write_gguf
from tests.conftest import group_quantized_x, make_prompts

KW = dict(kv_cache_gib=0.01, max_model_len=96, use_tqdm=False)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _expert_linears(stack: StackedPanels) -> list[GroupLinear]:
    return [stack.linear(e) for e in range(stack.num_experts)]


def _slot_sum(x, index, weights, num_experts: int, expert_out) -> torch.Tensor:
    """Token by token, slot by slot in fp64: sum of weights[t, slot] * expert_out(e, x[t:t+1])
    (a [1, H] row) for e = index[t, slot]; ids outside [0, E) add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[t, slot])
            if 0 <= e < num_experts:
                out[t] += weights[t, slot].double() * expert_out(e, x[t : t + 1])[0].double()
    return out


def _oracle(x, index, weights, experts: QuantizedExperts) -> torch.Tensor:
    """Each routed expert as its own `GroupLinear`s (views of the stacked panels), summed in
    slot order (`_slot_sum`). One row at a time takes the kernels' GEMV path where the op's
    rows per expert may take the GEMM one, and the hidden activation is re-quantized from
    either's fp32 sums: agreement to 1e-4 of the output's scale, not bits."""
    gate, down = _expert_linears(experts.gate), _expert_linears(experts.down)
    up = None if experts.up is None else _expert_linears(experts.up)
    act = ACTIVATIONS[experts.activation]

    def expert_out(e: int, xt: torch.Tensor) -> torch.Tensor:
        h = gate[e](xt)
        g, u = h.chunk(2, dim=-1) if up is None else (h, up[e](xt))
        return down[e](act(g) * u)

    return _slot_sum(x, index, weights, experts.num_experts, expert_out)


def _dequantized_reference(x, index, weights, experts: QuantizedExperts) -> torch.Tensor:
    """The same sum on the experts' dequantized weights with x and the hidden activation
    quantized as the kernels quantize them (int8 per group of 32), in fp64."""
    rows = lambda s, e: s.linear(e).rows(torch.arange(s.out_features)).double()  # noqa: E731
    act = ACTIVATIONS[experts.activation]

    def expert_out(e: int, xt: torch.Tensor) -> torch.Tensor:
        xq = group_quantized_x(xt).double()
        h = xq @ rows(experts.gate, e).t()
        g, u = h.chunk(2, dim=-1) if experts.up is None else (h, xq @ rows(experts.up, e).t())
        mid = group_quantized_x(act(g.float()) * u.float()).double()
        return mid @ rows(experts.down, e).t()

    return _slot_sum(x, index, weights, experts.num_experts, expert_out)


def _stacked_args(experts: QuantizedExperts) -> tuple:
    """`ember_cpu::moe_experts`'s arguments after (x, index, weights) for `experts`."""
    gate, up, down = experts.gate, experts.up, experts.down
    up_args = (None, None, None, 0, 0) if up is None else (
        up.codes, up.scales, up.mins, up.out_features, up.bits
    )  # fmt: skip
    return (
        gate.codes, gate.scales, gate.mins, gate.out_features, gate.bits, *up_args,
        down.codes, down.scales, down.mins, down.out_features, down.bits, experts.activation,
    )  # fmt: skip


def _routing(tokens: int, num_experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return index, weights


@pytest.mark.parametrize("bits", [8, 4])
def test_the_op_sums_each_tokens_experts_as_the_per_token_oracle(bits):
    """Group-quantized experts (8-bit symmetric, 4-bit with offsets) from random weights:
    one expert no token picks, one picked by every token, sentinel ids (expert parallelism's
    -1 and E) that add nothing; against the per-token oracle on the same panels and the
    fp64 sum on the dequantized weights."""
    kernels.load()
    num_experts, hidden, inter, k, tokens = 6, 64, 96, 3, 9
    g = torch.Generator().manual_seed(bits)
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(
        torch.randn(num_experts, 2 * inter, hidden, generator=g)
    )
    module.down_proj = torch.nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g))
    experts = _quantized(module, "silu", bits)
    x = torch.randn(tokens, hidden, generator=g)
    index, weights = _routing(tokens, num_experts - 1, k, seed=1)  # expert 5: never picked
    index[:, 0] = 2  # every token's first slot
    index[0, 1], index[3, 2] = -1, num_experts  # sentinels
    got = experts(x, index, weights)
    oracle = _oracle(x, index, weights, experts)
    assert got.dtype == x.dtype and got.shape == x.shape
    # the C++ op is the Python reference's sort, calls and sums: equal to the bit
    assert torch.equal(got, moe_experts_ref(x, index, weights, *_stacked_args(experts)))
    torch.testing.assert_close(
        got.double(), oracle, rtol=1e-4, atol=1e-4 * oracle.abs().max().item()
    )
    reference = _dequantized_reference(x, index, weights, experts)
    # The hidden activation is re-quantized from the kernel's fp32 sums: a rounding flip moves
    # a product by one step of that group, so compare the whole output's relative error.
    assert ((got.double() - reference).norm() / reference.norm()).item() < 1e-3
    torch.library.opcheck(
        torch.ops.ember_cpu.moe_experts.default,
        (x, index, weights, experts.gate.codes, experts.gate.scales, experts.gate.mins,
         2 * inter, bits, None, None, None, 0, 0, experts.down.codes, experts.down.scales,
         experts.down.mins, hidden, bits, "silu"),
    )  # fmt: skip


def _random_k_blocks(qtype: str, rows: int, k: int, rng) -> np.ndarray:
    """Random bytes in a K-quant's block layout with small finite fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (rows, k // block_size, type_size), dtype=np.uint8)
    for at in {"Q4_K": [0, 2], "Q6_K": [type_size - 2]}[qtype]:
        blocks[..., at : at + 2] = np.float16(0.01).reshape(1).view(np.uint8)
    return blocks.reshape(rows, -1)


def test_k_quant_experts_from_file_blocks_gate_and_up_apart():
    """A Q4_K_M file's experts: gate and up Q4_K (here of different types' panels: gate
    Q4_K, up Q6_K, so they stay two calls), down Q6_K, packed from random file blocks as a
    load packs them: the op against the per-token oracle, and the stacked panels' values are
    the `gguf` package's dequantized ones."""
    kernels.load()
    num_experts, hidden, inter = 4, 256, 256
    rng = np.random.default_rng(0)
    raws = {
        "gate": np.stack(
            [_random_k_blocks("Q4_K", inter, hidden, rng) for _ in range(num_experts)]
        ),
        "up": np.stack([_random_k_blocks("Q6_K", inter, hidden, rng) for _ in range(num_experts)]),
        "down": np.stack(
            [_random_k_blocks("Q6_K", hidden, inter, rng) for _ in range(num_experts)]
        ),
    }
    types = {"gate": "Q4_K", "up": "Q6_K", "down": "Q6_K"}
    stacks = {}
    for name, raw in raws.items():
        qtype = gguf.GGMLQuantizationType[types[name]]
        bits, offsets = (4, True) if types[name] == "Q4_K" else (6, False)
        rows = raw.shape[1]
        stack = StackedPanels(
            num_experts, rows, hidden if name != "down" else inter, bits, offsets, True
        )
        for e in range(num_experts):
            stack.fill(e, _row_chunks(raw[e], qtype, None))
            values = torch.from_numpy(gguf.quants.dequantize(raw[e], qtype))
            assert torch.equal(stack.linear(e).rows(torch.arange(rows)), values), (name, e)
        stacks[name] = stack
    experts = QuantizedExperts(num_experts, "silu", stacks["gate"], stacks["up"], stacks["down"])
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(3))
    index, weights = _routing(5, num_experts, 2, seed=4)
    got = experts(x, index, weights)
    oracle = _oracle(x, index, weights, experts)
    assert torch.equal(got, moe_experts_ref(x, index, weights, *_stacked_args(experts)))
    torch.testing.assert_close(
        got.double(), oracle, rtol=1e-4, atol=1e-4 * oracle.abs().max().item()
    )


def _file_values_hf(source: str, path: str) -> torch.nn.Module:
    """HF's model of the checkpoint `path` was written from, every weight replaced by the
    file's own values (the `gguf` package's dequantization; experts' gate and up side by
    side, as HF holds them): transformers 5.23 cannot load these files itself (it leaves
    `moe_intermediate_size` at its default)."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    reader = gguf.GGUFReader(path)
    values = {
        t.name: torch.from_numpy(
            np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        )
        for t in reader.tensors
    }
    params = dict(model.named_parameters())
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            experts = f"model.layers.{i}.mlp.experts."
            gate, up = (
                values.pop(f"blk.{i}.ffn_gate_exps.weight"),
                values.pop(f"blk.{i}.ffn_up_exps.weight"),
            )
            params[experts + "gate_up_proj"].copy_(torch.cat([gate, up], dim=1))
            params[experts + "down_proj"].copy_(values.pop(f"blk.{i}.ffn_down_exps.weight"))
        names = gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.QWEN3MOE if "qwen3" in path else gguf.MODEL_ARCH.QWEN2MOE,
            model.config.num_hidden_layers,
        )
        for hf_name, param in params.items():
            base, _, suffix = hf_name.rpartition(".")
            name = names.get_name(base)
            if name is None or f"{name}.{suffix}" not in values:
                continue
            param.copy_(values.pop(f"{name}.{suffix}").reshape(param.shape))
    assert not values, sorted(values)  # every tensor of the file placed
    return model.eval()


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    """`moe_file(shape, qtype, **types)` -> (GGUF path, the HF checkpoint it was written from)."""
    root = tmp_path_factory.mktemp("moe")
    made: dict[str, tuple[str, str]] = {}

    def make(shape: str, qtype: str, types: dict[str, str] | None = None) -> tuple[str, str]:
        key = f"{shape}-{qtype}-" + "-".join(f"{k}{v}" for k, v in sorted((types or {}).items()))
        if key not in made:
            # initializer_range 0.3: peaked logits, so agreement is a real constraint.
            source = build_checkpoint(str(root / f"{shape}-hf"), shape, initializer_range=0.3)
            made[key] = write_gguf(source, str(root / f"{key}.gguf"), qtype, types), source
        return made[key]

    return make


@pytest.mark.parametrize(
    "shape, qtype",
    [
        ("tiny-qwen3-moe", "F32"), ("tiny-qwen3-moe", "Q8_0"), ("tiny-qwen3-moe", "Q4_1"),
        ("tiny-qwen2-moe", "F32"), ("tiny-qwen2-moe", "Q4_0"),
    ],
)  # fmt: skip
def test_a_moe_gguf_file_decodes_what_hf_does_on_its_values(moe_file, shape, qtype):
    """A float file keeps HF's experts module (its values as they are: token-identical to HF
    on the checkpoint); a quantized one runs `QuantizedExperts` over the file's blocks (gate
    and up in one call) beside the quantized linears, against HF on the file's dequantized
    values under teacher forcing."""
    path, source = moe_file(shape, qtype)
    prompts = make_prompts(3, seed=12, low=4, high=20)
    with LLM(model=path, compile=False, **KW) as llm:
        model = llm.llm_engine.runner.model
        experts = model.model.layers[0].mlp.experts
        if qtype == "F32":
            assert type(experts).__name__.endswith("MoeExperts")
        else:
            assert isinstance(experts, QuantizedExperts) and experts.up is None
            assert experts.gate.bits == experts.down.bits == (8 if qtype == "Q8_0" else 4)
            assert (experts.gate.mins is not None) == (qtype == "Q4_1")
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        pool = llm.llm_engine.block_manager
        assert pool.num_free_blocks == pool.num_blocks - 1
    hf = _file_values_hf(source, path)
    if qtype == "F32":
        hf.generation_config.eos_token_id = None
        for p, got in zip(prompts, outs, strict=True):
            ids = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=GREEDY.max_tokens,
                              min_new_tokens=GREEDY.max_tokens, pad_token_id=0)  # fmt: skip
            assert got == ids[0, len(p) :].tolist()
        return
    ranks = [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]
    # int8-quantized activations, as llama.cpp's: HF's top 5 at every step, mostly its argmax.
    assert max(ranks) < 5, ranks
    assert sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


def test_experts_of_two_types_run_gate_and_up_apart(moe_file):
    """llama.cpp's mixes can give a layer's up experts more bits than its gate: the two stay
    separate stacks (two calls), against HF on the file's values."""
    path, source = moe_file("tiny-qwen3-moe", "Q4_0", {"blk.1.ffn_up_exps.weight": "Q8_0"})
    prompts = make_prompts(2, seed=13, low=4, high=16)
    with LLM(model=path, compile=False, **KW) as llm:
        layers = llm.llm_engine.runner.model.model.layers
        assert layers[0].mlp.experts.up is None
        apart = layers[1].mlp.experts
        assert apart.gate.bits == 4 and apart.up.bits == 8 and apart.down.bits == 4
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    hf = _file_values_hf(source, path)
    ranks = [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]
    assert max(ranks) < 5 and sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


def _naive_int4(w: torch.Tensor) -> torch.Tensor:
    """Asymmetric 4-bit groups of 32 written out, dequantized (as tests/e2e/test_gguf.py's,
    over all rows at once): per group d = (max - min) / 15 and m = min, both rounded to fp16,
    codes round((w - m) / d) in [0, 15]."""
    groups = w.detach().float().unflatten(-1, (-1, 32))
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    q = torch.where(d > 0, torch.round((groups - m) / d).clamp(0, 15), 0)
    return (q * d + m).flatten(-2)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_reaches_an_hf_moe_checkpoints_experts(moe_file, quantization):
    """`quantization="int8"` / "int4" on an HF checkpoint quantizes the experts too (8-bit
    groups, 4-bit groups with offsets), not only the `nn.Linear`s. int8: within HF fp32's top
    5; int4 (too coarse for that on random weights): HF on a copy whose linears and experts
    hold the naive quantizer's values."""
    _, source = moe_file("tiny-qwen3-moe", "F32")
    prompts = make_prompts(3, seed=14, low=4, high=20)
    with LLM(model=source, dtype="float32", quantization=quantization, compile=False, **KW) as llm:
        experts = llm.llm_engine.runner.model.model.layers[0].mlp.experts
        assert isinstance(experts, QuantizedExperts)
        assert experts.gate.bits == (8 if quantization == "int8" else 4)
        assert (experts.gate.mins is not None) == (quantization == "int4")
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if quantization == "int4":
        with torch.no_grad():
            for module in hf.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(_naive_int4(module.weight))
                if type(module).__name__ == "Qwen3MoeExperts":
                    for w in (module.gate_up_proj, module.down_proj):
                        w.copy_(_naive_int4(w))
    ranks = [r for p, g in zip(prompts, outs, strict=True) for r in teacher_forced_ranks(hf, p, g)]
    # Top-k routing is a step function: where int8-quantized activations flip a near-tied
    # expert, that layer's output moves by a whole expert's share (seen: int4, one step of
    # 36 at rank 5, 31 argmax), so the bound is the top 10, with the argmax share as strict.
    assert max(ranks) < 10, ranks
    assert sum(r == 0 for r in ranks) >= 0.75 * len(ranks), ranks


def test_a_compiled_moe_gguf_engine_matches_eager_without_recompiles(moe_file):
    """One compiled MoE engine: each layer's experts one `ember_cpu::moe_experts` node (no graph
    break for the data-dependent routing), mixed prefill/decode batches with chunked prefill,
    no recompiles after warm-up, the eager engine's tokens."""
    path, _ = moe_file("tiny-qwen2-moe", "Q8_0")
    prompts = make_prompts(4, seed=15, low=3, high=30)
    with LLM(model=path, compile=False, **KW) as eager:
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    graphs_before = counters["stats"]["unique_graphs"]
    breaks_before = sum(counters["graph_break"].values())
    with LLM(model=path, max_num_batched_tokens=16, **KW) as llm:
        runner = llm.llm_engine.runner
        compiled = runner.graphs_compiled
        assert counters["stats"]["unique_graphs"] - graphs_before == 1  # one trace, no breaks
        assert sum(counters["graph_break"].values()) == breaks_before
        with torch.compiler.set_stance("fail_on_recompile"):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert runner.graphs_compiled == compiled
        one = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        with torch.profiler.profile() as prof:  # a prefill step and a decode step
            llm.generate([prompts[0]], one, use_tqdm=False)
        calls = [e for e in prof.events() if e.name == "ember_cpu::moe_experts"]
        assert len(calls) == 2 * runner.model.config.num_hidden_layers
    assert got == want


@pytest.mark.parametrize("qtype", ["F32", "Q4_0", "tied-Q8_0"])
def test_the_decode_roofline_counts_the_routed_experts_only(tmp_path, qtype):
    """`ember bench`'s batch-1 bytes a token: of each layer's 8 experts a token reads its 2
    (the router's [E, H] weight whole), not all 8: counted here by the state dict's names.
    A table tied to the head is read whole (as the head), so it is not taken off."""
    from ember.tools.bench import decode_bytes_per_token

    tied = qtype.startswith("tied-")
    source = build_checkpoint(
        str(tmp_path / "hf"), "tiny-qwen3-moe", initializer_range=0.3, tie_word_embeddings=tied
    )
    path = write_gguf(source, str(tmp_path / "m.gguf"), qtype.removeprefix("tied-"))
    with LLM(model=path, compile=False, **KW) as llm:
        model = llm.llm_engine.runner.model
        unique = {t.data_ptr(): (name, t) for name, t in model.state_dict().items()}
        size = {name: t.numel() * t.element_size() for name, t in unique.values()}
        experts = sum(n for name, n in size.items() if ".mlp.experts." in name)
        table = 0 if tied else sum(n for name, n in size.items() if "embed_tokens" in name)
        assert experts and (table or tied)
        assert decode_bytes_per_token(model) == sum(size.values()) - table - experts * 6 // 8


def _moe_families() -> list[str]:
    """The exact architectures (`architectures.EXACT`) whose tiny zoo model has an experts
    module `QuantizedExperts` runs (transformers' default experts layout)."""
    from ember.model import architectures
    from ember.model.layers.experts import hf_experts_modules
    from tests.architectures import zoo

    found = []
    for model_type in sorted(architectures.EXACT & set(zoo.causal_model_types())):
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(zoo.tiny_config(model_type))
        except Exception:  # noqa: BLE001  (configs the zoo builds differently: not MoE ones)
            continue
        if any(True for _ in hf_experts_modules(model)):
            found.append(model_type)
    return found


# What `_moe_families()` finds in transformers 5.23 (checked below; a scan at collection would
# build ~90 meta models in every pytest process).
MOE_FAMILIES = [
    "afmoe", "cohere2_moe", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
    "glm4_moe", "granitemoe", "granitemoe_swa", "granitemoeshared", "hunyuan_v1_moe", "hy_v3",
    "kolibri1", "laguna", "mellum", "mimo_v2_flash", "minimax_m2", "mixtral", "olmoe", "phimoe",
    "qwen2_moe", "qwen3_moe", "solar_open",
]  # fmt: skip


@pytest.mark.one_host("a scan of transformers' configs")
def test_the_moe_families_are_what_a_scan_finds():
    """Every exact architecture whose experts `QuantizedExperts` runs is in `MOE_FAMILIES`;
    gpt-oss (biases, interleaved gate/up, clamped SwiGLU) and Llama 4 (transposed experts)
    are not: they keep HF's own experts code."""
    assert _moe_families() == MOE_FAMILIES
    assert "gpt_oss" not in MOE_FAMILIES and "llama4_text" not in MOE_FAMILIES


@pytest.mark.one_host("each family's layout and activation; the op's ISA paths are tested above")
@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_each_moe_familys_experts_quantize_into_the_op(model_type, tmp_path):
    """Every MoE family's experts module (tiny random model), replaced by 8-bit
    `QuantizedExperts`, against HF's own module holding the dequantized weights, on routed
    random tokens: the same gate/up order and activation (a mix-up gives O(1) errors; int8
    activations give about 0.5%)."""
    from ember.model.layers.experts import hf_experts_modules
    from tests.architectures import zoo

    kernels.load()
    model = AutoModelForCausalLM.from_pretrained(zoo.build(model_type, str(tmp_path / "m")))
    name, module, act = next(iter(hf_experts_modules(model)))
    experts = _quantized(module, act, 8)
    with torch.no_grad():
        for stack, param in ((experts.gate, module.gate_up_proj), (experts.down, module.down_proj)):
            rows = torch.arange(stack.out_features)
            param.copy_(torch.stack([stack.linear(e).rows(rows) for e in range(stack.num_experts)]))
    num = experts.num_experts
    k = min(2, num)
    x = torch.randn(7, module.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(5))
    index, weights = _routing(7, num, k, seed=6)
    with torch.no_grad():
        want = module(x, index, weights)
    got = experts(x, index, weights)
    error = ((got - want).norm() / want.norm()).item()
    assert error < 2e-2, (model_type, name, error)
