"""Judging a TP+DP run against an oracle: every value within its bound, every rank agreeing.

``assemble`` turns the ranks' traces into one global trace (the dp groups' rows put back
together) and checks that replicas agree; ``judge_training`` compares it with the rounded run and
the float64 shadow, value by value, and returns a ``Verdict`` whose report names what
departs, by how much, and from which module on.
"""

from __future__ import annotations

import textwrap

from dataclasses import dataclass, field

import torch

from tpdp_verify import signature
from tpdp_verify.cases.training import TrainCase
from tpdp_verify.judging.divergence import divergence
from tpdp_verify.judging.reductions import judge_dp_reductions, judge_reductions
from tpdp_verify.judging.tolerance import Error, bound, error
from tpdp_verify.ranks.loop import LR, Trace
from tpdp_verify.ranks.observation import Check, Observation
from tpdp_verify.ranks.pieces import merge_named


@dataclass(frozen=True)
class Row:
    """One compared value: a parameter's gradient at a step, an output, a state tensor."""

    # "gradient", "parameter", "optimizer state", "output", "loss", "buffer", and with
    # habits, "gradient norm" and "direct output"
    what: str
    step: int  # 1-based optimizer step (microbatch for outputs and losses); 0 = before training
    name: str
    err: Error


@dataclass
class Verdict:
    """What every property's run comes to: its checks and compared values, and the report."""

    checks: list[Check] = field(default_factory=list)  # exact, structural comparisons
    rows: list[Row] = field(default_factory=list)  # comparisons within a bound
    first_module: str | None = None  # set by localization when values depart
    cause: str = ""  # what may cause it there: a head's shard handed on, what feeds the first module
    module_is: str = "first module whose output departs (forward order)"  # what first_module names
    against: str = "one device"  # the oracle; "" for checks the ranks made themselves
    plain_ddp: str = ""  # on a departure: how the same DP entry point without TP fares
    beside: str = "the same DP entry point without TP"  # the run plain_ddp speaks of
    unobserved: str = ""  # what was not compared, and why
    unread: list[str] = field(default_factory=list)  # output leaves not compared, each with why
    substituted: list[str] = field(default_factory=list)  # what the float64 run ran in a kernel's place
    accumulate: int = 1  # microbatches a step: orders outputs among the steps' values
    # exact comparisons that failed: "check: where name" -> the largest absolute difference
    # (inf where there was nothing of the same shape to subtract), to weigh one run's
    # departures against another's
    departures: dict[str, float] = field(default_factory=dict)
    # what the observed run went through (tpdp_verify.ranks.loop.Trace.exercised)
    exercised: dict[str, list[str]] = field(default_factory=dict)
    tied: list[tuple[str, ...]] = field(default_factory=list)  # the oracle's names sharing one parameter

    @classmethod
    def of_ranks(cls, observed: list[Observation], minimum: int = 1) -> Verdict:
        """The checks the ranks made, each failure once with every rank it failed on.

        Fewer than ``minimum`` checks in all fail too: a property that compared nothing
        cannot have found anything.
        """
        compared = sum(len(o.checks) for o in observed)
        made = [(None, Check(f"compared at least {minimum} item{'s' * (minimum > 1)}", compared >= minimum,
                             f"the ranks compared {compared}"))]
        for rank, o in enumerate(observed):
            made += [(rank, c) for c in o.checks]
            if o.error:
                made.append((rank, Check("every rank runs without an exception", False, o.error, o.raised)))
        merged: dict[tuple[str, bool, str, str], Check] = {}
        for rank, c in made:
            key = (c.name, c.ok, c.part, c.where)
            first = merged.setdefault(key, c)
            if not c.ok and rank is not None and rank not in first.ranks:
                merged[key] = first._replace(ranks=first.ranks + (rank,))
        failed = {c.name for c in merged.values() if not c.ok}
        return cls([c for c in merged.values() if not c.ok or c.name not in failed], against="")

    @property
    def failures(self) -> list:
        return [c for c in self.checks if not c.ok] + [r for r in self.rows if not r.err.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def signature(self) -> signature.Signature:
        """Every failed check, and the kind of value that departs first (the rest follow
        from it: a gradient that departs moves the parameters, then the outputs)."""
        parts = [c.part or signature.check(c.name) for c in self.checks if not c.ok]
        bad = [r for r in self.rows if not r.err.ok]
        if bad:
            parts.append(signature.value(min(bad, key=lambda r: _order(r, self.accumulate)).what))
        return signature.of(parts)

    @property
    def kind(self) -> str:
        return divergence(self.signature).kind

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise divergence(self.signature)(self.report())

    def report(self, limit: int = 20) -> str:
        # An exception fails every check that ran into it: said once.
        said: dict = {}
        for c in self.checks:
            if not c.ok:
                said.setdefault(c.detail if c.part else c, c)  # the first says which ranks
        bad_checks = list(said.values())
        bad_rows = sorted((r for r in self.rows if not r.err.ok), key=lambda r: (r.step, -r.err.ratio))
        if self.against:
            lines = [f"TP+DP departs from {self.against}: {len(bad_checks)} of {len(self.checks)} checks "
                     f"and {len(bad_rows)} of {len(self.rows)} values beyond their bound"]
        else:
            lines = [f"{len(bad_checks)} of {len(self.checks)} checks failed:"]
        if self.first_module is not None:
            lines.append(f"{self.module_is}: {self.first_module}")
            lines += textwrap.wrap(self.cause, 100, initial_indent="  ", subsequent_indent="  ")
        if self.plain_ddp:
            lines.append(f"{self.beside}: {self.plain_ddp}")
        if self.unobserved:
            lines.append(f"not compared: {self.unobserved}")
        lines += [f"  {c.name}{on_ranks(c.ranks)}: {c.detail}" for c in bad_checks[:limit]]
        if bad_rows:
            lines.append(f"  {'value':<18}{'step':>5}  {'name':<34}{'max abs':>11}{'max rel':>11}"
                         f"{'bound':>11}{'ratio':>10}")
            lines += [f"  {r.what:<18}{r.step:>5}  {r.name:<34}{r.err.max_abs:>11.3g}"
                      f"{r.err.max_rel:>11.3g}{r.err.bound:>11.3g}{r.err.ratio:>10.3g}{_as_whole(r.err)}"
                      for r in bad_rows[:limit]]
            if len(bad_rows) > limit:
                lines.append(f"  ... and {len(bad_rows) - limit} more")
        return "\n".join(lines)


def on_ranks(ranks: tuple[int, ...]) -> str:
    return f" (rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))})" if ranks else ""


# Within an optimizer step, what a departure upstream moves: the forward's outputs and
# buffers, the loss, the gradients, then the parameters and the optimizer's state.
_STAGE = {"output": 0, "buffer": 1, "loss": 2, "gradient": 3, "parameter": 4, "optimizer state": 5}


def _order(row: Row, accumulate: int) -> tuple[int, int]:
    """When a value is made: (optimizer step, stage); outputs and losses count microbatches."""
    step = (row.step - 1) // accumulate + 1 if row.what in ("output", "loss") else row.step
    return step, _STAGE.get(row.what, len(_STAGE))


# --------------------------------------------------------------------------- assembling


def _coords(case: TrainCase, rank: int) -> tuple[int, int]:
    return divmod(rank, case.tp)  # init_device_mesh lays (dp, tp) out row-major


def _merged_steps(what: str, per_rank: list[list[dict]], unit: str = "step", first: int = 1
            ) -> tuple[list[dict], list[str]]:
    """Each step's global values from the ranks' pieces, and what was wrong with them.

    ``first`` numbers the first step (0 for parameters, recorded before training too).
    """
    steps, problems = [], []
    for step, values in enumerate(zip(*per_rank), first):
        merged, wrong = merge_named(list(values))
        problems += [f"{' '.join(filter(None, (what, name)))} at {unit} {step}: {problem}" for name, problem in wrong]
        steps.append(merged)
    if len({len(s) for s in per_rank}) > 1:
        problems.append(f"ranks recorded {[len(s) for s in per_rank]} {unit}s of {what}")
    return steps, problems


def assemble(case: TrainCase, traces: list[Trace]) -> tuple[Trace, list[Check]]:
    """One global trace from the ranks', and the checks that every replica agrees.

    Every global gradient, parameter, optimizer state and buffer is put together from the
    pieces the ranks hold: each element held by some rank, and every copy of it (DP keeps
    replicas in lockstep) the same. Ranks of one dp group saw the same rows, so their
    outputs and losses agree too, and the dp groups' outputs stack to the global batch.
    """
    errors = {t.error for t in traces}
    detail = "; ".join(sorted(e for e in errors if e))
    checks = [Check("every rank trains without an exception", False, detail, part,
                    tuple(r for r, t in enumerate(traces) if t.error and t.raised == part))
              for part in sorted(signature.echoes_left_out(t.raised for t in traces if t.error))] or \
             [Check("every rank trains without an exception", True)]
    if errors != {""}:
        return traces[0] if traces[0].error else next(t for t in traces if t.error), checks
    checks += judge_reductions(case, traces) + judge_dp_reductions(case, traces)
    whole = Trace(trainable=traces[0].trainable, activations=traces[0].activations,
                  state_unobserved=traces[0].state_unobserved, registry=traces[0].registry, unread=traces[0].unread,
                  ignored=sorted({d for t in traces for d in t.ignored}),
                  exercised=traces[0].exercised | _union("loss ops", traces))
    for what in ("trainable", "registry"):
        differ = [r for r, t in enumerate(traces) if getattr(t, what) != getattr(whole, what)]
        checks.append(Check(f"every rank has the same {what} parameters", not differ,
                            f"ranks {differ} differ from rank 0: {[getattr(traces[r], what) for r in differ]} "
                            f"against {getattr(whole, what)}"))
    for what in ("grads", "params", "state", "buffers"):
        steps, problems = _merged_steps(what, [getattr(t, what) for t in traces], first=int(what != "params"))
        setattr(whole, what, steps)
        checks.append(Check(f"replicas agree on {what}", not problems,
                            "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")))
    groups: dict[int, list[Trace]] = {}
    for rank, trace in enumerate(traces):
        groups.setdefault(_coords(case, rank)[0], []).append(trace)
    problems, outputs, losses = [], [], []
    for d, group in sorted(groups.items()):
        out, out_problems = _merged_steps("output", [t.outputs for t in group], "microbatch")
        loss, loss_problems = _merged_steps("loss", [[{"": torch.tensor(x)} for x in t.losses] for t in group],
                                            "microbatch")
        problems += [f"dp group {d}: {p}" for p in out_problems + loss_problems]
        outputs.append(out)
        losses.append([float(x[""]) for x in loss])
    # each microbatch: each leaf's rows, dp group after dp group (a leaf some group lacks is missing)
    whole.outputs = [{name: torch.cat([g[name] for g in parts]) for name in parts[0] if all(name in g for g in parts)}
                     for parts in zip(*outputs)]
    whole.losses = [sum(parts) / (1 if case.loss_shared else len(parts)) for parts in zip(*losses)]
    # each step: the block called directly, and each dp group's tp pieces of its output
    # (judging puts a tp shard back against the oracle's shape)
    whole.direct = [(traces[0].direct[i][0], [[t.direct[i][1] for t in g] for _, g in sorted(groups.items())])
                    for i in range(min(len(t.direct) for t in traces))]
    called = {tuple(n for n, _ in t.direct) for t in traces}
    problems += [f"ranks called different blocks directly: {sorted(called)}"] if len(called) > 1 else []
    # each step: every rank's own total gradient norm, as each reading gives it, each judged
    # against the oracle's
    whole.norms = [{f"rank {r} {reading}": x for r, norm in enumerate(norms) for reading, x in norm.items()}
                   for norms in zip(*(t.norms for t in traces))]
    checks.append(Check("tp ranks of a dp group produce the same output and loss", not problems,
                        "; ".join(problems[:3])))
    return whole, checks


