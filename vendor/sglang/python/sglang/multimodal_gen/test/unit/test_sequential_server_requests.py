import json
import os
from dataclasses import replace
from types import SimpleNamespace
from unittest.mock import Mock

import pytest

from sglang.multimodal_gen.runtime.utils.perf_logger import RequestPerfRecord
from sglang.multimodal_gen.test.server import conftest, test_server_common
from sglang.multimodal_gen.test.server.gpu_cases import TWO_GPU_CASES
from sglang.multimodal_gen.test.server.testcase_configs import (
    BaselineConfig,
    DiffusionSamplingParams,
    DiffusionServerArgs,
    DiffusionTestCase,
    ScenarioConfig,
    ToleranceConfig,
)

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("load_time_ms", [None, 0, float("nan"), 1000])
def test_load_guard_is_terminal_without_stage_checks(
    harness, monkeypatch, load_time_ms
):
    runner, case = harness
    case = replace(case, run_perf_check=False)
    monkeypatch.setattr(
        runner, "run_and_collect", Mock(return_value=(_perf_record(), b"output"))
    )
    with pytest.raises(test_server_common.PerformanceValidationError, match="Load"):
        runner.test_diffusion_generation(
            case, SimpleNamespace(load_time_ms=load_time_ms)
        )
    assert runner.run_and_collect.call_count == 1


@pytest.mark.parametrize("load_time_ms", [None, 0, float("nan")])
def test_baseline_generation_requires_loading_measurement(
    harness, monkeypatch, load_time_ms
):
    runner, case = harness
    monkeypatch.setenv("SGLANG_GEN_BASELINE", "1")
    monkeypatch.setattr(
        runner, "run_and_collect", Mock(return_value=(_perf_record(), b"output"))
    )
    with pytest.raises(test_server_common.PerformanceValidationError, match="Load"):
        runner.test_diffusion_generation(
            case, SimpleNamespace(load_time_ms=load_time_ms)
        )
    assert test_server_common._PENDING_BASELINE_DUMPS == {}


def test_request_warmup_is_separate_from_guarded_requests(harness, monkeypatch, capsys):
    runner, case = harness
    case = replace(case, perf_warmup_requests=1)
    cold = _perf_record()
    cold.total_duration_ms = 3000
    generate = Mock(
        side_effect=[
            (cold, b"output"),
            (_perf_record(), b"output"),
            (_perf_record(), b"output"),
        ]
    )
    monkeypatch.setattr(runner, "run_and_collect", generate)
    runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert generate.call_count == 3
    assert len(runner._perf_results) == 2
    assert runner._validate_consistency.call_count == 2
    assert "request warmup 1/1 e2e=3000.0000ms" in capsys.readouterr().out


@pytest.mark.parametrize("duration", [None, 0, float("nan"), float("inf")])
def test_request_warmup_requires_e2e(harness, monkeypatch, duration):
    runner, case = harness
    case = replace(case, perf_warmup_requests=1)
    record = _perf_record()
    if duration is None:
        record = None
    else:
        record.total_duration_ms = duration
    generate = Mock(return_value=(record, b"output"))
    monkeypatch.setattr(runner, "run_and_collect", generate)
    with pytest.raises(
        test_server_common.PerformanceValidationError, match="warmup.*E2E"
    ):
        runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert generate.call_count == 1


def test_request_after_warmup_still_enforces_e2e(harness, monkeypatch):
    runner, case = harness
    case = replace(case, perf_warmup_requests=1, run_perf_check=False)
    slow = _perf_record()
    slow.total_duration_ms = 3000
    generate = Mock(side_effect=[(_perf_record(), b"output"), (slow, b"output")])
    monkeypatch.setattr(runner, "run_and_collect", generate)
    with pytest.raises(test_server_common.PerformanceValidationError, match="E2E"):
        runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert generate.call_count == 2


