# SPDX-License-Identifier: Apache-2.0

import asyncio
import sys
from types import SimpleNamespace

import msgspec.msgpack
import numpy as np
import pytest

from sglang.multimodal_gen.runtime.realtime.video import RAW_RGB_CONTENT_TYPE
from sglang.multimodal_gen.runtime.utils.perf_logger import RequestPerfRecord
from sglang.multimodal_gen.test.server import test_server_common
from sglang.multimodal_gen.test.server.realtime_consistency import (
    build_realtime_event_payload,
    build_realtime_init_payload,
    collect_realtime_output,
    decode_realtime_raw_rgb_frames,
    parse_realtime_chunk_stats,
    pop_realtime_key_frames,
    prepare_realtime_first_frame,
    realtime_ws_url,
    record_realtime_key_frames,
    record_realtime_perf_stats,
    select_realtime_key_frames,
    summarize_realtime_perf_stats,
    validate_realtime_perf_stats,
)
from sglang.multimodal_gen.test.server.test_server_common import (
    DiffusionServerBase,
    PerformanceValidationError,
)
from sglang.multimodal_gen.test.server.test_server_utils import get_generate_fn
from sglang.multimodal_gen.test.server.testcase_configs import (
    DiffusionSamplingParams,
    DiffusionServerArgs,
    DiffusionTestCase,
    ScenarioConfig,
)

# Request construction


def test_realtime_ws_url_uses_existing_openai_base_url():
    client = SimpleNamespace(base_url="http://127.0.0.1:30000/v1")

    assert realtime_ws_url(client) == "ws://127.0.0.1:30000/v1/realtime_video/generate"


def test_realtime_init_payload_uses_sampling_params_and_extras():
    params = DiffusionSamplingParams(
        prompt="turn camera left",
        seconds=1,
        fps=8,
        num_frames=6,
        extras={"seed": 7, "num_inference_steps": 4},
        realtime_num_chunks=2,
    )

    payload = build_realtime_init_payload(
        model_path="robbyant/lingbot-world-fast-diffusers",
        sampling_params=params,
        output_size="832x480",
        first_frame="https://example.com/first.png",
    )

    assert payload == {
        "type": "init",
        "model": "robbyant/lingbot-world-fast-diffusers",
        "prompt": "turn camera left",
        "size": "832x480",
        "seconds": 1,
        "first_frame": "https://example.com/first.png",
        "fps": 8,
        "num_frames": 6,
        "seed": 7,
        "num_inference_steps": 4,
    }


def test_realtime_init_payload_can_request_preview_transport():
    params = DiffusionSamplingParams(
        prompt="preview transport",
        realtime_num_chunks=1,
        realtime_output_format="webp",
    )

    payload = build_realtime_init_payload(
        model_path="robbyant/lingbot-world-fast-diffusers",
        sampling_params=params,
        output_size="832x480",
        first_frame=None,
    )

    assert payload["realtime_output_format"] == "webp"


def test_realtime_first_frame_accepts_url_or_file(tmp_path):
    frame_path = tmp_path / "first.png"
    frame_path.write_bytes(b"png-bytes")

    assert prepare_realtime_first_frame("https://example.com/first.png") == (
        "https://example.com/first.png"
    )
    assert prepare_realtime_first_frame(frame_path) == b"png-bytes"


def test_realtime_key_frames_are_selected_from_raw_websocket_frames():
    frames = [np.full((2, 2, 3), idx, dtype=np.uint8) for idx in range(5)]

    selected = select_realtime_key_frames(frames)
    assert [int(frame[0, 0, 0]) for frame in selected] == [0, 2, 4]

    record_realtime_key_frames("unit-raw-frames", frames)
    frames[2][:] = 99
    popped = pop_realtime_key_frames("unit-raw-frames")

    assert popped is not None
    assert [int(frame[0, 0, 0]) for frame in popped] == [0, 2, 4]
    assert pop_realtime_key_frames("unit-raw-frames") is None


def test_realtime_event_payload_strips_test_schedule_metadata():
    payload = build_realtime_event_payload(
        {
            "after_chunk": 0,
            "kind": "camera_actions",
            "payload": [["w"], ["d"]],
        }
    )

    assert payload == {
        "type": "event",
        "kind": "camera_actions",
        "payload": [["w"], ["d"]],
    }


# Raw RGB frame decoding


def test_decode_realtime_raw_rgb_frames_splits_payload_by_header_metadata():
    first = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    second = (np.arange(12, dtype=np.uint8) + 20).reshape(2, 2, 3)
    header = {
        "type": "frame_batch_header",
        "content_type": RAW_RGB_CONTENT_TYPE,
        "num_frames": 2,
        "width": 2,
        "height": 2,
        "channels": 3,
        "bytes_per_frame": 12,
    }

    frames = decode_realtime_raw_rgb_frames(
        header,
        first.tobytes() + second.tobytes(),
    )

    assert len(frames) == 2
    np.testing.assert_array_equal(frames[0], first)
    np.testing.assert_array_equal(frames[1], second)


