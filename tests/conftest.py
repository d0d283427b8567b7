import pytest

import tfgraph


@pytest.fixture(scope="session")
def gpt_artifact(tmp_path_factory):
    """One exported gpt-tiny artifact shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("artifacts") / "gpt-tiny"
    result = tfgraph.export("gpt-tiny", out, check_each_pass=True)
    return result


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory):
    """A random-init GPT-2 saved with save_pretrained (no download)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)  # the exact config
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(path)
    return path
