"""``oracle``: the target's own greedy continuation with a chosen share corrupted, so acceptance is known in advance
and a timed run measures the loop's own overhead (``jointspec bench``; the drafter is drafters/oracle.py)."""

from __future__ import annotations

from dataclasses import dataclass

from jointspec.drafters.oracle import OracleDrafter
from jointspec.methods.registry import MethodConfig, MethodContext, register_method
from jointspec.verifiers.rejection import RejectionSamplingVerifier


@dataclass(frozen=True)
class OracleConfig(MethodConfig):
    """``MethodConfig`` plus the oracle's knobs: the share of draft tokens to corrupt and the seed that picks them."""

    name: str = "oracle"
    corruption_rate: float = 0.0
    corruption_seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.corruption_rate <= 1.0:
            raise ValueError(f"corruption_rate must be in [0, 1], got {self.corruption_rate}")


@register_method("oracle",
                 "the target's own greedy continuation, a share corrupted (measures loop overhead) (lossless)",
                 lossless=True,
                 reads=("num_draft_tokens", "corruption_rate", "corruption_seed"))
def _build_oracle(context: MethodContext) -> tuple[OracleDrafter, RejectionSamplingVerifier]:
    config = context.config
    drafter = OracleDrafter(context.target, config.num_draft_tokens, getattr(config, "corruption_rate", 0.0),
                            getattr(config, "corruption_seed", 0))
    return drafter, RejectionSamplingVerifier()
