"""Packed (strided) parameter specs end to end, and the local pieces of every spec form.

A packed dim (``P(Packed("tp", 2), None)``, internally ``S(0, outer=2)``, torch's ``_StridedShard``) gives
each rank its chunk of every block, which is what a fused ``[gate; up]`` projection needs. The first test
checks, on the fake process group for every rank coordinate, that the local parameters of every spec form
the plan checker accepts are exactly the pieces the sharded program assumes; the others check training
parity, ``full_state_dict``, ``load_full_state_dict``, ``init_parameters`` and DCP on real gloo ranks.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import fxshard
from fxshard import ColwiseParallel, P, Packed, RowwiseParallel, ShardingError
from fxshard.state.checkpoint import take
from fxshard.core.mesh import MeshInfo
from fxshard.core.placements import R, S, to_torch
from fxshard.plans.plan import resolve_plan
from fxshard.core.ir import META_KEY
from tests import models
from tests.conftest import fake_world
from tests.dist_utils import run_ranks

TOL = 1e-5

# (mesh shape, axis names) -> [(tensor shape, spec)]; parameters are named w0, w1, ... in order
SPEC_FORMS = {
    ((2,), ("tp",)): [
        ((8, 6), P("tp", None)),                                 # even
        ((5, 6), P("tp", None)),                                 # uneven: 3 + 2
        ((4, 7), P(None, "tp")),                                 # uneven on the last dim
        ((8, 6), P(Packed("tp", 2), None)),                      # packed [gate; up]
        ((4, 12), P(None, Packed("tp", 3))),                     # three packed blocks on dim 1
        ((8,), P(Packed("tp", 2))),                              # packed bias
        ((2, 8, 4), P(None, Packed("tp", 2), None)),             # packed MoE experts [E, 2I, H]
        ((6, 4), (Shard(1),)),                                   # torch placements
        ((8, 4), (_StridedShard(0, split_factor=2),)),           # torch's strided placement
        ((4, 8), (_StridedShard(-1, split_factor=2),)),          # ... with a negative dim
        ((4, 8), (S(1, 4),)),                                    # the internal form
        ((3, 4), None),                                          # replicated
    ],
    ((4,), ("tp",)): [
        ((7, 2), P("tp")),                                       # uneven over 4: 2 + 2 + 2 + 1
        ((16, 2), P(Packed("tp", 2))),
        ((8, 4), P(None, "tp")),
    ],
    ((2, 2), ("dp", "tp")): [
        ((8, 2), P(("dp", "tp"), None)),                         # one dim over two axes, dp major
        ((4, 6), P("dp", "tp")),
        ((4, 6), P("tp", "dp")),
        ((5, 7), P("dp", "tp")),                                 # uneven on both dims (one axis each)
        ((8, 6), P(Packed("tp", 2), "dp")),                      # packed on tp, another dim on dp
        ((6, 8), P("tp", Packed("dp", 2))),
        ((8, 6), (Shard(1), _StridedShard(0, split_factor=2))),  # torch placements per mesh axis
        ((4, 4), P(None, "tp")),                                 # replicated over dp
    ],
}
STYLE_MESHES = {((2,), ("tp",)), ((2, 2), ("dp", "tp"))}  # meshes with an axis named tp for the styles


class Holder(nn.Module):
    """Parameters of the given shapes (plus a Linear pair for the styles); ``forward(x)`` returns each
    parameter times ``x``, so with replicated parameters and ``out_specs`` the sharded program's output is
    its own cut of each parameter."""

    def __init__(self, shapes: list[tuple[int, ...]], styles: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i, shape in enumerate(shapes):
            self.register_parameter(f"w{i}", nn.Parameter(torch.randn(shape, generator=g)))
        if styles:
            self.col = nn.Linear(4, 6)
            self.row = nn.Linear(6, 4)
            for p in (*self.col.parameters(), *self.row.parameters()):
                p.data.copy_(torch.randn(p.shape, generator=g))
        self.requires_grad_(False)  # inference programs only: this model checks layouts, not gradients

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p * x for p in self.parameters())


def reference_piece(full: torch.Tensor, pls, sizes, coords) -> torch.Tensor:
    """The placement semantics spelled out: mesh axes apply left to right (DTensor's order); ``S(d)``
    keeps ``torch.chunk`` piece ``c``; ``S(d, outer=k)`` views dim ``d`` as ``[k, size/k]`` and keeps
    chunk ``c`` of the second factor."""
    t = full
    for p, n, c in zip(pls, sizes, coords):
        if not isinstance(p, S):
            continue
        if p.outer == 1:
            pieces = t.chunk(n, dim=p.dim)
            assert len(pieces) == n
            t = pieces[c]
        else:
            sh = list(t.shape)
            v = t.reshape(sh[:p.dim] + [p.outer, sh[p.dim] // p.outer] + sh[p.dim + 1:])
            t = v.chunk(n, dim=p.dim + 1)[c].reshape(sh[:p.dim] + [sh[p.dim] // n] + sh[p.dim + 1:])
    return t


def _one_rank(mesh, shapes, specs, styles, path):
    """{fqn: (placements, full, [local, program's cut, reference, torch's cut, init_parameters,
    load_full_state_dict(file)], local shape of the program's placeholder)} on this fake rank."""
    from safetensors.torch import save_file

    info = MeshInfo.of(mesh)
    plan = {f"w{i}": spec for i, spec in enumerate(specs) if spec is not None}
    if styles:
        plan.update({"col": ColwiseParallel(), "row": RowwiseParallel()})
    x = torch.ones(())
    model = Holder(shapes, styles)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pls = resolve_plan(plan, model, info)
    names = list(full)
    k = len(info.sizes)
    sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=(x,))
    program = fxshard.shard(model, mesh, None, example_inputs=(x,),
                            out_specs=tuple(pls.get(n, (Replicate(),) * k) for n in names))(x)
    placeholder = {}
    for node, slot in zip([n for n in sm._fwd.gm.graph.nodes if n.op == "placeholder"], sm._slots):
        if slot.kind == "param":
            placeholder[slot.names[0]] = tuple(int(s) for s in node.meta[META_KEY].local_shape(info.sizes, info.coords))
    local = lambda: {n: t.detach().clone() for n, t in [*sm.named_parameters(), *sm.named_buffers()]}
    own = local()
    sm.init_parameters(lambda name, t: t.copy_(full[name]))
    init = local()
    save_file(full, path)
    sm.load_full_state_dict(path)
    out = {}
    for i, n in enumerate(names):
        p = pls.get(n, (Replicate(),) * k)
        p = tuple(fxshard.core.placements.from_torch(q) for q in p)
        torch_cut = distribute_tensor(full[n], mesh, [to_torch(q) for q in p], src_data_rank=None).to_local()
        pieces = [own[n], program[i], reference_piece(full[n], p, info.sizes, info.coords), torch_cut,
                  take(full[n], p, info), init[n], local()[n]]
        out[n] = (p, pieces, placeholder[n])
    return out


def test_every_spec_form_gives_the_pieces_the_program_assumes(tmp_path):
    """For every rank coordinate: the local parameter equals the program's own cut of the replicated
    value (``out_specs``), the placement semantics spelled out, torch's ``distribute_tensor`` cut,
    ``init_parameters`` and ``load_full_state_dict`` from a safetensors file; its shape is the one
    the program's placeholder is localized to."""
    checked, expected = 0, 0
    for (shape, axis_names), cases in SPEC_FORMS.items():
        world = 1
        for s in shape:
            world *= s
        shapes = [c[0] for c in cases]
        specs = [c[1] for c in cases]
        styles = (shape, axis_names) in STYLE_MESHES
        expected += world * (len(cases) + (4 if styles else 0))  # the styled Linear pair has 4 parameters
        for rank in range(world):
            with fake_world(world, rank, shape, axis_names) as mesh:
                res = _one_rank(mesh, shapes, specs, styles, str(tmp_path / "full.safetensors"))
            for name, (pls, pieces, placeholder_shape) in res.items():
                what = f"mesh {dict(zip(axis_names, shape))} rank {rank} {name} {pls}"
                local = pieces[0]
                assert tuple(local.shape) == placeholder_shape, what
                for j, other in enumerate(pieces[1:], 1):
                    assert torch.equal(local, other), f"{what}: piece {j} differs"
                checked += 1
    assert checked == expected  # every parameter of every case on every rank


def test_packed_split_that_does_not_divide_each_block_is_a_sharding_error(fake_mesh):
    mesh = fake_mesh(2)
    with pytest.raises(ShardingError, match=r"w0 dim 0 \(size 6\).*each of its 2 packed blocks must split evenly"):
        resolve_plan({"w0": P(Packed("tp", 2), None)}, Holder([(6, 4)], False), MeshInfo.of(mesh))


def test_packed_dim_shared_with_another_axis_is_a_sharding_error(fake_mesh):
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with pytest.raises(ShardingError, match="packed dim .* is split over one mesh axis only"):
        resolve_plan({"w0": (Shard(0), _StridedShard(0, split_factor=2))}, Holder([(8, 4)], False),
                     MeshInfo.of(mesh))


def test_axes_out_of_mesh_order_in_one_dim_are_a_sharding_error(fake_mesh):
    """P(("tp", "dp")) would mean tp major; fxshard lays a dim split over several axes out major-first in
    mesh order, so the spec is refused rather than read as P(("dp", "tp"))."""
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with pytest.raises(ShardingError, match=r"'tp' major.*write \('dp', 'tp'\)"):
        resolve_plan({"w0": P(("tp", "dp"), None)}, Holder([(8, 4)], False), MeshInfo.of(mesh))


def test_packed_spec_round_trips_through_placements():
    spec = P(Packed("tp", 2), "dp")
    pls = spec.to_placements(("dp", "tp"), 2)
    assert pls == (S(1), S(0, 2))
    assert P.from_placements(pls, ("dp", "tp"), 2) == spec
    assert to_torch(S(0, 2)) == _StridedShard(0, split_factor=2)
    assert repr(spec) == "P(Packed('tp', 2), 'dp')"
    with pytest.raises(ShardingError, match="Packed"):
        Packed(("dp", "tp"), 2)


# ----------------------------------------------------------------- numerics on gloo ranks

PACKED_PLANS = {
    "fused_mlp": {"gate_up.weight": P(Packed("tp", 2), None), "gate_up.bias": P(Packed("tp", 2)),
                  "down.weight": P(None, "tp")},
    "packed_moe": {"gate_up_proj": P(None, Packed("tp", 2), None), "down_proj": P(None, None, "tp")},
    "moe_experts_split": {"gate_up_proj": P("tp"), "down_proj": P("tp")},
}
CASES = {c.name: c for c in models.MODEL_CASES}


def _case(name: str):
    return CASES["packed_moe" if name == "moe_experts_split" else name]


def _train_packed(rank: int, world: int, path: str) -> dict:
    """Each packed plan: loss and every parameter after 2 SGD steps vs the unsharded model, the local
    shards vs the reference pieces, collective counts. Then fused_mlp's trained state: a DCP checkpoint
    saved packed and loaded at other layouts, and a safetensors file loaded packed."""
    from safetensors.torch import save_file

    mesh = fxshard.init_mesh(tp=2)
    info = MeshInfo.of(mesh)
    out: dict = {}
    for name, plan in PACKED_PLANS.items():
        case = _case(name)
        model, batch = case.make_model(), case.make_inputs()
        ref = copy.deepcopy(model)
        sm = fxshard.shard(model, mesh, plan, example_inputs=batch)
        opt, ref_opt = torch.optim.SGD(sm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        losses = []
        for _ in range(2):
            for o in (opt, ref_opt):
                o.zero_grad()
            loss, ref_loss = sm(*batch), ref(*batch)
            loss.backward()
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            losses.append(abs(loss.item() - ref_loss.item()))
        full = sm.full_state_dict()
        want = ref.state_dict()
        out[name] = {
            "loss": max(losses),
            "params": max((full[k] - v).abs().max().item() for k, v in want.items()),
            "local": max((p - take(want[n], sm._placements[n], info)).abs().max().item()
                         for n, p in sm.named_parameters()),
            "comm": fxshard.comm_stats(sm),
        }
        if name == "fused_mlp":
            trained, saved = sm, full
    case = CASES["fused_mlp"]
    out["saved"] = saved
    dcp.save({"model": trained.sharded_state_dict()}, checkpoint_id=os.path.join(path, "dcp"))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in saved.items()}, os.path.join(path, "full.safetensors"))
    torch.distributed.barrier()
    for layout, plan in OTHER_LAYOUTS.items():
        sm = fxshard.shard(case.make_model(), mesh, plan, example_inputs=case.make_inputs())
        state = {"model": sm.sharded_state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        sm.load_sharded_state_dict(state["model"])
        out[layout] = sm.full_state_dict()
    fresh = fxshard.shard(case.make_model(), mesh, PACKED_PLANS["fused_mlp"], example_inputs=case.make_inputs())
    fresh.load_full_state_dict(os.path.join(path, "full.safetensors"))
    out["loaded_file"] = max((a - b).abs().max().item()
                             for a, b in zip(fresh.state_dict().values(), trained.state_dict().values()))
    return out


# fused_mlp's checkpoint (saved with PACKED_PLANS["fused_mlp"]) loads into these layouts too
OTHER_LAYOUTS = {
    "plain": {"gate_up.weight": P("tp", None), "gate_up.bias": P("tp"), "down.weight": P(None, "tp")},
    "packed_4_blocks": {"gate_up.weight": P(Packed("tp", 4), None), "gate_up.bias": P(Packed("tp", 4))},
    "replicated": {},
}


def test_packed_plans_train_with_parity_and_checkpoint_across_layouts():
    with tempfile.TemporaryDirectory() as path:
        res = run_ranks(_train_packed, 2, path)
        for r in res:
            for name in PACKED_PLANS:
                assert r[name]["loss"] < TOL and r[name]["params"] < TOL and r[name]["local"] < TOL, (name, r[name])
            assert r["loaded_file"] == 0.0
            for layout in OTHER_LAYOUTS:
                assert all(torch.equal(r[layout][k], r["saved"][k]) for k in r["saved"]), layout
        # packed layouts keep the gate/up split local: Megatron's one forward all-reduce, nothing backward
        for name in ("fused_mlp", "packed_moe"):
            comm = res[0][name]["comm"]
            assert set(comm["forward"]) == {"all_reduce"} and comm["forward"]["all_reduce"]["count"] == 1, comm
            assert comm["backward"] == {}, comm
        model = CASES["fused_mlp"].make_model()  # into the unsharded model, no process group
        sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        dcp.load({"model": sd}, checkpoint_id=os.path.join(path, "dcp"))
        assert all(torch.equal(sd[k], res[0]["saved"][k]) for k in sd)


def test_rules_read_strided_factors_from_one_place():
    """``registry.outer_of``/``split_outers``: the factors a dim may be split with, given its inputs' layouts."""
    from fxshard.rules.registry import outer_of, split_outers

    assert outer_of(S(1, 3), 1) == 3 and outer_of(S(1, 3), 0) == 1 and outer_of(R, 0) == 1 and outer_of(S(0), 0) == 1
    assert split_outers([(S(0, 2), 0), (S(1, 4), None), (R, 1), (S(1, 3), 1)]) == [1, 2, 3]
    assert split_outers([]) == [1]
