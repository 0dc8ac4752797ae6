"""``tpdp-verify``: the command line. A subparser and a ``_<command>(args)`` each; exit codes
(docs/cli.md): 0 ok, 1 divergence, 2 usage, 3 infrastructure, 4 not asked of the baseline; 130 and 143 interrupted by
SIGINT and SIGTERM, after the gate and plan have written their outputs (marked interrupted)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import time
import warnings
from pathlib import Path

from tpdp_verify import torch_release
from tpdp_verify.errors import EXIT_INFRA, EXIT_OK, EXIT_USAGE, PoolError, UsageError
from tpdp_verify.files import write_whole
from tpdp_verify.integrations import STACKS
from tpdp_verify.interrupts import Interrupted, caught
from tpdp_verify.runner import profiles


class _Refused(Exception):
    """An argument the parser refused: raised, not exited on, so that the outputs asked for
    are written with the error (``_refused``)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints and exits; the subcommands' parsers are of this class too
        raise _Refused(self, message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tpdp-verify",
        description="Check that tensor parallelism composed with data parallelism trains "
        "exactly like the unsharded model.",
        epilog="exit codes: 0 ok, 1 divergence found, 2 usage or input error, "
        "3 infrastructure failure (the harness: ranks would not start, an internal error; "
        "ranks that crash or hang in the code under test are a divergence), "
        "4 no verdict on some failures (the baseline release could not be asked about them), "
        "130 and 143 interrupted by SIGINT and SIGTERM (the outputs written, marked interrupted)",
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gate = commands.add_parser("gate", help="run the conformance suite against an implementation")
    gate.add_argument("--profile", default="smoke", choices=sorted(profiles.PROFILES),
                      help="how many examples on which world sizes (default: smoke)")
    gate.add_argument("--impl", default="torch",
                      help="implementation under test: torch, reference or a dotted path")
    gate.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    gate.add_argument("--timeout", type=float, default=120.0,
                      help="seconds one check may take before its ranks count as hung")
    gate.add_argument("--baseline", metavar="RELEASE",
                      help="the torch release whose faults are known, as pip spells it (torch==2.13.0): a failure "
                      "is known where that release fails the same way on the same case (its memo, else a replay "
                      "there); exit 1 only on new or changed ones (tpdp-verify docs cli)")
    gate.add_argument("--baseline-python", metavar="PATH",
                      help="the python of an environment holding the baseline release, to replay cases its memo "
                      "lacks (default: this interpreter where its torch is that release, else one installed "
                      "once into the cache)")
    gate.add_argument("--no-install", action="store_true",
                      help="never install the baseline release: a failure neither the memo nor this interpreter "
                      "can answer is reported as not asked (exit 4)")
    gate.add_argument("--memo", metavar="FILE", help="where this run adds what the baseline answered (default: "
                      "the user's memo in the cache; tpdp-verify's shipped memo is read either way)")
    gate.add_argument("--suite", default="tpdp_verify.properties", metavar="MODULE",
                      help="the module whose ALL lists the properties to run (default: tpdp-verify's own)")
    gate.add_argument("--seed", type=int, help="draw other cases than the profile's fixed ones "
                      "(default: the same cases on every run and machine)")
    gate.add_argument("-k", metavar="EXPR", dest="keyword",
                      help="only the searches whose property name (or worldN) matches, as pytest's -k: "
                      "'trains and not plain and world4'")
    gate.add_argument("--shard", metavar="K/N", help="only the K-th of N parts of the searches, balanced by "
                      "their measured cost; `tpdp-verify merge` puts the parts' --json files together")
    gate.add_argument("--jobs", type=int, metavar="N", help="run the searches in N parts at once, each a process "
                      "with its own ranks (default: as many as the cores and memory hold at the largest "
                      "world size's ranks each); the same verdict and outputs for any N")
    _verbose_option(gate)
    _output_options(gate, json="the run as JSON (keys: tpdp-verify docs cli)",
                    junit="the run as JUnit XML, a test case a property",
                    markdown="the run as a Markdown table and the failures' reports")

    plan = commands.add_parser("plan", help="verify a model's TP plan against one device and plain DP",
                               description="Names are module:attribute, imported with the current "
                               "directory on the path (tpdp-verify docs user-guide).")
    plan.add_argument("model", metavar="MODULE:FACTORY", help="model_fn(): the unsharded model")
    tp = plan.add_mutually_exclusive_group(required=True)
    tp.add_argument("--plan", metavar="MODULE:PLAN",
                    help="a dict for parallelize_module (ParallelStyles, or transformers' style strings), a "
                    "function tp_mesh -> dict, or auto: the model's own tp_plan (transformers')")
    tp.add_argument("--parallelize", metavar="MODULE:FN",
                    help="your own parallelize_fn(model, mesh) -> model: applies TP (and any fix-up) to "
                    "mesh['tp'] of the (dp, tp) or (dp_replicate, dp_shard, tp) mesh; tpdp-verify still wraps DP per --dp, unless --dp own says "
                    "your function wraps it too")
    tp.add_argument("--stack", choices=tuple(STACKS),
                    help="a library's own distributed stack as it shards the model: transformers = its "
                    "DistributedConfig(tp_size, fsdp_size, dp_replicate_size) from --mesh, applied by transformers' "
                    "own code (TP, then FSDP2 with the model's fsdp_plan); transformers-ep adds its expert "
                    "parallelism (ep_size = tp); torchtitan = its parallelize_llama (TP from the model's "
                    "config, then its FSDP2; the loss each rank's share: --loss-share); torchtitan-full-dtensor = "
                    "the same under its full_dtensor backend (every parameter a DTensor on its dense mesh, the "
                    "batch split on it, the loss the step's whole); the plain-DP run is the stack's DP without TP")
    plan.add_argument("--dp-alone", metavar="MODULE:FN",
                      help="with --dp own: dp_alone_fn(model, mesh) -> model, your DP without TP on the same "
                      "mesh, for the plain-DP run (else that run is not made)")
    plan.add_argument("--input", required=True, metavar="MODULE:FN",
                      help="input_fn(n, generator): the input of n samples, or a dict with it under 'input'")
    plan.add_argument("--loss", metavar="MODULE:FN", help="loss_fn(output, batch): one loss per sample "
                      "(default: mean square)")
    plan.add_argument("--loss-share", action="store_true",
                      help="with --dp own: the loss is each rank's share of the step's (its sum over the global "
                      "count), its DP summing gradients, as torchtitan's trainer and FSDP2 do")
    plan.add_argument("--optimizer", metavar="MODULE:FN", help="optimizer_fn(params) (default: SGD, lr 0.1, "
                      "momentum 0.9)")
    plan.add_argument("--mesh", default="1x2", type=_mesh,
                      help="DPxTP, or DP_REPLICATExDP_SHARDxTP for HSDP (default: 1x2)")
    plan.add_argument("--dp", default="fsdp2",
                      choices=("ddp", "ddp_mesh", "replicate", "fsdp2", "fsdp1", "replicate_fsdp", "own",
                               "hsdp", "fsdp1_hybrid", "spmd_shard", "spmd_replicate", "spmd_hsdp"),
                      help="the DP entry point tpdp-verify wraps the TP'd model in (default: fsdp2, fully_shard on "
                      "mesh['dp'], where a correct plan passes on torch 2.13); own: --parallelize applies "
                      "DP itself (no plain-DP run then); hsdp, fsdp1_hybrid (and fsdp2, fsdp1 on a 3-D mesh): "
                      "over mesh['dp_replicate', 'dp_shard']; spmd_*: fully_shard over the whole mesh with "
                      "dp_mesh_dims sharding, replicating, or both (3-D)")
    plan.add_argument("--steps", type=int, default=3)
    plan.add_argument("--batch", type=int, help="global batch, a multiple of DP (default: 2 * DP)")
    plan.add_argument("--accumulate", type=int, default=1, help="microbatches a step")
    plan.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    plan.add_argument("--loss-parallel", action="store_true", help="forward and loss under loss_parallel()")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--baseline", metavar="RELEASE", help="the torch release whose faults are known "
                      "(torch==2.13.0): a departure the run itself shows to be torch's (the reference "
                      "transform in torch's place does not show it) is labelled a torch fault, and passes; the "
                      "rest are the plan's")
    plan.add_argument("--impl", default="torch",
                      help="implementation under test: torch, reference or a dotted path")
    plan.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    plan.add_argument("--timeout", type=float, default=120.0,
                      help="seconds one check may take before its ranks count as hung")
    _verbose_option(plan)
    _output_options(plan, json="the report as JSON (keys: tpdp-verify docs cli)",
                    junit="the report as JUnit XML, a test case a check",
                    markdown="the report as a Markdown table")

    merge = commands.add_parser("merge", help="put the parts of a gate run split by --shard back together",
                                description="The whole run's verdict and outputs from the --json files of "
                                "its N parts (`gate --shard K/N`), as if it had run in one process; a part "
                                "missing, given twice or from another run is an error (exit 2).")
    merge.add_argument("parts", nargs="+", metavar="PART.json")
    _output_options(merge, json="the whole run as JSON (the gate's keys, and `parts`)",
                    junit="the whole run as JUnit XML", markdown="the whole run as a Markdown table")

    memo = commands.add_parser("memo", help="what a baseline release answered, as the gate remembers it",
                               description="The answers the gate judges by: the shipped memo and the user's "
                               "(tpdp-verify docs cli, \"Baselines\"), a line a search; -v: a line a case.")
    memo.add_argument("--baseline", default="torch==2.13.0", metavar="RELEASE",
                      help="the release whose answers to print (default: torch==2.13.0)")
    memo.add_argument("--memo", metavar="FILE", help="a memo file of the gate's --memo, read as well")
    memo.add_argument("-v", "--verbose", action="store_true", help="every case with its answer")

    explain = commands.add_parser("explain", help="the faults torch shows, from the catalog",
                                  description="A fault of the catalog: what goes wrong, what it costs, the "
                                  "workaround, where it lives in torch and where the suite meets it. With no FAULT, "
                                  "the list of faults; --all: the docs page known-divergences as generated.")
    explain.add_argument("faults", nargs="*", metavar="FAULT", help="a fault's number or name")
    explain.add_argument("--all", action="store_true", help="every fault, as the docs page")

    report = commands.add_parser("report", help="an issue ready to file upstream, for a fault or a gate's finding",
                                 description="For a FAULT of the catalog: its standalone reproduction run under "
                                 "this interpreter and each --python, torch's code at fault, the workaround. For "
                                 "a gate's --json FILE: its blocking finding (--finding K), from the shrunk case. "
                                 "For another project's finding (T1, ...: transformers'), the issue for that "
                                 "project, its reproduction run here.")
    report.add_argument("target", metavar="FAULT|GATE.json|T1")
    report.add_argument("--finding", type=int, default=1, metavar="K", help="the K-th blocking finding (default 1)")
    report.add_argument("--python", action="append", metavar="PATH",
                        help="run the reproduction under this interpreter too (its torch release), repeatable")
    report.add_argument("--no-run", action="store_true", help="do not run the reproduction")

    docs = commands.add_parser("docs", help="the documentation shipped with tpdp-verify: its pages, or one",
                               description="With no PAGE, each page and where it is installed; with PAGE "
                               "(cli, user-guide, ...), the page itself, as Markdown.")
    docs.add_argument("page", nargs="?", metavar="PAGE", help="a page's name, with or without .md")

    env = commands.add_parser("env", help="what this machine and torch build can run")
    _output_options(env, json="the same as JSON")
    return parser


