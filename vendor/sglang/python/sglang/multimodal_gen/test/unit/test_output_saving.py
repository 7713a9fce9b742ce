import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import sglang.multimodal_gen.runtime.entrypoints.utils as output_utils
from sglang.multimodal_gen.configs.sample.sampling_params import DataType
from sglang.multimodal_gen.runtime.entrypoints.utils import (
    MaterializedOutput,
    post_process_sample,
    save_materialized_output,
)


def _rgb_frame() -> np.ndarray:
    return np.array(
        [
            [[0, 32, 255], [64, 128, 192], [255, 224, 16]],
            [[9, 17, 33], [127, 128, 129], [240, 12, 88]],
        ],
        dtype=np.uint8,
    )


@pytest.mark.parametrize("output_compression", [None, 0, 75])
def test_png_output_saving_preserves_pixels(tmp_path, output_compression):
    frame = _rgb_frame()
    output_path = tmp_path / f"sample_{output_compression}.png"

    frames = post_process_sample(
        frame,
        DataType.IMAGE,
        fps=1,
        save_file_path=str(output_path),
        output_compression=output_compression,
    )

    assert output_path.exists()
    np.testing.assert_array_equal(frames[0], frame)
    np.testing.assert_array_equal(np.array(Image.open(output_path)), frame)


# compress_level 0 writes stored blocks itself; a compressed PNG goes through Pillow
@pytest.mark.parametrize(
    ("output_compression", "expected_pillow_saves"),
    [(None, []), (0, []), (75, []), (100, [("PNG", 9)])],
)
def test_png_output_saving_skips_pillow_row_filters_when_uncompressed(
    tmp_path, monkeypatch, output_compression, expected_pillow_saves
):
    frame = _rgb_frame()
    output_path = tmp_path / f"sample_{output_compression}.png"

    def fail_imageio_imwrite(*args, **kwargs):
        raise AssertionError("PNG output should not go through imageio")

    original_save = Image.Image.save
    save_calls = []

    def save_spy(self, fp, format=None, **params):
        save_calls.append((format, params.get("compress_level")))
        return original_save(self, fp, format=format, **params)

    monkeypatch.setattr(output_utils.imageio, "imwrite", fail_imageio_imwrite)
    monkeypatch.setattr(Image.Image, "save", save_spy)

    post_process_sample(
        frame,
        DataType.IMAGE,
        fps=1,
        save_file_path=str(output_path),
        output_compression=output_compression,
    )

    assert save_calls == expected_pillow_saves
    np.testing.assert_array_equal(np.array(Image.open(output_path)), frame)


@pytest.mark.parametrize("extension", ["jpg", "jpeg", "JPG"])
@pytest.mark.parametrize("alpha", [0, 128, 255])
def test_rgba_jpeg_output_composites_on_white(tmp_path, extension, alpha):
    """Composite RGBA onto a white background before JPEG encoding."""
    frame = np.full((32, 32, 4), [20, 80, 160, alpha], dtype=np.uint8)
    original = frame.copy()
    output_path = tmp_path / f"rgba.{extension}"

    save_materialized_output(
        MaterializedOutput(sample=None, frames=[frame]),
        DataType.IMAGE,
        str(output_path),
        output_compression=75,
    )

    with Image.open(output_path) as image:
        assert image.format == "JPEG" and image.mode == "RGB"
        assert image.size == (32, 32)
        actual = np.asarray(image).copy()
    expected = (np.array([20, 80, 160]) * alpha + 255 * (255 - alpha) + 127) // 255
    # JPEG is lossy; a constant-color image should stay within a few levels.
    np.testing.assert_allclose(actual, np.broadcast_to(expected, actual.shape), atol=3)
    np.testing.assert_array_equal(frame, original)


def test_rgba_png_output_preserves_transparent_pixels(tmp_path):
    rgb = _rgb_frame()
    alpha = np.array([[0, 64, 128], [192, 254, 255]], dtype=np.uint8)
    frame = np.concatenate([rgb, alpha[..., None]], axis=-1)
    output_path = tmp_path / "rgba.png"

    save_materialized_output(
        MaterializedOutput(sample=None, frames=[frame]),
        DataType.IMAGE,
        str(output_path),
        output_compression=75,
    )

    with Image.open(output_path) as image:
        assert image.mode == "RGBA"
        np.testing.assert_array_equal(np.asarray(image), frame)


