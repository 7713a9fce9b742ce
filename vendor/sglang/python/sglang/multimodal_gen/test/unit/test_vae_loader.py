import pathlib
import unittest
from tempfile import TemporaryDirectory
from unittest.mock import patch

import torch
import torch.nn as nn
from safetensors.torch import save_file as safetensors_save_file

from sglang.multimodal_gen.configs.models.vaes.minimax_h3_audio import (
    MiniMaxH3AudioVAEConfig,
)
from sglang.multimodal_gen.configs.models.vaes.sana import SanaVAEConfig
from sglang.multimodal_gen.configs.pipeline_configs.cosmos3 import Cosmos3Config
from sglang.multimodal_gen.configs.pipeline_configs.ltx_2 import LTX2PipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.wan import (
    FastWan2_2_TI2V_5B_Config,
    Wan2_2_I2V_A14B_Config,
    WanT2V480PConfig,
)
from sglang.multimodal_gen.runtime.loader.component_loaders import (
    component_loader,
    vae_loader,
)
from sglang.multimodal_gen.runtime.loader.component_loaders.component_loader import (
    ComponentCheckpointUnsupportedError,
)
from sglang.multimodal_gen.runtime.loader.component_loaders.vae_loader import (
    _assign_direct_gpu_vae_state,
    _backfill_ltx2_audio_vae_latent_stats,
    _channels_last_3d_prefix,
    _consume_vae_checkpoint_arch_metadata,
    _convert_conv3d_weights_to_channels_last_3d,
    _direct_gpu_vae_state_slots,
    _require_native_loader_for_quantized_vae,
    _should_use_channels_last_3d,
)
from sglang.multimodal_gen.runtime.loader.utils import (
    checkpoint_bytes,
    keep_checkpoint_mapped,
    load_model_state_dict,
)
from sglang.multimodal_gen.runtime.managers.memory_managers import (
    host_memory_budget,
)
from sglang.multimodal_gen.runtime.models.vaes import wanvae
from sglang.multimodal_gen.runtime.models.vaes.autoencoder_dc import AutoencoderDC
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.decoding_av import (
    LTX2AVDecodingStage,
)
from sglang.test.test_utils import CustomTestCase


class _FakeServerArgs:
    def __init__(self, pipeline_config, num_gpus=1):
        self.pipeline_config = pipeline_config
        self.num_gpus = num_gpus
        self.model_paths = {}
        self.revision = "test-revision"
        self.trust_remote_code = True
        self.layerwise_components = set()
        self.component_weights_paths = {}
        self.component_quantizations = {}
        self.component_precisions = {}
        self.component_direct_gpu_weight_loading = {}

    def resolve_component_attention_backend(self, _component_name):
        return None, None

    def resolve_component_backend_by_role(self, *_component_names):
        return {}

    def requested_component_attention_backend(self, _component_name):
        return None

    def should_start_component_on_cpu(self, _component_name):
        return False

    def should_configure_layerwise_offload_for_lazy_component(self, component_name):
        return component_name in self.layerwise_components

    def should_direct_gpu_weight_load_component(self, component_name):
        return self.component_direct_gpu_weight_loading.get(component_name, False)

    def should_use_fsdp_for_component(self, _component_name):
        return False


class TestDeploymentBytesRoot(unittest.TestCase):
    """A hub repo id is not a directory; the component path always is."""

    def test_the_component_parent_carries_the_variant_weight(self):
        with TemporaryDirectory() as root:
            variant = pathlib.Path(root) / "FL2VA"
            (variant / "video_vae").mkdir(parents=True)
            (variant / "transformer").mkdir()
            (variant / "video_vae" / "w.safetensors").write_bytes(b"x" * 128)
            (variant / "transformer" / "w.safetensors").write_bytes(b"x" * 512)
            self.assertEqual(
                checkpoint_bytes(str(variant)),
                640,
                "the parent of a component dir sums every sibling's shards",
            )
            self.assertEqual(
                checkpoint_bytes("MiniMaxAI/MiniMax-H3"),
                0,
                "a repo id globs nothing -- which is why the gate must never "
                "be fed one",
            )


