"""The models users bring, put in as docs/questions.md says (one line at the end of a copy of
common.py), on models nobody here wrote: Hugging Face's Llama (RoPE's non-persistent inv_freq,
grouped KV heads) and GPT-2, and SimpleModel with one non-persistent buffer its forward uses.

- The scripts that build on "meta" (fsdp.py, tp.py, nd.py, the FSDP twin) end with single.py's
  buffers, and so its weights, in float64: a state_dict carries no non-persistent buffer.
- A rank's last evaluation batch can be empty (3 ranks, batch 27): forwarded whole, then cut.
- What a script assumes of the model, checked by a probe forward before any process starts,
  and refused in one line (no usage block, printed by rank 0 only).
Hugging Face's models need transformers (tests/requirements.txt pins it); without it their
tests skip, saying so."""

import importlib.util
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from conftest import (FP64_TOL, REPO, early_results, fp64, logged_step_losses, max_diff, ok,
                      python_cmd, ranks_cmd, refused_in_one_line, summary_val_loss)

HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HF, reason="needs transformers (pip install -r "
                              "tests/requirements.txt): Hugging Face's models")
FLAGS = [*fp64(1, steps=10), "--hidden=24", "--blocks=2", "--heads=4", "--log-every=1",
         "--device=cpu"]
SWAPS = {"buffer": "from one_buffer import SimpleModel",
         "llama": "from hf_llama import SimpleModel"}
RUNS = {"buffer": {"single": ["single.py"], "fsdp": ["fsdp.py", "--nproc=2"],
                   "tp": ["tp.py", "--nproc=2"], "nd": ["nd.py", "--nproc=4"],
                   "fsdp-twin": ["from_scratch/fsdp.py", "--nproc=2"]},
        "llama": {"single": ["single.py"], "fsdp": ["fsdp.py", "--nproc=2"],
                  "tp": ["tp.py", "--nproc=2"]}}
MODELS = [m for m in RUNS if HF or m != "llama"]


def early_launches(folder):  # queued when the tests are collected (conftest.py)
    commands = []
    for model in MODELS:
        copy = folder / model
        shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
            ".git", "docs", "slurm", "tests", "__pycache__", ".benchmarks"))
        for adapter in ("one_buffer.py", "hf_llama.py"):
            shutil.copy(REPO / "tests" / adapter, copy)
        (copy / "common.py").write_text((REPO / "common.py").read_text() + f"\n{SWAPS[model]}\n")
        commands += [python_cmd(copy / script, *FLAGS, *rest, f"--save={copy / name}.pt")
                     for name, (script, *rest) in RUNS[model].items()]
    # Evaluation on 3 ranks of 9 samples: rank 2's last batch of the 1000 is empty.
    commands.append(ranks_cmd(3, REPO / "from_scratch" / "ddp.py", "--device=cpu", "--steps=1",
                              "--batch-size=27", "--hidden=24", "--blocks=2", "--heads=3"))
    commands.append(ranks_cmd(3, REPO / "ddp.py", "--device=cpu", "--steps=1",
                              "--batch-size=27", "--hidden=24", "--blocks=2", "--heads=3"))
    commands.append(python_cmd(REPO / "single.py", "--device=cpu", "--steps=1",
                               "--batch-size=27", "--hidden=24", "--blocks=2", "--heads=3"))
    # and on 7 ranks of 2 samples: 143 each, rank 6's last one padding, alone in its last batch
    commands.append(ranks_cmd(7, REPO / "zero.py", "--device=cpu", "--steps=1",
                              "--batch-size=14", "--hidden=24", "--blocks=2", "--heads=3"))
    commands.append(python_cmd(REPO / "single.py", "--device=cpu", "--steps=1",
                               "--batch-size=14", "--hidden=24", "--blocks=2", "--heads=3"))
    return commands, None


@pytest.fixture(scope="module")
def runs():
    folder, results = early_results(__name__)
    names = [(m, s) for m in MODELS for s in RUNS[m]] + [("empty", n) for n in
                                                          ("twin", "ddp", "single", "zero 7",
                                                           "single 14")]
    return folder, dict(zip(names, results))


