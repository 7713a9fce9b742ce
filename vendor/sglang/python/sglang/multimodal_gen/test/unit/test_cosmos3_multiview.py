# SPDX-License-Identifier: Apache-2.0
"""Unit tests for the Cosmos3 Multiview-AV port: visibility predicate against
the spec truth table, run-compressed block sparsity, padded flex attention
against a dense masked GQA oracle, camera-major helpers, wrapped temporal
positions, deployment-contract parsing, request validation, and registry
wiring."""

import builtins
import copy
import importlib.util
import math
import os
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image

from sglang.multimodal_gen.configs.pipeline_configs.cosmos3 import Cosmos3Config
from sglang.multimodal_gen.configs.pipeline_configs.cosmos3_multiview import (
    COSMOS3_MADS_CAMERAS,
    COSMOS3_MULTIVIEW_CONTRACT_FIELDS,
    MULTIVIEW_BACKEND_ENV_VAR,
    Cosmos3MultiviewConfig,
    parse_multiview_deployment_config,
    validate_lidar_config,
)
from sglang.multimodal_gen.configs.sample.cosmos3_multiview import (
    Cosmos3MultiviewSamplingParams,
    closest_multiview_aspect_ratio,
    normalize_multiview_aspect_ratio,
    parse_local_condition_indexes,
    validate_lidar_request,
    validate_multiview_request,
)
from sglang.multimodal_gen.registry import (
    _PIPELINE_REGISTRY,
    _discover_and_register_pipelines,
    _get_config_info,
)
from sglang.multimodal_gen.runtime.models.dits.cosmos3_multiview import (
    add_rig_view_rows,
    lidar_patch_grid,
    pack_state,
    patchify_lidar,
    sequence_shard_padding,
    shard_sequence,
    spatial_patch_hw,
    unpack_state,
    unpatchify_lidar,
)
from sglang.multimodal_gen.runtime.models.dits.cosmos3_simulation.multiview_attention import (
    TRITON_SPARSE_BLOCK_SIZES,
    MultiviewBlockSparsity,
    build_multiview_block_sparsity,
    build_multiview_flex_metadata,
    fa4_sparse_block_sizes,
    get_multiview_attention_plan,
    layout_sparse_block_sizes,
    multiview_pair_predicate,
    padded_multiview_flex_attention,
    resolve_masked_backend,
)
from sglang.multimodal_gen.runtime.models.dits.cosmos3_simulation.multiview_layout import (
    MaskItem,
    MultiviewAttentionContext,
    MultiviewLayout,
    expand_multiview_condition_frame_indexes,
)
from sglang.multimodal_gen.runtime.models.dits.cosmos3video import (
    compute_mrope_position_ids_vision,
)
from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.decoder import (
    _DepthToPixels,
    crop_lidar_width,
    depth_to_space,
    lidar_network_to_metric,
)
from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.encoder import (
    Cosmos3LidarEncoder,
    _SpaceToDepth,
    pad_lidar_sweeps,
    required_lidar_sweeps,
)
from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.layers import (
    _natten_backend_cache,
    resolve_natten_backend,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.cosmos3 import (
    _pil_to_uint8_tensor,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.cosmos3_simulation import (
    multiview as multiview_stage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.cosmos3_simulation.lidar_outputs import (
    lidar_output_payload,
    lidar_payload_for_response,
    pool_lidar_azimuth,
    render_lidar_bev_frames,
    render_lidar_range_frames,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.cosmos3_simulation.multiview import (
    COSMOS3_AV_JOINT_TRANSFER_SYSTEM_PROMPT_WSM,
    COSMOS3_AV_MULTIVIEW_TRANSFER_SYSTEM_PROMPT_WSM,
    COSMOS3_MULTIVIEW_EMPHASIS,
    Cosmos3MultiviewInputStage,
    fit_uint8_cthw,
    format_per_view_negative_prompt,
    format_per_view_prompts,
    format_separate_view_captions,
    media_kind,
    pad_view_frames_uint8,
    synthetic_multiview_pixels,
)
from sglang.multimodal_gen.runtime.utils.vision import load_video

# The V1.2 LiDAR contract of the joint export (transformer/config.json multiview.lidar).
LIDAR_BLOCK = {
    "apply_validity_mask": True,
    "dtype": "float32",
    "fps": 10.0,
    "latent_channels": 128,
    "network_config": {
        "base_channels": 128,
        "bottleneck_3d": True,
        "bottleneck_3d_causal_time": True,
        "bottleneck_3d_max_t": 32,
        "bottleneck_3d_rope": True,
        "depths": [3, 3, 3, 3],
        "dilation": [1, 1, 1, 1],
        "formulation": "VAE",
        "in_channels": 3,
        "mapping_depth": 2,
        "mask_as_input": False,
        "mlp_ratio": 3.0,
        "num_heads": [4, 4, 8, 8],
        "out_channels": 3,
        "patch_size": [2, 2],
        "positional_embedding": "learnable_embedding",
        "resolution": [128, 1808],
        "temporal_downsample": [False, False, False],
        "temporal_upsample": [False, False, False],
        "window_size": [5, 45],
        "z_dim": 128,
    },
    "range_projection": {
        "azimuth_end_degrees": -180.0,
        "azimuth_endpoint": False,
        "azimuth_start_degrees": 180.0,
        "coordinate_system": "x_forward_y_left_z_up",
        "intensity_encoding": "unit",
        "invalid_range_m": 0.0,
        "max_range_m": 100.0,
        "min_range_m": 5.0,
        "model_width": 1808,
        "model_width_transform": "circular_pad",
        "native_height": 128,
        "native_width": 3600,
        "return_selection": "nearest",
        "semantic_height": 128,
        "semantic_width": 1800,
        "sensor": "pandar128",
        "validity_threshold": 0.5,
    },
    "sample_posterior": False,
    "spatial_compression": [16, 16],
    "streaming_chunk_frames": 9,
    "streaming_context_frames": 9,
    "temporal_compression_factor": 1,
    "version": "1.2",
}
INFERENCE_DEFAULTS = {
    "control_guidance": 1.0,
    "control_guidance_interval": None,
    "emphasize_control_in_prompt": True,
    "fps": 30.0,
    "guidance": 6.0,
    "guidance_interval": None,
    "negative_metadata_mode": "none",
    "normalize_cfg": False,
    "num_steps": 35,
    "resolution": "480",
    "shift": 10.0,
    "sigma_max": 80.0,
}
# The physical MADS camera ids of the Oct-1 2026 export's rig view embedding.
RIG_VIEW_EMBEDDING = {
    "camera_ids": {
        "camera_cross_left_120fov": 5,
        "camera_cross_right_120fov": 1,
        "camera_front_fisheye_200fov": 7,
        "camera_front_tele_30fov": 6,
        "camera_front_wide_120fov": 0,
        "camera_left_fisheye_200fov": 8,
        "camera_rear_fisheye_200fov": 10,
        "camera_rear_left_70fov": 4,
        "camera_rear_right_70fov": 2,
        "camera_rear_tele_30fov": 3,
        "camera_right_fisheye_200fov": 9,
    },
    "lidar_id": 11,
    "num_embeddings": 12,
}
# ``transformer/config.json["multiview"]`` of the Oct-7 2026 export (HF da7c96b), the
# contract vLLM-Omni's multiview_config.py reads and the only one this build serves.
DEPLOYMENT_BLOCK = {
    "cameras": list(COSMOS3_MADS_CAMERAS),
    "cross_view_past_window_seconds": 0.4,
    "inference_defaults": {
        k: v
        for k, v in INFERENCE_DEFAULTS.items()
        if k not in ("sigma_max", "negative_metadata_mode")
    },
    "lidar": {
        **{k: v for k, v in LIDAR_BLOCK.items() if k != "version"},
        "streaming_chunk_frames": 20,
        "streaming_context_frames": 21,
    },
    "lidar_latent_patch_size_hw": [1, 1],
    "rig_view_embedding": RIG_VIEW_EMBEDDING,
}


def _adjust_multiview(params, deployment):
    """The multiview-specific half of ``_adjust``; the base adjustment needs live ServerArgs."""
    params._apply_deployment_defaults(deployment)
    params._resolve_canvas(deployment)
    params._apply_guidance_policy(deployment)
    return params


def _transformer_config(multiview=None, backbone_type="cosmos3_multiview"):
    return {
        "backbone_type": backbone_type,
        "latent_patch_size": 2,
        "multiview": copy.deepcopy(
            DEPLOYMENT_BLOCK if multiview is None else multiview
        ),
    }


def _fa4_available() -> bool:
    """FA4 CuTe block-sparse kernels exist for SM90 and SM100 and need the package."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (
        9,
        10,
    ):
        return False
    try:
        import cutlass  # noqa: F401
        import flash_attn.cute  # noqa: F401
    except Exception:
        return False
    return True


def _tiny_metadata(
    attention_scope="decomposed",
    *,
    decomposed_temporal_window_seconds=None,
    control_attends_sensor=False,
):
    """Two views x two frames x one patch per item, two real text tokens, no padding.

    Sequence: [T0 T1 | Wa0 Wa1 Wb0 Wb1 | Ra0 Ra1 Rb0 Rb1].
    """
    item = MaskItem(token_shape=(4, 1, 1), num_views=2, seconds_per_frame=0.5)
    control = MaskItem(
        token_shape=(4, 1, 1), num_views=2, is_control=True, seconds_per_frame=0.5
    )
    return build_multiview_flex_metadata(
        seq_len=10,
        full_q_offsets=(2, 6, 10),
        items_per_sample=(control, item),
        device="cpu",
        num_und=2,
        attention_scope=attention_scope,
        decomposed_temporal_window_seconds=decomposed_temporal_window_seconds,
        control_attends_sensor=control_attends_sensor,
    )


# Truth table transcribed from the Multiview-AV visibility spec, one row per
# (query role, key role). Deliberately not the boolean expression the
# implementation evaluates, so a sign error cannot cancel out.
_SPEC_VISIBILITY = {
    ("control", "und"): "always",
    ("control", "control"): "same_view",
    ("control", "sensor"): "configured_same_view",
    ("sensor", "und"): "always",
    ("sensor", "control"): "same_view",
    ("sensor", "sensor"): "in_scope",
}


def _token_role(vectors, index):
    if bool(vectors[4][index]):
        return "und"
    if bool(vectors[3][index]):
        return "control"
    return "sensor"


def _spec_visible(
    q_role,
    k_role,
    *,
    same_sample,
    same_view,
    same_frame,
    within_temporal_window,
    attention_scope,
    has_temporal_window,
    control_attends_sensor,
):
    if not same_sample:
        return False
    rule = _SPEC_VISIBILITY[(q_role, k_role)]
    if rule == "always":
        return True
    if rule == "same_view":
        return same_view
    if rule == "configured_same_view":
        return control_attends_sensor and same_view
    if attention_scope == "all_views":
        return True
    if attention_scope == "same_view":
        return same_view
    return same_view or (within_temporal_window if has_temporal_window else same_frame)


def _dense_masked_oracle(q, k, v, k_und, v_und, layout, real_und_len):
    """Dense masked GQA attention over [text | GEN] in float32, from the pair predicate."""
    padded_und = ((layout.max_und_tokens + 63) // 64) * 64
    padded_q = ((layout.gen_tokens + 63) // 64) * 64
    offsets = [padded_und]
    for item in layout.items:
        offsets.append(offsets[-1] + item.num_tokens)
    metadata = build_multiview_flex_metadata(
        seq_len=padded_und + padded_q,
        full_q_offsets=tuple(offsets),
        items_per_sample=layout.items,
        device="cpu",
        num_und=real_und_len,
        attention_scope=layout.attention_scope,
        decomposed_temporal_window_seconds=layout.decomposed_temporal_window_seconds,
        control_attends_sensor=layout.control_attends_sensor,
        caption_lengths=layout.caption_lengths,
        lidar_attends_captions=layout.lidar_attends_captions,
    )
    gen = layout.gen_tokens
    q_index = torch.arange(gen)[:, None]
    key_index = torch.cat([torch.arange(real_und_len), padded_und + torch.arange(gen)])[
        None, :
    ]
    mask = multiview_pair_predicate(metadata, q_index, key_index)
    keys = torch.cat([k_und, k], dim=1).float()
    values = torch.cat([v_und, v], dim=1).float()
    group = q.shape[2] // k.shape[2]
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) / (q.shape[-1] ** 0.5)
    scores = scores.masked_fill(~mask[None, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, values)


class TestVisibilityPredicate(unittest.TestCase):
    def test_metadata_is_camera_major_and_marks_padding(self):
        item = MaskItem(token_shape=(6, 1, 2), num_views=2, seconds_per_frame=0.4)
        metadata = build_multiview_flex_metadata(
            seq_len=18,
            full_q_offsets=(4, 16),
            items_per_sample=(item,),
            device="cpu",
            num_und=3,
            attention_scope="same_view",
        )
        self.assertEqual(
            metadata.sample_id.tolist(), [0, 0, 0, -1] + [0] * 12 + [-1, -1]
        )
        self.assertEqual(metadata.is_und.tolist(), [True] * 3 + [False] * 15)
        self.assertEqual(
            metadata.frame_id[4:16].tolist(), [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
        )
        self.assertEqual(metadata.view_id[4:16].tolist(), [0] * 6 + [1] * 6)
        torch.testing.assert_close(
            metadata.timestamp[4:16],
            torch.tensor([0.0, 0.0, 0.4, 0.4, 0.8, 0.8] * 2),
        )
        self.assertEqual(metadata.q_len, 14)
        self.assertEqual(metadata.kv_len, 18)

    def test_predicate_matches_spec_truth_table(self):
        for attention_scope in ("all_views", "same_view", "decomposed"):
            for control_attends_sensor in (False, True):
                for temporal_window in (None, 0.5):
                    with self.subTest(
                        scope=attention_scope,
                        control_attends_sensor=control_attends_sensor,
                        window=temporal_window,
                    ):
                        metadata = _tiny_metadata(
                            attention_scope,
                            decomposed_temporal_window_seconds=temporal_window,
                            control_attends_sensor=control_attends_sensor,
                        )
                        q_index = torch.arange(metadata.q_len)[:, None]
                        kv_index = torch.arange(metadata.kv_len)[None, :]
                        actual = multiview_pair_predicate(metadata, q_index, kv_index)
                        q_vectors = metadata.query_vectors()
                        k_vectors = metadata.key_vectors()
                        expected = torch.zeros_like(actual)
                        covered = set()
                        for q in range(metadata.q_len):
                            q_role = _token_role(q_vectors, q)
                            for k in range(metadata.kv_len):
                                k_role = _token_role(k_vectors, k)
                                covered.add((q_role, k_role))
                                gap = float(q_vectors[5][q]) - float(k_vectors[5][k])
                                expected[q, k] = _spec_visible(
                                    q_role,
                                    k_role,
                                    same_sample=int(q_vectors[0][q])
                                    == int(k_vectors[0][k]),
                                    same_view=int(q_vectors[2][q])
                                    == int(k_vectors[2][k]),
                                    same_frame=int(q_vectors[1][q])
                                    == int(k_vectors[1][k]),
                                    within_temporal_window=(
                                        -1e-4 <= gap <= (temporal_window or 0.0) + 1e-4
                                    ),
                                    attention_scope=attention_scope,
                                    has_temporal_window=temporal_window is not None,
                                    control_attends_sensor=control_attends_sensor,
                                )
                        self.assertEqual(covered, set(_SPEC_VISIBILITY))
                        self.assertTrue(actual[:, :2].all())
                        torch.testing.assert_close(actual, expected)

    def test_visibility_rule_examples(self):
        metadata = _tiny_metadata()

        def visible(q, keys):
            return multiview_pair_predicate(
                metadata, torch.tensor(q), torch.tensor(keys)
            ).tolist()

        # Control token camera A frame 0: text and own-camera control only.
        self.assertEqual(
            visible(0, [0, 1, 2, 3, 4, 6]), [True, True, True, True, False, False]
        )
        # RGB camera A frame 0: own-camera RGB at every frame, camera B RGB at
        # frame 0 only, own-camera control at every frame.
        self.assertEqual(
            visible(4, [2, 3, 6, 7, 8, 9]), [True, True, True, True, True, False]
        )
        self.assertEqual(
            visible(5, [2, 3, 6, 7, 8, 9]), [True, True, True, True, False, True]
        )
        # control_attends_sensor opens the own-camera RGB keys to control queries.
        enabled = _tiny_metadata(control_attends_sensor=True)
        self.assertEqual(
            multiview_pair_predicate(
                enabled, torch.tensor(0), torch.tensor([6, 7, 8])
            ).tolist(),
            [True, True, False],
        )

    def test_padding_queries_attend_only_padding(self):
        for attention_scope in ("all_views", "same_view", "decomposed"):
            with self.subTest(scope=attention_scope):
                item = MaskItem(token_shape=(2, 1, 2), num_views=1)
                metadata = build_multiview_flex_metadata(
                    seq_len=9,
                    full_q_offsets=(3, 7),
                    items_per_sample=(item,),
                    device="cpu",
                    num_und=2,
                    attention_scope=attention_scope,
                )
                allowed = multiview_pair_predicate(
                    metadata,
                    torch.arange(metadata.q_len)[:, None],
                    torch.arange(metadata.kv_len)[None, :],
                )
                q_padding = metadata.query_vectors()[0] == -1
                kv_padding = metadata.sample_id == -1
                self.assertTrue(allowed[q_padding][:, kv_padding].all())
                self.assertFalse(allowed[q_padding][:, ~kv_padding].any())
                self.assertFalse(allowed[~q_padding][:, kv_padding].any())
                self.assertTrue(allowed[q_padding].any(dim=-1).all())

    def test_decomposed_temporal_window_boundaries(self):
        cases = [
            (1.0, 1.0, 0.5, True),
            (1.0, 0.5, 0.5, True),
            (1.0, 0.4998, 0.5, False),
            (1.0, 1.00009, 0.5, True),
            (1.0, 1.0002, 0.5, False),
        ]
        for q_timestamp, k_timestamp, window, expected in cases:
            with self.subTest(q=q_timestamp, k=k_timestamp):
                metadata = _tiny_metadata(decomposed_temporal_window_seconds=window)
                # Two RGB tokens of different cameras and frames: only the
                # temporal window decides.
                metadata.timestamp[6] = q_timestamp
                metadata.timestamp[9] = k_timestamp
                allowed = multiview_pair_predicate(
                    metadata, torch.tensor(4), torch.tensor([9])
                )
                self.assertEqual(bool(allowed[0]), expected)

    def test_window_is_past_only_and_registers_lidar_sweeps_by_capture_time(self):
        """The Oct-1 export's 0.4 s window: a sensor query reaches other views'
        sensor keys captured at the same instant or up to 0.4 s earlier, never
        later; 10 Hz LiDAR sweeps register against 7.5 Hz camera latents by
        wall-clock time, each key counted once."""
        camera = (4, 1, 1)  # 2 views x 2 frames at 0.4 s: t = 0.0, 0.4
        lidar = (8, 1, 1)  # 8 sweeps at 0.1 s: t = 0.0 .. 0.7
        items = (
            MaskItem(camera, 2, is_control=True, seconds_per_frame=0.4),
            MaskItem(camera, 2, seconds_per_frame=0.4),
            MaskItem(
                lidar,
                1,
                view_offset=2,
                is_control=True,
                seconds_per_frame=0.1,
                is_lidar=True,
            ),
            MaskItem(lidar, 1, view_offset=2, seconds_per_frame=0.1, is_lidar=True),
        )
        offsets = [2]
        for item in items:
            offsets.append(offsets[-1] + item.num_tokens)
        metadata = build_multiview_flex_metadata(
            seq_len=offsets[-1],
            full_q_offsets=tuple(offsets),
            items_per_sample=items,
            device="cpu",
            num_und=2,
            decomposed_temporal_window_seconds=0.4,
            control_attends_sensor=True,
        )
        rgb = offsets[1]  # [A0 A1 B0 B1]
        sweeps = offsets[3]  # [S0 .. S7]
        query_start = offsets[0]

        def sees(token, keys):
            # Query indexes are relative to the first GEN token; keys are absolute.
            return multiview_pair_predicate(
                metadata, torch.tensor(token - query_start), torch.tensor(keys)
            ).tolist()

        # Camera A frame 1 (t=0.4): camera B at t=0.4 and t=0.0, LiDAR sweeps 0..4.
        self.assertEqual(sees(rgb + 1, [rgb + 2, rgb + 3]), [True, True])
        self.assertEqual(
            sees(rgb + 1, [sweeps + s for s in range(8)]),
            [True, True, True, True, True, False, False, False],
        )
        # Camera A frame 0 (t=0.0): only the same instant of camera B, sweep 0.
        self.assertEqual(sees(rgb, [rgb + 2, rgb + 3]), [True, False])
        self.assertEqual(sees(rgb, [sweeps, sweeps + 1]), [True, False])
        # LiDAR sweep 7 (t=0.7): camera frame 1 (t=0.4) but not frame 0 (0.7 s back).
        self.assertEqual(sees(sweeps + 7, [rgb, rgb + 1]), [False, True])
        # Own view is always reachable at every frame (same-view rule), once.
        self.assertEqual(sees(rgb + 1, [rgb, rgb + 1]), [True, True])
        full = multiview_pair_predicate(
            metadata,
            torch.arange(metadata.q_len)[:, None],
            torch.arange(metadata.kv_len)[None, :],
        )
        self.assertEqual(full.dtype, torch.bool)

    def test_rejects_mixed_view_offsets_without_window(self):
        first = MaskItem(token_shape=(2, 1, 1), num_views=1)
        second = MaskItem(token_shape=(2, 1, 1), num_views=1, view_offset=1)
        with self.assertRaisesRegex(ValueError, "mixed view offsets"):
            build_multiview_flex_metadata(
                seq_len=6,
                full_q_offsets=(2, 4, 6),
                items_per_sample=(first, second),
                device="cpu",
                num_und=2,
            )


class TestBlockSparsity(unittest.TestCase):
    def _metadata(self, control_attends_sensor=True):
        control = MaskItem(token_shape=(4, 1, 2), num_views=2, is_control=True)
        target = MaskItem(token_shape=(4, 1, 2), num_views=2)
        # 8 padded text slots (3 real) + 8 control + 8 target tokens.
        return build_multiview_flex_metadata(
            seq_len=24,
            full_q_offsets=(8, 16, 24),
            items_per_sample=(control, target),
            device="cpu",
            num_und=3,
            control_attends_sensor=control_attends_sensor,
        )

    def test_block_classification_matches_dense_projection(self):
        metadata = self._metadata()
        q_block, kv_block = 4, 4
        sparsity = build_multiview_block_sparsity(
            metadata, q_block_size=q_block, kv_block_size=kv_block
        )
        dense = multiview_pair_predicate(
            metadata,
            torch.arange(metadata.q_len)[:, None],
            torch.arange(metadata.kv_len)[None, :],
        )
        num_q_blocks = metadata.q_len // q_block
        num_kv_blocks = metadata.kv_len // kv_block
        for qb in range(num_q_blocks):
            full = set(
                sparsity.full_indices[qb, : int(sparsity.full_counts[qb])].tolist()
            )
            partial = set(
                sparsity.partial_indices[
                    qb, : int(sparsity.partial_counts[qb])
                ].tolist()
            )
            self.assertFalse(full & partial)
            for kb in range(num_kv_blocks):
                tile = dense[
                    qb * q_block : (qb + 1) * q_block,
                    kb * kv_block : (kb + 1) * kv_block,
                ]
                if tile.all():
                    self.assertIn(kb, full, (qb, kb))
                elif tile.any():
                    self.assertIn(kb, partial, (qb, kb))
                else:
                    self.assertNotIn(kb, full | partial, (qb, kb))
        # Full-width contiguous index layout, as create_block_mask produces.
        self.assertEqual(sparsity.full_indices.shape, (num_q_blocks, num_kv_blocks))
        self.assertEqual(sparsity.partial_indices.shape, (num_q_blocks, num_kv_blocks))

    def test_run_table_reproduces_the_pair_predicate(self):
        metadata = self._metadata()
        sparsity = build_multiview_block_sparsity(
            metadata, q_block_size=4, kv_block_size=4
        )
        dense = multiview_pair_predicate(
            metadata,
            torch.arange(metadata.q_len)[:, None],
            torch.arange(metadata.kv_len)[None, :],
        )
        q_groups = (sparsity.q_word_base // sparsity.words_per_row).long()
        k_groups = sparsity.k_group_ids.long()
        via_table = sparsity.group_allowed[q_groups[:, None], k_groups[None, :]]
        torch.testing.assert_close(via_table, dense)
        # Packed words round-trip bit by bit.
        words = (
            sparsity.allowed_words.view(-1, sparsity.words_per_row).to(torch.int64)
            & 0xFFFFFFFF
        )
        bits = (words[:, :, None] >> torch.arange(32)) & 1
        unpacked = bits.reshape(words.shape[0], -1)[
            :, : sparsity.group_allowed.shape[1]
        ]
        torch.testing.assert_close(unpacked.bool(), sparsity.group_allowed)

    def test_block_mask_carries_block_visibility_and_exact_mask_mod(self):
        metadata = self._metadata()
        q_block, kv_block = 4, 4
        sparsity = build_multiview_block_sparsity(
            metadata, q_block_size=q_block, kv_block_size=kv_block
        )
        block_mask = sparsity.to_block_mask()
        self.assertEqual(block_mask.seq_lengths, (metadata.q_len, metadata.kv_len))
        dense = multiview_pair_predicate(
            metadata,
            torch.arange(metadata.q_len)[:, None],
            torch.arange(metadata.kv_len)[None, :],
        )
        # ``to_dense`` is block-granular: a block is visible when any pair is.
        visible_blocks = dense.view(
            metadata.q_len // q_block, q_block, metadata.kv_len // kv_block, kv_block
        ).any(dim=(1, 3))
        torch.testing.assert_close(block_mask.to_dense()[0, 0].bool(), visible_blocks)
        # Inside partial blocks the kernel consults mask_mod, which must be the
        # exact predicate.
        q_idx = torch.arange(metadata.q_len)[:, None]
        kv_idx = torch.arange(metadata.kv_len)[None, :]
        torch.testing.assert_close(
            block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q_idx, kv_idx), dense
        )


class TestPaddedFlexAttention(unittest.TestCase):
    """Backends 'triton'/'fa4': one masked attention over [UND | GEN]."""

    def _run(self, device, dtype, atol, rtol, backend="triton", layout=None):
        torch.manual_seed(0)
        if layout is None:
            layout = MultiviewLayout(
                num_views=2,
                latent_frames=6,
                patch_height=2,
                patch_width=3,
                control_attends_sensor=True,
                seconds_per_frame=0.2,
                backend=backend,
                max_und_tokens=70,
            )
        heads, kv_heads, head_dim = 4, 2, 16
        real_und_len = sum(layout.caption_lengths) or 7
        gen = layout.gen_tokens
        q = torch.randn(1, gen, heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(1, gen, kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn(1, gen, kv_heads, head_dim, device=device, dtype=dtype)
        k_und = torch.randn(
            1, real_und_len, kv_heads, head_dim, device=device, dtype=dtype
        )
        v_und = torch.randn(
            1, real_und_len, kv_heads, head_dim, device=device, dtype=dtype
        )
        context = MultiviewAttentionContext(layout, {}, {})
        out = padded_multiview_flex_attention(q, k, v, k_und, v_und, context)
        self.assertEqual(tuple(out.shape), (1, gen, heads, head_dim))
        expected = _dense_masked_oracle(
            q.cpu(), k.cpu(), v.cpu(), k_und.cpu(), v_und.cpu(), layout, real_und_len
        )
        torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)
        return context

    def test_cpu_matches_dense_masked_gqa_oracle(self):
        context = self._run(torch.device("cpu"), torch.float32, atol=1e-4, rtol=1e-4)
        # One plan per (layout, text length) and reusable packing buffers.
        self.assertEqual(len(context.mask_cache), 1)
        self.assertEqual(
            {key[0].split(":")[1] for key in context.buffer_cache}, {"q", "k", "v"}
        )

    def test_cpu_windowed_joint_layout_matches_dense_oracle(self):
        """The Oct-1 contract: 0.4 s past window, per-camera captions, LiDAR at 10 Hz."""
        camera = (4, 1, 2)  # 2 views x 2 frames at 0.4 s
        lidar = (8, 1, 1)  # 8 sweeps at 0.1 s
        layout = MultiviewLayout(
            num_views=2,
            latent_frames=4,
            patch_height=1,
            patch_width=2,
            control_attends_sensor=True,
            seconds_per_frame=0.4,
            decomposed_temporal_window_seconds=0.4,
            backend="triton",
            max_und_tokens=70,
            items=(
                MaskItem(camera, 2, is_control=True, seconds_per_frame=0.4),
                MaskItem(camera, 2, seconds_per_frame=0.4),
                MaskItem(
                    lidar,
                    1,
                    view_offset=2,
                    is_control=True,
                    seconds_per_frame=0.1,
                    is_lidar=True,
                ),
                MaskItem(lidar, 1, view_offset=2, seconds_per_frame=0.1, is_lidar=True),
            ),
            caption_lengths=(3, 2),
        )
        self._run(
            torch.device("cpu"), torch.float32, atol=1e-4, rtol=1e-4, layout=layout
        )

    def test_padding_capacity_does_not_change_the_output(self):
        torch.manual_seed(1)
        base = dict(
            num_views=2,
            latent_frames=4,
            patch_height=1,
            patch_width=2,
            seconds_per_frame=0.5,
            backend="triton",
        )
        small = MultiviewLayout(max_und_tokens=10, **base)
        large = MultiviewLayout(max_und_tokens=200, **base)
        gen = small.gen_tokens
        q = torch.randn(1, gen, 2, 8)
        k = torch.randn(1, gen, 1, 8)
        v = torch.randn(1, gen, 1, 8)
        k_und = torch.randn(1, 5, 1, 8)
        v_und = torch.randn(1, 5, 1, 8)
        out_small = padded_multiview_flex_attention(
            q, k, v, k_und, v_und, MultiviewAttentionContext(small, {}, {})
        )
        out_large = padded_multiview_flex_attention(
            q, k, v, k_und, v_und, MultiviewAttentionContext(large, {}, {})
        )
        torch.testing.assert_close(out_small, out_large, atol=1e-5, rtol=1e-5)

    def test_plan_geometry_is_independent_of_prompt_length(self):
        layout = MultiviewLayout(
            num_views=2,
            latent_frames=4,
            patch_height=1,
            patch_width=2,
            backend="triton",
            max_und_tokens=100,
        )
        context = MultiviewAttentionContext(layout, {}, {})
        _, short = get_multiview_attention_plan(
            context,
            real_und_len=5,
            real_q_len=layout.gen_tokens,
            device=torch.device("cpu"),
        )
        _, long = get_multiview_attention_plan(
            context,
            real_und_len=90,
            real_q_len=layout.gen_tokens,
            device=torch.device("cpu"),
        )
        self.assertEqual(short.padded_und_len, 128)
        self.assertEqual(short.padded_und_len, long.padded_und_len)
        self.assertEqual(short.padded_q_len, long.padded_q_len)
        self.assertEqual(len(context.mask_cache), 2)
        with self.assertRaisesRegex(ValueError, "exceeds the layout capacity"):
            get_multiview_attention_plan(
                context,
                real_und_len=101,
                real_q_len=layout.gen_tokens,
                device=torch.device("cpu"),
            )
        with self.assertRaisesRegex(ValueError, "does not match the request layout"):
            get_multiview_attention_plan(
                context,
                real_und_len=5,
                real_q_len=layout.gen_tokens + 1,
                device=torch.device("cpu"),
            )

    @unittest.skipUnless(
        torch.cuda.is_available(), "needs a CUDA device for the Triton kernel"
    )
    def test_cuda_triton_kernel_matches_dense_oracle(self):
        self._run(torch.device("cuda"), torch.bfloat16, atol=3e-2, rtol=3e-2)

    @unittest.skipUnless(
        _fa4_available(),
        "needs an SM90 or SM100 device with the flash-attn-4 CuTe package",
    )
    def test_cuda_fa4_kernel_matches_dense_oracle(self):
        context = self._run(
            torch.device("cuda"), torch.bfloat16, atol=3e-2, rtol=3e-2, backend="fa4"
        )
        plan = next(iter(context.mask_cache.values()))
        self.assertIsInstance(plan, MultiviewBlockSparsity)
        self.assertEqual(
            (plan.q_block_size, plan.kv_block_size),
            fa4_sparse_block_sizes(torch.device("cuda")),
        )

    def test_fa4_block_map_matches_dense_projection(self):
        """Both FA4 geometries must classify tiles exactly like the 64x64 map does."""
        for block_sizes in ((256, 128), (128, 128)):
            with self.subTest(block_sizes=block_sizes):
                layout = MultiviewLayout(
                    num_views=2,
                    latent_frames=4,
                    patch_height=4,
                    patch_width=16,
                    control_attends_sensor=True,
                    backend="fa4",
                    max_und_tokens=100,
                    fa4_block_sizes=block_sizes,
                )
                context = MultiviewAttentionContext(layout, {}, {})
                plan, geometry = get_multiview_attention_plan(
                    context,
                    real_und_len=9,
                    real_q_len=layout.gen_tokens,
                    device=torch.device("cpu"),
                )
                self.assertIsInstance(plan, MultiviewBlockSparsity)
                self.assertEqual((plan.q_block_size, plan.kv_block_size), block_sizes)
                self.assertEqual(
                    (geometry.padded_q_len, geometry.padded_und_len), (512, 128)
                )
                self.assertEqual(plan.q_word_base.numel(), geometry.padded_q_len)
                self.assertEqual(
                    plan.k_group_ids.numel(),
                    geometry.padded_und_len + geometry.padded_q_len,
                )
                metadata = plan.metadata
                dense = multiview_pair_predicate(
                    metadata,
                    torch.arange(metadata.q_len)[:, None],
                    torch.arange(metadata.kv_len)[None, :],
                )
                q_block, kv_block = block_sizes
                for qb in range(metadata.q_len // q_block):
                    full = set(
                        plan.full_indices[qb, : int(plan.full_counts[qb])].tolist()
                    )
                    partial = set(
                        plan.partial_indices[
                            qb, : int(plan.partial_counts[qb])
                        ].tolist()
                    )
                    for kb in range(metadata.kv_len // kv_block):
                        tile = dense[
                            qb * q_block : (qb + 1) * q_block,
                            kb * kv_block : (kb + 1) * kv_block,
                        ]
                        if tile.all():
                            self.assertIn(kb, full, (qb, kb))
                        elif tile.any():
                            self.assertIn(kb, partial, (qb, kb))
                        else:
                            self.assertNotIn(kb, full | partial, (qb, kb))

    def test_fa4_block_geometry_follows_compute_capability(self):
        self.assertEqual(fa4_sparse_block_sizes(capability_major=9), (128, 128))
        self.assertEqual(fa4_sparse_block_sizes(capability_major=10), (256, 128))
        self.assertEqual(fa4_sparse_block_sizes(capability_major=11), (256, 128))
        for unsupported in (8, 12):
            with self.subTest(capability=unsupported):
                with self.assertRaisesRegex(ValueError, "not available"):
                    fa4_sparse_block_sizes(capability_major=unsupported)
        with self.assertRaisesRegex(ValueError, "CUDA device"):
            fa4_sparse_block_sizes(torch.device("cpu"))
        common = dict(num_views=1, latent_frames=1, patch_height=1, patch_width=1)
        self.assertEqual(
            layout_sparse_block_sizes(
                MultiviewLayout(backend="triton", **common), torch.device("cpu")
            ),
            TRITON_SPARSE_BLOCK_SIZES,
        )
        pinned = MultiviewLayout(backend="fa4", fa4_block_sizes=(128, 128), **common)
        self.assertEqual(
            layout_sparse_block_sizes(pinned, torch.device("cpu")), (128, 128)
        )
        self.assertIn((128, 128), pinned.cache_key())
        with self.assertRaisesRegex(ValueError, "CUDA device"):
            layout_sparse_block_sizes(
                MultiviewLayout(backend="fa4", **common), torch.device("cpu")
            )
        # The default backend is triton: a layout without a pin maps to its blocks.
        self.assertEqual(
            layout_sparse_block_sizes(MultiviewLayout(**common), torch.device("cpu")),
            TRITON_SPARSE_BLOCK_SIZES,
        )
        with self.assertRaisesRegex(ValueError, "fa4_block_sizes"):
            MultiviewLayout(backend="fa4", fa4_block_sizes=(0, 128), **common)
        with self.assertRaisesRegex(ValueError, "backend must be one of"):
            MultiviewLayout(backend="flex", **common)


class TestMaskedBackendResolution(unittest.TestCase):
    """``auto`` takes FA4 wherever its block-sparse kernels run, Triton elsewhere."""

    _AVAILABLE = (
        "sglang.multimodal_gen.runtime.models.dits.cosmos3_simulation.multiview_attention"
        ".fa4_sparse_available"
    )

    def test_cuda_device_follows_fa4_availability(self):
        cuda = torch.device("cuda", 0)
        with mock.patch(self._AVAILABLE, return_value=True) as available:
            self.assertEqual(resolve_masked_backend(cuda), "fa4")
            available.assert_called_once_with(cuda)
        with mock.patch(self._AVAILABLE, return_value=False):
            self.assertEqual(resolve_masked_backend(cuda), "triton")

    def test_off_cuda_is_triton_without_probing(self):
        with mock.patch(self._AVAILABLE) as available:
            self.assertEqual(resolve_masked_backend(torch.device("cpu")), "triton")
            available.assert_not_called()
        with (
            mock.patch("torch.cuda.is_available", return_value=False),
            mock.patch(self._AVAILABLE) as available,
        ):
            self.assertEqual(resolve_masked_backend(None), "triton")
            available.assert_not_called()

    def test_import_failure_logs_fallback_reason(self):
        original_import = builtins.__import__

        def import_dependency(name, *args, **kwargs):
            if name == "cutlass":
                raise ImportError("incompatible CuTe ABI")
            return original_import(name, *args, **kwargs)

        with (
            mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
            mock.patch("builtins.__import__", side_effect=import_dependency),
            self.assertLogs(self._AVAILABLE.rsplit(".", 1)[0], level="DEBUG") as logs,
        ):
            self.assertEqual(resolve_masked_backend(torch.device("cuda")), "triton")
        self.assertIn("incompatible CuTe ABI", "\n".join(logs.output))

    def test_fa4_block_map_exists_for_hopper_and_blackwell(self):
        self.assertEqual(fa4_sparse_block_sizes(capability_major=9), (128, 128))
        self.assertEqual(fa4_sparse_block_sizes(capability_major=10), (256, 128))
        with self.assertRaisesRegex(
            ValueError, "not available on compute capability 8"
        ):
            fa4_sparse_block_sizes(capability_major=8)


class TestSchema3Helpers(unittest.TestCase):
    """Rig view embedding rows and the per-stream LiDAR patch of the Oct-1 export."""

    def test_lidar_patch_grid_and_patchify_roundtrip(self):
        self.assertEqual(spatial_patch_hw(1), (1, 1))
        self.assertEqual(spatial_patch_hw([1, 2]), (1, 2))
        with self.assertRaisesRegex(ValueError, "positive int"):
            spatial_patch_hw((0, 2))
        # 1x1: every latent cell is a token, no padding.
        self.assertEqual(lidar_patch_grid(8, 113, (1, 1)), (8, 113, 8, 113))
        # 2x2: the odd width pads to the patch like the camera's _pad_to_patch_size.
        self.assertEqual(lidar_patch_grid(8, 113, (2, 2)), (4, 57, 8, 114))
        latent = torch.arange(2 * 3 * 2 * 3 * 5, dtype=torch.float32).view(
            2, 3, 2, 3, 5
        )
        for patch in ((1, 1), (2, 2), (1, 2)):
            with self.subTest(patch=patch):
                tokens = patchify_lidar(latent, patch)
                patch_h, patch_w, _, _ = lidar_patch_grid(3, 5, patch)
                self.assertEqual(
                    tuple(tokens.shape),
                    (2, 2 * patch_h * patch_w, patch[0] * patch[1] * 3),
                )
                back = unpatchify_lidar(tokens, latent.shape[1:], patch)
                torch.testing.assert_close(back, latent)
        # With a 1x1 patch the token order is frame-major then row-major, as the
        # camera's patchify would be with p=1.
        tokens = patchify_lidar(latent, (1, 1))
        torch.testing.assert_close(tokens[0, 0], latent[0, :, 0, 0, 0])
        torch.testing.assert_close(tokens[0, 1], latent[0, :, 0, 0, 1])

    def test_add_rig_view_rows(self):
        hidden = torch.zeros(1, 6, 4)  # 2 views x 3 tokens
        rows = torch.tensor([[1.0, 1, 1, 1], [2.0, 2, 2, 2]])
        out = add_rig_view_rows(hidden, rows, num_views=2)
        self.assertIs(out, hidden)
        torch.testing.assert_close(hidden[0, :3], torch.ones(3, 4))
        torch.testing.assert_close(hidden[0, 3:], torch.full((3, 4), 2.0))
        shared = add_rig_view_rows(torch.zeros(1, 6, 4), torch.full((1, 4), 7.0), 2)
        torch.testing.assert_close(shared, torch.full((1, 6, 4), 7.0))
        with self.assertRaisesRegex(ValueError, "rows must be"):
            add_rig_view_rows(torch.zeros(1, 6, 4), torch.zeros(3, 4), 2)
        with self.assertRaisesRegex(ValueError, "camera-major view blocks"):
            add_rig_view_rows(torch.zeros(1, 7, 4), rows, 2)

    def test_deployment_rig_view_ids_follow_physical_camera_ids(self):
        deployment = parse_multiview_deployment_config(_transformer_config())
        # Subsets and reordered views keep their trained rows.
        self.assertEqual(
            deployment.rig_view_ids(
                ["camera_rear_tele_30fov", "camera_front_wide_120fov"]
            ),
            [3, 0],
        )
        self.assertEqual(
            deployment.rig_view_ids(COSMOS3_MADS_CAMERAS),
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        )
        with self.assertRaisesRegex(ValueError, "no row"):
            deployment.rig_view_ids(["camera_rear_tele_30fov", "camera_x"])

    def test_per_view_negative_prompt_formatting(self):
        negative = format_per_view_negative_prompt(
            "Blurry, smeared motion", num_frames=17, fps=30.0, height=480, width=832
        )
        # Same whole-second duration and resolution sentences as the positive
        # captions, no rig header and no emphasis.
        self.assertTrue(negative.startswith("Blurry, smeared motion"))
        self.assertIn("0.0 second", negative)
        self.assertIn("480", negative)
        self.assertNotIn("vehicle-mounted", negative)
        self.assertNotIn("wsm", negative.lower())


class TestLayoutHelpers(unittest.TestCase):
    def test_expand_condition_indexes_camera_major(self):
        self.assertEqual(
            expand_multiview_condition_frame_indexes([0], 11, 11 * 24),
            [view * 24 for view in range(11)],
        )
        self.assertEqual(
            expand_multiview_condition_frame_indexes([1, 0, 99], 2, 6), [0, 1, 3, 4]
        )
        self.assertEqual(expand_multiview_condition_frame_indexes(None, 2, 6), [])
        with self.assertRaises(ValueError):
            expand_multiview_condition_frame_indexes([0], 2, 5)

    def test_layout_geometry_and_validation(self):
        layout = MultiviewLayout(
            num_views=11, latent_frames=264, patch_height=15, patch_width=26
        )
        self.assertEqual(layout.frames_per_view, 24)
        self.assertEqual(layout.item_tokens, 102_960)
        self.assertEqual(layout.gen_tokens, 205_920)
        with self.assertRaisesRegex(ValueError, "divisible by num_views"):
            MultiviewLayout(
                num_views=11, latent_frames=263, patch_height=15, patch_width=26
            )
        with self.assertRaisesRegex(ValueError, "attention_scope"):
            MultiviewLayout(
                num_views=1,
                latent_frames=1,
                patch_height=1,
                patch_width=1,
                attention_scope="all",
            )

    def test_temporal_position_period_wraps_camera_major_frames(self):
        ids, _ = compute_mrope_position_ids_vision(
            6,
            1,
            1,
            temporal_offset=0,
            device=torch.device("cpu"),
            temporal_position_period=3,
        )
        self.assertEqual(ids[0].tolist(), [0, 1, 2, 0, 1, 2])
        ids_fps, _ = compute_mrope_position_ids_vision(
            6,
            1,
            1,
            temporal_offset=0,
            device=torch.device("cpu"),
            fps=30.0,
            base_fps=24.0,
            temporal_compression_factor=4,
            temporal_position_period=3,
        )
        torch.testing.assert_close(
            ids_fps[0], torch.tensor([0.0, 0.8, 1.6, 0.0, 0.8, 1.6])
        )
        plain, _ = compute_mrope_position_ids_vision(
            6, 1, 1, temporal_offset=0, device=torch.device("cpu")
        )
        self.assertEqual(plain[0].tolist(), [0, 1, 2, 3, 4, 5])
        with self.assertRaisesRegex(ValueError, "positive"):
            compute_mrope_position_ids_vision(
                6,
                1,
                1,
                temporal_offset=0,
                device=torch.device("cpu"),
                temporal_position_period=0,
            )


class TestPixelHelpersAndPrompt(unittest.TestCase):
    def test_fisheye_canvas_crop_rounds_half_to_even(self):
        """1720x1080 fisheye sources resize to 523 rows for a 480x832 canvas; the
        21.5-row crop offset must round to 22 like imaginaire4. A floor offset
        shifted every fisheye anchor by one row (28 dB instead of 45 dB parity)."""
        ramp = (
            torch.arange(1080, dtype=torch.int64)
            .remainder(256)
            .to(torch.uint8)
            .view(1, 1, 1080, 1)
            .expand(3, 1, 1080, 1720)
        )

        actual = fit_uint8_cthw(ramp, height=480, width=832)

        resized = torch.nn.functional.interpolate(
            ramp.permute(1, 0, 2, 3).float(),
            size=(523, 832),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
        expected = resized[0, :, 22:502].round().clamp(0, 255).to(torch.uint8)
        self.assertEqual(tuple(actual.shape), (3, 1, 480, 832))
        self.assertTrue(torch.equal(actual[:, 0], expected))
        self.assertFalse(
            torch.equal(actual[:, 0], resized[0, :, 21:501].round().to(torch.uint8))
        )

    def test_fit_uint8_cthw_chunks_change_no_pixel(self):
        """Chunked resize is the whole-clip resize, value for value, at every geometry
        the corpora use: 1924x1084 MADS controls (odd, downscale), 1280x720 KPI
        controls (identity scale), 1720x1080 fisheye and a 4:3 upscale."""

        def whole_clip(frames, *, height, width):
            orig_h, orig_w = int(frames.shape[2]), int(frames.shape[3])
            scale = max(width / orig_w, height / orig_h)
            resize_h = int(math.ceil(scale * orig_h))
            resize_w = int(math.ceil(scale * orig_w))
            tchw = frames.permute(1, 0, 2, 3).to(dtype=torch.float32)
            resized = TF.resize(tchw, [resize_h, resize_w])
            cropped = TF.center_crop(resized, [height, width])
            return cropped.round().clamp(0, 255).to(torch.uint8).permute(1, 0, 2, 3)

        generator = torch.Generator().manual_seed(0)
        for (orig_h, orig_w), (height, width) in (
            ((1084, 1924), (720, 1280)),
            ((720, 1280), (720, 1280)),
            ((1080, 1720), (480, 832)),
            ((544, 736), (720, 1280)),
        ):
            for num_frames in (1, 5, 17):
                clip = torch.randint(
                    0,
                    256,
                    (3, num_frames, orig_h, orig_w),
                    dtype=torch.uint8,
                    generator=generator,
                )
                expected = whole_clip(clip, height=height, width=width)
                for chunk_frames in (1, 4, 16, 64):
                    actual = fit_uint8_cthw(
                        clip, height=height, width=width, chunk_frames=chunk_frames
                    )
                    self.assertEqual(
                        tuple(actual.shape), (3, num_frames, height, width)
                    )
                    self.assertEqual(actual.dtype, torch.uint8)
                    self.assertTrue(
                        torch.equal(actual, expected),
                        f"{(orig_h, orig_w)}->{(height, width)} T={num_frames} chunk={chunk_frames}",
                    )
        self.assertEqual(
            tuple(fit_uint8_cthw(clip[:, :0], height=480, width=832).shape),
            (3, 0, 480, 832),
        )
        with self.assertRaisesRegex(ValueError, "positive"):
            fit_uint8_cthw(clip, height=480, width=832, chunk_frames=0)

    def test_load_media_streams_decoded_frames_through_the_chunked_resize(self):
        """The loader converts and resizes the decoder's frames chunk by chunk and
        produces exactly what stacking every frame first would."""
        generator = torch.Generator().manual_seed(1)
        frames = [
            Image.fromarray(
                torch.randint(
                    0, 256, (90, 160, 3), dtype=torch.uint8, generator=generator
                ).numpy()
            )
            for _ in range(37)
        ]
        stacked = torch.stack([_pil_to_uint8_tensor(frame) for frame in frames], dim=1)
        with mock.patch.object(
            multiview_stage, "load_video", return_value=frames
        ) as load:
            actual = multiview_stage.load_media_uint8_cthw(
                "rig/front.mp4", height=48, width=64, max_frames=37
            )
        load.assert_called_once_with("rig/front.mp4", max_frames=37)
        self.assertTrue(
            torch.equal(actual, fit_uint8_cthw(stacked, height=48, width=64))
        )
        with mock.patch.object(multiview_stage, "load_video", return_value=[]):
            with self.assertRaisesRegex(ValueError, "No frames decoded"):
                multiview_stage.load_media_uint8_cthw(
                    "rig/front.mp4", height=48, width=64, max_frames=4
                )

    def test_pad_view_frames_truncates_or_repeats_last_frame(self):
        frames = torch.stack(
            [torch.full((3, 2, 3), value, dtype=torch.uint8) for value in (10, 20)],
            dim=1,
        )
        padded = pad_view_frames_uint8(frames, num_frames=5)
        self.assertEqual(tuple(padded.shape), (3, 5, 2, 3))
        self.assertEqual(padded[:, 0].unique().tolist(), [10])
        self.assertEqual(padded[:, 1:].unique().tolist(), [20])
        truncated = pad_view_frames_uint8(frames, num_frames=1)
        self.assertEqual(truncated.unique().tolist(), [10])
        with self.assertRaisesRegex(ValueError, "zero frames"):
            pad_view_frames_uint8(frames[:, :0], num_frames=3)

    def test_synthetic_pixels_and_media_kind(self):
        pixels = synthetic_multiview_pixels(
            num_views=3, num_frames=5, height=4, width=6
        )
        self.assertEqual(tuple(pixels.shape), (1, 3, 15, 4, 6))
        self.assertEqual(pixels.dtype, torch.uint8)
        self.assertEqual(media_kind("a/front.PNG"), "image")
        self.assertEqual(media_kind("a/front.mp4"), "video")


class TestDeploymentConfig(unittest.TestCase):
    def test_accepts_the_contract(self):
        deployment = parse_multiview_deployment_config(
            _transformer_config(DEPLOYMENT_BLOCK)
        )
        self.assertEqual(deployment.cameras, COSMOS3_MADS_CAMERAS)
        self.assertEqual(deployment.num_views, 11)
        self.assertEqual(deployment.cross_view_past_window_seconds, 0.4)
        self.assertEqual(deployment.lidar_latent_patch_size_hw, (1, 1))
        self.assertEqual(deployment.rig_view_embedding["lidar_id"], 11)
        self.assertEqual(
            deployment.rig_view_ids(
                ["camera_rear_tele_30fov", "camera_front_wide_120fov"]
            ),
            [3, 0],
        )
        with self.assertRaisesRegex(ValueError, "no row for cameras"):
            deployment.rig_view_ids(["camera_top"])
        self.assertTrue(deployment.supports_lidar)
        self.assertEqual(deployment.lidar["fps"], 10.0)
        self.assertEqual(deployment.inference_default("num_steps", 1), 35)
        self.assertEqual(deployment.inference_default("resolution", "720"), "480")
        self.assertEqual(deployment.inference_default("guidance_interval", "x"), "x")
        # The contract dropped sigma_max; consumers fall back.
        self.assertEqual(deployment.inference_default("sigma_max", 80.0), 80.0)
        # Any subset or order of the exported cameras is a valid export too.
        block = copy.deepcopy(DEPLOYMENT_BLOCK)
        block["cameras"] = list(reversed(COSMOS3_MADS_CAMERAS))
        self.assertEqual(
            parse_multiview_deployment_config(_transformer_config(block)).cameras,
            tuple(reversed(COSMOS3_MADS_CAMERAS)),
        )
        camera_only = {
            k: v
            for k, v in DEPLOYMENT_BLOCK.items()
            if k not in ("lidar", "lidar_latent_patch_size_hw")
        }
        deployment = parse_multiview_deployment_config(_transformer_config(camera_only))
        self.assertFalse(deployment.supports_lidar)
        self.assertIsNone(deployment.lidar_latent_patch_size_hw)

    def test_contract_validation(self):
        def parse(**changes):
            block = {**DEPLOYMENT_BLOCK, **changes}
            for key, value in changes.items():
                if value is None:
                    block.pop(key)
            return parse_multiview_deployment_config(_transformer_config(block))

        with self.assertRaisesRegex(
            ValueError, "Unknown Cosmos3 multiview contract fields"
        ):
            parse(backend="triton")
        with self.assertRaisesRegex(
            ValueError, "Unknown Cosmos3 multiview contract fields"
        ):
            parse(lidar_patch_spatial_hw=[1, 1])
        with self.assertRaisesRegex(ValueError, "requires field 'rig_view_embedding'"):
            parse(rig_view_embedding=None)
        with self.assertRaisesRegex(
            ValueError, "requires field 'lidar_latent_patch_size_hw'"
        ):
            parse(lidar_latent_patch_size_hw=None)
        with self.assertRaisesRegex(
            ValueError, "lidar_latent_patch_size_hw requires a lidar block"
        ):
            parse(lidar=None)
        with self.assertRaisesRegex(ValueError, "finite and non-negative"):
            parse(cross_view_past_window_seconds=-0.1)
        with self.assertRaisesRegex(TypeError, "must be a number"):
            parse(cross_view_past_window_seconds="0.4")
        defaults = {**DEPLOYMENT_BLOCK["inference_defaults"]}
        defaults.pop("guidance")
        with self.assertRaisesRegex(
            ValueError, "Incomplete Cosmos3 multiview inference_defaults"
        ):
            parse(inference_defaults=defaults)
        # The Sep-vintage optional keys are still accepted when an exporter writes them.
        parse(
            inference_defaults={
                **DEPLOYMENT_BLOCK["inference_defaults"],
                "sigma_max": 80.0,
            }
        )
        # A window of zero keeps cross-view attention to the same instant.
        self.assertEqual(
            parse(cross_view_past_window_seconds=0).cross_view_past_window_seconds,
            0.0,
        )
        for field in COSMOS3_MULTIVIEW_CONTRACT_FIELDS - {
            "lidar",
            "lidar_latent_patch_size_hw",
        }:
            with self.subTest(missing=field):
                with self.assertRaisesRegex(ValueError, "requires field"):
                    parse(**{field: None})

    def test_backend_resolution(self):
        config = Cosmos3MultiviewConfig()
        config.multiview_deployment = parse_multiview_deployment_config(
            _transformer_config(DEPLOYMENT_BLOCK)
        )
        with mock.patch.dict(os.environ, {MULTIVIEW_BACKEND_ENV_VAR: ""}):
            self.assertEqual(config.resolved_multiview_backend(), "auto")
        with mock.patch.dict(os.environ, {MULTIVIEW_BACKEND_ENV_VAR: "fa4"}):
            self.assertEqual(config.resolved_multiview_backend(), "fa4")
        with mock.patch.dict(os.environ, {MULTIVIEW_BACKEND_ENV_VAR: "fa4"}):
            # The config field wins over the environment.
            config.multiview_attention_backend = "triton"
            self.assertEqual(config.resolved_multiview_backend(), "triton")
            config.multiview_attention_backend = None
        for bad in ("maskless", "flex"):
            with mock.patch.dict(os.environ, {MULTIVIEW_BACKEND_ENV_VAR: bad}):
                with self.assertRaisesRegex(ValueError, "must be one of"):
                    config.resolved_multiview_backend()

    def test_lidar_contract_validation(self):
        self.assertEqual(validate_lidar_config(LIDAR_BLOCK)["version"], "1.2")
        for path, value, message in (
            (("version",), "1.1", "V1.2"),
            (("range_projection", "model_width"), 1800, "circularly padded"),
            (("network_config", "patch_size"), [2, 4], "disagree"),
            (("streaming_context_frames",), 4, "chunk length"),
        ):
            with self.subTest(path=path):
                block = copy.deepcopy(LIDAR_BLOCK)
                target = block
                for key in path[:-1]:
                    target = target[key]
                target[path[-1]] = value
                with self.assertRaisesRegex(ValueError, message):
                    validate_lidar_config(block)

    def test_rejects_wrong_backbone_before_multiview_fields(self):
        with self.assertRaisesRegex(ValueError, "backbone_type"):
            parse_multiview_deployment_config(
                {"backbone_type": None, "multiview": None}
            )

    def test_rejects_malformed_fields(self):
        bad_cases = {
            "cross_view_past_window_seconds": ("0.4", TypeError),
            "cameras": ("camera_front_wide_120fov", TypeError),
            "rig_view_embedding": ({**RIG_VIEW_EMBEDDING, "lidar_id": 3}, ValueError),
            "inference_defaults": ({"resolution": "480"}, ValueError),
            "lidar_latent_patch_size_hw": ([1, 0], ValueError),
        }
        for field, (value, error) in bad_cases.items():
            with self.subTest(field=field):
                block = copy.deepcopy(DEPLOYMENT_BLOCK)
                block[field] = value
                with self.assertRaises(error):
                    parse_multiview_deployment_config(_transformer_config(block))

    def test_config_flags_and_parallelism_limits(self):
        config = Cosmos3MultiviewConfig()
        self.assertEqual(
            config.transformer_class_override, "Cosmos3MultiviewTransformer"
        )
        self.assertTrue(config.use_system_prompt)
        self.assertFalse(config.supports_action_endpoint())
        self.assertFalse(config.supports_dynamic_batching())
        with (
            mock.patch(
                "sglang.multimodal_gen.configs.pipeline_configs.cosmos3_multiview._transformer_config",
                return_value=_transformer_config(),
            ),
            mock.patch(
                "sglang.multimodal_gen.configs.pipeline_configs.cosmos3.get_distilled_sigmas",
                return_value=None,
            ),
            mock.patch(
                "sglang.multimodal_gen.configs.pipeline_configs.cosmos3.is_edge_checkpoint",
                return_value=False,
            ),
            mock.patch(
                "sglang.multimodal_gen.configs.pipeline_configs.cosmos3.is_nano_checkpoint",
                return_value=True,
            ),
        ):
            config.update_config_from_dict({"model_path": "/models/mv"})
        self.assertEqual(config.multiview_deployment.num_views, 11)

        def args(**overrides):
            base = dict(
                tp_size=1,
                sp_degree=1,
                ulysses_degree=1,
                ring_degree=1,
                enable_cfg_parallel=False,
            )
            return SimpleNamespace(**{**base, **overrides})

        for bad in (
            dict(tp_size=2),
            dict(ring_degree=2, sp_degree=2),
            dict(sp_degree=2),  # ring-less SP must be spelled as ulysses_degree
            dict(ulysses_degree=3, sp_degree=3),
        ):
            with self.subTest(arg=bad):
                with self.assertRaises(ValueError):
                    config.validate_server_args(args(**bad))
        # Ulysses over 2, 4 or 8 ranks, alone or with CFG parallel, is allowed.
        for degree in (2, 4, 8):
            config.validate_server_args(args(ulysses_degree=degree, sp_degree=degree))
        config.validate_server_args(
            args(ulysses_degree=2, sp_degree=2, enable_cfg_parallel=True)
        )
        config.validate_server_args(args(enable_cfg_parallel=True))

    def test_sequence_sharding_helpers(self):
        self.assertEqual(sequence_shard_padding(10, 1), 0)
        self.assertEqual(sequence_shard_padding(10, 4), 2)
        self.assertEqual(sequence_shard_padding(12, 4), 0)
        tokens = torch.arange(10.0).view(1, 10, 1)
        # Tokens pad with zeros; each rank gets a contiguous chunk of 3.
        self.assertEqual(
            shard_sequence(tokens, 4, 3, dim=1, pad_last=False).flatten().tolist(),
            [9.0, 0.0, 0.0],
        )
        self.assertEqual(
            shard_sequence(tokens, 4, 0, dim=1, pad_last=False).flatten().tolist(),
            [0.0, 1.0, 2.0],
        )
        # Positions repeat their last entry so the pad has a valid RoPE position.
        positions = torch.arange(10).view(1, 1, 10).expand(3, 1, 10)
        last = shard_sequence(positions, 4, 3, dim=2, pad_last=True)
        self.assertEqual(last.shape, (3, 1, 3))
        self.assertEqual(last[0, 0].tolist(), [9, 9, 9])
        # Degree 1 is the identity.
        self.assertIs(shard_sequence(tokens, 1, 0, dim=1, pad_last=False), tokens)


def _views(cameras, *, vision=False):
    views = []
    for index, camera in enumerate(cameras):
        view = {"camera_key": camera, "control_path": f"control_{index}.mp4"}
        if vision:
            view["vision_path"] = f"vision_{index}.png"
        views.append(view)
    return views


class TestSamplingParamsAndInputStage(unittest.TestCase):
    def test_defaults_follow_the_reference(self):
        params = Cosmos3MultiviewSamplingParams()
        # The canvas is a bucket choice made at adjustment, not a field default.
        self.assertEqual((params.width, params.height), (None, None))
        self.assertEqual(params.num_frames, 201)
        self.assertEqual(params.fps, 30)
        self.assertEqual(params.guidance_scale, 6.0)
        self.assertEqual(params.num_inference_steps, 35)
        self.assertEqual(params.negative_metadata_mode, "same")
        self.assertEqual(params.resolve_views(), [])
        for name in ("multiview", "lidar", "resolution", "aspect_ratio"):
            self.assertIn(
                name, Cosmos3MultiviewSamplingParams.video_request_extra_fields()
            )

    def test_adjust_resolves_canvas_and_checkpoint_defaults(self):
        # Without a deployment (client side) the field defaults stand; guidance is not clamped.
        params = _adjust_multiview(
            Cosmos3MultiviewSamplingParams(guidance_scale=9.0), None
        )
        self.assertEqual((params.width, params.height), (832, 480))
        self.assertEqual(params.num_frames, 201)
        self.assertEqual(params.guidance_scale, 9.0)

        schema2 = parse_multiview_deployment_config(_transformer_config())
        params = _adjust_multiview(
            Cosmos3MultiviewSamplingParams(guidance_scale=9.0), schema2
        )
        self.assertEqual((params.width, params.height), (832, 480))
        self.assertEqual(params.num_frames, 201)
        self.assertEqual(params.guidance_scale, 9.0)
        self.assertEqual(params.flow_shift, 10.0)
        self.assertEqual(params.aspect_ratio, "auto")
        portrait = _adjust_multiview(
            Cosmos3MultiviewSamplingParams(resolution=720, aspect_ratio="9:16"), schema2
        )
        self.assertEqual((portrait.width, portrait.height), (720, 1280))
        explicit = _adjust_multiview(
            Cosmos3MultiviewSamplingParams(width=1104, height=832, resolution="720"),
            schema2,
        )
        self.assertEqual(explicit.aspect_ratio, "4,3")
        with self.assertRaisesRegex(ValueError, "requires width=1280"):
            _adjust_multiview(
                Cosmos3MultiviewSamplingParams(
                    width=832, height=480, resolution="720", aspect_ratio="16:9"
                ),
                schema2,
            )
        self.assertEqual(normalize_multiview_aspect_ratio("1920:1080"), "16,9")
        self.assertEqual(closest_multiview_aspect_ratio(1084, 1924, "480"), "16,9")
        self.assertEqual(closest_multiview_aspect_ratio(1000, 1000, "720"), "1,1")

    def test_views_from_multiview_object_and_control_path_list(self):
        params = Cosmos3MultiviewSamplingParams(
            multiview={
                "views": _views(("front", "left"), vision=True),
                "condition_video_as_image": True,
            }
        )
        views = params.resolve_views()
        self.assertEqual([view.camera_key for view in views], ["front", "left"])
        self.assertEqual(
            [view.vision for view in views], ["vision_0.png", "vision_1.png"]
        )
        self.assertTrue(params.resolved_condition_video_as_image())
        self.assertIsNone(params.resolved_local_condition_indexes())
        t2v = Cosmos3MultiviewSamplingParams(control_path=["a.mp4", "b.mp4"])
        self.assertEqual(
            [view.control for view in t2v.resolve_views()], ["a.mp4", "b.mp4"]
        )
        self.assertTrue(all(view.camera_key is None for view in t2v.resolve_views()))

    def test_request_validation(self):
        # Partial vision is view completion, admitted here and checked per checkpoint later.
        views = _views(("front", "left"))
        views[0]["vision_path"] = "front.mp4"
        self.assertEqual(len(validate_multiview_request({"views": views})), 2)
        with self.assertRaisesRegex(ValueError, "every view or none"):
            views = _views(("front", "left"))
            views[0]["prompt"] = "A car."
            validate_multiview_request({"views": views})
        with self.assertRaisesRegex(ValueError, "control_path"):
            validate_lidar_request({"control_path": "sweeps.tar"})
        self.assertEqual(
            validate_lidar_request({"control_path": "sweeps.safetensors"}),
            {
                "control_path": "sweeps.safetensors",
                "decode": False,
                "condition_path": None,
                "num_conditional_sweeps": None,
            },
        )
        with self.assertRaisesRegex(ValueError, "control_path"):
            validate_multiview_request({"views": [{"camera_key": "front"}]})
        with self.assertRaisesRegex(ValueError, "Unsupported Cosmos3 multiview fields"):
            validate_multiview_request({"views": _views(("front",)), "lidar": {}})
        with self.assertRaisesRegex(ValueError, "resolution"):
            validate_multiview_request({"views": _views(("front",)), "resolution": 704})
        with self.assertRaisesRegex(ValueError, "aspect_ratio"):
            validate_multiview_request(
                {"views": _views(("front",)), "aspect_ratio": "2:1"}
            )
        with self.assertRaisesRegex(ValueError, "wsm"):
            Cosmos3MultiviewSamplingParams(wsm={"strength": 1.0})
        Cosmos3MultiviewSamplingParams(wsm={"weight": 1.0})
        with self.assertRaisesRegex(ValueError, "negative_metadata_mode"):
            Cosmos3MultiviewSamplingParams(negative_metadata_mode="sometimes")
        with self.assertRaisesRegex(ValueError, "max_sequence_length"):
            Cosmos3MultiviewSamplingParams(max_sequence_length=5000)
        self.assertEqual(parse_local_condition_indexes("1, 0"), [0, 1])

    def test_lower_video_request_kwargs_parses_json_strings(self):
        request = SimpleNamespace(model_extra={}, num_frames=None, fps=None)
        kwargs = Cosmos3MultiviewSamplingParams.lower_video_request_kwargs(
            request,
            {
                "num_frames": 93,
                "fps": 30,
                "multiview": '{"views": [{"camera_key": "front", "control_path": "c.mp4"}]}',
                "wsm": "{}",
                "condition_video_as_image": "true",
                "negative_metadata_mode": "Same",
            },
        )
        self.assertEqual(kwargs["multiview"]["views"][0]["camera_key"], "front")
        self.assertEqual(kwargs["wsm"], {})
        self.assertIs(kwargs["condition_video_as_image"], True)
        self.assertEqual(kwargs["negative_metadata_mode"], "same")

    def test_input_stage_resolves_a_reordered_subset_with_captions(self):
        from sglang.multimodal_gen.runtime.server_args import (
            server_args as server_args_module,
        )

        deployment = parse_multiview_deployment_config(_transformer_config())
        with mock.patch.object(
            server_args_module,
            "_global_server_args",
            SimpleNamespace(comfyui_mode=False),
        ):
            stage = Cosmos3MultiviewInputStage(deployment)

        def batch_for(params, is_warmup=False):
            return SimpleNamespace(sampling_params=params, is_warmup=is_warmup)

        # A reordered subset is admitted, but every camera needs a caption.
        subset = _views((COSMOS3_MADS_CAMERAS[3], COSMOS3_MADS_CAMERAS[0]))
        with self.assertRaisesRegex(ValueError, "prompt"):
            stage._resolve_views(
                batch_for(Cosmos3MultiviewSamplingParams(multiview={"views": subset}))
            )
        for view in subset:
            view["prompt"] = "A car."
        resolved = stage._resolve_views(
            batch_for(Cosmos3MultiviewSamplingParams(multiview={"views": subset}))
        )
        self.assertEqual(
            [view.camera_key for view in resolved],
            [COSMOS3_MADS_CAMERAS[3], COSMOS3_MADS_CAMERAS[0]],
        )
        with self.assertRaisesRegex(ValueError, "all images or all videos"):
            views = _views(COSMOS3_MADS_CAMERAS)
            for view in views:
                view["prompt"] = "A car."
            views[3]["control_path"] = "c.png"
            stage._resolve_views(
                batch_for(Cosmos3MultiviewSamplingParams(multiview={"views": views}))
            )
        self.assertIsNone(
            stage._resolve_views(
                batch_for(Cosmos3MultiviewSamplingParams(), is_warmup=True)
            )
        )
        with self.assertRaisesRegex(ValueError, "multiview.views"):
            stage._resolve_views(batch_for(Cosmos3MultiviewSamplingParams()))


class TestPerViewCaptions(unittest.TestCase):
    CAMERAS = ("camera_front_wide_120fov", "camera_rear_tele_30fov")
    RIG = (
        "This multiview driving sequence contains time-aligned recordings from 2 "
        "vehicle-mounted cameras: front wide-angle camera (forward-facing, 120\u00b0 FOV); "
        "rear telephoto camera (backward-facing, 30\u00b0 FOV)."
    )

    def test_rig_header_matches_the_training_formatter(self):
        # Golden strings from imaginaire4 caption_format.format_separate_view_captions.
        separate = format_separate_view_captions(["A car.", "Trees."], self.CAMERAS)
        self.assertEqual(
            separate[0],
            f"{self.RIG}\n\nThe description below is for the front wide-angle camera mounted "
            "on the vehicle. This camera is facing forward and has a 120\u00b0 field of "
            "view:\n\nA car.",
        )
        self.assertEqual(
            separate[1],
            f"{self.RIG}\n\nThe description below is for the rear telephoto camera mounted "
            "on the vehicle. This camera is facing backward and has a 30\u00b0 field of "
            "view:\n\nTrees.",
        )
        prompts = format_per_view_prompts(
            ["A car.", "Trees."],
            self.CAMERAS,
            num_frames=17,
            fps=30.0,
            height=480,
            width=832,
            emphasis=COSMOS3_MULTIVIEW_EMPHASIS,
        )
        # Whole seconds, as the training augmentor wrote them (17 frames -> 0.0 s).
        self.assertTrue(
            prompts[0].endswith(
                "A car. The video is 0.0 seconds long and is of 30 FPS. This video is of "
                f"480x832 resolution. {COSMOS3_MULTIVIEW_EMPHASIS}"
            )
        )

    def test_wsm_system_prompts_match_imaginaire4(self):
        # Verbatim from imaginaire4 datasets/augmentors/text_tokenizer.py after
        # commit 86041fb1b52 (Sep 15 2026), the wording every servable export trained under.
        instruction = (
            "Follow WSM controls for vehicles (including trucks), cyclists, pedestrians, "
            "traffic lights, traffic signs, road markings, lane boundaries, and road "
            "boundaries. Do not add objects or road features in these categories that are "
            "absent from WSM. Use captions for appearance and unconstrained background "
            "details; WSM takes precedence in any conflict."
        )
        camera, joint = (
            COSMOS3_AV_MULTIVIEW_TRANSFER_SYSTEM_PROMPT_WSM,
            COSMOS3_AV_JOINT_TRANSFER_SYSTEM_PROMPT_WSM,
        )
        self.assertEqual(
            camera,
            "You are a helpful assistant that generates temporally synchronized, "
            "geometrically consistent autonomous-driving videos from per-camera scene "
            "descriptions and World Scenario Map (WSM) control videos depicting the "
            "controlled objects and road layout. Treat all camera views as simultaneous "
            "observations of the same driving scene, preserving each camera's viewpoint, "
            "shared ego motion, road layout, object identity and motion, weather, "
            f"lighting, and cross-view consistency.\n\n{instruction}",
        )
        self.assertEqual(
            joint,
            "You are a helpful assistant that jointly generates temporally synchronized, "
            "geometrically consistent autonomous-driving camera videos and LiDAR "
            "range-view sequences from per-camera scene descriptions and provided control "
            "signals: per-camera World Scenario Map (WSM) control videos depicting the "
            "controlled objects and road layout, and an HD-map control for LiDAR. Treat "
            "all camera views and LiDAR sweeps as synchronized observations of the same "
            "driving scene, preserving each camera's viewpoint, shared ego motion, road "
            "layout, object identity and motion, weather, lighting, cross-view "
            f"consistency, and camera-LiDAR alignment.\n\n{instruction}",
        )
        with self.assertRaisesRegex(ValueError, "match the selected cameras"):
            format_separate_view_captions(["A car."], self.CAMERAS)


class TestInputLoading(unittest.TestCase):
    def test_load_video_prefix_matches_full_decode(self):
        # The input stage decodes only the frames a request uses; stopping the
        # decoder early must return the same frames a full decode would.
        try:
            import imageio
        except ImportError:  # pragma: no cover - imageio ships with the runtime
            self.skipTest("imageio is not installed")
        rng = np.random.default_rng(0)
        base = rng.integers(0, 256, size=(64, 96, 3), dtype=np.uint8)
        frames = [np.roll(base, 3 * i, axis=1) for i in range(24)]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "clip.mp4")
            try:
                with imageio.get_writer(path, fps=10, macro_block_size=None) as writer:
                    for frame in frames:
                        writer.append_data(frame)
            except Exception as exc:  # pragma: no cover - no ffmpeg on this host
                self.skipTest(f"cannot encode a test clip here: {exc}")
            full = load_video(path)
            prefix = load_video(path, max_frames=5)
            self.assertEqual(len(full), 24)
            self.assertEqual(len(prefix), 5)
            for a, b in zip(prefix, full[:5]):
                self.assertTrue(np.array_equal(np.asarray(a), np.asarray(b)))
            self.assertEqual(len(load_video(path, max_frames=100)), 24)
            with self.assertRaisesRegex(ValueError, "max_frames"):
                load_video(path, max_frames=0)


class TestLidarItems(unittest.TestCase):
    def test_layout_items_drive_plan_offsets_and_tokens(self):
        camera = MaskItem((2, 1, 2), 2, seconds_per_frame=0.5)
        control = MaskItem((2, 1, 2), 2, is_control=True, seconds_per_frame=0.5)
        lidar = MaskItem(
            (3, 1, 3), 1, view_offset=2, seconds_per_frame=0.1, is_lidar=True
        )
        layout = MultiviewLayout(
            num_views=2,
            latent_frames=2,
            patch_height=1,
            patch_width=2,
            seconds_per_frame=0.5,
            control_attends_sensor=True,
            items=(control, camera, lidar),
            caption_lengths=(2, 2),
        )
        self.assertEqual(layout.gen_tokens, 4 + 4 + 9)
        default = MultiviewLayout(
            num_views=2, latent_frames=2, patch_height=1, patch_width=2
        )
        self.assertEqual([item.is_control for item in default.items], [True, False])
        self.assertNotEqual(layout.cache_key(), default.cache_key())
        with self.assertRaisesRegex(ValueError, "positive integers"):
            MultiviewLayout(
                num_views=2,
                latent_frames=2,
                patch_height=1,
                patch_width=2,
                caption_lengths=(0,),
            )

    def test_pack_unpack_roundtrip(self):
        camera = torch.arange(24.0).view(1, 2, 3, 2, 2)
        lidar = torch.arange(100.0, 118.0).view(1, 2, 3, 1, 3)
        packed = pack_state([camera, lidar])
        self.assertEqual(tuple(packed.shape), (1, 42))
        back = unpack_state(packed, (tuple(camera.shape[1:]), tuple(lidar.shape[1:])))
        torch.testing.assert_close(back[0], camera)
        torch.testing.assert_close(back[1], lidar)
        with self.assertRaisesRegex(ValueError, "declared geometries"):
            unpack_state(packed, ((2, 3, 2, 2),))

    def test_sweep_helpers_and_input_normalization(self):
        self.assertEqual(required_lidar_sweeps(17, 30.0, 10.0), 6)
        self.assertEqual(required_lidar_sweeps(201, 30.0, 10.0), 67)
        frames = torch.arange(3.0).view(1, 3, 1, 1).expand(3, 3, 1, 1).clone()
        padded = pad_lidar_sweeps(frames, 6)
        # Reflection pads [0, 1, 2] to [0, 1, 2, 2, 1], then one more reflected sweep.
        self.assertEqual(padded[0, :, 0, 0].tolist(), [0.0, 1.0, 2.0, 2.0, 1.0, 1.0])
        self.assertEqual(pad_lidar_sweeps(frames, 2).shape[1], 2)
        encoder = Cosmos3LidarEncoder(LIDAR_BLOCK)
        # Semantic-width input is circularly padded to the model width, ranges
        # normalized into [-1, 1], invalid rays filled with -1.
        clip = torch.zeros(3, 1, 128, 1800)
        clip[0, 0, 0, 0] = 52.5
        clip[1, 0, 0, 0] = 1.0
        clip[2, 0, 0, 0] = 1.0
        clip[0, 0, 1, 5] = 3.0  # below the 5 m minimum: invalid
        clip[2, 0, 1, 5] = 1.0
        prepared = encoder.prepare_input(clip)
        self.assertEqual(tuple(prepared.shape), (1, 3, 1, 128, 1808))
        self.assertAlmostEqual(prepared[0, 0, 0, 0, 4].item(), 0.0, places=5)
        self.assertEqual(prepared[0, 1, 0, 0, 4].item(), 1.0)
        self.assertEqual(prepared[0, 2, 0, 0, 4].item(), 1.0)
        self.assertEqual(prepared[0, 0, 0, 1, 9].item(), -1.0)
        self.assertEqual(prepared[0, 2, 0, 1, 9].item(), 0.0)
        # The circular pad wraps the last semantic columns in front of column 0.
        clip2 = torch.zeros(3, 1, 128, 1800)
        clip2[0, 0, 7, 1799] = 20.0
        clip2[2, 0, 7, 1799] = 1.0
        prepared2 = encoder.prepare_input(clip2)
        self.assertGreater(prepared2[0, 2, 0, 7, 3].item(), 0.5)


class TestLidarDecoder(unittest.TestCase):
    def test_network_to_metric_inverts_the_encoder_normalization(self):
        """Range is the inverse affine of the encoder's [5, 100] m -> [-1, 1] map,
        intensity the inverse of [0, 1] -> [-1, 1], and a ray whose mask logit
        falls below the 0.5 sigmoid cut reads zero range, zero intensity, validity 0."""
        torch.manual_seed(0)
        range_m = torch.rand(1, 1, 2, 4, 6) * 95.0 + 5.0
        intensity = torch.rand(1, 1, 2, 4, 6)
        valid = torch.rand(1, 1, 2, 4, 6) > 0.4
        network = torch.cat(
            (
                (range_m - 5.0) / 95.0 * 2.0 - 1.0,
                intensity * 2.0 - 1.0,
                torch.where(
                    valid, torch.full_like(range_m, 8.0), torch.full_like(range_m, -8.0)
                ),
            ),
            dim=1,
        )

        metric = lidar_network_to_metric(network, min_range_m=5.0, max_range_m=100.0)

        self.assertTrue(
            torch.allclose(
                metric[:, 0][valid[:, 0]], range_m[:, 0][valid[:, 0]], atol=1e-4
            )
        )
        self.assertTrue(
            torch.allclose(
                metric[:, 1][valid[:, 0]], intensity[:, 0][valid[:, 0]], atol=1e-6
            )
        )
        self.assertTrue(torch.equal(metric[:, 2], valid.float()[:, 0]))
        self.assertEqual(
            metric[:, :2][~valid.expand(-1, 2, -1, -1, -1)].abs().sum().item(), 0.0
        )
        probability = lidar_network_to_metric(
            network, min_range_m=5.0, max_range_m=100.0, apply_validity_mask=False
        )
        self.assertTrue(torch.allclose(probability[:, 2], torch.sigmoid(network[:, 2])))

    def test_pixel_shuffles_follow_the_reference_patch_order(self):
        """The decoder's expand and detokenizer lay a (p1, p2, c) channel group out as
        rows then columns, the inverse of the encoder's space-to-depth merge, so a
        checkpoint trained with einops' "(P1 P2 C)" ordering decodes on the same grid."""
        grouped = torch.arange(2 * 2 * 3 * 12, dtype=torch.float32).view(2, 2, 3, 12)

        self.assertTrue(torch.equal(_SpaceToDepth()(depth_to_space(grouped)), grouped))
        pixels = _DepthToPixels((2, 2), channels=3)(grouped)
        self.assertEqual(tuple(pixels.shape), (2, 3, 4, 6))
        # group index = p1 * 6 + p2 * 3 + c for the (row, column, channel) grouping
        for p1 in range(2):
            for p2 in range(2):
                for c in range(3):
                    self.assertEqual(
                        pixels[1, c, 1 * 2 + p1, 2 * 2 + p2].item(),
                        grouped[1, 1, 2, p1 * 6 + p2 * 3 + c].item(),
                    )
        self.assertTrue(
            torch.equal(_SpaceToDepth()(pixels.permute(0, 2, 3, 1)), grouped)
        )

    def test_crop_lidar_width_centers_the_azimuth_padding(self):
        clip = torch.arange(1808, dtype=torch.float32).view(1, 1, 1, 1, 1808)
        cropped = crop_lidar_width(clip, 1800)
        self.assertEqual(cropped.shape[-1], 1800)
        self.assertEqual(cropped[..., 0].item(), 4.0)
        with self.assertRaises(ValueError):
            crop_lidar_width(clip, 1801)

    def test_payload_and_preview_drop_invalid_rays(self):
        clip = torch.zeros(3, 2, 4, 8)
        clip[0] = 50.0
        clip[1] = 0.5
        clip[2] = 1.0
        clip[2, :, 0] = 0.0  # first beam dropped by the mask
        clip[0, :, 1] = 0.0  # second beam dropped by zero range
        frames = render_lidar_range_frames(clip, min_range_m=5.0, max_range_m=100.0)
        self.assertEqual(frames.shape, (2, 4, 8, 3))
        self.assertEqual(frames[:, :2].max(), 0)
        self.assertGreater(frames[:, 2:].max(), 0)
        payload = lidar_output_payload(
            clip,
            fps=10.0,
            min_range_m=5.0,
            max_range_m=100.0,
            files={"rangemap": "x"},
            include_arrays=True,
        )
        self.assertEqual(payload["sweeps"], 2)
        self.assertAlmostEqual(payload["valid_fraction"], 0.5)
        self.assertEqual(payload["range_m"][:, :2].max(), 0.0)
        self.assertEqual(
            set(lidar_payload_for_response(payload))
            & {"range_m", "intensity", "validity"},
            set(),
        )

    def test_video_api_accepts_an_empty_top_level_prompt(self):
        """Per-camera captions live in multiview.views[].prompt, so the multipart video
        endpoint must not reject the empty top-level prompt schema-2 requests send."""
        self.assertTrue(Cosmos3MultiviewSamplingParams.prompt_optional)

    def test_bev_places_rays_by_azimuth_and_range(self):
        """Column 0 of the range image is azimuth +180 (rear), the middle column is
        forward; a forward return at half the radius lands above the ego center and a
        rear one below it, and azimuth pooling keeps the nearest return of a group."""
        clip = torch.zeros(3, 1, 4, 8)
        clip[2] = 1.0
        clip[0, 0, :, 4] = 40.0  # forward (0 deg)
        clip[0, 0, :, 0] = 20.0  # rear (+180 deg)
        frames = render_lidar_bev_frames(
            clip, min_range_m=5.0, max_range_m=100.0, size_px=64, radius_m=80.0
        )
        self.assertEqual(frames.shape, (1, 64, 64, 3))
        center = 32
        self.assertTrue(frames[0, center - 16, center].any())  # forward, 40 of 80 m
        self.assertTrue(frames[0, center + 8, center].any())  # rear, 20 m
        self.assertFalse(frames[0, center, center].any())
        pooled = pool_lidar_azimuth(clip, 2)
        self.assertEqual(tuple(pooled.shape), (3, 1, 4, 4))
        self.assertEqual(pooled[0, 0, 0, 0].item(), 20.0)  # columns 0,1: nearest kept
        self.assertEqual(pooled[0, 0, 0, 2].item(), 40.0)  # columns 4,5
        self.assertEqual(pooled[0, 0, 0, 1].item(), 0.0)  # columns 2,3: no return

    def test_lidar_request_decode_flag(self):
        """LiDAR output is opt-in: a joint request returns only the camera video
        unless it sets decode true."""
        params = validate_lidar_request({"control_path": "/x/hdmap.safetensors"})
        self.assertFalse(params["decode"])
        params = validate_lidar_request(
            {"control_path": "/x/hdmap.safetensors", "decode": True}
        )
        self.assertTrue(params["decode"])
        with self.assertRaises(ValueError):
            validate_lidar_request(
                {"control_path": "/x/hdmap.safetensors", "decode": "no"}
            )
        with self.assertRaises(ValueError):
            validate_lidar_request(
                {"control_path": "/x/hdmap.safetensors", "outputs": []}
            )


class TestSchema3Requests(unittest.TestCase):
    """Measured LiDAR prefix fields and the opt-in per-view negative prompt."""

    def test_lidar_request_condition_fields(self):
        base = {"control_path": "hdmap.safetensors"}
        self.assertEqual(
            validate_lidar_request(base),
            {
                "control_path": "hdmap.safetensors",
                "decode": False,
                "condition_path": None,
                "num_conditional_sweeps": None,
            },
        )
        with_prefix = validate_lidar_request(
            {**base, "condition_path": " measured.pt "}
        )
        self.assertEqual(with_prefix["condition_path"], "measured.pt")
        # The reference conditions one measured sweep when no count is given.
        self.assertEqual(with_prefix["num_conditional_sweeps"], 1)
        self.assertEqual(
            validate_lidar_request(
                {**base, "condition_path": "m.safetensors", "num_conditional_sweeps": 3}
            )["num_conditional_sweeps"],
            3,
        )
        for bad, message in (
            ({**base, "num_conditional_sweeps": 2}, "requires lidar.condition_path"),
            ({**base, "condition_path": "m.tar"}, "condition_path must be"),
            (
                {**base, "condition_path": "m.pt", "num_conditional_sweeps": 0},
                "positive integer",
            ),
            (
                {**base, "condition_path": "m.pt", "num_conditional_sweeps": True},
                "positive integer",
            ),
            ({**base, "conditional_path": "m.pt"}, "accepts only"),
        ):
            with self.subTest(bad=bad):
                with self.assertRaisesRegex(ValueError, message):
                    validate_lidar_request(bad)
        params = Cosmos3MultiviewSamplingParams(
            lidar={"control_path": "hdmap.pt", "condition_path": "measured.pt"}
        )
        self.assertEqual(params.resolved_lidar()["num_conditional_sweeps"], 1)

    def test_per_view_negative_prompt_request_field(self):
        self.assertIn(
            "per_view_negative_prompt",
            Cosmos3MultiviewSamplingParams.video_request_extra_fields(),
        )
        lowered = Cosmos3MultiviewSamplingParams.lower_video_request_kwargs(
            None, {"per_view_negative_prompt": "  blurry  "}
        )
        self.assertEqual(lowered["per_view_negative_prompt"], "blurry")
        self.assertNotIn(
            "per_view_negative_prompt",
            Cosmos3MultiviewSamplingParams.lower_video_request_kwargs(
                None, {"per_view_negative_prompt": "   "}
            ),
        )
        self.assertEqual(
            Cosmos3MultiviewSamplingParams(
                per_view_negative_prompt="blurry"
            ).per_view_negative_prompt,
            "blurry",
        )
        with self.assertRaisesRegex(ValueError, "per_view_negative_prompt"):
            Cosmos3MultiviewSamplingParams(per_view_negative_prompt=7)  # type: ignore[arg-type]


class TestRegistry(unittest.TestCase):
    def test_pipeline_is_discoverable_and_paths_resolve(self):
        _discover_and_register_pipelines()
        self.assertIn("Cosmos3MultiviewPipeline", _PIPELINE_REGISTRY)
        for model_path in (
            "nvidia/Cosmos3-Nano-Transfer-Auto",
            "/mnt/models/Cosmos3-Nano-Transfer-Auto",
        ):
            with self.subTest(model_path=model_path):
                config_info = _get_config_info(model_path)
                self.assertIs(config_info.pipeline_config_cls, Cosmos3MultiviewConfig)
                self.assertIs(
                    config_info.sampling_param_cls, Cosmos3MultiviewSamplingParams
                )
        # The plain Nano release must keep resolving to the regular pipeline.
        self.assertIs(
            _get_config_info("nvidia/Cosmos3-Nano").pipeline_config_cls, Cosmos3Config
        )

    def test_class_name_detectors_stay_disjoint(self):
        expectations = {
            "Cosmos3MultiviewPipeline": Cosmos3MultiviewConfig,
            "Cosmos3OmniPipeline": Cosmos3Config,
        }
        for class_name, config_cls in expectations.items():
            with self.subTest(class_name=class_name):
                with mock.patch(
                    "sglang.multimodal_gen.registry.maybe_download_model_index",
                    return_value={"_class_name": class_name},
                ):
                    config_info = _get_config_info(f"acme/renamed-{class_name.lower()}")
                self.assertIs(config_info.pipeline_config_cls, config_cls)

    def test_transformer_class_is_resolvable(self):
        from sglang.multimodal_gen.runtime.models.registry import ModelRegistry

        model_cls, _ = ModelRegistry.resolve_model_cls("Cosmos3MultiviewTransformer")
        self.assertEqual(model_cls.__name__, "Cosmos3MultiviewTransformer")
        self.assertEqual(
            model_cls._cross_attention_cls.__name__, "Cosmos3MultiviewCrossAttention"
        )


class TestLidarNeighborhoodAttentionBackend(unittest.TestCase):
    """natten's eager FlexAttention fallback must be refused, never attempted."""

    def setUp(self):
        _natten_backend_cache.clear()

    def _qkv(self):
        q = torch.zeros(1, 4, 8, 2, 32)
        return q, q.clone(), q.clone()

    @unittest.skipUnless(importlib.util.find_spec("natten"), "needs natten")
    def test_refuses_the_eager_flex_fallback(self):
        q, k, v = self._qkv()
        with mock.patch("natten.backends.choose_backend", return_value="flex-fna"):
            with self.assertRaisesRegex(RuntimeError, "whl.natten.org"):
                resolve_natten_backend(q, k, v)
        self.assertEqual(_natten_backend_cache, {})

    @unittest.skipUnless(importlib.util.find_spec("natten"), "needs natten")
    def test_caches_a_compiled_kernel_choice(self):
        q, k, v = self._qkv()
        with mock.patch(
            "natten.backends.choose_backend", return_value="cutlass-fna"
        ) as chooser:
            self.assertEqual(resolve_natten_backend(q, k, v), "cutlass-fna")
            self.assertEqual(resolve_natten_backend(q, k, v), "cutlass-fna")
        chooser.assert_called_once()


def _dense_neighborhood_attention(q, k, v, kernel, dilation, scale):
    """Brute-force na2d: per query, softmax over its inward-shifted dilated window."""
    from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.neighborhood_attention import (
        neighborhood_window_start,
    )

    batch, height, width, heads, head_dim = q.shape
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(height):
        for j in range(width):
            start_h = int(
                neighborhood_window_start(
                    torch.tensor(i), height, kernel[0], dilation[0]
                )
            )
            start_w = int(
                neighborhood_window_start(
                    torch.tensor(j), width, kernel[1], dilation[1]
                )
            )
            rows = [
                (start_h + a) * dilation[0] + i % dilation[0] for a in range(kernel[0])
            ]
            cols = [
                (start_w + b) * dilation[1] + j % dilation[1] for b in range(kernel[1])
            ]
            keys = k[:, rows][:, :, cols].reshape(batch, -1, heads, head_dim).double()
            vals = v[:, rows][:, :, cols].reshape(batch, -1, heads, head_dim).double()
            scores = torch.einsum("bhd,bnhd->bhn", q[:, i, j].double(), keys) * scale
            out[:, i, j] = torch.einsum("bhn,bnhd->bhd", scores.softmax(-1), vals)
    return out.to(q.dtype)


class TestLidarNeighborhoodAttentionFlex(unittest.TestCase):
    """The FlexAttention block mask must reproduce na2d's windows exactly."""

    def test_window_start_shifts_inward_and_respects_residue_classes(self):
        from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.neighborhood_attention import (
            neighborhood_window_start,
        )

        idx = torch.arange(9)
        # kernel 3, no dilation: windows [0,3) at the top edge, [6,9) at the bottom.
        self.assertEqual(
            neighborhood_window_start(idx, 9, 3, 1).tolist(),
            [0, 0, 1, 2, 3, 4, 5, 6, 6],
        )
        # dilation 2 on length 9: even class has 5 members, odd class 4.
        self.assertEqual(
            neighborhood_window_start(idx, 9, 3, 2).tolist(),
            [0, 0, 0, 0, 1, 1, 2, 1, 2],
        )

    def test_matches_dense_reference_on_cpu(self):
        from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.neighborhood_attention import (
            neighborhood_attention_2d,
        )

        torch.manual_seed(0)
        for kernel, dilation in (((3, 5), (1, 1)), ((3, 3), (2, 1)), ((1, 5), (1, 2))):
            with self.subTest(kernel=kernel, dilation=dilation):
                q, k, v = (torch.randn(2, 6, 11, 2, 8) for _ in range(3))
                out = neighborhood_attention_2d(
                    q, k, v, kernel_size=kernel, dilation=dilation, scale=0.7
                )
                ref = _dense_neighborhood_attention(q, k, v, kernel, dilation, 0.7)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    def test_rejects_windows_larger_than_a_residue_class(self):
        from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.neighborhood_attention import (
            neighborhood_block_mask,
        )

        with self.assertRaisesRegex(ValueError, "smaller than kernel"):
            neighborhood_block_mask(6, 11, (3, 5), (3, 1), torch.device("cpu"))

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA")
    def test_cuda_matches_natten_fp32_kernel(self):
        if importlib.util.find_spec("natten") is None:
            self.skipTest("needs natten")
        from natten.functional import na2d

        from sglang.multimodal_gen.runtime.models.vaes.cosmos3_lidar.neighborhood_attention import (
            neighborhood_attention_2d,
        )

        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 16, 134, 4, 32, device="cuda") for _ in range(3))
        out = neighborhood_attention_2d(
            q, k, v, kernel_size=(5, 45), dilation=(1, 1), scale=1.0
        )
        ref = na2d(q, k, v, kernel_size=(5, 45), dilation=(1, 1), scale=1.0)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


if __name__ == "__main__":
    unittest.main()
