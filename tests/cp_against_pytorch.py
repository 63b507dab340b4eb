"""PyTorch's context_parallel() against cp.py's ring, on the same batch: run by
tests/test_cp.py on 2 GPUs, as `torchrun --nproc_per_node=2 tests/cp_against_pytorch.py`.

context_parallel() (a prototype) shards the buffers it is given along the sequence, in place,
and runs F.scaled_dot_product_attention as ring attention inside PyTorch's CUDA kernels. Every
rank draws the same q, k, v and positions 0..S-1; context_parallel() cuts all four, so the
positions say which tokens this rank got. Both outputs are checked against attention over the
whole sequence at those tokens, and against each other where both cut the sequence alike.
Prints one line per rank; exits non-zero on a mismatch.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp  # noqa: E402

SEQ, TOL = 64, 2e-2  # bf16 inputs, as PyTorch's flash kernel wants them

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
world = dist.get_world_size()
mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
torch.manual_seed(0)  # the same batch on every rank
q, k, v = torch.randn(3, 2, 4, SEQ, 32, device="cuda", dtype=torch.bfloat16)
whole = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)

cp.SEQ_LEN = SEQ  # cp.token_positions cuts a sequence of this length
mine = cp.token_positions(rank, world).cuda()
ours = cp.attend_ring(q[:, :, mine], k[:, :, mine], v[:, :, mine], group=mesh.get_group("cp"))

qs, ks, vs, positions = q.clone(), k.clone(), v.clone(), torch.arange(SEQ, device="cuda")
with torch.no_grad(), context_parallel(mesh, buffers=[qs, ks, vs, positions],
                                       buffer_seq_dims=[2, 2, 2, 0]):
    theirs = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    theirs_at = positions.clone()

errors = {"ours": (ours.float() - whole[:, :, mine]).abs().max().item(),
          "context_parallel()": (theirs.float() - whole[:, :, theirs_at]).abs().max().item()}
if torch.equal(theirs_at, mine):
    errors["ours vs context_parallel()"] = (ours.float() - theirs.float()).abs().max().item()
print(f"rank {rank}: " + ", ".join(f"{name} {e:.1e}" for name, e in errors.items()), flush=True)
dist.destroy_process_group()
sys.exit(0 if max(errors.values()) < TOL else 1)
