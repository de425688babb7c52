"""Autograd at the module boundary must match eager or fail loudly, never silently differ.

Each case runs the sharded model on 2 gloo ranks next to the unsharded model on the same process
(one ``run_ranks`` call for the module) and compares forward values and every full gradient:

* an output returned next to its own ``.detach()`` (a logged copy) keeps its gradient, and the copy (also a
  view of it) does not require grad;
* outputs that view one tensor (an output and a reshape or a slice of it, overlapping slices of an
  intermediate, one view of an intermediate) stay views of it, and one written in place before the loss
  gives eager's loss and gradients;
* a parameter that only an output left out of the loss reaches gets ``.grad`` None, as in eager (a
  zero tensor would let AdamW decay it);
* ``requires_grad`` changed after ``shard()`` (one weight unfrozen; every weight unfrozen, with the
  batch split) trains that weight from the next call; freezing one since needs no new program;
* an input declared ``Partial('sum')`` (each rank holds a term) gets the whole gradient on every rank;
* a plain tensor attribute (not a buffer, one of them read as a Python number) survives a train -> eval
  switch;
* ``torch.compile(sm)`` follows a train -> eval switch (sharding again outside the dynamo trace);
* a gradient penalty's second derivative taken with ``fxshard.jit`` (nested ``torch.func.grad``);
* a forward-mode JVP taken with ``fxshard.jit`` of ``torch.func.jvp``.

Loud failures: an input that requires grad where the example did not, with no parameter to train,
a backward with ``create_graph=True`` through the module (it gave wrong second derivatives), and a
forward-mode AD tangent on an input or a parameter (it gave a wrong tangent) (2 ranks); mixed partial
kinds over two mesh axes in ``in_specs``, a ``Partial('max')`` input that needs a gradient, and a
tensor made on the input's device in a mode shard() did not trace (fake process group).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import forward_ad as fwAD
from torch.func import functional_call
from torch.distributed.tensor import Partial, Replicate

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel, ShardingError
from tests.dist_utils import run_ranks

TOL = 1e-5
PLAN = {"l1": ColwiseParallel(), "l2": RowwiseParallel()}


class _Mlp(nn.Module):
    def __init__(self, aux: bool = False, attr: bool = False) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.aux = nn.Linear(8, 4) if aux else None
        self.drop = nn.Dropout(0.5)
        self.scale = torch.linspace(0.5, 2.0, 8) if attr else None  # a plain attribute: traced as a constant
        self.temp = torch.tensor(2.0) if attr else None  # read as a Python number

    def forward(self, x: torch.Tensor):
        o = self.l2(self.drop(torch.relu(self.l1(x))))
        if self.scale is not None:
            o = o * self.scale / float(self.temp)
        if self.aux is not None:
            return o, self.aux(x)
        return o, o.detach()


class _DetachedView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor):
        o = self.l2(torch.relu(self.l1(x)))
        return o, o.detach().view(-1)


class _Views(nn.Module):
    """Outputs that view one tensor: another output (reshaped or sliced), or an intermediate (overlapping, or
    one view of it)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.kind = kind

    def forward(self, x: torch.Tensor):
        o = self.l2(torch.relu(self.l1(x)))
        if self.kind == "reshaped":
            return o, o.view(2, 2, 8)
        if self.kind == "sliced":
            return o, o[:, :4]
        if self.kind == "one_view":  # an output that is a view of an intermediate, next to another output
            return o.view(2, 2, 8), o.sum(-1)
        return o[:, :5], o[:, 2:]


class _InputView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor):
        return self.l2(torch.relu(self.l1(x))), x[:, :4]


class _LossInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        loss = F.mse_loss(self.l2(torch.relu(self.l1(x))), y)
        return {"loss": loss, "log": loss.detach()}


