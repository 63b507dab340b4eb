"""The (model, script) matrix, a tier of its own: every script on every model of docs/models.py
(Hugging Face's Llama, tied and untied, GPT-2, Mixtral, and a CNN), in float64, ends within
1e-9 of single.py on that model, or refuses before training in one line; never a traceback, a
hang or a gap. And docs/models.md's table says what these runs did.

    python -m pytest -q -rs tests/test_matrix.py --matrix   # ~90 launches, by hand

Without --matrix (the README's command) its tests skip, saying so: the matrix stays out of the
suite's 10 minutes. Without transformers (tests/requirements.txt) they skip too."""

import difflib
import importlib.util
import re

import pytest

import conftest
from conftest import REPO, early_results

HF = importlib.util.find_spec("transformers") is not None
spec = importlib.util.spec_from_file_location("models_table", REPO / "docs" / "models.py")
models_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models_table)
MODELS = list(models_table.MODELS)
CELLS = [(m, s) for m in MODELS for s in models_table.SCRIPTS]


def early_launches(folder):  # queued when the tests are collected (conftest.py)
    if not (conftest.MATRIX and HF):
        return [], None
    for model in MODELS:
        models_table.copy_of_the_scripts(folder, model)
    return list(models_table.commands(folder, MODELS).values()), None


@pytest.fixture(scope="module")
def found():
    if not conftest.MATRIX:
        pytest.skip("the (model, script) matrix runs with --matrix: python -m pytest -q -rs "
                    "tests/test_matrix.py --matrix (by hand: 7-8 minutes on 2 cores)")
    if not HF:
        pytest.skip("needs transformers (pip install -r tests/requirements.txt)")
    folder, results = early_results(__name__)
    cmd = models_table.commands(folder, MODELS)  # the launched ones, in the same order
    by_cell = dict(zip(cmd, results))
    return {(m, s): models_table.verdict(by_cell[m, s], by_cell[m, "single"], cmd[m, s],
                                         cmd[m, "single"]) for m, s in CELLS}


@pytest.mark.parametrize("model, script", CELLS)
def test_every_cell_equals_one_device_in_fp64_or_is_refused_in_one_line(found, model, script):
    kind, what = found[model, script]
    assert kind in ("=", "refused"), what


def test_docs_models_md_says_what_the_runs_did(found):
    """The committed table, its distances aside (they move with rounding's order), is the one
    these runs write."""
    def without_distances(text):
        table = text.split("| script |", 1)[1].split("tests/test_", 1)[0]
        return re.sub(r"= \([^)]*\)", "=", table)
    committed = without_distances((REPO / "docs" / "models.md").read_text()).splitlines()
    ran = without_distances(models_table.page(found, MODELS)).splitlines()
    assert committed == ran, "\n".join(difflib.unified_diff(
        committed, ran, "docs/models.md", "these runs (python docs/models.py rewrites it)",
        lineterm=""))