def _verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="let the ranks' output (torch's warnings, "
                        "C++ logs) and the warnings of this process through to the terminal; by default the "
                        "ranks' goes to a log file a rank, named at the end")


def _quiet(args: argparse.Namespace) -> str | None:
    """Unless -v: the directory the ranks' output goes to, and torch's warnings in this process off."""
    if args.verbose:
        return None
    import warnings

    from tpdp_verify.files import run_directory

    warnings.filterwarnings("ignore", module=r"torch(\.|$)")
    return run_directory()


def _said_where(logs: str | None) -> None:
    from tpdp_verify.files import LIVE

    if logs and set(os.listdir(logs)) - {LIVE}:  # the run's lock is no output
        print(f"\nthe ranks' output (torch's warnings, C++ logs; -v shows it): {logs}")


def _version() -> str:
    """tpdp-verify's version and the torch it would judge, without importing torch (slow)."""
    import platform
    from importlib import metadata

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"tpdp-verify {version('tpdp-verify')} (torch {version('torch')}, python {platform.python_version()})"


def _output_options(parser: argparse.ArgumentParser, **formats: str) -> None:
    for fmt, help in formats.items():
        parser.add_argument(f"--{fmt}", metavar="FILE", help=f"write {help}")


def _outputs(args: argparse.Namespace, *formats: str) -> dict[str, str]:
    """The output files asked for, option -> path, checked writable now, before any run."""
    from tpdp_verify import outputs

    files = {f"--{fmt}": getattr(args, fmt) for fmt in formats if getattr(args, fmt)}
    outputs.check_writable(files)
    return files


