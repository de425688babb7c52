"""Data parallelism with DDP's gradients, on 2 ranks, checked against the unsharded model.

Run with ``torchrun --standalone --nproc-per-node 2 examples/data_parallel.py``. The batch is split over the
``dp`` axis (``in_specs``) and the loss is inside the sharded program (``fxshard.loss_parallel``), so the loss
each rank gets is the mean over the GLOBAL batch and the gradients are DDP's (the unsharded model's on the
global batch): parameters replicated on ``dp`` get their gradients all-reduced in buckets during the backward.
See docs/plans.md, "Data parallelism", for the other spellings and their gradients.
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import fxshard
from fxshard import P

mesh = fxshard.init_mesh(dp=2)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
reference = copy.deepcopy(model)                    # unsharded, trained on the global batch, to compare
gen = torch.Generator().manual_seed(1)              # the same global batches on every rank (for the check)
batches = [(torch.randn(1024, 64, generator=gen), torch.randn(1024, 64, generator=gen)) for _ in range(3)]

step = fxshard.loss_parallel(model, nn.functional.mse_loss)   # model(x) and the loss as one program
sm = fxshard.shard(step, mesh, {}, example_inputs=batches[0], in_specs=(P("dp"), P("dp")))
opt = torch.optim.SGD(sm.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for x, y in batches:
    x_local, y_local = x.chunk(2)[rank], y.chunk(2)[rank]     # this rank's rows (a DistributedSampler's)
    opt.zero_grad()
    loss = sm(x_local, y_local)                     # the mean over the global batch, on every rank
    loss.backward()                                 # gradients all-reduced over dp: DDP's
    opt.step()
    ref_opt.zero_grad()
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
worst = max((p - q).abs().max().item() for p, q in zip(sm.parameters(), reference.parameters()))
stats = fxshard.comm_stats(sm)                      # the gradient all-reduce, in the backward; no gather
if rank == 0:
    print(f"loss {loss.item():.6f}; max |parameter - unsharded| after 3 SGD steps: {worst:.2e}")
    print(stats)
dist.barrier()  # every rank done before the group is torn down
dist.destroy_process_group()
sys.exit(0 if worst < 1e-5 and "all_gather" not in stats["forward"] else 1)