def test_decode_realtime_raw_rgb_frames_rejects_truncated_payload():
    header = {
        "type": "frame_batch_header",
        "content_type": RAW_RGB_CONTENT_TYPE,
        "num_frames": 1,
        "width": 2,
        "height": 2,
        "channels": 3,
        "bytes_per_frame": 12,
    }

    with pytest.raises(ValueError, match="payload size mismatch"):
        decode_realtime_raw_rgb_frames(header, b"too-short")


# Stream collection and realtime performance stats


class _FakeRealtimeWebSocket:
    def __init__(self, messages):
        self.messages = list(messages)
        self.sent = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb):
        return False

    async def send(self, payload):
        self.sent.append(msgspec.msgpack.decode(payload))

    async def recv(self):
        if not self.messages:
            raise AssertionError("fake websocket received too many recv calls")
        return self.messages.pop(0)


def _packed_realtime_frame_message(chunk_index: int, frame: np.ndarray):
    header = {
        "type": "frame_batch_header",
        "content_type": RAW_RGB_CONTENT_TYPE,
        "chunk_index": chunk_index,
        "is_final_frame_batch": True,
        "num_frames": 1,
        "width": frame.shape[1],
        "height": frame.shape[0],
        "channels": frame.shape[2],
        "bytes_per_frame": frame.nbytes,
    }
    return msgspec.msgpack.encode(header), frame.tobytes()


def _packed_realtime_combined_frame_message(chunk_index: int, frame: np.ndarray):
    header, payload = _packed_realtime_frame_message(chunk_index, frame)
    message = msgspec.msgpack.decode(header)
    message["type"] = "frame_batch"
    message["payload"] = payload
    return msgspec.msgpack.encode(message)


def _packed_realtime_chunk_stats(chunk_index: int, **overrides):
    payload = {
        "type": "chunk_stats",
        "request_id": f"req-{chunk_index}",
        "chunk_index": chunk_index,
        "content_type": RAW_RGB_CONTENT_TYPE,
        "num_frames": 1,
        "raw_bytes": 12,
        "ws_payload_bytes": 128,
        "request_prepare_ms": 1,
        "scheduler_forward_ms": 20,
        "raw_payload_build_ms": 2,
        "raw_write_ms": 3,
        "ws_write_ms": 4,
        "chunk_total_ms": 30,
    }
    payload.update(overrides)
    for key, value in list(payload.items()):
        if key.endswith("_ms"):
            payload[key] = max(0, int(value + 0.5))
    packed = msgspec.msgpack.encode(payload)
    assert bytes([0xCB]) not in packed
    return packed


def test_collect_realtime_output_skips_and_records_chunk_stats(monkeypatch):
    first = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    second = first + 1
    chunk0_header, chunk0_payload = _packed_realtime_frame_message(0, first)
    chunk1_header, chunk1_payload = _packed_realtime_frame_message(1, second)
    websocket = _FakeRealtimeWebSocket(
        [
            chunk0_header,
            chunk0_payload,
            _packed_realtime_chunk_stats(0, chunk_total_ms=31),
            chunk1_header,
            chunk1_payload,
            _packed_realtime_chunk_stats(1, chunk_total_ms=32),
        ]
    )
    monkeypatch.setitem(
        sys.modules,
        "websockets",
        SimpleNamespace(connect=lambda *args, **kwargs: websocket),
    )

    result = asyncio.run(
        collect_realtime_output(
            ws_url="ws://example.test/v1/realtime_video/generate",
            init_payload={"type": "init", "prompt": "test"},
            events=[
                {
                    "after_chunk": 0,
                    "kind": "camera_actions",
                    "payload": [["w"]],
                }
            ],
            num_chunks=2,
            require_chunk_stats=True,
        )
    )

    assert len(result.frames) == 2
    np.testing.assert_array_equal(result.frames[0], first)
    np.testing.assert_array_equal(result.frames[1], second)
    assert [stat.chunk_index for stat in result.chunk_stats] == [0, 1]
    assert [stat.chunk_total_ms for stat in result.chunk_stats] == [31.0, 32.0]
    assert result.e2e_ms > 0
    record_realtime_perf_stats("stream-e2e", result.chunk_stats, result.e2e_ms)
    case = DiffusionTestCase(
        "stream-e2e",
        DiffusionServerArgs(model_path="test", modality="video"),
        DiffusionSamplingParams(prompt="test"),
        run_perf_check=False,
    )
    runner = DiffusionServerBase()
    runner._perf_results = []
    monkeypatch.setenv("SGLANG_GEN_BASELINE", "0")
    monkeypatch.setitem(
        test_server_common.BASELINE_CONFIG.scenarios,
        case.id,
        ScenarioConfig({}, {}, 1000, 0, 0, expected_load_ms=100),
    )
    runner._validate_realtime_performance(
        SimpleNamespace(load_time_ms=100), case, result.chunk_stats
    )
    assert runner._perf_results[0]["e2e_ms"] == result.e2e_ms
    assert websocket.sent == [
        {"type": "init", "prompt": "test"},
        {
            "type": "event",
            "kind": "camera_actions",
            "payload": [["w"]],
        },
    ]


