"""The module-tree strategy: it reaches every feature the transform's properties need, and
``build`` makes on real ranks exactly the model the plain data and ``param_paths`` describe."""

from collections import Counter

import torch
from hypothesis import given, settings
from torch.distributed.tensor import DTensor, Replicate, Shard

from tpdp_verify.cases.trees import (
    Node,
    ParamSpec,
    TreeCase,
    count_params,
    depth,
    named_param_specs,
    nodes,
    param_paths,
)
from tpdp_verify.properties.modules import KINDS, build, module_trees

REPLAY = {"TreeCase": TreeCase, "Node": Node, "ParamSpec": ParamSpec, "Shard": Shard, "Replicate": Replicate}


def _features(case: TreeCase) -> set[str]:
    found = {f"kind {node.kind}" for _, node in nodes(case.root)}
    specs = [spec for _, spec in named_param_specs(case)]
    sharded = [(spec.shape[p.dim], n) for spec in specs if spec.placements
               for p, n in zip(spec.placements, case.mesh_shape) if isinstance(p, Shard)]
    flags = {
        "depth >= 4": depth(case.root) >= 4,
        "shared submodule": bool(case.shared),
        "tied param": bool(case.tied),
        "frozen param": any(not s.requires_grad for s in specs),
        "buffer": any(node.buffers for _, node in nodes(case.root)),
        "root param": bool(case.root.params),
        "DTensor param": any(s.placements is not None for s in specs),
        "plain param": any(s.placements is None for s in specs),
        "uneven shard": any(size % n for size, n in sharded),
        "shard smaller than mesh": any(size < n for size, n in sharded),
        "prefix-sharing siblings": any(_prefix_pair(_sibling_names(node)) for _, node in nodes(case.root)),
        "2-D mesh": len(case.mesh_shape) == 2,
    }
    return found | {name for name, hit in flags.items() if hit}


def _sibling_names(node) -> list[str]:
    return [p.name for p in node.params] + list(node.buffers) + [n for n, _ in node.children]


def _prefix_pair(names: list[str]) -> bool:
    return any(a != b and b.startswith(a) for a in names for b in names)


def test_the_strategy_reaches_every_feature():
    seen: Counter = Counter()

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(case=module_trees(4))
    def collect(case: TreeCase):
        seen.update(_features(case))
        assert eval(repr(case), REPLAY) == case  # a falsifying example replays by pasting
        assert count_params(case) == len(param_paths(case)) <= 24
        assert len(set(param_paths(case))) == count_params(case)

    collect()
    expected = [f"kind {k}" for k in KINDS] + [
        "depth >= 4", "shared submodule", "tied param", "frozen param", "buffer", "root param",
        "DTensor param", "plain param", "uneven shard", "shard smaller than mesh",
        "prefix-sharing siblings", "2-D mesh",
    ]
    missing = [f for f in expected if seen[f] == 0]
    assert not missing, f"never drawn: {missing}; counts: {dict(seen)}"


def check_built_model(case: TreeCase) -> list[str]:
    """On every rank: build the case and compare the model with what the data says."""
    from tpdp_verify.ranks.rank import device_mesh

    mesh = device_mesh(case.mesh_shape)
    model = build(case, mesh)
    problems = []
    names = [n for n, _ in model.named_parameters()]
    if names != param_paths(case):
        problems.append(f"named_parameters {names} != param_paths {param_paths(case)}")
    params = dict(model.named_parameters())
    for path, spec in named_param_specs(case):
        p = params.get(path)
        if p is None:
            continue
        layout = tuple(p.placements) if isinstance(p, DTensor) else None
        if (tuple(p.shape), layout, p.requires_grad) != (spec.shape, spec.placements, spec.requires_grad):
            problems.append(f"{path}: built {tuple(p.shape)}, {layout}, {p.requires_grad}; spec {spec}")
    for src, dst in case.tied:
        if model.get_parameter(src) is not model.get_parameter(dst):
            problems.append(f"tied {src} and {dst} are different objects")
    for src, dst in case.shared:
        if model.get_submodule(src) is not model.get_submodule(dst):
            problems.append(f"shared {src} and {dst} are different objects")

    out = model(torch.tensor(0.5))
    if out.shape != () or isinstance(out, DTensor):
        problems.append(f"forward returned {type(out).__name__} of shape {tuple(out.shape)}")
    if out.requires_grad:  # no trainable parameter, nothing to differentiate
        out.backward()
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is None:
            problems.append(f"{name} requires grad but got none")
        if not p.requires_grad and p.grad is not None:
            problems.append(f"{name} is frozen but got a grad")
    return problems


@settings(max_examples=15, derandomize=True, database=None, deadline=None)
@given(case=module_trees(4))
def test_build_matches_the_case_on_real_ranks(tpdp_pools, case):
    problems = tpdp_pools.get(4).run(check_built_model, case)
    assert problems == [[]] * 4, f"{case}\n{problems}"
