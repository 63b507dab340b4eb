"""A user's own data, put in where docs/questions.md says (one line at the end of a copy of
common.py): common.py's sequences, each with a random number of targets that count, 2 to 16,
the others labelled -100, which cross_entropy skips. Even rows count their first targets (a
padded sequence's), odd rows their last (a prompt's answer). On such data a rank's, a
micro-batch's or a CP piece's mean is not the batch's: only the global count is one device's."""

import torch

import common

shared = common.make_dataset  # common.py's, before the line at its end replaces it with this


def make_dataset(split="train", kind="repeat"):
    if kind != "repeat":  # --data: common.py's kinds
        return shared(split, kind)
    x, y = shared(split).tensors
    g = torch.Generator().manual_seed({"train": 5, "val": 6}[split])
    kept = torch.randint(2, common.SEQ_LEN + 1, (len(y), 1), generator=g)  # targets that count
    where = torch.arange(common.SEQ_LEN)
    padded = where >= kept  # a padded sequence: its tail does not count
    prompt = where < common.SEQ_LEN - kept  # a prompt and its answer: the prompt does not count
    rows = torch.arange(len(y))[:, None] % 2 == 0
    y = y.masked_fill(torch.where(rows, padded, prompt), -100)
    return torch.utils.data.TensorDataset(x, y)