def _grad_err(sm, ref: nn.Module, relative: bool = False) -> float:
    """Largest difference between the sharded and eager full gradients (inf when only one side has one);
    ``relative``: each divided by the largest eager entry of that gradient (at least 1)."""
    err = 0.0
    for n, p in sm.named_parameters():
        r = ref.get_parameter(n).grad
        if (p.grad is None) != (r is None):
            return float("inf")
        if r is not None:
            scale = max(1.0, r.abs().max().item()) if relative else 1.0
            err = max(err, (sm._dtensor(n, p.grad).full_tensor() - r).abs().max().item() / scale)
    return err


def _cases(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    out: dict = {}

    def pair(ref: nn.Module, example: tuple):
        return ref, fxshard.shard(copy.deepcopy(ref), mesh, PLAN, example_inputs=example)

    # an output next to its own .detach()
    torch.manual_seed(0)
    ref, sm = pair(_Mlp().eval(), (x,))
    sm.eval()
    got, want = sm(x), ref(x)
    got[0].square().sum().backward()
    want[0].square().sum().backward()
    out["detached_copy"] = {"fwd": max((a - b).abs().max().item() for a, b in zip(got, want)),
                            "grad": _grad_err(sm, ref), "copy_requires_grad": got[1].requires_grad}
    ref, sm = pair(_DetachedView(), (x,))
    got, want = sm(x), ref(x)
    try:
        got[1].sum().backward()
        raised = "no error"
    except RuntimeError as e:  # as eager: "element 0 of tensors does not require grad"
        raised = str(e)
    out["detached_view"] = {"requires_grad": [t.requires_grad for t in got],
                            "eager": [t.requires_grad for t in want], "backward": raised}
    torch.manual_seed(0)
    ref, sm = pair(_LossInside(), (x, y))
    sm(x, y)["loss"].backward()
    ref(x, y)["loss"].backward()
    out["detached_loss_log"] = {"grad": _grad_err(sm, ref)}

    # outputs that view one tensor, one of them written in place before the loss: autograd's bare RuntimeError
    # about a Function returning multiple views; now as eager (the write shows through the other output)
    def written_through(m: nn.Module, written: int) -> tuple:
        m.zero_grad()
        xi = x.clone().requires_grad_()
        a, b = m(xi * 1.0)
        (a, b)[written].mul_(3.0)
        loss = a.square().sum() + b.pow(3).sum()
        loss.backward()
        return loss.item(), xi.grad, b._base is (a if a._base is None else a._base), a._base is not None

    # an output viewing the input, itself a view of the caller's tensor, stays the caller's view (it was taken for
    # a tensor the program made: autograd's bare "leaf variable has been moved into the graph interior")
    def input_view(m: nn.Module) -> torch.Tensor:
        h = torch.cat([x, x], 1).requires_grad_()
        a, b = m(h[:, :8])
        (a.square().sum() + (b * 3).sum()).backward()
        return h.grad

    torch.manual_seed(0)
    ref, sm = pair(_InputView(), (x.clone().requires_grad_(),))
    try:
        out["input_view"] = (input_view(sm) - input_view(ref)).abs().max().item()
    except RuntimeError as e:
        out["input_view"] = str(e)

    for kind in ("reshaped", "sliced", "overlapping", "one_view"):
        torch.manual_seed(0)
        ref, sm = pair(_Views(kind), (x.clone().requires_grad_(),))
        for written in (0, 1):
            want = written_through(ref, written)
            try:
                got = written_through(sm, written)
            except RuntimeError as e:
                out[f"views_{kind}_{written}"] = str(e)
                continue
            out[f"views_{kind}_{written}"] = {
                "loss": abs(got[0] - want[0]) / abs(want[0]), "grad": _grad_err(sm, ref, relative=True),
                "x_grad": (got[1] - want[1]).abs().max().item() / want[1].abs().max().item(),
                "aliases": (got[2:], want[2:])}

    # an output left out of the loss: its own weights get None, and AdamW agrees over steps
    torch.manual_seed(0)
    ref, sm = pair(_Mlp(aux=True).eval(), (x,))
    sm.eval()
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=0.1), torch.optim.AdamW(sm.parameters(), lr=0.1)
    nones, errs = [], []
    for step in range(3):
        main, aux = sm(x)
        rmain, raux = ref(x)
        (main.sum() + (aux.sum() if step == 1 else 0)).backward()
        (rmain.sum() + (raux.sum() if step == 1 else 0)).backward()
        nones.append((sm.aux.weight.grad is None, ref.aux.weight.grad is None))
        errs.append(_grad_err(sm, ref))
        opt.step(), opt_ref.step()
        opt.zero_grad(set_to_none=True), opt_ref.zero_grad(set_to_none=True)
    weights = max((sm._dtensor(n, p).full_tensor() - ref.get_parameter(n)).abs().max().item()
                  for n, p in sm.named_parameters())
    out["unused_output"] = {"nones": nones, "grad": max(errs), "weights_after_adamw": weights}

    # requires_grad changed after shard()
    torch.manual_seed(0)
    ref = _Mlp().eval()
    ref.l1.weight.requires_grad_(False)
    sm = fxshard.shard(copy.deepcopy(ref), mesh, PLAN, example_inputs=(x,)).eval()
    sm.l1.weight.requires_grad_(True)
    ref.l1.weight.requires_grad_(True)
    sm(x)[0].sum().backward()
    ref(x)[0].sum().backward()
    out["unfrozen_one"] = {"grad": _grad_err(sm, ref), "has_grad": sm.l1.weight.grad is not None}
    sm.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    sm.l2.requires_grad_(False), ref.l2.requires_grad_(False)  # frozen since: the programs above still serve
    sm(x)[0].sum().backward()
    ref(x)[0].sum().backward()
    out["frozen_since"] = {"grad": _grad_err(sm, ref), "programs": len(sm._by_mode),
                           "l2_grad_none": sm.l2.weight.grad is None and sm.l2.bias.grad is None}
    torch.manual_seed(0)
    ref = _Mlp().eval().requires_grad_(False)
    sm = fxshard.shard(copy.deepcopy(ref), mesh, {}, example_inputs=(x,), in_specs=(P("tp"),)).eval()
    sm.requires_grad_(True)
    ref.requires_grad_(True)
    sm(x.chunk(2)[rank])[0].square().sum().backward()  # the outputs are replicated (default out_specs)
    ref(x)[0].square().sum().backward()
    out["unfrozen_all_dp"] = {"grad": _grad_err(sm, ref)}

    # an input given as one term of a sum per rank: d(loss)/d(term) is the whole gradient
    class Mul(nn.Module):
        def forward(self, a, b):
            return a.relu() * b

    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    terms = [torch.randn(4, 6, generator=g) for _ in range(2)]
    a_terms = [terms[0], a - terms[0]]  # rank r holds a_terms[r]; their sum is a
    sm = fxshard.shard(Mul(), mesh, {}, example_inputs=(a.requires_grad_(), b.requires_grad_()),
                       in_specs=([Partial()], [Replicate()]))
    la, lb = a_terms[rank].clone().requires_grad_(), b.detach().clone().requires_grad_()
    ct = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    (sm(la, lb) * ct).sum().backward()
    ra, rb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (Mul()(ra, rb) * ct).sum().backward()
    out["partial_input"] = {"da": (la.grad - ra.grad).abs().max().item(),
                            "db": (lb.grad - rb.grad).abs().max().item()}

    # a module returning P(sum) terms (a row-parallel linear left unreduced) feeding one that takes them, and
    # DTensor's from_local taking them: each term's gradient is the whole gradient (it was summed over the ranks,
    # W x eager's, when a P(sum) output's incoming gradient was read as a term of a sum)
    torch.manual_seed(0)
    up, down = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6)), nn.Sequential(nn.Linear(6, 5))
    su = fxshard.shard(copy.deepcopy(up), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()},
                       example_inputs=(x,), out_specs=Partial())
    sd = fxshard.shard(copy.deepcopy(down), mesh, {"0": ColwiseParallel()},
                       example_inputs=(torch.randn(4, 6, requires_grad=True),), in_specs=(Partial(),))
    ct = torch.randn(4, 5, generator=torch.Generator().manual_seed(6))
    (sd(su(x)) * ct).sum().backward()
    (down(up(x)) * ct).sum().backward()
    out["partial_output_chain"] = {"up": _grad_err(su, up), "down": _grad_err(sd, down)}
    su.zero_grad(), up.zero_grad()
    from torch.distributed.tensor import DTensor
    whole = DTensor.from_local(su(x), mesh, [Partial()]).full_tensor()
    (whole * ct[:, :1]).sum().backward()
    (up(x) * ct[:, :1]).sum().backward()
    out["partial_output_dtensor"] = _grad_err(su, up)

    # a plain tensor attribute through a train -> eval switch; compiled, through train -> eval
    torch.manual_seed(0)
    ref, sm = pair(_Mlp(attr=True), (x,))
    sm(x)
    sm.eval(), ref.eval()
    out["attr_eval"] = (sm(x)[0] - ref(x)[0]).abs().max().item()
    torch.manual_seed(0)
    ref, sm = pair(_Mlp(), (x,))
    cm = torch.compile(sm, backend="eager")
    cm(x)[0].sum().backward()
    sm.eval(), ref.eval()
    out["compiled_eval"] = (cm(x)[0] - ref(x)[0]).abs().max().item()

    # a second derivative through the module (a gradient penalty): it gave wrong gradients silently (the
    # backward program is not differentiable); it raises, and fxshard.jit with nested torch.func.grad matches
    torch.manual_seed(0)
    ref, sm = pair(_DetachedView(), (x.clone().requires_grad_(),))
    xi = x.clone().requires_grad_()
    try:  # raised by the first backward: it was asked for a differentiable gradient
        (gx,) = torch.autograd.grad(sm(xi)[0].tanh().sum(), xi, create_graph=True)
        gx.square().sum().backward()
        out["double_backward"] = "no error"
    except ShardingError as e:
        out["double_backward"] = str(e)

    def penalty_grads(params, v):
        def out_sum(vi, p):
            return functional_call(ref, p, (vi,))[0].tanh().sum()
        return torch.func.grad(lambda p: torch.func.grad(out_sum)(v, p).square().sum())(params)

    def part(k, t):  # this rank's piece under specs
        return t if k == "l2.bias" else t.chunk(2, dim=0 if k.startswith("l1") else 1)[rank]

    params = {k: t.detach() for k, t in ref.named_parameters()}
    specs = {"l1.weight": P("tp", None), "l1.bias": P("tp"), "l2.weight": P(None, "tp"), "l2.bias": None}
    got = fxshard.jit(penalty_grads, mesh, in_specs=(specs, None), out_specs=specs)(
        {k: part(k, t) for k, t in params.items()}, x)
    want = penalty_grads(params, x)
    out["jit_penalty"] = max((got[k] - part(k, want[k])).abs().max().item() for k in want)

    # a forward-mode JVP through the module: its tangent was each rank's part (0.46 off eager) under no_grad, and
    # torch's bare NotImplementedError with grad on; it raises, a call without a tangent runs, and fxshard.jit of
    # torch.func.jvp (what the message proposes) matches eager
    torch.manual_seed(0)
    ref, sm = pair(_DetachedView(), (x,))
    t = torch.randn(4, 8, generator=g)
    out["forward_ad"] = {}
    for grad_on in (False, True):
        with torch.set_grad_enabled(grad_on), fwAD.dual_level():
            try:
                tangent = fwAD.unpack_dual(sm(fwAD.make_dual(x, t))[0]).tangent
                want = fwAD.unpack_dual(ref(fwAD.make_dual(x, t))[0]).tangent
                out["forward_ad"][grad_on] = f"no error, tangent off by {(tangent - want).abs().max().item()}"
            except (ShardingError, NotImplementedError) as e:
                out["forward_ad"][grad_on] = f"{type(e).__name__}: {e}"
            out["forward_ad"]["no_tangent"] = (sm(x)[0] - ref(x)[0]).abs().max().item()
    with torch.no_grad(), fwAD.dual_level():  # a tangent on a parameter (functional_call substitutes it)
        duals = {k: fwAD.make_dual(v, torch.ones_like(v)) for k, v in sm.named_parameters()}
        try:
            functional_call(sm, duals, (x,))
            out["forward_ad"]["param"] = "no error"
        except ShardingError as e:
            out["forward_ad"]["param"] = str(e)

    def jvp(params, v, tv):
        return torch.func.jvp(lambda vi: functional_call(ref, params, (vi,))[0], (v,), (tv,))

    got = fxshard.jit(jvp, mesh, in_specs=(specs, None, None))({k: part(k, p) for k, p in params.items()}, x, t)
    want = jvp(params, x, t)
    out["forward_ad"]["jit_jvp"] = max((a - b).abs().max().item() for a, b in zip(got, want))

    # an input that requires grad where the example did not, and no parameter to train
    class Cumsum(nn.Module):
        def forward(self, v):
            return v.cumsum(-1)

    sm = fxshard.shard(Cumsum(), mesh, {}, example_inputs=(torch.randn(3, 6),), in_specs=(P(None, "tp"),))
    try:
        sm(torch.randn(3, 3, requires_grad=True))
        out["untraced_input_grad"] = "no error"
    except ShardingError as e:
        out["untraced_input_grad"] = str(e)
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return run_ranks(_cases, 2, timeout=600)