@pytest.mark.parametrize("e2e_ms", [None, 0, -1, float("nan"), float("inf")])
def test_realtime_requires_e2e_without_threshold_checks(e2e_ms):
    case = DiffusionTestCase(
        "missing-stream-e2e",
        DiffusionServerArgs(model_path="test", modality="video"),
        DiffusionSamplingParams(prompt="test"),
        run_perf_check=False,
    )
    runner = DiffusionServerBase()
    runner._perf_results = []
    if e2e_ms is not None:
        record_realtime_perf_stats(case.id, [], e2e_ms)
    with pytest.raises(
        PerformanceValidationError, match="E2E duration missing or invalid"
    ):
        runner._validate_realtime_performance(
            SimpleNamespace(load_time_ms=100), case, []
        )


@pytest.mark.parametrize("baseline", [None, 0, float("nan"), 1000])
def test_realtime_e2e_guard_without_chunk_thresholds(monkeypatch, baseline):
    monkeypatch.setenv("SGLANG_GEN_BASELINE", "0")
    monkeypatch.setattr(test_server_common.current_platform, "is_hip", lambda: False)
    case = DiffusionTestCase(
        "stream-e2e-threshold",
        DiffusionServerArgs(model_path="test", modality="video"),
        DiffusionSamplingParams(prompt="test"),
        run_perf_check=False,
    )
    if baseline is None:
        monkeypatch.delitem(
            test_server_common.BASELINE_CONFIG.scenarios, case.id, raising=False
        )
        error, message = pytest.fail.Exception, "not found"
    else:
        monkeypatch.setitem(
            test_server_common.BASELINE_CONFIG.scenarios,
            case.id,
            ScenarioConfig({}, {}, baseline, 0, 0),
        )
        error = AssertionError
        message = (
            "E2E Latency" if baseline == 1000 else "E2E baseline missing or invalid"
        )
    runner = DiffusionServerBase()
    runner._perf_results = []
    record_realtime_perf_stats(case.id, [], 2000)
    with pytest.raises(error, match=message):
        runner._validate_realtime_performance(
            SimpleNamespace(load_time_ms=100), case, []
        )
    assert runner._perf_results[0]["e2e_ms"] == 2000