def _union(key: str, traces: list[Trace]) -> dict:
    """``key`` of the traces' ``exercised``, every rank's together, where some rank has it."""
    found = [t.exercised[key] for t in traces if key in t.exercised]
    return {key: sorted({x for f in found for x in f})} if found else {}


def _as_whole(err: Error) -> str:
    """The whole-tensor comparison of a half-precision value, where it was made."""
    return "" if err.whole is None else f"  (rms rel {err.whole[0]:.3g}, bound {err.whole[1]:.3g})"


# --------------------------------------------------------------------------- judging


def _values(what: str, step: int, observed: dict, rounded: dict, shadow: dict, out: Verdict,
            dtype: torch.dtype, slack: dict | None = None) -> None:
    if not shadow and not observed:
        return  # none to compare (a model without buffers): no check that compared nothing
    missing = sorted(set(shadow) - set(observed))
    out.checks.append(Check(f"every {what} is there", not missing,
                            f"step {step}: missing {what} of {', '.join(missing)}"))
    extra = sorted(set(observed) - set(shadow))
    out.checks.append(Check(f"no unexpected {what}", not extra, f"step {step}: unexpected {', '.join(extra)}"))
    scale = max((v.abs().max().item() for v in shadow.values() if v is not None and v.numel()), default=0.0)
    for name in shadow:
        if name not in observed:
            continue
        got, base, exact = observed[name], rounded[name], shadow[name]
        if (got is None) != (exact is None):
            out.checks.append(Check(f"{what} present where the oracle has one", False,
                                    f"step {step}: {name}: {'none' if got is None else 'one'} "
                                    f"where the oracle has {'none' if exact is None else 'one'}"))
            continue
        if exact is None:
            continue
        if got.shape != exact.shape:
            out.checks.append(Check(f"{what} shape", False,
                                    f"step {step}: {name}: shape {tuple(got.shape)}, oracle {tuple(exact.shape)}"))
            continue
        if _kind(got) != _kind(exact):  # a complex buffer made real drops its imaginary part
            out.checks.append(Check(f"{what} keeps its kind of dtype", False,
                                    f"step {step}: {name}: {got.dtype}, oracle {exact.dtype}"))
            continue
        got, base, exact = (torch.view_as_real(t) if t.is_complex() else t for t in (got, base, exact))
        # the first step's gradients as whole tensors too, where half precision hides a scaling
        out.rows.append(Row(what, step, name, error(got, base, exact, dtype, scale, whole=(what, step) == ("gradient", 1),
                                                    slack=(slack or {}).get(name))))


