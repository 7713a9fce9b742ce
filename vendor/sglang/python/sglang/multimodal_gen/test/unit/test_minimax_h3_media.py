# SPDX-License-Identifier: Apache-2.0
"""Numerical boundaries for the one-pass Ref2VA media path."""

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang.multimodal_gen.runtime.managers.forward_context import get_forward_context
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3 import (
    keyframe_encoding,
    material_io,
    reference_encoding,
)


@pytest.mark.parametrize(
    ("mode", "source_size", "canvas_size", "expected_size", "policy_version"),
    [
        (
            "match",
            (1920, 1080),
            (960, 544),
            (960, 544),
            "reference_image_match_v1",
        ),
        (
            "match",
            (512, 512),
            (960, 544),
            (512, 512),
            "reference_image_match_v1",
        ),
        (
            "max",
            (5000, 2500),
            (960, 544),
            (4096, 2048),
            "reference_image_max_v1",
        ),
        (
            "max",
            (1920, 1080),
            (960, 544),
            (1920, 1088),
            "reference_image_max_v1",
        ),
        (
            "diffusers",
            (512, 512),
            (960, 544),
            (2048, 2048),
            "reference_image_short_edge_v1",
        ),
    ],
)
def test_reference_image_resize_modes(
    mode, source_size, canvas_size, expected_size, policy_version
):
    resolved = reference_encoding.minimax_h3_resolve_reference_image_shape(
        width=source_size[0],
        height=source_size[1],
        canvas_width=canvas_size[0],
        canvas_height=canvas_size[1],
        mode=mode,
    )

    assert (resolved["width"], resolved["height"]) == expected_size
    assert resolved["shape_policy_version"] == policy_version
    assert resolved["reference_resize_mode"] == mode
    assert resolved["allow_upscale"] is (mode == "diffusers")


def test_reference_image_resize_defaults_to_legacy_diffusers_policy():
    resolved = reference_encoding.minimax_h3_resolve_reference_image_shape(
        width=512,
        height=512,
        canvas_width=960,
        canvas_height=544,
    )

    assert (resolved["width"], resolved["height"]) == (2048, 2048)
    assert resolved["reference_resize_mode"] == "diffusers"
    assert resolved["shape_policy_version"] == "reference_image_short_edge_v1"


def test_reference_image_resize_normalizes_mode():
    resolved = reference_encoding.minimax_h3_resolve_reference_image_shape(
        width=1920,
        height=1080,
        canvas_width=960,
        canvas_height=544,
        mode=" MATCH ",
    )

    assert resolved["reference_resize_mode"] == "match"
    assert (resolved["width"], resolved["height"]) == (960, 544)


def test_reference_image_resize_rejects_unknown_mode():
    with pytest.raises(ValueError, match="reference_resize_mode"):
        reference_encoding.minimax_h3_resolve_reference_image_shape(
            width=1920,
            height=1080,
            canvas_width=960,
            canvas_height=544,
            mode="unknown",
        )


@pytest.mark.parametrize(
    ("canvas_width", "canvas_height"),
    [(0, 544), (960, 0), (-960, 544), (float("nan"), 544)],
)
def test_reference_image_resize_rejects_invalid_canvas(canvas_width, canvas_height):
    with pytest.raises(ValueError, match="target canvas"):
        reference_encoding.minimax_h3_resolve_reference_image_shape(
            width=1920,
            height=1080,
            canvas_width=canvas_width,
            canvas_height=canvas_height,
            mode="match",
        )


def test_keyframe_rng_supports_cpu_and_default_device():
    initial_state = torch.random.get_rng_state()

    for device in (None, torch.device("cpu")):
        with keyframe_encoding.minimax_h3_scoped_encode_rng(42, device):
            assert torch.initial_seed() == 42
        torch.testing.assert_close(torch.random.get_rng_state(), initial_state)


