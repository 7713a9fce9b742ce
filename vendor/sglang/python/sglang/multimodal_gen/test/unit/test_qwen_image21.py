# SPDX-License-Identifier: Apache-2.0
import argparse
import json
import sys
from contextlib import nullcontext
from types import SimpleNamespace
from unittest.mock import Mock, patch

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler as ReferenceFlowMatchScheduler
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from transformers import BatchFeature

from sglang.multimodal_gen import registry
from sglang.multimodal_gen.configs.models.dits.qwenimage21 import (
    QwenImage21ArchConfig,
    QwenImage21DitConfig,
)
from sglang.multimodal_gen.configs.models.vaes.qwenimage21 import (
    QwenImage21VAEArchConfig,
    QwenImage21VAEConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.base import PipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.qwen_image21 import (
    QwenImage21PipelineConfig,
)
from sglang.multimodal_gen.configs.sample.qwenimage import QwenImage2512SamplingParams
from sglang.multimodal_gen.configs.sample.qwenimage21 import QwenImage21SamplingParams
from sglang.multimodal_gen.configs.sample.sampling_params import (
    DataType,
    SamplingParams,
)
from sglang.multimodal_gen.registry import _get_config_info
from sglang.multimodal_gen.runtime.breakable_cuda_graph.replay_token import (
    replay_token_scope,
)
from sglang.multimodal_gen.runtime.cache.conditioning import ConditioningCache
from sglang.multimodal_gen.runtime.entrypoints.openai import utils as openai_utils
from sglang.multimodal_gen.runtime.entrypoints.openai.image_api import (
    _resolve_image_output_format,
)
from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request
from sglang.multimodal_gen.runtime.layers.linear import UnquantizedLinearMethod
from sglang.multimodal_gen.runtime.managers.memory_managers.component_manager import (
    ResidencyState,
)
from sglang.multimodal_gen.runtime.managers.memory_managers.component_residency_strategies import (
    ComponentOffloadStrategy,
)
from sglang.multimodal_gen.runtime.managers.scheduler import Scheduler
from sglang.multimodal_gen.runtime.models.dits.qwen_image21 import (
    PrefixPad,
    QwenImage21Attention,
    QwenImage21TransformerBlock,
    build_layout,
)
from sglang.multimodal_gen.runtime.models.encoders.base import (
    EncoderTensorParallelMixin,
)
from sglang.multimodal_gen.runtime.models.encoders.qwen3vl_vision import (
    Qwen3VLVisionRotaryEmbedding,
)
from sglang.multimodal_gen.runtime.models.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from sglang.multimodal_gen.runtime.models.vaes.autoencoder_kl_qwenimage21 import (
    AutoencoderKLQwenImage21,
    QwenImage21RMS_norm,
    QwenImage21Upsample,
    _patchify,
    _unpatchify,
)
from sglang.multimodal_gen.runtime.pipelines.qwen_image21 import QwenImage21Pipeline
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch, Req
from sglang.multimodal_gen.runtime.pipelines_core.stages.decoding import DecodingStage
from sglang.multimodal_gen.runtime.pipelines_core.stages.input_validation import (
    InputValidationStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.qwen_image21 import (
    QwenImage21EncodingStage,
    QwenImage21InputValidationStage,
    collapse_image_slots,
    prepare_qwen21_mu,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.timestep_preparation import (
    TimestepPreparationStage,
)
from sglang.multimodal_gen.runtime.platforms.rocm import RocmPlatform
from sglang.multimodal_gen.runtime.server_args import ServerArgs
from sglang.multimodal_gen.runtime.warmup_request_builder import build_warmup_reqs
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    breakable_cuda_graph as bcg,
)


@pytest.fixture
def qwen21_server_args():
    return SimpleNamespace(
        model_path="Qwen/Qwen-Image-2.1-Turbo",
        model_id=None,
        backend="sglang",
        performance_mode="manual",
        pipeline_class_name=None,
        pipeline_config=QwenImage21PipelineConfig(),
        output_path=None,
        comfyui_mode=True,
        enable_cfg_parallel=False,
        enable_breakable_cuda_graph=False,
        enable_torch_compile=False,
        enable_trace=False,
        attention_backend_config={},
        num_gpus=1,
        warmup_steps=8,
        warmup_num_frames=None,
    )


@pytest.mark.parametrize(
    "requested,expected",
    [
        ((1280, 720), (1280, 704)),
        ((1279, 735), (1248, 704)),
        ((1024, 1024), (1024, 1024)),
        ((1, 31), (32, 32)),
    ],
)
def test_qwen21_resolution_alignment(requested, expected):
    sampling = QwenImage21SamplingParams(width=requested[0], height=requested[1])
    assert (sampling.width, sampling.height) == expected


def test_request_alignment_precedes_pipeline_validation(qwen21_server_args):
    """A 720p request must reach validation with dimensions divisible by 32."""
    sampling = QwenImage21SamplingParams(prompt="a coffee shop", width=1280, height=720)
    batch = prepare_request(qwen21_server_args, sampling)
    QwenImage21InputValidationStage().forward(batch, qwen21_server_args)
    assert (batch.width, batch.height) == (1280, 704)


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"size": "1280x720"}, (1280, 704)),
        ({"width": 1279, "height": 735}, (1248, 704)),
        ({"size": "1280x720", "height": 769}, (1280, 768)),
    ],
)
def test_http_size_merging_preserves_alignment(qwen21_server_args, fields, expected):
    with (
        patch.object(
            openai_utils, "get_global_server_args", return_value=qwen21_server_args
        ),
        patch.object(
            SamplingParams, "from_pretrained", return_value=QwenImage21SamplingParams()
        ),
    ):
        sampling = openai_utils.build_sampling_params(
            "size-regression",
            prompt="a coffee shop",
            request_data_type=DataType.IMAGE,
            **fields,
        )
    assert (sampling.width, sampling.height) == expected


