"""The README's Python example runs as written (the trained pair on this machine's device) and its DDTree
output equals greedy AR; every docs page the README links to exists."""
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _example() -> str:
    m = re.search(r"## A first run in Python\n\n```python\n(.*?)```", README, re.S)
    assert m, "README: the section 'A first run in Python' with a python block"
    return m.group(1)


def test_the_example_runs_and_is_lossless(tmp_path, monkeypatch, capsys):
    if not (ROOT / "data" / "trained" / "target").is_dir():
        pytest.skip("data/trained/ is not in this checkout")
    script = tmp_path / "example.py"
    script.write_text(_example())
    monkeypatch.chdir(ROOT)
    ns = runpy.run_path(str(script))
    out = capsys.readouterr().out
    assert re.search(r"tau \d+\.\d\d, \d+ tok/s", out), out
    from kdtree.oracle import oracle_ar
    res, prompt, target = ns["res"], ns["prompt"], ns["target"]
    assert len(res.tokens) == 48 and res.mean_accept_length > 1
    assert res.tokens == oracle_ar(target, prompt, 48).tokens


def test_linked_pages_exist():
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", README)
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link
