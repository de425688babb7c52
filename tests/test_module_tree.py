"""The module tree of a ShardedModule (fake process group): stand-ins of containers index and iterate like
them and hold the local parameters; hooks that could never fire raise; what ``remat`` puts in the backward;
stand-ins are instances of the original classes (code selecting modules by type: 2 gloo ranks against eager)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from fxshard.core.errors import ShardingError
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan

TOL = 1e-5


@pytest.fixture
def sm(mesh2):
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=3, max_seq=16)
    batch = (models.make_tokens(2, 16, 64, seed=0), models.make_tokens(2, 16, 64, seed=1))
    return fxshard.shard(model, mesh2, transformer_plan(3), example_inputs=batch)


def test_layers_index_iterate_and_hold_the_local_shards(sm):
    layers = list(sm.layers)
    assert len(sm.layers) == 3 and len(layers) == 3
    assert sm.layers[0] is layers[0] and sm.layers[-1] is layers[2] and sm.layers[1:] == layers[1:]
    # the parameters the program reads are the layer's own
    assert sm.layers[1].attn.wq.weight is dict(sm.named_parameters())["layers.1.attn.wq.weight"]
    assert tuple(sm.layers[1].attn.wq.weight.shape) == (16, 32)  # colwise: half the rows on each of 2 ranks
    assert [n for n, _ in sm.layers[2].named_parameters()][:2] == ["attn_norm.weight", "attn_norm.bias"]
    with pytest.raises(ShardingError, match="has 3 modules; index 3"):
        sm.layers[3]


def test_hooks_on_a_submodule_raise_and_say_what_to_do(sm):
    for register in (sm.layers[0].register_forward_hook, sm.layers[0].attn.register_forward_pre_hook,
                     sm.layers[0].register_full_backward_hook):
        with pytest.raises(ShardingError, match="would never fire.*ShardedModule itself.*remat='layers'"):
            register(lambda *a: None)
    with pytest.raises(ShardingError, match="cannot run on its own.*remat='layers'"):
        sm.layers[0](torch.randn(2, 16, 32))
    seen = []
    sm.register_forward_hook(lambda m, args, out: seen.append(out))  # the ShardedModule's own hooks fire
    batch = (models.make_tokens(2, 16, 64, seed=0), models.make_tokens(2, 16, 64, seed=1))
    with torch.no_grad():
        loss = sm(*batch)
    assert len(seen) == 1 and seen[0] is loss


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_layers_recompute_layer_ops_but_never_random_draws(mesh2):
    model = nn.Sequential(*[_Block(8) for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    progs = {}
    for remat in ("none", "layers"):
        progs[remat] = fxshard.shard(model, mesh2, {}, example_inputs=(x,), remat=remat)._training
    aten = torch.ops.aten
    none_bwd, layers_bwd = _ops(progs["none"].bwd.gm), _ops(progs["layers"].bwd.gm)
    assert none_bwd.count(aten.tanh.default) == 0 and layers_bwd.count(aten.tanh.default) == 3
    assert all(torch.Tag.nondeterministic_seeded not in getattr(t, "tags", ()) for t in layers_bwd)
    assert _ops(progs["layers"].fwd.gm).count(aten.native_dropout.default) == 3


class _Blocks(nn.ModuleList):
    pass


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = _Blocks([nn.Linear(8, 8) for _ in range(2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 4), "b": nn.Linear(8, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.heads["a"](x) + self.heads["b"](x)


def test_container_subclasses_and_module_dicts_index_like_the_model(mesh2):
    sm = fxshard.shard(_Heads(), mesh2, {"blocks.*": ColwiseParallel()}, example_inputs=(torch.randn(4, 8),))
    assert len(sm.blocks) == 2 and sm.blocks[1] is list(sm.blocks)[1] and repr(sm.blocks).startswith("_Blocks(")
    assert isinstance(sm.blocks, _Blocks) and isinstance(sm.heads, nn.ModuleDict)
    assert tuple(sm.blocks[0].weight.shape) == (4, 8)
    assert list(sm.heads) == ["a", "b"] and "b" in sm.heads and sm.heads["b"] is dict(sm.heads.items())["b"]
    with pytest.raises(ShardingError, match="has no module 'c'"):
        sm.heads["c"]


class _Head(nn.Module):
    """A user-defined block with its own method, property, class constant and ``train`` override (as HF's
    PreTrainedModel.train, it reads instance state a stand-in does not have)."""

    scale = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.kernels: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) * self.scale

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.fc.weight)

    @property
    def width(self) -> int:
        return self.fc.in_features

    def train(self, mode: bool = True) -> nn.Module:
        out = super().train(mode)
        for kernel in self.kernels:
            kernel.train(mode)
        return out


class _Tagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with models._seeded(0):
            self.norm = nn.LayerNorm(16)
            self.net1 = nn.Linear(16, 32)
            self.bn = nn.BatchNorm1d(32)
            self.drop = nn.Dropout(0.0)
            self.head = _Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.bn(torch.relu(self.net1(self.norm(x))))))


_TAGGED_PLAN = {"net1": ColwiseParallel(), "head.fc": RowwiseParallel()}


def test_stand_ins_are_instances_of_the_original_classes_and_run_none_of_their_code(mesh2):
    """isinstance() was False for every stand-in (they were Scopes), so code selecting modules by type silently
    did nothing. Now each is an instance of its original class, named like it, while what runs stays the
    stand-in's: its forward, nn.Module's train (not _Head's), no method or property of the original class."""
    model = _Tagged()
    sm = fxshard.shard(copy.deepcopy(model), mesh2, _TAGGED_PLAN, example_inputs=(torch.randn(8, 16),))
    for fqn, orig in model.named_modules():
        if fqn:
            stand_in = sm.get_submodule(fqn)
            assert isinstance(stand_in, type(orig)), fqn
            assert (type(stand_in).__name__, stand_in.__class__.__qualname__) == (type(orig).__name__,
                                                                                 type(orig).__qualname__)
    assert repr(sm.head) == "_Head(\n  (fc): Linear()\n  (norm): LayerNorm()\n)"
    assert sm.net1.extra_repr() == "" and sm.head.scale == 0.5  # nn.Module's extra_repr; a class constant reads
    sm.eval()  # _Head.train runs on the model's meta copy (it reads kernels, a list a stand-in does not carry)
    assert not sm.head.training and not sm.bn.training
    with pytest.raises(ShardingError, match="cannot run on its own"):
        sm.head(torch.randn(8, 32))
    with pytest.raises(ShardingError, match=r"_Head.reset_parameters cannot run on the _Head 'head'.*init_parameters"):
        sm.head.reset_parameters()
    with pytest.raises(ShardingError, match=r"Linear.reset_parameters cannot run .* 'net1'.*init_parameters"):
        sm.net1.reset_parameters()
    with pytest.raises(ShardingError, match=r"_Head.width \(a property\) cannot be read.*original model"):
        sm.head.width
    for m, name, value in ((sm.head, "scale", 1.0), (sm.drop, "p", 0.0)):
        with pytest.raises(ShardingError, match=f"setting '{name}' .* would change nothing"):
            setattr(m, name, value)
    assert type(copy.deepcopy(sm).head) is type(sm.head)
    head = pickle.loads(pickle.dumps(sm.head))
    assert type(head) is type(sm.head) and torch.equal(head.fc.weight, sm.head.fc.weight)


class _Final(nn.Linear):
    def __init_subclass__(cls, **kwargs: object) -> None:
        raise TypeError("_Final cannot be subclassed")


def test_a_class_that_cannot_be_subclassed_keeps_a_plain_stand_in_and_says_so(mesh2):
    with pytest.warns(UserWarning, match="not instances of _Final.*cannot be subclassed"):
        sm = fxshard.shard(nn.Sequential(_Final(8, 8)), mesh2, {}, example_inputs=(torch.randn(4, 8),))
    plain = sm.get_submodule("0")
    assert type(plain).__name__ == "Scope" and repr(plain) == "_Final()"


def _init_by_type(m: nn.Module) -> None:
    """Initializers that give the same values sharded (elementwise constants), selected by type and by class name
    (DCGAN's weights_init)."""
    if isinstance(m, nn.Linear):
        nn.init.zeros_(m.bias)
    if m.__class__.__name__.find("BatchNorm") != -1:
        nn.init.constant_(m.weight, 1.5)


def _train_selecting_by_type(m: nn.Module, case: str, batches: list) -> tuple[list[float], list[str]]:
    """Trains ``m`` with code that selects its modules by type; the losses, and the parameters HF's Trainer decays."""
    from transformers.trainer_pt_utils import get_parameter_names

    decay: list[str] = []
    if case == "no_decay":  # Trainer.get_decay_parameter_names: no weight decay for LayerNorms (by type) and biases
        decay = sorted(get_parameter_names(m, [nn.LayerNorm], [r"bias"]))
        named = list(m.named_parameters())
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            [{"params": [p for n, p in named if n in decay], "weight_decay": 0.5},
             {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=1e-2)
    else:
        if case == "apply_init":
            m.apply(_init_by_type)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for step, (x, y) in enumerate(batches):
        if case == "freeze_bn" and step == 2:  # fine-tuning: BatchNorm in eval mode and frozen
            for mod in m.modules():
                if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                    mod.eval()
                    mod.requires_grad_(False)
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, decay


def _selecting_by_type(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(5)]
    out = {}
    for case in ("no_decay", "freeze_bn", "apply_init"):
        ref = _Tagged()
        sm = fxshard.shard(copy.deepcopy(ref), mesh, _TAGGED_PLAN, example_inputs=(batches[0][0],))
        (want, want_decay), (got, got_decay) = (_train_selecting_by_type(m, case, batches) for m in (ref, sm))
        full = sm.full_state_dict()
        out[case] = {"loss": max(abs(a - b) for a, b in zip(got, want)), "decay": (got_decay, want_decay),
                     "state": max((full[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items()),
                     "bn training": (sm.bn.training, ref.bn.training)}
    return out


def test_code_selecting_modules_by_type_trains_as_eager():
    """Measured before (2 ranks): HF's no-decay groups put LayerNorm weights in the decay group (parameters 0.023
    off eager); freezing BatchNorm by type did nothing (running statistics 0.197 off); model.apply(init) by type
    or class name did nothing. Each now trains as eager (losses, parameters, buffers)."""
    for res in run_ranks(_selecting_by_type, 2):
        for case, r in res.items():
            assert r["decay"][0] == r["decay"][1] and r["bn training"][0] == r["bn training"][1], (case, r)
            assert r["loss"] <= TOL and r["state"] <= TOL, (case, r)
        assert "norm.weight" not in res["no_decay"]["decay"][1] and "net1.weight" in res["no_decay"]["decay"][1]


def test_replacing_a_stand_in_raises(mesh2):
    """Found by type, a stand-in is what module-swapping utilities replace (convert_sync_batchnorm, BatchNorm
    freezing or LoRA helpers), but the programs keep computing the original module: replacing one raises. The
    same module again and names the model did not have are set as on any module."""
    sm = fxshard.shard(_Tagged(), mesh2, _TAGGED_PLAN, example_inputs=(torch.randn(8, 16),))
    with pytest.raises(ShardingError, match=r"replacing the BatchNorm1d 'bn' inside a ShardedModule with "
                                            r"SyncBatchNorm would change nothing.*shard it again"):
        nn.SyncBatchNorm.convert_sync_batchnorm(sm)
    with pytest.raises(ShardingError, match=r"replacing the Dropout 'drop' inside a ShardedModule with Identity"):
        sm.drop = nn.Identity()
    with pytest.raises(ShardingError, match=r"replacing the Linear 'head.fc' inside a ShardedModule with None"):
        sm.head.register_module("fc", None)
    sm.head.fc = sm.head.fc
    sm.extra = nn.Identity()
    assert isinstance(sm.bn, nn.BatchNorm1d) and isinstance(sm.drop, nn.Dropout) and isinstance(sm.extra, nn.Identity)


class _FrozenStemBackbone(nn.Module):
    """A backbone whose ``train`` keeps its BatchNorm in eval and its stem frozen (mmdet's norm_eval and
    frozen_stages): eager's ``model.train()`` runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.mid = nn.Linear(8, 8)
        self.norm_eval = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mid(torch.relu(self.bn(self.stem(x))))

    def train(self, mode: bool = True) -> nn.Module:
        super().train(mode)
        if mode and self.norm_eval:
            self.bn.eval()
        for p in self.stem.parameters():
            p.requires_grad = False
        return self


class _WithBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with models._seeded(0):
            self.backbone = _FrozenStemBackbone()
            self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.backbone(x))


def test_train_overrides_of_the_models_classes_set_modes_and_frozen_parameters_as_eager(mesh2):
    """sm.train() ran nn.Module.train only, so a backbone class keeping its BatchNorm in eval (and its stem frozen)
    in its own train() trained the BatchNorm under fxshard: other outputs and running statistics than eager's,
    silently. The override now runs on the model's meta copy and the stand-ins take the modes and requires_grad
    flags it set, from sm.train() and from the backbone's stand-in alike. Replicated plan on the fake process
    group, so the sharded numbers are the unsharded ones."""
    ref = _WithBackbone().eval()
    sm = fxshard.shard(copy.deepcopy(ref), mesh2, {}, example_inputs=(torch.randn(6, 8),))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    for call in (lambda m: m.train(), lambda m: m.eval(), lambda m: m.backbone.train()):
        call(ref), call(sm)
        assert {n: m.training for n, m in sm.named_modules()} == {n: m.training for n, m in ref.named_modules()}
        assert {n: p.requires_grad for n, p in sm.named_parameters()} == \
            {n: p.requires_grad for n, p in ref.named_parameters()}
        got, want = sm(x), ref(x)
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
        got.square().sum().backward()
        want.square().sum().backward()
        for n, p in ref.named_parameters():
            g = sm.get_parameter(n).grad
            assert (g is None) == (p.grad is None) and (g is None or torch.allclose(g, p.grad, atol=1e-5)), n
        for n, b in ref.named_buffers():
            assert torch.allclose(sm.get_buffer(n).float(), b.float()), n
        sm.zero_grad(), ref.zero_grad()
    # the override starts from the module's own state: a stage unfrozen by hand is frozen again, in a copy too
    for a, b in ((sm, ref), (copy.deepcopy(sm), copy.deepcopy(ref))):
        a.backbone.stem.weight.requires_grad_(True), b.backbone.stem.weight.requires_grad_(True)
        a.train(), b.train()
        assert not a.backbone.stem.weight.requires_grad and not a.backbone.bn.training


def test_apply_initializing_split_parameters_by_type_raises_constant_fills_pass(mesh2):
    """With stand-ins instances of their classes, sm.apply(init) with an isinstance test runs nn.init on this rank's
    pieces: a random init of a split weight drew the same numbers on both ranks (fan-in from the piece), silently.
    It raises; constant fills (right on pieces) and replicated parameters pass and match eager's init."""
    model = _Tagged()
    sm = fxshard.shard(copy.deepcopy(model), mesh2, _TAGGED_PLAN, example_inputs=(torch.randn(8, 16),))

    def normal_(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)

    with pytest.raises(ShardingError, match=r"apply\(fn\) wrote net1.weight.*init_parameters"):
        sm.apply(normal_)

    def fills(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)
            nn.init.constant_(m.weight, 0.25)
        if isinstance(m, nn.LayerNorm):  # replicated: any init is right
            nn.init.normal_(m.weight, generator=torch.Generator().manual_seed(3))

    sm.apply(fills)
    model.apply(fills)
    for fqn, p in model.named_parameters():
        local = sm.get_parameter(fqn).detach()
        if sm._how_split(fqn):  # a constant fill: this rank's piece holds eager's one value
            assert p.unique().numel() == 1 and torch.all(local == p.reshape(-1)[0]), fqn
        else:
            assert torch.equal(local, p.detach()), fqn
