"""``ort_probe``'s ``kernels_only`` mode: the attention kernels alone, on the graph's inputs.

The kernels-alone graph must hold exactly the artifact's attention nodes and compute what
they computed inside the whole graph (same inputs captured from one run), so the bench's
kernel floor measures those kernels and nothing else. No timing assertions.
"""

import json

import numpy as np
import onnx
import pytest

from tfgraph.bench import ort_probe
from tfgraph.bench.exporters import tfgraph_peer

SPEC = {"threads": 1, "optimize": True}


# slow: t5-tiny (16 s); llama-tiny's kernels stay in the default tier
@pytest.mark.parametrize(
    "preset, kind",
    [("llama-tiny", "causal"), pytest.param("t5-tiny", "seq2seq", marks=pytest.mark.slow)],
)
def test_kernels_alone_compute_what_they_computed_in_the_graph(tmp_path, preset, kind):
    built = tfgraph_peer(preset, kind, tmp_path, high=250)
    path, inputs, bind = built["step"](16)
    rng = np.random.default_rng(0)
    feeds = {name: ort_probe._feed(name, desc, rng) for name, desc in inputs.items()}
    session, sub_feeds = ort_probe._kernels_alone(str(path), SPEC, dict(feeds))
    # the nodes of the kernels-alone graph are the artifact's kernels, nothing else
    proto = onnx.load(path)
    kernels = [
        n for n in proto.graph.node if (n.domain, n.op_type) in ort_probe.attention_kernels()
    ]
    assert kernels
    names = [o.name for o in session.get_outputs()]
    assert names == [o for n in kernels for o in n.output if o]
    # the same values as inside the whole graph, computed there with every output exposed
    whole = onnx.ModelProto()
    whole.CopyFrom(proto)
    infos = {v.name: v for v in proto.graph.value_info}
    whole.graph.output.extend(infos[n] for n in names if n in infos)
    full = ort_probe._session(whole.SerializeToString(), SPEC)
    expected = dict(zip([o.name for o in full.get_outputs()], full.run(None, feeds), strict=True))
    got = dict(zip(names, session.run(None, sub_feeds), strict=True))
    for name in names:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_probe_times_the_kernels_alone(tmp_path):
    built = tfgraph_peer("llama-tiny", "causal", tmp_path, high=250)
    path, inputs, bind = built["step"](32)
    out = ort_probe.probe(path, inputs, repeats=2, threads=1, bind=bind, kernels_only=True)
    json.dumps(out, allow_nan=False)
    assert out["seconds"] > 0
