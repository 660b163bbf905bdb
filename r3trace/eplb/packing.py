"""The two greedy steps of DeepSeek's EPLB, written from its published description and vectorised over rows.

Shape legend: X independent rows (layers, or layer x node), n items, m packs.
Each loop runs over items (n <= a few hundred) with numpy work over all rows at once: the reference
loops over rows in Python too, which is where its 0.6-2 s per [58, 256] plan goes.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import PlacementError, slot_order


def torch_order(weight: np.ndarray) -> np.ndarray:
    """[X, n] item order, heaviest first, by the call DeepSeek's reference makes: torch's sort of the float32
    weights, descending. Its order among equal weights is torch's (not stable; it depends on n), and equal
    weights are common: every replica of one expert weighs the same. Sorting the same way puts tied replicas
    where the reference does, so DeepSeek's policies give its log2phy replica ranks, not just equal loads."""
    import torch  # on first use (about 2 s once a process): DeepSeek's policies, and ours wherever it weighs
    # global's layout (planner.py, dispatch_contest.py, candidates.py, replan.py, static_ladder.py)

    w = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    return w.sort(-1, descending=True).indices.numpy()


def balanced_packing(
    weight: np.ndarray, num_packs: int, order: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Heaviest item first into the lightest pack that still has room; every pack gets n/m items.

    weight: [X, n]; order: [X, n] the items heaviest first (default: stable, equal weights by index).
    Returns pack_index [X, n] and rank_in_pack [X, n] (0..n/m-1), both int64.
    With one item per pack, item i goes to pack i, as in the reference.
    """
    x, n = weight.shape
    if n % num_packs:
        raise PlacementError(f"{n} items do not split evenly into num_packs={num_packs}")
    cap = n // num_packs
    if cap == 1:
        return np.tile(np.arange(n, dtype=np.int64), (x, 1)), np.zeros((x, n), dtype=np.int64)
    rows = np.arange(x)
    if order is None:
        order = np.argsort(-weight, axis=1, kind="stable")
    # packs of all rows raveled ([X m]) and indexed by flat + pack: one index array per update instead of (rows,
    # pack), and the load of a full pack kept at inf, so a step is one argmin ([464, 40] items into 8 packs: 1.6 ->
    # 1.3 ms; [58, 320] into 64: 5.9 -> 3.6 ms). Ranks are set after the loop: every pack ends with `cap` items, so
    # an item's rank is its place among its pack's items in packing order (fewer calls a step)
    flat = rows * num_packs
    pack_n = np.zeros(x * num_packs, dtype=np.int64)
    open_w = np.zeros((x, num_packs))  # a pack's load while it has room, else inf
    open_flat = open_w.ravel()  # a view
    w_seq = np.take_along_axis(np.asarray(weight, dtype=np.float64), order, 1)  # [X, n] in packing order
    w_steps = np.ascontiguousarray(w_seq.T)  # [n, X]
    packs = np.empty((n, x), dtype=np.int64)  # [n, X] pack of each step's item
    # while some pack is empty the lightest open pack is the first empty one, so with positive weights item i < m
    # goes to pack i: those m steps are set at once (64 of the 256-320 steps of the global policy at [58, 256/320])
    start = num_packs if (w_seq[:, : num_packs - 1] > 0).all() else 0
    if start:
        packs[:start] = np.arange(start)[:, None]
        pack_n[:] = 1
        open_w[:] = w_seq[:, :start]  # cap >= 2: every pack still has room
    # a step adds its item's weight plus closing[count after it]: inf where the pack is then full, else +0.0 (x + 0.0
    # is x), one gather and two scatters a step instead of a count test and a masked write (272 steps of global's
    # packing at [58, 288] on 16 GPUs: ~20% of its time)
    closing = np.zeros(cap + 1)
    closing[cap] = np.inf
    for step in range(start, n):
        p = np.argmin(open_w, axis=1)
        packs[step] = p
        i = flat + p
        c = pack_n[i] + 1
        pack_n[i] = c
        open_flat[i] += w_steps[step] + closing[c]
    packs = packs.T  # [X, n]
    ranks = np.empty((x, n), dtype=np.int64)
    np.put_along_axis(ranks, slot_order(packs), np.arange(n) % cap, 1)
    pack_index = np.empty((x, n), dtype=np.int64)
    rank = np.empty((x, n), dtype=np.int64)
    np.put_along_axis(pack_index, order, packs, 1)
    np.put_along_axis(rank, order, ranks, 1)
    return pack_index, rank


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each extra slot goes to the expert with the highest load per replica.

    weight: [X, n_log]. Returns phy2log [X, num_phy] (the first n_log slots are experts 0..n_log-1 in order),
    rank [X, num_phy] (replica index), logcnt [X, n_log].
    """
    x, n_log = weight.shape
    if num_phy < n_log:
        raise PlacementError(f"num_phy={num_phy} slots cannot hold {n_log} experts")
    rows = np.arange(x)
    phy2log = np.tile(np.arange(num_phy), (x, 1))
    rank = np.zeros((x, num_phy), dtype=np.int64)
    logcnt = np.ones((x, n_log), dtype=np.int64)
    per = weight / logcnt  # [X, n_log] load per replica; a step changes only its chosen expert's (the same division)
    for slot in range(n_log, num_phy):
        e = np.argmax(per, axis=1)
        phy2log[:, slot] = e
        c = logcnt[rows, e]
        rank[:, slot] = c
        logcnt[rows, e] = c + 1
        per[rows, e] = weight[rows, e] / (c + 1)
    return phy2log, rank, logcnt


def replica_counts(weight: np.ndarray, num_phy: int) -> np.ndarray:
    """logcnt [X, n_log] of replicate_experts without the slot bookkeeping."""
    return replicate_experts(weight, num_phy)[2]
