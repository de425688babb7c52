"""The README's quickstart: 2-rank tensor-parallel training of a small MLP.

Run with ``torchrun --standalone --nproc-per-node 2 examples/quickstart.py``. CI runs it in a fresh
``pip install .`` environment (``scripts/check_install.sh``); ``tests/test_docs.py`` checks that the
README's quickstart block is this file's code.
"""
import torch
import torch.nn as nn

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel

mesh = fxshard.init_mesh(tp=2)                  # a DeviceMesh with a named axis; gloo on CPU, NCCL on GPUs
torch.manual_seed(0)                            # the same seed on every rank: the same model and batch
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
x, y = torch.randn(32, 64), torch.randn(32, 64)
plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # FQN globs -> layouts (Megatron's MLP)
sm = fxshard.shard(model, mesh, plan, example_inputs=(x,))
opt = torch.optim.AdamW(sm.parameters(), lr=1e-2)  # built once, over this rank's shards
for step in range(5):
    opt.zero_grad()
    loss = nn.functional.mse_loss(sm(x), y)     # the whole batch on every rank (tensor parallel)
    loss.backward()                             # each .grad is this rank's piece of the full gradient
    opt.step()
if torch.distributed.get_rank() == 0:
    print(f"loss {loss.item():.4f}", fxshard.comm_stats(sm))  # one all_reduce, in the forward
    print(fxshard.explain(sm))                  # every node's layout and local shape, every collective and why
torch.distributed.barrier()                     # every rank done before the group is torn down
torch.distributed.destroy_process_group()