class TestKeepCheckpointMapped(unittest.TestCase):
    """The mapping is for hosts that cannot afford the whole deployment."""

    def test_a_small_deployment_on_a_roomy_host_copies(self):
        with unittest.mock.patch.object(
            host_memory_budget, "host_memory_available_bytes", lambda: 64 * 1024**3
        ):
            self.assertFalse(
                keep_checkpoint_mapped(weight_bytes=3 * 1024**3, component="vae (VAE)"),
                "copies are the faster choice when the host has room: their "
                "pages are resident where a mapping's first use pays a fault",
            )

    def test_a_deployment_larger_than_the_host_stays_mapped(self):
        with unittest.mock.patch.object(
            host_memory_budget, "host_memory_available_bytes", lambda: 19 * 1024**3
        ):
            self.assertTrue(
                keep_checkpoint_mapped(
                    weight_bytes=117 * 1024**3, component="vae (VAE)"
                )
            )


class TestMatchCheckpointDtypes(CustomTestCase):
    """Assignment replaces a parameter, so only matching dtypes may stay mapped."""

    def test_assignment_preserves_mixed_dtypes_and_matching_storage(self):
        model = nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
        model.register_buffer("scale", torch.zeros(4, dtype=torch.float32))
        weights = {
            "weight": torch.ones(4, 4, dtype=torch.float32),
            "scale": torch.ones(4, dtype=torch.float32),
        }
        checkpoint_weight = weights["weight"]
        load_model_state_dict(model, weights, assign=True)
        self.assertEqual(model.weight.dtype, torch.bfloat16)
        self.assertEqual(model.scale.dtype, torch.float32)
        self.assertEqual(model.scale.data_ptr(), weights["scale"].data_ptr())
        self.assertNotEqual(model.weight.data_ptr(), checkpoint_weight.data_ptr())
        self.assertTrue(torch.equal(model.weight.float(), checkpoint_weight))


class TestPlainWeightNormCheckpoint(CustomTestCase):
    def test_adopts_a_folded_weight_without_reconstructing_it(self):
        module = nn.Sequential(
            torch.nn.utils.parametrizations.weight_norm(
                nn.Conv1d(2, 3, kernel_size=3, bias=False)
            )
        )
        expected = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3) / 19
        loaded = {"0.weight": expected}

        load_model_state_dict(module, loaded)

        self.assertEqual(set(module.state_dict()), {"0.weight"})
        self.assertTrue(torch.equal(module[0].weight, expected))

    def test_keeps_legacy_weight_norm_state_parameterized(self):
        module = nn.Sequential(
            torch.nn.utils.parametrizations.weight_norm(
                nn.Conv1d(2, 3, kernel_size=3, bias=False)
            )
        )
        original_state = module.state_dict()
        loaded = {
            "0.weight_g": original_state["0.parametrizations.weight.original0"].clone(),
            "0.weight_v": original_state["0.parametrizations.weight.original1"].clone(),
        }

        load_model_state_dict(module, loaded)

        self.assertIn("0.parametrizations.weight.original0", module.state_dict())

    def test_lazy_dc_ae_keeps_the_checkpoint_after_state_dict_builds_it(self):
        """SANA's DC-AE must load its checkpoint even though the loader reads
        ``state_dict()`` (which builds the lazy inner model) first."""
        config = SanaVAEConfig()
        for key, value in dict(
            latent_channels=4,
            attention_head_dim=4,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 16),
            decoder_block_out_channels=(8, 16),
            encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            encoder_qkv_multiscales=((), (5,)),
            decoder_qkv_multiscales=((), (5,)),
        ).items():
            setattr(config.arch_config, key, value)
        vae = AutoencoderDC(config)
        checkpoint = {k: torch.randn_like(v) for k, v in vae.state_dict().items()}

        load_model_state_dict(vae, dict(checkpoint), strict=False)

        state = vae.state_dict()
        self.assertTrue(all(torch.equal(state[k], v) for k, v in checkpoint.items()))

    def test_moves_checkpoint_latent_stats_into_arch_config(self):
        config = MiniMaxH3AudioVAEConfig()
        loaded = {
            "latents_mean": torch.arange(32, dtype=torch.float32),
            "latents_std": torch.arange(1, 33, dtype=torch.float32),
        }

        consumed = _consume_vae_checkpoint_arch_metadata(loaded, config, {})

        self.assertEqual(consumed, ("latents_mean", "latents_std"))
        self.assertEqual(config.arch_config.latents_mean, list(range(32)))
        self.assertEqual(config.arch_config.latents_std, list(range(1, 33)))
        self.assertEqual(loaded, {})