def _gate(args: argparse.Namespace) -> int:
    files = _outputs(args, "json", "junit", "markdown")  # before torch loads: fail fast
    if args.shard:
        from tpdp_verify.runner.selection import parse

        parse(args.shard)
    if args.baseline_python and not args.baseline:
        raise UsageError("--baseline-python runs the release --baseline names: give --baseline torch==X.Y.Z too")
    jobs = _jobs(args)
    if jobs > 1:
        return _gate_in_parts(args, files, jobs)
    run = _GateRun(args, files)
    try:
        return _run_gate(args, run)
    except Interrupted as exc:
        return run.interrupted(exc)
    finally:
        if run.baseline:
            run.baseline.close(at_once=run.stopped)


def _jobs(args: argparse.Namespace) -> int:
    """How many parts at once: --jobs, else as the machine holds; one where the run is a part already."""
    from tpdp_verify.runner.jobs import default_jobs

    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs takes a positive number of parts, not {args.jobs}")
    if args.jobs and args.jobs > 1 and args.shard:
        raise UsageError("--jobs runs parts at once, which --shard cannot take: give --jobs 1")
    if args.shard:
        return 1
    return args.jobs or default_jobs(profiles.get(args.profile).world_sizes)


def _gate_in_parts(args: argparse.Namespace, files: dict[str, str], n: int) -> int:
    """The run in ``n`` parts at once (tpdp_verify.runner.jobs), its outputs the merged parts'."""
    from tpdp_verify import outputs
    from tpdp_verify.impls import select as impl_mod
    from tpdp_verify.runner import jobs, merge
    from tpdp_verify.runner.suite import load as load_suite

    from tpdp_verify.runner import baseline

    impl_mod.load(args.impl)  # what a part would refuse, refused once, here, before any part starts
    if args.baseline:
        baseline.release_of(args.baseline)
    run = _GateRun(args, files)
    run.suite = load_suite(args.suite)
    _select(args, run)
    print(f"{n} parts at once, each a gate process with its own ranks", flush=True)
    parts, stopped = jobs.run(part_arguments(args), n, lambda line: print(line, flush=True))
    merged = merge.merge(parts)
    print()
    print(merge.summary(merged, "gate"))
    outputs.write(files, merged)
    if stopped:
        print(f"tpdp-verify: interrupted by {stopped.name}: each part wrote what it judged"
              + (f"; written to {', '.join(files.values())}" if files else ""), file=sys.stderr)
    return merged["exit_code"]