def test_an_output_and_its_detached_copy_keep_the_gradient(cases):
    for r in cases:
        assert r["detached_copy"]["fwd"] <= TOL and r["detached_copy"]["grad"] <= TOL, r["detached_copy"]
        assert r["detached_copy"]["copy_requires_grad"] is False
        assert r["detached_loss_log"]["grad"] <= TOL, r["detached_loss_log"]
        v = r["detached_view"]
        assert v["requires_grad"] == v["eager"] == [True, False] and "does not require grad" in v["backward"], v


def test_outputs_that_view_one_tensor_can_be_written_in_place_as_in_eager(cases):
    for r in cases:
        for kind in ("reshaped", "sliced", "overlapping", "one_view"):
            for written in (0, 1):
                v = r[f"views_{kind}_{written}"]
                assert isinstance(v, dict), (kind, written, v)
                assert v["loss"] <= TOL and v["grad"] <= TOL and v["x_grad"] <= TOL, (kind, written, v)
                got, want = v["aliases"]  # (b views a's root, a is a view), as in eager
                assert got == want, v
                assert got[0] == (kind != "one_view") and got[1] == (kind in ("overlapping", "one_view")), v


def test_an_output_viewing_an_input_that_is_a_view_keeps_eagers_gradient(cases):
    for r in cases:
        assert isinstance(r["input_view"], float) and r["input_view"] <= TOL, r["input_view"]


