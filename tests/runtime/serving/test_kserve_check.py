"""The docs' Kubernetes manifests against KServe's and Kubernetes' schemas, without a cluster.

The checks run in the KServe environment (``python -m tfgraph.runtime.serving.kserve_check
--install``: the ``kserve`` SDK's generated models and the ``kubernetes`` client); without it
those tests skip with that command. All manifests go to one probe process (~4 s: it imports
the SDK).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tfgraph.errors import TfgraphError
from tfgraph.runtime.serving import kserve_check as kc

DOCS = Path(__file__).resolve().parents[3] / "docs"

GOOD_ISVC = """\
apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata:
  name: llama
spec:
  predictor:
    minReplicas: 1
    maxReplicas: 4
    triton:
      storageUri: pvc://models/repo
      args: ["--model-control-mode=poll"]
"""
DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: serve
spec:
  selector:
    matchLabels:
      app: serve
  template:
    metadata:
      labels:
        app: serve
    spec:
      containers:
      - name: serve
        readinessProbe:
          httpGet:
            path: /health
            port: 8000
"""
BROKEN = {  # a manifest with one mistake → a word its problem must hold
    "a misspelt field": (GOOD_ISVC.replace("minReplicas", "minReplica"), "minReplica"),
    "a wrong type": (GOOD_ISVC.replace("maxReplicas: 4", "maxReplicas: four"), "maxReplicas"),
    "a string for a list": (GOOD_ISVC.replace('["--model-control-mode=poll"]', "poll"), "args"),
    "a container without a name": (
        GOOD_ISVC.replace(
            "    triton:\n      storageUri: pvc://models/repo\n      args: "
            '["--model-control-mode=poll"]\n',
            "    containers:\n    - image: tfgraph\n",
        ),  # fmt: skip
        "containers[0].name",
    ),
    "an unknown metadata key": (GOOD_ISVC.replace("  name: llama", "  nmae: llama"), "nmae"),
    "a Deployment's misspelt probe": (
        DEPLOYMENT.replace("readinessProbe", "readinesProbe"),
        "readinesProbe",
    ),
    "another kind": (GOOD_ISVC.replace("InferenceService", "InferenceServise"), "kind"),
}


def _env_or_skip() -> None:
    try:
        kc.find_kserve_env()
    except TfgraphError as exc:
        pytest.skip(str(exc))


def test_yaml_blocks_are_the_fenced_manifests():
    text = "x\n```yaml\nkind: A\n```\n```bash\nkind: B\n```\n```yaml\nfoo: 1\n```\n"
    assert kc.yaml_blocks(text) == ["kind: A\n"]  # a yaml block without kind: is no manifest


def test_a_missing_environment_names_the_install_command(tmp_path):
    with pytest.raises(TfgraphError, match=r"no KServe environment .*kserve_check --install"):
        kc.find_kserve_env(tmp_path / "none")


@pytest.fixture(scope="module")
def checked():
    """Every docs manifest, the good one and each broken one, checked in one probe run."""
    _env_or_skip()
    docs = [(f.name, t) for f in (DOCS / "serving.md", DOCS / "scale-out.md") if f.exists()
            for t in kc.yaml_blocks(f.read_text())]  # fmt: skip
    texts = [t for _, t in docs] + [GOOD_ISVC, DEPLOYMENT] + [t for t, _ in BROKEN.values()]
    results = kc.check_manifests(texts)
    named = dict(zip(["good", "deployment", *BROKEN], results[len(docs) :], strict=True))
    return docs, results[: len(docs)], named


def test_the_docs_manifests_pass_the_schemas(checked):
    docs, results, named = checked
    assert any("kind: InferenceService" in t for _, t in docs), "no InferenceService in the docs"
    for (name, text), problems in zip(docs, results, strict=True):
        assert problems == [], (name, text, problems)
    assert named["good"] == [] and named["deployment"] == []


@pytest.mark.parametrize("mistake", list(BROKEN))
def test_each_mistake_is_named(checked, mistake):
    problems = checked[2][mistake]
    assert problems and any(BROKEN[mistake][1] in p for p in problems), problems
