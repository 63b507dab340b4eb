"""The mixture of experts' load-balancing loss in a training step, over the ranks that share
one device's micro-batch: what every script with --experts adds to its loss (common.balance_loss
is the formula, SimpleModel.routed what it reads)."""

import torch
import torch.distributed as dist

from common import balance_loss


def balance(model, args, y, group=None):
    """--balance x the load-balancing loss of the micro-batch just forwarded (0 if dense), over
    its tokens whose targets `y` count (docs/moe.md). With `group`: over its ranks, which hold
    one device's micro-batch between them (ddp.py...)."""
    if not args.experts:
        return 0.0
    routed = model.routed(y != -100)
    routed = routed if group is None else AllReduce.apply(routed, group)
    # The tokens each expert got over the run (the summary's last line), as exact integers
    model.tokens_per_expert = (routed[:, 0].detach().to(torch.int64)
                               + getattr(model, "tokens_per_expert", 0))
    return args.balance * balance_loss(routed, args.top_k)


class AllReduce(torch.autograd.Function):
    """A sum over `group`'s ranks that autograd goes through: its gradient is the sum of the
    ranks' gradients (an all-reduce too), so DDP's average is one device's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