class TestDirectGPUVAEState(unittest.TestCase):
    class _StandardVAE(nn.Module):
        def __init__(self, *_args, **_kwargs):
            super().__init__()
            self.proj = nn.Linear(2, 2, bias=False)
            self.register_buffer("scale", torch.ones(1))

    def test_assigns_one_complete_state_without_a_cpu_state_dict(self):
        expected_weight = torch.arange(4, dtype=torch.float32).reshape(2, 2)
        expected_scale = torch.tensor([3.0])
        with TemporaryDirectory() as root:
            checkpoint = pathlib.Path(root) / "model.safetensors"
            safetensors_save_file(
                {"proj.weight": expected_weight, "scale": expected_scale}, checkpoint
            )
            with torch.device("meta"):
                vae = self._StandardVAE()
            _assign_direct_gpu_vae_state(
                vae,
                [str(checkpoint)],
                component_name="vae",
                device=torch.device("cpu"),
                vae_config=QwenImagePipelineConfig().vae_config,
            )

        self.assertTrue(torch.equal(vae.proj.weight, expected_weight))
        self.assertTrue(torch.equal(vae.scale, expected_scale))
        self.assertFalse(any(tensor.is_meta for tensor in vae.state_dict().values()))

    def test_direct_load_adopts_folded_weight_norm_and_checkpoint_metadata(self):
        class _WeightNormVAE(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.utils.parametrizations.weight_norm(
                    nn.Conv1d(2, 3, kernel_size=3, bias=False)
                )

        expected = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3) / 19
        config = MiniMaxH3AudioVAEConfig()
        with TemporaryDirectory() as root:
            checkpoint = pathlib.Path(root) / "model.safetensors"
            safetensors_save_file(
                {
                    "proj.weight": expected,
                    "latents_mean": torch.arange(32, dtype=torch.float32),
                    "latents_std": torch.arange(1, 33, dtype=torch.float32),
                },
                checkpoint,
            )
            with torch.device("meta"):
                vae = _WeightNormVAE()
            adaptations = _assign_direct_gpu_vae_state(
                vae,
                [str(checkpoint)],
                component_name="audio_vae",
                device=torch.device("cpu"),
                vae_config=config,
            )

        self.assertEqual(adaptations, (1, ("latents_mean", "latents_std")))
        self.assertEqual(set(vae.state_dict()), {"proj.weight"})
        self.assertTrue(torch.equal(vae.proj.weight, expected))
        self.assertEqual(config.arch_config.latents_mean, list(range(32)))
        self.assertEqual(config.arch_config.latents_std, list(range(1, 33)))

    def test_rejects_nonstandard_state_lifecycle(self):
        class _CustomVAE(self._StandardVAE):
            def state_dict(self, *args, **kwargs):
                return super().state_dict(*args, **kwargs)

        with torch.device("meta"):
            vae = _CustomVAE()

        with self.assertRaisesRegex(ComponentCheckpointUnsupportedError, "ABI"):
            _direct_gpu_vae_state_slots(vae, "vae")

    def test_ignores_nonpersistent_runtime_buffers(self):
        class _VAEWithRuntimeBuffer(self._StandardVAE):
            def __init__(self):
                super().__init__()
                self.register_buffer("runtime_cache", torch.zeros(1), persistent=False)

        with torch.device("meta"):
            vae = _VAEWithRuntimeBuffer()

        state, slots = _direct_gpu_vae_state_slots(vae, "vae")

        self.assertNotIn("runtime_cache", state)
        self.assertNotIn("runtime_cache", slots)

    def test_loader_streams_native_vae_without_the_legacy_cpu_state_dict(self):
        loader = vae_loader.VAELoader()
        server_args = _FakeServerArgs(QwenImagePipelineConfig())
        server_args.component_weights_paths = {}
        server_args.component_direct_gpu_weight_loading = {"vae": True}
        expected_weight = torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)
        expected_scale = torch.tensor([3.0], dtype=torch.bfloat16)

        with (
            TemporaryDirectory() as root,
            patch.object(
                vae_loader,
                "get_diffusers_component_config",
                return_value={"_class_name": "TestVAE"},
            ),
            patch.object(
                vae_loader.ModelRegistry,
                "resolve_model_cls",
                return_value=(self._StandardVAE, None),
            ),
            patch.object(
                vae_loader,
                "_list_safetensors_files",
                return_value=[str(pathlib.Path(root) / "model.safetensors")],
            ),
            patch.object(loader, "target_device", return_value=torch.device("cpu")),
            patch.object(
                vae_loader.current_platform,
                "optimize_vae",
                side_effect=lambda vae: vae,
            ),
            patch("safetensors.torch.load_file") as legacy_load,
        ):
            safetensors_save_file(
                {"proj.weight": expected_weight, "scale": expected_scale},
                pathlib.Path(root) / "model.safetensors",
            )
            loaded = loader.load_customized(root, server_args, "vae")

        legacy_load.assert_not_called()
        self.assertTrue(torch.equal(loaded.proj.weight, expected_weight))
        self.assertTrue(torch.equal(loaded.scale, expected_scale))

    def test_native_vae_ignores_diffusers_auto_map_for_weight_override(self):
        loader = vae_loader.VAELoader()
        expected_weight = torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)
        expected_scale = torch.tensor([3.0], dtype=torch.bfloat16)

        with TemporaryDirectory() as root:
            checkpoint = pathlib.Path(root) / "override.safetensors"
            safetensors_save_file(
                {"proj.weight": expected_weight, "scale": expected_scale}, checkpoint
            )

            for direct_gpu_loading in (False, True):
                with self.subTest(direct_gpu_loading=direct_gpu_loading):
                    pipeline_config = QwenImagePipelineConfig()
                    pipeline_config.native_only_components = ("vae",)
                    server_args = _FakeServerArgs(pipeline_config)
                    server_args.component_direct_gpu_weight_loading = {
                        "vae": direct_gpu_loading
                    }

                    with (
                        patch.object(
                            vae_loader,
                            "get_diffusers_component_config",
                            return_value={
                                "_class_name": "TestVAE",
                                "auto_map": {"AutoModel": "custom.TestVAE"},
                            },
                        ),
                        patch.object(
                            loader,
                            "resolve_component_weights_path",
                            return_value=str(checkpoint),
                        ),
                        patch.object(
                            vae_loader.ModelRegistry,
                            "resolve_model_cls",
                            return_value=(self._StandardVAE, None),
                        ),
                        patch.object(
                            loader, "target_device", return_value=torch.device("cpu")
                        ),
                        patch.object(
                            vae_loader.current_platform,
                            "optimize_vae",
                            side_effect=lambda vae: vae,
                        ),
                    ):
                        loaded = loader.load_customized(root, server_args, "vae")

                    self.assertTrue(torch.equal(loaded.proj.weight, expected_weight))
                    self.assertTrue(torch.equal(loaded.scale, expected_scale))

    def test_quantized_checkpoint_does_not_fall_back_from_direct_loading(self):
        loader = vae_loader.VAELoader()
        server_args = _FakeServerArgs(QwenImagePipelineConfig())
        server_args.component_direct_gpu_weight_loading = {"vae": True}

        with (
            patch.object(
                vae_loader,
                "get_diffusers_component_config",
                return_value={
                    "_class_name": "AutoencoderKL",
                    "quantization_config": {"quant_method": "bitsandbytes"},
                },
            ),
            patch("diffusers.AutoModel.from_pretrained") as native_load,
            patch.object(
                vae_loader.current_platform,
                "get_available_gpu_memory",
                return_value=10.0,
            ),
            self.assertRaisesRegex(
                ComponentCheckpointUnsupportedError, "Direct GPU loading"
            ),
        ):
            loader.load("/quantized/vae", server_args, "vae", "diffusers")

        native_load.assert_not_called()