@pytest.mark.parametrize("model, script", [(m, s) for m in RUNS for s in RUNS[m] if s != "single"])
def test_a_meta_built_script_ends_with_one_devices_buffers_and_weights_in_fp64(runs, model,
                                                                                script):
    if model not in MODELS:
        pytest.skip("needs transformers (pip install -r tests/requirements.txt)")
    folder, results = runs
    one_out, out = ok(results[model, "single"]), ok(results[model, script])
    one = torch.load(folder / model / "single.pt", weights_only=True)
    weights = torch.load(folder / model / f"{script}.pt", weights_only=True)
    assert set(weights) == set(one) and max_diff(weights, one) < FP64_TOL
    assert logged_step_losses(out) == pytest.approx(logged_step_losses(one_out), abs=1e-6)
    assert summary_val_loss(out) == pytest.approx(summary_val_loss(one_out), abs=1e-6)
    # it trained: the buffer (x2 on the logits) or RoPE moved the loss off its first value
    losses = logged_step_losses(out)
    assert losses[max(losses)] < losses[1]


def test_an_empty_last_evaluation_batch_is_forwarded_whole_and_counted_exactly(runs):
    _, results = runs
    one = summary_val_loss(ok(results["empty", "single"]))
    for name in ("twin", "ddp"):
        assert summary_val_loss(ok(results["empty", name])) == pytest.approx(one, abs=1e-6)
    assert summary_val_loss(ok(results["empty", "zero 7"])) == pytest.approx(
        summary_val_loss(ok(results["empty", "single 14"])), abs=1e-6)


class BatchMean(nn.Module):  # a norm by any other name: statistics over the whole batch
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return F.batch_norm(x.transpose(1, 2), None, None, self.weight, training=True
                            ).transpose(1, 2)


class Coupled(common.SimpleModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = BatchMean(self.norm.normalized_shape[0])


class NoAttend(common.SimpleModel):  # an attention that never calls attend (GPT-2's, say)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for block in self.blocks.values():
            block.attn.forward = lambda x, docs=None, a=block.attn: a.o(  # Block passes docs
                F.scaled_dot_product_attention(*(p(x).view(*x.shape[:2], -1, a.head_width)
                                                 .transpose(1, 2) for p in (a.q, a.k, a.v)),
                                               is_causal=True).transpose(1, 2).flatten(2))


class Scaled(common.SimpleModel):  # a forward that does more than its parts, on every stage
    def forward(self, x, positions=None):
        return 2 * super().forward(x, positions)


class TimeMix(nn.Module):  # a causal convolution over the positions (Mamba's, Hyena's)
    def __init__(self, hidden):
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, 3, groups=hidden)

    def forward(self, x):
        return self.conv(F.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2)


class Convolved(common.SimpleModel):  # a block that mixes positions outside its attention
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for block in self.blocks.values():
            block.attn_norm = nn.Sequential(block.attn_norm, TimeMix(self.embed.embedding_dim))


SMALL = ["--hidden=24", "--blocks=2", "--heads=4"]


@pytest.mark.parametrize("script, model, world, flags, message", [
    ("ddp", Coupled, 2, SMALL, "Coupled.norm (BatchMean) couples the samples of a batch"),
    ("single", Coupled, 1, [*SMALL, "--accum-steps=2"], "Coupled.norm (BatchMean) couples"),
    ("pipeline", Coupled, 2, SMALL, "Coupled.norm (BatchMean) couples the samples"),
    ("pipeline", Scaled, 2, SMALL,
     "pipeline.py's cut() makes stages of Scaled by deleting SimpleModel's parts"),
    ("nd", Scaled, 4, [*SMALL, "--blocks=4"], "the chain is"),
    ("cp", NoAttend, 2, SMALL, "cp.py replaces each block's attn.attend, which NoAttend's "
     "forward never calls"),
    ("cp", Coupled, 2, SMALL, "Coupled.norm (BatchMean) couples"),
    ("tp", Convolved, 2, [*SMALL, "--sequence-parallel"], "--sequence-parallel: "
     "Convolved.blocks.0.attn_norm.1 (TimeMix) runs between the TP regions"),
])
def test_what_a_probe_forward_shows_is_refused_in_one_line(script, model, world, flags, message,
                                                           as_torchrun, monkeypatch, capsys):
    as_torchrun(world)
    importlib.import_module(script)  # before the swap: its own name stays SimpleModel's
    monkeypatch.setattr(common, "SimpleModel", model)
    refused_in_one_line(script, flags, message, capsys)


