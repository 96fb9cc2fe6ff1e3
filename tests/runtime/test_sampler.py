"""Sampler: masks, penalties vs naive references, seeded reproducibility across batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.runtime.batch import ScheduledRequest
from ember.runtime.request import SamplingParams
from ember.runtime.sampler import apply_min_p, apply_penalties, apply_top_k_top_p, sample
from tests.runtime.test_speculative import chisquare_pvalue


def _sched(
    rid: str, params: SamplingParams, seed: int, prompt=(1, 2), output=()
) -> ScheduledRequest:
    return ScheduledRequest(
        rid,
        0,
        (1,),
        (1,),
        True,
        params,
        torch.Generator().manual_seed(seed),
        tuple(prompt),
        tuple(output),
    )


def ref_top_k_top_p(row: torch.Tensor, k: int, p: float) -> set[int]:
    """Naive: the surviving token set of one row."""
    order = sorted(range(len(row)), key=lambda i: -float(row[i]))
    keep = order[:k]
    probs = torch.softmax(row[keep], dim=0).tolist()
    out, total = [], 0.0
    for idx, pr in zip(keep, probs):
        out.append(idx)
        total += pr
        if total >= p:
            break
    return set(out)


@pytest.mark.parametrize("k,p", [(1, 1.0), (5, 1.0), (50, 0.5), (3, 0.9), (64, 0.2), (10, 0.999)])
def test_sampler_top_k_top_p_mask_matches_naive(k, p):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(k))
    out = apply_top_k_top_p(logits, torch.full((4,), k), torch.full((4,), p))
    for r in range(4):
        kept = set(torch.nonzero(out[r] > float("-inf")).flatten().tolist())
        assert kept == ref_top_k_top_p(logits[r], k, p)
        torch.testing.assert_close(out[r][list(kept)], logits[r][list(kept)])


@pytest.mark.parametrize("scale", [0.3, 3.0, 10.0])
def test_sampler_top_k_top_p_from_candidates_matches_naive(scale):
    """Rows wider than the candidates `apply_top_k_top_p` takes first: cut from them where the
    kept set lies within them, sorted where not (top_k just past them, flat rows), mixed in
    one batch."""
    g = torch.Generator().manual_seed(int(scale * 10))
    vocab = 3000
    ks = [1, 40, 256, 257, 1000, vocab, vocab, vocab]
    ps = [0.9, 0.5, 0.95, 0.1, 0.9, 0.9, 0.999, 0.3]
    logits = torch.randn(len(ks), vocab, generator=g) * scale
    out = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for r, (k, p) in enumerate(zip(ks, ps, strict=True)):
        kept = set(torch.nonzero(out[r] > float("-inf")).flatten().tolist())
        assert kept == ref_top_k_top_p(logits[r], k, p), (r, k, p)
        torch.testing.assert_close(out[r][list(kept)], logits[r][list(kept)])


def test_sampler_min_p_mask():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    out = apply_min_p(logits, torch.tensor([0.15]))
    assert (out[0] > float("-inf")).tolist() == [True, True, True, False, False]


def test_sampler_penalties_match_naive():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 10, generator=g)
    prompts = [(1, 2, 2), (9,)]
    outputs = [(2, 3, 3, 3), ()]
    pres, freq, rep = [0.5, -0.3], [0.25, 1.0], [1.3, 0.8]
    got = apply_penalties(
        logits, prompts, outputs, torch.tensor(pres), torch.tensor(freq), torch.tensor(rep)
    )
    want = logits.clone()
    for i in range(2):
        for t in range(10):
            x = float(want[i, t])
            if t in prompts[i] or t in outputs[i]:
                x = x / rep[i] if x > 0 else x * rep[i]
            c = outputs[i].count(t)
            x -= freq[i] * c + (pres[i] if c else 0.0)
            want[i, t] = x
    torch.testing.assert_close(got, want)


def test_sampler_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    reqs = [_sched(str(i), SamplingParams(temperature=0.0, logprobs=3), i) for i in range(3)]
    tokens, lps = sample(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(tokens):
        entry = lps[str(i)]
        assert entry.token_ids[0] == t and entry.ranks[0] == 1
        assert entry.token_ids[1:] == tuple(ref[i].topk(3).indices.tolist())
        assert entry.logprobs[0] == pytest.approx(float(ref[i, t]), abs=1e-6)


def test_sampler_seeded_reproducible_across_batch_compositions():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 100, generator=g)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11)
    target_row = logits[2:3]

    def draw(rows: torch.Tensor, position: int, seqs: int) -> list[int]:
        reqs = [
            _sched(str(i), params if i == position else SamplingParams(temperature=1.0), 100 + i)
            for i in range(seqs)
        ]
        reqs[position] = _sched("t", params, 11)
        tokens = []
        gen = reqs[position].generator
        for _ in range(20):
            reqs[position] = ScheduledRequest("t", 0, (1,), (1,), True, params, gen, (1,), ())
            tokens.append(sample(rows, reqs)[0][position])
        return tokens

    alone = draw(target_row, 0, 1)
    batch = logits.clone()
    batch[4] = target_row[0]
    in_batch = draw(batch, 4, 5)
    assert alone == in_batch
    assert len(set(alone)) > 1, "sampling should not be degenerate"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampler_distribution_follows_temperature(temperature):
    """Draws at temperature T follow softmax(logits / T): Pearson's chi-square against it over
    6,000 seeded draws (p > 1e-3); at T != 1 the same draws reject softmax(logits), so a
    sampler that ignored T (or multiplied by it) would fail here."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    trials = 6000
    gen = torch.Generator().manual_seed(int(temperature * 10))
    params = SamplingParams(temperature=temperature)
    reqs = [ScheduledRequest("a", 0, (1,), (1,), True, params, gen, (1,), ())] * trials
    tokens, _ = sample(logits[None].expand(trials, -1), reqs)
    counts = np.bincount(tokens, minlength=len(logits))
    expected = torch.softmax(logits / temperature, 0).numpy() * trials
    assert chisquare_pvalue(counts, expected) > 1e-3, (counts, expected)
    if temperature != 1.0:
        at_one = torch.softmax(logits, 0).numpy() * trials
        assert chisquare_pvalue(counts, at_one) < 1e-6, (counts, at_one)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_sampling_params_invalid_values_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_non_finite_rows_finds_nan_and_inf_but_allows_masked_tokens():
    from ember.runtime.sampler import non_finite_rows

    inf = float("inf")
    logits = torch.tensor(
        [
            [1.0, 2.0, 3.0],
            [1.0, float("nan"), 3.0],
            [1.0, inf, 0.0],
            [-inf, -inf, -inf],
            [-inf, 2.0, -inf],
        ]
    )
    assert non_finite_rows(logits) == [1, 2, 3]
    assert non_finite_rows(logits.bfloat16()) == [1, 2, 3]


def test_draw_follows_the_distribution_and_never_draws_zero_probability():
    from ember.runtime.sampler import _draw
    from tests.runtime.test_speculative import chisquare_pvalue

    probs = torch.tensor([0.0, 0.45, 0.0, 0.3, 0.15, 0.1, 0.0]) * 3.0  # any positive total
    g = torch.Generator().manual_seed(5)
    counts = torch.bincount(
        torch.tensor([_draw(probs, g) for _ in range(6000)]), minlength=len(probs)
    ).double()
    assert counts[probs == 0].sum() == 0
    nz = probs > 0
    expected = (probs[nz] / probs.sum() * 6000).numpy()
    assert chisquare_pvalue(counts[nz].numpy(), expected) > 1e-3