def test_weights_only_an_unused_output_reaches_get_no_gradient(cases):
    for r in cases:
        u = r["unused_output"]
        assert u["nones"] == [(True, True), (False, False), (True, True)], u
        assert u["grad"] <= TOL and u["weights_after_adamw"] <= 1e-5, u


def test_requires_grad_changed_after_shard_trains_the_weight(cases):
    for r in cases:
        assert r["unfrozen_one"]["has_grad"] and r["unfrozen_one"]["grad"] <= TOL, r["unfrozen_one"]
        assert r["unfrozen_all_dp"]["grad"] <= 1e-4, r["unfrozen_all_dp"]
        f = r["frozen_since"]
        assert f["grad"] <= TOL and f["l2_grad_none"] and f["programs"] == 2, f  # shard()'s, and l1's unfrozen


def test_a_partial_sum_input_gets_the_whole_gradient_on_every_rank(cases):
    for r in cases:
        assert r["partial_input"]["da"] <= TOL and r["partial_input"]["db"] <= TOL, r["partial_input"]


def test_a_partial_sum_output_takes_the_whole_gradient_of_its_terms(cases):
    for r in cases:
        assert max(r["partial_output_chain"].values()) <= TOL, r["partial_output_chain"]
        assert r["partial_output_dtensor"] <= TOL, r["partial_output_dtensor"]


