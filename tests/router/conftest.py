"""The toy tokenizer the RequestFlow tests' workers detokenize with (tests/router/flow_cluster.py)."""

from __future__ import annotations

import pytest

from pdserve.models.tokenizer_builder import write_tokenizer
from pdserve.tokenizer import Tokenizer
from tests.router.flow_cluster import VOCAB


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, VOCAB)
    return Tokenizer.from_dir(directory)
