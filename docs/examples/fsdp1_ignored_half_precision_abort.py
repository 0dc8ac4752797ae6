"""torch 2.13: FSDP1 alone (no TP) with ``ignored_modules`` on a half-precision model aborts
a rank: gloo's ``Received data size doesn't match expected size`` (a collective whose size
the ranks disagree on), SIGABRT. The same model in float32 trains.

The ``frozen`` zoo model (a frozen plain layer, then an MLP) on 4 dp ranks, its trained
``mlp`` block given to FSDP1 as an ignored module, the model in bfloat16
(docs/known-divergences.md; found explaining a TP+DP failure without TP). Four gloo ranks
on the CPU: python docs/examples/fsdp1_ignored_half_precision_abort.py
"""

from tpdp_verify import RankPool
from tpdp_verify.cases.training import Habits, Size, TrainCase
from tpdp_verify.errors import RankDied
from tpdp_verify.oracles.plain_ddp import observe_plain_ddp

if __name__ == "__main__":
    with RankPool(4, timeout=60) as pool:
        for dtype in ("float32", "bfloat16"):
            case = TrainCase(model="frozen", size=Size(dim=1, hidden=2), mesh_shape=(4, 1), entry="fsdp1",
                             habits=Habits(ignored="trained"), dtype=dtype)
            try:
                pool.run(observe_plain_ddp, case)
                print(f"{dtype}: trains")
            except RankDied as exc:
                print(f"{dtype}: {str(exc).splitlines()[0]}")
