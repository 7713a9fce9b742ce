import json
from types import SimpleNamespace
from unittest.mock import patch

import huggingface_hub
import modelscope
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from sglang.multimodal_gen.runtime.pipelines_core.composed_pipeline_base import (
    ComposedPipelineBase,
)
from sglang.multimodal_gen.runtime.utils import hf_diffusers_utils
from sglang.multimodal_gen.runtime.utils.hf_diffusers_utils import (
    _check_index_files_for_missing_shards,
    _is_revisionless_snapshot_root,
    _verify_diffusers_model_complete,
    maybe_download_model,
)
from sglang.srt.environ import envs


def test_component_override_resolves_hub_subfolder_before_loading(tmp_path):
    repo_root = tmp_path / "FLUX.1-dev-bnb-4bit"
    component_root = repo_root / "text_encoder_2"
    component_root.mkdir(parents=True)
    pipeline = SimpleNamespace(model_path="/base")
    server_args = SimpleNamespace(
        component_paths={
            "text_encoder_2": "diffusers/FLUX.1-dev-bnb-4bit/text_encoder_2"
        }
    )

    with patch(
        "sglang.multimodal_gen.runtime.utils.hf_diffusers_utils.maybe_download_model",
        return_value=str(repo_root),
    ) as download:
        component_path = ComposedPipelineBase._resolve_component_path(
            pipeline,
            server_args,
            "text_encoder_2",
            "text_encoder_2",
        )

    assert component_path == str(component_root)
    download.assert_called_once_with(
        "diffusers/FLUX.1-dev-bnb-4bit",
        allow_patterns=["text_encoder_2/**", "text_encoder_2/*"],
    )


def _write_model_index(root):
    (root / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "LongLive2Pipeline",
                "_diffusers_version": "0.34.0",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "T5EncoderModel"],
                "tokenizer": ["transformers", "T5TokenizerFast"],
                "transformer": ["diffusers", "LongLive2Transformer3DModel"],
                "transformer_2": [None, None],
                "vae": ["diffusers", "AutoencoderKLWan"],
            }
        )
    )


def test_diffusers_cache_validation_rejects_declared_component_without_weights(
    tmp_path,
):
    _write_model_index(tmp_path)
    for subdir in ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        (tmp_path / subdir).mkdir()
    (tmp_path / "text_encoder" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"weights")

    assert not _verify_diffusers_model_complete(str(tmp_path))

    is_valid, missing_files, checked_subdirs = _check_index_files_for_missing_shards(
        str(tmp_path)
    )
    assert not is_valid
    assert "transformer/<weights>" in missing_files
    assert "transformer" in checked_subdirs


def test_diffusers_cache_validation_checks_declared_component_shards(tmp_path):
    _write_model_index(tmp_path)
    for subdir in ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        (tmp_path / subdir).mkdir()
        (tmp_path / subdir / "model.safetensors").write_bytes(b"weights")

    index_path = (
        tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    )
    index_path.write_text(
        json.dumps(
            {
                "weight_map": {
                    "block.0.weight": "model.safetensors",
                    "block.1.weight": "missing.safetensors",
                }
            }
        )
    )

    assert _verify_diffusers_model_complete(str(tmp_path))

    is_valid, missing_files, checked_subdirs = _check_index_files_for_missing_shards(
        str(tmp_path)
    )
    assert not is_valid
    assert "transformer/missing.safetensors" in missing_files
    assert "transformer" in checked_subdirs


def _populate_components(root, components, *, weights=True):
    for name in components:
        (root / name).mkdir(parents=True, exist_ok=True)
        if weights:
            (root / name / "model.safetensors").write_bytes(b"weights")


@pytest.fixture
def recording_snapshot_download(monkeypatch):
    """Stub ``snapshot_download`` to return ``path``, recording each call as an
    offline ``"probe"`` or a real ``"download"``."""
    calls = []

    def factory(path):
        def fake_snapshot_download(**kwargs):
            calls.append("probe" if kwargs.get("local_files_only") else "download")
            return str(path)

        monkeypatch.setattr(
            hf_diffusers_utils, "snapshot_download", fake_snapshot_download
        )
        return calls

    return factory


@pytest.mark.parametrize(
    "relative_path, expected",
    [
        ("models--org--repo/snapshots", True),
        ("models--org--repo/snapshots/", True),
        ("datasets--org--repo/snapshots", True),
        # A healthy entry resolves to snapshots/<commit_sha>.
        ("models--org--repo/snapshots/" + "a" * 40, False),
        # A local_dir may legitimately be named "snapshots".
        ("mymodels/snapshots", False),
        ("mymodels/snapshots/inner", False),
        ("models--org--repo", False),
    ],
)
def test_revisionless_snapshot_root_detection(tmp_path, relative_path, expected):
    assert _is_revisionless_snapshot_root(str(tmp_path / relative_path)) is expected


