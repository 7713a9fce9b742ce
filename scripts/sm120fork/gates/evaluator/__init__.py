"""Evaluate an expression of one module on one architecture (`Evaluator`).

Layered without a cycle: `context` (what the module knows of the tree) and
`base` (the evaluator's shared state and the methods its parts call on each
other) at the bottom; `external` (values from other modules), `functions`
(zero-argument functions run path by path), `names` and `operators` on them;
`evaluate` (calls, dispatch) puts the parts together.
"""

from sm120fork.gates.evaluator.context import Context
from sm120fork.gates.evaluator.evaluate import Evaluator
from sm120fork.gates.evaluator.functions import zero_argument

__all__ = ["Context", "Evaluator", "zero_argument"]
