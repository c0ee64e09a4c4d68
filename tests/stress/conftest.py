from __future__ import annotations

import pytest

from tests.conftest import make_tiny_model


@pytest.fixture(scope="session")
def stress_model(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with a 2k context, so 1500-token prompts fit."""
    return make_tiny_model(tmp_path_factory.mktemp("stress-llama"), "llama", tie_word_embeddings=True,
                           max_position_embeddings=2048)
