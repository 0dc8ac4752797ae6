"""``tpdp-verify``: the command line. A subparser and a ``_<command>(args)`` each; exit codes
(docs/cli.md): 0 ok, 1 divergence, 2 usage, 3 infrastructure."""

from __future__ import annotations

import argparse
import sys
import time

from tpdp_verify import profiles
from tpdp_verify.errors import EXIT_INFRA, EXIT_OK, EXIT_USAGE, PoolError, UsageError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpdp-verify",
        description="Check that tensor parallelism composed with data parallelism trains "
        "exactly like the unsharded model.",
        epilog="exit codes: 0 ok, 1 divergence found, 2 usage or input error, "
        "3 infrastructure failure (a rank hung or died)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gate = commands.add_parser("gate", help="run the conformance suite against an implementation")
    gate.add_argument("--profile", default="smoke", choices=sorted(profiles.PROFILES),
                      help="how many examples on which world sizes (default: smoke)")
    gate.add_argument("--impl", default="torch",
                      help="implementation under test: torch, reference or a dotted path")
    gate.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    gate.add_argument("--timeout", type=float, default=120.0,
                      help="seconds one check may take before its ranks count as hung")
    _output_options(gate, json="the run as JSON (keys: docs/cli.md)",
                    junit="the run as JUnit XML, a test case a property",
                    markdown="the run as a Markdown table and the failures' reports")

    env = commands.add_parser("env", help="what this machine and torch build can run")
    _output_options(env, json="the same as JSON")
    return parser


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
    from tpdp_verify import outputs
    from tpdp_verify.gate import exit_code, iter_gate, summary
    from tpdp_verify.properties import ALL

    profile = profiles.get(args.profile)
    started, start, outcomes = outputs.now(), time.monotonic(), []

    def record(code: int, error: str = "") -> dict:
        return outputs.gate_record(outcomes, profile, args.impl, args.backend,
                                   time.monotonic() - start, code, started, error)

    try:
        for outcome in iter_gate(ALL, profile, args.impl, args.backend, args.timeout,
                                 progress=lambda line: print(line, flush=True)):
            outcomes.append(outcome)
    except PoolError as exc:  # ranks would not start: CI still gets what ran, and why not the rest
        outputs.write(files, record(EXIT_INFRA, str(exc)))
        raise
    print()
    print(summary(outcomes, profile, args.impl, time.monotonic() - start))
    code = exit_code(outcomes)
    outputs.write(files, record(code))  # with divergences too: they are what CI shows
    return code


def _env(args: argparse.Namespace) -> int:
    files = _outputs(args, "json")
    from tpdp_verify import outputs

    record = outputs.env_record()
    print(outputs.env_text(record))
    outputs.write(files, record)
    return EXIT_OK


COMMANDS = {"gate": _gate, "env": _env}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"tpdp-verify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PoolError as exc:
        print(f"tpdp-verify: infrastructure failure: {exc}", file=sys.stderr)
        return EXIT_INFRA
    except KeyboardInterrupt:
        print("tpdp-verify: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    sys.exit(main())