def test_ffprobe_falls_back_when_stream_side_data_is_unknown(monkeypatch):
    material_io._ffprobe_entries = None
    calls = []

    def run(command, **_kwargs):
        calls.append(command)
        entries = command[command.index("-show_entries") + 1]
        if "stream_side_data" in entries:
            raise subprocess.CalledProcessError(
                1,
                command,
                stderr="ffprobe: No match for section 'stream_side_data'",
            )
        return SimpleNamespace(
            stdout=json.dumps(
                {
                    "streams": [{"codec_type": "audio", "sample_rate": "44100"}],
                    "format": {"format_name": "mp3", "duration": "1.0"},
                }
            )
        )

    monkeypatch.setattr(subprocess, "run", run)
    payload = material_io._ffprobe_media("/input/ref.mp3")

    assert len(calls) == 2
    assert "stream_side_data" in calls[0][calls[0].index("-show_entries") + 1]
    assert "stream_side_data" not in calls[1][calls[1].index("-show_entries") + 1]
    assert payload["format"]["format_name"] == "mp3"
    assert material_io._ffprobe_entries is not None
    assert "stream_side_data" not in material_io._ffprobe_entries


def test_video_transform_runs_once_and_qwen_samples_shared_rgb(monkeypatch):
    expected = np.arange(25 * 4 * 6 * 3, dtype=np.uint8).reshape(25, 4, 6, 3)
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        if command[-1] == "pipe:1":
            return SimpleNamespace(stdout=expected.tobytes())
        output_fd = int(command[-1].removeprefix("pipe:"))
        assert kwargs["pass_fds"] == (output_fd,)
        os.write(output_fd, expected.tobytes())
        return SimpleNamespace(stderr=b"")

    monkeypatch.setattr(subprocess, "run", run)
    frames = reference_encoding.minimax_h3_decode_reference_video_frames(
        "/input/ref.mp4",
        target_width=6,
        target_height=4,
        target_frame_count=25,
        fps=24.0,
        start_time_seconds=2.25,
    )
    sampled = reference_encoding.minimax_h3_sample_reference_video_frames(frames)

    assert len(commands) == 1
    command = commands[0]
    assert command[command.index("-vf") + 1] == (
        "fps=24,scale=6:4:flags=lanczos,setsar=1"
    )
    assert command[command.index("-frames:v") + 1] == "25"
    assert command[command.index("-ss") + 1] == "2.25"
    assert command.index("-ss") < command.index("-i")
    assert command[-5:-1] == ["-f", "rawvideo", "-pix_fmt", "rgb24"]
    assert command[-1].startswith("pipe:")
    assert "libx264" not in command
    if command[-1] != "pipe:1":
        assert frames.flags.writeable
    assert all(np.shares_memory(frame, frames) for frame in sampled["frames"])
    assert [int(frame[0, 0, 0]) for frame in sampled["frames"]] == [
        int(expected[index, 0, 0, 0]) for index in (0, 12, 24)
    ]
    assert sampled["block_timestamps"] == [0.25, 1.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="requires Linux memfd")
def test_video_transform_can_share_one_host_decode(monkeypatch):
    expected = np.arange(25 * 4 * 6 * 3, dtype=np.uint8).reshape(25, 4, 6, 3)
    commands = []

    class FakeGroup:
        world_size = 2
        rank_in_group = 0
        cpu_group = object()

        def barrier(self):
            return None

    def all_gather_object(outputs, value, **_kwargs):
        outputs[:] = [value, value]

    def run(command, **_kwargs):
        commands.append(command)
        output_fd = int(command[-1].removeprefix("pipe:"))
        os.write(output_fd, expected.tobytes())
        return SimpleNamespace(stderr=b"")

    monkeypatch.setattr(reference_encoding, "get_replica_group", FakeGroup)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(subprocess, "run", run)
    reference_encoding._reference_video_host_leader.cache_clear()

    try:
        frames = reference_encoding.minimax_h3_decode_reference_video_frames(
            "/input/ref.mp4",
            target_width=6,
            target_height=4,
            target_frame_count=25,
            share_across_replicas=True,
        )
    finally:
        reference_encoding._reference_video_host_leader.cache_clear()

    assert np.array_equal(frames, expected)
    assert frames.flags.writeable
    assert len(commands) == 1
    assert commands[0][-1].startswith("pipe:")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="requires Linux memfd")
