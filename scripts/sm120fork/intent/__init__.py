"""Gate intents: what a patch wants at a gate, re-applicable to moved or reformatted code.

A patch may declare, in `patches/intents.toml`, the recipe that produces it:
which gate (found by an anchor and the architectures it admits, not by line
or text), which architectures to let in, and which choices to switch for
them. `check` proves the recipe reproduces the patch on the pinned base;
`rebase` uses it when the patch text no longer applies.
"""