@pytest.mark.parametrize("peak_mb", [1000, 2000])
def test_realtime_memory_guard_retains_session_e2e(monkeypatch, peak_mb):
    case = DiffusionTestCase(
        "stream-memory-e2e",
        DiffusionServerArgs(model_path="test", modality="video"),
        DiffusionSamplingParams(prompt="test"),
        run_perf_check=True,
    )
    scenario = ScenarioConfig(
        {},
        {},
        2000,
        0,
        0,
        load_peak_vram_mb=1000,
        runtime_peak_vram_mb=1000,
        expected_load_ms=100,
    )
    monkeypatch.setitem(test_server_common.BASELINE_CONFIG.scenarios, case.id, scenario)
    monkeypatch.setattr(test_server_common.current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(test_server_common.current_platform, "is_hip", lambda: False)
    monkeypatch.setenv("SGLANG_GEN_BASELINE", "0")
    record = RequestPerfRecord(
        request_id="last-chunk",
        commit_hash="test",
        tag="test",
        stages=[],
        steps=[],
        total_duration_ms=20,
        memory_snapshots={
            "load_peak": {"peak_reserved_mb": 1000},
            "runtime_peak": {"peak_reserved_mb": peak_mb},
        },
    )
    monkeypatch.setattr(
        test_server_common, "wait_for_req_perf_record", lambda *a, **k: record
    )
    stats = [
        parse_realtime_chunk_stats(
            msgspec.msgpack.decode(_packed_realtime_chunk_stats(0))
        )
    ]
    record_realtime_perf_stats(case.id, stats, 2000)
    runner = DiffusionServerBase()
    runner._perf_results = []
    ctx = SimpleNamespace(perf_log_path="unused", load_time_ms=100)
    if peak_mb > 1000:
        with pytest.raises(AssertionError, match="Runtime Peak VRAM"):
            runner._validate_realtime_performance(ctx, case, stats)
    else:
        runner._validate_realtime_performance(ctx, case, stats)
    assert runner._perf_results[0]["e2e_ms"] == 2000
    assert runner._perf_results[0]["runtime_peak_vram_mb"] == peak_mb


def test_collect_realtime_output_accepts_combined_frame_batch(monkeypatch):
    frame = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    websocket = _FakeRealtimeWebSocket(
        [
            _packed_realtime_combined_frame_message(0, frame),
        ]
    )
    monkeypatch.setitem(
        sys.modules,
        "websockets",
        SimpleNamespace(connect=lambda *args, **kwargs: websocket),
    )

    result = asyncio.run(
        collect_realtime_output(
            ws_url="ws://example.test/v1/realtime_video/generate",
            init_payload={"type": "init", "prompt": "test"},
            events=[],
            num_chunks=1,
        )
    )

    assert len(result.frames) == 1
    np.testing.assert_array_equal(result.frames[0], frame)


def test_realtime_perf_stats_summary_and_thresholds():
    stats = [
        parse_realtime_chunk_stats(
            msgspec.msgpack.decode(
                _packed_realtime_chunk_stats(
                    0,
                    scheduler_forward_ms=10.0,
                    raw_write_ms=2.0,
                    ws_write_ms=3.0,
                    ws_payload_bytes=1024 * 1024,
                    chunk_total_ms=20.0,
                )
            )
        ),
        parse_realtime_chunk_stats(
            msgspec.msgpack.decode(
                _packed_realtime_chunk_stats(
                    1,
                    scheduler_forward_ms=30.0,
                    raw_write_ms=4.0,
                    ws_write_ms=5.0,
                    ws_payload_bytes=2 * 1024 * 1024,
                    chunk_total_ms=40.0,
                )
            )
        ),
    ]

    summary = summarize_realtime_perf_stats(stats)

    assert summary["num_chunks"] == 2
    assert summary["total_frames"] == 2
    assert summary["guarded_chunks"] == 2
    assert summary["avg_scheduler_forward_ms"] == 20.0
    assert summary["p95_chunk_total_ms"] == 40.0
    assert summary["avg_ws_payload_mb"] == 1.5
    validate_realtime_perf_stats(
        "case",
        stats,
        {
            "avg_scheduler_forward_ms": 25.0,
            "p95_chunk_total_ms": 45.0,
            "avg_ws_payload_mb": 2.0,
        },
    )
    with pytest.raises(pytest.fail.Exception, match="p95_chunk_total_ms"):
        validate_realtime_perf_stats(
            "case",
            stats,
            {"p95_chunk_total_ms": 35.0},
        )


def test_realtime_perf_stats_can_ignore_startup_chunks():
    stats = [
        parse_realtime_chunk_stats(
            msgspec.msgpack.decode(
                _packed_realtime_chunk_stats(
                    0,
                    scheduler_forward_ms=20000.0,
                    chunk_total_ms=21000.0,
                )
            )
        ),
        parse_realtime_chunk_stats(
            msgspec.msgpack.decode(
                _packed_realtime_chunk_stats(
                    1,
                    scheduler_forward_ms=7000.0,
                    chunk_total_ms=7200.0,
                )
            )
        ),
        parse_realtime_chunk_stats(
            msgspec.msgpack.decode(
                _packed_realtime_chunk_stats(
                    2,
                    scheduler_forward_ms=2300.0,
                    chunk_total_ms=2800.0,
                )
            )
        ),
    ]

    summary = summarize_realtime_perf_stats(stats, ignore_initial_chunks=2)

    assert summary["num_chunks"] == 3
    assert summary["ignored_initial_chunks"] == 2
    assert summary["guarded_chunks"] == 1
    assert summary["ignored_max_chunk_total_ms"] == 21000.0
    assert summary["p95_chunk_total_ms"] == 2800.0
    validate_realtime_perf_stats(
        "case",
        stats,
        {"p95_chunk_total_ms": 5000.0, "p95_scheduler_forward_ms": 4500.0},
        ignore_initial_chunks=2,
    )
    with pytest.raises(ValueError, match="leave at least one"):
        summarize_realtime_perf_stats(stats, ignore_initial_chunks=3)


# Generate function routing


def test_realtime_sampling_params_route_to_realtime_video_generator():
    params = DiffusionSamplingParams(
        prompt="turn camera left",
        realtime_num_chunks=2,
    )

    generate_fn = get_generate_fn(
        "robbyant/lingbot-world-fast-diffusers",
        "video",
        params,
    )

    assert generate_fn.__name__ == "generate_realtime_video"