def test_cli_720p_shortcut_preserves_alignment(qwen21_server_args):
    cli = QwenImage21SamplingParams.get_cli_args(
        argparse.Namespace(resolution_720p=True, width=None, height=None)
    )
    with patch.object(
        SamplingParams, "from_pretrained", return_value=QwenImage21SamplingParams()
    ):
        sampling = SamplingParams.from_user_sampling_params_args(
            model_path=qwen21_server_args.model_path,
            server_args=qwen21_server_args,
            prompt="a coffee shop",
            **cli,
        )
    assert (sampling.width, sampling.height) == (1280, 704)


@pytest.mark.parametrize("dimension", ["width", "height"])
@pytest.mark.parametrize("value", [0, -1])
def test_alignment_does_not_make_invalid_dimensions_positive(
    qwen21_server_args, dimension, value
):
    sampling = QwenImage21SamplingParams(prompt="a coffee shop", **{dimension: value})
    with pytest.raises(ValueError, match="must be positive"):
        prepare_request(qwen21_server_args, sampling)


@pytest.mark.parametrize("bcg", [False, True])
def test_synthetic_warmup_uses_the_same_grid_as_serving(
    qwen21_server_args, tmp_path, bcg
):
    """Warmup's post-construction size overrides must not restore invalid 720p."""
    defaults = QwenImage21SamplingParams()
    image_path = tmp_path / "warmup.png"
    Image.new("RGB", (64, 64)).save(image_path)
    qwen21_server_args.enable_breakable_cuda_graph = bcg
    with patch(
        "sglang.multimodal_gen.runtime.warmup_request_builder.get_model_sampling_defaults",
        return_value=defaults,
    ):
        reqs = build_warmup_reqs(
            qwen21_server_args,
            warmup_resolutions=["1280x720"],
            warmup_input_path=str(image_path),
            server_based_warmup=True,
        )
    assert len(reqs) == 1
    assert (reqs[0].width, reqs[0].height) == (1280, 704)
    QwenImage21InputValidationStage().forward(reqs[0], qwen21_server_args)
    assert (defaults.width, defaults.height) == (1024, 1024)


def test_legacy_qwen_keeps_its_720p_resolution():
    sampling = QwenImage2512SamplingParams(width=1280, height=720)
    assert (sampling.width, sampling.height) == (1280, 720)