def _kind(t: torch.Tensor) -> str:
    return "complex" if t.is_complex() else "floating point" if t.is_floating_point() else "integer"


def judge_training(case: TrainCase, observed: Trace, rounded: Trace, shadow: Trace,
          against: str = "one device") -> Verdict:
    """Compare a global trace with the rounded run (one device, the case's dtype) and the float64 shadow;
    where an option rounds values to half precision on the way (a compressing comm hook,
    mixed precision), that dtype is the floor of every bound (docs/tolerance.md)."""
    dtype = case.wire_dtype
    v = Verdict(against=against, unobserved=f"optimizer state: {observed.state_unobserved}"
                if observed.state_unobserved else "", unread=shadow.unread, substituted=shadow.substituted,
                accumulate=case.accumulate,
                exercised=observed.exercised, tied=shadow.tied)
    if observed.error:
        v.checks.append(Check("trains without an exception", False, observed.error, observed.raised))
        v.first_module, v.module_is = observed.raised_in or None, "the module whose forward raised"
        v.cause = _other_style(observed.raised_in, observed.raised_split)
        return v
    frozen = sorted(set(shadow.params[0]) - set(shadow.trainable))
    v.checks.append(Check("the same parameters are trainable", observed.trainable == shadow.trainable,
                          f"trainable {observed.trainable}, oracle {shadow.trainable}"))
    v.checks.append(_registry(observed.registry, shadow.registry, shadow.tied))
    if case.habits.ignored:
        v.checks.append(Check("what DP is told to ignore stays as the user left it", not observed.ignored,
                              "; ".join(observed.ignored)))
    for i, (o, b, s) in enumerate(zip(observed.outputs, rounded.outputs, shadow.outputs), 1):
        _values("output", i, o, b, s, v, dtype)
    for i, (o, b, s) in enumerate(zip(observed.losses, rounded.losses, shadow.losses), 1):
        _values("loss", i, {"loss": torch.tensor(o)}, {"loss": torch.tensor(b)}, {"loss": torch.tensor(s)}, v, dtype)
    for i, (o, b, s) in enumerate(zip(observed.direct, rounded.direct, shadow.direct), 1):
        _direct(i, o, b, s, v, case)
    if len(observed.direct) != len(shadow.direct):
        v.checks.append(Check("calls a block directly as often as the oracle", False,
                              f"{len(observed.direct)} direct calls, the oracle {len(shadow.direct)}"))
    _values("parameter", 0, observed.params[0], rounded.params[0], shadow.params[0], v, dtype)
    for i, (o, b, s) in enumerate(zip(observed.norms, rounded.norms, shadow.norms), 1):
        _values("gradient norm", i, {k: torch.tensor(x) for k, x in o.items()}, _per_rank(b, o), _per_rank(s, o),
                v, dtype)
    if len(observed.norms) != len(shadow.norms):
        v.checks.append(Check("clips as often as the oracle", False,
                              f"{len(observed.norms)} gradient norms, the oracle {len(shadow.norms)}"))
    slack = _adam_slack(case, rounded, shadow, dtype)
    for step in range(1, len(shadow.grads) + 1):
        _values("gradient", step, observed.grads[step - 1], rounded.grads[step - 1], shadow.grads[step - 1], v, dtype)
        _values("parameter", step, observed.params[step], rounded.params[step], shadow.params[step], v, dtype,
                slack[step - 1])
        if not observed.state_unobserved:
            _values("optimizer state", step, observed.state[step - 1], rounded.state[step - 1],
                    shadow.state[step - 1], v, dtype)
        _values("buffer", step, observed.buffers[step - 1], rounded.buffers[step - 1],
                shadow.buffers[step - 1], v, dtype)
    for name in frozen:
        kept = all(torch.equal(p[name], observed.params[0][name]) for p in observed.params if name in p)
        v.checks.append(Check("frozen parameters stay unchanged", kept, f"{name} changed"))
    for name in shadow.trainable:
        # Moving means moving beyond rounding noise: a gradient that is zero but for its
        # rounding (a norm over one element) moves the oracle by less than the bound.
        drift = (shadow.params[-1][name] - shadow.params[0][name]).abs()
        if drift.numel() == 0 or drift.max() <= bound(rounded.params[-1][name], shadow.params[-1][name], dtype):
            continue
        got = name in observed.params[-1] and not torch.equal(observed.params[-1][name], observed.params[0][name])
        v.checks.append(Check("trainable parameters move as in the oracle", got,
                              f"{name} stayed where it was over {len(shadow.grads)} steps; the oracle's "
                              f"moved by up to {drift.max():.3g}"))
    if len(v.rows) < len(shadow.params[0]):
        v.checks.append(Check("compared at least one value a parameter", False,
                              f"compared {len(v.rows)} values for {len(shadow.params[0])} parameters"))
    return v