# What a --jobs part is not given of the run's own arguments, and why; every other gate option
# goes to each part as given (part_arguments), so that a new option cannot be dropped.
NOT_TO_PARTS = {"--jobs": "the parts are the jobs", "--shard": "each part gets its own (runner/jobs.py)",
                "--json": "each part writes its own, merged here", "--junit": "written here from the merged parts",
                "--markdown": "written here from the merged parts", "--help": "not a run's"}


def part_arguments(args: argparse.Namespace) -> list[str]:
    """The gate arguments each --jobs part runs with: the run's own, read from the parser's
    options (NOT_TO_PARTS aside)."""
    out = []
    for action in _subparser("gate")._actions:
        option = next((o for o in action.option_strings if o.startswith("--")), None) or \
            (action.option_strings or [None])[0]
        if option is None or option in NOT_TO_PARTS:
            continue
        value = getattr(args, action.dest)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out += [option] if value != action.default else []
        elif value is not None:
            out += [option, str(value)]
    return out


def _subparser(command: str) -> argparse.ArgumentParser:
    return next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


class _GateRun:
    """A gate run's state as it goes: what its outputs are written from, at its end, when
    it fails, and when a signal stops it."""

    def __init__(self, args: argparse.Namespace, files: dict[str, str]):
        from tpdp_verify import outputs

        self.args, self.files = args, files
        self.started, self.start = outputs.now(), time.monotonic()
        self.profile = profiles.get(args.profile)
        self.suite = self.baseline = self.judged = None
        self.selected: set | None = None  # the searches -k and --shard leave, where given
        self.selection: dict | None = None  # and what they were chosen from, for merge
        self.outcomes: list = []
        self.during = "start-up"  # then search, baseline (judging by it), report
        self.last = self.start  # when the last search ended: the running one's start, or near it
        self.stopped = False  # by a signal

    def record(self, code: int, error: str = "", interrupted: dict | None = None) -> dict:
        from tpdp_verify import outputs

        args = self.args
        return outputs.gate_record(self.outcomes, self.profile, args.impl, args.backend, time.monotonic() - self.start,
                                   code, self.started, error,
                                   baseline=self.baseline.name if self.baseline else "",
                                   judged=self.judged, excluded=self.suite.exclusion_records() if self.suite else [],
                                   seed=args.seed, interrupted=interrupted, selection=self.selection)

    def searched(self, outcome) -> None:
        self.outcomes.append(outcome)
        self.last = time.monotonic()

    def interrupted(self, exc: Interrupted) -> int:
        """Write every output with what was judged, the searches left marked interrupted, and
        say so in one line; the ranks are stopped already (the exception retired them)."""
        from tpdp_verify import outputs
        from tpdp_verify.runner.gate import interrupted, searches

        self.stopped = True
        todo = searches(self.suite.properties, self.profile, self.selected) if self.suite else []
        done, left = len(self.outcomes), todo[len(self.outcomes):]
        running = time.monotonic() - self.last if self.during == "search" and left else None
        self.outcomes += interrupted(left, exc.name, running, self.profile.max_examples)
        where = {"start-up": "before the first search", "baseline": "while the baseline judged the findings",
                 "report": "while reporting"}.get(self.during) or \
            (f"during {left[0][0].name} (world size {left[0][1]})" if running is not None else "between searches")
        said = f"interrupted by {exc.name} {where}: {done} of {len(todo)} searches judged"
        outputs.write(self.files, self.record(exc.exit_code, said, {"signal": exc.name, "during": self.during}))
        print(f"tpdp-verify: {said}" + (f", {len(left)} marked interrupted" if left else "")
              + (f"; written to {', '.join(self.files.values())}" if self.files else ""), file=sys.stderr)
        return exc.exit_code


