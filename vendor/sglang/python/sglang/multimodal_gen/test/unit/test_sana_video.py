from types import SimpleNamespace

import torch
import torch.nn.functional as F

from sglang.multimodal_gen.configs.models.dits.sana import SanaConfig
from sglang.multimodal_gen.configs.pipeline_configs.sana_video import (
    SanaVideoPipelineConfig,
)
from sglang.multimodal_gen.configs.sample.sana_video import SanaVideoSamplingParams
from sglang.multimodal_gen.registry import get_model_info
from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
from sglang.multimodal_gen.runtime.models.dits.sana import SanaTransformer2DModel
from sglang.multimodal_gen.runtime.models.dits.sana_video import (
    GLUMBTempConv,
    SanaVideoModulatedNorm,
    SanaVideoRotaryPosEmbed,
    apply_interleaved_rotary_emb,
    apply_interleaved_rotary_emb_pair,
)
from sglang.multimodal_gen.runtime.pipelines.sana_video import (
    select_sana_video_prompt_window,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.latent_preparation import (
    LatentPreparationStage,
)
from sglang.multimodal_gen.test.unit.host_sync_guard import RecordOps

# the DiT's fused kernels need a GPU on a GPU platform; elsewhere run on the CPU
_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_sana_video_registry_resolution(monkeypatch):
    monkeypatch.setattr(
        "sglang.multimodal_gen.registry.maybe_download_model_index",
        lambda _: {"_class_name": "SanaVideoPipeline"},
    )
    get_model_info.cache_clear()
    model_info = get_model_info("Efficient-Large-Model/SANA-Video_2B_480p_diffusers")

    assert model_info is not None
    assert model_info.pipeline_config_cls is SanaVideoPipelineConfig
    assert model_info.sampling_param_cls is SanaVideoSamplingParams
    get_model_info.cache_clear()


def test_sana_video_pipeline_latent_shape_and_frame_alignment():
    config = SanaVideoPipelineConfig()
    sampling = SanaVideoSamplingParams()

    assert config.adjust_num_frames(81) == 81
    assert config.adjust_num_frames(80) == 77
    batch = SimpleNamespace(height=480, width=832, num_frames=81)
    server_args = SimpleNamespace(pipeline_config=config)
    latent_frames = LatentPreparationStage(
        scheduler=None, transformer=None
    ).adjust_video_length(batch, server_args)
    assert latent_frames == 21
    # LatentPreparationStage applies temporal compression before calling the config.
    assert config.prepare_latent_shape(
        batch, batch_size=2, num_frames=latent_frames
    ) == (
        2,
        16,
        21,
        60,
        104,
    )
    assert config.get_latent_dtype(torch.bfloat16) is torch.float32
    assert not config.enable_autocast
    assert not config.vae_config.load_encoder
    assert config.vae_config.load_decoder
    assert (sampling.width, sampling.height, sampling.num_frames) == (832, 480, 81)
    assert sampling.fps == 16
    assert sampling.num_inference_steps == 50
    assert sampling.guidance_scale == 6.0


def test_select_sana_video_prompt_window_keeps_first_and_tail_tokens():
    tensor = torch.arange(10).view(1, 10, 1)

    selected = select_sana_video_prompt_window(tensor, max_sequence_length=4)

    assert selected.flatten().tolist() == [0, 7, 8, 9]


def test_sana_video_rotary_embeddings_follow_video_token_order():
    rotary = SanaVideoRotaryPosEmbed(
        attention_head_dim=12,
        patch_size=(1, 2, 2),
        max_seq_len=16,
    )

    cos, sin = rotary(torch.zeros(1, 4, 3, 4, 4))

    assert cos.shape == (1, 12, 1, 12)
    assert sin.shape == (1, 12, 1, 12)
    assert torch.isfinite(cos).all()
    assert torch.isfinite(sin).all()


def test_sana_video_paired_rope_falls_back_to_eager_on_cpu():
    query = torch.randn(2, 7, 3, 12, dtype=torch.bfloat16)
    key = torch.randn_like(query)
    cos = torch.randn(1, 7, 1, 12, dtype=torch.float64)
    sin = torch.randn_like(cos)

    query_out, key_out = apply_interleaved_rotary_emb_pair(query, key, cos, sin)

    assert torch.equal(query_out, apply_interleaved_rotary_emb(query, cos, sin))
    assert torch.equal(key_out, apply_interleaved_rotary_emb(key, cos, sin))


def test_sana_video_glumb_shared_fast_path_preserves_reference():
    torch.manual_seed(0)
    module = GLUMBTempConv(channels=4, expand_ratio=2.0).eval()
    hidden_states = torch.randn(1, 2, 3, 5, 4)

    with torch.no_grad():
        actual = module(hidden_states)

        batch_size, num_frames, height, width, channels = hidden_states.shape
        expected = hidden_states.reshape(
            batch_size * num_frames, height, width, channels
        ).permute(0, 3, 1, 2)
        expected = F.silu(module.conv_inverted(expected))
        expected = module.conv_depth(expected)
        expected, gate = expected.chunk(2, dim=1)
        expected = expected * F.silu(gate)
        expected = module.conv_point(expected)
        temporal = expected.reshape(
            batch_size, num_frames, channels, height * width
        ).permute(0, 2, 1, 3)
        expected = temporal + module.conv_temp(temporal)
        expected = expected.permute(0, 2, 3, 1).reshape(
            batch_size, num_frames, height, width, channels
        )

    assert torch.equal(actual, expected)


def test_sana_video_modulated_norm_shared_fast_path_preserves_reference():
    torch.manual_seed(1)
    module = SanaVideoModulatedNorm(dim=8, eps=1e-6).eval()
    hidden_states = torch.randn(2, 5, 8)
    embedded_timestep = torch.randn(2, 1, 8)
    scale_shift_table = torch.randn(2, 8)

    actual = module(hidden_states, embedded_timestep, scale_shift_table)
    shift, scale = (
        scale_shift_table[None, None] + embedded_timestep[:, :, None]
    ).unbind(dim=2)
    expected = module.norm(hidden_states) * (1 + scale) + shift

    assert torch.equal(actual, expected)


@torch.no_grad()
def test_sana_prompt_mask_is_cast_once_per_forward(single_process_model_parallel):
    """SANA is launch-bound in eager mode: the int64 prompt mask is cast to
    bool once per forward instead of once in every block's cross-attention."""
    config = SanaConfig()
    for key, value in dict(
        in_channels=4,
        out_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=12,
    ).items():
        setattr(config.arch_config, key, value)
    model = SanaTransformer2DModel(config, {})
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    model.to(_DEVICE)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 4, 4, generator=generator),
        encoder_hidden_states=torch.randn(1, 5, 12, generator=generator),
        timestep=torch.tensor([500.0]),
    )
    inputs = {key: value.to(_DEVICE) for key, value in inputs.items()}
    mask = torch.tensor([[1, 1, 1, 0, 0]], device=_DEVICE)
    with set_forward_context(current_timestep=0, attn_metadata=None):
        with RecordOps() as ops:
            out = model(**inputs, encoder_attention_mask=mask)
        reference = model(**inputs, encoder_attention_mask=mask.bool())
    assert ops.casts(torch.bool) == 1
    torch.testing.assert_close(out, reference, atol=0, rtol=0)