def _adam_slack(case: TrainCase, rounded: Trace, shadow: Trace, dtype: torch.dtype) -> list[dict]:
    """Per step, per parameter: how far Adam may move an element by rounding alone.

    Adam's first step moves an element by lr * g / (|g| + eps): lr, whatever |g|, unless g is
    below eps. Where the exact gradient is within its bound of zero (rounding noise: a
    sum that cancels), the runs' gradients may differ in sign there, and each such step
    moves the element by up to 2 lr one way or the other; later steps carry the difference.
    Such an element may differ by 2 lr a step on which its gradient was noise; every other
    element keeps its bound. A gradient off by a factor departs beyond its bound wherever it
    is larger than noise, so the slack hides no such fault. SGD's step is linear in the
    gradient: no slack."""
    steps = len(shadow.grads)
    if case.optimizer != "adam" or case.user is not None:
        return [{} for _ in range(steps)]
    out, flips = [], {}
    for step in range(steps):
        exact, base = shadow.grads[step], rounded.grads[step]
        scale = max((g.abs().max().item() for g in exact.values() if g is not None and g.numel()), default=0.0)
        for name, g in exact.items():
            if g is None or base.get(name) is None or not g.numel():
                continue
            noise = g.double().abs() <= bound(base[name], g, dtype, scale)
            flips[name] = flips.get(name, 0) + noise.double()
        out.append({name: 2 * LR["adam"] * n for name, n in flips.items()})
    return out


