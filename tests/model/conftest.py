"""The plain checkpoint the quantized-weight tests derive theirs from, written once per module."""

import pytest

from tests.support.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("plain"), "llama")
