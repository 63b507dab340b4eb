"""The oracle computes the model on its own (tests/reference.py): it equals SimpleModel's
forward in float64, and a changed line in SimpleModel's forward moves the model away from it,
so every proof against the oracle would fail. Each mutation is one line of common.py's text,
changed in a copy loaded as its own module: if that line is rewritten, its test says so."""

import importlib.util

import pytest
import torch

import reference
from conftest import REPO

MUTATIONS = {
    "the top-k weights renormalized": (
        "weights, chosen = probs.topk(self.top_k, dim=-1)",
        "weights, chosen = probs.topk(self.top_k, dim=-1); weights = weights / weights.sum(-1, "
        "keepdim=True)"),
    "the router's softmax over the tokens": (
        "probs = F.softmax(logits, dim=-1,", "probs = F.softmax(logits, dim=0,"),
    "the causal mask dropped": (
        "return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        "return F.scaled_dot_product_attention(q, k, v, is_causal=False)"),
    "ReLU for GELU in the dense feed-forward": (
        "return x + self.down(F.gelu(self.up(self.mlp_norm(x))))",
        "return x + self.down(F.relu(self.up(self.mlp_norm(x))))"),
    "no position embedding": (
        "x = self.embed(x) + self.pos(positions if docs is None else positions - docs)",
        "x = self.embed(x)"),
    "packed: positions not restarting at each document": (
        "self.pos(positions if docs is None else positions - docs)", "self.pos(positions)"),
    "packed: a document attending across its boundary": (
        "same = docs[:, None, :, None] == docs[:, None, None, :]",
        "same = docs[:, None, :, None] >= 0"),
}
SIZE = dict(hidden=24, blocks=2, heads=3)


def model_from(source, tmp_path, experts, top_k):
    path = tmp_path / "mutated_common.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("mutated_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.SimpleModel(**SIZE, experts=experts, top_k=top_k).double()


def distance_from_the_oracle(model, experts, top_k):
    """The largest difference of the logits and the routing statistics, in float64, on 64
    training sequences, of --data repeat, then of packed (the model told its BOS token)."""
    from common import BOS, make_dataset
    gap = 0.0
    for bos in (None, BOS):
        x = make_dataset("train", "repeat" if bos is None else "packed").tensors[0][:64]
        model.bos = bos
        with torch.no_grad():
            logits = model(x)
            want, routing = reference.forward(model.state_dict(), x, SIZE["heads"], experts,
                                              top_k, bos)
        gap = max(gap, (logits - want).abs().max().item())
    if experts:
        for routed, (counts, prob_sums) in zip(model.routed(), routing):
            gap = max(gap, (routed[0] - counts).abs().max().item(),
                      (routed[1] - prob_sums).abs().max().item())
    return gap


@pytest.mark.parametrize("experts, top_k", [(0, 1), (4, 2)], ids=["dense", "mixture"])
def test_the_oracle_computes_simplemodels_forward_in_fp64(experts, top_k, tmp_path):
    model = model_from((REPO / "common.py").read_text(), tmp_path, experts, top_k)
    assert distance_from_the_oracle(model, experts, top_k) < 1e-12


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_changed_line_in_the_models_forward_moves_it_from_the_oracle(mutation, tmp_path):
    line, changed = MUTATIONS[mutation]
    source = (REPO / "common.py").read_text()
    assert source.count(line) == 1, f"common.py no longer says {line!r}: update this mutation"
    experts = 0 if "dense" in mutation else 4  # the mixture's lines run in a mixture only
    model = model_from(source.replace(line, changed), tmp_path, experts, top_k=2)
    assert distance_from_the_oracle(model, experts, top_k=2) > 1e-3, mutation