def _run_gate(args: argparse.Namespace, run: _GateRun) -> int:
    from tpdp_verify import outputs
    from tpdp_verify.impls import select as impl_mod
    from tpdp_verify.ranks import pool
    from tpdp_verify.runner.suite import load as load_suite

    # What the command names is refused in its one line before the ranks' server imports its
    # preloads (seconds): the suite, the implementation, the selection.
    profile = run.profile
    suite = run.suite = load_suite(args.suite)
    impl_mod.load(args.impl)
    _select(args, run)
    pool.warm_up(here=True)  # the ranks' fork server, forked once this process has imported torch
    from tpdp_verify.runner import baseline
    from tpdp_verify.runner.gate import InternalError, iter_gate, summary, verdict
    from tpdp_verify.status import verdict_line

    logs = _quiet(args)
    progress = lambda line: print(line, flush=True)  # noqa: E731
    if args.baseline:
        run.baseline = baseline.Baseline(baseline.release_of(args.baseline), python=args.baseline_python,
                                         install=not args.no_install, memo_path=_memo_path(args),
                                         suite=args.suite, backend=args.backend, timeout=args.timeout,
                                         rank_output=logs, progress=progress)
        if args.baseline_python:
            run.baseline.side()  # the environment the user named: a bad one is one line now, not mid-run
    files = run.files
    run.started, run.start = outputs.now(), time.monotonic()  # the run's seconds: from its first rank on
    start = run.last = run.start
    try:
        run.during = "search"
        searches = iter_gate(suite.properties, profile, args.impl, args.backend, args.timeout, progress=progress,
                             baseline=run.baseline, seed=args.seed, rank_output=logs, selected=run.selected)
        with contextlib.closing(searches):  # an interrupt between searches: the ranks stop now, not at exit
            for outcome in searches:
                run.searched(outcome)
        run.judged = baseline.Judgement.of(run.outcomes) if run.baseline else None
    except PoolError as exc:  # ranks would not start: CI still gets what ran, and why not the rest
        outputs.write(files, run.record(EXIT_INFRA, str(exc)))
        raise
    except InternalError as exc:
        log = _internal_log(exc.original)
        outputs.write(files, run.record(EXIT_INFRA, f"{exc} (traceback in {log})"))
        print(f"tpdp-verify: internal error: {exc}; the traceback is in {log}", file=sys.stderr)
        return EXIT_INFRA
    run.during = "report"
    outcomes, judged, said_of_run = run.outcomes, run.judged, verdict(run.outcomes)
    seconds = time.monotonic() - start

    def said(full: bool) -> str:  # the full report for the file (and -v), the short one for a person
        text = summary(outcomes, profile, args.impl, seconds, suite.summary_lines(), full)
        if judged is not None:
            b = run.baseline
            text += "\n" * (1 + full) + baseline.report(judged, b.name, said_of_run, b.asking, b.unavailable, full)
        return text + "\n" + verdict_line(said_of_run)

    print()
    print(said(full=bool(args.verbose)))
    print(_next_steps(args, outcomes), end="")
    code = said_of_run.exit_code
    outputs.write(files, run.record(code))  # with divergences too: they are what CI shows
    if logs:
        write_whole(os.path.join(logs, "report.txt"), said(full=True) + "\n")
        print(f"\nthe full report (every finding's case and replay, what is not searched): {logs}/report.txt")
    _said_where(logs)
    return code


def _next_steps(args: argparse.Namespace, outcomes: list) -> str:
    """After findings judged by no baseline: the commands that tell torch's known faults from
    new ones, and explain one the catalog names; "" otherwise."""
    from tpdp_verify.runner.memo import SHIPPED

    found = [f for o in outcomes for f in o.findings if f.blocks]
    if args.baseline or not found:
        return ""
    releases = sorted((p.name[len("torch-"):-len(".json.gz")] for p in SHIPPED.glob("torch-*.json.gz")),
                      key=lambda r: tuple(int(x) for x in r.split(".") if x.isdigit()))
    release = releases[-1] if releases else "2.13.0"
    named = sorted({x.number for f in found if f.explanation for x in f.explanation.faults})
    gate = _subparser("gate")  # the run's own choices, its defaults left out (--profile said always)
    given = {"-k": "keyword", "--seed": "seed", "--impl": "impl", "--suite": "suite"}
    again = ["--profile", args.profile] + [
        x for option, dest in given.items() if getattr(args, dest) not in (None, gate.get_default(dest))
        for x in (option, shlex.quote(str(getattr(args, dest))))]
    me = _invoked()
    lines = ["", "next:",
             f"  {me} gate {' '.join(again + ['--baseline', f'torch=={release}'])}"
             + f"   # known: torch {release} fails alike; the rest is new",
             *([f"  {me} explain {named[0]}   # fault {named[0]}: what goes wrong, the workaround"] if named else []),
             f"  {me} docs cli   # the gate's options, outputs and baselines; docs known-divergences: torch's faults"]
    return "\n".join(lines) + "\n"


