"""Gradient equality: TP+DP trains exactly like one device, and like plain DDP.

A drawn ``TrainCase`` picks a zoo model and size, a (dp, tp) factorization of the world,
a data-parallel entry point with its options, an optimizer and when it is built, and the
steps; the ranks train it and the oracles say what training should have produced.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tpdp_verify.cases import BUILT, DDP_ENTRIES, ENTRIES, OPTIMIZERS, DDPOptions, TrainCase
from tpdp_verify.compare import Check
from tpdp_verify.execute import observe, observe_both
from tpdp_verify.fixtures.zoo import ZOO
from tpdp_verify.oracles.single_device import oracle
from tpdp_verify.suite import tpdp_property
from tpdp_verify.verdict import Verdict, assemble, judge, localize

# 1e-6 MB is a few bytes: every gradient gets a bucket of its own, the most buckets DDP makes.
BUCKET_CAPS = (None, 1e-6, 1e-4)


def meshes(world_size: int) -> list[tuple[int, int]]:
    """Every (dp, tp) factorization, both dimensions real first: shrinking keeps a 2-D mesh."""
    shapes = [(d, world_size // d) for d in range(1, world_size + 1) if world_size % d == 0]
    return sorted(shapes, key=lambda s: (min(s) == 1, s[0]))


@st.composite
def ddp_options(draw, model: str, static_graph: tuple[bool, ...] = (False, True)) -> DDPOptions:
    static = draw(st.sampled_from(static_graph))
    # DDP's contract: a parameter that gets no gradient needs find_unused_parameters or a
    # static graph, with or without TP. A case outside it would only test DDP's error.
    unused = draw(st.booleans()) or (model == "unused" and not static)
    return DDPOptions(
        bucket_cap_mb=draw(st.sampled_from(BUCKET_CAPS)),
        gradient_as_bucket_view=draw(st.booleans()),
        static_graph=static,
        find_unused_parameters=unused,
        sync_buffers=draw(st.booleans()),
    )


@st.composite
def train_cases(draw, world_size: int, entries: tuple[str, ...] = ENTRIES,
                built: tuple[str, ...] = BUILT, static_graph: tuple[bool, ...] = (False, True)) -> TrainCase:
    mesh = draw(st.sampled_from(meshes(world_size)))
    model = draw(st.sampled_from(list(ZOO)))
    entry = draw(st.sampled_from(entries))
    return TrainCase(
        model=model,
        size=draw(ZOO[model].sizes(mesh[1])),
        mesh_shape=mesh,
        entry=entry,
        ddp=draw(ddp_options(model, static_graph)) if entry in DDP_ENTRIES else DDPOptions(),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        built=draw(st.sampled_from(built)),
        eval_first=draw(st.booleans()),
        steps=draw(st.integers(1, 3)),
        accumulate=draw(st.integers(1, 2)),
        local_batch=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


def _explain(verdict: Verdict, pool, impl: str, case: TrainCase) -> None:
    """Run the case again with every module's output recorded, to name where it departs,
    and under plain DDP, to say whether DP alone departs too."""
    from tpdp_verify.oracles.plain_ddp import observe_plain_ddp

    traces = pool.run(observe, case, impl, True)
    if not any(t.error for t in traces):
        baseline, shadow = oracle(case, capture=True)
        verdict.first_module = localize(traces, case, baseline, shadow)
    plain, checks = assemble(case, pool.run(observe_plain_ddp, case))
    alone = judge(case, plain, *oracle(case))
    alone.checks[:0] = checks
    verdict.plain_ddp = "trains like one device: the departure is TP+DP's" if alone.ok else \
        f"departs too ({alone.kind}): the departure is DP's own"


def verdict_one_device(pool, impl: str, case: TrainCase) -> Verdict:
    whole, checks = assemble(case, pool.run(observe, case, impl))
    baseline, shadow = oracle(case)
    verdict = judge(case, whole, baseline, shadow)
    verdict.checks[:0] = checks
    if not verdict.ok:
        _explain(verdict, pool, impl, case)
    return verdict


@tpdp_property(min_world_size=2, case=train_cases)
def trains_like_one_device(pool, impl: str, case: TrainCase) -> None:
    """TP+DP over K steps matches the unsharded model on one device: outputs, gradients, parameters, optimizer state."""
    verdict_one_device(pool, impl, case).raise_if_failed()


def verdict_plain_ddp(pool, impl: str, case: TrainCase) -> Verdict:
    traces = pool.run(observe_both, case, impl)
    tpdp, tp_checks = assemble(case, [t for t, _ in traces])
    plain, plain_checks = assemble(case, [p for _, p in traces])
    _, shadow = oracle(case)
    if plain.error:  # plain DDP refuses the case: TP+DP must refuse it the same way
        return Verdict([Check("refuses what plain DDP refuses", bool(tpdp.error),
                              f"plain DDP raised {plain.error!r}; TP+DP {tpdp.error or 'trained'}")],
                       against="plain DDP")
    assert all(c.ok for c in plain_checks), "plain DDP's own replicas disagree: " + str(plain_checks)
    verdict = judge(case, tpdp, plain, shadow, against="plain DDP")
    verdict.checks[:0] = tp_checks
    return verdict


@tpdp_property(min_world_size=2, case=train_cases)
def trains_like_plain_ddp(pool, impl: str, case: TrainCase) -> None:
    """TP+DP matches plain DDP (no TP) over the same dp groups, within the bound plain DDP earns."""
    verdict_plain_ddp(pool, impl, case).raise_if_failed()
