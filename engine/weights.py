"""Load Hugging Face-layout safetensors (one file or a sharded index) into the engine's model.

Every checkpoint tensor is matched to a model tensor; missing tensors, unexpected tensors and shape
mismatches are collected and raised together in one WeightsError. Routed experts are stacked:
mlp.experts.E.{gate,up}_proj.weight -> mlp.w13[E], mlp.experts.E.down_proj.weight -> mlp.w2[E].
MTP layers (model.layers.N with N >= num_hidden_layers) go to model.mtp_weights, untouched.
Tensor parallelism: a sharded parameter (layers/linear.py shards) holds one rank's slice; the checkpoint
tensor is checked against the full shape and the rank's slice copied, so every rank reads the same files.
Expert parallelism: a MoE holds only its dispatcher's experts (w13[e - first] for e in dispatcher.experts, the
rows layers/dispatcher.py's expert_slice would cut); the other experts' tensors are read past, not copied. With a
placement (an ExpertMap on the MoE) row j holds the logical expert of the rank's j-th physical slot
(held_experts): a replicated expert is read once and copied into each of its rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .layers.expert_location import held_experts
from .layers.linear import shards
from .layers.moe import MoE
from .model import DeepseekForCausalLM

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Not weights: transformers may save rotary buffers in old checkpoints.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class WeightsError(ValueError):
    """The checkpoint does not fit the model; the message lists every problem found."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise WeightsError(f"{index}: not a safetensors index ({exc})") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightsError(f"index names shard files that do not exist: {missing}")
    return files


def load_weights(model: DeepseekForCausalLM, model_dir: str | Path) -> None:
    model_dir = Path(model_dir)
    cfg = model.config
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update({k: v for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
    sharded = shards(model)
    # "model.layers.N.mlp" -> {logical expert: its rows in this rank's w13 / w2} (all experts, one row each, without
    # expert parallelism; a placement's slots, where a replicated expert may fill several rows)
    held = {name: rows_by_expert(m) for name, m in model.named_modules() if isinstance(m, MoE)}
    filled: set[str] = set()
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    problems: list[str] = []
    unexpected: list[str] = []

    for path in checkpoint_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsError(f"{path.name}: corrupt or unreadable safetensors file ({exc})") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                layer = _LAYER.match(name)
                if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
                    model.mtp_weights[name] = f.get_tensor(name)
                    continue
                if _IGNORED.search(name):
                    continue
                expert = _EXPERT.match(name)
                experts = held.get(expert.group(1)) if expert else None
                if expert and experts is not None and int(expert.group(2)) in range(cfg.n_routed_experts):
                    if int(expert.group(2)) not in experts:  # another expert-parallel rank's: not even read
                        expert_parts.setdefault(expert.group(1), set()).add((int(expert.group(2)), expert.group(3)))
                        continue
                elif expert:  # no MoE at that layer, or an expert id past n_routed_experts
                    unexpected.append(name)
                    continue
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError, ValueError) as exc:
                    raise WeightsError(f"{path.name}: tensor {name} unreadable ({exc})") from exc
                if expert and experts is not None:
                    for row in experts[int(expert.group(2))]:
                        _load_expert(params, expert, row, tensor, cfg.moe_intermediate_size, expert_parts, problems,
                                     unexpected)  # fmt: skip
                    continue
                target = params.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                shard = sharded.get(name)
                full = list(target.shape)
                if shard is not None:
                    full[shard.dim] *= shard.size
                if tuple(full) != tuple(tensor.shape):
                    problems.append(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(full)}")
                    continue
                if shard is not None:
                    n = target.shape[shard.dim]
                    tensor = tensor.narrow(shard.dim, shard.rank * n, n)
                target.data.copy_(tensor.to(target.dtype))
                filled.add(name)

    if "lm_head.weight" not in filled and cfg.tie_word_embeddings and "model.embed_tokens.weight" in filled:
        params["lm_head.weight"].data.copy_(params["model.embed_tokens.weight"].data)
        filled.add("lm_head.weight")
    for prefix, parts in expert_parts.items():
        want = {(e, p) for e in range(cfg.n_routed_experts) for p in ("gate_proj", "up_proj", "down_proj")}
        missing_parts = sorted(want - parts)
        if missing_parts:
            problems.append(f"{prefix}.experts: missing {len(missing_parts)} tensors, e.g. {missing_parts[:3]}")
        filled.update({f"{prefix}.w13", f"{prefix}.w2"})
    missing = sorted(set(params) - filled)
    if missing or unexpected or problems:
        lines = [f"checkpoint {model_dir} does not fit the model ({cfg.model_type}):"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  unexpected: {n}" for n in sorted(unexpected)]
        lines += [f"  {p}" for p in problems]
        raise WeightsError("\n".join(lines))
    model.post_load()


def rows_by_expert(moe: MoE) -> dict[int, list[int]]:
    """{logical expert: the rows of moe.w13 / w2 that hold it} on this rank."""
    m = moe.expert_map
    experts = list(moe.dispatcher.experts) if m is None else held_experts(m.location, m.layer_id, m.ep_rank)
    rows: dict[int, list[int]] = {}
    for row, expert in enumerate(experts):
        rows.setdefault(expert, []).append(row)
    return rows


def read_moe_experts(model: DeepseekForCausalLM, model_dir: str | Path, layer_id: int,
                     experts: Collection[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's logical expert weights from the checkpoint, in the model's dtype: w13 [E, 2I, D] (gate_proj
    rows, then up_proj), w2 [E, D, I]: the weight source of a rebalance (expert_placement.update_chunks).
    experts: read only these (a rank's new slots hold P/G of the E); the other rows are left unwritten."""
    cfg = model.config
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    dtype = model.engine_config.torch_dtype
    w13, w2 = torch.empty(e, 2 * i, d, dtype=dtype), torch.empty(e, d, i, dtype=dtype)
    prefix = f"model.layers.{layer_id}.mlp.experts."
    wanted = set(range(e)) if experts is None else set(experts) & set(range(e))
    seen = 0
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                match = _EXPERT.match(name)
                if not name.startswith(prefix) or match is None or int(match.group(2)) not in wanted:
                    continue
                expert, part = int(match.group(2)), match.group(3)
                rows = slice(0, i) if part == "gate_proj" else slice(i, 2 * i)
                dest = w2[expert] if part == "down_proj" else w13[expert, rows]
                dest.copy_(f.get_tensor(name).to(dtype))
                seen += 1
    if seen != 3 * len(wanted):
        raise WeightsError(
            f"{model_dir}: layer {layer_id} has {seen} of the {3 * len(wanted)} routed-expert tensors it needs"
        )
    return w13, w2


def _load_expert(
    params: dict[str, torch.Tensor],
    match: re.Match[str],
    row: int,
    tensor: torch.Tensor,
    inter: int,
    expert_parts: dict[str, set[tuple[int, str]]],
    problems: list[str],
    unexpected: list[str],
) -> None:
    """row: the expert's row in this rank's w13 / w2."""
    prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
    w13, w2 = params.get(f"{prefix}.w13"), params.get(f"{prefix}.w2")
    if w13 is None or w2 is None or not 0 <= row < w13.shape[0]:
        unexpected.append(match.group(0))
        return
    if part == "down_proj":
        dest = w2.data[row]
    elif part == "gate_proj":
        dest = w13.data[row, :inter]
    else:
        dest = w13.data[row, inter:]
    if tuple(dest.shape) != tuple(tensor.shape):
        problems.append(f"{match.group(0)}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
        return
    dest.copy_(tensor.to(dest.dtype))
    expert_parts.setdefault(prefix, set()).add((expert, part))