@pytest.mark.parametrize("steps", [2, 40])
@pytest.mark.parametrize("preset", [False, True])
@pytest.mark.parametrize("explicit_sigmas", [None, [1.0, 0.7, 0.3]])
@pytest.mark.parametrize("dynamic_shifting", [False, True])
def test_checkpoint_sigma_grid_reaches_request_scheduler(
    tmp_path, monkeypatch, steps, preset, explicit_sigmas, dynamic_shifting
):
    sample_sigmas = [
        1.0,
        0.978453,
        0.95418,
        0.926626,
        0.89508,
        0.845148,
        0.704534,
        0.414568,
    ]
    model_index = {
        "_class_name": "QwenImage21Pipeline",
        "_diffusers_version": "0.41.0.dev0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    if preset:
        model_index["sample_sigmas"] = sample_sigmas
    (tmp_path / "model_index.json").write_text(json.dumps(model_index))
    (tmp_path / "scheduler").mkdir()
    config = QwenImage21PipelineConfig()
    args = SimpleNamespace(
        pipeline_config=config,
        model_subfolder=None,
        revision=None,
        enable_cfg_parallel=False,
    )
    pipeline = object.__new__(QwenImage21Pipeline)
    pipeline.model_path = str(tmp_path)
    pipeline.server_args = args
    loaded_config = pipeline._load_config()
    assert "sample_sigmas" not in loaded_config
    assert config.sample_sigmas == (sample_sigmas if preset else None)

    batch = Req(
        sampling_params=QwenImage21SamplingParams(
            prompt="a ceramic teapot",
            height=1024,
            width=1024,
            num_inference_steps=steps,
        ),
        sigmas=explicit_sigmas,
    )
    QwenImage21InputValidationStage().forward(batch, args)
    batch.extra["qwen21_mu"] = 0.7
    scheduler_kwargs = dict(
        use_dynamic_shifting=dynamic_shifting,
        shift=1.0,
        shift_terminal=0.02 if dynamic_shifting else None,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**scheduler_kwargs)
    monkeypatch.setattr(
        "sglang.multimodal_gen.runtime.pipelines_core.stages.timestep_preparation.get_local_torch_device",
        lambda: torch.device("cpu"),
    )
    TimestepPreparationStage(scheduler, [prepare_qwen21_mu]).forward(batch, args)
    expected_sigmas = explicit_sigmas
    if expected_sigmas is None:
        expected_sigmas = sample_sigmas if preset else np.linspace(1, 1 / steps, steps)
    # preserve the native scheduler's existing dynamic-shift rounding; Turbo's
    # unshifted grid must also match the Diffusers scheduler bit for bit
    scheduler_cls = (
        FlowMatchEulerDiscreteScheduler
        if dynamic_shifting
        else ReferenceFlowMatchScheduler
    )
    reference = scheduler_cls(**scheduler_kwargs)
    reference.set_timesteps(sigmas=expected_sigmas, mu=0.7, device="cpu")
    torch.testing.assert_close(batch.timesteps, reference.timesteps, atol=0, rtol=0)
    torch.testing.assert_close(batch.scheduler.sigmas, reference.sigmas, atol=0, rtol=0)
    assert batch.num_inference_steps == len(expected_sigmas)
    assert batch.scheduler.num_inference_steps == len(expected_sigmas)
    assert isinstance(batch.sigmas, list)
    # request-local schedules must not mutate the checkpoint's preset
    batch.sigmas[0] = 0.9
    assert config.sample_sigmas == (sample_sigmas if preset else None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_nearest_upsample_preserves_every_finite_low_precision_value(
    dtype, layout, device
):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA required")
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)].reshape(1, 2, -1, 128).to(device)
    if layout == "channels_last":
        values = values.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        values = values.transpose(2, 3)
    upsample = QwenImage21Upsample(scale_factor=2, mode="nearest-exact")
    expected = torch.nn.functional.interpolate(
        values.float(), scale_factor=2, mode="nearest-exact"
    ).to(dtype)
    actual = upsample(values)
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("prompt", ["edit", ""])
@pytest.mark.parametrize("image_count", [0, 1, 2])
def test_prompt_conditioning_uses_training_template_and_pre_norm(prompt, image_count):
    hidden = torch.arange(24).reshape(1, 6, 4).float()
    inputs = BatchFeature(
        data={
            "input_ids": torch.tensor([[1, 2, 99, 99, 3, 0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
        }
    )
    processor = Mock(return_value=inputs)
    processor.tokenizer.convert_tokens_to_ids.return_value = 99
    processor.apply_chat_template.return_value = [[1]]
    encoder = Mock(return_value=SimpleNamespace(hidden_states=(hidden,)))
    stage = QwenImage21EncodingStage(encoder, processor, None, None)
    stage.use_declared_component = Mock(return_value=nullcontext(encoder))
    images = [Image.new("RGBA", (2, 1), (12, 34, 56, 0)) for _ in range(image_count)]
    for image in images:
        image.putpixel((1, 0), (12, 34, 56, 255))
    actual, slots = stage.encode_prompt(prompt, images, "cpu")
    torch.testing.assert_close(actual, hidden[0, [1, 2, 4]])
    assert slots.tolist() == [False, True, False]
    encoder.model.language_model.norm.assert_not_called()
    assert encoder.model.visual.fp32_position_interpolation is False
    assert encoder.model.visual.rotary_pos_emb.recompute_on_device_change is True
    kwargs = processor.call_args.kwargs
    prefix = " ".join(
        f"<image{i + 1}><|vision_start|><|image_pad|><|vision_end|>"
        for i in range(image_count)
    )
    assert kwargs["text"] == [
        "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
        f"<|im_start|>user\n{prefix}{prompt or ' '}<|im_end|>\n<|im_start|>assistant\n"
    ]
    assert kwargs["padding_side"] == "left"
    for image in kwargs.get("images", []):
        assert image.mode == "RGB"
        assert image.getpixel((0, 0)) == (255, 255, 255)
        assert image.getpixel((1, 0)) == (12, 34, 56)
    for image in images:
        assert image.mode == "RGBA"
        assert image.getpixel((0, 0)) == (12, 34, 56, 0)


class ConditioningTestEncoder(EncoderTensorParallelMixin, torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones((), device=device))
        self.model = SimpleNamespace(
            visual=SimpleNamespace(rotary_pos_emb=SimpleNamespace())
        )
        self.calls = 0

    def forward(self, input_ids, **kwargs):
        self.calls += 1
        hidden = input_ids[..., None].float().expand(-1, -1, 4) * self.weight
        return SimpleNamespace(hidden_states=tuple(hidden + i for i in range(32)))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="CUDA required"
            ),
        ),
    ],
)
@torch.no_grad()
def test_prompt_cache_skips_processor_and_weight_preparation(device):
    def process(text, **kwargs):
        image_value = sum(kwargs["images"][0].getpixel((0, 0)))
        return BatchFeature(
            data={
                "input_ids": torch.tensor([[1, len(text[0]), 99, 99, image_value, 0]]),
                "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
            }
        )

    processor = Mock(side_effect=process)
    processor.tokenizer.convert_tokens_to_ids.return_value = 99
    processor.apply_chat_template.return_value = [[1]]
    encoder = ConditioningTestEncoder(device).eval()
    stage = QwenImage21EncodingStage(encoder, processor, None, None)
    stage.use_declared_component = Mock(return_value=nullcontext(encoder))
    image = Image.new("RGBA", (2, 2), (12, 34, 56, 128))
    cache = ConditioningCache(1024)
    with cache.scope():
        first, slots = stage.encode_prompt("edit", [image], device)
        expected = first.clone()
        first.zero_()
        slots.zero_()
        restored, slots = stage.encode_prompt("edit", [image.copy()], device)
        torch.testing.assert_close(restored, expected, atol=0, rtol=0)
        assert slots.tolist() == [False, True, False]
        assert encoder.calls == processor.call_count == 1
        stage.use_declared_component.assert_called_once()
        assert cache.stats()["entries"] == 1
        assert cache.bytes == 3 * 4 * 4 + 3
        assert cache.bypasses == 0  # no oversized duplicate of all hidden states
        changed, _ = stage.encode_prompt("another edit", [image], device)
        assert not torch.equal(changed, expected)
        image.putpixel((0, 0), (12, 34, 56, 255))
        changed_alpha, _ = stage.encode_prompt("edit", [image], device)
        assert not torch.equal(changed_alpha, expected)
        assert encoder.calls == 3
        with cache.scope(refresh=True):
            stage.encode_prompt("edit", [image], device)
        with cache.scope(enabled=False):
            stage.encode_prompt("edit", [image], device)
        assert encoder.calls == processor.call_count == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