def _direct(step: int, observed: tuple, rounded: tuple, shadow: tuple, out: Verdict, case: TrainCase) -> None:
    """A block called directly between steps (Habits.between "submodule"): its output, put
    together from what the runs hold, against the oracle's."""
    name, exact = shadow
    if observed[0] != name:
        out.checks.append(Check("calls the oracle's block directly", False,
                                f"step {step}: called {observed[0]}, the oracle {name}"))
        return
    got, base = _put_together(observed[1], exact, case), _put_together(rounded[1], exact, case)
    if got is None or base is None:
        held = observed[1] if got is None else rounded[1]
        out.checks.append(Check("a block's direct output puts back together", False,
                                f"step {step}: {name}: pieces of shapes {[[tuple(p.shape) for p in g] for g in held]} "
                                f"make no {tuple(exact.shape)}"))
        return
    key = f"{name} called directly"
    _values("direct output", step, {key: got}, {key: base}, {key: exact}, out, case.wire_dtype)


def _put_together(held, exact: torch.Tensor, case: TrainCase) -> torch.Tensor | None:
    """A direct call's output as a run holds it: one device's tensor, or each dp group's tp
    pieces (whole, or shards along one dimension), the groups' rows (TrainCase.rows) stacked."""
    if isinstance(held, torch.Tensor):
        return held
    if len(held) != case.dp:
        return None
    parts = [_whole(pieces, exact[case.rows(d)].shape) for d, pieces in enumerate(held)]
    return None if any(p is None for p in parts) else torch.cat(parts)


