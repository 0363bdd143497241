"""Progress bars: tqdm's notebook widget where ipywidgets is installed, its text bar elsewhere.

`tqdm.auto` picks the widget inside any Jupyter kernel and, without ipywidgets, warns (TqdmWarning:
IProgress not found) in every notebook run by papermill; the lab does not need the widget, so it asks for
it only where it can be drawn."""
from __future__ import annotations

import importlib.util


def tqdm(*args, **kwargs):
    """A tqdm bar (the arguments of tqdm.tqdm): tqdm.auto's where ipywidgets is installed, else tqdm.std's."""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm as bar
    else:
        from tqdm.std import tqdm as bar
    return bar(*args, **kwargs)
