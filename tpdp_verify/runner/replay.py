"""The baseline release's side of a replay: a case run again, same case and seed, there.

Two sides (tpdp_verify.runner.baseline chooses):

- ``ImplSide``: another implementation in this interpreter, on the same ranks (torch, where
  this interpreter's torch is the baseline release and the candidate is another
  implementation: a mutant, the reference, a user's transform);
- ``PythonSide``: another environment's interpreter (``--baseline-python PATH``, or one
  installed into the cache), serving replays from its own process and its own ranks:
  nothing of the candidate's torch is imported there.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tpdp_verify import signature
from tpdp_verify.errors import PoolError, UsageError
from tpdp_verify.runner.property import Property, finding, never


class ReplayError(PoolError):
    """The baseline side could not run a case: no verdict (exit 3), never a finding."""


class ImplSide:
    """The baseline is another implementation in this interpreter, run on the candidate's ranks."""

    def __init__(self, impl: str):
        from tpdp_verify.impls import select

        select.load(impl)  # a bad name fails now, in one line
        self.impl = impl
        self.what = f"implementation {impl}"

    def shows(self, prop: Property, pool, drawn: dict) -> signature.Signature:
        return run_case(prop, pool, self.impl, drawn)

    def close(self, at_once: bool = False) -> None:
        pass


def run_case(prop: Property, pool, impl: str, drawn: dict) -> signature.Signature:
    """What ``prop`` shows on ``drawn`` with ``impl``: its signature, () when it passes (a
    death only the ranks' history causes is not the case's: on_fresh_ranks)."""
    try:
        prop.call(pool, impl, drawn, never)
    except Exception as exc:
        found = finding(exc)
        if found is None:
            raise ReplayError(f"the baseline side failed running {prop.name}: {type(exc).__name__}: {exc}") from exc
        return found.signature
    return ()


class PythonSide:
    """The baseline is the torch of another environment: a server in that interpreter replays
    cases on ranks of its own. It imports this tpdp-verify's code (a view of its packages on
    its path), with that environment's torch, hypothesis and numpy."""

    def __init__(self, python: str, suite: str, backend: str, timeout: float, rank_output: str | None):
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise UsageError(f"--baseline-python {python}: not an executable file; give the python of an "
                             "environment that holds the baseline torch")
        self._view = tempfile.TemporaryDirectory(prefix="tpdp-verify-baseline-")
        server = _package_view(Path(self._view.name))
        # the view first, the working directory last (a user's --suite): never `python -m`, which
        # puts the working directory first, where a checkout's own tpdp_verify folder (no
        # properties in it) would stand for the package
        path = [self._view.name, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), os.getcwd()]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        env.pop("PYTHONHOME", None)
        self._log = open(os.path.join(rank_output, "baseline-python.log"), "ab") if rank_output else None
        self.process = subprocess.Popen(
            [python, str(server), suite, backend, str(timeout), rank_output or ""],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
            start_new_session=True)  # a Ctrl-C reaches this process, which stops the server itself
        try:
            hello = self._reply("starting")
        except (ReplayError, ValueError) as exc:  # not a python that runs tpdp-verify: the user's input
            self.close(at_once=True)
            raise UsageError(f"--baseline-python {python} did not start the replay server: {exc}") from None
        if "error" in hello:
            self.close()
            raise UsageError(f"--baseline-python {python}: {hello['error']}")
        self.torch = hello["torch"]
        self.what = f"torch {self.torch} ({python})"

    def shows(self, prop: Property, pool, drawn: dict) -> signature.Signature:
        from tpdp_verify.runner.memo import printed

        case, types = printed(drawn)
        request = {"property": prop.name, "world_size": pool.world_size, "case": case, "types": types,
                   "impl": "torch"}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self._reply(f"replaying {prop.name}")
        if "error" in reply:
            raise ReplayError(f"the baseline python failed replaying {prop.name}: {reply['error']}")
        return signature.of(reply["signature"])

    def _reply(self, doing: str) -> dict:
        line = self.process.stdout.readline()
        if not line:  # its output closed: it is exiting, or has
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
            raise ReplayError(f"the baseline python exited while {doing} (exit {self.process.poll()})"
                              + (f"; its output is in {self._log.name}" if self._log else ""))
        return json.loads(line)

    def close(self, at_once: bool = False) -> None:
        """Stop the server: at the end of its input, after the replay it runs; ``at_once`` (the
        gate was interrupted): killed, its ranks ending with it (their lifeline)."""
        if self.process.poll() is None:
            if at_once:
                self.process.kill()
            else:
                self.process.stdin.close()  # the server stops its ranks and exits at end of input
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log:
            self._log.close()
        self._view.cleanup()


def _package_view(root: Path) -> Path:
    """``root/tpdp_verify``: this tpdp-verify's package as installed, its top-level folders
    (properties, oracles, fixtures) in place, as links, for a python that has not installed it;
    and beside it the server's script, which it returns: run as a file, its folder (the view)
    is the first place that python imports from, whatever the working directory holds."""
    from importlib.util import find_spec

    def where(name: str) -> Path:  # found, not imported: the suite is not this layer's to import
        return Path(find_spec(name).submodule_search_locations[0])

    package = root / "tpdp_verify"
    package.mkdir()
    for item in where("tpdp_verify").iterdir():
        if item.name != "__pycache__":
            (package / item.name).symlink_to(item)
    for sub in ("properties", "oracles", "fixtures"):
        if not (package / sub).exists():
            (package / sub).symlink_to(where(f"tpdp_verify.{sub}"))
    server = root / "tpdp_verify_replay_server.py"
    # the guard: the server's ranks import this file again as __mp_main__
    server.write_text("from tpdp_verify.runner.replay import main\n\nif __name__ == \"__main__\":\n    main()\n")
    return server


# --------------------------------------------------------------------------- the server


def serve(suite_name: str, backend: str, timeout: float, rank_output: str) -> None:
    """Answer replays, a JSON line each, until the end of input. Runs in the baseline's python."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what anything else prints goes to the log, never into the replies
    try:
        import torch

        from tpdp_verify.ranks.pool import RankPool
        from tpdp_verify.runner.memo import rebuild
        from tpdp_verify.runner.suite import load
    except ImportError as exc:
        _send(replies, {"error": f"cannot import {exc.name or exc}: install tpdp-verify's dependencies there "
                                 "(torch, hypothesis, numpy)"})
        return
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a user's --suite; last, so that nothing there shadows the view
    suite = {p.name: p for p in load(suite_name).properties}
    _send(replies, {"torch": torch.__version__})
    pools: dict[int, RankPool] = {}
    try:
        for line in sys.stdin:
            request = json.loads(line)
            world_size = request["world_size"]
            try:
                if world_size not in pools:
                    pools[world_size] = RankPool(world_size, backend, timeout=timeout, output=rank_output or None)
                    pools[world_size].__enter__()
                drawn = rebuild(request["case"], tuple(request["types"]))
                shown = run_case(suite[request["property"]], pools[world_size], request["impl"], drawn)
                _send(replies, {"signature": list(shown)})
            except Exception as exc:  # the harness here: the candidate reports it, exit 3
                _send(replies, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
    finally:
        for pool in pools.values():
            pool.__exit__(None, None, None)


def _send(replies, message: dict) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


def main() -> None:
    """The server's entry: ``SUITE BACKEND TIMEOUT RANK_OUTPUT``, as PythonSide starts it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the candidate stops this server by closing its input
    serve(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4])