def _invoked() -> str:
    """This command as the user can type it again: ``tpdp-verify`` where that is on the
    PATH, else the script's path (``.venv/bin/tpdp-verify`` after ``make demo``), or
    ``python -m tpdp_verify``."""
    import shutil

    script = sys.argv[0]
    if os.path.basename(script) != "tpdp-verify":
        return "python -m tpdp_verify"
    found = shutil.which("tpdp-verify")
    if found and os.path.exists(script) and os.path.samefile(found, script):
        return "tpdp-verify"
    relative = os.path.relpath(script)
    return script if relative.startswith("..") else relative


def _memo_path(args: argparse.Namespace) -> Path | None:
    return Path(args.memo) if args.memo else None


def _select(args: argparse.Namespace, run: _GateRun) -> None:
    """The searches -k and --shard leave of the suite's, said in one line."""
    from tpdp_verify.runner.gate import searches
    from tpdp_verify.runner.selection import search_id, select

    if not (args.keyword or args.shard):
        return
    every = [(p.name, ws) for p, ws in searches(run.suite.properties, run.profile)]
    plan = select(every, args.keyword, None, run.profile)
    mine = select(plan, None, args.shard, run.profile)
    run.selected = set(mine)
    run.selection = {"keyword": args.keyword, "shard": args.shard, "plan": [search_id(*s) for s in plan],
                     "searches": [search_id(*s) for s in mine]}
    print(f"{'shard ' + args.shard + ': ' if args.shard else ''}{len(mine)} of {len(every)} searches"
          + (f" (-k {args.keyword!r} selects {len(plan)})" if args.keyword else ""), flush=True)


def _internal_log(exc: BaseException) -> str:
    """Write ``exc``'s traceback to a log file; its path."""
    import tempfile
    import traceback

    with tempfile.NamedTemporaryFile("w", prefix="tpdp-verify-internal-", suffix=".log", delete=False) as f:
        f.write("".join(traceback.format_exception(exc)))
    return f.name


def _mesh(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) not in (2, 3) or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not DPxTP or DP_REPLICATExDP_SHARDxTP, e.g. 2x2 or 2x2x2")
    return dims


