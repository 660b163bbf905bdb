"""The polish's candidate moves around the hottest GPU, described by the slots they write, and their keys.

A step of polish.py scores every swap, recount and 2-for-2 exchange around the hottest GPU h: on one node of 8 GPUs
with 12 slots each that is 33K candidates, of which 30K are exchanges (66 x 66 slot pairs with each other GPU).
Written out as [C, P] layouts and re-summed slot by slot, a step cost 35 ms of keys and 10 ms of layouts, and a
plan of 3 such layers 5 s. Here a move is at most 4 slot writes, and the keys of those that keep every replica
count (swaps and exchanges: a slot's share, load / count, moves with it) re-sum only h and the other GPU they
touch; recounts change two experts' shares on every GPU holding them and are scored in full (layout_keys). Both
sum a GPU's slots with the same reduction over its S contiguous shares, so the keys are the same bits as
layout_keys of the written-out layouts (tests/analysis/test_eplb_polish.py checks every candidate).

Shape legend: E experts, P slots, G GPUs, S slots per GPU, C candidates.
"""

from __future__ import annotations

from itertools import combinations
from typing import NamedTuple

import numpy as np

from r3trace.eplb.placement import Cluster

WRITES = 4  # slot writes of the largest move (an exchange); smaller moves repeat a write


class Moves(NamedTuple):
    """C candidate layouts, each the base layout with slots[c, i] <- experts[c, i] (repeats write the same value)."""

    slots: np.ndarray  # [C, WRITES]
    experts: np.ndarray  # [C, WRITES]
    partner: np.ndarray  # [C] the other GPU a count-keeping move touches; -1 for a recount
    hot: int  # h, the base layout's hottest GPU


def layout_keys(cand: np.ndarray, w: np.ndarray, cl: Cluster, tol: float) -> np.ndarray:
    """[C, P] layouts, loads w [E] -> [C, 2] (max GPU load under the even split, GPUs within tol of it)."""
    c, e = len(cand), len(w)
    cnt = np.bincount((cand + e * np.arange(c)[:, None]).ravel(), minlength=c * e).reshape(c, e)
    u = w[cand] / np.maximum(np.take_along_axis(cnt, cand, 1), 1)
    gpu = u.reshape(c, cl.num_gpus, cl.slots_per_gpu).sum(-1)
    mx = gpu.max(1)
    return np.stack([mx, (gpu > (mx - tol)[:, None]).sum(1)], 1)


def neighbours(ph: np.ndarray, w: np.ndarray, cl: Cluster) -> Moves:
    """Every swap of a slot of the hottest GPU h with another GPU's slot, every recount (a slot of an expert with
    >= 2 replicas becomes one more replica of an expert of h) and every 2-for-2 exchange of h's slots with another
    GPU's, in that order."""
    spg, p = cl.slots_per_gpu, len(ph)
    cnt = np.bincount(ph, minlength=len(w))
    h = int((w[ph] / cnt[ph]).reshape(-1, spg).sum(1).argmax())
    mine = np.arange(h * spg, (h + 1) * spg)
    other = np.setdiff1d(np.arange(p), mine)
    a, b = np.repeat(mine, len(other)), np.tile(other, len(mine))
    a, b = a[ph[a] != ph[b]], b[ph[a] != ph[b]]
    slots = [np.stack([a, b, a, b], 1)]
    experts = [np.stack([ph[b], ph[a], ph[b], ph[a]], 1)]
    partner = [b // spg]
    a, s = np.repeat(mine, p), np.tile(np.arange(p), len(mine))
    keep = (cnt[ph[s]] > 1) & (ph[s] != ph[a])
    a, s = a[keep], s[keep]
    slots.append(np.repeat(s[:, None], WRITES, 1))
    experts.append(np.repeat(ph[a][:, None], WRITES, 1))
    partner.append(np.full(len(a), -1))
    pairs = np.array(list(combinations(range(spg), 2)), dtype=np.int64).reshape(-1, 2)  # [Q, 2]
    i, j = np.repeat(np.arange(len(pairs)), len(pairs)), np.tile(np.arange(len(pairs)), len(pairs))
    for g in range(cl.num_gpus):
        if g == h or not len(pairs):
            continue
        a2, b2 = (h * spg + pairs)[i], (g * spg + pairs)[j]  # [Q^2, 2] h's two slots, g's two
        slots.append(np.concatenate([a2, b2], 1))
        experts.append(np.concatenate([ph[b2], ph[a2]], 1))
        partner.append(np.full(len(i), g))
    return Moves(np.concatenate(slots), np.concatenate(experts), np.concatenate(partner), h)


def apply(ph: np.ndarray, mv: Moves, idx: np.ndarray) -> np.ndarray:
    """[P] base layout -> [len(idx), P] the layouts of moves idx."""
    out = np.tile(ph, (len(idx), 1))
    out[np.arange(len(idx))[:, None], mv.slots[idx]] = mv.experts[idx]
    return out


def move_keys(ph: np.ndarray, w: np.ndarray, cl: Cluster, tol: float, mv: Moves) -> np.ndarray:
    """[C, 2] layout_keys of every move's layout (module doc: only the GPUs a count-keeping move touches re-summed)."""
    g, spg = cl.num_gpus, cl.slots_per_gpu
    cnt = np.bincount(ph, minlength=len(w))
    share = w / np.maximum(cnt, 1)  # [E] one replica's load (an absent expert is never written)
    u = share[ph].reshape(g, spg)  # [G, S]
    gpu = u.sum(1)  # [G]
    out = np.empty((len(mv.slots), 2))
    rc = np.flatnonzero(mv.partner < 0)
    if len(rc):
        out[rc] = layout_keys(apply(ph, mv, rc), w, cl, tol)
    kp = np.flatnonzero(mv.partner >= 0)
    if not len(kp):
        return out
    h, q = mv.hot, mv.partner[kp]  # [C']
    blk = u[np.stack([np.full(len(kp), h), q], 1)]  # [C', 2, S] h's shares, q's
    sl = mv.slots[kp]
    side = (sl // spg != h).astype(np.int64)  # [C', WRITES] 0: a slot of h, 1: of q
    blk[np.arange(len(kp))[:, None], side, sl % spg] = share[mv.experts[kp]]
    new = blk.sum(-1)  # [C', 2] h's and q's loads after the move
    rest = np.tile(gpu, (g, 1))  # [G, G] row q: every GPU but h and q
    rest[:, h] = -np.inf
    rest[np.arange(g), np.arange(g)] = -np.inf
    mx = np.maximum(rest.max(1)[q], new.max(1))
    thr = mx - tol
    ranked = np.sort(gpu)
    above = g - np.searchsorted(ranked, thr, side="right")  # base GPUs above thr, h and q among them
    above -= (gpu[h] > thr).astype(np.int64) + (gpu[q] > thr) - (new > thr[:, None]).sum(1)
    out[kp, 0], out[kp, 1] = mx, above
    return out
