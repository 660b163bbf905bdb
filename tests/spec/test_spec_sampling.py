"""Speculative sampling is distributed as plain sampling: chi-square tests of committed tokens against the target's
own distribution, on a tiny vocabulary, seeded.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_sampling.py

Reference: Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1 and Appendix A.1 (the committed token is distributed
as p whatever q is); SGLang's tree_speculative_sampling_target_only (sgl-project/sglang, sgl-kernel
csrc/speculative/speculative_sampling.cuh, read at 0114f9c) implements the same rule on trees.

Threshold: the test fails when the chi-square p-value is below 1e-3. The draws are seeded, so each test is one fixed
sample: with a correct sampler its p-value is uniform on (0, 1) over seeds, and the seed here passes; a 1e-3 cut keeps
the chance that an unlucky seed was picked at 0.1% while the deviations a bug makes are far past it (the mutations in
the report, e.g. accepting every draft, give p-values below 1e-30). Cells with an expected count under 5 are pooled
(the usual validity rule for the chi-square approximation).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from r3trace.engine.spec.verify import accept_sampled
from tests.engine.conftest import EngineFactory


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of observed counts against cell probabilities (same shape)."""
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel().astype(np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(expected) - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)).item()
    return stat, df, p_value


def assert_follows(got: list[dict], want: np.ndarray) -> None:
    """Output tokens 2 and 3 of the results against their joint want [V, V] (p-value > 1e-3), with drafts both
    accepted and rejected (10-90%) so that the residual draws are part of the sample."""
    counts = np.zeros(want.shape)
    for o in got:
        counts[o["output_ids"][1], o["output_ids"][2]] += 1
    stat, df, p_value = chi_square(counts, want)
    assert p_value > 1e-3, f"chi2 = {stat:.1f} on {df} df, p = {p_value:.2e}"
    correct = sum(o["meta_info"]["spec_num_correct_drafts"] for o in got)
    proposed = sum(o["meta_info"]["spec_num_proposed_drafts"] for o in got)
    assert 0.1 < correct / proposed < 0.9, f"{correct} of {proposed} drafts accepted: the test needs both outcomes"


