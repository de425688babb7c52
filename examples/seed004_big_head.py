"""Seed 004: a data-parallel conv trunk with one huge classifier layer sharded on its classes.

    torchrun --standalone --nproc-per-node 2 examples/seed004_big_head.py

Each rank feeds its own slice of the batch (``in_specs=P("tp")``: the trunk runs data
parallel); the classifier's weight and bias are split on the output features; cross
entropy runs inside the module on class-sharded logits, so only per-sample statistics
travel, never the logits. Prints the loss of sharded and unsharded training and the bytes
communicated per step next to the size of the logits.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import P


class ConvBigHead(nn.Module):
    def __init__(self, n_classes: int = 100_000):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.linear = nn.Linear(8 * 8 * 8, n_classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.flatten(F.relu(self.conv(x)), 1)
        return F.cross_entropy(self.linear(h), target)


PLAN = {"linear.weight": P("tp", None), "linear.bias": P("tp")}


def planned() -> tuple[nn.Module, dict]:
    """For ``fxshard plan examples.seed004_big_head:planned --mesh tp=2 --plan examples.seed004_big_head:PLAN``:
    the model and its example inputs (images and labels, as keyword inputs; global shapes, built on meta)."""
    return ConvBigHead(), {"x": torch.randn(16, 3, 8, 8), "target": torch.zeros(16, dtype=torch.long)}


def main() -> int:
    mesh = fxshard.init_mesh(tp=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ConvBigHead()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 100_000, (16,), generator=g)
    sm = fxshard.shard(model, mesh, PLAN,
                       example_inputs=(x, y), in_specs=(P("tp"), P("tp")))
    local = (x.chunk(world)[rank], y.chunk(world)[rank])
    opt, ref_opt = torch.optim.SGD(sm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        losses = []
        for m, o, inp in ((sm, opt, local), (reference, ref_opt, (x, y))):
            o.zero_grad()
            loss = m(*inp)
            loss.backward()
            o.step()
            losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss sharded {losses[0]:.6f} unsharded {losses[1]:.6f}")
    stats = fxshard.comm_stats(sm)
    total = sum(v["bytes"] for prog in stats.values() for v in prog.values())
    if rank == 0:
        print(f"bytes communicated per step: {total:,} (logits would be {16 * 100_000 * 4:,})")
        print(stats)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
