"""The script that makes a verify_plan call again, wherever it is run from."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from tpdp_verify.cases.training import DP, DDPOptions, TrainCase


def script(case: TrainCase, impl: str, plan, baseline: str | None) -> str:
    """A script that makes the same call: it imports the user's functions (and plan) from
    their modules' files, wherever it is run from."""
    u = case.user
    named = {"model_fn": u.model_fn, "input_fn": u.input_fn, "loss_fn": u.loss_fn, "optimizer_fn": u.optimizer_fn,
             "parallelize_fn": u.parallelize_fn, "dp_alone_fn": u.dp_alone_fn, "plan": plan if callable(plan) else None}
    imports = {fn.__module__: [] for fn in named.values() if fn is not None}
    for fn in named.values():
        if fn is not None:
            imports[fn.__module__].append(getattr(fn, "__qualname__", type(fn).__qualname__).split(".")[0])
    plan_name, written = None, []
    if plan == "auto":
        plan_name = "'auto'"
    elif plan is not None and not callable(plan):
        plan_name = _plan_name(plan, imports)
        if plan_name is None:  # no module-level name: written out from its styles' reprs
            plan_name, written = "PLAN", [
                "from torch.distributed.tensor import Replicate, Shard",
                "from torch.distributed.tensor.parallel import *  # noqa: F403", "",
                "# the plan, from its styles' reprs (torch writes a layout as a tuple): check it",
                f"PLAN = {{{', '.join(f'{k!r}: {v!r}' for k, v in plan.items())}}}"]
    args = [_called(named["model_fn"])]
    if plan is not None:
        args.append(_called(named["plan"]) if callable(plan) else plan_name)
    args += [f"{k}={_called(v)}" for k, v in named.items() if v is not None and k not in ("model_fn", "plan")]
    dp = next(k for k, v in DP.items() if v == case.entry)
    args += [f"mesh={case.mesh_shape}", f"steps={case.steps}", f"dp={dp!r}", f"dtype=torch.{case.dtype}",
             f"batch={case.global_batch}", f"accumulate={case.accumulate}", f"seed={case.seed}", f"impl={impl!r}"]
    args += [f"loss_parallel={u.loss_parallel}"] if u.loss_parallel else []
    args += ["loss_share=True"] if case.loss_shared else []
    args += [f"ddp_options={dataclasses.asdict(case.ddp)!r}"] if case.ddp != DDPOptions() else []
    args += [f"baseline={baseline!r}"] if baseline else []
    paths = sorted({p for m in imports if (p := _import_root(m))})
    lines = ["import sys", "", "import torch", "", "from tpdp_verify import verify_plan", ""]
    lines += [f"sys.path[:0] = {paths!r}  # the directories of the modules below"] if paths else []
    lines += [f"from {_module_name(m)} import {', '.join(dict.fromkeys(names))}" for m, names in imports.items()]
    lines += written
    lines += ["", 'if __name__ == "__main__":  # the ranks are processes that import this file',
              f"    report = verify_plan({', '.join(args)})", "    print(report)",
              "    raise SystemExit(0 if report.ok else 1)"]
    return "\n".join(lines) + "\n"


def _called(fn) -> str:
    """A callable as the script writes it: a function by its name, a callable object (a
    dataclass instance's __call__) by its repr, its class imported."""
    return getattr(fn, "__qualname__", None) or repr(fn)


def _import_root(module: str) -> str | None:
    """The directory from which ``module`` imports: where its top-level package (or the
    module itself) lies. A package installed under another folder's name (tpdp_verify's
    fixtures) counts from its top package."""
    top = sys.modules.get(module.split(".")[0])
    if getattr(top, "__file__", None) is None:
        return None
    path = Path(top.__file__).resolve()
    return str(path.parents[1] if hasattr(top, "__path__") else path.parent)


def _module_name(module: str) -> str:
    """A module as a script imports it: a script run as __main__ by its file's name."""
    return Path(sys.modules[module].__file__).stem if module in ("__main__", "__mp_main__") else module


def _plan_name(plan: dict, imports: dict[str, list[str]]) -> str | None:
    """The name a plan dict has at a module's top level (the user's functions' modules
    first, then the script's, then any), added to the imports."""
    for module in [*imports, "__main__", *sys.modules]:
        if getattr(sys.modules.get(module), "__file__", None) is None:
            continue  # nowhere to import it from
        for name, value in list(vars(sys.modules[module]).items()):
            if value is plan:
                imports.setdefault(module, []).append(name)
                return name
    return None
