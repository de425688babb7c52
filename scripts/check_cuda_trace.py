"""What fxshard traces on CUDA, checked without a GPU: models whose parameters and inputs are fake CUDA tensors
(``FakeTensor`` with device ``cuda``: shapes, dtypes and the CUDA dispatch keys, no memory), sharded for
inference under bf16 autocast on the fake process group. Each program must hold attention as one
``fxshard::attention`` node, no device-specific kernel (``cudnn``, ``efficient``, ``flash``, ``_for_cpu``)
and no replicated fallback that the same model traced on CPU does not have.

    python scripts/check_cuda_trace.py            # fxshard.models' Llama (tp=8) and the HF zoo's CI set (tp=2)
    python scripts/check_cuda_trace.py llama qwen3

What it cannot see: without a GPU, SDPA's kernel choice on fake CUDA tensors falls back to the math form, so a
program that lost the ``fxshard::attention`` node shows matmuls here where a GPU would show a cuDNN kernel (the
missing node is still reported). Needs a torch built with CUDA (the GPU machines' wheel works on a CPU-only
machine); a CPU-only build cannot make CUDA tensors, even fake ones. Training graphs are out of reach: autograd's engine starts a thread per
CUDA device, and there is none. ``scripts/check_torch_window.sh`` runs it when the interpreter has CUDA built.
Exit status 1 when any model fails a check.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fxshard  # noqa: E402

DEVICE_KERNELS = ("cudnn", "efficient", "flash", "_for_cpu")
LLAMA = dict(vocab=4096, dim=1024, n_heads=32, n_kv_heads=8, n_layers=2, hidden=2048, max_seq=256)


def on_fake_cuda(model: torch.nn.Module, inputs: dict) -> dict:
    """Swaps ``model``'s parameters and buffers (in place, frozen) and returns ``inputs`` as fake CUDA tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        return FakeTensor(mode, t.detach().to("meta"), torch.device("cuda"))

    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    table[name] = torch.nn.Parameter(fake(t), requires_grad=False) \
                        if isinstance(t, torch.nn.Parameter) else fake(t)
    return {k: fake(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def programs_ops(sm: fxshard.ShardedModule) -> tuple[set[str], list[str]]:
    """The call targets of ``sm``'s programs and their replicated fallbacks."""
    ops, fallbacks = set(), []
    for p in sm._programs():
        ops |= {str(n.target) for n in p.gm.graph.nodes if n.op == "call_function"}
        fallbacks += list(p.fallbacks)
    return ops, fallbacks


def shard_on(device: str, build, mesh, plan) -> tuple[set[str], list[str]]:
    """Shards ``build()``'s model for inference, traced on ``device`` ("cpu" or fake "cuda") under bf16 autocast."""
    model, inputs = build()
    if device == "cuda":
        inputs = on_fake_cuda(model, inputs)
    else:
        model.requires_grad_(False)
    # torch.autocast("cuda") turns itself off without a GPU; the flags themselves work on fake CUDA tensors
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, torch.bfloat16)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return programs_ops(fxshard.shard(model, mesh, plan, example_kwargs=inputs))
    finally:
        torch.set_autocast_enabled(device, False)


def cases(names: list[str]) -> dict:
    """name -> (build, world size, plan, attends): ``build()`` gives a fresh model and its keyword inputs;
    ``attends``: the model calls ``F.scaled_dot_product_attention`` (not eager-only attention)."""
    from fxshard.models import LlamaDecoder, make_tokens
    from tests.gpu.test_cuda import megatron_plan
    from tests.test_hf_zoo import CI_ARCHS, ZOO, build

    def llama(on: str):
        def make():
            with torch.device(on):
                model = LlamaDecoder(**LLAMA)
            tokens = make_tokens(2, 256, LLAMA["vocab"])
            return model, {"tokens": tokens, "targets": tokens}
        return make

    out = {f"llama-{on}-built": (llama(on), 8, megatron_plan(), True) for on in ("cpu", "meta")}
    for arch in CI_ARCHS:
        out[arch] = ((lambda a=arch: build(a)), 2, "hf", ZOO[arch].get("_attn") != "eager")
    return {k: v for k, v in out.items() if not names or any(k.startswith(n) for n in names)}


def main(names: list[str]) -> int:
    if not torch.backends.cuda.is_built():
        print(f"check_cuda_trace: torch {torch.__version__} has no CUDA built; nothing checked", file=sys.stderr)
        return 1
    from torch.testing._internal.distributed.fake_pg import FakeStore

    failed = 0
    for name, (build, world, plan, attends) in cases(names).items():
        t0 = time.perf_counter()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            ops, fallbacks = shard_on("cuda", build, mesh, plan)
            _, cpu_fallbacks = shard_on("cpu", build, mesh, plan) if fallbacks else (None, [])
            problems = [f"device kernel {o}" for o in sorted(ops) if any(k in o for k in DEVICE_KERNELS)]
            problems += [f"fallback on CUDA only: {f}" for f in sorted(set(fallbacks) - set(cpu_fallbacks))]
            if attends and not any("fxshard.attention" in o for o in ops):
                problems.append("no fxshard::attention node")
        except Exception as e:  # noqa: BLE001 - reported per model
            problems = [f"{type(e).__name__}: {str(e)[:300]}"]
        finally:
            dist.destroy_process_group()
        failed += bool(problems)
        print(f"{name:18s} {'FAIL' if problems else 'ok':4s} {time.perf_counter() - t0:5.1f} s  {'; '.join(problems)}",
              flush=True)
    print(f"check_cuda_trace: torch {torch.__version__}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