def test_pure_tp_where_every_rank_sees_the_whole_batch_accepts_a_batch_coupling_model(
        as_torchrun, monkeypatch):
    as_torchrun(2)
    importlib.import_module("tp")
    monkeypatch.setattr(common, "SimpleModel", Coupled)
    __import__("tp").parse_args(["--device=cpu", *SMALL])
    # and a block that mixes positions outside its attention, with the whole sequence each
    monkeypatch.setattr(common, "SimpleModel", Convolved)
    __import__("tp").parse_args(["--device=cpu", *SMALL])


def test_a_refusal_is_one_line_without_usage_and_said_by_rank_0_only(as_torchrun, monkeypatch,
                                                                     capsys):
    as_torchrun(2)
    with pytest.raises(SystemExit):
        __import__("ddp").parse_args(["--device=cpu", "--batch-size=7"])
    [line] = capsys.readouterr().err.strip().splitlines()  # no usage block above it
    assert line.endswith(": error: --batch-size 7 must be divisible by world size 2 x "
                         "--accum-steps 1; use a multiple of 2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_:
        __import__("ddp").parse_args(["--device=cpu", "--batch-size=7"])
    assert exit_.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize("adapter, script, flags, message", [
    ("hf_llama", "tp", ["--nproc=4", *SMALL], "--tp 4 must divide SimpleModel's 2 key/value heads"),
    ("hf_llama", "pipeline", SMALL, "stays in two stages"),
    ("hf_llama", "cp", SMALL, "cp.py replaces each block's attn.attend(q, k, v), and "
     "SimpleModel's blocks have none"),
    ("hf_gpt2", "cp", SMALL, "SimpleModel's blocks have none"),
    ("hf_gpt2", "tp", SMALL, "SimpleModel.tp_plan cuts nothing"),
    ("hf_mixtral", "pipeline", SMALL, "stays in two stages"),
    ("hf_mixtral", "ep", SMALL, "ep.py spreads each block's moe.experts"),
    ("cnn", "ep", SMALL, "SimpleModel's blocks hold no such mixture"),
    ("cnn", "pipeline", SMALL, "head.weight stays in two stages"),
    ("cnn", "cp", SMALL, "SimpleModel's blocks have none"),
])
def test_a_model_nobody_here_wrote_where_a_script_cannot_take_it_is_refused_in_one_line(
        adapter, script, flags, message, as_torchrun, monkeypatch, capsys):
    if adapter.startswith("hf_") and not HF:
        pytest.skip("needs transformers (pip install -r tests/requirements.txt)")
    as_torchrun(4 if "--nproc=4" in flags else 2)
    importlib.import_module(script)
    monkeypatch.setattr(common, "SimpleModel", __import__(adapter).SimpleModel)
    refused_in_one_line(script, [f for f in flags if not f.startswith("--nproc")], message, capsys)


@needs_hf
def test_under_fp64_an_fp32_island_is_named(monkeypatch, capsys):
    """Hugging Face's LlamaRMSNorm computes in float32 whatever the weights' dtype (the adapter
    swaps it for torch's nn.RMSNorm): named in one line, with the gap it causes."""
    import hf_llama
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Island(hf_llama.SimpleModel):
        def __init__(self, *args):
            super().__init__(*args)
            self.llama.model.norm = LlamaRMSNorm(args[0])
    importlib.import_module("single")
    monkeypatch.setattr(common, "SimpleModel", Island)
    __import__("single").parse_args(["--device=cpu", "--fp64", *SMALL])
    assert ("note: --fp64: Island.llama.model.norm (LlamaRMSNorm) computes in float32"
            in capsys.readouterr().out)


def test_a_model_too_large_to_probe_on_the_cpu_says_so_in_one_line(as_torchrun, monkeypatch,
                                                                    capsys):
    """Every rank would build the whole model on its CPU: above PROBE_BYTES the probe is
    skipped, and the note says how to run it (smaller flags, the same code)."""
    import plumbing.model_check
    as_torchrun(2)
    importlib.import_module("ddp")
    monkeypatch.setattr(common, "SimpleModel", Coupled)
    monkeypatch.setattr(plumbing.model_check, "PROBE_BYTES", 1000)
    __import__("ddp").parse_args(["--device=cpu", *SMALL])
    assert "note: Coupled is 0.0 GiB, too large for the probe forward on the CPU" in \
        capsys.readouterr().out
