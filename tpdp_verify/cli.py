"""``tpdp-verify``: the command line. Exit codes: 0 ok, 1 divergence, 2 usage, 3 infrastructure."""

from __future__ import annotations

import argparse
import sys
import time

from tpdp_verify import profiles
from tpdp_verify.errors import EXIT_INFRA, EXIT_USAGE, PoolError, UsageError


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
    return parser


def _gate(args: argparse.Namespace) -> int:
    from tpdp_verify.gate import exit_code, run_gate, summary
    from tpdp_verify.properties import ALL

    profile = profiles.get(args.profile)
    start = time.monotonic()
    outcomes = run_gate(ALL, profile, args.impl, args.backend, args.timeout,
                        progress=lambda line: print(line, flush=True))
    print()
    print(summary(outcomes, profile, args.impl, time.monotonic() - start))
    return exit_code(outcomes)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _gate(args)
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