def test_shared_video_transform_falls_back_when_proc_fd_is_blocked(monkeypatch):
    expected = np.arange(25 * 4 * 6 * 3, dtype=np.uint8).reshape(25, 4, 6, 3)
    commands = []

    class FakeGroup:
        world_size = 2
        rank_in_group = 0
        cpu_group = object()

    def all_gather_object(outputs, value, **_kwargs):
        outputs[:] = [value, value]

    def run(command, **_kwargs):
        commands.append(command)
        os.write(int(command[-1].removeprefix("pipe:")), expected.tobytes())
        return SimpleNamespace(stderr=b"")

    real_open = os.open

    def guarded_open(path, flags):
        if str(path).startswith("/proc/"):
            raise PermissionError("blocked by test policy")
        return real_open(path, flags)

    monkeypatch.setattr(reference_encoding, "get_replica_group", FakeGroup)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(os, "open", guarded_open)
    reference_encoding._reference_video_host_leader.cache_clear()
    try:
        frames = reference_encoding.minimax_h3_decode_reference_video_frames(
            "/input/ref.mp4",
            target_width=6,
            target_height=4,
            target_frame_count=25,
            share_across_replicas=True,
        )
    finally:
        reference_encoding._reference_video_host_leader.cache_clear()

    assert np.array_equal(frames, expected)
    assert len(commands) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="requires Linux memfd")
def test_shared_video_transform_propagates_any_host_decode_failure(monkeypatch):
    class FakeGroup:
        world_size = 4
        rank_in_group = 0
        cpu_group = object()

    gather_index = 0

    def all_gather_object(outputs, value, **_kwargs):
        nonlocal gather_index
        if gather_index == 0:
            outputs[:] = ["host-a", "host-a", "host-b", "host-b"]
        else:
            outputs[:] = [
                value,
                None,
                (None, 0, "CalledProcessError: remote decode failed"),
                None,
            ]
        gather_index += 1

    monkeypatch.setattr(reference_encoding, "get_replica_group", FakeGroup)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(
        reference_encoding,
        "_write_reference_video_to_fd",
        lambda _command, _fd: 1,
    )
    reference_encoding._reference_video_host_leader.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="remote decode failed"):
            reference_encoding._decode_reference_video_shared(["ffmpeg"])
    finally:
        reference_encoding._reference_video_host_leader.cache_clear()

    # The failure is resolved immediately after the shared state exchange;
    # no rank enters a mapping collective that another host skipped.
    assert gather_index == 2


def test_audio_decode_is_bounded_float_pcm_without_temp_files(monkeypatch):
    pcm = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    commands = []

    def run(command, **_kwargs):
        commands.append(command)
        if command[0] == "ffprobe":
            return SimpleNamespace(
                stdout=json.dumps(
                    {"streams": [{"channels": 6, "sample_rate": "44100"}]}
                )
            )
        return SimpleNamespace(stdout=pcm)

    monkeypatch.setattr(subprocess, "run", run)
    waveform, source_rate = reference_encoding._load_waveform(
        "/input/ref.mp4",
        material_chain="video.reference_preserve",
        max_duration_seconds=3.5,
        start_time_seconds=2.25,
    )

    ffmpeg = next(command for command in commands if command[0] == "ffmpeg")
    assert source_rate == 44100
    torch.testing.assert_close(
        waveform,
        torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]], dtype=torch.float32),
    )
    assert ffmpeg[ffmpeg.index("-t") + 1] == "3.5"
    assert ffmpeg[ffmpeg.index("-ss") + 1] == "2.25"
    assert ffmpeg.index("-ss") < ffmpeg.index("-i")
    assert ffmpeg[-3:] == ["-f", "f32le", "pipe:1"]


