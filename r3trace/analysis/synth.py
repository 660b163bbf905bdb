"""Synthetic DeepSeek-V3-shaped routing traces, deterministic by seed.

Model of a router, per MoE layer l and domain d: logits = log p_l + b_{d,l} + Gumbel noise, where p_l is a
Zipf(s) popularity over a random permutation of the E experts and b_{d,l} ~ N(0, domain_sigma) is the
domain's preference. Group-limited routing as V3 does it: group score = sum of its top-2 logits, keep the
top `topk_group` of `num_groups` groups, take the top K experts inside them, in score order (gate rank).

Sampling every (token, layer) afresh costs T*L*E Gumbel draws (25G for 100M rows), so each
(domain, layer) routes a bank of `bank_size` tokens once and tokens draw from the bank: with probability
`locality` a token reuses the previous token's bank entry for that layer (temporal locality), else a
fresh one. Requests arrive into a continuous batch of at most `max_running` requests: each forward
prefills one new prompt and decodes one token for every running request.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from r3trace.progress import progress_bar
from r3trace.trace.schema import TraceSchemaError
from r3trace.trace.writer import TraceWriter


@dataclass(frozen=True)
class SynthConfig:
    # model (DeepSeek-V3: 61 layers, first 3 dense, 256 routed experts, top-8, 8 groups, top-4 groups)
    num_hidden_layers: int = 61
    first_k_dense: int = 3
    num_experts: int = 256
    top_k: int = 8
    num_groups: int = 8
    topk_group: int = 4
    # workload
    zipf_s: float = 0.6
    num_domains: int = 4
    domain_sigma: float = 0.5
    locality: float = 0.3
    bank_size: int = 4096
    prompt_len: tuple[int, int] = (64, 512)
    completion_len: tuple[int, int] = (32, 256)
    max_running: int = 64
    forward_ms: float = 25.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise TraceSchemaError(
                f"num_groups={self.num_groups} does not divide num_experts={self.num_experts}"
            )
        per_group = self.num_experts // self.num_groups
        if not 1 <= self.topk_group <= self.num_groups or self.top_k > self.topk_group * per_group:
            raise TraceSchemaError(
                f"top_k={self.top_k} needs <= topk_group*experts_per_group = {self.topk_group * per_group}"
            )
        if not 0 <= self.locality < 1 or self.first_k_dense >= self.num_hidden_layers:
            raise TraceSchemaError(f"locality={self.locality} must be in [0, 1) and first_k_dense < layers")

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense, self.num_hidden_layers))


def route_bank(cfg: SynthConfig, rng: np.random.Generator, progress: bool | None = False) -> np.ndarray:
    """Bank of routed tokens: [domains, L, bank_size, K] int32 logical ids in gate-rank order.

    `progress`: a bar of (domain, layer) banks drawn (r3trace/progress.py); V3's 4 x 58 take seconds."""
    n_layers, e, g = len(cfg.moe_layer_ids), cfg.num_experts, cfg.num_groups
    ranks = np.argsort(rng.random((n_layers, e)), axis=1)  # [L, E] popularity rank of each expert
    base = -cfg.zipf_s * np.log1p(ranks).astype(np.float32)  # log of Zipf(s) popularity, [L, E]
    bank = np.empty((cfg.num_domains, n_layers, cfg.bank_size, cfg.top_k), dtype=np.int32)
    bar = progress_bar(progress, total=cfg.num_domains * n_layers, unit="layer", desc="synth bank")
    for d in range(cfg.num_domains):
        bias = rng.normal(0, cfg.domain_sigma, (n_layers, e)).astype(np.float32)
        for li in range(n_layers):
            gumbel = -np.log(-np.log(rng.random((cfg.bank_size, e), dtype=np.float32) + 1e-20) + 1e-20)
            logits = base[li] + bias[li] + gumbel  # [B, E]
            grouped = logits.reshape(cfg.bank_size, g, e // g)
            top2 = np.partition(grouped, -2, axis=2)[:, :, -2:].sum(2)  # [B, groups]
            drop = np.argpartition(top2, g - cfg.topk_group, axis=1)[:, : g - cfg.topk_group]
            np.put_along_axis(grouped, drop[:, :, None], -np.inf, axis=1)
            top = np.argpartition(logits, e - cfg.top_k, axis=1)[:, e - cfg.top_k:]  # [B, K]
            order = np.argsort(-np.take_along_axis(logits, top, 1), axis=1)
            bank[d, li] = np.take_along_axis(top, order, 1)
            bar.update()
    bar.close()
    return bank


class Schedule(NamedTuple):
    """T tokens in forward order: request index, position, phase code (0 prefill, 1 decode), forward."""

    request: np.ndarray
    token_pos: np.ndarray
    phase: np.ndarray
    forward_id: np.ndarray
    prompt_len: np.ndarray  # [R]
    completion_len: np.ndarray  # [R]
    domain: np.ndarray  # [R]


def schedule(cfg: SynthConfig, num_tokens: int, rng: np.random.Generator) -> Schedule:
    """Continuous batching until about `num_tokens` tokens have been processed."""
    mean_len = sum(cfg.prompt_len) / 2 + sum(cfg.completion_len) / 2
    n_req = int(num_tokens / mean_len * 1.5) + 8
    plen = rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1, n_req)
    clen = rng.integers(cfg.completion_len[0], cfg.completion_len[1] + 1, n_req)
    domain = rng.integers(0, cfg.num_domains, n_req)
    reqs, poss, phases, fwds = [], [], [], []
    running: list[int] = []  # requests in decode
    pos = np.zeros(n_req, dtype=np.int64)
    nxt, total, fwd = 0, 0, 0
    while total < num_tokens and (nxt < n_req or running):
        batch_r = np.asarray(running, dtype=np.int64)
        batch_p = pos[batch_r]
        r_list, p_list, ph_list = [batch_r], [batch_p], [np.ones(len(batch_r), np.int32)]
        pos[batch_r] += 1
        if nxt < n_req and len(running) < cfg.max_running:
            r_list.append(np.full(plen[nxt], nxt))
            p_list.append(np.arange(plen[nxt]))
            ph_list.append(np.zeros(plen[nxt], np.int32))
            pos[nxt] = plen[nxt]
            running.append(nxt)
            nxt += 1
        r = np.concatenate(r_list)
        reqs.append(r)
        poss.append(np.concatenate(p_list))
        phases.append(np.concatenate(ph_list))
        fwds.append(np.full(len(r), fwd, np.int64))
        total += len(r)
        fwd += 1
        running = [q for q in running if pos[q] < plen[q] + clen[q] - 1]
    return Schedule(np.concatenate(reqs), np.concatenate(poss).astype(np.int32), np.concatenate(phases),
                    np.concatenate(fwds), plen, clen, domain)