def test_mode_switches_keep_tensor_attributes_and_work_compiled(cases):
    for r in cases:
        assert r["attr_eval"] <= TOL and r["compiled_eval"] <= TOL, r


def test_a_second_derivative_through_the_module_raises_and_jit_computes_it(cases):
    for r in cases:
        assert "a backward with create_graph=True" in r["double_backward"] and "fxshard.jit" in r["double_backward"], r
        assert r["jit_penalty"] <= TOL, r["jit_penalty"]


def test_forward_mode_ad_through_the_module_raises_and_jit_computes_it(cases):
    for r in cases:
        f = r["forward_ad"]
        for grad_on in (False, True):
            assert f[grad_on].startswith("ShardingError") and "forward-mode AD" in f[grad_on], f
            assert "fxshard.jit" in f[grad_on] and "torch.func.jvp" in f[grad_on], f
        assert "forward-mode AD" in f["param"] and f["no_tangent"] <= TOL and f["jit_jvp"] <= TOL, f


def test_an_input_gradient_without_a_program_raises(cases):
    for r in cases:
        assert "requires grad but the example input did not" in r["untraced_input_grad"], r


class _Abs(nn.Module):
    def forward(self, v):
        return v.abs()


def test_mixed_partial_kinds_are_refused(fake_mesh):
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with pytest.raises(ShardingError, match=r"mixes partial reductions \(max, sum\)"):
        fxshard.shard(_Abs(), mesh, {}, example_inputs=(torch.randn(4, 4),), in_specs=([Partial("max"), Partial()],))


