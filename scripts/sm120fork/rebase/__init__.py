"""`sm120fork rebase`: carry the patch series onto a new upstream release.

The steps, as a maintainer would do them by hand (see `flow.py`):

1. preconditions: no rebase in progress, clean repository, the series applies
   exactly to vendor/sglang, the target is a newer release (`preconditions`);
2. fetch the target release, or every release up to it with `--step`
   (`targets`);
3. build a scratch git repository under build/rebase/work: the old base, one
   commit per patch, then each new release as a commit on top (`workrepo`);
4. carry each patch in series order through an ordered list of strategies
   (`carry.STRATEGIES`, each a function over a frozen `strategy.CarryContext`):
   exact, already upstream, at an offset, by intent, a 3-way merge by
   `git cherry-pick`, relocated where its code went (`relocate`), the rules
   that resolve a conflict (`resolutions`); stop on a conflict and describe it
   (`conflicts`); each result, with the strategy's name, is recorded as data
   (`ledger`) and worded in one place (`fate`);
5. land vendor/sglang, its lock, patches/ and CHANGELOG.md in one step,
   guided by a journal (`landing`, `changelog`);
6. write build/rebase/report.json and report.md (`report`).

Everything --continue and --abort need is persisted after each step in the
git directory (`state`), so the tool can be killed at any point.
"""
