"""Two ranks sharing one GPU, with real NCCL collectives between them: the Llama model trained tensor-parallel
(tp=2) against the same model run unsharded, loss and every gradient, in fp32 and bf16 autocast, built on CPU
and on the meta device. ``tests/gpu/test_two_ranks.py`` launches it with torchrun::

    python -m torch.distributed.run --nproc-per-node 2 tests/gpu/two_ranks_one_gpu.py

How two ranks share one GPU: NCCL refuses two ranks of one host on one device ("Duplicate GPU detected"; it
compares host hashes and PCI bus ids). Each rank here gets its own ``NCCL_HOSTID``, so NCCL sees two hosts
of one GPU each and joins them with its socket transport over the loopback interface: real NCCL
collectives on CUDA tensors, slower than NVLink, which does not matter for parity. (gloo on CUDA tensors
crashed both ranks; a one-rank NCCL world exchanges nothing.)

``FXSHARD_GPU_TEST_DEVICE=cpu`` runs the same checks on CPU with gloo (a dry run, not a GPU result).
Exit status 0 only when every check passed; the last line of rank 0's output is ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from fxshard.models import LlamaDecoder  # noqa: E402
from tests.gpu.test_cuda import DEVICE, SMALL, TOLS, _batches, _train, relative_errors, shard_like  # noqa: E402


def one_gpu_nccl_env(rank: int) -> dict[str, str]:
    """The NCCL settings that let rank ``rank`` share the machine's one GPU with the other ranks: its own host
    id, NCCL's own socket transport (no InfiniBand, no network plugin) on the loopback interface, warnings
    logged (which transport failed, and why)."""
    return {"NCCL_HOSTID": f"fxshard-one-gpu-rank{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1",
            "NCCL_NET": "Socket", "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}


def _case(mesh, dtype, built_on: str) -> dict:
    """Relative errors (test_cuda's) of the sharded run against eager, both on DEVICE."""
    torch.manual_seed(0)
    ref = LlamaDecoder(**SMALL).to(DEVICE)
    batches = _batches(SMALL)
    sm = shard_like(ref, built_on, mesh, dtype, batches[0])
    layout = sm.fxshard_state.layout
    split = [n for n, _ in sm.named_parameters() if layout.split_axes(n)]
    losses, grads = _train(sm, batches, dtype, grad_of=lambda n, g: layout.dtensor(n, g).full_tensor())
    ref_losses, ref_grads = _train(ref, batches, dtype)
    loss_err, grad_err = relative_errors(losses, ref_losses, grads, ref_grads)
    worst = max(grad_err, key=grad_err.get)
    return {"loss_err": loss_err, "grad_err": grad_err[worst], "worst_grad": worst, "split_params": len(split),
            "params": len(ref_grads), "tol": TOLS[dtype]}


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE == "cuda":
        os.environ.update(one_gpu_nccl_env(rank))
        torch.cuda.set_device(0)
        # a stuck collective becomes an error within the GPU check's time limit (NCCL's default: 10 minutes)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0), timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh(DEVICE, (world,), mesh_dim_names=("tp",))
        probe = torch.full((4,), float(rank + 1), device=DEVICE)
        dist.all_reduce(probe)  # a real exchange: every rank must see 1 + 2 + ... + world
        exchanged = probe.tolist() == [world * (world + 1) / 2] * 4
        results = {"backend": dist.get_backend(), "device": DEVICE, "world": world, "exchanged": exchanged,
                   "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else None, "torch": torch.__version__}
        ok = exchanged
        for dtype in (None, torch.bfloat16):
            for built_on in ("cpu", "meta"):
                r = _case(mesh, dtype, built_on)
                r["ok"] = r["loss_err"] <= r["tol"] and r["grad_err"] <= r["tol"] and r["split_params"] > 0
                ok = ok and r["ok"]
                results[f"{'fp32' if dtype is None else 'bf16-autocast'}/{built_on}"] = r
        if rank == 0:
            print("RESULT " + json.dumps(results), flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