def _perf_record():
    return RequestPerfRecord(
        request_id="request",
        commit_hash="test",
        tag="test",
        stages=[{"name": "DenoisingStage", "execution_time_ms": 10}],
        steps=[5, 5],
        total_duration_ms=100,
        memory_snapshots={
            "load_peak": {"peak_reserved_mb": 1000, "peak_allocated_mb": 800},
            "runtime_peak": {"peak_reserved_mb": 2000, "peak_allocated_mb": 1600},
        },
    )


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.setenv("SGLANG_GEN_GT", "0")
    monkeypatch.setenv("SGLANG_GEN_BASELINE", "0")
    monkeypatch.setenv("SGLANG_SKIP_CONSISTENCY", "0")
    monkeypatch.setattr(test_server_common.current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(test_server_common.current_platform, "is_hip", lambda: False)
    scenario = ScenarioConfig(
        stages_ms={"DenoisingStage": 10},
        denoise_step_ms={0: 5, 1: 5},
        expected_e2e_ms=100,
        expected_avg_denoise_ms=5,
        expected_median_denoise_ms=5,
        estimated_full_test_time_s=1,
        expected_load_ms=100,
        load_peak_vram_mb=1000,
        runtime_peak_vram_mb=2000,
    )
    monkeypatch.setattr(
        test_server_common,
        "BASELINE_CONFIG",
        BaselineConfig(
            scenarios={"first": scenario},
            step_fractions=[0, 1],
            tolerances=ToleranceConfig(0, 0, 0, 0, 0),
            improvement_threshold=0,
        ),
    )
    runner = test_server_common.DiffusionServerBase()
    runner._perf_results = []
    monkeypatch.setattr(test_server_common, "_PENDING_BASELINE_DUMPS", {})
    monkeypatch.setattr(test_server_common, "get_generate_fn", Mock())
    monkeypatch.setattr(runner, "_validate_consistency", Mock())
    monkeypatch.setattr(runner, "_validate_audio_consistency", Mock())
    monkeypatch.setattr(runner, "_dump_baseline_for_testcase", Mock())
    case = DiffusionTestCase(
        "first",
        DiffusionServerArgs(model_path="test", modality="image"),
        DiffusionSamplingParams(prompt="first"),
        perf_repeat_requests=2,
        run_models_api_check=False,
        run_t2v_input_reference_check=False,
    )
    return runner, case


@pytest.mark.parametrize("bad_request", [0, 1])
@pytest.mark.parametrize(
    "failure",
    [
        "performance",
        "load_peak",
        "runtime_peak",
        "missing_memory",
        "consistency",
        "generation",
    ],
)
def test_each_request_failure_fails_case(harness, monkeypatch, bad_request, failure):
    runner, case = harness
    records = [_perf_record(), _perf_record()]
    outputs = [(record, b"output") for record in records]
    if failure == "performance":
        records[bad_request].total_duration_ms = 10000
    elif failure in {"load_peak", "runtime_peak"}:
        records[bad_request].memory_snapshots[failure]["peak_reserved_mb"] = 10000
    elif failure == "missing_memory":
        records[bad_request].memory_snapshots.clear()
    elif failure == "consistency":
        checks = [None, None]
        checks[bad_request] = AssertionError("wrong pixels or audio")
        runner._validate_consistency.side_effect = checks
    else:
        outputs[bad_request] = RuntimeError("server request failed")
    generate = Mock(side_effect=outputs)
    monkeypatch.setattr(runner, "run_and_collect", generate)
    ctx = SimpleNamespace(load_time_ms=100)

    terminal = failure in {"performance", "load_peak", "runtime_peak", "missing_memory"}
    error_type = (
        test_server_common.PerformanceValidationError
        if terminal
        else pytest.fail.Exception
    )
    with pytest.raises(error_type, match=f"request {bad_request + 1}/2"):
        runner.test_diffusion_generation(case, ctx)

    expected_requests = bad_request + 1 if terminal else 2
    assert generate.call_count == expected_requests
    assert all(call.args[0] is ctx for call in generate.call_args_list)
    expected_consistency = (
        bad_request if terminal else (1 if failure == "generation" else 2)
    )
    assert runner._validate_consistency.call_count == expected_consistency
    # Even failed performance measurements must survive in the report.
    expected = [
        i + 1
        for i in range(expected_requests)
        if failure != "generation" or i != bad_request
    ]
    assert [r["request_index"] for r in runner._perf_results] == expected


def test_both_requests_pass(harness, monkeypatch):
    runner, case = harness
    monkeypatch.setattr(
        runner,
        "run_and_collect",
        Mock(side_effect=[(_perf_record(), b"first"), (_perf_record(), b"second")]),
    )
    runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert runner._validate_consistency.call_count == 2
    assert [call.args[1] for call in runner._validate_consistency.call_args_list] == [
        b"first",
        b"second",
    ]
    assert [r["request_index"] for r in runner._perf_results] == [1, 2]


@pytest.mark.parametrize("run_perf_check", [False, True])
@pytest.mark.parametrize("e2e_ms", [None, 0, -1, float("nan"), float("inf")])
def test_e2e_is_required_even_without_threshold_checks(
    harness, monkeypatch, run_perf_check, e2e_ms
):
    runner, case = harness
    case = replace(case, run_perf_check=run_perf_check)
    record = _perf_record()
    record.total_duration_ms = e2e_ms
    generate = Mock(return_value=(record, b"output"))
    monkeypatch.setattr(runner, "run_and_collect", generate)

    with pytest.raises(
        test_server_common.PerformanceValidationError,
        match="E2E duration missing or invalid",
    ):
        runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert generate.call_count == 1
    assert not runner._perf_results


def test_disabled_threshold_checks_still_record_e2e(harness, monkeypatch):
    runner, case = harness
    case = replace(case, run_perf_check=False)
    monkeypatch.setattr(
        runner, "run_and_collect", Mock(return_value=(_perf_record(), b"output"))
    )
    runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert [r["e2e_ms"] for r in runner._perf_results] == [100, 100]


def test_request_artifacts_do_not_overwrite_each_other(harness, monkeypatch, tmp_path):
    runner, case = harness
    monkeypatch.setenv("SGLANG_DIFFUSION_ARTIFACT_DIR", str(tmp_path))
    artifact_dirs = []

    def generate(*args, **kwargs):
        artifact_dirs.append(os.environ["SGLANG_DIFFUSION_ARTIFACT_DIR"])
        return _perf_record(), b"output"

    monkeypatch.setattr(runner, "run_and_collect", generate)
    runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert artifact_dirs == [str(tmp_path / f"request-{i}") for i in (1, 2)]
    assert os.environ["SGLANG_DIFFUSION_ARTIFACT_DIR"] == str(tmp_path)


def test_later_skip_cannot_hide_earlier_failure(harness, monkeypatch):
    runner, case = harness
    monkeypatch.setattr(
        runner,
        "run_and_collect",
        Mock(
            side_effect=[
                RuntimeError("failed first"),
                pytest.skip.Exception("skip second"),
            ]
        ),
    )
    with pytest.raises(pytest.fail.Exception, match="failed first"):
        runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))


