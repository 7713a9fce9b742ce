"""What a patch's rows say at a new release (rebase/verdicts.py) and which environment
decides them (rebase/decisionenv.py), without a gate run: observations are made up
here, as the harness would write them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hermetic import git
from hermetic import output as git_output
from sm120fork.harness import table
from sm120fork.patches.patchfile import parse_patch
from sm120fork.rebase import decisionenv, gaterows, verdicts

SM12X = ("sm120", "sm121")
OTHERS = ("sm90", "sm100")
PATCH = "sm120-x.patch"
TEXT = """\
--- a/python/sglang/x.py
+++ b/python/sglang/x.py
@@ -1,1 +1,3 @@
 def f():
+    raise ValueError(
+        "attention backend nsa is not supported on SM12x")
"""
ADDED = verdicts.added_text(parse_patch(TEXT.encode(), PATCH, 1))


def row(**cells: table.Cell) -> table.Row:
    return table.Row(1, "s", "backend", None, PATCH, cells)


def seen(**values: object) -> dict[str, dict[str, dict[str, object]]]:
    """arch -> {"s": {"backend": value}}; a value {"error": ...} is a refusal."""
    return {
        arch: {"s": value if isinstance(value, dict) else {"backend": value}}
        for arch, value in values.items()
    }


EXPECT = row(sm90="fa3", sm100="trtllm", sm120="triton", sm121="triton")
PRISTINE = seen(sm90="fa3", sm100="trtllm", sm120="fa3", sm121="fa3")
PATCHED = seen(sm90="fa3", sm100="trtllm", sm120="triton", sm121="triton")


def after(pristine: object, patched: object, before: object = None) -> verdicts.Verdict:
    observed = (pristine, patched, before)
    return verdicts.after_carry("0.5.24", [EXPECT], observed, SM12X, OTHERS)  # type: ignore[arg-type]


def test_rows_passing_on_the_pristine_release_make_it_upstreamed() -> None:
    verdict = verdicts.upstreamed("0.5.24", [EXPECT], PATCHED, SM12X, "")
    assert verdict.ok and "row 1 s:backend" in verdict.reason
    assert not verdicts.upstreamed("0.5.24", [EXPECT], PRISTINE, SM12X, "").ok
    assert not verdicts.upstreamed("0.5.24", [], PATCHED, SM12X, "").ok


def test_upstream_refusing_in_its_own_words_meets_the_patchs_refusal() -> None:
    refusal = row(sm120="raises:attention backend nsa is not supported on SM12x")
    refused = seen(sm120={"error": "ValueError: DSA needs SM90 or SM100"})
    assert verdicts.upstreamed("0.5.24", [refusal], refused, ("sm120",), ADDED).ok
    assert not verdicts.upstreamed("0.5.24", [refusal], refused, ("sm120",), "").ok
    blind = seen(sm120={"error": "harness: Traceback"})
    assert not verdicts.upstreamed("0.5.24", [refusal], blind, ("sm120",), ADDED).ok


def test_a_carried_patch_whose_rows_pass_is_verified() -> None:
    verdict = after(PRISTINE, PATCHED)
    assert verdict.ok and verdict.reason.startswith("verified"), verdict


def test_rows_that_fail_as_on_the_pristine_release_are_dead_code() -> None:
    verdict = after(PRISTINE, PRISTINE)
    assert (verdict.ok, verdict.kind) == (False, "dead code"), verdict
    assert 'expected "triton", patched "fa3"' in verdict.reason


def test_rows_that_fail_otherwise_stop() -> None:
    verdict = after(PRISTINE, seen(sm90="fa3", sm100="trtllm", sm120="flashinfer", sm121="triton"))
    assert (verdict.ok, verdict.kind) == (False, "rows fail"), verdict


def test_a_changed_cell_of_another_architecture_stops() -> None:
    verdict = after(PRISTINE, seen(sm90="triton", sm100="trtllm", sm120="triton", sm121="triton"))
    assert (verdict.ok, verdict.kind) == (False, "other architectures"), verdict
    assert 'sm90: upstream "fa3", patched "triton"' in verdict.reason


def test_a_change_of_another_architecture_that_its_row_records_is_verified() -> None:
    """The b12x runner refuses its SM12x-only flag elsewhere: the row says so there."""
    recorded = row(sm90="raises:b12x is SM12x only", sm100="trtllm", sm120="b12x", sm121="b12x")
    refused = seen(
        sm90={"error": "ValueError: b12x is SM12x only"}, sm100="trtllm", sm120="b12x", sm121="b12x"
    )
    accepted = seen(sm90="b12x", sm100="trtllm", sm120="fa3", sm121="fa3")
    observed = (accepted, refused, None)
    judged = verdicts.after_carry("0.5.24", [recorded], observed, SM12X, OTHERS)
    assert judged.ok, judged
    unrecorded = seen(sm90="fa3", sm100="fa3", sm120="b12x", sm121="b12x")
    observed = (accepted, unrecorded, None)
    judged = verdicts.after_carry("0.5.24", [recorded], observed, SM12X, OTHERS)
    assert (judged.ok, judged.kind) == (False, "other architectures"), judged


def test_a_refusal_whose_case_upstream_now_resolves_otherwise_is_for_review() -> None:
    refusal = table.Row(1, "s", "backend", None, PATCH, {"sm120": "raises:not supported"})
    refused = seen(sm120={"error": "ValueError: not supported on SM12x"})
    now, then = seen(sm120="flashinfer_sparse_mla"), seen(sm120="nsa")
    observed = (now, refused, then)
    verdict = verdicts.after_carry("0.5.19", [refusal], observed, ("sm120",), ())
    assert (verdict.ok, verdict.kind) == (False, "review"), verdict
    assert 'now "flashinfer_sparse_mla", before "nsa"' in verdict.reason
    unchanged = (then, refused, then)
    assert verdicts.after_carry("0.5.19", [refusal], unchanged, ("sm120",), ()).ok
    # The release before, run where its tree does not load, shows no resolution.
    unloaded = seen(sm120={"error": "ImportError: cannot import name 'x' from 'sgl_kernel'"})
    assert verdicts.after_carry("0.5.19", [refusal], (now, refused, unloaded), ("sm120",), ()).ok


def _venv(root: Path, requires: list[str]) -> Path:
    """A venv as far as the finder looks: bin/python and sglang's dist-info."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    info = root / "lib/python3.11/site-packages/sglang-0.5.23.dist-info"
    info.mkdir(parents=True)
    lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\n{lines}")
    return root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SM120_GATE_ENV", raising=False)
    monkeypatch.delenv("SM120_ENV_ROOT", raising=False)
    monkeypatch.delenv(decisionenv.OVERRIDE_VARIABLE, raising=False)
    monkeypatch.setenv(decisionenv.INSTALL_VARIABLE, "no")
    fork = tmp_path / "fork"
    (fork / "vendor").mkdir(parents=True)
    (fork / "vendor" / "sglang.lock").write_text('version = "0.5.23"\n')
    (fork / "pyproject.toml").write_text('[project]\nname = "t"\ndependencies = []\n')
    return tmp_path


