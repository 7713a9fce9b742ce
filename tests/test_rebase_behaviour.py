"""The behaviour strategy's rules (rebase/behaviour.py, rebase/gaterows.py) and the
gate environments keyed by pin set (gateenv.for_release), without a gate run; the
rebase onto a synthetic release that runs the real rows is in
tests/gates/test_synthetic_releases.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from sm120fork import gateenv
from sm120fork.patches.patchfile import PatchFile, parse_patch
from sm120fork.rebase import behaviour, gaterows
from sm120fork.rebase.state import Target
from sm120fork.rebase.workrepo import WorkRepo

PATCH = "sm120-guard.patch"
TEXT = """\
From: a <a@example.com>
Subject: [PATCH] guard

Origin: vendor
Forwarded: no
Last-Update: 2026-12-01
---
diff --git a/python/sglang/x.py b/python/sglang/x.py
--- a/python/sglang/x.py
+++ b/python/sglang/x.py
@@ -1,2 +1,5 @@
 def f():
+    if sm120:
+        raise ValueError("its kernels are built for SM100/SM103 only, not "
+                         "SM12x. Use triton.")
     return 1
"""
ADDED = behaviour.added_text(parse_patch(TEXT.encode(), PATCH, 1))


def cell(arch: str, expected: str, observed: str, **flags: object) -> gaterows.Cell:
    ok = bool(flags.get("ok", expected == observed))
    wants = flags.get("expects_raise")
    return gaterows.Cell(
        row=int(str(flags.get("row", 7))),
        scenario="s",
        field="f",
        arch=arch,
        expected=expected,
        observed=observed,
        ok=ok,
        raised=bool(flags.get("raised", False)),
        expects_raise=wants if isinstance(wants, str) else None,
        blind=bool(flags.get("blind", False)),
    )


def test_every_sm12x_cell_matching_is_upstreamed_naming_the_rows() -> None:
    cells = [cell("sm120", '"triton"', '"triton"'), cell("sm121", '"triton"', '"triton"', row=9)]
    upstreamed, why = behaviour.verdict("0.5.10", "2 gate-table rows", cells, "")
    assert upstreamed
    assert "upstream 0.5.10 already gives sm120/sm121" in why
    assert "row 7 s:f, row 9 s:f" in why


def test_one_differing_cell_keeps_the_patch_and_says_what_upstream_gives() -> None:
    cells = [cell("sm120", '"triton"', '"triton"'), cell("sm121", '"triton"', '"fa3"')]
    upstreamed, why = behaviour.verdict("0.5.13", "1 gate-table row", cells, "")
    assert not upstreamed
    assert 'row 7 s:f sm121: patched "triton", upstream "fa3"' in why
    assert "still needed" in why


def test_upstream_refusing_in_its_own_words_meets_the_patch_s_refusal() -> None:
    wanted = "built for SM100/SM103 only, not SM12x"
    refused = cell(
        "sm120",
        f'"raises:{wanted}"',
        '"raises:RuntimeError: FlashInfer TRT-LLM FP8 GEMM needs SM100"',
        ok=False,
        raised=True,
        expects_raise=wanted,
    )
    upstreamed, why = behaviour.verdict("0.5.10", "1 gate-table row", [refused], ADDED)
    assert upstreamed
    assert "in its own words" in why and "needs SM100" in why


def test_a_refusal_prefixed_at_run_time_is_still_the_patch_s_own() -> None:
    wanted = "--fp8-gemm-backend trtllm: built for SM100/SM103 only, not SM12x"
    refused = cell(
        "sm121",
        f'"raises:{wanted}"',
        '"raises:ValueError: no"',
        ok=False,
        raised=True,
        expects_raise=wanted,
    )
    assert behaviour.verdict("0.5.10", "1 gate-table row", [refused], ADDED)[0]


def test_a_refusal_the_patch_does_not_word_must_match_exactly() -> None:
    refused = cell(
        "sm120",
        '"raises:upstream words"',
        '"raises:RuntimeError: other words"',
        ok=False,
        raised=True,
        expects_raise="upstream words",
    )
    assert not behaviour.verdict("0.5.10", "1 gate-table row", [refused], ADDED)[0]


def test_a_blind_cell_or_no_cell_is_never_a_pass() -> None:
    blind = cell("sm120", '"triton"', '"unavailable:no gate"', ok=False, blind=True)
    assert not behaviour.verdict("0.5.10", "1 gate-table row", [blind], "")[0]
    upstreamed, why = behaviour.verdict("0.5.10", "1 gate-table row", [], "")
    assert not upstreamed and "no SM12x cell observed" in why


@dataclass(frozen=True)
class _Context:
    repo: WorkRepo
    target: Target
    fork_root: Path
    parsed: PatchFile

    @property
    def name(self) -> str:
        return self.parsed.name


def _fork(root: Path) -> Path:
    gates = root / "gatetable"
    gates.mkdir(parents=True)
    (gates / "archs.toml").write_text(
        "[sm100]\ncapability = [10, 0]\n[sm120]\ncapability = [12, 0]\n"
        "[sm121]\ncapability = [12, 1]\n"
    )
    (gates / "expectations.toml").write_text(
        f'[[row]]\nscenario = "s"\nfield = "f"\npatch = "{PATCH}"\n'
        '[[row]]\nscenario = "t"\nfield = "g"\n'
    )
    return root


def test_rows_are_the_patch_s_own_and_the_cells_sm12x(tmp_path: Path) -> None:
    root = _fork(tmp_path)
    assert gaterows.rows_of(root, PATCH) == [gaterows.Row(1, "s", "f")]
    assert gaterows.rows_of(root, "other.patch") == []
    assert gaterows.rows_of(tmp_path / "nowhere", PATCH) == []
    assert gaterows.sm12x_archs(root) == ["sm120", "sm121"]


def test_without_rows_it_is_not_the_strategy_s_case(tmp_path: Path) -> None:
    parsed = parse_patch(TEXT.encode(), "other.patch", 1)
    ctx = _Context(WorkRepo(tmp_path), Target("0.5.10"), _fork(tmp_path), parsed)
    assert behaviour.judge(ctx, ctx, print) is None


def test_an_environment_that_cannot_be_had_is_said_never_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gaterows.OVERRIDE_VARIABLE, str(tmp_path / "no-venv"))
    parsed = parse_patch(TEXT.encode(), PATCH, 1)
    ctx = _Context(WorkRepo(tmp_path), Target("0.5.10"), _fork(tmp_path), parsed)
    judged = behaviour.judge(ctx, ctx, print)
    assert judged is not None
    upstreamed, why = judged
    assert not upstreamed
    assert "could not be run on pristine sglang 0.5.10" in why
    assert "holds no bin/python" in why


def test_no_install_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(gaterows.INSTALL_VARIABLE, "no")
    monkeypatch.setattr(gateenv, "release_pins", lambda version: "torch==1\n")
    root = tmp_path / "fork"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = []\n')
    with pytest.raises(gateenv.GateEnvError, match=r"--release 0\.5\.10"):
        gaterows.gate_env(root, "0.5.10", print)
    monkeypatch.setenv(gaterows.INSTALL_VARIABLE, "0.5.13,0.5.20")
    with pytest.raises(gateenv.GateEnvError, match=r"=0\.5\.13,0\.5\.20"):
        gaterows.gate_env(root, "0.5.10", print)


def _venv(cache: Path, version: str, pins: str) -> Path:
    venv = cache / "sglang-sm120" / f"gate-env-{version}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "sm120-gate-requirements.txt").write_text(f"sglang=={version}\npytest>=8\n")
    (venv / "sm120-gate-pins.txt").write_text(pins)
    return venv


def test_a_release_with_the_same_pins_reuses_an_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "fork"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = []\n')
    shared = _venv(tmp_path, "0.5.13", "torch==2.11.0\n")
    reused = gateenv.for_release(root, "0.5.13.post1", "torch==2.11.0\n")
    assert reused.venv == shared and reused.current
    other = gateenv.for_release(root, "0.5.14", "torch==2.13.0\n")
    assert other.venv.name == "gate-env-0.5.14" and not other.current
    assert other.requirements[0] == "sglang==0.5.14"
    assert gateenv.for_release(root, "0.5.13", "anything").venv == shared


def test_behaviour_is_the_last_strategy_before_the_conflict() -> None:
    from sm120fork.rebase import carry

    assert carry.STRATEGIES[-1] is behaviour.try_behaviour