def test_corrupt_ref_resolving_to_snapshots_parent_is_a_cache_miss(
    recording_snapshot_download, tmp_path
):
    """The snapshots/ parent holds only revision subdirs, so it is not a hit."""
    snapshots_parent = tmp_path / "models--org--repo" / "snapshots"
    (snapshots_parent / ("a" * 40)).mkdir(parents=True)
    calls = recording_snapshot_download(snapshots_parent)

    with pytest.raises(ValueError, match="not found in local cache"):
        maybe_download_model("org/repo", download=False)

    assert calls == ["probe"]


def test_local_dir_named_snapshots_is_not_treated_as_corrupt(
    recording_snapshot_download, tmp_path
):
    """The guard requires a models--*/ folder above, so this stays a valid hit."""
    local_dir = tmp_path / "mymodels" / "snapshots"
    local_dir.mkdir(parents=True)
    _write_model_index(local_dir)
    _populate_components(local_dir, ("text_encoder", "transformer", "vae"))
    calls = recording_snapshot_download(local_dir)

    result = maybe_download_model("org/repo", local_dir=str(local_dir), download=False)

    assert result == str(local_dir)
    assert calls == ["probe"]


def test_local_path_is_returned_as_given(tmp_path):
    """A local path is not a repo id, so it is returned without any download."""
    _write_model_index(tmp_path)
    _populate_components(tmp_path, ("text_encoder", "transformer", "vae"))

    assert maybe_download_model(str(tmp_path), download=False) == str(tmp_path)


def test_metadata_only_local_path_is_still_returned_as_given(tmp_path):
    """Falling through would download the filesystem path as a repo id and fail."""
    _write_model_index(tmp_path)

    assert maybe_download_model(str(tmp_path), download=False) == str(tmp_path)


def test_metadata_only_cached_snapshot_is_not_a_usable_hit(
    recording_snapshot_download, tmp_path
):
    """The probe stub resolves as an offline hit but has no component weights."""
    _write_model_index(tmp_path)
    calls = recording_snapshot_download(tmp_path)

    with pytest.raises(ValueError, match="only contains pipeline metadata"):
        maybe_download_model("org/repo", download=False)

    assert calls == ["probe"]


def test_metadata_only_cached_snapshot_falls_through_to_one_download(
    recording_snapshot_download, tmp_path
):
    """Exactly one download -- no duplicate fetch, and no force_download retry."""
    _write_model_index(tmp_path)
    calls = recording_snapshot_download(tmp_path)

    assert maybe_download_model("org/repo") == str(tmp_path)
    assert calls == ["probe", "download"]


def test_complete_cached_snapshot_is_served_without_download(
    recording_snapshot_download, tmp_path
):
    _write_model_index(tmp_path)
    _populate_components(tmp_path, ("text_encoder", "transformer", "vae"))
    calls = recording_snapshot_download(tmp_path)

    assert maybe_download_model("org/repo") == str(tmp_path)
    assert calls == ["probe"]


def test_cached_snapshot_respects_requested_revision(monkeypatch, tmp_path):
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(hf_diffusers_utils, "snapshot_download", fake_snapshot_download)

    assert maybe_download_model("org/repo", revision="a" * 40, download=False) == str(
        tmp_path
    )
    assert calls == [
        {
            "repo_id": "org/repo",
            "ignore_patterns": ["*.onnx", "*.msgpack"],
            "allow_patterns": None,
            "local_dir": None,
            "local_files_only": True,
            "max_workers": 8,
            "revision": "a" * 40,
        }
    ]


def test_partially_populated_cached_snapshot_is_served_without_download(
    recording_snapshot_download, tmp_path
):
    """An allow_patterns fetch leaves components absent, so only a total absence of
    weights counts as the stub."""
    _write_model_index(tmp_path)
    _populate_components(tmp_path, ("vae",))
    calls = recording_snapshot_download(tmp_path)

    assert maybe_download_model("org/repo") == str(tmp_path)
    assert calls == ["probe"]


