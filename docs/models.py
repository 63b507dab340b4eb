"""Which models each script takes: every script run on models nobody here wrote, in float64,
against single.py on the same model, and the table of docs/models.md written from these runs.

    pip install -r tests/requirements.txt    # transformers, pinned
    python docs/models.py                    # every cell (~90 runs); rewrites docs/models.md
    python docs/models.py --models cnn       # one model's row, printed; docs/models.md untouched

Each model goes in as docs/questions.md#putting-your-own-model-in says: a copy of the scripts,
one line at the end of its common.py (`from hf_llama import SimpleModel`), the adapter beside
it (tests/hf_llama.py, ...). A cell is the largest weight difference from single.py's run
when the run's weights end within 1e-9 of it and every printed loss equals it; otherwise
the script's one-line refusal. Anything else (a traceback, a gap, a hang) is a bug.
tests/test_matrix.py runs these cells and checks this table against them
(python -m pytest -q -rs tests/test_matrix.py --matrix).
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# The model: (adapter file in tests/, the line appended to the copy's common.py)
MODELS = {
    "llama": ("hf_llama.py", "from hf_llama import SimpleModel"),
    "llama-tied": ("hf_llama.py", "from hf_llama import Tied as SimpleModel"),
    "gpt2": ("hf_gpt2.py", "from hf_gpt2 import SimpleModel"),
    "mixtral": ("hf_mixtral.py", "from hf_mixtral import SimpleModel"),
    "cnn": ("cnn.py", "from cnn import SimpleModel"),
}
TITLES = {"llama": "Hugging Face Llama (RoPE, 2 KV heads for 4)", "llama-tied":
          "the same, head tied", "gpt2": "Hugging Face GPT-2 (Conv1D, tied)",
          "mixtral": "Hugging Face Mixtral (4 fused experts, top-2)",
          "cnn": "a 1-D CNN (GroupNorm, sinusoidal buffer)"}
# The script: its command after `python`, on top of FLAGS
SCRIPTS = {
    "single --accum-steps 2": ["single.py", "--accum-steps=2"],
    "dataparallel": ["dataparallel.py"],
    "ddp": ["ddp.py", "--nproc=2"],
    "zero": ["zero.py", "--nproc=2"],
    "fsdp": ["fsdp.py", "--nproc=2"],
    "tp": ["tp.py", "--nproc=2"],
    "tp 2D (tp 2 x fsdp 2)": ["tp.py", "--nproc=4", "--tp=2"],
    "tp --sequence-parallel": ["tp.py", "--nproc=2", "--sequence-parallel"],
    "cp": ["cp.py", "--nproc=2"],
    "ep": ["ep.py", "--nproc=2"],
    "pipeline": ["pipeline.py", "--nproc=2"],
    "nd (pp 2 x tp 2)": ["nd.py", "--nproc=4"],
    **{f"by hand: {s}": [f"from_scratch/{s}.py", "--nproc=2"]
       for s in ("ddp", "zero", "fsdp", "tp", "pipeline")},
}
FLAGS = ["--fp64", "--steps=10", "--batch-size=48", "--lr=0.01", "--seed=1", "--hidden=24",
         "--blocks=2", "--heads=4", "--log-every=1", "--device=cpu"]
TOL = 1e-9
TIMEOUT = 600  # a hung collective fails its cell, not the whole run


def copy_of_the_scripts(folder, model):
    """A copy of the scripts with `model` put in, as a user does; its path."""
    adapter, line = MODELS[model]
    copy = Path(folder) / model
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
        ".git", "docs", "slurm", "tests", "__pycache__", ".benchmarks"))
    shutil.copy(REPO / "tests" / adapter, copy)
    (copy / "common.py").write_text((REPO / "common.py").read_text() + f"\n{line}\n")
    return copy


def commands(folder, models):
    """{(model, script): command}, single.py's first for each model, in the copies made in
    `folder` (copy_of_the_scripts)."""
    cells = {}
    for model in models:
        copy = Path(folder) / model
        for name, (script, *flags) in {"single": ["single.py"], **SCRIPTS}.items():
            save = copy / (re.sub(r"\W+", "_", name) + ".pt")
            cells[model, name] = [sys.executable, str(copy / script), *FLAGS, *flags,
                                  f"--save={save}"]
    return cells


def run(cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, "hung", e.stdout or "", f"hung after {TIMEOUT} s")


def losses(out):
    return re.findall(r"loss (\d+\.\d+)", out)


def verdict(result, one, cmd, one_cmd):
    """('=', distance) for a run equal to one device's, ('refused', its line), or
    ('BUG', what went wrong)."""
    if result.returncode == 0:
        weights = torch.load(cmd[-1].split("=", 1)[1], weights_only=True)
        reference = torch.load(one_cmd[-1].split("=", 1)[1], weights_only=True)
        if set(weights) != set(reference):
            return "BUG", "saved other parameters than single.py"
        gap = max((weights[k].double() - reference[k].double()).abs().max().item()
                  for k in reference)
        if gap > TOL or losses(result.stdout) != losses(one.stdout):
            return "BUG", f"{gap:.1e} from single.py, or other printed losses"
        return "=", gap
    said = [line for line in result.stderr.splitlines() if ": error: " in line]
    if result.returncode == "hung" or "Traceback" in result.stderr or len(said) != 1:
        return "BUG", (result.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return "refused", said[0].split(": error: ", 1)[1]


def matrix(models, slots=3):
    """{(model, script): (kind, what)} of every cell, `slots` runs at a time."""
    with tempfile.TemporaryDirectory() as folder:
        for model in models:
            copy_of_the_scripts(folder, model)
        cells = commands(folder, models)
        with concurrent.futures.ThreadPoolExecutor(slots) as pool:
            results = dict(zip(cells, pool.map(run, cells.values())))
        return {(model, name): verdict(results[model, name], results[model, "single"],
                                       cells[model, name], cells[model, "single"])
                for model, name in cells if name != "single"}


def table(found, models):
    """docs/models.md's table: a row per script, a column per model."""
    keys = {}  # each refusal's line once, numbered
    rows = ["| script | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for name in SCRIPTS:
        cells = []
        for model in models:
            kind, what = found[model, name]
            cells.append(f"= ({what:.0e})" if kind == "=" else
                         f"refused [{keys.setdefault(what, len(keys) + 1)}]" if kind == "refused"
                         else f"**BUG**: {what}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    notes = [f"{n}. {line}" for line, n in keys.items()]
    return "\n".join(rows), "\n".join(notes)


def page(found, models):
    rows, notes = table(found, models)
    adapters = ", ".join(sorted({MODELS[m][0] for m in models}))
    return f"""# Which models each script takes

Every script, run on models nobody here wrote, in float64, against single.py on the same model
(`python docs/models.py`, {torch.__version__}; {len(found) + len(models)} runs of
`{' '.join(FLAGS)}`). Each model was put in as
[questions.md](questions.md#putting-your-own-model-in) says: one line at the end of a copy of
common.py, the adapter beside it ([tests/](../tests/): {adapters}).

`=` is a run whose weights end within {TOL:.0e} of single.py's (the largest difference in
brackets), every printed loss equal to it. Otherwise the script refused before training,
in one line: the numbers point to the lines below. The columns:
{chr(10).join(f'- **{m}**: {TITLES[m]}' for m in models)}

{rows}

What the refusals say:

{notes}

tests/test_matrix.py runs these cells and checks this page against them:
`python -m pytest -q -rs tests/test_matrix.py --matrix` (by hand, when a script, the model's
interface or transformers changes: 7-8 minutes on 2 cores, beyond CI's budget).
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    found = matrix(args.models)
    if args.models == list(MODELS):
        (REPO / "docs" / "models.md").write_text(page(found, args.models))
        print(f"wrote {REPO / 'docs' / 'models.md'}")
    else:
        print(page(found, args.models))
    bugs = [cell for cell, (kind, _) in found.items() if kind == "BUG"]
    sys.exit(f"{len(bugs)} cells are bugs: {bugs}" if bugs else 0)


if __name__ == "__main__":
    main()