def test_warm_image_writer_takes_the_default_jpeg_path(tmp_path, monkeypatch):
    written = []
    imwrite = output_utils.imageio.imwrite

    def imwrite_spy(uri, frame, **kwargs):
        written.append((uri, kwargs))
        return imwrite(uri, frame, **kwargs)

    monkeypatch.setattr(output_utils.imageio, "imwrite", imwrite_spy)
    monkeypatch.chdir(tmp_path)

    output_utils.warm_image_writer()

    assert written == [("<bytes>", {"format": ".jpg", "quality": 75})]
    assert list(tmp_path.iterdir()) == []


def test_video_with_audio_uses_single_pass_encoder(tmp_path, monkeypatch):
    output_path = tmp_path / "sample.mp4"
    calls = []

    class FakeWavFile:
        @staticmethod
        def write(*_args, **_kwargs):
            pass

    def encode_spy(path, frames, **kwargs):
        calls.append((path, frames, kwargs))
        assert kwargs["audio_path"].endswith(".wav")
        assert kwargs["quality"] == 5

    def fail_legacy_mux(**_kwargs):
        raise AssertionError("the two-pass mux path should not run")

    monkeypatch.setattr(output_utils, "_save_video_ffmpeg", encode_spy)
    monkeypatch.setattr(output_utils, "scipy_wavfile", FakeWavFile)
    monkeypatch.setattr(output_utils, "_maybe_mux_audio_into_mp4", fail_legacy_mux)

    materialized = MaterializedOutput(
        sample=None,
        frames=[_rgb_frame()],
        audio=np.zeros((320, 2), dtype=np.float32),
        fps=24,
    )
    save_materialized_output(
        materialized,
        DataType.VIDEO,
        str(output_path),
        audio_sample_rate=32000,
    )

    assert len(calls) == 1


def test_x264_preset_reaches_every_video_save_path(tmp_path, monkeypatch):
    presets = []

    class FakeWavFile:
        @staticmethod
        def write(*_args, **_kwargs):
            pass

    def parallel_save(samples, _paths, **kwargs):
        presets.append(("parallel", kwargs["x264_preset"]))
        return [False] * len(samples)

    def direct_save(**kwargs):
        presets.append(("direct", kwargs["x264_preset"]))
        return False

    def encode_spy(_path, _frames, **kwargs):
        encoder = "single-pass" if "audio_path" in kwargs else "ffmpeg"
        presets.append((encoder, kwargs["x264_preset"]))

    monkeypatch.setattr(output_utils, "_try_save_cuda_videos_direct", parallel_save)
    monkeypatch.setattr(output_utils, "_try_save_cuda_video_direct", direct_save)
    monkeypatch.setattr(output_utils, "_save_video_ffmpeg", encode_spy)
    monkeypatch.setattr(output_utils, "scipy_wavfile", FakeWavFile)

    output_utils.save_outputs(
        [torch.zeros((3, 1, 2, 3)), torch.zeros((3, 1, 2, 3))],
        DataType.VIDEO,
        fps=24,
        save_output=True,
        build_output_path=lambda idx: str(tmp_path / f"sample_{idx}.mp4"),
        x264_preset="ultrafast",
    )
    save_materialized_output(
        MaterializedOutput(
            sample=None,
            frames=[_rgb_frame()],
            audio=np.zeros((320, 2), dtype=np.float32),
            fps=24,
        ),
        DataType.VIDEO,
        str(tmp_path / "with_audio.mp4"),
        audio_sample_rate=32000,
        x264_preset="ultrafast",
    )

    assert {encoder for encoder, _ in presets} == {
        "parallel",
        "direct",
        "ffmpeg",
        "single-pass",
    }
    assert {preset for _, preset in presets} == {"ultrafast"}