def test_encoder_component_offload_preserves_loaded_dtypes(monkeypatch):
    monkeypatch.setattr(
        "sglang.multimodal_gen.runtime.managers.memory_managers."
        "component_residency_strategies.get_local_torch_device",
        lambda: torch.device("cuda", torch.cuda.current_device()),
    )
    encoder = torch.nn.Module()
    encoder.model = torch.nn.Module()
    encoder.model.visual = torch.nn.Module()
    encoder.model.visual.rotary_pos_emb = Qwen3VLVisionRotaryEmbedding(36)
    with torch.device("cuda"):
        expected_rope = Qwen3VLVisionRotaryEmbedding(36)(64)
    encoder.register_parameter(
        "embedding", torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    )
    encoder.register_parameter(
        "weight",
        torch.nn.Parameter(
            torch.tensor([0.25, -0.5]).to(torch.float8_e4m3fn), requires_grad=False
        ),
    )
    frequencies = torch.tensor([1.0 / 3, 1.0 / 7])
    encoder.register_buffer("inv_freq", frequencies.clone())
    processor = Mock()
    processor.apply_chat_template.return_value = [[1]]
    stage = QwenImage21EncodingStage(encoder, processor, None, None)
    use = stage.component_uses(None, "conditioning")[0]
    strategy = ComponentOffloadStrategy()
    state = ResidencyState(batch_is_warmup=False)
    weight_bytes = encoder.weight.view(torch.uint8).clone()

    for _ in range(2):
        strategy.prefetch_for_use(encoder, use, state)
        strategy.wait_for_use(encoder, use, state)
        assert encoder.embedding.device.type == "cuda"
        assert encoder.embedding.dtype == torch.bfloat16
        assert encoder.weight.dtype == torch.float8_e4m3fn
        assert encoder.inv_freq.dtype == torch.float32
        torch.testing.assert_close(encoder.inv_freq.cpu(), frequencies, atol=0, rtol=0)
        torch.testing.assert_close(
            encoder.model.visual.rotary_pos_emb(64), expected_rope, atol=0, rtol=0
        )
        assert torch.equal(encoder.weight.view(torch.uint8).cpu(), weight_bytes)
        strategy.finish_use(encoder, use, state)
        torch.cuda.synchronize()
        assert encoder.embedding.device.type == "cpu"


