"""Landing a finished rebase: stage, swap under the journal, clean up, report.

Resumable from any point: the journal in the state says how far it got (see
finalize.py), and every step below is idempotent.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

from sm120fork.errors import EXIT_OK
from sm120fork.rebase import fate, finalize, outputs, report
from sm120fork.rebase.run import Run, say
from sm120fork.rebase.state import RebaseState, crash_point


def land(run: Run, state: RebaseState) -> int:
    root = run.paths.root
    plan = state.journal
    if plan is None or plan.step == "staging":
        state = run.release_gates(state)  # with --step, also the gates section below
        gates = run.gates(state)
        final = state.final.version
        writers = outputs.writers(run.paths, state, run.tree(final), run.manifest(final), gates)
        plan = finalize.journal(root, writers)
        state = run.save(replace(state, journal=plan, gates=gates))
        say("staging vendor/sglang, its lock, patches/ and CHANGELOG.md")
        finalize.stage(root, plan, writers, after_each=lambda: crash_point("mid-stage"))
        plan = replace(plan, step="staged")
        state = run.save(replace(state, journal=plan))
        crash_point("after-stage")
    if plan.step == "staged":
        finalize.swap(root, plan, after_each=lambda: crash_point("mid-swap"))
        plan = replace(plan, step="swapped")
        state = run.save(replace(state, journal=plan))
        crash_point("after-swap")
    finalize.discard_old(root, plan)
    _, md = report.write(run.reports, report.build(state, "complete", run.gates(state), None))
    shutil.rmtree(run.work, ignore_errors=True)
    shutil.rmtree(run.area / "upstream", ignore_errors=True)
    run.store.remove()
    kept = sum(not fate.leaves_series(p.status) for p in state.patches)
    print(
        f"rebased onto sglang {state.final.version}: {kept} of {len(state.patches)} patches "
        f"carried; wrote vendor/sglang, its lock, patches/ and CHANGELOG.md; report {md}"
    )
    return EXIT_OK