def _named(path: str, what: str):
    """The object ``module:attribute`` names, the current directory on the import path."""
    import difflib
    import importlib
    import os

    module, _, attr = path.partition(":")
    if not module or not attr:
        raise UsageError(f"{what} {path!r} is not module:attribute, e.g. my_model:make_model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; spawned ranks inherit it
    try:
        obj = importlib.import_module(module)
    except Exception as exc:
        raise UsageError(f"cannot import {module!r} for {what}: {type(exc).__name__}: {exc}; "
                         "run from the directory that holds it, or add it to PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            near = difflib.get_close_matches(part, dir(obj), n=1)
            raise UsageError(f"{module!r} has no {attr!r} for {what}"
                             + (f"; did you mean {near[0]!r}?" if near else ""))
        obj = getattr(obj, part)
    return obj


def _plan(args: argparse.Namespace) -> int:
    files = _outputs(args, "json", "junit", "markdown")
    from tpdp_verify import outputs
    from tpdp_verify.ranks import pool

    given = {"plan": args.plan, "parallelize": args.parallelize, "dp_alone": args.dp_alone, "input": args.input,
             "loss": args.loss, "optimizer": args.optimizer}
    if args.stack:
        if args.dp not in ("fsdp2", "hsdp", "own") or args.dp_alone:
            raise UsageError(f"--stack {args.stack} applies the stack's own DP (FSDP2, HSDP on a 3-D mesh) and its "
                             "run without TP: leave out --dp and --dp-alone")
        args.dp = "own"
        given["parallelize"], given["dp_alone"], share = STACKS[args.stack]
        args.loss_share = args.loss_share or share
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; the ranks and their fork server inherit it
    started, start = outputs.now(), time.monotonic()
    try:
        # the ranks' fork server, forked once this process has imported torch and the user's modules
        pool.warm_up(tuple(v.partition(":")[0] for v in (args.model, *given.values()) if v and ":" in v), here=True)
        return _run_plan(args, files, given, started, start)
    except Interrupted as exc:  # no verdict: the record says so, every file is written
        outputs.write(files, outputs.plan_interrupted(_plan_case(args), exc.name, exc.exit_code, started,
                                                      time.monotonic() - start, args.baseline or "", _replay_line()))
        print(f"tpdp-verify: interrupted by {exc.name} before the verdict"
              + (f"; written to {', '.join(files.values())}, marked interrupted" if files else ""), file=sys.stderr)
        return exc.exit_code


def _plan_case(args: argparse.Namespace) -> dict:
    """The case of a plan run, as its report's JSON names it, from the options alone."""
    from tpdp_verify.cases.training import DP

    dp = math.prod(args.mesh[:-1])
    return {"model": args.model, "mesh": list(args.mesh), "dp": DP[args.dp], "steps": args.steps,
            "accumulate": args.accumulate, "batch": args.batch or 2 * dp, "dtype": args.dtype, "seed": args.seed}


def _replay_line() -> str:
    return "tpdp-verify " + " ".join(sys.argv[1:])


def _run_plan(args: argparse.Namespace, files: dict[str, str], given: dict, started: str, start: float) -> int:
    from tpdp_verify import outputs
    from tpdp_verify.plan import verify_plan

    model_fn = _named(args.model, "the model")
    logs = _quiet(args)
    named = {k: v if (k, v) == ("plan", "auto") else _named(v, f"--{k.replace('_', '-')}") if v else None
             for k, v in given.items()}
    report = verify_plan(model_fn, named["plan"], parallelize_fn=named["parallelize"], dp_alone_fn=named["dp_alone"],
                         mesh=args.mesh,
                         input_fn=named["input"],
                         loss_fn=named["loss"], loss_share=args.loss_share, optimizer_fn=named["optimizer"],
                         steps=args.steps, dp=args.dp,
                         dtype=args.dtype, batch=args.batch, accumulate=args.accumulate,
                         loss_parallel=args.loss_parallel, seed=args.seed, impl=args.impl,
                         backend=args.backend, timeout=args.timeout, baseline=args.baseline,
                         replay=_replay_line(), rank_output=logs,
                         waiting=lambda line: print(f"tpdp-verify: {line}", file=sys.stderr, flush=True))
    print(report)
    code = report.status.exit_code
    outputs.write(files, outputs.plan_record(report, code, started, time.monotonic() - start))
    _said_where(logs)
    return code


def _env(args: argparse.Namespace) -> int:
    files = _outputs(args, "json")
    from tpdp_verify import outputs

    record = outputs.env_record()
    print(outputs.env_text(record))
    outputs.write(files, record)
    return EXIT_OK


def _merge(args: argparse.Namespace) -> int:
    from tpdp_verify import outputs
    from tpdp_verify.runner import merge

    files = _outputs(args, "json", "junit", "markdown")
    merged = merge.merge([(path, merge.load(path)) for path in args.parts])
    print(merge.summary(merged))
    outputs.write(files, merged)
    return merged["exit_code"]


def _memo(args: argparse.Namespace) -> int:
    from tpdp_verify.runner import memo
    from tpdp_verify.runner.baseline import release_of

    release = release_of(args.baseline)
    paths = [memo.shipped(release), memo.users(release), *([Path(args.memo)] if args.memo else [])]
    held = memo.Memo.load(release, paths)
    print(f"torch {release}: {len(held.answers)} cases asked (memo revision {memo.HARNESS}), from "
          + ", ".join(f"{p} ({len(memo.read(p, release))})" for p in paths))
    searches: dict = {}
    for asked in held.answers.values():
        searches.setdefault((asked.property, asked.world_size), []).append(asked)
    for (prop, world_size), answers in sorted(searches.items()):
        failing = [a for a in answers if a.signature]
        print(f"  {prop:<38} world {world_size}  {len(answers):>5} asked, {len(failing):>5} fail there, "
              f"{len({a.signature for a in failing})} ways")
        for a in answers if args.verbose else ():
            said = " + ".join(a.signature) or "passes"
            print(f"      {said}: " + ", ".join(f"{k}={v}" for k, v in a.case.items()))
    return EXIT_OK


def _explain(args: argparse.Namespace) -> int:
    from tpdp_verify import faults
    from tpdp_verify.faults import pages

    if args.all:
        print(pages.page(faults.CATALOG), end="")
        return EXIT_OK
    if not args.faults:
        print(pages.table(faults.CATALOG))
        print("\ntpdp-verify explain N: one fault; tpdp-verify report N: an issue ready to file upstream")
        return EXIT_OK
    print("\n\n".join(pages.section(_fault(ref)) for ref in args.faults))
    return EXIT_OK


def _fault(ref: str):
    from tpdp_verify import faults

    found = faults.find(ref)
    if found is None:
        raise UsageError(f"no fault {ref!r} in the catalog; `tpdp-verify explain` lists them (1 to "
                         f"{len(faults.CATALOG)})")
    return found


def _docs(args: argparse.Namespace) -> int:
    """The shipped docs (package tpdp_verify.docs: the source tree's docs/)."""
    from importlib import resources

    pages = {p.name.removesuffix(".md"): p for p in resources.files("tpdp_verify.docs").iterdir()
             if p.name.endswith(".md")}
    if not args.page:
        width = max(map(len, pages))
        print("\n".join(f"{name:<{width}}  {pages[name]}" for name in sorted(pages)))
        return EXIT_OK
    page = pages.get(args.page.removesuffix(".md").removeprefix("docs/"))
    if page is None:
        raise UsageError(f"no page {args.page!r}; tpdp-verify docs lists them: {', '.join(sorted(pages))}")
    print(page.read_text(encoding="utf-8"), end="")
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from tpdp_verify.faults import issue
    from tpdp_verify.integrations import findings
    from tpdp_verify.integrations.findings import FINDINGS

    finding = next((f for f in FINDINGS if f.code == args.target.upper()), None)
    if finding is not None:  # another project's fault (transformers'), found by the conformance table
        print(findings.issue(finding, runs=not args.no_run), end="")
    elif args.target.endswith(".json") or os.path.sep in args.target:
        print(issue.for_finding(issue.load(args.target), args.finding), end="")
    else:
        print(issue.for_fault(_fault(args.target), issue.interpreters(args.python), runs=not args.no_run), end="")
    return EXIT_OK


COMMANDS = {"gate": _gate, "plan": _plan, "merge": _merge, "memo": _memo, "explain": _explain, "report": _report,
            "docs": _docs, "env": _env}


def _one_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"tpdp-verify: warning: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from tpdp_verify.files import inductor_cache

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache())  # not left in the temp dir
    try:
        args = _parser().parse_args(argv)
    except _Refused as exc:
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc}", file=sys.stderr)
        _refused(argv, f"{exc}: {exc.parser.prog} --help lists the arguments")
        return EXIT_USAGE
    try:
        # SIGINT and SIGTERM raise Interrupted (once): gate and plan write what they judged
        with warnings.catch_warnings(), caught():  # a warning of ours is one line, as an error is
            warnings.showwarning = _one_line
            # env says what this machine has, torch too old or not; the others read files only
            if args.command not in ("env", "merge", "memo", "explain", "docs"):
                torch_release.check()
            return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"tpdp-verify: error: {exc}", file=sys.stderr)
        _usage_outputs(args, str(exc))
        return EXIT_USAGE
    except PoolError as exc:
        print(f"tpdp-verify: infrastructure failure: {exc}", file=sys.stderr)
        return EXIT_INFRA
    except BrokenPipeError:  # the reader went away (tpdp-verify memo | head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is buffered goes nowhere
        return EXIT_OK
    except KeyboardInterrupt as exc:  # where a command had nothing to write yet (env, or before its run)
        stopped = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)  # Python's own handler raised it
        print(f"tpdp-verify: interrupted by {stopped.name}", file=sys.stderr)
        return stopped.exit_code
    except Exception as exc:  # tpdp-verify's own failure: one line, the traceback in a log, never 1
        print(f"tpdp-verify: internal error: {type(exc).__name__}: {exc}; the traceback is in "
              f"{_internal_log(exc)}", file=sys.stderr)
        return EXIT_INFRA


