"""A model small enough to count the communication ledger by hand (tests/model)."""

from smelt_model.config import LoopSpec, ModelConfig


def small_config(**changes) -> ModelConfig:
    """Per layer: attention 2*4*4 + 2*4*4 = 64, router 4*4 = 16, norms 8, experts
    4*3*4*2 = 96 parameters; H = 4, so a bf16 row is 8 bytes."""
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=4,
        n_layers=2,
        n_heads=1,
        n_kv_heads=1,
        head_dim=4,
        n_experts=4,
        expert_size=2,
        top_k=2,
    )
    return cfg.replace(**changes)


def small_looped() -> ModelConfig:
    """Four layers, the middle two looped twice: executed 0, 1, 2, 1, 2, 3."""
    return small_config(n_layers=4, loop=LoopSpec(start=1, length=2, count=2))