class TestVAELoader(unittest.TestCase):
    def test_exact_precision_is_admitted_for_every_vae_component(self):
        loader = vae_loader.VAELoader()
        server_args = _FakeServerArgs(QwenImagePipelineConfig())
        server_args.component_precisions = {"vae": "bf16"}

        self.assertEqual(loader.component_load_precision(server_args, "vae"), "bf16")

        server_args.component_precisions = {"audio_vae": "bf16"}
        self.assertEqual(
            loader.component_load_precision(server_args, "audio_vae"), "bf16"
        )

    def test_exact_audio_vae_precision_reaches_customized_loader(self):
        loader = vae_loader.VAELoader()
        server_args = _FakeServerArgs(LTX2PipelineConfig())
        server_args.component_precisions = {"audio_vae": "bf16"}
        audio_vae = nn.Identity()

        with (
            patch.object(loader, "load_customized", return_value=audio_vae) as load,
            patch.object(
                vae_loader.current_platform,
                "get_available_gpu_memory",
                side_effect=[10.0, 9.0],
            ),
            patch(
                "sglang.multimodal_gen.runtime.loader.component_loaders."
                "component_loader.get_memory_usage_of_component",
                return_value=1.0,
            ),
        ):
            loaded, _ = loader.load(
                "/component/audio_vae", server_args, "audio_vae", "diffusers"
            )

        self.assertIs(loaded, audio_vae)
        load.assert_called_once_with("/component/audio_vae", server_args, "audio_vae")

    def test_ltx_audio_vae_use_honors_exact_component_precision(self):
        stage = LTX2AVDecodingStage(
            vae=torch.nn.Identity(),
            audio_vae=torch.nn.Identity(),
            vocoder=torch.nn.Identity(),
        )
        server_args = _FakeServerArgs(LTX2PipelineConfig())
        server_args.component_precisions = {"audio_vae": "fp32"}

        uses = {use.component_name: use for use in stage.component_uses(server_args)}
        self.assertEqual(uses["audio_vae"].target_dtype, torch.float32)

    def test_weights_override_keeps_base_component_config(self):
        loader = vae_loader.VAELoader()
        server_args = _FakeServerArgs(QwenImagePipelineConfig())
        server_args.component_weights_paths = {
            "audio_vae": "owner/repo/audio_vae.safetensors"
        }

        with (
            patch.object(component_loader, "resolve_weight", return_value="resolved"),
            patch.object(
                component_loader,
                "materialize_weight",
                return_value="/cache/audio.safetensors",
            ),
        ):
            self.assertEqual(
                loader.resolve_component_weights_path(
                    "/base/audio_vae", server_args, "audio_vae"
                ),
                "/cache/audio.safetensors",
            )

    def test_mps_layerwise_load_uses_residency_api(self):
        loader = vae_loader.VAELoader()
        server_args = _FakeServerArgs(QwenImagePipelineConfig())
        server_args.layerwise_components.add("vae")

        with patch.object(vae_loader.current_platform, "is_mps", return_value=True):
            self.assertEqual(
                loader.customized_load_kwargs_for_component(server_args, "vae"),
                {"cpu_offload_flag": True},
            )
            self.assertEqual(
                loader.customized_load_kwargs_for_component(server_args, "audio_vae"),
                {},
            )

    def test_quantized_vae_admission_leaves_plain_configs_unchanged(self):
        _require_native_loader_for_quantized_vae(
            {"_class_name": "AutoencoderKL"}, "vae"
        )

        with self.assertRaisesRegex(
            ComponentCheckpointUnsupportedError, "compression_config"
        ):
            _require_native_loader_for_quantized_vae(
                {
                    "_class_name": "AutoencoderKL",
                    "compression_config": {"quant_method": "compressed-tensors"},
                },
                "vae",
            )

        with self.assertRaisesRegex(
            ComponentCheckpointUnsupportedError,
            r"text_config\.quantization_config",
        ):
            _require_native_loader_for_quantized_vae(
                {
                    "_class_name": "AutoencoderKL",
                    "text_config": {
                        "quantization_config": {
                            "quant_method": "bitsandbytes",
                            "load_in_4bit": True,
                        }
                    },
                },
                "vae",
            )

    def test_quantized_vae_routes_to_diffusers_native_loader(self):
        loader = vae_loader.VAELoader()
        server_args = _FakeServerArgs(QwenImagePipelineConfig())
        native_vae = nn.Linear(1, 1)

        with (
            TemporaryDirectory() as component_path,
            patch.object(
                vae_loader,
                "get_diffusers_component_config",
                return_value={
                    "_class_name": "AutoencoderKL",
                    "quantization_config": {
                        "quant_method": "bitsandbytes",
                        "load_in_4bit": True,
                    },
                },
            ),
            patch(
                "diffusers.AutoModel.from_pretrained",
                return_value=native_vae,
            ) as native_load,
            patch.object(loader, "target_device", return_value=torch.device("cpu")),
            patch.object(native_vae, "to", wraps=native_vae.to) as module_to,
            patch.object(
                vae_loader.current_platform,
                "get_available_gpu_memory",
                side_effect=[10.0, 9.0],
            ),
            patch(
                "sglang.multimodal_gen.runtime.loader.component_loaders."
                "component_loader.get_memory_usage_of_component",
                return_value=1.0,
            ),
        ):
            loaded, consumed = loader.load(
                component_path, server_args, "vae", "diffusers"
            )

        self.assertIs(loaded, native_vae)
        self.assertFalse(loaded.training)
        self.assertEqual(consumed, 1.0)
        self.assertEqual(server_args.model_paths["vae"], component_path)
        native_load.assert_called_once_with(
            component_path,
            revision="test-revision",
            trust_remote_code=True,
            torch_dtype=torch.bfloat16,
        )
        module_to.assert_called_once_with(torch.device("cpu"))

    def test_native_only_quantized_vae_fails_closed(self):
        pipeline_config = QwenImagePipelineConfig()
        pipeline_config.native_only_components = ("vae",)
        server_args = _FakeServerArgs(pipeline_config)
        loader = vae_loader.VAELoader()

        with (
            patch.object(
                vae_loader,
                "get_diffusers_component_config",
                return_value={
                    "_class_name": "AutoencoderKL",
                    "quantization_config": {
                        "quant_method": "bitsandbytes",
                        "load_in_4bit": True,
                    },
                },
            ),
            patch("diffusers.AutoModel.from_pretrained") as native_load,
            patch.object(
                vae_loader.current_platform,
                "get_available_gpu_memory",
                return_value=10.0,
            ),
        ):
            with self.assertRaisesRegex(
                ComponentCheckpointUnsupportedError, "native-only SGLang"
            ):
                loader.load("/quantized/vae", server_args, "vae", "diffusers")

        native_load.assert_not_called()

    def test_backfill_ltx2_audio_vae_latent_stats_maps_official_keys(self):
        loaded = {
            "per_channel_statistics.mean-of-means": torch.tensor([1.0, 2.0]),
            "per_channel_statistics.std-of-means": torch.tensor([3.0, 4.0]),
        }

        _backfill_ltx2_audio_vae_latent_stats(loaded, "audio_vae")

        self.assertTrue(torch.equal(loaded["latents_mean"], torch.tensor([1.0, 2.0])))
        self.assertTrue(torch.equal(loaded["latents_std"], torch.tensor([3.0, 4.0])))

    def test_backfill_ltx2_audio_vae_latent_stats_does_not_override_existing(self):
        loaded = {
            "per_channel_statistics.mean-of-means": torch.tensor([1.0, 2.0]),
            "per_channel_statistics.std-of-means": torch.tensor([3.0, 4.0]),
            "latents_mean": torch.tensor([5.0, 6.0]),
            "latents_std": torch.tensor([7.0, 8.0]),
        }

        _backfill_ltx2_audio_vae_latent_stats(loaded, "audio_vae")

        self.assertTrue(torch.equal(loaded["latents_mean"], torch.tensor([5.0, 6.0])))
        self.assertTrue(torch.equal(loaded["latents_std"], torch.tensor([7.0, 8.0])))

    def test_backfill_ltx2_audio_vae_latent_stats_skips_non_audio_vae(self):
        loaded = {
            "per_channel_statistics.mean-of-means": torch.tensor([1.0]),
            "per_channel_statistics.std-of-means": torch.tensor([2.0]),
        }

        _backfill_ltx2_audio_vae_latent_stats(loaded, "vae")

        self.assertNotIn("latents_mean", loaded)
        self.assertNotIn("latents_std", loaded)

    def test_channels_last_3d_cuda_model_defaults(self):
        cases = [
            (QwenImagePipelineConfig, 1, "vae", True),
            (WanT2V480PConfig, 1, "video_vae", True),
            (FastWan2_2_TI2V_5B_Config, 1, "video_vae", True),
            # Wan's spatial-parallel decode runs channels_last too
            (Wan2_2_I2V_A14B_Config, 2, "video_vae", True),
            (WanT2V480PConfig, 4, "video_vae", True),
            (LTX2PipelineConfig, 1, "video_vae", True),
            (LTX2PipelineConfig, 2, "video_vae", False),
            (Cosmos3Config, 1, "vae", True),
            (Cosmos3Config, 1, "video_vae", True),
            (Cosmos3Config, 2, "video_vae", True),
            (Cosmos3Config, 4, "vae", True),
        ]
        with (
            patch.dict("os.environ", {}, clear=True),
            patch.object(vae_loader.current_platform, "is_cuda", return_value=True),
            patch.object(vae_loader.current_platform, "is_rocm", return_value=False),
        ):
            for config_cls, num_gpus, component, expected in cases:
                with self.subTest(config=config_cls.__name__, num_gpus=num_gpus):
                    server_args = _FakeServerArgs(config_cls(), num_gpus=num_gpus)
                    self.assertEqual(
                        _should_use_channels_last_3d(server_args, component), expected
                    )

    @unittest.skipUnless(
        hasattr(torch, "channels_last_3d"), "channels_last_3d is unavailable"
    )
    def test_channels_last_3d_multi_gpu_wan_keeps_encoder_layout(self):
        cases = [
            (WanT2V480PConfig, 1, {"encoder", "quant_conv", "decoder.0"}),
            (Wan2_2_I2V_A14B_Config, 2, {"decoder.0"}),
            (Cosmos3Config, 4, {"decoder.0"}),
            (QwenImagePipelineConfig, 2, {"encoder", "quant_conv", "decoder.0"}),
        ]
        for config_cls, num_gpus, expected in cases:
            with (
                self.subTest(config=config_cls.__name__, num_gpus=num_gpus),
                patch.dict("os.environ", {}, clear=True),
            ):
                vae = nn.Module()
                vae.encoder = nn.Conv3d(2, 2, 3)
                vae.quant_conv = nn.Conv3d(2, 2, 3)
                vae.decoder = nn.Sequential(nn.Conv3d(2, 2, 3))
                prefix = _channels_last_3d_prefix(
                    _FakeServerArgs(config_cls(), num_gpus=num_gpus)
                )
                _convert_conv3d_weights_to_channels_last_3d(vae, prefix)
                converted = {
                    name
                    for name, m in vae.named_modules()
                    if isinstance(m, nn.Conv3d)
                    and m.weight.is_contiguous(memory_format=torch.channels_last_3d)
                }
                self.assertEqual(converted, expected)

    def test_channels_last_3d_env_override_converts_whole_multi_gpu_wan_vae(self):
        server_args = _FakeServerArgs(Wan2_2_I2V_A14B_Config(), num_gpus=2)
        with patch.dict("os.environ", {"SGLANG_DIFFUSION_VAE_CHANNELS_LAST_3D": "1"}):
            self.assertEqual(_channels_last_3d_prefix(server_args), "")
        with patch.dict(
            "os.environ", {"SGLANG_DIFFUSION_VAE_CHANNELS_LAST_3D": "auto"}
        ):
            self.assertEqual(_channels_last_3d_prefix(server_args), "decoder.")

    def test_channels_last_3d_can_be_disabled_by_env(self):
        with (
            patch.dict(
                "os.environ", {"SGLANG_DIFFUSION_VAE_CHANNELS_LAST_3D": "false"}
            ),
            patch.object(vae_loader.current_platform, "is_cuda", return_value=True),
            patch.object(vae_loader.current_platform, "is_rocm", return_value=False),
        ):
            server_args = _FakeServerArgs(QwenImagePipelineConfig())
            self.assertFalse(_should_use_channels_last_3d(server_args, "vae"))

    def test_channels_last_3d_can_be_enabled_by_env(self):
        with (
            patch.dict("os.environ", {"SGLANG_DIFFUSION_VAE_CHANNELS_LAST_3D": "true"}),
            patch.object(vae_loader.current_platform, "is_cuda", return_value=True),
            patch.object(vae_loader.current_platform, "is_rocm", return_value=False),
        ):
            server_args = _FakeServerArgs(LTX2PipelineConfig(), num_gpus=2)
            self.assertTrue(_should_use_channels_last_3d(server_args, "video_vae"))

    def test_channels_last_3d_auto_uses_model_policy(self):
        with (
            patch.dict("os.environ", {"SGLANG_DIFFUSION_VAE_CHANNELS_LAST_3D": "auto"}),
            patch.object(vae_loader.current_platform, "is_cuda", return_value=True),
            patch.object(vae_loader.current_platform, "is_rocm", return_value=False),
        ):
            wan_args = _FakeServerArgs(WanT2V480PConfig(), num_gpus=1)
            ltx_args = _FakeServerArgs(LTX2PipelineConfig(), num_gpus=2)

            self.assertTrue(_should_use_channels_last_3d(wan_args, "video_vae"))
            self.assertFalse(_should_use_channels_last_3d(ltx_args, "video_vae"))

    def test_channels_last_3d_skips_non_video_vae_components(self):
        with (
            patch.dict("os.environ", {}, clear=True),
            patch.object(vae_loader.current_platform, "is_cuda", return_value=True),
            patch.object(vae_loader.current_platform, "is_rocm", return_value=False),
        ):
            server_args = _FakeServerArgs(QwenImagePipelineConfig())
            self.assertFalse(_should_use_channels_last_3d(server_args, "audio_vae"))

    def test_channels_last_3d_skips_unsupported_platforms(self):
        with (
            patch.dict("os.environ", {}, clear=True),
            patch.object(vae_loader.current_platform, "is_cuda", return_value=False),
            patch.object(vae_loader.current_platform, "is_rocm", return_value=False),
            patch.object(vae_loader.current_platform, "is_xpu", return_value=False),
        ):
            server_args = _FakeServerArgs(QwenImagePipelineConfig())
            self.assertFalse(_should_use_channels_last_3d(server_args, "vae"))

    def test_channels_last_3d_selected_on_xpu(self):
        with (
            patch.dict("os.environ", {}, clear=True),
            patch.object(vae_loader.current_platform, "is_cuda", return_value=False),
            patch.object(vae_loader.current_platform, "is_rocm", return_value=False),
            patch.object(vae_loader.current_platform, "is_xpu", return_value=True),
        ):
            server_args = _FakeServerArgs(QwenImagePipelineConfig())
            self.assertTrue(_should_use_channels_last_3d(server_args, "vae"))

    @unittest.skipUnless(
        hasattr(torch, "channels_last_3d"), "channels_last_3d is unavailable"
    )
    def test_match_conv3d_input_format_skips_non_cuda_platforms(self):
        x = torch.randn(1, 3, 2, 4, 4)
        weight = torch.randn(3, 3, 1, 1, 1).contiguous(
            memory_format=torch.channels_last_3d
        )

        with (
            patch.object(wanvae.current_platform, "is_cuda", return_value=False),
            patch.object(wanvae.current_platform, "is_rocm", return_value=False),
            patch.object(wanvae.current_platform, "is_xpu", return_value=False),
        ):
            out = wanvae.match_conv3d_input_format(x, weight)

        self.assertIs(out, x)

    @unittest.skipUnless(
        hasattr(torch, "channels_last_3d"), "channels_last_3d is unavailable"
    )
    def test_match_conv3d_input_format_uses_channels_last_3d_on_xpu(self):
        x = torch.randn(1, 3, 2, 4, 4)
        weight = torch.randn(3, 3, 1, 1, 1).contiguous(
            memory_format=torch.channels_last_3d
        )

        with (
            patch.object(wanvae.current_platform, "is_cuda", return_value=False),
            patch.object(wanvae.current_platform, "is_rocm", return_value=False),
            patch.object(wanvae.current_platform, "is_xpu", return_value=True),
        ):
            out = wanvae.match_conv3d_input_format(x, weight)

        self.assertTrue(out.is_contiguous(memory_format=torch.channels_last_3d))

    @unittest.skipUnless(
        hasattr(torch, "channels_last_3d"), "channels_last_3d is unavailable"
    )
    def test_match_conv3d_input_format_uses_channels_last_3d_on_cuda(self):
        x = torch.randn(1, 3, 2, 4, 4)
        weight = torch.randn(3, 3, 1, 1, 1).contiguous(
            memory_format=torch.channels_last_3d
        )

        with (
            patch.object(wanvae.current_platform, "is_cuda", return_value=True),
            patch.object(wanvae.current_platform, "is_rocm", return_value=False),
        ):
            out = wanvae.match_conv3d_input_format(x, weight)

        self.assertTrue(out.is_contiguous(memory_format=torch.channels_last_3d))


if __name__ == "__main__":
    unittest.main()
