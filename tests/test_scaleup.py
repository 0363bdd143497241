"""docs/scale_up_k2.6.md is what kdtree.scaleup computes from the model's code and the committed records."""
import json

import pytest

from kdtree import scaleup

DOC = scaleup.ROOT / "docs" / "scale_up_k2.6.md"


def test_the_page_equals_its_figures():
    assert DOC.read_text() == scaleup.report(), "docs/scale_up_k2.6.md is stale: run python -m kdtree.scaleup"


def test_the_check_fails_on_a_changed_record(tmp_path):
    rec = json.loads((scaleup.RECORDS / "bridge.json").read_text())
    rec["rows"][0]["native_graph_s"] *= 2
    p = tmp_path / "bridge.json"
    p.write_text(json.dumps(rec))
    assert scaleup.report(bridge_path=p) != DOC.read_text()


def test_weights_add_up():
    w = scaleup.weights()
    routed = next(r for r in w["rows"] if r["kind"].startswith("routed"))
    assert routed["bytes"] == 60 * 384 * 3 * 7168 * 2048 * (0.5 + 2 / 32)
    assert w["total"] == pytest.approx(sum(r["bytes"] for r in w["rows"]))
    emb = next(r for r in w["rows"] if r["kind"].startswith("embeddings"))
    assert emb["bytes"] == 2 * 163840 * 7168 * 2 and emb["per_rank"] == emb["bytes"]
    assert scaleup.kv_bytes()["target_per_token"] == 61 * 576 * 2
