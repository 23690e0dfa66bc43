"""Checkpoint conversion between :class:`SmeltLM` (baseline) and transformers'
``MixtralForCausalLM``.

The unlooped smelt model is numerically Mixtral: rotate-half RoPE, the same GQA head
mapping, pre-norm RMSNorm, a softmax -> top-k -> renormalise router over SwiGLU experts
stored gate rows first as (E, 2·d_e, H) and (E, H, d_e), an untied LM head. Conversion is
therefore a renaming of tensors, each copied bit for bit in its dtype:

    from smelt_model.convert import from_hf, to_hf
    smelt = from_hf(hf_model)            # or from_hf("saved/mixtral/folder")
    hf = to_hf(smelt)                    # a MixtralForCausalLM

The names come from one table (:data:`LAYER_KEYS`, :data:`TOP_KEYS`): a Mixtral name on the
left, the smelt name on the right, so a renamed smelt module changes one entry, not code.
Every tensor on both sides must be matched exactly once, or the conversion stops with the
names it could not place.

Refused with a ``ValueError`` that says why: a looped SMELT model in :func:`to_hf` (its span
layers run r times with shared weights and 1/r residual scales, which no Mixtral config can
say; keep it in smelt's own format, :meth:`SmeltLM.save_pretrained`), a router without
renormalisation or with a z-loss, and in :func:`from_hf` any Mixtral option smelt does not
compute (sliding window, non-default RoPE scaling, router jitter, attention dropout, another
activation, another architecture). The router's auxiliary-loss coefficient carries over as
``aux_loss_weight`` <-> ``router_aux_loss_coef``; transformers adds it to the loss only with
``output_router_logits=True``, smelt reports it beside the loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import torch

from smelt_model.config import ModelConfig
from smelt_model.model import SmeltLM

__all__ = ["from_hf", "to_hf", "config_from_hf", "config_to_hf", "LAYER_KEYS", "TOP_KEYS"]

#: per layer: Mixtral name (under ``model.layers.{i}.``) -> smelt name (under the block)
LAYER_KEYS: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "post_attention_layernorm.weight": "moe_norm.weight",
    "mlp.gate.weight": "moe.router.weight",
    "mlp.experts.gate_up_proj": "moe.gate_up_proj",
    "mlp.experts.down_proj": "moe.down_proj",
}
#: outside the layers: Mixtral name -> smelt name
TOP_KEYS: dict[str, str] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


# ---------------------------------------------------------------------- configs
def _rope_theta(hcfg) -> float:
    rp = getattr(hcfg, "rope_parameters", None) or {}
    kind = rp.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"from_hf: RoPE type {kind!r} is not computed by smelt (default only)")
    theta = rp.get("rope_theta", getattr(hcfg, "rope_theta", None))
    if theta is None:
        raise ValueError("from_hf: the config has no rope_theta")
    return float(theta)


def config_from_hf(hcfg) -> ModelConfig:
    """A :class:`ModelConfig` for a ``MixtralConfig``; refuses what smelt does not compute."""
    mt = getattr(hcfg, "model_type", None)
    if mt != "mixtral":
        raise ValueError(
            f"from_hf converts Mixtral-layout models, got model_type={mt!r}; other "
            "families run smelt's kernels in place with "
            "experts_implementation='smelt' (import smelt_kernels.hf)"
        )
    checks = (
        (
            getattr(hcfg, "hidden_act", "silu") not in ("silu", "swish"),
            f"hidden_act={getattr(hcfg, 'hidden_act', None)!r} (smelt experts are SwiGLU)",
        ),
        (
            getattr(hcfg, "sliding_window", None) is not None,
            f"sliding_window={getattr(hcfg, 'sliding_window', None)} (smelt attends to the whole "
            "document)",
        ),
        (
            float(getattr(hcfg, "router_jitter_noise", 0.0) or 0.0) != 0.0,
            f"router_jitter_noise={getattr(hcfg, 'router_jitter_noise', None)}",
        ),
        (
            float(getattr(hcfg, "attention_dropout", 0.0) or 0.0) != 0.0,
            f"attention_dropout={getattr(hcfg, 'attention_dropout', None)}",
        ),
    )
    for bad, what in checks:
        if bad:
            raise ValueError(f"from_hf: smelt has no equivalent of {what}")
    n_heads = hcfg.num_attention_heads
    head_dim = getattr(hcfg, "head_dim", None) or hcfg.hidden_size // n_heads
    return ModelConfig(
        vocab_size=hcfg.vocab_size,
        hidden_size=hcfg.hidden_size,
        n_layers=hcfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=hcfg.num_key_value_heads or n_heads,
        head_dim=head_dim,
        n_experts=hcfg.num_local_experts,
        expert_size=hcfg.intermediate_size,
        top_k=hcfg.num_experts_per_tok,
        loop=None,
        rope_theta=_rope_theta(hcfg),
        norm_eps=float(hcfg.rms_norm_eps),
        router_renormalize=True,
        aux_loss_weight=float(getattr(hcfg, "router_aux_loss_coef", 0.0) or 0.0),
        z_loss_weight=0.0,
    )


def config_to_hf(cfg: ModelConfig, max_position_embeddings: int = 32768, **overrides: Any):
    """A ``MixtralConfig`` for an unlooped :class:`ModelConfig`; refuses a looped one."""
    # transformers is optional (the [hf] extra): only a conversion needs it
    from transformers import MixtralConfig

    if cfg.is_looped:
        a, b = cfg.loop.one_based()
        raise ValueError(
            f"to_hf: a looped SMELT model (layers {a}-{b} run {cfg.loop.count} times with shared "
            "weights and 1/r residual scales) has no MixtralForCausalLM equivalent; keep it in "
            "smelt's format (SmeltLM.save_pretrained)"
        )
    if not cfg.router_renormalize:
        raise ValueError(
            "to_hf: Mixtral always renormalises the top-k router weights; this "
            "model has router_renormalize=False"
        )
    if cfg.z_loss_weight > 0:
        raise ValueError(f"to_hf: Mixtral has no router z-loss (z_loss_weight={cfg.z_loss_weight})")
    kw = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.expert_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        router_aux_loss_coef=cfg.aux_loss_weight,
    )
    kw.update(overrides)
    return MixtralConfig(**kw)


# ---------------------------------------------------------------------- tensor names
def _layer_prefixes(model) -> list[str]:
    """The state-dict prefix of each physical layer of a SmeltLM, in layer order."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(model.layer(i))] + "." for i in range(model.cfg.n_layers)]


