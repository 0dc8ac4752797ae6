"""Structure: parameter paths resolve to their owners, the transform keeps the registry,
and so does TP itself, for what a user froze before applying it.

DDP, ``replicate`` and checkpointing find a model's parameters through its registry
(``named_parameters()``, ``parameters()``, ``state_dict()``). The TP->DP transform swaps
parameters in and out of that registry on every forward pass; whatever it loses there,
the optimizer, the checkpoint or DP itself stops seeing.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.cases.trees import TreeCase
from tpdp_verify.judging.verdict import Verdict
from tpdp_verify.properties.exclusions import TREES_WITHOUT_PARAMETERS
from tpdp_verify.properties.modules import build, module_trees
from tpdp_verify.properties.returned import is_a, kind, read, unpacked
from tpdp_verify.ranks.observation import Check, observing
from tpdp_verify.runner.property import tpdp_property

MODES = st.lists(st.tuples(st.sampled_from(["train", "eval"]), st.booleans()), min_size=1, max_size=3)


def _global_shape(t: torch.Tensor) -> tuple[int, ...] | str:
    """The global shape ``t`` stands for; text saying why it cannot be read where the
    implementation left something that cannot say (an info without a shape, no tensor)."""
    try:
        info = getattr(t, "_st_info", None)  # a localized shard knows the DTensor it stands for
        return tuple(info.shape if info is not None else t.shape)
    except Exception as exc:  # noqa: BLE001 - compared, it fails "global shapes" with this text
        return f"<unreadable in a {type(t).__name__}: {type(exc).__name__}: {exc}>"


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _handles(model: torch.nn.Module) -> list[tuple[str, int, bool]]:
    return [(n, id(p), is_a(p, torch.nn.Parameter))
            for n, p in model.named_parameters(remove_duplicate=False)]


def snapshot(model: torch.nn.Module) -> dict:
    """What a user relies on in the registry, in comparable form."""
    params = list(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, p in params:
        groups.setdefault(id(p), []).append(name)
    return {
        "parameter names": [n for n, _ in model.named_parameters()],
        "parameter names, duplicates included": [n for n, _ in params],
        "global shapes": {n: _global_shape(p) for n, p in params},
        "requires_grad": {n: read(p, "requires_grad") for n, p in params},
        "tied parameters": sorted(sorted(g) for g in groups.values() if len(g) > 1),
        "parameters() count": len(list(model.parameters())),
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "state_dict names and global shapes": {k: _global_shape(v) for k, v in model.state_dict().items()},
    }


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _differences(before: dict, now: dict, stage: str) -> list[Check]:
    checks = []
    for key, expected in before.items():
        got = now[key]
        ok = _same(expected, got)
        detail = "" if ok else f"{stage}: expected {_short(expected)}, got {_short(got)}"
        checks.append(Check(key, ok, detail))
    return checks


def _short(value, limit: int = 300) -> str:
    text = repr({k: tuple(v.shape) for k, v in value.items()} if isinstance(value, dict) and
                value and isinstance(next(iter(value.values())), torch.Tensor) else value)
    return text if len(text) <= limit else text[:limit] + "..."


@observing
def observe_registry(case: TreeCase, modes: list[tuple[str, bool]], impl_name: str) -> list[Check]:
    """On every rank: transform a model, run forwards in ``modes``, compare the registry."""
    from tpdp_verify.impls.select import load
    from tpdp_verify.ranks.rank import device_mesh

    impl = load(impl_name)
    model = build(case, device_mesh(case.mesh_shape))
    before = snapshot(model)
    impl.pre_dp_module_transform(model)
    checks = _differences(before, snapshot(model), "after the transform")
    hooks = _hooks(model)
    handles = _handles(model)  # what DP and the optimizer captured
    x = torch.zeros(())
    for step, (mode, grad) in enumerate(modes, 1):
        model.train(mode == "train")
        with torch.set_grad_enabled(grad):
            out = model(x)
        if grad and out.requires_grad:
            out.backward()
        stage = f"after forward {step} ({mode}, {'grad' if grad else 'no_grad'})"
        checks += _differences(before, snapshot(model), stage)
        checks.append(Check("the registry holds the parameters DP captured", _handles(model) == handles,
                            f"{stage}: the registry no longer holds the Parameter objects it held "
                            "after the transform"))
        checks.append(Check("hooks per step", _hooks(model) == hooks,
                            f"{stage}: {_hooks(model)} forward hooks, {hooks} after the transform"))
    return checks


@tpdp_property(case=module_trees, modes=MODES)
def registry_preserved(pool, impl: str, case: TreeCase, modes: list) -> None:
    """The transform and any forwards keep names, order, global shapes, requires_grad, ties, buffers, state_dict, hooks."""
    Verdict.of_ranks(pool.run(observe_registry, case, modes, impl)).raise_if_failed()


@observing
def observe_paths(case: TreeCase, pick: int, impl_name: str) -> list[Check]:
    """On every rank: every parameter name resolves to its owner; a replacement touches
    exactly the slot it names."""
    from tpdp_verify.impls.select import load
    from tpdp_verify.ranks.rank import device_mesh

    impl = load(impl_name)
    model = build(case, device_mesh(case.mesh_shape))
    params = list(model.named_parameters(remove_duplicate=False))
    checks = []
    for name, param in params:
        prefix, _, attr = name.rpartition(".")
        resolved, wrong = _resolved(impl.get_submodule_n_params(model, name), name)
        if wrong:
            checks += wrong
            continue
        owner, got = resolved
        ok = owner is model.get_submodule(prefix) and got == attr and owner._parameters.get(got) is param
        checks.append(Check("path resolves to the owning module and attribute", ok,
                            f"{name!r} -> {type(owner).__name__}.{got}"))
    if not params:
        return checks
    name = params[pick % len(params)][0]
    resolved, wrong = _resolved(impl.get_submodule_n_params(model, name), name)
    if wrong:  # no slot to replace: the failed check above is the verdict
        return checks
    owner, attr = resolved
    sentinel = torch.nn.Parameter(torch.zeros(1))
    impl.update_module_param([(owner, attr, sentinel)])
    after = list(model.named_parameters(remove_duplicate=False))
    checks.append(Check("replacement keeps every name", sorted(n for n, _ in after) == sorted(n for n, _ in params),
                        f"replacing {name!r}: names {[n for n, _ in after]}"))
    checks.append(Check("replacement keeps the registration order", [n for n, _ in after] == [n for n, _ in params],
                        f"replacing {name!r}: order {[n for n, _ in params]} became {[n for n, _ in after]}"))
    now = dict(after)
    for other, param in params:
        expected = sentinel if model.get_submodule(other.rpartition(".")[0]) is owner and \
            other.rpartition(".")[2] == attr else param
        checks.append(Check("replacement touches exactly the named slot", now.get(other) is expected,
                            f"replacing {name!r} changed {other!r}" if expected is param else
                            f"replacing {name!r} left {other!r}"))
    return checks


def _resolved(returned, name: str) -> tuple[tuple | None, list[Check]]:
    """What get_submodule_n_params returned for ``name`` as (owner, attribute) and no check,
    or None and the failed check saying what came back instead."""
    pair = unpacked(returned, 2)
    if pair is not None and is_a(pair[0], torch.nn.Module) and is_a(pair[1], str):
        return pair, []
    return None, [Check("get_submodule_n_params returns a (module, attribute) pair", False,
                        f"{name!r} -> {kind(returned)}")]


def _trees_with_parameters(world_size: int):
    return module_trees(world_size).filter(lambda case: not TREES_WITHOUT_PARAMETERS.test(case))


@tpdp_property(case=_trees_with_parameters, pick=st.integers(0, 10**6))
def paths_resolve(pool, impl: str, case: TreeCase, pick: int) -> None:
    """Every parameter name resolves to the module and attribute owning it; replacement touches only that slot."""
    Verdict.of_ranks(pool.run(observe_paths, case, pick, impl)).raise_if_failed()


@observing
def observe_ignored(case: TreeCase, mask: int, impl_name: str) -> list[Check]:
    """On every rank: localize with some parameters ignored; those stay exactly as they were."""
    from torch.distributed.tensor import DTensor

    from tpdp_verify.impls.select import load
    from tpdp_verify.ranks.rank import device_mesh

    impl = load(impl_name)
    model = build(case, device_mesh(case.mesh_shape))
    before = list(model.named_parameters(remove_duplicate=False))
    ignored = {p for i, (_, p) in enumerate(model.named_parameters()) if mask >> i & 1}
    impl.localize_dtensor(model, None, ignored_params=ignored)
    now = dict(model.named_parameters(remove_duplicate=False))
    checks = [Check("names and their order survive localize", [n for n, _ in before] == list(now),
                    f"names {[n for n, _ in before]} became {list(now)}")]
    for name, param in before:
        got = now.get(name)
        if param in ignored or not isinstance(param, DTensor):
            checks.append(Check("ignored and plain parameters stay untouched", got is param,
                                f"{name!r} was replaced"))
        else:
            # localized: a local tensor, which what the implementation left is not trusted to be
            tensor = is_a(got, torch.Tensor)
            checks.append(Check("other DTensor parameters are localized", tensor and not is_a(got, DTensor),
                                f"{name!r} is still a {type(got).__name__}" if tensor or got is None
                                else f"{name!r} became a {type(got).__name__}, not a local tensor"))
    return checks


@tpdp_property(case=_trees_with_parameters, mask=st.integers(0, 2**24 - 1))
def ignored_params_untouched(pool, impl: str, case: TreeCase, mask: int) -> None:
    """localize_dtensor(ignored_params=S) leaves every parameter in S, and plain ones, as they were."""
    Verdict.of_ranks(pool.run(observe_ignored, case, mask, impl)).raise_if_failed()


# --------------------------------------------------------------------------- TP itself


@st.composite
def tp_cases(draw, world_size: int) -> TrainCase:
    """A zoo model and size on a (dp, tp) mesh of ``world_size``: what TP is applied to."""
    from tpdp_verify.fixtures.zoo import TRAINED, ZOO
    from tpdp_verify.properties.training import meshes

    mesh = draw(st.sampled_from(meshes(world_size)))
    model = draw(st.sampled_from(TRAINED))
    return TrainCase(model=model, size=draw(ZOO[model].sizes(mesh[1])), mesh_shape=mesh)


@observing
def observe_tp_requires_grad(case: TrainCase, mask: int) -> list[Check]:
    """On every rank: freeze the parameters ``mask`` picks (by registration order), apply the
    fixture's TP as the training runs do, and compare every parameter's requires_grad."""
    from tpdp_verify.ranks.loop import build, fixture
    from tpdp_verify.ranks.rank import device_mesh
    from tpdp_verify.ranks.tp_dp import apply_tp

    model = build(case)
    for i, (_, p) in enumerate(model.named_parameters()):
        if mask >> i & 1:
            p.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    fx = fixture(case)
    model = apply_tp(fx, case, model, device_mesh(case.mesh_shape, case.mesh_dims))
    if fx.after_parallelize is not None:
        fx.after_parallelize(model)
    after = {n: p.requires_grad for n, p in model.named_parameters()}
    return [Check("TP keeps requires_grad", after.get(n) == wanted,
                  f"{n}: requires_grad {wanted} before TP, {after.get(n, 'no such parameter')} after")
            for n, wanted in before.items()]


def every_model_frozen(strategies: dict) -> list[dict]:
    """Each zoo model's simplest case with every parameter frozen, before any drawn one: a
    style that thaws shows on the first case of its model, whatever the draw meets."""
    from tpdp_verify.properties.training import every_model

    return [{**covered, "mask": 2**24 - 1} for covered in every_model(strategies)]


@tpdp_property(case=tp_cases, mask=st.integers(0, 2**24 - 1), cover=every_model_frozen)
def tp_keeps_requires_grad(pool, impl: str, case: TrainCase, mask: int) -> None:
    """TP (each zoo model's plan or parallelize function) leaves every parameter's requires_grad as the user set it."""
    # torch's TP whatever ``impl`` names: no transform runs here
    Verdict.of_ranks(pool.run(observe_tp_requires_grad, case, mask)).raise_if_failed()
