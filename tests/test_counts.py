"""Every script divides by what one device divides by: the global count of the targets that
count, whatever the ranks, micro-batches, CP pieces or pipeline micro-batches.

On common.py's data every target counts, and a rank's or a micro-batch's mean is the batch's:
a script that divides by the wrong count still ends where one device ends. So these runs train
on a user's own data (tests/masked_data.py, put in by one line at the end of a copy of
common.py, as docs/questions.md says): each sequence has 2 to 16 targets that count, the rest
labelled -100. Counts then differ per rank, per micro-batch and per CP piece, and one script of
each family (data parallel with accumulation, TP, CP, EP, the pipeline, DDP by hand) must end
within 1e-9 of the fp64 oracle trained on the same data, and print its losses, gradient norms
and the validation loss over the held-out set's counted targets, to the digits printed."""

import shutil

import pytest

import common
import masked_data
from conftest import (FP64_TOL, JOB, REPO, VAL_TOL, early_results, fp64, load_saved,
                      logged_norms, logged_step_losses, max_diff, ok, python_cmd, ranks_cmd,
                      summary_val_loss)

SEED, STEPS = 2, 12  # 12 steps of 180 cross an epoch of 2048 sequences
HEADS = 3  # JOB's; the TP run's 4 (its flags say so), which its 2 ranks of a group divide
EXPERTS = dict(experts=4, top_k=2)
# name: (ranks, script, its flags, the oracle's mixture, the data: --data's kind, or "user"'s)
RUNS = {
    "single, accumulation 3, packed": (1, "single.py", ["--accum-steps=3"], {}, "packed"),
    "ddp, 3 ranks, accumulation 3": (3, "ddp.py", ["--accum-steps=3"], {}, "user"),
    "fsdp, 2 ranks, accumulation 3, padded": (2, "fsdp.py", ["--accum-steps=3"], {}, "padded"),
    "tp 2D with SP, 4 ranks (dp 2 x tp 2), packed": (
        4, "tp.py", ["--tp=2", "--sequence-parallel", "--heads=4"], {}, "packed"),
    "cp by ring, 2 ranks, accumulation 3, packed": (
        2, "cp.py", ["--accum-steps=3", "--cp-method=ring"], {}, "packed"),
    "cp by all-gather, 2 ranks, padded": (2, "cp.py", ["--cp-method=allgather"], {}, "padded"),
    "cp, 2 ranks, accumulation 3": (2, "cp.py", ["--accum-steps=3"], {}, "user"),
    "ep, 2 ranks, 4 experts, prompt": (2, "ep.py", ["--experts=4", "--top-k=2"], EXPERTS,
                                       "prompt"),
    "pipeline, 2 stages, 4 micro-batches, packed": (2, "pipeline.py", ["--microbatches=4"], {},
                                                    "packed"),
    "nd, 2 stages x cp 2, packed": (4, "nd.py", ["--pp=2", "--cp=2", "--tp=1"], {}, "packed"),
    "ddp by hand, 3 ranks, accumulation 3": (3, "from_scratch/ddp.py", ["--accum-steps=3"], {},
                                             "user"),
    "pipeline by hand, 2 stages, 4 micro-batches, prompt": (
        2, "from_scratch/pipeline.py", ["--microbatches=4"], {}, "prompt"),
}


def early_launches(folder):  # queued when the tests are collected (conftest.py)
    (folder / "from_scratch").mkdir()
    for _, script, *_ in RUNS.values():
        shutil.copy(REPO / script, folder / script)
    shutil.copy(REPO / "tests" / "masked_data.py", folder)
    shutil.copytree(REPO / "plumbing", folder / "plumbing")
    (folder / "common.py").write_text((REPO / "common.py").read_text()
                                      + "\nfrom masked_data import make_dataset\n")
    commands = []
    for i, (ranks, script, flags, _, data) in enumerate(RUNS.values()):
        data = [] if data == "user" else [f"--data={data}"]
        flags = [*data, *fp64(SEED, steps=STEPS), f"--hidden={JOB['hidden']}",
                 f"--blocks={JOB['blocks']}", f"--heads={heads(flags)}", "--log-every=1",
                 "--device=cpu", *flags, f"--save={folder / str(i)}.pt"]
        commands.append(python_cmd(folder / script, *flags) if ranks == 1
                        else ranks_cmd(ranks, folder / script, *flags))
    return commands, None


