import gc
import json
from types import SimpleNamespace
from unittest.mock import Mock, patch

import pytest
import torch

import sglang.multimodal_gen.runtime.managers.gpu_worker as gpu_worker_module
import sglang.multimodal_gen.runtime.managers.memory_managers.component_manager as component_manager_module
import sglang.multimodal_gen.runtime.utils.perf_logger as perf_logger_module
from sglang.multimodal_gen.runtime.disaggregation.orchestrator import (
    _deserialize_request_metrics,
)
from sglang.multimodal_gen.runtime.managers.gpu_worker import GPUWorker
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch
from sglang.multimodal_gen.runtime.pipelines_core.stages.base import PipelineStage
from sglang.multimodal_gen.runtime.pipelines_core.stages.denoising import DenoisingStage
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.denoising_av import (
    LTX2RefinementStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3.stages.denoising import (
    MiniMaxH3DenoisingStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.text_encoding import (
    TextEncodingStage,
)
from sglang.multimodal_gen.runtime.platforms import current_platform
from sglang.multimodal_gen.runtime.utils.perf_logger import (
    MemorySnapshot,
    PerformanceLogger,
    RequestMetrics,
    RequestPerfRecord,
)
from sglang.multimodal_gen.test.server.conftest import _write_results_json
from sglang.multimodal_gen.test.server.test_server_utils import PerformanceValidator
from sglang.multimodal_gen.test.server.testcase_configs import (
    BaselineConfig,
    PerformanceSummary,
    ScenarioConfig,
    ToleranceConfig,
)
from sglang.multimodal_gen.test.test_utils import read_perf_logs


@pytest.fixture(autouse=True)
def _isolate_global_component_residency_manager(monkeypatch):
    # Worker paths exercised here create the process-global residency manager
    # for their fake pipeline; leaving it behind hands its modules to later
    # tests (the worker prefers the global manager's placement modules).
    monkeypatch.setattr(
        component_manager_module, "_GLOBAL_COMPONENT_RESIDENCY_MANAGER", None
    )


def _perf_record(memory_snapshots: dict[str, dict]) -> RequestPerfRecord:
    return RequestPerfRecord(
        request_id="request",
        commit_hash="commit",
        tag="test",
        stages=[],
        steps=[],
        total_duration_ms=1.0,
        memory_snapshots=memory_snapshots,
    )


@pytest.mark.parametrize("replica_size", [1, 2])
@pytest.mark.parametrize("propagate", [False, True])
def test_forward_oom_cannot_reuse_a_multi_rank_replica(
    replica_size, propagate, monkeypatch
):
    worker = GPUWorker.__new__(GPUWorker)
    worker.is_output_rank = True
    worker._realtime_sessions = SimpleNamespace(attach=Mock())
    worker._release_warmup_pool = Mock()
    worker._record_output_peak_memory = Mock()
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(
        gpu_worker_module,
        "get_replica_group",
        lambda: SimpleNamespace(world_size=replica_size),
    )
    req = SimpleNamespace(is_warmup=False, extra={})
    oom = torch.OutOfMemoryError("allocator OOM")

    def fail_forward():
        assert not gc.isenabled()
        raise oom

    def run():
        return worker._execute_forward_common(
            req,
            forward_fn=fail_forward,
            log_reqs=[],
            return_req=False,
            save_output_paths=Mock(),
            error_context="test",
            propagate_forward_errors=propagate,
        )

    gc_enabled = gc.isenabled()
    if replica_size > 1:
        # Must escape the scheduler's request-level `except Exception` handlers.
        with pytest.raises(SystemExit, match="restart"):
            run()
        worker._record_output_peak_memory.assert_not_called()
    elif propagate:
        with pytest.raises(torch.OutOfMemoryError):
            run()
    else:
        assert "allocator OOM" in run().error
    assert gc.isenabled() == gc_enabled


@pytest.mark.parametrize("is_output_rank", [False, True])
@pytest.mark.parametrize("is_warmup", [False, True])
def test_worker_perf_dump_has_one_writer_per_replica(
    is_output_rank, is_warmup, monkeypatch, tmp_path
):
    worker = GPUWorker.__new__(GPUWorker)
    worker.is_output_rank = is_output_rank
    worker.server_args = SimpleNamespace(model_path="test-model")
    worker._realtime_sessions = SimpleNamespace(attach=Mock())
    worker._release_warmup_pool = Mock()
    worker._materialize_output_transport = Mock()
    worker._record_output_peak_memory = Mock()
    worker._record_replica_peak_memory = Mock()
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(perf_logger_module, "get_git_commit_hash", lambda: "test")
    monkeypatch.setattr(PerformanceLogger, "log_request_summary", Mock())

    path = tmp_path / "perf.json"
    path.write_text('{"writer": "output-rank"}')
    metrics = RequestMetrics("request")
    output = OutputBatch(metrics=metrics)
    req = SimpleNamespace(
        request_id="request",
        is_warmup=is_warmup,
        extra={},
        suppress_logs=True,
        perf_dump_path=str(path),
    )
    result = worker._execute_forward_common(
        req,
        forward_fn=lambda: output,
        log_reqs=[],
        return_req=False,
        save_output_paths=Mock(),
        error_context="test",
    )

    assert result is output
    assert result.error is None
    report = json.loads(path.read_text())
    if is_output_rank and not is_warmup:
        assert report["request_id"] == "request"
        assert report["tag"] == "server_perf_dump"
        assert report["meta"] == {"model": "test-model"}
    else:
        assert report == {"writer": "output-rank"}
    # non-output ranks must still participate in the replica's memory reduction
    if is_warmup:
        worker._record_replica_peak_memory.assert_not_called()
    else:
        worker._record_replica_peak_memory.assert_called_once_with([metrics])


@pytest.mark.parametrize("roundtrip", [False, True])
@pytest.mark.parametrize(
    "stage_class,profile_name,is_denoising",
    [
        (DenoisingStage, "DenoisingStage", True),
        (MiniMaxH3DenoisingStage, "MiniMaxH3DenoisingStage", True),
        (LTX2RefinementStage, "LTX2RefinementStage", True),
        (LTX2RefinementStage, "custom_refinement", True),
        (DenoisingStage, "BeforeDenoisingStage", True),
        (TextEncodingStage, "BeforeDenoisingStage", False),
        (TextEncodingStage, "TextEncodingStage", False),
    ],
)
def test_stage_role_reaches_performance_guard(
    stage_class, profile_name, is_denoising, roundtrip, monkeypatch, tmp_path
):
    # skip model construction and kernels, retaining the real stage role,
    # call boundary, profiler, log writer/reader and threshold validator
    stage = stage_class.__new__(stage_class)
    stage.server_args = SimpleNamespace(
        enable_layerwise_nvtx_marker=False, comfyui_mode=False
    )
    stage.set_profile_stage_name(profile_name)
    monkeypatch.setattr(stage, "forward", lambda batch, args: batch)
    monkeypatch.setattr(
        stage, "verify_input", PipelineStage.verify_input.__get__(stage)
    )
    monkeypatch.setattr(
        stage, "verify_output", PipelineStage.verify_output.__get__(stage)
    )
    monkeypatch.setattr(current_platform, "get_available_gpu_memory", lambda **_: 100)
    monkeypatch.setattr(current_platform, "is_hip", lambda: False)
    monkeypatch.setenv("SGLANG_PERF_LOG_DIR", str(tmp_path))
    monkeypatch.setattr(perf_logger_module, "get_is_main_process", lambda: True)
    monkeypatch.setattr(perf_logger_module, "get_git_commit_hash", lambda: "test")
    metrics = RequestMetrics("stage-role")
    batch = SimpleNamespace(is_warmup=False, metrics=metrics, perf_dump_path="metrics")
    with patch.object(perf_logger_module.time, "perf_counter", side_effect=[10, 11.5]):
        assert stage(batch, stage.server_args) is batch
    metrics.total_duration_ms = 1500
    if roundtrip:
        metrics = _deserialize_request_metrics(
            json.loads(json.dumps(metrics.to_dict()))
        )
    PerformanceLogger.log_request_summary(metrics)
    (record,) = read_perf_logs(tmp_path / "performance.log")
    assert record.stages == [
        {
            "name": profile_name,
            "execution_time_ms": 1500.0,
            "is_denoising": is_denoising,
        }
    ]
    validator = PerformanceValidator(
        ScenarioConfig({profile_name: 1000}, {}, 1500, 1, 1),
        ToleranceConfig(0.25, 0.25, 0.8, 0.3, 0.2),
        (),
    )
    summary = validator.collect_metrics(record)
    if is_denoising:
        with pytest.raises(AssertionError, match="Stage '"):
            validator._validate_stages(summary)
    else:
        validator._validate_stages(summary)


def test_performance_summary_separates_load_and_runtime_peaks():
    summary = PerformanceSummary.from_req_perf_record(
        _perf_record(
            {
                "after_forward": {"peak_reserved_mb": 1024.0},
                "load_peak": {"peak_reserved_mb": 4096.0, "peak_allocated_mb": 3900.0},
                "runtime_peak": {
                    "peak_reserved_mb": 3072.0,
                    "peak_allocated_mb": 2900.0,
                },
            }
        ),
        step_fractions=(),
    )

    assert summary.load_peak_vram_mb == 4096.0
    assert summary.runtime_peak_vram_mb == 3072.0
    assert summary.load_peak_allocated_mb == 3900.0
    assert summary.runtime_peak_allocated_mb == 2900.0


def test_worker_records_replica_load_and_runtime_peaks():
    worker = GPUWorker.__new__(GPUWorker)
    worker.local_rank = 0
    worker.is_output_rank = True
    worker._load_peak_reserved_mb = 4096.0
    worker._runtime_peak_reserved_mb = 0.0
    worker._warmup_peak_reserved_mb = 0.0
    worker._load_peak_allocated_mb = 3000.0
    worker._runtime_peak_allocated_mb = 0.0
    output = OutputBatch()
    metrics = RequestMetrics("request")
    replica_group = SimpleNamespace(world_size=2, cpu_group=object())
    reduced = []

    def all_reduce(tensor, op, group):
        # five host counters over the gloo group, never a device collective
        assert tensor.device.type == "cpu"
        assert op == torch.distributed.ReduceOp.MAX
        assert group is replica_group.cpu_group
        reduced.append(tensor.tolist())
        tensor.copy_(
            torch.tensor([5120.0, 3584.0, 6144.0, 3500.0, 2560.0], dtype=torch.float64)
        )

    snapshots = [
        MemorySnapshot(0.0, 0.0, 2048.0, 3072.0),
        MemorySnapshot(0.0, 0.0, 2048.0, 3072.0),
    ]

    with (
        patch.object(current_platform, "is_cpu", return_value=False),
        patch.object(current_platform, "is_cuda", return_value=True),
        patch.object(current_platform, "get_device", return_value=torch.device("cpu")),
        patch.object(
            gpu_worker_module, "capture_memory_snapshot", side_effect=snapshots
        ),
        patch.object(
            gpu_worker_module, "get_replica_group", return_value=replica_group
        ),
        patch.object(
            gpu_worker_module.torch.distributed, "all_reduce", side_effect=all_reduce
        ),
    ):
        worker._record_output_peak_memory(output)
        worker._record_replica_peak_memory([metrics])

    assert output.peak_memory_mb == 3072.0
    assert worker._load_peak_reserved_mb == 4096.0
    assert worker._runtime_peak_reserved_mb == 3072.0
    assert worker._runtime_peak_allocated_mb == 2048.0
    assert metrics.memory_snapshots["load_peak"].peak_reserved_mb == 5120.0
    assert metrics.memory_snapshots["runtime_peak"].peak_reserved_mb == 3584.0
    assert metrics.memory_snapshots["load_peak"].peak_allocated_mb == 3500.0
    assert metrics.memory_snapshots["runtime_peak"].peak_allocated_mb == 2560.0
    assert metrics.memory_snapshots["warmup_peak"].peak_reserved_mb == 6144.0
    assert reduced == [[4096.0, 3072.0, 0.0, 3000.0, 2048.0]]


def test_server_warmup_preserves_peak_after_managed_stage_timeline():
    worker = GPUWorker.__new__(GPUWorker)
    worker._auto_residency_warmup_records = []
    residency_manager = Mock()
    residency_manager.take_warmup_phase_peaks.return_value = {
        "0:denoise:use:transformer": 8
    }
    device_module = Mock()
    device_module.max_memory_allocated.return_value = 9
    device_module.max_memory_reserved.return_value = 12
    with (
        patch.object(torch, "get_device_module", return_value=device_module),
        patch.object(
            gpu_worker_module,
            "peek_global_component_residency_manager",
            return_value=residency_manager,
        ),
    ):
        worker._record_server_warmup_memory(
            workload=(128, 96, 9),
            baseline_allocated_bytes=3,
            succeeded=True,
        )

    record = worker._auto_residency_warmup_records[0]
    assert record.peak_allocated_bytes == 9
    assert (record.width, record.height, record.num_frames) == (128, 96, 9)


def test_server_warmup_does_not_treat_allocator_cache_as_untracked_live_memory():
    worker = GPUWorker.__new__(GPUWorker)
    worker._auto_residency_warmup_records = []
    residency_manager = Mock()
    residency_manager.take_warmup_phase_peaks.return_value = {
        "0:denoise:use:transformer": 8
    }
    device_module = Mock()
    device_module.max_memory_allocated.return_value = 8
    device_module.max_memory_reserved.return_value = 12
    with (
        patch.object(torch, "get_device_module", return_value=device_module),
        patch.object(
            gpu_worker_module,
            "peek_global_component_residency_manager",
            return_value=residency_manager,
        ),
    ):
        worker._record_server_warmup_memory(
            workload=(64, 64, 1),
            baseline_allocated_bytes=3,
            succeeded=True,
        )

    record = worker._auto_residency_warmup_records[0]
    assert record.peak_allocated_bytes == 8


def test_baseline_config_loads_per_scenario_peak_vram(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(
        json.dumps(
            {
                "tolerances": {
                    "pr_test": {
                        "e2e": 0.25,
                        "denoise_stage": 0.25,
                        "non_denoise_stage": 0.8,
                        "denoise_step": 0.3,
                        "denoise_agg": 0.2,
                        "load_peak_vram": 0.01,
                        "runtime_peak_vram": 0.02,
                    }
                },
                "sampling": {"step_fractions": [0.0, 1.0]},
                "scenarios": {
                    "case": {
                        "stages_ms": {},
                        "denoise_step_ms": {},
                        "expected_e2e_ms": 1.0,
                        "expected_avg_denoise_ms": 1.0,
                        "expected_median_denoise_ms": 1.0,
                        "load_peak_vram_mb": 1234.5,
                        "runtime_peak_vram_mb": 2345.6,
                        "runtime_peak_allocated_mb": 2000.5,
                    }
                },
            }
        ),
        encoding="utf-8",
    )

    config = BaselineConfig.load(path)

    scenario = config.scenarios["case"]
    assert scenario.load_peak_vram_mb == 1234.5
    assert scenario.runtime_peak_vram_mb == 2345.6
    assert scenario.load_peak_allocated_mb is None
    assert scenario.runtime_peak_allocated_mb == 2000.5
    assert config.tolerances.load_peak_vram == 0.01
    assert config.tolerances.runtime_peak_vram == 0.02
    assert config.tolerances.load is None


def test_peak_vram_validation_uses_independent_tolerances():
    validator = PerformanceValidator(
        scenario=ScenarioConfig({}, {}, 0.0, 0.0, 0.0),
        tolerances=ToleranceConfig(
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            load_peak_vram=0.01,
            runtime_peak_vram=0.02,
        ),
        step_fractions=(),
    )
    load_regression = PerformanceSummary(
        0.0,
        0.0,
        0.0,
        {},
        [],
        {},
        {},
        load_peak_vram_mb=10_129.0,
        runtime_peak_vram_mb=10_000.0,
    )
    runtime_regression = PerformanceSummary(
        0.0,
        0.0,
        0.0,
        {},
        [],
        {},
        {},
        load_peak_vram_mb=10_000.0,
        runtime_peak_vram_mb=10_201.0,
    )

    with patch.object(current_platform, "is_hip", return_value=False):
        with pytest.raises(AssertionError, match="Load Peak VRAM"):
            validator.validate_peak_vram(load_regression, 10_000.0, 10_000.0)
        with pytest.raises(AssertionError, match="Runtime Peak VRAM"):
            validator.validate_peak_vram(runtime_regression, 10_000.0, 10_000.0)


def test_peak_vram_validation_enforces_allocated_when_baselined():
    validator = PerformanceValidator(
        scenario=ScenarioConfig({}, {}, 0.0, 0.0, 0.0),
        tolerances=ToleranceConfig(
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            load_peak_vram=0.01,
            runtime_peak_vram=0.02,
        ),
        step_fractions=(),
    )
    # reserved drifts with allocator pool history: +5% is not a regression
    # once the allocated peak is baselined and unchanged
    reserved_drift = PerformanceSummary(
        0.0,
        0.0,
        0.0,
        {},
        [],
        {},
        {},
        load_peak_vram_mb=10_000.0,
        runtime_peak_vram_mb=10_500.0,
        load_peak_allocated_mb=8_000.0,
        runtime_peak_allocated_mb=8_000.0,
    )
    allocated_regression = PerformanceSummary(
        0.0,
        0.0,
        0.0,
        {},
        [],
        {},
        {},
        load_peak_vram_mb=10_000.0,
        runtime_peak_vram_mb=10_000.0,
        load_peak_allocated_mb=8_000.0,
        runtime_peak_allocated_mb=8_300.0,
    )

    with patch.object(current_platform, "is_hip", return_value=False):
        validator.validate_peak_vram(
            reserved_drift,
            10_000.0,
            10_000.0,
            expected_runtime_peak_allocated_mb=8_000.0,
        )
        with pytest.raises(AssertionError, match=r"Runtime Peak VRAM \(allocated\)"):
            validator.validate_peak_vram(
                allocated_regression,
                10_000.0,
                10_000.0,
                expected_runtime_peak_allocated_mb=8_000.0,
            )
        # without an allocated baseline the reserved figure is still enforced
        with pytest.raises(AssertionError, match="Runtime Peak VRAM"):
            validator.validate_peak_vram(reserved_drift, 10_000.0, 10_000.0)

        reserved_drift.warmup_peak_vram_mb = 12_000.0
        with pytest.raises(AssertionError, match="Warmup Peak VRAM"):
            validator.validate_peak_vram(
                reserved_drift,
                10_000.0,
                10_000.0,
                expected_warmup_peak_vram_mb=10_000.0,
                expected_runtime_peak_allocated_mb=8_000.0,
            )


@pytest.mark.parametrize(
    ("load_peak_vram_mb", "runtime_peak_vram_mb", "message"),
    [
        (0.0, 10_000.0, "Load peak VRAM metric missing"),
        (10_000.0, 0.0, "Runtime peak VRAM metric missing"),
    ],
)
def test_peak_vram_validation_rejects_missing_metrics(
    load_peak_vram_mb, runtime_peak_vram_mb, message
):
    validator = PerformanceValidator(
        scenario=ScenarioConfig({}, {}, 0.0, 0.0, 0.0),
        tolerances=ToleranceConfig(0.0, 0.0, 0.0, 0.0, 0.0),
        step_fractions=(),
    )
    summary = PerformanceSummary(
        0.0,
        0.0,
        0.0,
        {},
        [],
        {},
        {},
        load_peak_vram_mb=load_peak_vram_mb,
        runtime_peak_vram_mb=runtime_peak_vram_mb,
    )

    with pytest.raises(AssertionError, match=message):
        validator.validate_peak_vram(summary, 10_000.0, 10_000.0)


def test_results_json_merges_retry_sessions(tmp_path):
    path = tmp_path / "diffusion-results.json"
    _write_results_json(
        [
            {
                "class_name": "Suite",
                "test_name": "first",
                "load_peak_vram_mb": 1.0,
                "runtime_peak_vram_mb": 2.0,
            }
        ],
        str(path),
    )
    _write_results_json(
        [
            {
                "class_name": "Suite",
                "test_name": "second",
                "load_peak_vram_mb": 3.0,
                "runtime_peak_vram_mb": 4.0,
            }
        ],
        str(path),
    )

    results = json.loads(path.read_text(encoding="utf-8"))
    assert {item["test_name"] for item in results} == {"first", "second"}


def test_warmup_peak_stays_out_of_the_runtime_peak():
    from unittest import mock

    worker = gpu_worker_module.GPUWorker.__new__(gpu_worker_module.GPUWorker)
    worker._runtime_peak_reserved_mb = 0.0
    worker._runtime_peak_allocated_mb = 0.0
    worker._warmup_peak_reserved_mb = 0.0
    worker.is_output_rank = False
    with (
        mock.patch.object(
            gpu_worker_module.current_platform, "is_cpu", return_value=False
        ),
        mock.patch.object(
            gpu_worker_module,
            "capture_memory_snapshot",
            side_effect=[
                MemorySnapshot(0.0, 0.0, 35000.0, 40000.0),
                MemorySnapshot(0.0, 0.0, 15000.0, 20000.0),
            ],
        ),
    ):
        worker._record_output_peak_memory(SimpleNamespace(), is_warmup=True)
        worker._record_output_peak_memory(SimpleNamespace(), is_warmup=False)
    assert worker._warmup_peak_reserved_mb == 40000.0
    assert worker._runtime_peak_reserved_mb == 20000.0
    assert worker._runtime_peak_allocated_mb == 15000.0


def _warmup_req(*, probe: bool = False) -> SimpleNamespace:
    extra = {"auto_residency_full_shape_probe": True} if probe else {}
    return SimpleNamespace(is_warmup=True, extra=extra)


def test_worker_releases_the_probe_pool_before_the_next_request(monkeypatch):
    import sglang.multimodal_gen.runtime.distributed.device_communicators.ipc_a2a as ipc_a2a_module

    calls = []
    fake_device = SimpleNamespace(empty_cache=lambda: calls.append("empty_cache"))
    monkeypatch.setattr(
        gpu_worker_module.torch, "get_device_module", lambda: fake_device
    )
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_mps", lambda self: False)
    monkeypatch.setattr(
        ipc_a2a_module.IPC_A2A, "drop_staging", lambda: calls.append("drop_staging")
    )
    worker = GPUWorker.__new__(GPUWorker)
    worker._release_warmup_pool_before_serving = False

    worker._release_warmup_pool(_warmup_req())
    worker._release_warmup_pool(_warmup_req(probe=True))
    assert calls == []

    # the bounded re-warm after the probe regrows the pool from empty, and the
    # IPC staging buffers sized for the probe's messages go with it
    worker._release_warmup_pool(_warmup_req())
    assert calls == ["drop_staging", "empty_cache"]

    worker._release_warmup_pool(SimpleNamespace(is_warmup=False, extra={}))
    assert calls == ["drop_staging", "empty_cache"]


def test_worker_keeps_the_pool_when_no_probe_ran(monkeypatch):
    calls = []
    fake_device = SimpleNamespace(empty_cache=lambda: calls.append("empty_cache"))
    monkeypatch.setattr(
        gpu_worker_module.torch, "get_device_module", lambda: fake_device
    )
    worker = GPUWorker.__new__(GPUWorker)
    worker._release_warmup_pool_before_serving = False

    worker._release_warmup_pool(_warmup_req())
    worker._release_warmup_pool(SimpleNamespace(is_warmup=False, extra={}))
    assert calls == []


def _timing_validator(timing_tolerance: float | None) -> PerformanceValidator:
    return PerformanceValidator(
        scenario=ScenarioConfig(
            stages_ms={"DenoisingStage": 1000.0},
            denoise_step_ms={1: 100.0},
            expected_e2e_ms=1000.0,
            expected_avg_denoise_ms=100.0,
            expected_median_denoise_ms=100.0,
            timing_tolerance=timing_tolerance,
        ),
        tolerances=ToleranceConfig(0.25, 0.25, 0.25, 0.3, 0.2),
        step_fractions=(),
    )


def _validate_scaled(validator: PerformanceValidator, scale: float) -> None:
    summary = PerformanceSummary(
        1000.0 * scale,
        100.0 * scale,
        100.0 * scale,
        {"DenoisingStage": 1000.0 * scale},
        [],
        {1: 100.0 * scale},
        {1: 100.0 * scale},
    )
    validator.collect_metrics = lambda _record: summary
    validator.validate(None)


def test_timing_tolerance_override_widens_wall_clock_checks_only():
    with patch.object(current_platform, "is_hip", return_value=False):
        # 1.7x the baseline fails at the profile's 25% e2e tolerance
        with pytest.raises(AssertionError, match="E2E Latency"):
            _validate_scaled(_timing_validator(None), 1.7)

        # the same run passes for a case that declares a 90% timing tolerance
        _validate_scaled(_timing_validator(0.9), 1.7)

        # the override is a ceiling, not a blank cheque
        with pytest.raises(AssertionError, match="E2E Latency"):
            _validate_scaled(_timing_validator(0.9), 2.5)


def test_timing_tolerance_override_leaves_memory_guards_alone():
    validator = _timing_validator(0.9)
    regression = PerformanceSummary(
        0.0,
        0.0,
        0.0,
        {},
        [],
        {},
        {},
        load_peak_vram_mb=10_000.0,
        runtime_peak_vram_mb=10_201.0,
    )

    with patch.object(current_platform, "is_hip", return_value=False):
        with pytest.raises(AssertionError, match="Runtime Peak VRAM"):
            validator.validate_peak_vram(regression, 10_000.0, 10_000.0)


def test_request_metrics_compare_by_identity():
    """Distinct RequestMetrics instances must not compare equal."""
    assert perf_logger_module.RequestMetrics("a") != perf_logger_module.RequestMetrics(
        "b"
    )


def test_log_request_summary_records_requested_tag(monkeypatch, tmp_path):
    """log_request_summary must record the tag it is given."""
    monkeypatch.setattr(perf_logger_module, "get_git_commit_hash", lambda: "test")
    monkeypatch.setattr(perf_logger_module, "get_is_main_process", lambda: True)
    monkeypatch.setattr(
        perf_logger_module, "get_diffusion_perf_log_dir", lambda: str(tmp_path)
    )

    perf_logger_module.PerformanceLogger.log_request_summary(
        perf_logger_module.RequestMetrics("r1"), tag="custom_tag"
    )

    assert "custom_tag" in (tmp_path / "performance.log").read_text()
