"""The real tree: vendor/sglang scans cleanly and the fork's policy reviews every gate."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sm120fork.cli import main
from sm120fork.errors import EXIT_OK
from sm120fork.gates import Inventory, diff_inventories, load_policy, review_tree, scan_tree
from test_gates_support import answers

REPO = Path(__file__).resolve().parents[1]
VENDOR = REPO / "vendor" / "sglang"
POLICY = REPO / "patches" / "gates.toml"

pytestmark = pytest.mark.skipif(not VENDOR.is_dir(), reason="vendor/sglang not imported")


def _vendored_version() -> str | None:
    import tomllib

    lock = REPO / "vendor" / "sglang.lock"
    return tomllib.loads(lock.read_text()).get("version") if lock.is_file() else None


# Line numbers and rows of sm120-gates.md are 0.5.9's; a rebase re-pins them.
only_0_5_9 = pytest.mark.skipif(_vendored_version() != "0.5.9", reason="rows are 0.5.9's")


@pytest.fixture(scope="module")
def inventory() -> Inventory:
    return review_tree(VENDOR, load_policy(POLICY))


def gate_at(inventory: Inventory, path: str, line: int):  # type: ignore[no-untyped-def]
    (gate,) = [g for g in inventory.gates if g.file.endswith(path) and g.line == line]
    return gate


def test_no_parse_failures_and_plenty_of_gates(inventory: Inventory) -> None:
    assert inventory.problems == ()
    assert inventory.files_total > 1000
    assert len(inventory.gates) > 150


def test_every_gate_is_reviewed_and_no_entry_is_stale(inventory: Inventory) -> None:
    assert [g.where for g in inventory.unreviewed] == []
    assert inventory.stale_policy == ()


@only_0_5_9
def test_the_gate_table_rows(inventory: Inventory) -> None:
    """sm120-gates.md rows, as the scanner evaluates them on pristine 0.5.9."""
    fusion = gate_at(inventory, "srt/layers/communicator.py", 95)
    assert fusion.archs["sm120"] is False and fusion.decision == "excluded"
    glm = gate_at(inventory, "srt/server_args.py", 1608)
    assert (answers(glm), glm.patch) == ("FFFTTFF", "sm120-glm4-moe-runner.patch")
    mla = gate_at(inventory, "srt/server_args.py", 1878)
    assert answers(mla) == "TTTFFFF"  # the refusal SM12x passes
    assert (mla.wrongly_included_token, mla.decision) == ("trtllm", "patched")
    nsa = gate_at(inventory, "srt/server_args.py", 1166)
    assert answers(nsa) == "FFFTTTT"  # `major >= 10` reached through a parameter
    deepgemm = gate_at(inventory, "srt/layers/deep_gemm_wrapper/configurer.py", 24)
    assert answers(deepgemm) == "FFF????" and deepgemm.decision == "patched"
    fp8 = gate_at(inventory, "srt/layers/quantization/fp8_utils.py", 265)
    assert fp8.wrongly_included and fp8.patch == "sm120-fp8-gemm-triton.patch"


@only_0_5_9
def test_flagged_gates_left_in_are_the_known_open_ones(inventory: Inventory) -> None:
    left_in = {
        (g.file.removeprefix("python/sglang/"), g.line)
        for g in inventory.flagged
        if g.decision not in ("patched", "excluded")
    }
    # Both gates flagged in 0.5.9 are patched now: server_args.py:1509 (Olmo2 -> fa3) by
    # sm120-olmo2-attention-triton.patch, fp8_utils.py:203 (explicit flashinfer_trtllm)
    # by sm120-fp8-gemm-explicit-trtllm-guard.patch.
    assert left_in == set()


def test_command_exits_0_on_the_fork(tmp_path: Path) -> None:
    assert main(["-C", str(REPO), "gates", "--out", str(tmp_path)]) == EXIT_OK
    assert (tmp_path / "gates.json").is_file()


# -- against a later release from the package index ------------------------------


@pytest.fixture(scope="module")
def release_0_5_23(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("sglang-0.5.23")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["sglang==0.5.23", "--python-version", "3.11", "-d", str(where), "-q"]
    if subprocess.run(command, check=False).returncode != 0:
        pytest.skip("sglang 0.5.23 could not be downloaded")
    (wheel,) = where.glob("sglang-0.5.23-*.whl")
    root = where / "tree" / "python"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("sglang/")])
    return where / "tree"


@only_0_5_9
@pytest.mark.network
@pytest.mark.slow
def test_diff_to_0_5_23_finds_the_moves(inventory: Inventory, release_0_5_23: Path) -> None:
    later = scan_tree(release_0_5_23)
    assert later.problems == ()
    changes = diff_inventories(inventory, later)
    moved = {(c.old.file, c.old.line): (c.new.file, c.new.function) for c in changes.moved}
    assert moved[("python/sglang/srt/server_args.py", 1608)] == (
        "python/sglang/srt/arg_groups/model_overrides/glm4_moe.py",
        "_glm4_moe_overrides",
    )
    assert moved[("python/sglang/srt/layers/communicator.py", 95)] == (
        "python/sglang/srt/layers/layer_boundary/residual/add_norm.py",
        "flashinfer_ar_fusion_applies",
    )
