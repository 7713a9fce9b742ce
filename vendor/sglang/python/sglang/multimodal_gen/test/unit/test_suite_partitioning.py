"""Shard assignment invariants for the diffusion suites.

Lanes that hardcode ``--total-partitions`` (AMD) must still schedule the whole
suite when standalone files outnumber the shards, and the shards must agree on
who runs what without talking to each other.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang.multimodal_gen.test.partitioning import PartitionItem, assign_partition
from sglang.multimodal_gen.test.runner import diffusion_suite_runner as run_suite
from sglang.multimodal_gen.test.runner.diffusion_suite_runner import (
    PartitionAssignment,
    build_local_partition_assignment,
)
from sglang.multimodal_gen.test.server.gpu_cases import (
    PARAMETRIZED_CASE_GROUPS,
    STANDALONE_FILES,
    TWO_GPU_CASES,
)

_H100_BASELINE_PATH = (
    Path(__file__).resolve().parents[1] / "server/perf_baselines/h100.json"
)


def _items(*est_times: float) -> list[PartitionItem]:
    return [
        PartitionItem(kind="case", item_id=f"case-{idx}", est_time=est_time)
        for idx, est_time in enumerate(est_times)
    ]


def _expected_work(suite: str) -> tuple[list[str], list[str]]:
    case_ids = [
        case.id
        for _, case_group in PARAMETRIZED_CASE_GROUPS[suite]
        for case in case_group
    ]
    return case_ids, list(STANDALONE_FILES.get(suite, []))


def test_assign_partition_covers_every_item_once():
    items = _items(300.0, 120.0, 600.0, 60.0, 180.0)
    assigned = [
        item.item_id for rank in range(3) for item in assign_partition(items, rank, 3)
    ]
    assert sorted(assigned) == sorted(item.item_id for item in items)


def test_assign_partition_is_empty_outside_the_shard_range():
    items = _items(300.0, 120.0)
    assert assign_partition(items, 5, 3) == []
    assert assign_partition(items, -1, 3) == []
    assert assign_partition(items, 0, 0) == []


@pytest.mark.parametrize("suite", sorted(PARAMETRIZED_CASE_GROUPS))
@pytest.mark.parametrize("total_partitions", [1, 2, 3, 4, 8])
def test_suite_is_fully_scheduled_for_any_shard_count(suite, total_partitions):
    expected_case_ids, expected_standalone_files = _expected_work(suite)

    scheduled_case_ids: list[str] = []
    scheduled_standalone_files: list[str] = []
    for partition_id in range(total_partitions):
        assignment = build_local_partition_assignment(
            suite=suite,
            partition_id=partition_id,
            total_partitions=total_partitions,
        )
        scheduled_case_ids.extend(assignment.case_ids)
        scheduled_standalone_files.extend(assignment.standalone_files)

    # More standalone files than shards used to abort the run; they now share
    # shards with the parametrized cases instead.
    assert sorted(scheduled_case_ids) == sorted(expected_case_ids)
    assert sorted(scheduled_standalone_files) == sorted(expected_standalone_files)


@pytest.mark.parametrize("total_partitions", [1, 4, 8])
def test_file_suite_runs_each_file_once(monkeypatch, tmp_path, total_partitions):
    files = [f"test_{i}.py" for i in range(5)]
    for filename in files:
        (tmp_path / filename).touch()
    monkeypatch.setitem(run_suite.FILE_SUITES, "unit", files)
    executed = []

    def run_files(assigned, filter_expr, junit_xml_path):
        assert assigned
        assert filter_expr == "not ltx2_vae_channels_last"
        executed.extend(assigned)
        return 1, [], {}

    monkeypatch.setattr(run_suite, "run_pytest", run_files)
    for partition_id in range(total_partitions):
        args = SimpleNamespace(
            suite="unit",
            partition_id=partition_id,
            total_partitions=total_partitions,
            filter="not ltx2_vae_channels_last",
        )
        result = run_suite._run_file_suite(args, tmp_path)
        assert result == (1 if partition_id < len(files) else 0)

    assert sorted(executed) == sorted(str(tmp_path / filename) for filename in files)


def test_failing_cases_do_not_skip_the_shards_standalone_files(monkeypatch, tmp_path):
    """Standalone files used to own a shard, so cases could not block them."""
    standalone_rel = "../single_test_file/test_disagg_server.py"
    executed_standalone = []

    def fake_run_standalone_file(suite, rel, target_dir, extra_filter=None):
        executed_standalone.append(rel)
        key = f"standalone:{rel}"
        return 0, [key], {key: "pass"}, {"used_fallback_estimate": False}

    monkeypatch.setattr(
        run_suite, "run_pytest", lambda *a, **k: (1, ["a_case"], {"a_case": "fail"})
    )
    monkeypatch.setattr(run_suite, "_run_standalone_file", fake_run_standalone_file)
    monkeypatch.setattr(
        run_suite, "_get_parametrized_files_for_case_ids", lambda *a, **k: ["a_file.py"]
    )
    monkeypatch.setattr(run_suite, "write_execution_report", lambda **kwargs: "")

    args = SimpleNamespace(
        suite="2-gpu",
        partition_id=0,
        total_partitions=2,
        filter=None,
        continue_on_error=False,
    )
    exit_code = run_suite._run_partition_assignment(
        args,
        tmp_path,
        PartitionAssignment(case_ids=["a_case"], standalone_files=[standalone_rel]),
    )

    assert executed_standalone == [standalone_rel]
    assert exit_code == 1


def test_two_gpu_cases_have_h100_full_test_time_estimates():
    """Every 2-gpu case must have an h100 estimated_full_test_time_s.

    NVIDIA LPT sharding falls back to 300s when the field is missing, which
    unbalances the three 2-gpu partitions.
    """
    scenarios = json.loads(_H100_BASELINE_PATH.read_text())["scenarios"]
    missing = [
        case.id
        for case in TWO_GPU_CASES
        if scenarios.get(case.id, {}).get("estimated_full_test_time_s") is None
    ]
    assert missing == []


def test_qwen_quality_variants_use_the_same_generation_request():
    cases = {case.id: case for case in TWO_GPU_CASES}
    lossless = cases["qwen_image_t2i_2_gpus"].sampling_params
    extra_high = cases["qwen_image_t2i_2_gpus_extra_high"].sampling_params

    assert extra_high.prompt == lossless.prompt
    assert extra_high.output_size == lossless.output_size
    assert extra_high.extras == {"quality": "extra-high"}

    scenarios = json.loads(_H100_BASELINE_PATH.read_text())["scenarios"]
    for case_id in ("qwen_image_t2i_2_gpus", "qwen_image_t2i_2_gpus_extra_high"):
        assert cases[case_id].run_perf_check
        assert scenarios[case_id]["expected_e2e_ms"] > 0
