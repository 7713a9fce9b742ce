"""The 0.5.9 series the replay benchmark carries (benchmarks/data/series-0.5.9/): an
intent for each of its patches, each reproducing its patch byte for byte on sglang
0.5.9 (fetched from the package index, so marked `network`)."""

from __future__ import annotations

import ast
import difflib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sm120fork.intent.model import load_intents
from sm120fork.intent.reapply import reapply
from sm120fork.patches.applier import Overlay, apply_patch
from sm120fork.patches.patchfile import load_patch
from sm120fork.patches.series import read_series

SERIES = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "series-0.5.9"
ENTRIES = read_series(SERIES / "series").entries
NAMES = [entry.name for entry in ENTRIES]
GLM4 = "python/sglang/srt/arg_groups/model_overrides/glm4_moe.py"
Case = tuple[dict[str, str | None], dict[str, str | None]]  # a patch's files, before and after


def test_every_patch_of_the_0_5_9_series_has_an_intent() -> None:
    assert sorted(load_intents(SERIES / "intents.toml")) == sorted(NAMES)


def test_the_0_5_9_glm4_moe_intent_follows_its_gate_to_0_5_23() -> None:
    """0.5.9's gate sat in ServerArgs under `elif model_arch in ["Glm4MoeForCausalLM"]`
    and tested `is_sm100_supported()`; 0.5.23 (vendored) has it in its own override
    module behind `@_register_for` and tests `get_platform().is_sm100`."""
    intent = load_intents(SERIES / "intents.toml")["sm120-glm4-moe-runner.patch"]
    vendor = Path(__file__).resolve().parents[1] / "vendor" / "sglang"
    overrides = vendor / "python/sglang/srt/arg_groups"
    paths = [p.relative_to(vendor).as_posix() for p in sorted(overrides.rglob("*.py"))]

    def read(path: str) -> str | None:
        file = vendor / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    result = reapply(intent, read, paths)
    assert result.status == "resolved", result.detail
    (path, new) = next(iter(result.changes.items()))
    assert (path, len(result.changes)) == (f"{GLM4}", 1)
    assert "    if get_platform().is_sm100 or get_platform().is_sm120:\n" in new
    assert "            get_platform().is_sm120\n            and quant_method" in new
    assert '("flashinfer_cutlass" if get_platform().is_sm120 else "flashinfer_trtllm")' in new
    ast.parse(new)


def test_the_0_5_9_olmo2_intent_writes_0_5_23s_override_pass_form() -> None:
    """0.5.15 turned Olmo2's `self.attention_backend = ...` into an override returning
    `overrides`; the recipe finds its if-chain in 0.5.23's olmo2.py and writes the
    branch as the fork's own 0.5.23 patch does (passform.py): no `self.` there."""
    intent = load_intents(SERIES / "intents.toml")["sm120-olmo2-attention-triton.patch"]
    path = "python/sglang/srt/arg_groups/model_overrides/olmo2.py"
    text = (Path(__file__).resolve().parents[1] / "vendor" / "sglang" / path).read_text()
    result = reapply(intent, {path: text}.get, [path])
    assert result.status == "resolved", result.detail
    assert "written in the override-pass form" in result.detail
    added = difflib.ndiff(text.splitlines(), result.changes[path].splitlines())
    assert [line[2:] for line in added if line.startswith("+ ")] == [
        "        elif get_platform().is_cuda and get_platform().is_sm120:",
        "            # FA3 has no SM12x kernels and FlashInfer is refused below.",
        '            overrides["attention_backend"] = "triton"',
    ]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """Each patch's files on sglang 0.5.9 below it, and as the patch leaves them."""
    where = tmp_path_factory.mktemp("sglang-0.5.9")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*command, "sglang==0.5.9", "-d", str(where), "-q"], check=True)
    (wheel,) = where.glob("sglang-0.5.9-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("sglang/")]
        archive.extractall(where / "tree" / "python", names)
    overlay = Overlay(where / "tree")
    found: dict[str, Case] = {}
    for entry in ENTRIES:
        patch = load_patch(SERIES / entry.name, entry.name, entry.strip)
        before = {path: overlay.read(path) for path in patch.paths}
        apply_patch(overlay, patch)
        found[entry.name] = (before, {path: overlay.read(path) for path in patch.paths})
    return found


@pytest.mark.network
@pytest.mark.parametrize("name", NAMES)
def test_the_intent_reproduces_its_patch_on_0_5_9(name: str, cases: dict[str, Case]) -> None:
    before, after = cases[name]
    intent = load_intents(SERIES / "intents.toml")[name]
    result = reapply(intent, before.get, sorted(before))
    assert result.status == "resolved", result.detail
    assert result.changes == after
