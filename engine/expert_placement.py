"""Expert placement on a built model: install an ExpertLocation's maps, and rebalance while serving.

    initial_location(engine_config, model_config, ep_size)         the EngineConfig's placement (None: none asked)
    read_location(source, model_config, ep_size)                   a file (or an ExpertLocation) -> ExpertLocation
    apply_expert_location(model, location, ep_rank, mode, seed)   once, after build_model and before load
    update_expert_placement(model, location, weight_source)        between two forwards, on every EP rank
                                                                    at the same forward boundary

weight_source(layer_id) -> (w13 [E, 2I, D], w2 [E, D, I]): that MoE layer's logical weights (all E experts), from
the checkpoint or a host copy. A rebalance goes over the MoE layers in chunks of chunk_layers: a chunk's full
weights are fetched, its layers' moved slots copied and their maps switched (moe.py: weights first), then the
weights are dropped, so at most one chunk of full weights is alive. Each layer is self-consistent after its own
switch, so the caller may run forwards between chunks (update_chunks yields after each). Routes are logical and
never change with the placement: requests in flight keep theirs.

Every EP rank must switch a layer between the same two forwards: a rank that switched sends a pair to a slot
under the new map, and the rank holding that slot must have copied its new weights by then. The caller (the
engine's event loop) runs the same chunk on every rank at the same step; no collective here checks it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .engine_config import EngineConfig
from .layers.expert_location import ExpertLocation, ExpertLocationError
from .layers.expert_map import DispatchMode, ExpertMap
from .layers.moe import MoE
from .model_config import ModelConfig

WeightSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers in layer order."""
    return sorted((m for m in model.modules() if isinstance(m, MoE)), key=lambda m: m.gate.layer_id)


def read_location(source: Any, mc: ModelConfig, ep_size: int, field: str = "source") -> ExpertLocation:
    """source: an ExpertLocation, "trivial" (the P = E map), or a path to `r3trace eplb --out`'s JSON ({"cluster",
    "phy2log", ...}, rows over the MoE layers) or SGLang's expert-location JSON / .pt ({"physical_to_logical_map":
    [num_hidden_layers, P]}, as SGLang's compute_initial_expert_location_metadata reads it). field: the name an
    error gives the source (the option or request field it came from)."""
    moe = mc.moe_layer_ids
    if isinstance(source, ExpertLocation):
        loc = source
    elif source == "trivial":
        loc = ExpertLocation.trivial(mc.n_routed_experts, ep_size, moe)
    else:
        from r3trace.eplb.placement import PlacementError
        from r3trace.eplb.previous import load_location  # read as SGLang's --init-expert-location reads it

        try:
            doc = load_location(Path(str(source)))
        except PlacementError as e:
            raise ExpertLocationError(f"{field}={str(source)!r}: unreadable expert location ({e})") from e
        if not isinstance(doc, dict):
            raise ExpertLocationError(f"{field}={str(source)!r}: a {type(doc).__name__}; expected a JSON object")
        try:
            if "phy2log" in doc and "cluster" in doc:  # r3trace's own EPLB output
                loc = ExpertLocation.from_eplb_json(json.dumps(doc), moe)
            else:
                loc = ExpertLocation.from_sglang(doc, mc, ep_size)
        except (ExpertLocationError, KeyError, TypeError, ValueError) as e:
            raise ExpertLocationError(f"{field}={str(source)!r}: {e}") from e
    if loc.ep_size != ep_size or loc.num_logical != mc.n_routed_experts or loc.layer_ids != moe:
        raise ExpertLocationError(
            f"{field}: placement for ep_size={loc.ep_size}, E={loc.num_logical}, MoE layers {loc.layer_ids}; the "
            f"engine runs ep_size={ep_size}, E={mc.n_routed_experts}, MoE layers {moe}"
        )
    return loc


def initial_location(ecfg: EngineConfig, mc: ModelConfig, ep_size: int) -> ExpertLocation | None:
    """The placement the model is built with: None without one (slot e is expert e, no map step)."""
    if not ecfg.has_placement:
        return None
    ecfg.check_expert_slots(mc.n_routed_experts, ep_size)
    p = mc.n_routed_experts + ecfg.ep_num_redundant_experts
    source = ecfg.init_expert_location
    if source is None or source == "trivial":
        return ExpertLocation.trivial(mc.n_routed_experts, ep_size, mc.moe_layer_ids, p)
    loc = read_location(source, mc, ep_size, "init_expert_location")
    if loc.num_physical != p:
        raise ExpertLocationError(
            f"init_expert_location={source!r} has P={loc.num_physical} slots; n_routed_experts + "
            f"ep_num_redundant_experts = {p}"
        )
    return loc


def apply_expert_location(
    model: nn.Module, location: ExpertLocation, ep_rank: int, mode: DispatchMode = "static", seed: int = 0
) -> None:
    """Give every MoE layer its map; each layer's w13 / w2 must then hold the rank's P/G slots
    (expert_location.physical_expert_weights when loading)."""
    layers = moe_layers(model)
    _check(layers, location)
    for moe in layers:
        moe.expert_map = ExpertMap(location, moe.gate.layer_id, ep_rank, mode, seed, moe.w13.device)


class ChunkDone(NamedTuple):
    layer_ids: tuple[int, ...]  # the layers this chunk switched
    slots_copied: int  # slots whose weights were rewritten on this rank
    from_forward_id: int = -1  # the first forward under the new maps (EngineCore sets it; -1: not run by one)


def update_chunks(
    model: nn.Module, location: ExpertLocation, weight_source: WeightSource, chunk_layers: int = 4
) -> Iterator[ChunkDone]:
    """Rebalance chunk by chunk; yields after each chunk (a point where forwards may run)."""
    if chunk_layers < 1:
        raise ExpertLocationError(f"chunk_layers={chunk_layers}; expected >= 1")
    layers = moe_layers(model)
    _check(layers, location)
    if any(moe.expert_map is None for moe in layers):
        raise ExpertLocationError("the model has no expert maps: apply_expert_location when it is built")
    for start in range(0, len(layers), chunk_layers):
        chunk = layers[start : start + chunk_layers]
        weights = {moe.gate.layer_id: weight_source(moe.gate.layer_id) for moe in chunk}
        copied = sum(moe.update_expert_placement(location, *weights[moe.gate.layer_id]) for moe in chunk)
        del weights
        yield ChunkDone(tuple(m.gate.layer_id for m in chunk), copied)


def update_expert_placement(
    model: nn.Module, location: ExpertLocation, weight_source: WeightSource, chunk_layers: int = 4
) -> int:
    """All chunks at once, between two forwards; returns the slots copied on this rank."""
    return sum(done.slots_copied for done in update_chunks(model, location, weight_source, chunk_layers))


def _check(layers: list[MoE], location: ExpertLocation) -> None:
    ids = tuple(m.gate.layer_id for m in layers)
    if ids != location.layer_ids:
        raise ExpertLocationError(f"location.layer_ids={location.layer_ids}; the model's MoE layers are {ids}")