def test_rejection_sampling_commits_the_targets_distribution() -> None:
    """A chain of 2 drafts from a draft model q over V = 6 tokens, verified against a target p (random conditional
    tables, q != p): the first three committed tokens, topped up from p where a verify committed fewer (what the next
    verify does), are distributed as p(y1) p(y2 | y1) p(y3 | y1, y2) over all 216 cells. 60k chains; rows with 0 and
    1 drafts mixed in (a prefill's sample, a short verify)."""
    v, n = 6, 60_000
    gen = torch.Generator().manual_seed(0)

    def table(*shape: int) -> torch.Tensor:  # conditional distributions, rows far from uniform and from each other
        return torch.softmax(2.0 * torch.randn(*shape, v, generator=gen, dtype=torch.float64), dim=-1)

    def draw(probs: torch.Tensor) -> torch.Tensor:  # [M, V] -> [M] one draw per row (inverse CDF)
        u = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64)
        return (probs.cumsum(dim=-1) < u).sum(dim=-1).clamp(max=v - 1)

    p0, p1, p2 = table(), table(v), table(v, v)  # target: p(y1), p(y2 | y1), p(y3 | y1, y2)
    q0, q1 = table(), table(v)  # draft
    x1 = draw(q0.expand(n, v))
    x2 = draw(q1[x1])
    drafts = torch.stack([x1, x2], dim=1)  # [N, 2]
    draft_lens = torch.tensor([2, 1, 0], dtype=torch.int64).repeat(n // 3)  # [N]
    p = torch.stack([p0.expand(n, v), p1[x1], p2[x1, x2]], dim=1).float()  # [N, 3, V] the target at each verify row
    q = torch.stack([q0.expand(n, v), q1[x1]], dim=1).float()  # [N, 2, V]
    u = torch.rand(n, 2, generator=gen)
    race = torch.empty(n, v).exponential_(generator=gen)
    tokens, counts = accept_sampled(p, q, drafts, draft_lens, u, race)
    assert set(counts.tolist()) == {1, 2, 3}

    y = tokens.clone()  # where fewer than 3 were committed, the next steps sample p given the committed ones
    need2 = counts < 2
    y[need2, 1] = draw(p1[y[need2, 0]])
    need3 = counts < 3
    y[need3, 2] = draw(p2[y[need3, 0], y[need3, 1]])
    cells = np.bincount((y[:, 0] * v * v + y[:, 1] * v + y[:, 2]).numpy(), minlength=v**3)
    want = (p0[:, None, None] * p1[:, :, None] * p2).numpy()  # [V, V, V]
    stat, df, p_value = chi_square(cells, want)
    assert p_value > 1e-3, f"chi2 = {stat:.1f} on {df} df, p = {p_value:.2e}"
    accepted_drafts = (counts - 1).sum().item() / draft_lens.sum().item()
    assert 0.2 < accepted_drafts < 0.8, f"acceptance {accepted_drafts:.2f}: the test needs both outcomes"


@pytest.mark.parametrize("temperature", [0.8])
def test_speculative_engine_samples_as_the_plain_engine(make_spec_engine: EngineFactory, tmp_path: Path,
                                                        temperature: float) -> None:
    """Through the engine (draft sampling, stored q, verify, residual, per-request generators): 600 requests of one
    prompt, vocabulary 4, 2 drafts; the joint of output tokens 2 and 3 (committed by the first verify, accepted or
    resampled) against the plain engine's own distribution, read from its top logprobs (every token, temperature
    applied here)."""
    from tests.spec.mtp_checkpoint import make_mtp_checkpoint

    v, n, prompt = 4, 600, [3, 2, 0, 3, 2]
    # noise 2: the draft's q is far enough from p that about a third of the drafts are rejected (0.5 leaves 10%,
    # too few rejections for this sample to see a wrong residual)
    ckpt = make_mtp_checkpoint(tmp_path / "v4", seed=5, vocab_size=v, noise=2.0)
    plain = make_spec_engine(model=ckpt)
    grid = [prompt + [a, b] for a in range(v) for b in range(v)]
    outs = plain.generate(input_ids=grid, sampling_params={"temperature": 0, "max_new_tokens": 1},
                          return_logprob=True, logprob_start_len=len(prompt), top_logprobs_num=v)

    def dist(tops: list[tuple[float, int, None]]) -> np.ndarray:  # raw logprobs -> p under the temperature
        logits = np.zeros(v)
        for lp, tok, _ in tops:
            logits[tok] = lp / temperature
        e = np.exp(logits - logits.max())
        return e / e.sum()

    want = np.zeros((v, v, v))  # p(t1) p(t2 | t1) p(t3 | t1, t2) of the plain engine
    for seq, o in zip(grid, outs, strict=True):
        a, b = seq[-2:]
        m = o["meta_info"]
        want[a, b] = dist(m["input_top_logprobs"][0])[a] * dist(m["input_top_logprobs"][1])[b] \
            * dist(m["output_top_logprobs"][0])
    want = want.sum(axis=0)  # [V, V] the joint of output tokens 2 and 3

    spec = make_spec_engine(model=ckpt, speculative_algorithm="NEXTN", speculative_num_steps=2, seed=11,
                            max_running_requests=256, chunked_prefill_size=2048, kv_pool_tokens=4096)
    sp = [{"temperature": temperature, "max_new_tokens": 4, "ignore_eos": True,
           **({"seed": i} if i % 2 else {})} for i in range(n)]  # half seeded: their own generators
    got = spec.generate(input_ids=[prompt] * n, sampling_params=sp)
    assert_follows(got, want)