def test_reference_audio_encode_sets_forward_context(monkeypatch):
    class FakeAudioVAE(torch.nn.Module):
        attn_proj = True

        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))
            self.mean_proj = torch.nn.Identity()

        def preprocess(self, waveform, _sample_rate):
            return waveform

        def encoder(self, _audio_data):
            return torch.ones(2, 32, 4)

        def pre_block(self, hidden_states):
            assert get_forward_context().current_timestep == 0
            return hidden_states

    monkeypatch.setattr(
        reference_encoding,
        "_load_waveform",
        lambda *_args, **_kwargs: (torch.ones(2, 320), 32000),
    )

    result = reference_encoding.minimax_h3_encode_reference_audio_rows(
        FakeAudioVAE(),
        "/input/ref.wav",
        SimpleNamespace(
            latent_channels=32,
            latents_mean=[0.0] * 32,
            latents_std=[1.0] * 32,
        ),
    )

    assert result["rows"].shape == (8, 32)
    assert result["ref_audio_t"] == 4


def _decode_base64_payload(write, uri):
    output = io.BytesIO()
    result = write(uri, uri.index(",") + 1, output)
    return output.getvalue(), result


@pytest.mark.parametrize("size", [1, 2, 3, 11, 12, 13, 47, 48, 49])
@pytest.mark.parametrize("alphabet", ["standard", "urlsafe", "unpadded"])
def test_plain_base64_material_matches_per_character_path(monkeypatch, size, alphabet):
    # 16-character windows, so every size crosses window boundaries.
    monkeypatch.setattr(material_io, "MINIMAX_H3_BASE64_DECODE_CHUNK_CHARS", 16)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    encode = base64.urlsafe_b64encode if alphabet == "urlsafe" else base64.b64encode
    payload = encode(data).decode()
    if alphabet == "unpadded":
        payload = payload.rstrip("=")
    uri = "data:image/png;base64," + payload

    assert material_io._PLAIN_BASE64_PAYLOAD.fullmatch(uri, uri.index(",") + 1)
    plain = _decode_base64_payload(material_io._write_plain_base64, uri)
    assert plain == _decode_base64_payload(material_io._write_escaped_base64, uri)
    assert plain[0] == data


@pytest.mark.parametrize(
    "payload, message",
    [
        ("", "payload is empty"),
        ("A", "invalid base64 payload length"),
        ("QQ=", "invalid base64 payload length"),
        ("QQ===", "invalid base64 padding"),
        ("QQ==QQ==", "data after base64 padding"),
        ("QU*D", "invalid base64 character"),
    ],
)
def test_base64_material_rejects_invalid_payloads(
    tmp_path, monkeypatch, payload, message
):
    monkeypatch.setattr(material_io.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    with pytest.raises(ValueError, match=message):
        material_io._stream_base64_material(
            SimpleNamespace(extra={}),
            "data:image/png;base64," + payload,
            condition_type="image",
            condition_index=0,
        )
    assert list(tmp_path.iterdir()) == []


def test_base64_material_decodes_escapes_and_whitespace(tmp_path, monkeypatch):
    monkeypatch.setattr(material_io.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    data = bytes(range(256)) * 4
    payload = base64.b64encode(data).decode()
    escaped = f"%{ord(payload[0]):02X}" + payload[1:20] + "\n " + payload[20:]
    path = material_io._stream_base64_material(
        SimpleNamespace(extra={}),
        "data:image/png;base64," + escaped,
        condition_type="image",
        condition_index=0,
    )
    assert Path(path).read_bytes() == data


def test_plain_base64_material_skips_the_per_character_loop(tmp_path, monkeypatch):
    def per_character(*_args):
        raise AssertionError("a plain base64 payload took the per-character path")

    monkeypatch.setattr(material_io.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(material_io, "_iter_base64_payload_bytes", per_character)
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    path = material_io._stream_base64_material(
        SimpleNamespace(extra={}),
        "data:image/png;base64," + base64.b64encode(data).decode(),
        condition_type="image",
        condition_index=0,
    )
    assert Path(path).read_bytes() == data
