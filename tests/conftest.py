"""Fixtures shared by every test module: tiny random models built in process (fp32, CPU), no downloads, forward
passes well under a millisecond. The builders themselves live in ``helpers.py``; no test module imports another.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import tiny_llama, tiny_tokenizer
from jointspec.backends.hf import CausalLM


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test runs with one intra-op thread, restored afterwards. The tiny models run hundreds of
    sub-millisecond forwards, and on a shared 2-core machine a second thread spends more time synchronising than
    computing: a 40-token tiny decode took 6 s with 2 threads and 0.3 s with 1, and the real-model test 253 s vs 18 s
    under load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def target_model() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="session")
def other_model() -> LlamaForCausalLM:
    return tiny_llama(1)


@pytest.fixture()
def target(target_model) -> CausalLM:
    return CausalLM(target_model, name="tiny-target")


@pytest.fixture()
def other(other_model) -> CausalLM:
    return CausalLM(other_model, name="tiny-other")


@pytest.fixture(scope="module")
def bench_tokenizer():
    """helpers.tiny_tokenizer: English words over the tiny models' 99 ids, with a minimal chat template."""
    return tiny_tokenizer()