def test_second_request_cannot_be_skipped_after_first_passes(harness, monkeypatch):
    runner, case = harness
    monkeypatch.setattr(
        runner,
        "run_and_collect",
        Mock(side_effect=[(_perf_record(), b"output"), pytest.skip.Exception("skip")]),
    )
    with pytest.raises(pytest.fail.Exception, match="Required request skipped"):
        runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))


def test_empty_content_is_not_a_consistency_pass(harness):
    runner, case = harness
    with pytest.raises(pytest.fail.Exception, match="Empty output"):
        test_server_common.DiffusionServerBase._validate_consistency(runner, case, b"")


@pytest.mark.parametrize("bad_request", [0, 1])
def test_audio_checked_even_when_video_consistency_fails(
    harness, monkeypatch, bad_request
):
    runner, case = harness
    case = replace(
        case,
        server_args=replace(case.server_args, modality="video"),
        sampling_params=replace(case.sampling_params, expect_audio_output=True),
    )
    runner._validate_consistency.side_effect = AssertionError("wrong pixels")
    audio_checks = [None, None]
    audio_checks[bad_request] = AssertionError("wrong audio")
    runner._validate_audio_consistency.side_effect = audio_checks
    monkeypatch.setattr(
        runner, "run_and_collect", Mock(return_value=(_perf_record(), b"output"))
    )
    with pytest.raises(pytest.fail.Exception, match="audio consistency.*wrong audio"):
        runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert runner._validate_consistency.call_count == 2
    assert runner._validate_audio_consistency.call_count == 2


