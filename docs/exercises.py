"""Measure the distances of docs/exercises.md: each mistake of the bug zoo (tests/test_zoo.py),
and the correct script on the same flags, against one device, in fp32 and in fp64.

    python docs/exercises.py       # tens of minutes: 4 launches a row
    python docs/exercises.py "TP group fed by rank"     # only the rows named

Every run is FP64_JOB (tests/conftest.py: 40 steps of batch 180, lr 0.01, hidden 24, 3 blocks of
3 heads; 4 heads where TP cuts them in 2) on the zoo's seed, launched as the zoo launches it,
once with --fp64 and once without; each is compared with tests/reference.py in the same
precision. Prints the max weight difference and the printed validation loss's distance from the
exact one; for the fused qkv layer, whose weights have other names, the first step's loss; for
the CP loss averaged over a rank's own tokens, the last printed loss; for the ring that skips a
hop, how long the job takes to fail, and its first error line; for the tied weight, against
single.py on the same tied model (tests/gpt_like.py), not the oracle; for DiLoCo's, against
reference_diloco (DiLoCo is not one device's training). The mistakes that no
weight shows (the collective count, the checkpoint's keys, the clipped norm, the mesh built tp
first, the plan key refused) are measured by their tests.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import common  # noqa: E402
import conftest  # noqa: E402
import test_zoo  # noqa: E402
from reference import reference_diloco, reference_train, reference_val_loss  # noqa: E402

CASES = {  # mistake: (ranks under torchrun, or None for `python`; flags beyond the job; steps)
    # (a --clip among the flags clips the oracle too)
    "no set_epoch": (1, [], 40),
    "sampler seeded per rank": (2, [], 40),
    "mean of per-rank validation means": (3, [], 4),
    "loss not divided when accumulating": (None, ["--accum-steps=3"], 40),
    "TP group fed by rank": (2, ["--heads=4"], 40),
    "TP: attention that counts its heads": (2, ["--heads=4"], 40),
    "TP: a fused qkv layer cut by columns": (2, ["--heads=4"], 2),
    "SP: a norm left out of the plan": (2, ["--heads=4", "--sequence-parallel"], 40),
    "optimizer built before fully_shard": (1, [], 4),
    "pipeline with scale_grads=False": (2, ["--microbatches=4"], 40),
    "FSDP clipped by the norm of the local shards": (2, [f"--clip={conftest.FP64_CLIP}"], 4),
    "CP: positions not offset per piece": (2, [], 40),
    "CP: loss averaged over a rank's own tokens": (2, [], 40),
    "CP ring: a hop skipped where its keys are masked": (4, ["--cp-method=ring", "--timeout=10"],
                                                         4),
    # nd.py's FSDP x CP: no pipeline, FSDP over dp 2 x cp 2
    **{name: (4, ["--pp=1", "--tp=1", "--cp=2", "--microbatches=2"], 40)
       for name in test_zoo.MISTAKES if name.startswith("CP x FSDP")},
    "ND: positions not passed to the stages": (4, [*test_zoo.ND_FLAGS, "--cp=2"], 40),
    **{name: (2, test_zoo.EP_FLAGS, 40) for name in test_zoo.MISTAKES if name.startswith("EP")},
    "ND: the norm clipped per stage": (2, [*test_zoo.ND_FLAGS, f"--clip={conftest.FP64_CLIP}"], 40),
    "ND: the micro-batches counted twice": (2, test_zoo.ND_FLAGS, 40),
    "ND: a seed per rank": (2, test_zoo.ND_FLAGS, 40),
    # against single.py on the same tied model (tests/gpt_like.py): the oracle's is untied
    "TP: a tied weight made a DTensor module by module": (2, ["--heads=4"], 40),
    # the count's mistakes, on data whose counts differ (test_zoo.COUNTED: their --data)
    "the mean of the ranks' means": (3, ["--data=prompt"], 40),
    "the mean of the micro-batches' means": (2, ["--microbatches=4", "--data=prompt"], 40),
    "the loss divided by the accumulation steps": (None, ["--accum-steps=3", "--data=prompt"],
                                                   40),
    "CP: divided by each rank's own tokens": (2, ["--data=padded"], 40),
    "CP: a packed document attending across its boundary": (2, ["--data=packed"], 40),
    "padding counted in evaluation": (2, ["--data=padded"], 40),
    # DiLoCo's, against tests/reference.py's reference_diloco (not one device: DiLoCo is not)
    **{name: (2, ["--inner-steps=4"], 40) for name in test_zoo.MISTAKES
       if name.startswith("DiLoCo")},
    # Ulysses': 2 ranks, 2 of the 4 heads each
    **{name: (2, ["--cp-method=ulysses", "--heads=4"], 40) for name in test_zoo.MISTAKES
       if name.startswith("Ulysses")},
}
TIED = "TP: a tied weight made a DTensor module by module"


def with_gpt_like(script, where):
    """`script` in `where`, beside tests/gpt_like.py and a common.py that ends with the line
    that puts it in (tests/test_own_model.py's way); returns the copy."""
    where.mkdir(parents=True, exist_ok=True)
    copy = where / Path(script).name
    copy.write_text(Path(script).read_text())
    (where / "gpt_like.py").write_text((REPO / "tests" / "gpt_like.py").read_text())
    (where / "common.py").write_text((REPO / "common.py").read_text()
                                     + "\nfrom gpt_like import SimpleModel\n")
    return copy


def tied_model_oracle(where, flags, extra, env):
    """single.py's final weights, per-step losses and validation loss on the GPT-2."""
    script = with_gpt_like(REPO / "single.py", where)
    result = subprocess.run([sys.executable, str(script), *conftest.JOB_FLAGS, *flags, *extra,
                             "--log-every=1", f"--save={where / 'one.pt'}"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600, check=True)
    return (torch.load(where / "one.pt", weights_only=True),
            conftest.logged_losses(result.stdout), conftest.summary_val_loss(result.stdout))


def main():
    folder = Path(tempfile.mkdtemp())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    job = {**conftest.JOB, **conftest.FP64_JOB, "seed": test_zoo.SEED}
    for i, (name, (nproc, extra, steps)) in enumerate(CASES.items()):
        if sys.argv[1:] and name not in sys.argv[1:]:
            continue
        clip = next((float(f.split("=")[1]) for f in extra if f.startswith("--clip=")), None)
        heads = next((int(f.split("=")[1]) for f in extra if f.startswith("--heads=")),
                     job["heads"])
        moe = {key: int(f.split("=")[1]) for f in extra for key in ("experts", "top_k")
               if f.startswith(f"--{key.replace('_', '-')}=")}
        data_kind = next((f.split("=")[1] for f in extra if f.startswith("--data=")), "repeat")
        data = dict(bos=common.BOS if data_kind == "packed" else None)
        for precision in ("fp32", "fp64"):
            flags = [f for f in conftest.fp64(job["seed"], steps=steps)
                     if precision == "fp64" or f != "--fp64"]
            if name == TIED:  # the oracle: single.py, with the GPT-2 swapped in as a user does
                oracle, losses, exact = tied_model_oracle(folder / f"{i}{precision}", flags,
                                                          extra, env)
            elif test_zoo.MISTAKES[name][0] == "diloco.py":  # 4-step rounds, the defaults
                _, oracle, losses = reference_diloco(
                    steps, job["batch_size"], job["lr"], job["seed"], job["hidden"],
                    job["blocks"], heads, ranks=nproc, inner_steps=4, outer_lr=0.7,
                    outer_momentum=0.9, fp64=precision == "fp64")
                exact = reference_val_loss(oracle, job["hidden"], job["blocks"], heads)
            else:
                _, oracle, losses = reference_train(
                    **dict(job, steps=steps, heads=heads), fp64=precision == "fp64", clip=clip,
                    **moe, data=common.make_dataset("train", data_kind), **data)
                exact = reference_val_loss(oracle, job["hidden"], job["blocks"], heads, **moe,
                                           data=common.make_dataset("val", data_kind), **data)
            row = []
            for kind in ("correct", "mistake"):
                where = folder / f"{i}{precision}{kind}"
                script = (test_zoo.mutant(name, where) if kind == "mistake"
                          else REPO / test_zoo.MISTAKES[name][0])
                if name == TIED:
                    script = with_gpt_like(script, where)
                where.mkdir(parents=True, exist_ok=True)
                cmd = ([sys.executable, script] if nproc is None
                       else conftest.torchrun_cmd(nproc, script))
                started = time.monotonic()
                result = subprocess.run(
                    [*map(str, cmd), *conftest.JOB_FLAGS, *flags, *extra,
                     f"--save={where / 'w.pt'}"],
                    cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
                if "hop skipped" in name and kind == "mistake":
                    error = next(line for line in result.stderr.splitlines() if "error:" in line)
                    row.append(f"{kind}: exit {result.returncode} after "
                               f"{time.monotonic() - started:.1f} s: {error.strip()}")
                    continue
                if result.returncode:
                    raise SystemExit(f"{name} ({precision}, {kind}) failed:\n{result.stderr}")
                if "own tokens" in name:
                    last = conftest.logged_losses(result.stdout)[-1]
                    row.append(f"{kind} last loss {abs(last - losses[-1]):.1e} away")
                if "fused" in name:
                    first = conftest.logged_losses(result.stdout)[0]
                    row.append(f"{kind} first loss {abs(first - losses[0]):.1e} away")
                    continue
                weights = (torch.load(where / "w.pt", weights_only=True) if name == TIED
                           else conftest.load_saved(where / "w.pt"))
                row.append(f"{kind} {conftest.max_diff(weights, oracle):.1e} (val loss "
                           f"{abs(conftest.summary_val_loss(result.stdout) - exact):.1e})")
            print(f"{name:36s} {precision}: {'   '.join(row)}", flush=True)


if __name__ == "__main__":
    main()