def test_condition_slots_expand_to_actual_latent_grid():
    hidden = torch.randn(22, 8)
    ids = torch.tensor([1, 2] + [99] * 16 + [3, 4, 5, 6])
    collapsed, slots = collapse_image_slots(hidden, ids, 99)
    assert collapsed.shape == (7, 8)
    layout = build_layout(slots.tolist(), [(1, 4, 8), (1, 2, 2)], (4, 6, 6), "cpu")
    assert len(layout["image_indices"]) == 32
    assert len(layout["prefix_rope"]) == 38
    assert layout["segments"] == ((0, 2, False), (2, 34, True), (34, 38, False))
    torch.testing.assert_close(collapsed[slots][0], hidden[2])


class _RecordingAttention(torch.nn.Module):
    def forward(self, x, ropes, prefixes, layouts, caches, prefix_pad):
        self.seen = caches
        return torch.zeros_like(x), [None] * len(caches)


def _block_recording_caches(layer_id, dim=4):
    # The real block forward with its attention swapped for a recorder.
    block = QwenImage21TransformerBlock.__new__(QwenImage21TransformerBlock)
    torch.nn.Module.__init__(block)
    block._layer_id = layer_id
    block.img_norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False)
    block.img_norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False)
    block.attn = _RecordingAttention()
    block.img_mlp = torch.nn.Identity()
    return block


class _UnifiedBlocks(torch.nn.Module):
    """Cache-DiT's wrapper: every wrapped block receives the same extras."""

    def __init__(self, blocks):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(blocks)

    def forward(self, hidden_states, *args):
        x = hidden_states
        for block in self.transformer_blocks:
            x = block(x, *args)
        return x


@pytest.mark.parametrize("cache_dit_wrapped", [False, True])
def test_blocks_keep_per_layer_prefix_kv(cache_dit_wrapped):
    blocks = [_block_recording_caches(layer_id) for layer_id in range(3)]
    runners = [_UnifiedBlocks(blocks)] if cache_dit_wrapped else blocks
    prefix_caches = [[{"layer": 0}, {"layer": 1}, {"layer": 2}]]
    x = torch.zeros(1, 2, 4)
    modulation = (torch.zeros(1, 1, 4),) * 4
    prefix_states = [{"hidden_states": None}]
    for runner in runners:
        x = runner(
            x, modulation, prefix_states, None, [None], [None], prefix_caches, None
        )
    assert [block.attn.seen for block in blocks] == [
        [cache] for cache in prefix_caches[0]
    ]


def test_adjacent_image_slots_stay_distinct():
    layout = build_layout(
        [False, True, True, False], [(1, 2, 2), (1, 4, 2), (1, 2, 2)], (4, 6, 6), "cpu"
    )
    assert layout["segments"] == (
        (0, 1, False),
        (1, 5, True),
        (5, 13, True),
        (13, 14, False),
    )
    with pytest.raises(ValueError, match="slots"):
        build_layout([False], [(1, 2, 2), (1, 2, 2)], (4, 6, 6), "cpu")


def test_latent_pack_decode_contract():
    config = QwenImage21PipelineConfig()
    batch = SimpleNamespace(
        height=64, width=96, extra={"qwen21_positive": {}, "qwen21_negative": {}}
    )
    shape = config.prepare_latent_shape(batch, 2, 1)
    x = torch.arange(torch.tensor(shape).prod()).reshape(shape)
    packed = config.maybe_pack_latents(x, 2, batch)
    assert packed.shape == (2, 24, 64)
    decoded = config.post_denoising_loop(packed, batch)
    assert not batch.extra
    torch.testing.assert_close(decoded[:, :, 0], x[:, 0])
    scale, shift = config.get_decode_scale_and_shift("cpu", torch.float32, None)
    torch.testing.assert_close(
        (decoded.float() - shift) * scale / scale + shift, decoded.float()
    )


def test_decode_latent_stats_are_uploaded_once():
    # decode normalizes with the first request's device tensors: a per-request
    # upload would stall the host until the denoising loop drains
    config = QwenImage21PipelineConfig()
    ac = config.vae_config.arch_config
    device = torch.device("cpu")
    first = config.get_decode_scale_and_shift(device, torch.bfloat16, None)
    second = config.get_decode_scale_and_shift(device, torch.bfloat16, None)
    mean = torch.tensor(ac.latents_mean, dtype=torch.bfloat16)
    std = torch.tensor(ac.latents_std, dtype=torch.bfloat16)
    torch.testing.assert_close(
        first[0], std.view(1, ac.z_dim, 1, 1, 1).reciprocal(), atol=0, rtol=0
    )
    torch.testing.assert_close(
        first[1], mean.view(1, ac.z_dim, 1, 1, 1), atol=0, rtol=0
    )
    assert first[0] is second[0] and first[1] is second[1]


