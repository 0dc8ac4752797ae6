"""Known means the baseline release shows the same failure on the same case.

``Baseline`` answers "what does release R show on this case?": from the memo where it was
asked before (tpdp_verify.runner.memo), else by running the case there (replay: another
environment's python, or this one's where it holds that very release), and remembers the
answer. A failure of the candidate is then judged against that answer (``status``):

- **known**: the release shows every part of it on the case;
- **NEW**: the release passes the case, or shows all it shows and the candidate more;
- **CHANGED**: the release fails the case otherwise (a different error, other checks);
- **not asked**: no memo holds the case and no environment of the release could run it.
  Never NEW and never known: the run says so, and exits 4.

After a search, the memo's failing cases of that search are run on the candidate (those the
search met are not run again): one that passes now is **FIXED**, one that fails otherwise
**CHANGED**. Reruns are bounded by the profile; those left are counted and said.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpdp_verify import signature
from tpdp_verify.errors import UsageError
from tpdp_verify.status import Found, Status
from tpdp_verify.runner import memo as memos


def release_of(spec: str) -> str:
    """``torch==2.13.0`` (as pip spells it), or ``torch-2.13.0`` / ``2.13.0``: the release."""
    match = re.fullmatch(r"(?:torch\s*==\s*|torch-)?(\d+\.\d+\.\d+(?:[.\w]*))", spec.strip())
    if not match:
        raise UsageError(f"--baseline {spec!r} is not a torch release: give one as pip spells it, "
                         "e.g. --baseline torch==2.13.0")
    return match[1]


def installed_release() -> str | None:
    """The installed torch's release (``2.13.0`` of ``2.13.0+cpu``) where its files are the
    ones its wheel installed (pip's RECORD hashes), else None: a torch edited in place is
    not the release it is named after."""
    import base64
    import hashlib
    from importlib import metadata

    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.hash is None or not str(f).endswith(".py"):
            continue
        try:
            digest = hashlib.new(f.hash.mode, f.locate().read_bytes()).digest()
        except OSError:
            return None
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value:
            return None
    return dist.version.split("+")[0]


def status(shown: signature.Signature, answer: signature.Signature | None) -> Found:
    """A candidate's failure ``shown`` judged by the release's ``answer`` on the same case."""
    if answer is None:
        return Found.NOT_ASKED
    if shown and set(shown) <= set(answer):
        return Found.KNOWN
    if not answer or set(answer) <= set(shown):
        return Found.NEW  # the release passes, or the candidate adds a fault to the release's
    return Found.CHANGED


@dataclass
class Asking:
    """How often a run asked, and what it cost."""

    memo: int = 0  # answered by the memo
    replays: int = 0  # answered by running the case on the release
    seconds: float = 0.0
    candidate: int = 0  # answered by the candidate's own run: it is the release
    not_asked: int = 0


class Baseline:
    """A torch release as the judge of a run: its memo, and where to run what it lacks.

    ``python``: the interpreter of an environment holding the release (``--baseline-python``);
    else this interpreter where its torch is the release, unmodified; else an environment
    installed once into the cache (``install``), unless ``install`` is False: then a failure
    the memo lacks is not asked. ``memo_path``: where this run's answers are added.
    """

    def __init__(self, release: str, *, python: str | None = None, install: bool = True,
                 memo_path: Path | None = None, suite: str = "tpdp_verify.properties", backend: str = "auto",
                 timeout: float = 120.0, rank_output: str | None = None, progress=print):
        self.release = release
        self.memo_path = memo_path or memos.users(release)
        self.memo = memos.Memo.load(release, [memos.shipped(release), memos.users(release), self.memo_path])
        self.python, self.install = python, install
        self.here = installed_release() == release
        self.suite, self.backend, self.timeout, self.rank_output = suite, backend, timeout, rank_output
        self.progress = progress
        self.asking = Asking()
        self._side, self.unavailable = None, ""

    @property
    def name(self) -> str:
        return f"torch=={self.release}"

    def is_candidate(self, impl: str) -> bool:
        """Whether the code under test is the release itself: its runs are the release's answers."""
        return impl == "torch" and self.here and self.python is None

    def answer(self, prop, pool, impl: str, drawn: dict, shown: signature.Signature) -> signature.Signature | None:
        """What the release shows on ``drawn`` (``()``: passes); None where it could not be asked."""
        if self.is_candidate(impl):  # this very run is the release's answer: truer than one remembered
            self.asking.candidate += 1
            now = shown
        else:
            known = self.memo.get(prop.name, pool.world_size, drawn)
            if known is not None:
                self.asking.memo += 1
                return known.signature
            side = self.side()
            if side is None:
                self.asking.not_asked += 1
                return None
            start = time.monotonic()
            now = side.shows(prop, pool, drawn)
            self.asking.replays += 1
            self.asking.seconds += time.monotonic() - start
        self.memo.put(memos.Asked.of(prop.name, pool.world_size, drawn, now))
        return signature.of(now)

    def remember(self, prop: str, world_size: int, ran: dict, cases: dict) -> int:
        """Where this run is the release's (``is_candidate``): every case it ran, passes
        too, as the release's answers, so that the memo answers the draws themselves and not
        only their failures, in the memo this run adds to (``memo_path``; the shipped one when it
        records it) though another file holds them. ``ran``: memo key -> signature; ``cases``:
        key -> (reprs, types). How many were new to that memo."""
        new = [k for k in ran if k in cases and k not in self.memo.added
               and self.memo.held_in.get(k) != self.memo_path]
        for k in new:
            self.memo.put(memos.Asked(prop, world_size, *cases[k], signature.of(ran[k]), k))
        return len(new)

    def side(self):
        """Where the release runs a case the memo lacks, started on first use; None if nowhere."""
        from tpdp_verify.runner import provision, replay

        if self._side is not None or self.unavailable:
            return self._side
        if self.python is None and self.here:
            self._side = replay.ImplSide("torch")
            return self._side
        python = self.python
        if python is None:
            if not self.install:
                self.unavailable = (f"no environment of torch {self.release} (--no-install): failures the memo "
                                    f"lacks were not asked; drop --no-install, or give --baseline-python PATH")
                return None
            try:
                python = provision.environment(self.release, self.progress)
            except UsageError as exc:
                self.unavailable = str(exc)
                self.progress(f"baseline: {exc}")
                return None
        self.progress(f"baseline: starting torch {self.release} at {python}")
        self._side = replay.PythonSide(python, self.suite, self.backend, self.timeout, self.rank_output)
        return self._side

    def close(self, at_once: bool = False) -> int:
        """Stop the release's side, and keep what it answered; the memo's size (0: nothing added)."""
        if self._side is not None:
            self._side.close(at_once)
        if not self.memo.added:
            return 0
        try:
            return self.memo.save(self.memo_path)
        except OSError as exc:
            self.progress(f"baseline: could not keep this run's answers in {self.memo_path}: {exc}")
            return 0


@dataclass
class Judgement:
    """A run's findings by status, over every search."""

    new: list = field(default_factory=list)  # (property, world size, finding)
    changed: list = field(default_factory=list)
    fixed: list = field(default_factory=list)
    known: list = field(default_factory=list)
    not_asked: list = field(default_factory=list)
    reran: int = 0  # memo cases run again on the candidate
    not_rerun: int = 0  # and those the rerun budget left
    infra: int = 0  # searches the harness could not judge: the run has no verdict on them

    @property
    def blocks(self) -> bool:
        return bool(self.new or self.changed)

    @classmethod
    def of(cls, outcomes) -> "Judgement":
        out = cls()
        lists = {Found.NEW: out.new, Found.CHANGED: out.changed, Found.FIXED: out.fixed, Found.KNOWN: out.known,
                 Found.NOT_ASKED: out.not_asked}
        for o in outcomes:
            for f in o.findings:
                if f.status in lists:
                    lists[f.status].append((o.property, o.world_size, f))
            out.reran += o.stats.reran
            out.not_rerun += o.stats.not_rerun
            out.infra += o.status in (Status.INFRA, Status.INTERRUPTED)
        return out

    def counts(self) -> dict:
        return {"new": len(self.new), "changed": len(self.changed), "fixed": len(self.fixed),
                "known": len(self.known), "not_asked": len(self.not_asked), "reran": self.reran,
                "not_rerun": self.not_rerun, "infra": self.infra}


def report(j: Judgement, name: str, verdict: Status, asking: Asking | None = None, unavailable: str = "",
           full: bool = True) -> str:
    """What the baseline said of the run: a line per finding that is not known (``full``; the
    summary lists them otherwise), how it was asked, then the counts and the run's ``verdict``."""
    width = max([len(p) for p, _, _ in j.new + j.changed + j.fixed + j.not_asked] + [8])

    def line(label: str, item) -> str:
        prop, world_size, f = item
        return f"  {label:<9} {prop:<{width}} world {world_size}  {f.kind}"

    out = [f"baseline {name}: known where that release fails the same way on the same case"]
    for label, found in (("NEW", j.new), ("CHANGED", j.changed), ("FIXED", j.fixed), ("not asked", j.not_asked)):
        out += [line(label, x) for x in found] if full else []
    if asking is not None:
        out.append(f"  asked {asking.memo + asking.replays + asking.candidate + asking.not_asked} times: "
                   f"{asking.memo} from the memo, {asking.replays} replayed there ({asking.seconds:.0f} s)"
                   + (f", {asking.candidate} by the candidate's own run (it is that release)" if asking.candidate
                      else "") + (f", {asking.not_asked} not asked" if asking.not_asked else ""))
    if j.reran or j.not_rerun:
        out.append(f"  the memo's failing cases run again on the candidate: {j.reran}"
                   + (f"; {j.not_rerun} not rerun (the profile's rerun budget was spent): whether they still "
                      "fail was not asked" if j.not_rerun else ""))
    if unavailable:
        out.append(f"  {unavailable}")
    out.append(f"against the baseline: {len(j.new)} new, {len(j.changed)} changed, {len(j.fixed)} fixed, "
               f"{len(j.known)} known" + (f", {len(j.not_asked)} not asked" if j.not_asked else "")
               + f": {verdict.sentence}")
    return "\n".join(out)