@pytest.fixture(scope="module")
def runs():
    folder, results = early_results(__name__)
    return {name: (ok(result), load_saved(folder / f"{i}.pt"))
            for i, (name, result) in enumerate(zip(RUNS, results))}


def data(split, kind):
    """The run's data: common.py's --data kind, or the user's (tests/masked_data.py)."""
    return masked_data.make_dataset(split, "repeat" if kind == "user" else kind)


def heads(flags):
    """The run's heads: its own --heads, else HEADS."""
    return next((int(f.split("=")[1]) for f in flags if f.startswith("--heads=")), HEADS)


def oracle(kind, heads, **mixture):
    from reference import reference_train
    norms = []
    model = dict(hidden=JOB["hidden"], blocks=JOB["blocks"], heads=heads)
    _, weights, losses = reference_train(
        STEPS, 180, 0.01, SEED, **model, fp64=True, norms=norms, data=data("train", kind),
        bos=common.BOS if kind == "packed" else None, **mixture)
    return weights, losses, norms


def test_the_data_counts_differently_per_rank_micro_batch_and_piece():
    """What makes the wrong divisor visible: the counts are not equal."""
    _, y = masked_data.make_dataset("train").tensors
    counted = (y != -100).sum(dim=1)
    assert counted.min() == 2 and counted.max() == 16
    halves = (y[:, :8] != -100).sum(), (y[:, 8:] != -100).sum()  # CP's 2 pieces
    assert halves[0] != halves[1]


@pytest.mark.parametrize("name", RUNS)
def test_each_family_divides_by_the_global_count_and_equals_the_fp64_oracle(runs, name):
    from reference import reference_val_loss
    out, weights = runs[name]
    _, _, flags, mixture, kind = RUNS[name]
    expected, losses, norms = oracle(kind, heads(flags), **mixture)
    diff = max_diff(weights, expected)
    print(f"{name}: {diff:.2e} from the fp64 oracle")  # pytest -s
    assert diff < FP64_TOL
    for step, loss in logged_step_losses(out).items():
        assert loss == pytest.approx(losses[step - 1], abs=1e-6), f"loss of step {step}"
    for step, norm in logged_norms(out).items():
        assert norm == pytest.approx(norms[step - 1], rel=1e-6), f"norm of step {step}"
    exact = reference_val_loss(expected, JOB["hidden"], JOB["blocks"], heads(flags),
                               mixture.get("experts", 0), mixture.get("top_k", 1),
                               data=data("val", kind),
                               bos=common.BOS if kind == "packed" else None)
    assert summary_val_loss(out) == pytest.approx(exact, abs=VAL_TOL)
    # and not the mean over every target, padding's included (the divisor evaluation had)
    _, y = data("val", kind).tensors
    assert abs(exact * (y != -100).sum().item() / y.numel() - exact) > 100 * VAL_TOL


def test_a_make_dataset_from_before_data_and_packed_data_for_a_model_without_bos_are_refused(
        monkeypatch, capsys):
    """A user's make_dataset(split), without --data's kind, is refused in one line naming the
    fix, before any process starts; so is --data packed for a model that does not say where its
    documents begin (no `bos`): its attention would cross them."""
    from conftest import refused_in_one_line
    shared = common.make_dataset
    monkeypatch.setattr(common, "make_dataset", lambda split: shared(split))
    refused_in_one_line("ddp", ["--nproc=2"], "make_dataset takes (split, kind)", capsys)
    monkeypatch.setattr(common, "make_dataset", shared)

    class Unpacked(common.SimpleModel):
        def __init__(self, *args):
            super().__init__(*args)
            del self.bos

    monkeypatch.setattr(common, "SimpleModel", Unpacked)
    refused_in_one_line("cp", ["--nproc=2", "--data=packed"], "--data packed: Unpacked has no "
                        "`bos`", capsys)
