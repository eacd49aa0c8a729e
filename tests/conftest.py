"""Shared fixtures: tiny random checkpoints, built once per test session (about 0.1 s each
after the first, which also trains the tokenizer)."""

from __future__ import annotations

import os
import tempfile

import pytest

# Caches of this run only (profiles, compiled forwards), and no compiled forward built behind a
# test's back (tests/engine/test_compiled.py builds its own); child processes inherit both.
os.environ["SPECSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="specserve-test-cache-")
os.environ["SPECSERVE_COMPILE_BUILDS"] = "0"

from tests.checkpoints import make_checkpoint


def _checkpoint(tmp_path_factory, arch: str, **overrides):
    return make_checkpoint(tmp_path_factory.mktemp(f"tiny_{arch}"), arch=arch, **overrides)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_checkpoints(tiny_llama, tiny_qwen2, tiny_qwen3, tiny_mistral):
    """arch name -> checkpoint directory, for tests parametrized over every architecture."""
    return {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "mistral": tiny_mistral}
