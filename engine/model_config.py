"""ModelConfig: every config.json field DeepSeek-V2/V3 use, validated once, read everywhere.

Fields are grouped as DeepSeek's own ModelArgs groups them (# mla, # moe, # yarn). A missing, unknown
or inconsistent value raises ConfigError naming the field and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
ScoringFunc = Literal["softmax", "sigmoid"]

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


class ConfigError(ValueError):
    """A config.json value is missing, unknown or inconsistent; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN as DeepSeek defines it (only `yarn` and no scaling are supported)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    # mla
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # moe
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: TopkMethod
    scoring_func: ScoringFunc
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    # rope / yarn
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    # misc
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_layer_freq",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank={self.q_lora_rank!r}: must be a positive integer or null")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates pairs, must be even")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"topk_method={self.topk_method!r}: expected greedy, group_limited_greedy or noaux_tc")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"scoring_func={self.scoring_func!r}: expected softmax or sigmoid")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_group={self.n_group} does not divide n_routed_experts={self.n_routed_experts}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.topk_method != "greedy" and self.topk_group * self.experts_per_group < self.num_experts_per_tok:
            raise ConfigError(
                f"topk_group={self.topk_group} groups of {self.experts_per_group} experts cannot hold "
                f"num_experts_per_tok={self.num_experts_per_tok}"
            )
        if self.topk_method == "noaux_tc" and self.experts_per_group < 2 and self.n_group > 1:
            raise ConfigError(f"noaux_tc scores a group by its top-2 experts; n_group={self.n_group} leaves 1")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace={self.first_k_dense_replace} outside 0..{self.num_hidden_layers}"
            )
        if self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts={self.n_shared_experts}: must be >= 0")
        if self.routed_scaling_factor <= 0:
            raise ConfigError(f"routed_scaling_factor={self.routed_scaling_factor}: must be > 0")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only silu is supported")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(f"eos_token_id={eos} outside the vocabulary 0..{self.vocab_size - 1}")

    # derived values
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per token per layer in the latent cache: compressed kv plus the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's definition)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ConfigError(f"config.json not found at {cfg_file}")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_file}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, name=path.name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type={model_type!r}: expected one of {SUPPORTED_MODEL_TYPES}")
        is_v3 = model_type == "deepseek_v3"

        def req(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{key} is missing from config.json (model_type={model_type})")
            return raw[key]

        def opt(key: str, default: Any) -> Any:
            value = raw.get(key)
            return default if value is None else value

        rope_theta, rope_scaling = _parse_rope(raw)
        scoring = opt("scoring_func", "sigmoid" if is_v3 else "softmax")
        method = opt("topk_method", "noaux_tc" if is_v3 else "greedy")
        n_group = opt("n_group", 1)
        topk_group = opt("topk_group", 1)
        if method == "greedy":
            # Groups play no part in greedy routing; V2 configs often carry n_group=null.
            n_group, topk_group = max(1, n_group), max(1, topk_group)
        eos = raw.get("eos_token_id")
        eos_ids: tuple[int, ...] = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        num_heads = req("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != num_heads:
            raise ConfigError(
                f"num_key_value_heads={kv_heads}: MLA shares one latent across heads; must equal "
                f"num_attention_heads={num_heads}"
            )
        return cls(
            model_type=model_type,
            vocab_size=req("vocab_size"),
            hidden_size=req("hidden_size"),
            num_hidden_layers=req("num_hidden_layers"),
            intermediate_size=req("intermediate_size"),
            rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
            num_attention_heads=num_heads,
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=req("kv_lora_rank"),
            qk_nope_head_dim=req("qk_nope_head_dim"),
            qk_rope_head_dim=req("qk_rope_head_dim"),
            v_head_dim=req("v_head_dim"),
            moe_intermediate_size=req("moe_intermediate_size"),
            n_routed_experts=req("n_routed_experts"),
            n_shared_experts=opt("n_shared_experts", 0),
            num_experts_per_tok=req("num_experts_per_tok"),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=method,
            scoring_func=scoring,
            norm_topk_prob=bool(opt("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(opt("routed_scaling_factor", 1.0)),
            first_k_dense_replace=opt("first_k_dense_replace", 0),
            moe_layer_freq=opt("moe_layer_freq", 1),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=opt("max_position_embeddings", 4096),
            tie_word_embeddings=bool(opt("tie_word_embeddings", False)),
            num_nextn_predict_layers=opt("num_nextn_predict_layers", 0),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=opt("hidden_act", "silu"),
            name=name,
            extra={k: v for k, v in raw.items()},
        )

    def to_dict(self) -> dict[str, Any]:
        """The subset written into trace manifests and hashed for `config_hash`."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("extra", "rope_scaling")}
        out["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling.__dict__)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta + rope_scaling (DeepSeek's and transformers v4 layout) or rope_parameters (v5)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type={kind!r}: only yarn (or no scaling) is supported")
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise ConfigError(f"rope_scaling.{key} is missing for yarn")
    if scaling.get("attention_factor") is not None:
        raise ConfigError(
            f"rope_scaling.attention_factor={scaling['attention_factor']}: DeepSeek derives it from mscale; "
            "an explicit value is not supported"
        )
    rs = RopeScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling.get("mscale") or 1.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )
    if rs.factor < 1:
        raise ConfigError(f"rope_scaling.factor={rs.factor}: must be >= 1")
    return float(theta), rs