def _per_rank(norm: dict, ranks: dict) -> dict:
    """An oracle's gradient norm under each rank's name ("rank R READING"): plain DDP's
    rank's own, one device's reading for every rank."""
    return {k: torch.tensor(norm[k] if k in norm else norm[k.split(" ", 2)[2]]) for k in ranks}


def _registry(observed: list[str], oracle: list[str], tied: list[tuple[str, ...]] = ()) -> Check:
    """The model's named_parameters() after training: the optimizer a user builds then, and
    state_dict(), see exactly these, in this order. ``tied``: the oracle's names that share
    one parameter, which named_parameters() gives once; given twice, the tie came apart."""
    missing, extra = [n for n in oracle if n not in observed], [n for n in observed if n not in oracle]
    apart = [group for group in tied if sum(n in observed for n in group) > 1]
    detail = (f"tied parameters came apart: {'; '.join(', '.join(g) for g in apart)} (parallelize_module "
              "gives each a DTensor of its own: tie them again after it, in a parallelize_fn, where the plan "
              f"shards both alike: model.{apart[0][-1]} = model.{apart[0][0]})" if apart else
              f"after training named_parameters() lacks {missing}" if missing else
              f"after training named_parameters() has unexpected {extra}" if extra else
              f"after training named_parameters() gives {observed}, the oracle {oracle}")
    return Check("parameters stay registered, in order", observed == oracle, detail)