@pytest.mark.parametrize("gfx1151", [False, True])
@pytest.mark.parametrize("override", [None, False, True])
def test_vae_tiling_platform_default_and_python_override(
    monkeypatch, gfx1151, override
):
    module = "sglang.multimodal_gen.configs.pipeline_configs.qwen_image21"
    monkeypatch.setattr(f"{module}.current_platform.is_gfx1151", lambda: gfx1151)
    kwargs = {} if override is None else {"vae_tiling": override}
    config = QwenImage21PipelineConfig(**kwargs)
    assert config.vae_tiling is (gfx1151 if override is None else override)
    warning = Mock()
    monkeypatch.setattr(f"{module}.logger.warning", warning)
    config.validate_server_args(None)
    assert warning.call_count == int(gfx1151 and not config.vae_tiling)


@pytest.mark.parametrize("gfx1151", [False, True])
@pytest.mark.parametrize("cli_value", [None, False, True])
@pytest.mark.parametrize("file_value", [None, False, True])
def test_vae_tiling_cli_overrides_config_file_and_platform_default(
    monkeypatch, tmp_path, gfx1151, cli_value, file_value
):
    module = "sglang.multimodal_gen.configs.pipeline_configs.qwen_image21"
    monkeypatch.setattr(f"{module}.current_platform.is_gfx1151", lambda: gfx1151)
    monkeypatch.setattr(
        registry,
        "get_model_info",
        lambda *args, **kwargs: SimpleNamespace(
            pipeline_config_cls=QwenImage21PipelineConfig
        ),
    )
    argv = []
    if file_value is not None:
        path = tmp_path / "pipeline.json"
        path.write_text(json.dumps({"vae_tiling": file_value}))
        argv.extend(["--pipeline-config-path", str(path)])
    if cli_value is not None:
        argv.extend(["--vae-tiling", str(cli_value).lower()])
    monkeypatch.setattr(sys, "argv", ["sglang", *argv])
    parser = PipelineConfig.add_cli_args(argparse.ArgumentParser())
    args, unknown = parser.parse_known_args(argv)
    kwargs = ServerArgs.get_provided_args(args, unknown)
    kwargs["model_path"] = "Qwen/Qwen-Image-2.1"
    config = PipelineConfig.from_kwargs(kwargs)
    expected = gfx1151 if file_value is None else file_value
    assert config.vae_tiling is (expected if cli_value is None else cli_value)


