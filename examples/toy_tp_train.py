"""The README's main job: 2-rank tensor-parallel training of seed 000's ToyModel on CPU.

Run with ``torchrun --nproc-per-node 2 examples/toy_tp_train.py``. Every rank
trains the sharded model (net1 column-parallel, net2 row-parallel) and, for
comparison, the same model unsharded on the full batch; it prints the loss of
both per step, the largest parameter difference at the end (gathered with
``full_state_dict``), the collectives fxshard inserted and why.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel


class ToyModel(nn.Module):
    def __init__(self, in_dim: int = 64, hidden: int = 256):
        super().__init__()
        self.net1 = nn.Linear(in_dim, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def main(steps: int = 5) -> int:
    mesh = fxshard.init_mesh(tp=2)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ToyModel()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)) for _ in range(steps)]

    sm = fxshard.shard(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                       example_inputs=(data[0][0],))
    del model  # the sharded module holds only this rank's shards
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    for step, (x, y) in enumerate(data):
        for m, o in ((sm, opt), (reference, ref_opt)):
            o.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            o.step()
            if m is sm:
                sharded_loss = loss.item()
            else:
                ref_loss = loss.item()
        if rank == 0:
            print(f"step {step}: loss sharded {sharded_loss:.6f}  unsharded {ref_loss:.6f}  "
                  f"diff {abs(sharded_loss - ref_loss):.2e}")
    full = sm.full_state_dict()
    ref_sd = reference.state_dict()
    worst = max((full[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
    ok = worst <= 1e-5
    if rank == 0:
        print(f"\nlocal parameter shapes on rank 0: " + ", ".join(f"{n} {tuple(p.shape)}" for n, p in sm.named_parameters()))
        print(f"max |parameter difference| after {steps} AdamW steps: {worst:.2e}  -> {'PARITY' if ok else 'MISMATCH'}")
        print(f"collectives per step: {fxshard.comm_stats(sm)}\n")
        print(fxshard.explain(sm))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