def _release(cache: Path, version: str, pins: list[str] | None) -> Path:
    release = cache / "upstream" / version
    release.mkdir(parents=True)
    if pins is not None:
        (release / decisionenv.PINS_FILE).write_text(decisionenv.normalized(pins))
    return release


def test_the_venv_with_the_releases_pins_decides(cache: Path) -> None:
    base = cache / "cache" / "sglang-sm120"
    _venv(
        base / "gate-env-0.5.23", ["torch==2.14.1", "flashinfer_python==0.7.2", "x; extra == 'y'"]
    )
    _venv(base / "gate-env-0.5.13", ["torch==2.11.0"])
    release = _release(cache, "0.5.24", ["flashinfer_python ==0.7.2", "torch==2.14.1"])
    env = decisionenv.find(cache / "fork", "0.5.24", release)
    assert env.venv == base / "gate-env-0.5.23" and "same pins as 0.5.24" in env.why


def test_no_pins_or_no_venv_is_a_reason_not_a_pass(cache: Path) -> None:
    with pytest.raises(decisionenv.NoDecisionEnv, match="declares no pins"):
        decisionenv.find(cache / "fork", "0.5.24", _release(cache, "0.5.24", None))
    with pytest.raises(decisionenv.NoDecisionEnv, match="forbids installing"):
        decisionenv.find(cache / "fork", "0.5.25", _release(cache, "0.5.25", ["torch==0.1"]))


def test_pins_are_read_from_the_tag_the_rebase_was_given(tmp_path: Path) -> None:
    """A git release's pins come from its tag's python/pyproject.toml (nothing is
    downloaded); a tag without one records none, and `find` then gives the reason."""
    work = tmp_path / "src"
    (work / "python").mkdir(parents=True)
    pyproject = '[project]\ndependencies = ["torch==2.14.1", "x; extra == \'y\'"]\n'
    (work / "python" / "pyproject.toml").write_text(pyproject)
    git("init", "-q", ".", cwd=work)
    git("add", "-A", ".", cwd=work)
    git("commit", "-q", "-m", "release", cwd=work)
    release = tmp_path / "release"
    bare = release / "upstream.git"  # where the fetch leaves the repository it fetched
    git("clone", "-q", "--bare", str(work), str(bare), cwd=tmp_path)
    commit = git_output("rev-parse", "HEAD", cwd=work)
    decisionenv.record_pins(release, None, commit)
    assert (release / decisionenv.PINS_FILE).read_text() == "torch==2.14.1\n"
    made = git_output("show", "-s", "--format=%cI", "HEAD", cwd=work)  # resolve as of then
    assert (release / decisionenv.RELEASED_FILE).read_text() == f"{made}\n"
    git("rm", "-q", "python/pyproject.toml", cwd=work)
    git("commit", "-q", "-m", "no pins", cwd=work)
    git("fetch", "-q", str(work), "HEAD", cwd=bare)
    (release / decisionenv.PINS_FILE).unlink()
    decisionenv.record_pins(release, None, git_output("rev-parse", "HEAD", cwd=work))
    assert not (release / decisionenv.PINS_FILE).exists()


def test_kept_observations_are_named_by_what_decides_them(tmp_path: Path) -> None:
    """A change to the gate data the harness reads, or to the environment's pins,
    names a new place for the observations: none made before it is reused."""
    fork = tmp_path / "fork"
    (fork / "gatetable" / "models").mkdir(parents=True)
    for name in ("archs.toml", "scenarios.toml", "models/m.json"):
        (fork / "gatetable" / name).write_text("a")
    env = decisionenv.DecisionEnv(_venv(tmp_path / "venv", ["torch==2.14.1"]) / "bin/python", "")
    first = gaterows.inputs_digest(env, fork)
    assert gaterows.inputs_digest(env, fork) == first
    (fork / "gatetable" / "models" / "m.json").write_text("b")
    second = gaterows.inputs_digest(env, fork)
    assert second != first
    metadata = next((tmp_path / "venv").glob("lib/*/site-packages/sglang-*/METADATA"))
    metadata.write_text(metadata.read_text().replace("torch==2.14.1", "torch==2.15.0"))
    assert gaterows.inputs_digest(env, fork) not in (first, second)