@pytest.mark.parametrize("repeat", [0, -1])
def test_invalid_repeat_count(harness, repeat):
    _, case = harness
    with pytest.raises(ValueError, match="must be positive"):
        replace(case, perf_repeat_requests=repeat)


def test_report_keeps_both_requests_and_replaces_retry(tmp_path):
    path = tmp_path / "results.json"
    records = [
        {"class_name": "suite", "test_name": "case", "request_index": i, "e2e_ms": i}
        for i in (1, 2)
    ]
    conftest._write_results_json(records, str(path))
    conftest._write_results_json([{**records[0], "e2e_ms": 3}], str(path))
    assert json.loads(path.read_text()) == [{**records[0], "e2e_ms": 3}, records[1]]


def test_perf_fixture_retains_failed_case_results(pytester, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    pytester.makeconftest(
        'pytest_plugins = ["sglang.multimodal_gen.test.server.conftest"]'
    )
    pytester.makepyfile(
        """
        import pytest

        from sglang.multimodal_gen.test.server.test_server_common import DiffusionServerBase
        from sglang.multimodal_gen.test.server.testcase_configs import (
            DiffusionSamplingParams, DiffusionServerArgs, DiffusionTestCase, PerformanceSummary,
        )

        class TestRequests(DiffusionServerBase):
            @pytest.mark.parametrize("case_id", ["failed", "passed"])
            def test_diffusion_generation(self, case_id):
                assert self._perf_results == []
                case = DiffusionTestCase(
                    case_id,
                    DiffusionServerArgs("test", modality="image"),
                    DiffusionSamplingParams(prompt="test"),
                )
                summary = PerformanceSummary(100, 5, 5, {}, [], {}, {}, load_time_ms=100)
                for index in (1, 2):
                    self._record_performance_result(case, summary, index)
                if case_id == "failed":
                    pytest.fail("recorded failure")

        class TestOtherRequests(TestRequests):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(passed=2, failed=2)
    records = json.loads((pytester.path / "diffusion-results.json").read_text())
    assert len(records) == 8
    assert {(r["class_name"], r["test_name"], r["request_index"]) for r in records} == {
        (suite, case_id, index)
        for suite in ("TestRequests", "TestOtherRequests")
        for case_id in ("failed", "passed")
        for index in (1, 2)
    }


def test_gt_generation_runs_both_requests(harness, monkeypatch):
    runner, case = harness
    monkeypatch.setenv("SGLANG_GEN_GT", "1")
    generate = Mock(side_effect=[(None, b"first"), (None, b"second")])
    monkeypatch.setattr(runner, "run_and_collect", generate)
    save = Mock()
    monkeypatch.setattr(runner, "_save_gt_output", save)
    runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    assert [(call.args[0].id, call.args[1]) for call in save.call_args_list] == [
        ("first", b"first"),
        ("first", b"second"),
    ]
    assert all(not call.kwargs["collect_perf"] for call in generate.call_args_list)
    runner._validate_consistency.assert_not_called()


@pytest.mark.parametrize("mode", ["pass", "fail", "gen_gt"])
def test_lead_request_runs_first_against_its_own_golden(harness, monkeypatch, mode):
    runner, case = harness
    case = replace(
        case,
        lead_sampling_params=DiffusionSamplingParams(
            prompt="first", output_size="1360x768"
        ),
    )
    gen_gt = mode == "gen_gt"
    monkeypatch.setenv("SGLANG_GEN_GT", "1" if gen_gt else "0")
    record = None if gen_gt else _perf_record()
    generate = Mock(
        side_effect=[(None, b"lead"), (record, b"first"), (record, b"second")]
    )
    monkeypatch.setattr(runner, "run_and_collect", generate)
    save = Mock()
    monkeypatch.setattr(runner, "_save_gt_output", save)
    if mode == "fail":
        runner._validate_consistency.side_effect = [
            AssertionError("streaks"),
            None,
            None,
        ]
        with pytest.raises(pytest.fail.Exception, match="lead request.*streaks"):
            runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    else:
        runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))

    checked = save if gen_gt else runner._validate_consistency
    assert [call.args[0].id for call in checked.call_args_list] == [
        "first_lead",
        "first",
        "first",
    ]
    lead, content = checked.call_args_list[0].args
    assert content == b"lead"
    assert lead.sampling_params.output_size == "1360x768"
    assert lead.sampling_params.extras["quality"] == "exact"
    assert not generate.call_args_list[0].kwargs["collect_perf"]
    assert len(runner._perf_results) == (0 if gen_gt else 2)


def test_baseline_generation_keeps_worst_of_both_requests(harness, monkeypatch):
    runner, case = harness
    monkeypatch.setenv("SGLANG_GEN_BASELINE", "1")
    records = [_perf_record(), _perf_record()]
    records[0].total_duration_ms = 200
    records[0].memory_snapshots["load_peak"]["peak_allocated_mb"] = 900
    records[0].memory_snapshots["warmup_peak"] = {"peak_reserved_mb": 4000}
    records[1].memory_snapshots["warmup_peak"] = {"peak_reserved_mb": 2000}
    records[1].memory_snapshots["runtime_peak"]["peak_reserved_mb"] = 3000
    records[1].memory_snapshots["runtime_peak"]["peak_allocated_mb"] = 2500
    monkeypatch.setattr(
        runner, "run_and_collect", Mock(side_effect=[(r, b"output") for r in records])
    )
    runner.test_diffusion_generation(case, SimpleNamespace(load_time_ms=100))
    summaries = test_server_common._PENDING_BASELINE_DUMPS[case.id]
    assert len(summaries) == 2
    log = Mock()
    monkeypatch.setattr(test_server_common.logger, "error", log)
    test_server_common.DiffusionServerBase._dump_baseline_for_testcase(
        runner, case, summaries[-1], repeated_summaries=summaries
    )
    baseline = json.loads(log.call_args.args[0].split(f'"{case.id}": ', 1)[1])
    assert baseline["expected_e2e_ms"] == 200
    assert baseline["runtime_peak_vram_mb"] == 3000
    assert baseline["warmup_peak_vram_mb"] == 4000
    assert baseline["load_peak_allocated_mb"] == 900
    assert baseline["runtime_peak_allocated_mb"] == 2500


def test_h3_cases_check_two_short_requests_and_audio():
    cases = [case for case in TWO_GPU_CASES if case.id.startswith("minimax_h3_")]
    assert {case.sampling_params.extras["task"] for case in cases} == {"t2va", "ref2va"}
    for case in cases:
        assert case.perf_repeat_requests == 2
        assert case.run_perf_check and case.run_consistency_check
        assert case.sampling_params.expect_audio_output
        assert case.sampling_params.extras["num_inference_steps"] <= 8
        assert case.sampling_params.extras["target"]["duration_seconds"] == 4.0
