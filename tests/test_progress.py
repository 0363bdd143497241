import importlib.util
import warnings

import tqdm.auto

from kdtree import progress


def test_progress_bars_take_the_widget_only_where_ipywidgets_is_installed(monkeypatch):
    """Without ipywidgets the bar is tqdm's text bar (no TqdmWarning: tqdm.auto warns inside a Jupyter kernel
    without it); with it, tqdm.auto's (a stand-in here, so that a bar that always took one of the two
    fails)."""
    from tqdm.std import tqdm as text

    class Widget(text):
        pass
    monkeypatch.setattr(tqdm.auto, "tqdm", Widget)
    real = importlib.util.find_spec
    for have, want in ((False, text), (True, Widget)):
        def find(name, *a, have=have):   # ipywidgets present (any spec) or absent
            return (real("tqdm") if have else None) if name == "ipywidgets" else real(name, *a)
        monkeypatch.setattr(importlib.util, "find_spec", find)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            bar = progress.tqdm(range(3), disable=True)
        assert type(bar) is want, have
        bar.close()
