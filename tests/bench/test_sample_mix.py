"""bench/eplb_traces.py's sample-mix family: serving windows cut from the sample model's held-out routes
(samples/heldout_routes.npz, bench/sample_routes.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.eplb_traces import PIECE, SAMPLE_ROUTES, TraceSpec, load_windows, sample_mix_windows

SPEC = TraceSpec(family="sample-mix", num_experts=32, num_groups=4, top_k=4, num_layers=4, windows=20,
                 window_tokens=4096)


def _pool() -> tuple[dict[bytes, int], int]:
    """-> ({a request's route bytes: its domain}, domains) over every PIECE-token request of the pool."""
    z = np.load(SAMPLE_ROUTES)
    ids, domain = z["ids"].astype(np.int16), z["domain"]
    per = ids.shape[1] // PIECE
    pieces = ids[:, : per * PIECE].reshape(len(ids) * per, PIECE, *ids.shape[2:])
    return {p.tobytes(): int(d) for p, d in zip(pieces, np.repeat(domain, per), strict=True)}, int(domain.max()) + 1


def _domains(routes: np.ndarray, pool: dict[bytes, int]) -> np.ndarray:
    """routes [W, T, L, K] -> [W, T / PIECE] each request's domain (KeyError: a request not in the pool)."""
    w, t = routes.shape[:2]
    reqs = routes.reshape(w, t // PIECE, PIECE, *routes.shape[2:])
    return np.array([[pool[r.tobytes()] for r in win] for win in reqs])


def test_windows_are_pool_requests_in_drifting_shares() -> None:
    pool, n_domains = _pool()
    routes, sees_tokens = load_windows(SPEC)
    assert sees_tokens and routes.shape == (20, 4096, 4, 4) and routes.dtype == np.int16
    slow = _domains(routes, pool)  # every request is one of the pool's, whole and in order
    counts = np.stack([np.bincount(d, minlength=n_domains) for d in slow])  # [W, domains]
    assert (counts.sum(1) == 4096 // PIECE).all() and (counts > 0).sum() > 0.9 * counts.size


def _moved(drift: str, pool: dict[bytes, int], n_domains: int) -> int:
    """Requests of the first five windows whose domain share the last five windows lost, over trace seeds 0-2."""
    total = 0
    for seed in range(3):
        d = _domains(sample_mix_windows(replace(SPEC, drift=drift, seed=seed)), pool)
        c = np.stack([np.bincount(x, minlength=n_domains) for x in d])
        total += int(np.abs(c[:5].sum(0) - c[-5:].sum(0)).sum()) // 2
    return total


def test_fast_drift_moves_the_mix_further() -> None:
    # sigma 0.3 a window against 0.05: the shares walk 6x as far, the 160 requests of five windows' ends of the
    # trace 68 apart under slow drift (multinomial noise and the slow walk) and 226 under fast (seeds 0-2)
    pool, n_domains = _pool()
    assert _moved("fast", pool, n_domains) > 2 * _moved("slow", pool, n_domains)

def test_seeded() -> None:
    a = sample_mix_windows(replace(SPEC, windows=3))
    assert np.array_equal(a, sample_mix_windows(replace(SPEC, windows=3)))
    assert not np.array_equal(a, sample_mix_windows(replace(SPEC, windows=3, seed=1)))


@pytest.mark.parametrize("change", [{"num_experts": 64, "num_groups": 8}, {"top_k": 8}, {"window_tokens": 4000}])
def test_shape_mismatch_is_refused(change: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="sample-mix"):
        sample_mix_windows(replace(SPEC, **change))
