"""Fixtures shared by every test module: tiny random models built in process (fp32, CPU), no downloads, forward
passes well under a millisecond. The builders themselves live in ``helpers.py`` (the tree verifiers' tables in
``tree_tables.py``); no test module imports another.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from jointspec.backends.hf import CausalLM
from jointspec.train.heads import HeadTrainConfig, HeadTrainer

from helpers import SPEC_BENCH_LINES, TEST_DEVICE, byte_tokenizer, tiny_llama, tiny_tokenizer, tiny_training_data


def pytest_report_header(config):
    return f"jointspec tiny models on: {TEST_DEVICE} (JOINTSPEC_TEST_DEVICE)"


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


@pytest.fixture(autouse=True, scope="session")
def no_kept_cost_curves():
    """`jointspec generate` keeps measured cost curves in the user's cache (drafters/curve_store.py); the suite's CLI
    runs measure afresh and leave that cache alone, except where a test turns the store on for its own folder."""
    previous = os.environ.get("JOINTSPEC_COST_CURVES")
    os.environ["JOINTSPEC_COST_CURVES"] = "off"
    yield
    if previous is None:
        os.environ.pop("JOINTSPEC_COST_CURVES", None)
    else:
        os.environ["JOINTSPEC_COST_CURVES"] = previous


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


@pytest.fixture(scope="session")
def trained_head_dir(tmp_path_factory, target_model):
    """A head trained for the tiny target on its own greedy continuations of 48 random prompts (once per session:
    the head, hybrid, default-method and training tests all read it; none writes into its folder)."""
    target = CausalLM(target_model, name="tiny-target")
    data = tiny_training_data(tmp_path_factory, target_model)
    out = tmp_path_factory.mktemp("head")
    config = HeadTrainConfig(draft_vocab_size=None, epochs=40, batch_tokens=512, learning_rate=3e-3,
                             warmup_steps=10, eval_every=40, patience=100, eval_fraction=0.1)
    HeadTrainer(target, config).train(data, out, progress=False)
    return out


@pytest.fixture()
def bench_prompt_file(tmp_path):
    """helpers.SPEC_BENCH_LINES written as a SpecBench-style question.jsonl (with a trailing blank line)."""
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in SPEC_BENCH_LINES) + "\n\n")
    return path


# -- the server tests' model: bytes in, bytes out, so any prompt text round-trips ----------------------------------

@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level tokenizer (259 ids); test modules with another tokenizer define their own fixture."""
    return byte_tokenizer()


@pytest.fixture(scope="session")
def byte_model():
    return tiny_llama(3, vocab=259)


@pytest.fixture(scope="module")
def long_byte_model():
    """The byte model with room for long prompts (tools, templates): 2,048 positions."""
    from helpers import tiny_llama

    return tiny_llama(3, vocab=259, max_positions=2048)


@pytest.fixture(scope="module")
def byte_engine(long_byte_model):
    """A serving engine on the long byte model and a byte tokenizer of its own (its template the server tests')."""
    from jointspec.backends.hf import CausalLM
    from jointspec.server.engine import ServingEngine

    from helpers import byte_tokenizer

    served = ServingEngine(CausalLM(long_byte_model), byte_tokenizer(), model_id="tiny", max_batch_size=4)
    yield served
    served.close()


@pytest.fixture(scope="module")
def byte_client(byte_engine):
    """The server's app on :func:`byte_engine`, in process."""
    from fastapi.testclient import TestClient

    from jointspec.server.app import ServerSettings, create_app

    return TestClient(create_app(ServerSettings(), byte_engine))