def route_chunk(
    bank: np.ndarray, sched: Schedule, lo: int, hi: int, last: np.ndarray, cfg: SynthConfig,
    rng: np.random.Generator,
) -> np.ndarray:
    """Routes of schedule tokens lo..hi: [T, L, K]; `last` [R, L] holds each request's previous bank index."""
    n_layers = bank.shape[1]
    req, pos = sched.request[lo:hi], sched.token_pos[lo:hi]
    order = np.lexsort((pos, req))  # request-major so the previous token of a request is the previous row
    r_sorted = req[order]
    t = hi - lo
    fresh = rng.integers(0, cfg.bank_size, (t, n_layers), dtype=np.int32)
    repeat = rng.random((t, n_layers)) < cfg.locality
    first = np.ones(t, dtype=bool)
    first[1:] = r_sorted[1:] != r_sorted[:-1]
    carried = last[r_sorted[first]]  # [n_first, L]; -1 when the request has no previous token
    vals = fresh.copy()
    take_state = repeat[first] & (carried >= 0)
    vals[first] = np.where(take_state, carried, fresh[first])
    src = np.where(~repeat | first[:, None], np.arange(t)[:, None], 0)
    src = np.maximum.accumulate(src, axis=0)  # row of the last fresh (or carried) draw per layer
    idx = np.take_along_axis(vals, src, 0)  # [T, L] bank index
    ends = np.append(np.nonzero(first)[0][1:] - 1, t - 1)
    last[r_sorted[ends]] = idx[ends]
    dom = sched.domain[r_sorted]
    routed = bank[dom[:, None], np.arange(n_layers)[None, :], idx]  # [T, L, K]
    out = np.empty_like(routed)
    out[order] = routed
    return out


