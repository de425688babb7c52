"""ParallelStyles of other libraries (torchtitan's ``NoParallel``): read by applying them to a meta copy of
the module, trained next to the unsharded model; a style fxshard cannot read is a ShardingError naming it;
the cross-rank plan fingerprint holds no memory addresses."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

import fxshard
from fxshard.comm.consistency import fingerprint
from fxshard.models import LlamaDecoder, make_tokens
from tests.models import ToyModel
from tests.dist_utils import run_ranks

TOL = 1e-5


class NoParallel(ParallelStyle):
    """Written after torchtitan's ``NoParallel`` (torchtitan/distributed/tensor_parallel.py): parameters become
    Replicate DTensors; the first input is taken as a DTensor of ``input_layout`` and redistributed to Replicate;
    the output is redistributed to ``output_layout`` and handed on as a local tensor with ``use_local_output``.
    No ``__repr__``: its default one holds the object's address."""

    def __init__(self, *, input_layout=None, output_layout=None, use_local_output: bool = False) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.output_layout = output_layout or Replicate()
        self.desired_input_layout = Replicate()
        self.use_local_output = use_local_output

    @staticmethod
    def _in(input_layout, desired, mod, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (input_layout,), run_check=False)
        if input_layout != desired:
            x = x.redistribute(placements=(desired,), async_op=True)
        return (x, *inputs[1:])

    @staticmethod
    def _out(output_layout, use_local_output, mod, outputs, mesh):
        if outputs.placements != (output_layout,):
            outputs = outputs.redistribute(placements=(output_layout,), async_op=True)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, None,
                                 partial(self._in, self.input_layout, self.desired_input_layout),
                                 partial(self._out, self.output_layout, self.use_local_output))


class PartialOutput(ParallelStyle):
    """A style whose output hook hands on a pending sum: no global value fxshard could give it."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def out(mod, inputs, outputs, mesh):
            return DTensor.from_local(outputs, mesh, (Replicate(),), run_check=False).redistribute(
                placements=(Partial(),)).to_local()
        return distribute_module(module, device_mesh, None, None, out)


class ReplicatedColwise(ColwiseParallel):
    """A subclass of torch's style whose ``_apply`` does something else (replicates): read by applying it, not
    from the ColwiseParallel arguments it inherits."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return NoParallel(use_local_output=True)._apply(module, device_mesh)


def llama_plan_with(norm_style) -> dict:
    """torchtitan's Llama 3 TP plan without sequence parallel: norms kept replicated by ``norm_style()``."""
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
            "norm": norm_style(),
            "layers.*.attention_norm": norm_style(),
            "layers.*.ffn_norm": norm_style()}
    for w in ("wq", "wk", "wv"):
        plan[f"layers.*.attention.{w}"] = ColwiseParallel()
    plan["layers.*.attention.wo"] = RowwiseParallel()
    plan["layers.*.feed_forward.w1"] = ColwiseParallel()
    plan["layers.*.feed_forward.w3"] = ColwiseParallel()
    plan["layers.*.feed_forward.w2"] = RowwiseParallel()
    return plan


def _train_no_parallel(rank: int, world: int) -> dict:
    """Two NoParallel variants in torchtitan's plan: 3 AdamW steps vs the unsharded model (losses, every full
    gradient, parameters); the norms' weights stay whole, wq is split; a ColwiseParallel subclass that replicates;
    a PartialOutput entry raises; the plan's fingerprint as this rank sees it."""
    mesh = fxshard.init_mesh(tp=world)
    batches = [(make_tokens(2, 16, 64, seed=s), make_tokens(2, 16, 64, seed=s + 9)) for s in range(2)]
    out: dict = {}
    for name, style in (("local output", lambda: NoParallel(use_local_output=True)),
                        ("DTensor output", NoParallel)):
        model = LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)
        ref = copy.deepcopy(model)
        plan = llama_plan_with(style)
        out.setdefault("fingerprint", fingerprint(plan, model, batches[0]))
        sm = fxshard.shard(model, mesh, plan, example_inputs=batches[0])
        opt, ref_opt = torch.optim.AdamW(sm.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
        loss_err = grad_err = 0.0
        for i in range(3):
            tok, y = batches[i % 2]
            opt.zero_grad(), ref_opt.zero_grad()
            loss, ref_loss = sm(tok, y), ref(tok, y)
            loss.backward(), ref_loss.backward()
            loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
            ref_grads = dict(ref.named_parameters())
            for fqn, p in sm.named_parameters():
                full = sm._dtensor(fqn, p.grad).full_tensor()
                grad_err = max(grad_err, (full - ref_grads[fqn].grad).abs().max().item())
            opt.step(), ref_opt.step()
        full = sm.full_state_dict()
        out[name] = {"loss": loss_err, "grad": grad_err,
                     "param": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
                     "norm": tuple(sm.get_parameter("layers.0.attention_norm.weight").shape),
                     "wq": tuple(sm.get_parameter("layers.0.attention.wq.weight").shape)}
    toy, x = ToyModel(16, 32), torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    sm = fxshard.shard(copy.deepcopy(toy), mesh, {"net1": ReplicatedColwise(), "net2": RowwiseParallel()},
                       example_inputs=(x,))
    sm(x).square().sum().backward(), toy(x).square().sum().backward()
    out["subclass"] = {"net1": tuple(sm.net1.weight.shape), "fwd": (sm(x) - toy(x)).abs().max().item(),
                       "grad": max((sm._dtensor(n, p.grad).full_tensor() - toy.get_parameter(n).grad).abs().max().item()
                                   for n, p in sm.named_parameters())}
    model = LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)
    try:
        fxshard.shard(model, mesh, llama_plan_with(PartialOutput), example_inputs=batches[0])
        out["unreadable"] = ""
    except fxshard.ShardingError as e:
        out["unreadable"] = str(e)
    return out