def test_a_partial_max_input_that_needs_a_gradient_is_refused(mesh2):
    with pytest.raises(ShardingError, match=r"input 0 is laid out P\(max\).*needs a gradient"):
        fxshard.shard(_Abs(), mesh2, {}, example_inputs=(torch.randn(4, 4, requires_grad=True),),
                      in_specs=([Partial("max")],))


class _MadeOnTheInputsDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.tensor([1.0 if self.training else 5.0] * 4, device=x.device)


def test_a_tensor_made_on_the_inputs_device_in_an_untraced_mode_raises(mesh2):
    """The meta copy that is sharded again after a mode switch makes it on meta: no value to run with. It
    must not take the value of another tensor the first trace made (they are numbered, not named)."""
    x = torch.randn(2, 4)
    sm = fxshard.shard(_MadeOnTheInputsDevice(), mesh2, {}, example_inputs=(x,))
    sm(x)
    sm.eval()
    with pytest.raises(ShardingError, match=r"a tensor its forward creates .* on the input's device"):
        sm(x)


def test_torch_func_transforms_over_the_module_raise_and_functional_call_works(mesh2):
    """``torch.func.grad``/``vmap`` over a ShardedModule raised torch's bare RuntimeError about autograd.Function's
    setup_context; now a ShardingError names fxshard.jit. ``functional_call`` with substituted tensors (no transform)
    computes what the unsharded model does, gradients to the substitutes included."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(2, 4)
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(x,))
    params = {k: v.detach() * 2 for k, v in model.named_parameters()}
    with pytest.raises(ShardingError, match=r"called under a torch.func transform .* fxshard.jit"):
        torch.func.grad(lambda p: functional_call(sm, p, (x,)).sum())(params)
    with pytest.raises(ShardingError, match=r"called under a torch.func transform"):
        torch.func.vmap(lambda row: sm(row[None]))(x)
    mine = {k: v.clone().requires_grad_() for k, v in params.items()}
    theirs = {k: v.clone().requires_grad_() for k, v in params.items()}
    functional_call(sm, mine, (x,)).sum().backward()
    functional_call(model, theirs, (x,)).sum().backward()
    for k in mine:
        torch.testing.assert_close(mine[k].grad, theirs[k].grad, rtol=0, atol=1e-6)