def test_video_audio_single_pass_failure_falls_back(tmp_path, monkeypatch):
    output_path = tmp_path / "sample.mp4"
    calls = []
    mux_calls = []

    class FakeWavFile:
        @staticmethod
        def write(*_args, **_kwargs):
            pass

    def encode_spy(path, frames, **kwargs):
        calls.append((path, frames, kwargs))
        if "audio_path" in kwargs:
            raise RuntimeError("unsupported audio input")

    monkeypatch.setattr(output_utils, "_save_video_ffmpeg", encode_spy)
    monkeypatch.setattr(output_utils, "scipy_wavfile", FakeWavFile)
    monkeypatch.setattr(
        output_utils,
        "_maybe_mux_audio_into_mp4",
        lambda **kwargs: mux_calls.append(kwargs),
    )

    materialized = MaterializedOutput(
        sample=None,
        frames=[_rgb_frame()],
        audio=np.zeros((320, 2), dtype=np.float32),
        fps=24,
    )
    save_materialized_output(
        materialized,
        DataType.VIDEO,
        str(output_path),
        audio_sample_rate=32000,
    )

    assert len(calls) == 2
    assert "audio_path" in calls[0][2]
    assert "audio_path" not in calls[1][2]
    assert len(mux_calls) == 1


@pytest.mark.parametrize(
    ("height", "available_cpus", "expected_threads"),
    [
        (768, 256, 24),
        (720, 256, 22),
        (2160, 16, 24),
        (4320, 256, 128),
        (16, 1, 1),
    ],
)
def test_x264_auto_thread_count(monkeypatch, height, available_cpus, expected_threads):
    monkeypatch.setattr(
        output_utils.os,
        "sched_getaffinity",
        lambda _pid: set(range(available_cpus)),
    )

    assert output_utils._x264_auto_thread_count(height) == expected_threads


def test_video_direct_save_short_circuits_materialization(tmp_path, monkeypatch):
    output_path = tmp_path / "sample.mp4"
    direct_calls = []

    monkeypatch.setattr(
        output_utils,
        "_try_save_cuda_video_direct",
        lambda **kwargs: direct_calls.append(kwargs) or True,
    )
    monkeypatch.setattr(
        output_utils,
        "post_process_sample",
        lambda *_args, **_kwargs: pytest.fail(
            "successful direct save should skip frame materialization"
        ),
    )

    paths = output_utils.save_outputs(
        [torch.zeros((3, 1, 2, 3))],
        DataType.VIDEO,
        fps=24,
        save_output=True,
        build_output_path=lambda _idx: str(output_path),
    )

    assert paths == [str(output_path)]
    assert len(direct_calls) == 1


def test_multiple_videos_use_parallel_direct_save_with_serial_fallback(
    tmp_path, monkeypatch
):
    outputs = [torch.zeros((3, 1, 2, 3)), torch.ones((3, 1, 2, 3))]
    direct_calls = []

    def parallel_save(samples, paths, **kwargs):
        direct_calls.append((samples, paths, kwargs))
        return [True, False]

    serial_calls = []

    monkeypatch.setattr(output_utils, "_try_save_cuda_videos_direct", parallel_save)
    monkeypatch.setattr(
        output_utils,
        "_try_save_cuda_video_direct",
        lambda **kwargs: serial_calls.append(kwargs) or True,
    )
    monkeypatch.setattr(
        output_utils,
        "post_process_sample",
        lambda *_args, **_kwargs: pytest.fail(
            "successful parallel direct saves should skip frame materialization"
        ),
    )

    paths = output_utils.save_outputs(
        outputs,
        DataType.VIDEO,
        fps=24,
        save_output=True,
        build_output_path=lambda idx: str(tmp_path / f"sample_{idx}.mp4"),
    )

    assert paths == [str(tmp_path / "sample_0.mp4"), str(tmp_path / "sample_1.mp4")]
    assert len(direct_calls) == 1
    samples, save_paths, kwargs = direct_calls[0]
    assert all(actual is expected for actual, expected in zip(samples, outputs))
    assert save_paths == paths
    assert kwargs["fps"] == 24
    assert len(serial_calls) == 1
    assert serial_calls[0]["save_file_path"] == paths[1]


def test_video_output_preserves_pinned_encoder(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda _: "/system/ffmpeg")
    monkeypatch.setattr(
        output_utils.imageio_ffmpeg, "get_ffmpeg_exe", lambda: "/pinned/ffmpeg"
    )
    assert output_utils._resolve_ffmpeg_exe() == "/pinned/ffmpeg"
