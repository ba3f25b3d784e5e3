"""Fixtures for the model package: one tiny built-in checkpoint per test session."""

from pathlib import Path

import pytest

from pdq.model import load_tokenizer, save_builtin


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_builtin(tmp_path_factory.mktemp("builtin") / "tiny", size="tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    """The built-in tokenizer as the gateway loads it: a plain ``tokenizers.Tokenizer``."""
    return load_tokenizer(tiny_dir)