def _usage_outputs(args: argparse.Namespace, message: str) -> None:
    """The output files asked for, saying the input was refused: CI reads an error there,
    never a stale verdict. A path that cannot take one (the usage error may be about it) is
    left alone."""
    from tpdp_verify import outputs

    record = outputs.usage_record(args.command, message)
    for fmt in ("json", "junit", "markdown"):
        path = getattr(args, fmt, None)
        if path:
            with contextlib.suppress(UsageError):
                outputs.write({f"--{fmt}": path}, record)


def _refused(argv: list[str], message: str) -> None:
    """The outputs a refused command line asked for (``--json FILE``, ``--junit=FILE``), read
    from it as given, saying it was refused: a CI job finds the error there, as for any other
    usage error."""
    command = next((a for a in argv if a in COMMANDS), "tpdp-verify")
    asked = argparse.Namespace(command=command)
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        if option in ("--json", "--junit", "--markdown"):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "")
            setattr(asked, option[2:], value or None)
    _usage_outputs(asked, message)


def console() -> None:
    code = main()
    # Everything is written and every rank stopped: skip unloading torch's modules at exit,
    # a second of a command that takes ten. multiprocessing's exit finalizers still run:
    # they remove the pymp-* directory its fork server's socket lives in.
    from multiprocessing import util

    util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
