"""The TargetLM protocol: what every backend declares, and that the library reads those declarations.

The loop, the methods, the batched engine and the bench ask a target for ``capabilities`` instead of probing it
for attributes or its class, so a backend with fewer capabilities gets the methods that fit it, or a clear error.
Deterministic tests: no false failures.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.target import TargetCapabilities, TargetLM
from jointspec.drafters.costaware import CostAwareDrafter
from jointspec.methods import MethodConfig, MethodContext, build_method


class ChainsOnly:
    """A target that scores chains and nothing more (as a new backend might start): it wraps the torch adapter but
    declares no trees, no features, no fork and no torch module."""

    capabilities = TargetCapabilities()

    def __init__(self, inner: CausalLM) -> None:
        self.inner = inner
        self.name = "chains-only"

    num_cached = property(lambda self: self.inner.num_cached)
    vocab_size = property(lambda self: self.inner.vocab_size)
    max_context = property(lambda self: self.inner.max_context)
    device = property(lambda self: self.inner.device)
    dtype = property(lambda self: self.inner.dtype)

    def reset(self, *, plain: bool = False, length: int | None = None) -> None:
        self.inner.reset()

    def forward(self, token_ids, *, parents=None, num_logits=None, output_hidden=False, argmax_only=False):
        if parents is not None or output_hidden:
            raise UnsupportedOptionError("chains only")
        return self.inner.forward(token_ids, num_logits=num_logits)

    def crop(self, length: int) -> None:
        self.inner.crop(length)

    def keep(self, positions: list[int]) -> None:
        if positions != list(range(len(positions))):
            raise UnsupportedOptionError("chains only")
        self.inner.crop(len(positions))

    def fork(self, name=None):
        raise AssertionError("fork() called on a target that declares no fork")


def test_the_torch_adapter_implements_the_protocol(target_model):
    target = CausalLM(target_model)
    assert isinstance(target, TargetLM)
    from jointspec.kernels.grouped import ROWWISE_MAX_ROWS

    # On a CPU a forward past ROWWISE_MAX_ROWS rows is read as a prompt: a verification must stay within it.
    rows = ROWWISE_MAX_ROWS if target.device.type == "cpu" else None
    assert target.capabilities == TargetCapabilities(trees=True, features=True, fork=True, torch_module=True,
                                                     sparse_view=True, max_verify_rows=rows)
    assert isinstance(ChainsOnly(target), TargetLM)


def test_sparse_self_needs_a_target_that_can_restrict_its_attention(target_model):
    with pytest.raises(UnsupportedOptionError, match="cannot restrict its attention"):
        build_method(MethodContext(MethodConfig(name="sparse-self"), ChainsOnly(CausalLM(target_model)), None, None))


def test_a_fork_shares_the_weights_and_owns_its_cache(target_model):
    target = CausalLM(target_model)
    target.forward([5, 6, 7])
    fork = target.fork()
    assert fork.model is target.model and fork.num_cached == 0 and target.num_cached == 3
    expected = target.forward([8]).logits
    fork.forward([5, 6, 7])
    assert torch.equal(fork.forward([8]).logits, expected)


def test_default_on_a_target_without_trees_or_features_drafts_chains(target_model, other_model):
    """Given a draft model, `default` verifies a tree of its top tokens on the torch adapter, and drafts chains
    (`hybrid`, cost-aware) on a target that declares no trees: never a tree it could not score."""
    load = lambda source: (CausalLM(other_model, name=source), None)  # noqa: E731
    config = MethodConfig(name="default", draft="other")
    on_torch, _ = build_method(MethodContext(config, CausalLM(target_model), None, load))
    assert hasattr(on_torch, "tree")
    on_chains, _ = build_method(MethodContext(config, ChainsOnly(CausalLM(target_model)), None, load))
    assert isinstance(on_chains, CostAwareDrafter) and not hasattr(on_chains.inner, "tree")
    assert type(on_chains.inner).__name__ == "HybridDrafter"


def test_self_draft_needs_a_fork(target_model):
    chains = ChainsOnly(CausalLM(target_model))
    with pytest.raises(UnsupportedOptionError, match="cannot be its own draft"):
        build_method(MethodContext(MethodConfig(name="sps", draft="self"), chains, None, None))
    drafter, _ = build_method(MethodContext(MethodConfig(name="sps", draft="self", cost_aware=False),
                                            CausalLM(target_model), None, None))
    assert drafter.draft.model is target_model  # the fork: same weights, its own cache
