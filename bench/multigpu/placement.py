"""Redundant experts in the parallel matrix: a seeded placement to rebalance to, a rebalance while requests run, and
the check that each returned physical slot holds the logical expert recorded beside it.

tests/engine/test_parallel_placement.py runs the same rebalance on gloo ranks with more assertions; here it is one
case of the matrix, with counts instead of assertions.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from bench.multigpu.workload import ASK, greedy, joined
from r3trace.capture.wire import decode_routed_experts

REDUNDANT = 8  # redundant slots: P = E + 8 (40 on the sample model: 20, 10, 5 a rank on 2, 4, 8 ranks)


def shuffled_placement(seed: int, num_layers: int = 5, num_experts: int = 32, redundant: int = REDUNDANT
                       ) -> np.ndarray:
    """SGLang's physical_to_logical_map [num_layers, P]: each layer a seeded shuffle of the E experts plus
    `redundant` seeded replicas (a dense layer's row is read past)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.randperm(num_experts, generator=g), torch.randint(0, num_experts, (redundant,),
                                                                                generator=g)])
            for _ in range(num_layers)]  # fmt: skip
    return torch.stack(rows).numpy()


def rebalance_prompts(n: int = 4, seed: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4096) for _ in range(rng.randrange(3, 24))] for _ in range(n)]


def plain_run(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[dict[str, Any]]:
    """The reference side of the rebalance: the same requests and options, no update."""
    return list(engine.generate(input_ids=prompts, sampling_params=greedy(new_tokens), **ASK))


class Rebalance(NamedTuple):
    """What rebalance_during_stream saw."""

    results: list[dict[str, Any]]  # the first n - 1 prompts' results, in prompt order
    chunks: list[dict[str, Any]]  # the last prompt's stream chunks
    update: dict[str, Any]  # engine.update_expert_placement's reply
    chunks_after_update: int  # stream chunks that arrived after the update returned (> 0: requests ran past it)


def rebalance_during_stream(engine: Any, prompts: list[list[int]], source: Path, **ask: Any) -> Rebalance:
    """All but the last prompt on threads, the last one streamed; once its first chunk is back,
    engine.update_expert_placement(source) on another thread. `ask`: generate's other arguments (sampling_params,
    return_logprob, ...), the same for every request."""
    results: dict[int, dict[str, Any]] = {}

    def one(i: int) -> None:
        results[i] = engine.generate(input_ids=[prompts[i]], **ask)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts) - 1)]
    for t in threads:
        t.start()
    stream = engine.generate(input_ids=prompts[-1], stream=True, **ask)
    chunks = [next(stream)]  # the batch is running
    reply: dict[str, Any] = {}
    update = threading.Thread(target=lambda: reply.update(engine.update_expert_placement(str(source))))
    update.start()
    after = 0
    for chunk in stream:
        chunks.append(chunk)
        after += not update.is_alive()
    update.join()
    for t in threads:
        t.join()
    return Rebalance([results[i] for i in range(len(prompts) - 1)], chunks, reply, after)


def rebalance_run(engine: Any, prompts: list[list[int]], new_tokens: int, source: Path) -> dict[str, Any]:
    """rebalance_during_stream with the matrix's options. -> {"results": in prompt order (the stream joined),
    "update": the update's reply, "chunks_after_update"}."""
    r = rebalance_during_stream(engine, prompts, source, sampling_params=greedy(new_tokens), **ASK)
    return {"results": [*r.results, joined(r.chunks)], "update": r.update, "chunks_after_update": r.chunks_after_update}


def write_placement(path: Path, seed: int, num_layers: int, num_experts: int) -> Path:
    path.write_text(json.dumps({"physical_to_logical_map": shuffled_placement(seed, num_layers, num_experts).tolist()}))
    return path


def physical_mismatches(slots: list[dict[str, Any]], results: list[dict[str, Any]], moe_layer_ids: list[int]
                        ) -> tuple[int, int]:
    """(routed pairs whose physical slot does not hold the logical expert recorded beside it, pairs checked) over
    the results that carry routed_experts_physical; slots: Engine.expert_slots() when they ran."""
    phy2log = np.array([sum((s["held"][m] for s in slots), []) for m in range(len(moe_layer_ids))])  # [M, P]
    bad = checked = 0
    for r in results:
        if "routed_experts_physical" not in r.get("meta_info", {}):
            continue
        logical = decode_routed_experts(r["meta_info"])  # [rows, L, K]
        physical = decode_routed_experts(r["meta_info"], "routed_experts_physical")
        for m, layer in enumerate(moe_layer_ids):
            bad += int((phy2log[m][physical[:, layer]] != logical[:, layer]).sum())
            checked += logical[:, layer].size
    return bad, checked