def route_windows(cfg: SynthConfig, num_windows: int, window_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Routes of num_windows consecutive windows in schedule order: [W, window_tokens, L, K] (EPLB benches/tests)."""
    bank = route_bank(cfg, rng)
    total = num_windows * window_tokens
    sched = schedule(cfg, total, rng)
    last = np.full((len(sched.prompt_len), bank.shape[1]), -1, dtype=np.int32)
    ids = route_chunk(bank, sched, 0, total, last, cfg, rng)
    return ids.reshape(num_windows, window_tokens, *ids.shape[1:])


def synth_routes(
    cfg: SynthConfig, num_tokens: int, progress: bool | None = False
) -> Iterator[tuple[Schedule, int, int, np.ndarray]]:
    """Yields (schedule, lo, hi, topk_ids [hi-lo, L, K]) chunks of about 16K tokens, in forward order."""
    rng = np.random.default_rng(cfg.seed)
    bank = route_bank(cfg, rng, progress)
    sched = schedule(cfg, num_tokens, rng)
    last = np.full((len(sched.prompt_len), bank.shape[1]), -1, dtype=np.int32)
    last_fwd = int(sched.forward_id[-1])
    edges = np.r_[np.arange(0, last_fwd + 1, 64), last_fwd + 1]  # chunks of 64 forwards
    bounds = [int(b) for b in np.asarray(np.searchsorted(sched.forward_id, edges))]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            yield sched, lo, hi, route_chunk(bank, sched, lo, hi, last, cfg, rng)


def write_synth(root: str | Path, cfg: SynthConfig, num_tokens: int, run_id: str | None = None,
                progress: bool | None = True, **writer_kw: object) -> TraceWriter:
    """Writes a synthetic run through TraceWriter; returns the closed writer (its manifest says what).

    `progress` (r3trace/progress.py): a bar of tokens written, to the schedule's whole-forward total."""
    writer = TraceWriter(
        root, model_name="synthetic-deepseek-v3", num_hidden_layers=cfg.num_hidden_layers,
        moe_layer_ids=cfg.moe_layer_ids, num_experts=cfg.num_experts, top_k=cfg.top_k, run_id=run_id,
        num_groups=cfg.num_groups, engine={"synth": cfg.__dict__ | {"num_tokens": num_tokens}},
        **{"flush_interval_s": None, **writer_kw},  # type: ignore[arg-type]  # offline: size and close commits
    )
    t0 = np.datetime64("2026-01-01T00:00:00", "ns").astype(np.int64)
    sched: Schedule | None = None
    bar = None  # opened once the bank is drawn and the schedule's length known (whole forwards: a few more)
    try:
        for sched, lo, hi, ids in synth_routes(cfg, num_tokens, progress):
            if bar is None:
                bar = progress_bar(progress, total=len(sched.request), unit="tok", desc="synth")
            fwd = sched.forward_id[lo:hi]
            writer.append_tokens(
                np.char.add("r", sched.request[lo:hi].astype(str)), sched.token_pos[lo:hi],
                sched.phase[lo:hi], "computed", fwd, t0 + (fwd * cfg.forward_ms * 1e6).astype(np.int64),
                0, ids,
            )
            bar.update(hi - lo)
    finally:
        if bar is not None:
            bar.close()
    if sched is not None:
        seen = np.unique(sched.request)
        for r in seen.tolist():
            writer.add_request(f"r{r}", tag=f"domain{sched.domain[r]}",
                               prompt_tokens=int(sched.prompt_len[r]),
                               completion_tokens=int(sched.completion_len[r]), finish_reason="length")
    writer.close()
    return writer
