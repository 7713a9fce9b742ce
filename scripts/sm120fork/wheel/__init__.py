"""Build the fork's wheel: the upstream release wheel with the patch series applied.

`build.build_wheels` is the flow; the other modules are its steps: pick and
fetch the locked upstream wheels (`select`, `fetch`), rewrite one wheel
(`transform`) with new metadata (`metadata`) and RECORD (`record`), written
as a deterministic zip (`zipfiles`).
"""
