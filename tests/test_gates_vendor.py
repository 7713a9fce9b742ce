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
from sm120fork.gates.policy import unmatched_added
from sm120fork.patches.stack import apply_stack, load_stack
from sm120fork.paths import RepoPaths
from test_gates_support import answers

REPO = Path(__file__).resolve().parents[1]
VENDOR = REPO / "vendor" / "sglang"
POLICY = REPO / "patches" / "gates.toml"

pytestmark = pytest.mark.skipif(not VENDOR.is_dir(), reason="vendor/sglang not imported")


def _vendored_version() -> str | None:
    import tomllib

    lock = REPO / "vendor" / "sglang.lock"
    return tomllib.loads(lock.read_text()).get("version") if lock.is_file() else None


PINNED = "0.5.23"  # the release whose line numbers the tests below name


@pytest.fixture
def pinned() -> None:
    """Fail, never skip, when a rebase moved vendor/sglang: the lines must be re-pinned."""
    version = _vendored_version()
    assert version == PINNED, f"vendor/sglang is {version}: re-pin these gate lines from {PINNED}"


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


@pytest.mark.usefixtures("pinned")
def test_the_patched_gates(inventory: Inventory) -> None:
    """Where the series changes what SM12x gets, as the scanner evaluates pristine 0.5.23."""
    glm = gate_at(inventory, "arg_groups/model_overrides/glm4_moe.py", 19)
    # SM12x stays off the SM100 block: the generic NVFP4 pass answers it (no per-model patch).
    assert (answers(glm), glm.decision) == ("FFFTTFF", "excluded")
    nvfp4_auto = gate_at(inventory, "layers/quantization/modelopt_quant.py", 3118)
    assert (answers(nvfp4_auto), nvfp4_auto.patch) == (
        "TTTFFFF",
        "sm120-nvfp4-moe-auto-fit.patch",
    )
    mla = gate_at(inventory, "arg_groups/overrides.py", 1210)
    assert answers(mla) == "TTTFFFF"  # the refusal SM12x passes
    assert (mla.wrongly_included_token, mla.patch) == ("trtllm", "sm120-trtllm-mla-guard.patch")
    dsa = gate_at(inventory, "arg_groups/overrides.py", 716)
    assert (answers(dsa), dsa.wrongly_included_token) == ("FFFTTTT", "trtllm")
    assert dsa.patch == "sm120-nsa-guard.patch"
    fp4 = gate_at(inventory, "layers/quantization/fp4_utils.py", 157)
    # SM12x falls through to upstream's flashinfer_cutlass (sm120-fp4-gemm-cudnn dropped, #13).
    assert (answers(fp4), fp4.patch, fp4.decision) == ("TTTFFFF", None, "excluded")
    tiles = gate_at(inventory, "kernels/ops/attention/prefill_attention.py", 180)
    assert (answers(tiles), tiles.patch) == ("FFTTTTT", "sm120-triton-attention-tiles.patch")
    olmo = gate_at(inventory, "arg_groups/model_overrides/olmo2.py", 27)
    assert (olmo.wrongly_included_token, olmo.decision) == ("fa3", "patched")
    # DeepGEMM on SM12x: upstream's own probe for the SM120 kernels decides (unknown here).
    deepgemm = gate_at(inventory, "layers/deep_gemm_wrapper/configurer.py", 44)
    assert answers(deepgemm) == "FFFFF??" and deepgemm.decision == "included"


@pytest.mark.usefixtures("pinned")
def test_gates_that_take_the_architecture_from_other_modules(inventory: Inventory) -> None:
    """A parameter every caller elsewhere passes the device's major; an attribute
    the class inheriting a mixin assigns (issue 13)."""
    plans = gate_at(inventory, "srt/lora/utils.py", 121)
    assert (plans.condition, answers(plans)) == ("major >= 10", "FFFTTTT")
    kpool = gate_at(inventory, "srt/layers/attention/dsa/dsa_backend_kpool.py", 74)
    assert (kpool.condition, answers(kpool)) == ("self.device_sm_major >= 10", "FFFTTTT")
    assert kpool.decision == "excluded"
    decode = gate_at(inventory, "srt/layers/attention/dsv4/v41_indexer/full_topk.py", 61)
    assert (answers(decode), decode.patch) == ("FFFTTTT", "sm120-v41-indexer-deep-gemm.patch")


def test_the_gates_the_series_adds_are_in_the_patched_tree() -> None:
    """`added` entries review gates upstream lacks; the patched sources must hold them."""
    policy = load_policy(POLICY)
    assert {rule.decision.patch for rule in policy.added} == {
        "sm120-pcie-ipc-allreduce-default.patch",
        "sm120-nsa-guard.patch",
        "sm120-trtllm-mha-checkpoint-fp8-kv.patch",
        "sm120-pdmux-guard.patch",
        "sm120-b12x-fp4-gemm.patch",
        "sm120-b12x-moe-runner.patch",
        "sm120-nvfp4-moe-situ-marlin.patch",
    }
    overlay = apply_stack(VENDOR, load_stack(RepoPaths(REPO)).patches)
    assert unmatched_added(policy, overlay.read) == []


@pytest.mark.usefixtures("pinned")
def test_no_flagged_gate_is_left_in_and_none_is_open(inventory: Inventory) -> None:
    """Every gate that lets SM12x into code it cannot run is patched, excluded or
    explained as a false positive, and no reviewed gate is left `open`."""
    left_in = [g.where for g in inventory.flagged if g.decision not in ("patched", "excluded")]
    assert left_in == []
    assert [g.where for g in inventory.gates if g.decision == "open"] == []


def test_command_exits_0_on_the_fork(tmp_path: Path) -> None:
    assert main(["-C", str(REPO), "gates", "--out", str(tmp_path)]) == EXIT_OK
    assert (tmp_path / "gates.json").is_file()


# -- against an earlier release from the package index -----------------------------


@pytest.fixture(scope="module")
def release_0_5_9(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("sglang-0.5.9")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["sglang==0.5.9", "-d", str(where), "-q"]
    subprocess.run(command, check=True)
    (wheel,) = where.glob("sglang-0.5.9-*.whl")
    root = where / "tree" / "python"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("sglang/")])
    return where / "tree"


@pytest.mark.usefixtures("pinned")
@pytest.mark.network
@pytest.mark.slow
def test_diff_from_0_5_9_finds_the_moves(inventory: Inventory, release_0_5_9: Path) -> None:
    earlier = scan_tree(release_0_5_9)
    assert earlier.problems == ()
    changes = diff_inventories(earlier, inventory)
    moved = {(c.old.file, c.old.line): (c.new.file, c.new.function) for c in changes.moved}
    assert moved[("python/sglang/srt/server_args.py", 1608)] == (
        "python/sglang/srt/arg_groups/model_overrides/glm4_moe.py",
        "_glm4_moe_overrides",
    )
    assert moved[("python/sglang/srt/layers/communicator.py", 95)] == (
        "python/sglang/srt/layers/layer_boundary/residual/add_norm.py",
        "flashinfer_ar_fusion_applies",
    )