def localize(observed: list[Trace], case: TrainCase, rounded: Trace, shadow: Trace) -> str | None:
    """The first module, in the order outputs were produced, whose output leaves its bound.

    ``observed`` are the ranks' traces of a run with activations captured. A module's
    output on a rank is whole (full_tensor of a DTensor, or replicated) or a tp shard; a
    shard is put back by concatenating the tp ranks' along the dimension that yields the
    oracle's shape.
    """
    groups: dict[int, list[Trace]] = {}
    for rank, trace in enumerate(observed):
        groups.setdefault(_coords(case, rank)[0], []).append(trace)
    n = len(shadow.activations)
    for i in range(n):
        name, exact = shadow.activations[i]
        pieces = []
        for d in sorted(groups):
            rows = case.rows(d)
            if any(i >= len(t.activations) or t.activations[i][0] != name for t in groups[d]):
                return name  # the TP+DP run did not run the module the oracle ran here
            local = [t.activations[i][1] for t in groups[d]]
            pieces.append(_whole(local, exact[rows].shape))
        if any(p is None for p in pieces):
            continue  # an output whose layout cannot be put back; the next module decides
        got = torch.cat(pieces)
        if not error(got, rounded.activations[i][1], exact, case.wire_dtype).ok:
            return name or "<the whole model>"
    return _shape_break(observed[0], shadow)


# Where a Linear's forward raised, by how TP split its weight: the style that split it, and the
# other, which may fit (a shape error there is mostly a style its input does not match).
# Colwise takes the whole input and hands on a shard of the output features; Rowwise takes a
# shard of the input features (what a Colwise module before it hands on) and sums the output.
_OTHER = {"output": ("ColwiseParallel", "RowwiseParallel", "a module fed the output of a ColwiseParallel one, its "
                     "input features split over tp, is RowwiseParallel's"),
          "input": ("RowwiseParallel", "ColwiseParallel", "a module fed its whole input (features not split) is "
                    "ColwiseParallel's, or RowwiseParallel(input_layouts=Replicate())'s")}


def _other_style(module: str, split: str) -> str:
    if split not in _OTHER:
        return ""
    given, other, why = _OTHER[split]
    return f"{module} is split as {given} splits it; {other}() may fit: {why}"


def upstream(name: str, shadow: Trace) -> str:
    """Where to look besides the first module whose output departs: what feeds it. A module
    whose own work is right departs when its input is wrong without departing where the
    outputs are compared: its owner's code between its children (a split into heads, a view)
    or the layout the module before it hands on."""
    names = [n for n, _ in shadow.activations]
    if name not in names or names.index(name) == 0:
        return ""
    before, owner = names[names.index(name) - 1], name.rpartition(".")[0]
    code = f"{owner}'s own forward code (a split into heads, a view, a reshape), " if owner else ""
    return (f"it may only be fed wrongly: its input comes through {code}after {before or '<the whole model>'}"
            f"'s output; look there too")


def handed_on_shard(observed: Trace, shadow: Trace) -> tuple[str, str] | None:
    """A run that raised after the forward (in the loss): the module from which on every output
    has another shape than the unsharded model's, where the model's output has, and the
    cause in words; None where the output's shape is right."""
    name = _shape_break(observed, shadow)
    if name is None:
        return None
    got, want = observed.activations[-1][1].shape, shadow.activations[-1][1].shape
    return name, (f"{name} hands on its tp shard: the model's output is {list(got)} on each rank, the unsharded "
                  f"model's {list(want)}, and the loss gets the shard. A head's output must be whole for a plain "
                  "loss: ColwiseParallel(output_layouts=Replicate()), or use_local_output=False with the loss "
                  "under loss_parallel() (--loss-parallel)")


def _shape_break(observed: Trace, shadow: Trace) -> str | None:
    """Where the model's output leaves the oracle's shape when every value, put back
    together, is right: a module that hands on its tp shard (a head left Colwise with a
    local output) makes the whole model return a shard. The first module from which on
    every output a rank sees has another shape than the oracle's."""
    shapes = [(name, got.shape != exact.shape) for (name, got), (_, exact)
              in zip(observed.activations, shadow.activations)]
    if not shapes or not shapes[-1][1]:
        return None
    first = len(shapes) - 1
    while first > 0 and shapes[first - 1][1]:
        first -= 1
    return shapes[first][0] or "<the whole model>"


def _whole(local: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    if local[0].shape == shape:
        return local[0]
    for dim in range(len(shape)):
        try:
            cat = torch.cat(local, dim)
        except RuntimeError:
            continue
        if cat.shape == shape:
            return cat
    return None
