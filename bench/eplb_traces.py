"""Routed-token windows for the EPLB matrix: synthetic routers with different co-activation structure and drift,
the sample model's traces, and the shape of SGLang's expert-distribution dump.

Synthetic router, per window w, layer l, token t: logits = -s log(1 + rank_l(e)) + drift_{w,l}(e) + bias(t) +
Gumbel noise; with G > 1 groups it keeps the top G/2 groups by the sum of their two best logits (V3's
group-limited routing: 4 of 8) and takes the top K experts inside them. Families differ in bias(t):
- grouped: 4 domains with N(0, 0.5) preferences per (layer, expert); a window's domain mix is Dirichlet(1),
  so each window leans differently (r3trace synth's model, without its token banks);
- clustered: 16 topics, each favouring (+2) a random set of 2K experts across groups; tokens of one topic
  choose together across groups, a structure groups do not reveal;
- independent: no bias: experts co-occur only through popularity and the group limit.
Drift: drift_{w+1} = drift_w + N(0, sigma) per (layer, expert), sigma 0.05 (slow) or 0.3 (fast) logits
per window, or 0 (none: an unchanged workload, windows that differ by sampling alone); Zipf s = 1 puts the top
two experts log 2 = 0.69 apart.

sample-mix: the sample model's trained router (a fixed checkpoint) under a serving stream of held-out text whose mix
of domains moves: samples/heldout_routes.npz (bench/sample_routes.py: 305 requests of 512 tokens, 5 domains) cut into
requests of PIECE tokens; a window draws window_tokens / PIECE of them, each request's domain from the window's
shares softmax(z_w), z_{w+1} = z_w + N(0, sigma) per domain (sigma as the drift above, z_0 = 0: equal shares), a
request of that domain at random (with replacement across windows). The router's domains differ: half the L1
distance between two domains' loads is 0.22-0.56 a layer.

sglang-dump: SGLang's `/dump_expert_distribution_record` in stat mode writes `logical_count`
[forward passes, L, E] (sglang python/sglang/srt/eplb/expert_distribution.py, _StatAccumulator.dump,
commit dd780ab): counts only, no tokens. The matrix gives the planners of that family the grouped windows'
counts and no tokens; it still scores nodes per token on the tokens behind them.

Shape legend: W windows, T tokens per window, L layers, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

Family = Literal["grouped", "clustered", "independent", "sglang-dump", "sample", "sample-mix"]
Drift = Literal["none", "slow", "fast"]
SYNTH: tuple[Family, ...] = ("grouped", "clustered", "independent", "sglang-dump")
DRIFT_SIGMA = {"none": 0.0, "slow": 0.05, "fast": 0.3}
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "samples" / "traces"
SAMPLE_ROUTES = SAMPLE_DIR.parent / "heldout_routes.npz"
PIECE = 128  # tokens a request of the sample-mix stream: 32 requests a 4,096-token window


@dataclass(frozen=True)
class TraceSpec:
    family: Family = "grouped"
    zipf_s: float = 0.6
    drift: Drift = "slow"
    num_groups: int = 8
    num_experts: int = 256
    top_k: int = 8
    num_layers: int = 6
    windows: int = 8
    window_tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_groups={self.num_groups} does not divide num_experts={self.num_experts}")
        if self.family not in (*SYNTH, "sample", "sample-mix"):
            raise ValueError(f"family={self.family!r}: expected one of {(*SYNTH, 'sample', 'sample-mix')}")


def _route(logits: np.ndarray, groups: int, k: int) -> np.ndarray:
    """logits [T, E] -> [T, K] expert ids, group-limited to the top groups / 2 groups when groups > 1."""
    t, e = logits.shape
    if groups > 1:
        keep = groups // 2
        grouped = logits.reshape(t, groups, e // groups)
        score = np.partition(grouped, -2, axis=2)[:, :, -2:].sum(2)  # [T, groups]
        drop = np.argpartition(score, groups - keep, axis=1)[:, : groups - keep]
        np.put_along_axis(grouped, drop[:, :, None], -np.inf, axis=1)
    return np.argpartition(logits, e - k, axis=1)[:, e - k:]


def synth_windows(spec: TraceSpec) -> np.ndarray:
    """-> [W, T, L, K] int16 routes of the synthetic families (module doc), deterministic in spec.seed."""
    return _synth(spec, 0)[0]


def oracle_heats(spec: TraceSpec, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (synth_windows(spec), [W, L, E] picks of `tokens` more tokens a window drawn from that window's router
    (its drift) with the domains or topics in their long-run shares (equal: the mean of the Dirichlet(1) mix), not
    the window's own mix. With W large, what the past tells of the next window: the drift is a random walk and the
    mix is drawn afresh every window (bench/eplb_hindsight.py). The extra tokens come from their own generator,
    seeded by (spec.seed, 1), so the windows are synth_windows' bytes."""
    routes, heats = _synth(spec, tokens)
    assert heats is not None
    return routes, heats