def test_torchtitan_no_parallel_style_trains_like_the_unsharded_model():
    """Before: every plan with NoParallel raised 'differs between rank 0 (<...NoParallel object at 0x7ff0...>) and
    rank 1 (...)' (the fingerprint held the objects' addresses) and, with a __repr__, 'NoParallel is not a supported
    ParallelStyle'. Now its norms are read as replicated and the plan trains with parity."""
    res = run_ranks(_train_no_parallel, 2, timeout=600)
    assert res[0]["fingerprint"] == res[1]["fingerprint"]
    assert not any("0x" in v for v in res[0]["fingerprint"].values()), res[0]["fingerprint"]
    assert "NoParallel(" in res[0]["fingerprint"]["plan entry 'norm'"]
    for r in res:
        for name in ("local output", "DTensor output"):
            got = r[name]
            # parameters after 3 AdamW steps: its normalized update amplifies float noise in the tiniest gradients
            assert got["loss"] <= TOL and got["grad"] <= TOL and got["param"] <= 1e-4, (name, got)
            assert got["norm"] == (32,) and got["wq"] == (16, 32), (name, got)
        sub = r["subclass"]
        assert sub["net1"] == (32, 16) and sub["fwd"] <= TOL and sub["grad"] <= TOL, sub  # net1 whole, not split
        msg = r["unreadable"]
        assert "PartialOutput" in msg and "plan entry 'norm'" in msg and "ColwiseParallel" in msg, msg


class _Plain:
    """No ``__repr__``, state of several kinds."""

    def __init__(self) -> None:
        self.layout = Replicate()
        self.fn = partial(max, 1)
        self.inner = NoParallel(use_local_output=True)
        self.weights = torch.zeros(3)
        self.me = self


@pytest.mark.parametrize("value", [_Plain(), NoParallel(), [object(), {"a": _Plain}], lambda x: x])
def test_a_fingerprint_holds_no_address(value):
    fp = fingerprint({"x": value}, nn.Linear(2, 2), ())
    assert not any("0x" in v for v in fp.values()), fp


def test_fingerprint_names_what_differs_in_an_object_without_repr():
    a, b = fingerprint({"n": NoParallel()}, nn.Linear(2, 2), ()), fingerprint(
        {"n": NoParallel(use_local_output=True)}, nn.Linear(2, 2), ())
    assert a["plan entry 'n'"] != b["plan entry 'n'"] and "use_local_output=True" in b["plan entry 'n'"]


def test_layouts_read_from_a_styles_hooks(mesh2):
    """The layouts a style's hooks produce, on the fake process group: a Shard counted from the end stays so."""
    from fxshard.core.mesh import MeshInfo
    from fxshard.plans.plan import resolve_boundaries, resolve_plan
    from torch.distributed.tensor import Shard

    model, info = ToyModel(16, 32), MeshInfo.of(mesh2)
    plan = {"net1": NoParallel(input_layout=Shard(1), output_layout=Shard(-1), use_local_output=True),
            "net2": NoParallel(output_layout=Shard(0))}
    bounds = resolve_boundaries(plan, model, info)
    assert [b.placement for b in bounds["net1"][0].inputs] == [Replicate()]  # what the module computes with
    assert [b.placement for b in bounds["net1"][0].outputs] == [Shard(-1)]
    assert [b.placement for b in bounds["net2"][0].outputs] == [Shard(0)]
    assert set(resolve_plan(plan, model, info)) == {"net1.weight", "net1.bias", "net2.weight", "net2.bias"}


def test_a_fingerprint_holds_the_device_type_not_the_ranks_device():
    """A style holding its rank's own device (cuda:LOCAL_RANK on a GPU node) is the same plan on every rank."""
    held = []
    for i in range(2):
        style = _Plain()
        style.device = torch.device("cuda", i)
        held.append(fingerprint({"n": style}, nn.Linear(2, 2), ())["plan entry 'n'"])
    assert held[0] == held[1] and "device(cuda)" in held[0], held
