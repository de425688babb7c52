"""A Llama-style decoder with tensor + sequence parallelism and loss parallelism (seed 003's plan),
optionally on a 2-D (dp, tp) mesh.

    torchrun --standalone --nproc-per-node 2 examples/llama_tp_sp.py          # tp=2
    torchrun --standalone --nproc-per-node 4 examples/llama_tp_sp.py --2d     # dp=2 x tp=2

Prints per-step losses of the sharded and unsharded models, the collectives per step and the per-rank memory report.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

import fxshard
from fxshard import P
from fxshard.models import LlamaDecoder, llama_seed003_plan, make_tokens


def main() -> int:
    two_d = "--2d" in sys.argv
    mesh = fxshard.init_mesh(dp=2, tp=2) if two_d else fxshard.init_mesh(tp=2)
    dp = mesh.get_coordinate()[0] if two_d else 0
    model = LlamaDecoder(vocab=256, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, hidden=128, max_seq=32)
    reference = copy.deepcopy(model)
    batch = (make_tokens(4, 32, 256, seed=1), make_tokens(4, 32, 256, seed=2))
    in_specs = (P("dp"), P("dp")) if two_d else None
    sm = fxshard.shard(model, mesh, llama_seed003_plan(), example_inputs=batch, in_specs=in_specs)
    local = tuple(t.chunk(2)[dp] for t in batch) if two_d else batch
    opt, ref_opt = torch.optim.SGD(sm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        losses = []
        for m, o, inp in ((sm, opt, local), (reference, ref_opt, batch)):
            o.zero_grad()
            loss = m(*inp)
            loss.backward()
            o.step()
            losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss sharded {losses[0]:.6f} unsharded {losses[1]:.6f}")
    if dist.get_rank() == 0:
        print("collectives per step:", fxshard.comm_stats(sm))
        print("memory per rank:", fxshard.memory(sm, "sgd"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