def _synth(spec: TraceSpec, oracle_tokens: int) -> tuple[np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(spec.seed)
    orng = np.random.default_rng([spec.seed, 1])
    w_, t_, n_layers, e, k = spec.windows, spec.window_tokens, spec.num_layers, spec.num_experts, spec.top_k
    rank = np.argsort(rng.random((n_layers, e)), axis=1)
    base = (-spec.zipf_s * np.log1p(rank)).astype(np.float32)  # [L, E]
    family = "grouped" if spec.family == "sglang-dump" else spec.family
    if family == "grouped":
        bias = rng.normal(0, 0.5, (4, n_layers, e)).astype(np.float32)  # [domains, L, E]
    elif family == "clustered":
        bias = np.zeros((16, n_layers, e), dtype=np.float32)
        for c in range(16):
            for li in range(n_layers):
                bias[c, li, rng.choice(e, 2 * k, replace=False)] = 2.0
    else:
        bias = np.zeros((1, n_layers, e), dtype=np.float32)
    drift = np.zeros((n_layers, e), dtype=np.float32)
    out = np.empty((w_, t_, n_layers, k), dtype=np.int16)
    oracle = np.zeros((w_, n_layers, e)) if oracle_tokens else None
    for w in range(w_):
        mix = rng.dirichlet(np.ones(len(bias)))
        kind = rng.choice(len(bias), t_, p=mix)  # [T] domain or topic of each token
        for li in range(n_layers):
            logits = base[li] + drift[li] + bias[kind, li] + _gumbel(rng, t_, e)
            out[w, :, li] = _route(logits, spec.num_groups, k)
        if oracle is not None:
            okind = orng.integers(0, len(bias), oracle_tokens)
            for li in range(n_layers):
                picks = _route(base[li] + drift[li] + bias[okind, li] + _gumbel(orng, oracle_tokens, e),
                               spec.num_groups, k)
                oracle[w, li] = np.bincount(picks.ravel(), minlength=e)
        drift += rng.normal(0, DRIFT_SIGMA[spec.drift], drift.shape).astype(np.float32)
    return out, oracle


def _gumbel(rng: np.random.Generator, t: int, e: int) -> np.ndarray:
    return -np.log(-np.log(rng.random((t, e), dtype=np.float32) + 1e-20) + 1e-20)  # [T, E]


def sample_windows(windows: int) -> tuple[np.ndarray, int, int]:
    """The sample model's traces (samples/traces, 32 experts, 4 groups, top-4, 4 MoE layers) cut into `windows`
    windows of equal token count in forward order -> (routes [W, T, L, K], num_experts, num_groups)."""
    from r3trace.trace.reader import open_dataset, read_token_routes

    run = open_dataset(SAMPLE_DIR)[0]
    ids = read_token_routes(run).topk_ids
    t = len(ids) // windows
    return ids[: t * windows].reshape(windows, t, *ids.shape[1:]), run.manifest.num_experts, run.manifest.num_groups


def sample_mix_windows(spec: TraceSpec) -> np.ndarray:
    """-> [W, T, L, K] int16 routes of the sample-mix family (module doc), deterministic in spec.seed."""
    z = np.load(SAMPLE_ROUTES)
    ids, domain = z["ids"], z["domain"]  # [N, S, L, K], [N]
    shape = (int(z["num_experts"]), int(z["num_groups"]), ids.shape[3], ids.shape[2])
    if (spec.num_experts, spec.num_groups, spec.top_k, spec.num_layers) != shape or spec.window_tokens % PIECE:
        raise ValueError(f"sample-mix: (num_experts, num_groups, top_k, num_layers) must be {shape} and "
                         f"window_tokens a multiple of {PIECE}; got {spec}")
    per = ids.shape[1] // PIECE
    pieces = ids[:, : per * PIECE].reshape(len(ids) * per, PIECE, *ids.shape[2:])  # [N per, PIECE, L, K]
    owners = [np.flatnonzero(np.repeat(domain, per) == d) for d in range(int(domain.max()) + 1)]
    rng = np.random.default_rng(spec.seed)
    z_mix = np.zeros(len(owners))
    n = spec.window_tokens // PIECE
    out = np.empty((spec.windows, n * PIECE, *ids.shape[2:]), dtype=np.int16)
    for w in range(spec.windows):
        shares = np.exp(z_mix - z_mix.max())
        for j, d in enumerate(rng.choice(len(owners), n, p=shares / shares.sum())):
            out[w, j * PIECE: (j + 1) * PIECE] = pieces[rng.choice(owners[d])]
        z_mix += rng.normal(0, DRIFT_SIGMA[spec.drift], len(owners))
    return out


def load_windows(spec: TraceSpec) -> tuple[np.ndarray, bool]:
    """-> (routes [W, T, L, K], planners see tokens): every family's windows; sglang-dump hides the tokens."""
    if spec.family == "sample":
        return sample_windows(spec.windows)[0], True
    if spec.family == "sample-mix":
        return sample_mix_windows(spec), True
    return synth_windows(spec), spec.family != "sglang-dump"


def sglang_dump(routes: np.ndarray, num_experts: int, forwards: int) -> np.ndarray:
    """routes [T, L, K] of one window -> logical_count [forwards, L, E] as SGLang's stat dump holds it
    (per forward pass, tokens split evenly over `forwards` passes)."""
    t, n_layers, _ = routes.shape
    fwd = np.arange(t) * forwards // t
    flat = (fwd[:, None, None] * n_layers + np.arange(n_layers)[None, :, None]) * num_experts + routes
    counts = np.bincount(flat.ravel().astype(np.int64), minlength=forwards * n_layers * num_experts)
    return counts.reshape(forwards, n_layers, num_experts)