def key_map(model) -> dict[str, str]:
    """Mixtral state-dict name -> SmeltLM state-dict name, for every tensor of ``model``."""
    sd = model.state_dict()
    mapping: dict[str, str] = {}

    def place(hf_name: str, name: str) -> None:
        if name not in sd:
            raise ValueError(
                f"convert: no SmeltLM tensor {name} for {hf_name}; the "
                "conversion table needs updating"
            )
        mapping[hf_name] = name

    for hf_name, name in TOP_KEYS.items():
        place(hf_name, name)
    for i, prefix in enumerate(_layer_prefixes(model)):
        for suffix, name in LAYER_KEYS.items():
            place(f"model.layers.{i}.{suffix}", prefix + name)
    used = set(mapping.values())
    left = sorted(set(sd) - used)
    if left or len(used) != len(mapping):
        raise ValueError(f"convert: SmeltLM tensors not in the conversion table: {left}")
    return mapping


def _copy(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], pairs) -> None:
    with torch.no_grad():
        for d, s in pairs:
            if s not in src:
                raise ValueError(f"convert: the source model has no tensor {s}")
            a, b = dst[d], src[s]
            if a.shape != b.shape:
                raise ValueError(
                    f"convert: {s} has shape {tuple(b.shape)}, {d} expects {tuple(a.shape)}"
                )
            a.copy_(b)


def _check_covered(hf_state: dict, names: dict, what: str) -> None:
    left = sorted(set(hf_state) - set(names))
    if left:
        raise ValueError(f"convert: {what} has tensors smelt has no place for: {left[:8]}")


def _state(model, hf: bool) -> dict[str, torch.Tensor]:
    sd = model.state_dict(keep_vars=False)
    if hf and "lm_head.weight" not in sd:  # a tied head is stored once
        sd["lm_head.weight"] = model.get_output_embeddings().weight
    return sd


# ---------------------------------------------------------------------- conversion
def _load_hf(path: Union[str, Path]):
    # transformers is optional, as above
    from transformers import AutoConfig, AutoModelForCausalLM

    src = Path(path)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(
            f"from_hf: {src / 'config.json'} not found (expected a folder "
            "written by save_pretrained)"
        )
    hcfg = AutoConfig.from_pretrained(str(src), local_files_only=True)
    config_from_hf(hcfg)  # refuse before reading any weights
    return AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, dtype="auto")


def from_hf(model_or_path, **kwargs) -> SmeltLM:
    """A :class:`SmeltLM` with the weights of a Mixtral-layout transformers model (or of
    the folder it was saved to), copied exactly, in the source's dtype and on its device.
    ``kwargs`` go to :class:`SmeltLM` (``backend``, ``recompute``)."""
    hf = _load_hf(model_or_path) if isinstance(model_or_path, (str, Path)) else model_or_path
    if not isinstance(hf, torch.nn.Module) or not hasattr(hf, "config"):
        raise TypeError(
            f"from_hf: expected a transformers model or a folder, got "
            f"{type(model_or_path).__name__}"
        )
    cfg = config_from_hf(hf.config)
    src = _state(hf, hf=True)
    w = src["model.embed_tokens.weight"] if "model.embed_tokens.weight" in src else None
    if w is None:
        raise ValueError(
            "from_hf: the model has no model.embed_tokens.weight (is it a MixtralForCausalLM?)"
        )
    model = SmeltLM(cfg, **kwargs).to(device=w.device, dtype=w.dtype)
    names = key_map(model)
    _check_covered(src, names, "the source model")
    _copy(model.state_dict(), src, [(s, h) for h, s in names.items()])
    return model


def to_hf(model, **config_overrides: Any):
    """A ``MixtralForCausalLM`` with the weights of an unlooped :class:`SmeltLM`, copied
    exactly, in its dtype and on its device. A looped model is refused (see the module
    docstring). ``config_overrides`` go to the ``MixtralConfig`` (e.g.
    ``max_position_embeddings``)."""
    # transformers is optional, as above
    from transformers import MixtralForCausalLM

    if not isinstance(model, SmeltLM):
        raise TypeError(f"to_hf: expected a SmeltLM, got {type(model).__name__}")
    hcfg = config_to_hf(model.cfg, **config_overrides)
    names = key_map(model)
    src = model.state_dict()
    w = src[names["model.embed_tokens.weight"]]
    hf = MixtralForCausalLM(hcfg).to(device=w.device, dtype=w.dtype)
    dst = _state(hf, hf=True)
    _check_covered(dst, names, "the MixtralForCausalLM")
    _copy(dst, src, names.items())
    return hf
