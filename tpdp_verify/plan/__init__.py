"""Verify a user's TP plan: their model, plan, data and loss through the suite's oracles.

``verify_plan`` carries the user's callables in a ``TrainCase`` (its ``user`` field,
``case``), checks every input it can before training (``preflight``: a mistake gets one
line saying what to do, as a ``UsageError``), trains the case on the ranks and compares it
with the unsharded model on one device and with the same DP entry point without TP
(``verify``). The result is a ``Report``, with a script that makes the same call
(``replay``).
"""

from tpdp_verify.plan.preflight import plan_problems
from tpdp_verify.plan.verify import verify_plan

__all__ = ["plan_problems", "verify_plan"]