def test_vae_tiling_default_without_visible_rocm_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    properties = Mock(side_effect=AssertionError("No device should be queried"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    module = "sglang.multimodal_gen.configs.pipeline_configs.qwen_image21"
    monkeypatch.setattr(f"{module}.current_platform", RocmPlatform)
    RocmPlatform.is_gfx1151.cache_clear()
    try:
        assert not QwenImage21PipelineConfig().vae_tiling
        properties.assert_not_called()
    finally:
        RocmPlatform.is_gfx1151.cache_clear()


def test_default_image_output_format_preserves_rgba():
    assert QwenImage21SamplingParams.default_image_output_format() == "png"
    assert _resolve_image_output_format(None, QwenImage21SamplingParams) == "png"
    assert _resolve_image_output_format("webp", QwenImage21SamplingParams) == "webp"


@pytest.mark.parametrize("outputs", [1, 2])
def test_dynamic_batching_preserves_output_order_and_seeds(outputs):
    scheduler = object.__new__(Scheduler)
    config = QwenImage21PipelineConfig()
    scheduler.server_args = SimpleNamespace(pipeline_config=config)
    scheduler._batch_admission = SimpleNamespace(enabled=True)
    assert scheduler._dynamic_batching_enabled()
    requests = []
    for i, prompt in enumerate(["short", "a longer prompt"]):
        params = QwenImage21SamplingParams(
            prompt=prompt, seed=7 + i * 10, num_outputs_per_prompt=outputs
        )
        requests.append(Req(request_id=f"request-{i}", sampling_params=params))
    merged = scheduler._try_merge_generation_reqs(requests)
    assert merged.prompt == ["short", "a longer prompt"]
    assert merged.extra["dynamic_batch_seeds"] == [7, 17]
    result = torch.arange(outputs * 2).reshape(-1, 1)
    split = scheduler._split_batched_output(OutputBatch(output=result), requests)
    assert len(split) == 2
    torch.testing.assert_close(split[0].output, result[:outputs])
    torch.testing.assert_close(split[1].output, result[outputs:])
    requests[1].image_path = "reference.png"
    assert scheduler._try_merge_generation_reqs(requests) is None


@pytest.mark.parametrize("channels", [3, 4])
@pytest.mark.parametrize("tiling", [False, True])
def test_native_vae_roundtrip_shapes_and_checkpoint_names(
    monkeypatch, channels, tiling
):
    ac = QwenImage21VAEArchConfig(
        base_dim=4,
        decoder_base_dim=4,
        z_dim=4,
        dim_mult=(1, 2, 4, 4, 4),
        num_res_blocks=1,
        temperal_downsample=(False, False, False, False),
        in_channels=channels,
        out_channels=channels,
        latents_mean=(0.0,) * 4,
        latents_std=(1.0,) * 4,
    )
    model = AutoencoderKLQwenImage21(QwenImage21VAEConfig(arch_config=ac)).eval()
    assert not model.use_tiling
    assert ac.scale_factor_spatial == ac.spatial_compression_ratio == 16
    model.use_tiling = tiling
    model.use_parallel_tiling = False
    model.tile_sample_min_height = model.tile_sample_min_width = 32
    model.tile_sample_stride_height = model.tile_sample_stride_width = 16
    with torch.no_grad():
        latent = model.encode(torch.randn(1, channels, 1, 32, 64)).mode()
        assert latent.shape == (1, 4, 1, 2, 4)
        output = model.decode(latent)
        assert output.shape == (1, channels, 1, 32, 64)
        # Exercise the serving decoder on gfx1151 with an explicit tiling choice.
        monkeypatch.setattr(
            "sglang.multimodal_gen.configs.pipeline_configs.qwen_image21.current_platform.is_gfx1151",
            lambda: True,
        )
        args = SimpleNamespace(
            pipeline_config=QwenImage21PipelineConfig(
                vae_config=QwenImage21VAEConfig(arch_config=ac), vae_tiling=tiling
            ),
            disable_autocast=True,
            enable_torch_compile=False,
        )
        monkeypatch.setattr(
            "sglang.multimodal_gen.runtime.pipelines_core.stages.base.get_global_server_args",
            lambda: args,
        )
        monkeypatch.setattr(
            "sglang.multimodal_gen.runtime.pipelines_core.stages.decoding.get_local_torch_device",
            lambda: torch.device("cpu"),
        )
        model.use_tiling = False
        actual = DecodingStage(model).decode(latent, args, vae_dtype=torch.float32)
        assert model.use_tiling is tiling
        torch.testing.assert_close(actual, (output / 2 + 0.5).clamp(0, 1))
    assert model.state_dict()["encoder.conv_in.weight"].ndim == 4
    x = torch.randn(2, 3, 1, 8, 12)
    torch.testing.assert_close(_unpatchify(_patchify(x, 2), 2), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_vae_rms_norm_normalizes_in_float32(dtype):
    norm = QwenImage21RMS_norm(8, images=False).to(dtype)
    x = torch.linspace(-60000, 60000, 256).reshape(1, 8, 1, 4, 8).to(dtype)
    expected = (
        torch.nn.functional.normalize(x.float(), dim=1).to(dtype)
        * norm.scale
        * norm.gamma
    )
    torch.testing.assert_close(norm(x), expected, atol=0, rtol=0)


@pytest.mark.parametrize("tiling", [False, True])
def test_condition_pixels_match_reference_preprocessing(monkeypatch, tiling):
    module = "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.qwen_image21"
    monkeypatch.setattr(f"{module}.get_local_torch_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(f"{module}.set_forward_context", lambda **kwargs: nullcontext())
    image = Image.frombytes("RGBA", (32, 32), bytes(range(256)) * 16)
    vae = Mock()
    vae.encode.return_value.mode.return_value = torch.zeros(1, 64, 1, 2, 2)
    processor = Mock()
    processor.apply_chat_template.return_value = [[1]]
    stage = QwenImage21EncodingStage(Mock(), processor, vae, SimpleNamespace(config={}))
    stage.use_declared_component = Mock(return_value=nullcontext(vae))
    stage.encode_prompt = Mock(
        return_value=(torch.zeros(3, 8), torch.tensor([False, True, False]))
    )
    batch = SimpleNamespace(
        height=32,
        width=32,
        condition_image=image,
        prompt="edit",
        negative_prompt=None,
        num_outputs_per_prompt=1,
        do_classifier_free_guidance=False,
        extra={},
    )
    stage.forward(
        batch,
        SimpleNamespace(pipeline_config=QwenImage21PipelineConfig(vae_tiling=tiling)),
    )
    assert vae.use_tiling is tiling
    expected = VaeImageProcessor(vae_scale_factor=16).preprocess(image).unsqueeze(2)
    actual = vae.encode.call_args.args[0]
    torch.testing.assert_close(actual, expected.bfloat16(), atol=0, rtol=0)
    assert actual.stride() == expected.stride()


def test_condition_latents_reuse_uploaded_latent_stats(monkeypatch):
    module = "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.qwen_image21"
    monkeypatch.setattr(f"{module}.get_local_torch_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(f"{module}.set_forward_context", lambda **kwargs: nullcontext())
    image = Image.frombytes("RGBA", (32, 32), bytes(range(256)) * 16)
    latent = torch.randn(
        1, 64, 1, 2, 2, generator=torch.Generator().manual_seed(0)
    ).bfloat16()
    vae = Mock()
    vae.encode.return_value.mode.return_value = latent
    processor = Mock()
    processor.apply_chat_template.return_value = [[1]]
    stage = QwenImage21EncodingStage(Mock(), processor, vae, SimpleNamespace(config={}))
    stage.use_declared_component = Mock(return_value=nullcontext(vae))
    stage.encode_prompt = Mock(
        return_value=(torch.zeros(3, 8), torch.tensor([False, True, False]))
    )
    server_args = SimpleNamespace(pipeline_config=QwenImage21PipelineConfig())
    ac = server_args.pipeline_config.vae_config.arch_config
    mean = latent.new_tensor(ac.latents_mean).view(1, ac.z_dim, 1, 1, 1)
    std = latent.new_tensor(ac.latents_std).view(1, ac.z_dim, 1, 1, 1)
    expected = ((latent - mean) / std).flatten(2).transpose(1, 2)
    stats = []
    for _ in range(2):
        batch = SimpleNamespace(
            height=32,
            width=32,
            condition_image=image,
            prompt="edit",
            negative_prompt=None,
            num_outputs_per_prompt=1,
            do_classifier_free_guidance=False,
            extra={},
        )
        stage.forward(batch, server_args)
        actual = batch.extra["qwen21_positive"]["condition_latents"]
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
        stats.append(stage.latent_stats[(latent.dtype, latent.device)])
    # the second request normalizes with the first request's device tensors
    assert stats[0] is stats[1]


def test_condition_image_loading_preserves_alpha(tmp_path):
    path = tmp_path / "condition.png"
    Image.new("RGBA", (32, 32), (12, 34, 56, 78)).save(path)
    image = QwenImage21InputValidationStage().load_condition_image(str(path))
    assert image.mode == "RGBA"
    assert image.getpixel((0, 0)) == (12, 34, 56, 78)
    assert InputValidationStage().load_condition_image(str(path)).mode == "RGB"


def test_architecture_derived_dimensions():
    config = QwenImage21DitConfig(
        arch_config=QwenImage21ArchConfig(num_attention_heads=2, attention_head_dim=16)
    )
    assert config.hidden_size == 32


def test_registry_routes_local_checkpoint_and_preserves_legacy():
    assert (
        _get_config_info("Qwen/Qwen-Image-2.1-Turbo").pipeline_config_cls
        is QwenImage21PipelineConfig
    )
    assert (
        _get_config_info("Qwen/Qwen-Image-2.1").pipeline_config_cls
        is QwenImage21PipelineConfig
    )
    assert (
        _get_config_info(
            "/models/private", model_id="Qwen-Image-2.1"
        ).pipeline_config_cls
        is QwenImage21PipelineConfig
    )
    assert (
        _get_config_info("Qwen/Qwen-Image").pipeline_config_cls
        is not QwenImage21PipelineConfig
    )


def test_packed_qkv_weight_skips_offloaded_placeholders():
    # Layerwise offload swaps every weight for one shared 1-D placeholder; the
    # packing check runs from _apply and must not unpack it as [rows, cols].
    placeholder = torch.empty((1,), dtype=torch.bfloat16)
    projection = SimpleNamespace(
        quant_method=UnquantizedLinearMethod(), weight=placeholder
    )
    attention = SimpleNamespace(to_q=projection, to_k=projection, to_v=projection)
    assert QwenImage21Attention.packed_qkv_weight(attention) is None


def test_packed_qkv_projection_is_skipped_under_compile():
    # Its storage-identity checks cannot be traced; compiled graphs keep the
    # plain projections instead of breaking in every attention.
    with patch.object(torch.compiler, "is_compiling", return_value=True):
        assert QwenImage21Attention._project_qkv_packed(object(), None, [], []) is None


def test_prefix_pad_replay_writes_the_captured_output():
    def attend(q, k, v, attn_metadata):
        return q + k.shape[1]

    attention = SimpleNamespace(
        target_attn=SimpleNamespace(attn_impl=SimpleNamespace(forward=attend))
    )
    prefix_pad = PrefixPad(torch.tensor(2))
    q, kv = torch.zeros(1, 3, 2, 4), torch.zeros(1, 6, 2, 4)
    graph = bcg.BreakableCUDAGraph()
    capture = SimpleNamespace(
        cuda_graph=graph,
        _barrier_fn=None,
        _end_current_segment=lambda: None,
        _begin_new_segment=lambda: None,
    )
    with patch(
        "sglang.multimodal_gen.runtime.models.dits.qwen_image21.get_forward_context",
        return_value=SimpleNamespace(attn_metadata=None),
    ):
        token = bcg._current_capture_var.set(capture)
        try:
            out = QwenImage21Attention.attend_target(attention, q, kv, kv, prefix_pad)
        finally:
            bcg._current_capture_var.reset(token)
        assert torch.all(out == 4)

        prefix_pad.rows.fill_(1)
        with replay_token_scope():
            assert graph._break_fns[0]() is None
    assert torch.all(out == 5)
