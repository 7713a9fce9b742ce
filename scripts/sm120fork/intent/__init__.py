"""Gate intents: what a patch does at a gate, re-applicable to moved or reformatted code.

A patch declares, in `patches/intents.toml`, the recipe that produces it: edits
whose scope is found by meaning (a function by qualified name, the override a
decorator registers for an architecture, the module defining a name), each one
operation (insert, refuse, add an elif branch, change a condition, replace,
import). `check` proves the recipe reproduces the patch on the pinned base;
`rebase` uses it when the patch text no longer applies.
"""