def test_cached_component_repo_without_model_index_is_served_without_download(
    recording_snapshot_download, tmp_path
):
    """Declares nothing, so the stub check must not match on 0 missing == 0."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    calls = recording_snapshot_download(tmp_path)

    assert maybe_download_model("org/repo") == str(tmp_path)
    assert calls == ["probe"]


def test_metadata_only_cached_lora_snapshot_is_a_usable_hit(
    recording_snapshot_download, tmp_path
):
    """LoRA repos declare no components, so they can never be the stub."""
    _write_model_index(tmp_path)
    calls = recording_snapshot_download(tmp_path)

    assert maybe_download_model("org/repo", is_lora=True) == str(tmp_path)
    assert calls == ["probe"]


def test_cached_lora_snapshot_downloads_missing_selected_weight(monkeypatch, tmp_path):
    calls = []
    selected_file = "loras/adapter.safetensors"

    def fake_snapshot_download(**kwargs):
        calls.append("probe" if kwargs.get("local_files_only") else "download")
        if not kwargs.get("local_files_only"):
            target = tmp_path / selected_file
            target.parent.mkdir()
            target.write_bytes(b"weights")
        return str(tmp_path)

    monkeypatch.setattr(hf_diffusers_utils, "snapshot_download", fake_snapshot_download)

    result = maybe_download_model(
        "org/repo",
        is_lora=True,
        allow_patterns=["*.json", selected_file],
    )

    assert result == str(tmp_path)
    assert calls == ["probe", "download"]


def test_cached_lora_snapshot_reports_missing_selected_weight_offline(
    recording_snapshot_download, tmp_path
):
    calls = recording_snapshot_download(tmp_path)

    with pytest.raises(ValueError, match="loras/adapter.safetensors"):
        maybe_download_model(
            "org/repo",
            download=False,
            is_lora=True,
            allow_patterns=["*.json", "loras/adapter.safetensors"],
        )

    assert calls == ["probe"]


def test_force_diffusers_model_stub_keeps_its_existing_path(
    recording_snapshot_download, tmp_path
):
    """Already rejected by _verify_diffusers_model_complete, so its path is
    unchanged: download, then the force_download retry."""
    _write_model_index(tmp_path)
    calls = recording_snapshot_download(tmp_path)

    with pytest.raises(ValueError, match="still incomplete after forced re-download"):
        maybe_download_model("org/repo", force_diffusers_model=True)

    assert calls == ["probe", "download", "download"]


@pytest.mark.parametrize(
    "cached, expected_downloads",
    [
        ("complete", ["model_index.json"]),
        ("manifest", ["_overlay/overlay_manifest.json"]),
        ("metadata", ["_overlay/overlay_manifest.json", "model_index.json"]),
    ],
)
def test_complete_cached_checkpoint_skips_overlay_probe(
    monkeypatch, tmp_path, cached, expected_downloads
):
    """hf_hub_download waits out Hub rate limits before reporting a file the repo
    never had, so a complete cached checkpoint must not probe its overlay manifest.
    A cached manifest still marks an overlay repo, and a metadata-only snapshot,
    which an overlay repo leaves, still asks the Hub."""
    repo_cache = tmp_path / "models--org--repo"
    snapshot = repo_cache / "snapshots" / ("a" * 40)
    (snapshot / "_overlay").mkdir(parents=True)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text("a" * 40)
    _write_model_index(snapshot)
    if cached != "metadata":
        _populate_components(snapshot, ("scheduler", "tokenizer"), weights=False)
        _populate_components(snapshot, ("text_encoder", "transformer", "vae"))
    if cached == "manifest":
        (snapshot / "_overlay" / "overlay_manifest.json").write_text(
            '{"source_model_id": "org/source"}'
        )
    downloads = []

    def fake_hf_hub_download(repo_id, filename, **kwargs):
        downloads.append(filename)
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_diffusers_utils, "hf_hub_download", fake_hf_hub_download)

    config = hf_diffusers_utils.maybe_download_model_index("org/repo")

    assert config["_class_name"] == "LongLive2Pipeline"
    assert downloads == expected_downloads


def test_modelscope_file_download_preserves_local_dir(monkeypatch, tmp_path):
    calls = []

    def model_file_download(**kwargs):
        calls.append(kwargs)
        return str(tmp_path / kwargs["file_path"])

    monkeypatch.setattr(modelscope, "model_file_download", model_file_download)

    with envs.SGLANG_USE_MODELSCOPE.override(True):
        result = hf_diffusers_utils.hf_hub_download(
            "MiniMax/MiniMax-H3",
            "FL2VA/model_index.json",
            local_dir=tmp_path,
            revision="master",
        )

    assert result == str(tmp_path / "FL2VA/model_index.json")
    assert calls == [
        {
            "model_id": "MiniMax/MiniMax-H3",
            "file_path": "FL2VA/model_index.json",
            "local_dir": str(tmp_path),
            "revision": "master",
        }
    ]


def test_modelscope_snapshot_download_selects_h3_partition(monkeypatch, tmp_path):
    calls = []

    def snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(modelscope, "snapshot_download", snapshot_download)

    with envs.SGLANG_USE_MODELSCOPE.override(True):
        result = hf_diffusers_utils.snapshot_download(
            "MiniMax/MiniMax-H3",
            local_dir=tmp_path,
            allow_patterns=["Ref2VA/**"],
            force_download=True,
        )

    assert result == str(tmp_path)
    assert calls == [
        {
            "model_id": "MiniMax/MiniMax-H3",
            "local_dir": str(tmp_path),
            "ignore_patterns": None,
            "allow_patterns": ["Ref2VA/**"],
            "local_files_only": False,
            "max_workers": 8,
        }
    ]


def test_modelscope_empty_selected_partition_is_a_cache_miss(monkeypatch, tmp_path):
    monkeypatch.setattr(modelscope, "snapshot_download", lambda **_: str(tmp_path))

    with (
        envs.SGLANG_USE_MODELSCOPE.override(True),
        pytest.raises(LocalEntryNotFoundError, match="Ref2VA"),
    ):
        hf_diffusers_utils.snapshot_download(
            "MiniMax/MiniMax-H3",
            allow_patterns=["Ref2VA/**"],
            local_files_only=True,
        )


def test_modelscope_selected_partition_cache_hit_requires_a_file(monkeypatch, tmp_path):
    model_index = tmp_path / "FL2VA" / "model_index.json"
    model_index.parent.mkdir()
    model_index.write_text("{}")
    monkeypatch.setattr(modelscope, "snapshot_download", lambda **_: str(tmp_path))

    with envs.SGLANG_USE_MODELSCOPE.override(True):
        result = hf_diffusers_utils.snapshot_download(
            "MiniMax/MiniMax-H3",
            allow_patterns=["FL2VA/**"],
            local_files_only=True,
        )

    assert result == str(tmp_path)


def test_unreachable_hub_falls_back_to_cached_model_index(monkeypatch, tmp_path):
    """An unreachable Hub must fall back to the cached model_index.json."""
    cached = tmp_path / "model_index.json"
    cached.write_text("{}")

    def offline(**kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(hf_diffusers_utils, "hf_hub_download", offline)
    monkeypatch.setattr(
        "huggingface_hub.try_to_load_from_cache",
        lambda repo_id, filename: (
            str(cached) if filename == "model_index.json" else None
        ),
    )

    assert hf_diffusers_utils._resolve_remote_repo_model_index_path("org/model") == str(
        cached
    )


@pytest.mark.parametrize("cached_single_model", [True, False])
def test_unreachable_hub_model_index(
    monkeypatch, tmp_path, recording_snapshot_download, cached_single_model
):
    """Offline, a cached single model loads; a cache miss is reported, not a -Diffusers hint."""

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(
        hf_diffusers_utils, "maybe_load_overlay_model_index", lambda *a, **k: None
    )
    monkeypatch.setattr(hf_diffusers_utils, "hf_hub_download", offline)
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda **k: None)

    if cached_single_model:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["M"]}))
        calls = recording_snapshot_download(tmp_path)
        config = hf_diffusers_utils.maybe_download_model_index("org/model")
        assert config == {"architectures": ["M"]}
        assert calls == ["probe"]
    else:
        monkeypatch.setattr(hf_diffusers_utils, "snapshot_download", offline)
        with pytest.raises(ValueError, match="not found in local cache"):
            hf_diffusers_utils.maybe_download_model_index("org/model")


def test_component_config_ignores_scheduler_in_parent_directory(tmp_path):
    """Only the component dir name, not a parent dir, selects scheduler_config.json."""
    component = tmp_path / "scheduler_ablation" / "unet"
    component.mkdir(parents=True)
    (component / "config.json").write_text(json.dumps({"_class_name": "UNet"}))

    config = hf_diffusers_utils.get_diffusers_component_config(str(component))

    assert config["_class_name"] == "UNet"


def test_modelopt_config_patch_does_not_write_through_cache_symlink(tmp_path):
    """Normalizing config.json must not modify the shared HF cache blob."""
    blob = tmp_path / "blob"
    original = json.dumps(
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}
    )
    blob.write_text(original)
    component = tmp_path / "snapshot" / "transformer"
    component.mkdir(parents=True)
    (component / "config.json").symlink_to(blob)

    hf_diffusers_utils.prepare_diffusers_component_path_for_loading(str(component))

    patched = json.loads((component / "config.json").read_text())
    assert patched["quantization_config"]["quant_type"] == "FP8"
    assert blob.read_text() == original
