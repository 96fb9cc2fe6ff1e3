"""Flat calls (`ember.compile.flat_call`): an `aot_compile`d graph called without Dynamo's
pre-graph bytecode gives what the graph gives, sees in-place changes to what the forward closes
over, replays the bytecode's side effects, and is refused where the bytecode does anything a
flat call would not repeat. The graphs here use Dynamo's eager backend (no inductor compile)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.compile.flat_call import flat_call


@dataclass
class _Meta:
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    steps: int = 0


class _State:
    calls = 0


_STATE = _State()
_LOG: list[int] = []


def _aot(forward, *args):
    graph = torch.compile(forward, fullgraph=True, backend="eager").aot_compile((args, {}))
    graph.disable_guard_check()
    return graph


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.SiLU(), torch.nn.Linear(5, 3))
    model.register_buffer("scale", torch.tensor(0.5))
    return model


def _step(num_tokens: int, num_seqs: int) -> tuple:
    x = torch.randn(num_tokens, 6)
    meta = _Meta(torch.arange(1, num_seqs + 1), torch.arange(num_seqs * 4).view(num_seqs, 4))
    return x, meta, [torch.zeros(16, 1), torch.zeros(16, 1)]


def test_flat_call_matches_the_graph_across_sizes_and_in_place_updates():
    model = _model()

    def forward(x, meta, caches):
        # An in-place cache write, sizes of dynamic dims, a nested argument, the closure.
        caches[1][: x.shape[0]] = x.sum(-1, keepdim=True)
        y = model(x) * model.scale + meta.seq_lens.sum() + meta.block_tables.shape[1]
        return y, caches[1].sum()

    x, meta, caches = _step(4, 2)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(meta.seq_lens, 0)
    torch._dynamo.mark_dynamic(meta.block_tables, 0)
    graph = _aot(forward, x, meta, caches)
    call = flat_call(graph)
    assert call is not None and call.__wrapped__ is graph
    for num_tokens, num_seqs in ((4, 2), (9, 3), (1, 1)):
        x, meta, caches = _step(num_tokens, num_seqs)
        other = [c.clone() for c in caches]
        want = graph(x, meta, other)
        got = call(x, meta, caches)
        assert isinstance(got, tuple) and len(got) == 2
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(caches, other, rtol=0, atol=0)
        torch.testing.assert_close(got[0], forward(x, meta, [c.clone() for c in caches])[0])
    with torch.no_grad():  # weights written in place are read by the next call
        model[0].weight.mul_(2)
        model.scale.fill_(3.0)
    x, meta, caches = _step(5, 2)
    torch.testing.assert_close(call(x, meta, caches), graph(x, meta, caches), rtol=0, atol=0)
    torch.testing.assert_close(call(x, meta, caches)[0], forward(x, meta, caches)[0])


def test_flat_call_replays_side_effects_on_what_the_forward_reads():
    def forward(x, meta):
        _STATE.calls = 7
        return x.sum(-1) * 2 + meta.seq_lens

    x, meta, _ = _step(3, 3)
    call = flat_call(_aot(forward, x, meta))
    assert call is not None
    _STATE.calls = 0
    torch.testing.assert_close(call(x, meta), x.sum(-1) * 2 + meta.seq_lens)
    assert _STATE.calls == 7


def test_flat_call_is_refused_where_the_bytecode_does_more_than_read():
    def sets_an_argument(x, meta):
        meta.steps = 3
        return x * 2

    def mutates_a_global(x, meta):
        _LOG.append(1)
        return x * 2

    def returns_an_argument(x, meta):
        return x * 2, meta.seq_lens

    x, meta, _ = _step(3, 3)
    for forward in (sets_an_argument, mutates_a_global, returns_an_argument):
        graph = _aot(forward, x, meta)
        assert flat_call(graph) is None, forward.__name__
        graph(x, meta)  # the graph itself still runs
    assert flat_call(lambda x: x) is None  # not an aot_compile'd graph (a frozen one)


def test_flat_call_leaves_a_running_profiler_alone():
    """The symbolic run installs no hook of its own: a cProfile session around an engine's
    start keeps running, and the graph is still called flat."""
    import cProfile
    import sys

    x, meta, _ = _step(3, 3)
    graph = _aot(lambda x, meta: x.sum(-1) + meta.seq_lens, x, meta)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        call = flat_call(graph)
        running = sys.getprofile()
    finally:
        profiler.disable()
    assert running is profiler
    assert call is not None
    torch.testing.assert_close(call(x, meta), x.sum(-1) + meta.seq_lens)
