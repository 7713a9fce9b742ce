import dataclasses
import unittest
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import torch

from sglang.multimodal_gen.runtime.breakable_cuda_graph.model_padders import (
    qwen_image21 as qwen21_padder,
)
from sglang.multimodal_gen.runtime.breakable_cuda_graph.runner import (
    DiffusionBreakableCudaGraphRunner,
    _CaptureEntry,
    _flatten_kwargs,
    _map_tensors,
    _signature_kwargs,
)
from sglang.multimodal_gen.runtime.layers.attention import (
    DynamicVarlenMaskMeta,
    build_varlen_mask_meta,
)
from sglang.multimodal_gen.runtime.managers.gpu_worker import GPUWorker
from sglang.multimodal_gen.runtime.models.dits.flux3_image import Packed
from sglang.multimodal_gen.runtime.models.dits.qwen_image import (
    _attn_mask_meta_local_pad,
)
from sglang.multimodal_gen.runtime.pipelines_core import LoRAPipeline
from sglang.multimodal_gen.runtime.pipelines_core.stages import (
    denoising as denoising_module,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.denoising import (
    DenoisingStage,
)
from sglang.multimodal_gen.runtime.server_args import (
    BREAKABLE_CUDA_GRAPH_SUPPORTED_MODEL_IDS,
    BREAKABLE_CUDA_GRAPH_SUPPORTED_PIPELINE_CONFIGS,
)
from sglang.multimodal_gen.runtime.utils.logging_utils import _print_warning_once


class QwenImageTransformer2DModel(torch.nn.Module):
    pass


class QwenImage21Transformer2DModel(torch.nn.Module):
    pass


class OtherTransformer2DModel(torch.nn.Module):
    pass


class FluxTransformer2DModel(torch.nn.Module):
    pass


class Ideogram4Transformer2DModel(torch.nn.Module):
    pass


class MiniMaxH3DiTModel(torch.nn.Module):
    pass


class LongCatImageTransformer2DModel(torch.nn.Module):
    pass


class ZImageTransformer2DModel(torch.nn.Module):
    def rotary_emb(self, pos_ids):
        return torch.zeros(pos_ids.shape[0], 8, device=pos_ids.device)


class SanaVideoTransformer3DModel(torch.nn.Module):
    pass


class TestQualityFusionBCGCompatibility(unittest.TestCase):
    def setUp(self):
        self.stage = DenoisingStage.__new__(DenoisingStage)
        self.stage.server_args = SimpleNamespace(enable_breakable_cuda_graph=True)
        self.stage.transformer = OtherTransformer2DModel()
        self.stage.transformer_2 = None
        self.stage._mounted_quality = "exact"

    @staticmethod
    def _batch(quality: str):
        return SimpleNamespace(sampling_params=SimpleNamespace(quality=quality))

    def test_each_quality_level_gets_its_own_bcg_runner(self):
        # A captured graph bakes in the fusions mounted when it was recorded,
        # and the capture signature only covers the tensors. Warmup captures
        # at the server's default level, so a request at another level must
        # not reach those graphs: it gets an empty runner, and the eager
        # fallback runs the fusion set it actually asked for.
        self.stage._bcg_runners = {}
        model = self.stage.transformer
        built = []

        class _FakeRunner:
            def __init__(self, transformer, device):
                built.append(transformer)

        with (
            patch.object(
                denoising_module, "get_local_torch_device", return_value="cpu"
            ),
            patch(
                "sglang.multimodal_gen.runtime.breakable_cuda_graph.runner."
                "DiffusionBreakableCudaGraphRunner",
                _FakeRunner,
            ),
        ):
            self.stage._mounted_quality = "lossless"
            default_runner = self.stage._maybe_get_bcg_runner(model)
            self.assertIs(self.stage._maybe_get_bcg_runner(model), default_runner)

            self.stage._mounted_quality = "exact"
            exact_runner = self.stage._maybe_get_bcg_runner(model)

        self.assertIsNot(exact_runner, default_runner)
        self.assertEqual(len(built), 2)

    def test_mounting_a_fusion_under_bcg_is_allowed(self):
        # This used to raise: with one runner per module, switching level
        # would have replayed the warmup level's kernels under another
        # level's name. The runner key carries the level now, so the request
        # simply runs.
        mounted = []
        handlers = (
            (
                "lossless",
                SimpleNamespace(
                    name="test fusion",
                    mount=lambda t: mounted.append(t) or True,
                    unmount=lambda _: None,
                ),
            ),
        )

        with patch.object(denoising_module, "_QUALITY_FUSION_HANDLERS", handlers):
            self.stage._maybe_toggle_quality_fusions(self._batch("lossless"))

        self.assertEqual(mounted, [self.stage.transformer])
        self.assertEqual(self.stage._mounted_quality, "lossless")

    def test_allows_high_when_model_has_no_dit_quality_fusions(self):
        handlers = (
            (
                "lossless",
                SimpleNamespace(
                    name="test fusion", mount=lambda _: False, unmount=lambda _: None
                ),
            ),
        )

        with patch.object(denoising_module, "_QUALITY_FUSION_HANDLERS", handlers):
            self.stage._maybe_toggle_quality_fusions(self._batch("high"))

        self.assertEqual(self.stage._mounted_quality, "high")

    def test_an_exact_request_unmounts_what_a_faster_tier_left_behind(self):
        self.stage.server_args.enable_breakable_cuda_graph = False
        mounted, unmounted = [], []
        handlers = (
            (
                "lossless",
                SimpleNamespace(
                    name="test fusion",
                    mount=lambda t: mounted.append(t) or True,
                    unmount=lambda t: unmounted.append(t),
                ),
            ),
        )

        with patch.object(denoising_module, "_QUALITY_FUSION_HANDLERS", handlers):
            self.stage._maybe_toggle_quality_fusions(self._batch("lossless"))
            self.assertEqual(mounted, [self.stage.transformer])

            # Back to the default at the next batch boundary: the fusion has
            # to come off, or an exact request silently keeps running it.
            self.stage._maybe_toggle_quality_fusions(self._batch("exact"))

        self.assertEqual(unmounted, [self.stage.transformer])
        self.assertEqual(self.stage._mounted_quality, "exact")

    def test_a_fusion_runs_only_from_the_tier_that_declares_it(self):
        self.stage.server_args.enable_breakable_cuda_graph = False
        mounted = []
        handlers = (
            (
                "lossless",
                SimpleNamespace(
                    name="equivalent fusion",
                    mount=lambda _: mounted.append("equivalent") or True,
                    unmount=lambda _: None,
                ),
            ),
            (
                "high",
                SimpleNamespace(
                    name="approximate fusion",
                    mount=lambda _: mounted.append("approximate") or True,
                    unmount=lambda _: None,
                ),
            ),
        )

        with patch.object(denoising_module, "_QUALITY_FUSION_HANDLERS", handlers):
            self.stage._maybe_toggle_quality_fusions(self._batch("lossless"))
            self.assertEqual(mounted, ["equivalent"])
            self.assertEqual(self.stage._mounted_quality, "lossless")

            mounted.clear()
            self.stage._maybe_toggle_quality_fusions(self._batch("high"))

        # "high" is cumulative: it keeps the equivalent fusion and adds its own
        self.assertEqual(mounted, ["equivalent", "approximate"])
        self.assertEqual(self.stage._mounted_quality, "high")


class TestBCGDataclassInputs(unittest.TestCase):
    def test_packed_tensor_leaves_are_mapped_and_flattened(self):
        packed = Packed(
            data={"image": torch.zeros(2, 3)},
            ids={"image": torch.zeros(2, 4)},
            timesteps={"image": torch.zeros(2)},
            mode_indices={"image": [(0, 1), (1, 2)]},
        )
        mapped = _map_tensors(packed, lambda tensor: tensor + 1)
        self.assertIsInstance(mapped, Packed)
        self.assertTrue(torch.equal(mapped.data["image"], torch.ones(2, 3)))
        self.assertEqual(mapped.mode_indices, packed.mode_indices)
        self.assertEqual(len(_flatten_kwargs({"packed": mapped})), 3)
        self.assertEqual(
            _signature_kwargs({"packed": packed}),
            _signature_kwargs({"packed": mapped}),
        )
        # Equal tensor shapes, other sample bounds: a replay would mix samples.
        regrouped = dataclasses.replace(packed, mode_indices={"image": [(0, 2)]})
        self.assertNotEqual(
            _signature_kwargs({"packed": packed}),
            _signature_kwargs({"packed": regrouped}),
        )


def _fake_cache_dit_batch(*, is_warmup: bool) -> SimpleNamespace:
    return SimpleNamespace(
        is_warmup=is_warmup,
        sampling_params=SimpleNamespace(enable_cache_dit=None, cache_dit_params=None),
    )


class TestDiffusionBCGPadding(unittest.TestCase):
    def setUp(self):
        self.stage = DenoisingStage.__new__(DenoisingStage)
        self.qwen_model = QwenImageTransformer2DModel()
        self.qwen21_model = QwenImage21Transformer2DModel()
        self.ideogram_model = Ideogram4Transformer2DModel()
        self.longcat_model = LongCatImageTransformer2DModel()
        self.minimax_h3_model = MiniMaxH3DiTModel()
        self.zimage_model = ZImageTransformer2DModel()
        self.sana_video_model = SanaVideoTransformer3DModel()
        self.other_model = OtherTransformer2DModel()
        self.flux_model = FluxTransformer2DModel()

    def _patch_buckets(self, *buckets: int):
        resolved = tuple(sorted({b for b in buckets if b > 0}))
        return patch.object(
            DenoisingStage,
            "_bcg_text_buckets",
            staticmethod(lambda: resolved),
        )

    def _qwen_kwargs(self, seq_len: int, *, fill: float = 1.0):
        return {
            "hidden_states": torch.zeros(1, 4096, 64),
            "timestep": torch.zeros(1),
            "encoder_hidden_states": [
                torch.full((1, seq_len, 3584), fill, dtype=torch.float32)
            ],
            "encoder_hidden_states_mask": None,
            "txt_seq_lens": [seq_len],
            "freqs_cis": (
                torch.zeros(4096, 128, dtype=torch.float32),
                torch.ones(seq_len, 128, dtype=torch.float32),
            ),
            "freqs_complex": (
                torch.zeros(4096, 64, dtype=torch.complex64),
                torch.ones(seq_len, 64, dtype=torch.complex64),
            ),
            "img_shapes": [[(1, 64, 64)]],
        }

    def test_qwen_prompt_lengths_share_bucket_signature(self):
        with self._patch_buckets(256, 512, 1024):
            short = self.stage._bcg_pad_prompt_kwargs(
                self._qwen_kwargs(19), current_model=self.qwen_model
            )
            longer = self.stage._bcg_pad_prompt_kwargs(
                self._qwen_kwargs(47), current_model=self.qwen_model
            )

        self.assertEqual(short["encoder_hidden_states"][0].shape, (1, 256, 3584))
        self.assertEqual(longer["encoder_hidden_states"][0].shape, (1, 256, 3584))
        self.assertEqual(short["encoder_hidden_states_mask"].shape, (1, 256))
        self.assertTrue(short["encoder_hidden_states_mask"][0, :19].all())
        self.assertFalse(short["encoder_hidden_states_mask"][0, 19:].any())
        self.assertTrue(longer["encoder_hidden_states_mask"][0, :47].all())
        self.assertFalse(longer["encoder_hidden_states_mask"][0, 47:].any())
        self.assertEqual(short["freqs_cis"][1].shape, (256, 128))
        # the complex RoPE cache must follow the bucket too, or every prompt
        # length misses the captured graph
        self.assertEqual(short["freqs_complex"][1].shape, (256, 64))
        self.assertFalse(short["freqs_complex"][1][19:].any())
        # a bucketed length would tell a missed graph's eager forward to attend
        # the pad rows; the mask alone marks the valid text
        self.assertIsNone(short["txt_seq_lens"])
        self.assertIsNone(longer["txt_seq_lens"])
        self.assertEqual(_signature_kwargs(short), _signature_kwargs(longer))

    def test_qwen_prompt_content_changes_do_not_change_signature(self):
        with self._patch_buckets(256, 512, 1024):
            first = self.stage._bcg_pad_prompt_kwargs(
                self._qwen_kwargs(47, fill=1.0), current_model=self.qwen_model
            )
            second = self.stage._bcg_pad_prompt_kwargs(
                self._qwen_kwargs(47, fill=2.0), current_model=self.qwen_model
            )

        self.assertFalse(
            torch.equal(
                first["encoder_hidden_states"][0],
                second["encoder_hidden_states"][0],
            )
        )
        self.assertEqual(_signature_kwargs(first), _signature_kwargs(second))

    def test_qwen_dynamic_varlen_meta_is_not_tail_pad_meta(self):
        self.assertEqual(_attn_mask_meta_local_pad(None), 0)
        self.assertEqual(_attn_mask_meta_local_pad({"local_pad": 7}), 7)
        self.assertEqual(_attn_mask_meta_local_pad(DynamicVarlenMaskMeta()), 0)

    def _qwen21_kwargs(self, prefix_len: int, *, num_layers: int = 2):
        torch.manual_seed(prefix_len)
        return {
            "hidden_states": torch.zeros(1, 16, 4),
            "timestep": torch.zeros(1),
            "encoder_hidden_states": [torch.ones(1, prefix_len, 8)],
            "encoder_hidden_states_mask": [torch.ones(1, prefix_len, dtype=torch.bool)],
            "condition_latents": None,
            "layouts": [
                {
                    "encoder_seq_len": prefix_len,
                    "text_indices": torch.arange(prefix_len),
                    "image_indices": torch.zeros(0, dtype=torch.long),
                    "prefix_rope": torch.ones(prefix_len, 4, dtype=torch.complex64),
                    "target_rope": torch.ones(16, 4, dtype=torch.complex64),
                    "segments": ((0, prefix_len, False),),
                }
            ],
            "prefix_caches": [
                [
                    {
                        "key": torch.randn(1, prefix_len, 2, 8),
                        "value": torch.randn(1, prefix_len, 2, 8),
                    }
                    for _ in range(num_layers)
                ]
            ],
        }

    def _qwen21_pad(self, kwargs, *, sp_world_size: int = 1):
        with patch.object(
            qwen21_padder, "get_sp_world_size", return_value=sp_world_size
        ):
            return self.stage._bcg_pad_prompt_kwargs(
                kwargs, current_model=self.qwen21_model
            )

    def test_qwen21_prefix_lengths_share_bucket_signature(self):
        with self._patch_buckets(16, 32):
            short_kwargs, long_kwargs = self._qwen21_kwargs(5), self._qwen21_kwargs(13)
            short = self._qwen21_pad(short_kwargs)
            longer = self._qwen21_pad(long_kwargs)

        self.assertEqual(_signature_kwargs(short), _signature_kwargs(longer))
        for out, kwargs, prefix_len in (
            (short, short_kwargs, 5),
            (longer, long_kwargs, 13),
        ):
            self.assertEqual(out["prefix_pad"].item(), 16 - prefix_len)
            self.assertIsNone(out["prefix_caches"])
            # layer-major [key, value] pairs, left-padded so the real rows stay
            # contiguous ahead of the target rows
            prefix_kv = out["prefix_kv"].unflatten(0, (-1, 2))
            self.assertEqual(prefix_kv.shape, (2, 2, 1, 16, 2, 8))
            self.assertFalse(prefix_kv[:, :, :, : 16 - prefix_len].any())
            for pair, original in zip(
                prefix_kv, kwargs["prefix_caches"][0], strict=True
            ):
                for padded, name in zip(pair, ("key", "value"), strict=True):
                    self.assertTrue(
                        torch.equal(padded[:, 16 - prefix_len :], original[name])
                    )
            # cached steps never read the prompt, prefix RoPE or causal segments
            self.assertIsNone(out["encoder_hidden_states"])
            self.assertIsNone(out["encoder_hidden_states_mask"])
            self.assertEqual(list(out["layouts"][0]), ["target_rope"])
            self.assertIs(
                out["layouts"][0]["target_rope"], kwargs["layouts"][0]["target_rope"]
            )
            self.assertEqual(kwargs["prefix_caches"][0][0]["key"].shape[1], prefix_len)

    def test_qwen21_calls_without_a_replayable_prefix_are_not_padded(self):
        prefill = self._qwen21_kwargs(5)
        prefill["prefix_caches"] = [[{}, {}]]
        batched = self._qwen21_kwargs(5)
        batched["prefix_caches"] = batched["prefix_caches"] * 2
        with self._patch_buckets(16, 32):
            for kwargs in (prefill, batched, self._qwen21_kwargs(33)):
                self.assertIs(self._qwen21_pad(kwargs), kwargs)
            kwargs = self._qwen21_kwargs(5)
            self.assertIs(self._qwen21_pad(kwargs, sp_world_size=2), kwargs)

    def test_longcat_keeps_its_fixed_512_token_prompt_shape(self):
        kwargs = {
            "hidden_states": torch.zeros(1, 4096, 64),
            "timestep": torch.zeros(1),
            "encoder_hidden_states": torch.zeros(1, 512, 3584),
            "encoder_attention_mask": [torch.ones(1, 512, dtype=torch.long)],
            "encoder_hidden_states_mask": [torch.ones(1, 512, dtype=torch.bool)],
            "txt_ids": torch.zeros(512, 3),
            "img_ids": torch.zeros(4096, 3),
        }

        with self._patch_buckets(64, 128, 256, 512, 1024):
            out = self.stage._bcg_pad_prompt_kwargs(
                kwargs, current_model=self.longcat_model
            )

        self.assertIs(out, kwargs)
        self.assertEqual(out["encoder_hidden_states"].shape, (1, 512, 3584))
        self.assertEqual(out["txt_ids"].shape, (512, 3))

    def test_longcat_edit_keeps_vl_prefix_and_image_grid(self):
        kwargs = {
            "hidden_states": torch.zeros(1, 8374, 64),
            "encoder_hidden_states": torch.zeros(1, 859, 64),
            "encoder_hidden_states_mask": [torch.ones(1, 859, dtype=torch.bool)],
            "txt_ids": torch.zeros(859, 3),
            "img_ids": torch.zeros(8374, 3),
        }
        with self._patch_buckets(64, 128, 256, 512, 1024):
            out = self.stage._bcg_pad_prompt_kwargs(
                kwargs, current_model=self.longcat_model
            )
        self.assertIs(out, kwargs)
        self.assertEqual(out["encoder_hidden_states"].shape[1], 859)
        self.assertEqual(out["txt_ids"].shape, (859, 3))
        self.assertEqual(out["img_ids"].shape, (8374, 3))

    def test_qwen_default_bucket_preserves_mask(self):
        def kwargs(valid_len: int):
            mask = torch.zeros(1, 64, dtype=torch.bool)
            mask[:, :valid_len] = True
            out = self._qwen_kwargs(64)
            out["encoder_hidden_states_mask"] = mask
            out["txt_seq_lens"] = [valid_len]
            return out

        first = self.stage._bcg_pad_prompt_kwargs(
            kwargs(19), current_model=self.qwen_model
        )
        second = self.stage._bcg_pad_prompt_kwargs(
            kwargs(47), current_model=self.qwen_model
        )

        self.assertEqual(first["encoder_hidden_states"][0].shape[1], 64)
        self.assertIsNone(first["txt_seq_lens"])
        self.assertIsNone(second["txt_seq_lens"])
        self.assertTrue(first["encoder_hidden_states_mask"][0, :19].all())
        self.assertFalse(first["encoder_hidden_states_mask"][0, 19:].any())
        self.assertTrue(second["encoder_hidden_states_mask"][0, :47].all())
        self.assertFalse(second["encoder_hidden_states_mask"][0, 47:].any())
        self.assertEqual(_signature_kwargs(first), _signature_kwargs(second))

    def test_non_qwen_kwargs_do_not_take_qwen_padding_path(self):
        kwargs = self._qwen_kwargs(47)
        with self._patch_buckets(256, 512, 1024):
            out = self.stage._bcg_pad_prompt_kwargs(
                kwargs, current_model=self.other_model
            )

        self.assertIs(out, kwargs)
        self.assertIsNone(out["encoder_hidden_states_mask"])
        self.assertEqual(out["encoder_hidden_states"][0].shape[1], 47)
        self.assertEqual(out["txt_seq_lens"], [47])

    def _zimage_kwargs(self, seq_len: int, *, fill: float = 1.0):
        return {
            "hidden_states": [torch.zeros(16, 1, 4, 4)],
            "timestep": torch.zeros(1),
            "guidance": torch.zeros(1),
            "encoder_hidden_states": [
                torch.full((seq_len, 16), fill, dtype=torch.float32)
            ],
            "encoder_hidden_states_mask": torch.ones(1, seq_len, dtype=torch.bool),
            "freqs_cis": (
                torch.zeros(seq_len, 8, dtype=torch.float32),
                torch.zeros(256, 8, dtype=torch.float32),
            ),
            "image_seq_len_target": 256,
        }

    def test_zimage_captures_at_native_caption_length(self):
        """Z-Image attends its caption slots unmasked (learned pad tokens act
        as attended registers), so padding to a shared text bucket changes how
        many registers every token attends and drifts the output
        (sgl-project/sglang#34183). The padder therefore captures at the
        incoming native length: lengths are never extended, and distinct
        native lengths intentionally do NOT share a graph signature (unseen
        lengths fall back to eager at serving time)."""
        with self._patch_buckets(64, 128):
            short = self.stage._bcg_pad_prompt_kwargs(
                self._zimage_kwargs(19), current_model=self.zimage_model
            )
            short_again = self.stage._bcg_pad_prompt_kwargs(
                self._zimage_kwargs(19), current_model=self.zimage_model
            )
            longer = self.stage._bcg_pad_prompt_kwargs(
                self._zimage_kwargs(47), current_model=self.zimage_model
            )

        # Captions keep their native length -- no bucket extension.
        self.assertEqual(short["encoder_hidden_states"][0].shape, (19, 16))
        self.assertEqual(longer["encoder_hidden_states"][0].shape, (47, 16))
        self.assertEqual(short["encoder_hidden_states_mask"].shape, (1, 19))
        self.assertEqual(short["caption_valid_lens"].item(), 19)
        self.assertEqual(longer["caption_valid_lens"].item(), 47)
        self.assertTrue(short["_use_caption_valid_mask"])
        self.assertTrue(short["encoder_hidden_states_mask"].all())
        self.assertEqual(short["freqs_cis"][0].shape, (19, 8))
        # Same native length -> same signature (graph reuse works); different
        # native lengths -> different signatures, by design.
        self.assertEqual(_signature_kwargs(short), _signature_kwargs(short_again))
        self.assertNotEqual(_signature_kwargs(short), _signature_kwargs(longer))

    def _minimax_h3_kwargs(self, text_seq: int):
        image_seq = 4
        audio_seq = 2
        media_seq = image_seq + audio_seq
        used = text_seq + media_seq
        packed_seq = 64
        audio_pos = torch.arange(text_seq, text_seq + audio_seq)
        img_pos = torch.arange(text_seq + audio_seq, used)
        return {
            "x": torch.zeros(1, packed_seq, 96),
            "audio_x": torch.zeros(1, packed_seq, 32),
            "img_position_ids": torch.zeros(1, packed_seq, 3),
            "unique_timesteps": torch.zeros(1),
            "inverse_indices": torch.zeros(packed_seq, dtype=torch.long),
            "update_mask": torch.ones(image_seq, dtype=torch.bool),
            "token_tags": torch.full((packed_seq,), -1, dtype=torch.long),
            "skip_mask_out_condition": False,
            "prompt_embeds": torch.ones(text_seq, 8),
            "refined_prompt_embeds_length": text_seq,
            "img_pos_info": {"position_ids": img_pos},
            "audio_pos_info": {"position_ids": audio_pos},
            "text_pos_info": {"position_ids": torch.arange(text_seq, dtype=torch.long)},
            "img_pos_for_infer_output_info": {"position_ids": img_pos},
            "local_embedding_layout": {
                "text_source_ids": torch.arange(text_seq),
                "text_row_ids": torch.arange(text_seq),
            },
            "packed_seq_params": {
                "cu_seqlens_q": torch.tensor([0, used, packed_seq], dtype=torch.int32),
                "max_seqlen_q": used,
            },
            "refiner_packed_seq_params": {
                "cu_seqlens_q": torch.tensor(
                    [0, text_seq, text_seq], dtype=torch.int32
                ),
                "max_seqlen_q": text_seq,
            },
        }

    def test_minimax_h3_prompt_lengths_share_bucket_signature(self):
        with self._patch_buckets(64, 128):
            short = self.stage._bcg_pad_prompt_kwargs(
                self._minimax_h3_kwargs(19), current_model=self.minimax_h3_model
            )
            longer = self.stage._bcg_pad_prompt_kwargs(
                self._minimax_h3_kwargs(47), current_model=self.minimax_h3_model
            )

        # H3 keeps the original aligned main sequence: growing it changes SP
        # row partitions and loses bitwise eager equivalence.
        self.assertEqual(short["x"].shape, (1, 64, 96))
        self.assertEqual(longer["x"].shape, (1, 64, 96))
        self.assertEqual(short["audio_x"].shape, (1, 64, 32))
        self.assertEqual(short["prompt_embeds"].shape, (64, 8))
        self.assertEqual(longer["prompt_embeds"].shape, (64, 8))
        self.assertNotIn("local_embedding_layout", short)
        self.assertNotIn("local_embedding_layout", longer)
        self.assertEqual(
            short["refined_prompt_embeds_length"].shape,
            torch.Size([]),
        )
        self.assertEqual(short["refined_prompt_embeds_length"].item(), 19)
        self.assertEqual(longer["refined_prompt_embeds_length"].item(), 47)
        self.assertEqual(
            short["packed_seq_params"]["cu_seqlens_q"].tolist(), [0, 25, 64]
        )
        self.assertEqual(
            longer["packed_seq_params"]["cu_seqlens_q"].tolist(), [0, 53, 64]
        )
        self.assertEqual(short["packed_seq_params"]["max_seqlen_q"], 64)
        self.assertEqual(short["refiner_packed_seq_params"]["max_seqlen_q"], 64)
        self.assertEqual(
            short["refiner_packed_seq_params"]["cu_seqlens_q"].tolist(),
            [0, 19, 64],
        )
        # Dummy prompt rows occupy the independent packed-attention segment;
        # real text/media remain in the first segment.
        self.assertEqual(
            short["text_pos_info"]["position_ids"][19:].tolist(),
            list(range(25, 70)),
        )
        self.assertEqual(
            longer["text_pos_info"]["position_ids"][47:].tolist(),
            list(range(53, 70)),
        )
        self.assertEqual(_signature_kwargs(short), _signature_kwargs(longer))

    def _ideogram_kwargs(self, text_seq: int, *, image_seq: int = 4):
        total_seq = text_seq + image_seq
        indicator = torch.zeros(1, total_seq, dtype=torch.long)
        if text_seq:
            indicator[:, :text_seq] = 3
        indicator[:, text_seq:] = 2
        segment_ids = torch.ones(1, total_seq, dtype=torch.long)
        if text_seq:
            segment_ids[:, :text_seq] = 1
        return {
            "llm_features": torch.ones(1, total_seq, 8),
            "x": torch.zeros(1, total_seq, 16),
            "t": torch.zeros(1),
            "position_ids": torch.zeros(1, total_seq, 3, dtype=torch.long),
            "segment_ids": segment_ids,
            "indicator": indicator,
            "attn_mask": segment_ids > 0,
            "attn_mask_meta": build_varlen_mask_meta(segment_ids > 0),
        }

    def test_ideogram_prompt_lengths_share_bucket_signature(self):
        with self._patch_buckets(64, 128):
            short = self.stage._bcg_pad_prompt_kwargs(
                self._ideogram_kwargs(19), current_model=self.ideogram_model
            )
            longer = self.stage._bcg_pad_prompt_kwargs(
                self._ideogram_kwargs(47), current_model=self.ideogram_model
            )

        self.assertEqual(short["llm_features"].shape, (1, 68, 8))
        self.assertEqual(longer["llm_features"].shape, (1, 68, 8))
        self.assertEqual(short["x"].shape, (1, 68, 16))
        self.assertEqual(short["position_ids"].shape, (1, 68, 3))
        self.assertEqual(short["segment_ids"][0, 23:].tolist(), [-1] * 45)
        self.assertFalse(short["attn_mask"][0, 23:].any())
        self.assertIsInstance(short["attn_mask_meta"], DynamicVarlenMaskMeta)
        self.assertIs(short["attn_mask_meta"], longer["attn_mask_meta"])
        self.assertEqual(_signature_kwargs(short), _signature_kwargs(longer))

    def test_ideogram_image_only_kwargs_are_not_prompt_padded(self):
        kwargs = self._ideogram_kwargs(0)
        with self._patch_buckets(64, 128):
            out = self.stage._bcg_pad_prompt_kwargs(
                kwargs, current_model=self.ideogram_model
            )

        self.assertIs(out, kwargs)
        self.assertEqual(out["x"].shape, (1, 4, 16))
        self.assertIsInstance(out["attn_mask_meta"], dict)

    def test_sana_video_keeps_its_fixed_prompt_shape(self):
        kwargs = {
            "encoder_hidden_states": torch.zeros(1, 300, 2304),
            "encoder_attention_mask": torch.ones(1, 300, dtype=torch.long),
        }
        with self._patch_buckets(64, 128, 256, 512, 1024):
            out = self.stage._bcg_pad_prompt_kwargs(
                kwargs, current_model=self.sana_video_model
            )

        self.assertIs(out, kwargs)
        self.assertEqual(out["encoder_hidden_states"].shape, (1, 300, 2304))
        self.assertEqual(out["encoder_attention_mask"].shape, (1, 300))
        self.assertIn(
            "efficient-large-model/sana-video_2b_480p_diffusers",
            BREAKABLE_CUDA_GRAPH_SUPPORTED_MODEL_IDS,
        )
        self.assertIn(
            "SanaVideoPipelineConfig",
            BREAKABLE_CUDA_GRAPH_SUPPORTED_PIPELINE_CONFIGS,
        )

    def test_flux_unmasked_conditioning_keeps_one_signature_for_all_buckets(self):
        # FLUX attends to all 512 T5 tokens, including tokenizer padding.
        # Adding unmasked tokens would change attention and generated pixels.
        kwargs = {
            "hidden_states": torch.zeros(1, 4096, 64, dtype=torch.bfloat16),
            "encoder_hidden_states": torch.ones(1, 512, 4096, dtype=torch.bfloat16),
            "pooled_projections": torch.ones(1, 768, dtype=torch.bfloat16),
            "timestep": torch.zeros(1),
            "guidance": torch.full((1,), 3.5, dtype=torch.bfloat16),
            "freqs_cis": (torch.zeros(4608, 64), torch.ones(4608, 64)),
        }
        signature = _signature_kwargs(kwargs)
        for bucket in (64, 128, 256, 512, 1024):
            with self.subTest(bucket=bucket):
                out = self.stage._bcg_pad_prompt_kwargs(
                    kwargs, current_model=self.flux_model, force_bucket=bucket
                )
                self.assertIs(out, kwargs)
                self.assertEqual(_signature_kwargs(out), signature)

    def test_dynamic_varlen_mask_meta_rebuilds_once_per_replay_token(self):
        builder = DynamicVarlenMaskMeta()
        mask = torch.tensor([[True, True, False, False]])
        calls = []

        def fake_build(current_mask):
            calls.append(current_mask.clone())
            return {"valid": int(current_mask.sum().item())}

        with (
            patch(
                "sglang.multimodal_gen.runtime.layers.attention.layer."
                "build_varlen_mask_meta",
                side_effect=fake_build,
            ),
            patch(
                "sglang.multimodal_gen.runtime.layers.attention.layer."
                "get_current_replay_token",
                side_effect=[1, 1, 2],
            ),
        ):
            first = builder.resolve(mask)
            mask[0, 2] = True
            second = builder.resolve(mask)
            third = builder.resolve(mask)

        self.assertEqual(first, {"valid": 2})
        self.assertIs(second, first)
        self.assertEqual(third, {"valid": 3})
        self.assertEqual(len(calls), 2)

    def test_disabled_bcg_flag_skips_runner(self):
        self.stage.server_args = SimpleNamespace(
            enable_breakable_cuda_graph=False,
            enable_torch_compile=False,
        )
        self.stage._bcg_runners = {}
        self.stage._cache_dit_enabled = False

        self.assertIsNone(self.stage._maybe_get_bcg_runner(self.qwen_model))
        self.stage._maybe_torch_compile(self.qwen_model)
        self.stage._maybe_enable_cache_dit(1, _fake_cache_dit_batch(is_warmup=True))
        self.assertEqual(self.stage._bcg_runners, {})

    def test_bcg_warns_when_cache_dit_is_requested(self):
        self.stage.server_args = SimpleNamespace(enable_breakable_cuda_graph=True)
        _print_warning_once.cache_clear()
        self.addCleanup(_print_warning_once.cache_clear)

        with (
            patch.object(self.stage, "_cache_dit_requested", return_value=True),
            patch.object(denoising_module.logger, "warning") as warning,
        ):
            self.stage._maybe_enable_cache_dit(1, _fake_cache_dit_batch(is_warmup=True))
            self.stage._maybe_enable_cache_dit(
                1, _fake_cache_dit_batch(is_warmup=False)
            )

        warning.assert_called_once_with(
            "Cache-DiT was requested but is disabled because breakable CUDA "
            "graphs are enabled.",
            stacklevel=2,
        )

    def test_bcg_does_not_warn_when_cache_dit_is_not_requested(self):
        self.stage.server_args = SimpleNamespace(enable_breakable_cuda_graph=True)

        with (
            patch.object(self.stage, "_cache_dit_requested", return_value=False),
            patch(
                "sglang.multimodal_gen.runtime.pipelines_core.stages.denoising."
                "logger.warning_once"
            ) as warning_once,
        ):
            self.stage._maybe_enable_cache_dit(1, _fake_cache_dit_batch(is_warmup=True))

        warning_once.assert_not_called()

    def test_bcg_runner_cache_is_per_model_module(self):
        self.stage.server_args = SimpleNamespace(enable_breakable_cuda_graph=True)
        self.stage._bcg_runners = {}
        # The cache key is (module, quality level); this one varies the module.
        self.stage._mounted_quality = "lossless"

        def fake_runner(model, device):
            return SimpleNamespace(model=model, device=device)

        with (
            patch(
                "sglang.multimodal_gen.runtime.breakable_cuda_graph.runner."
                "DiffusionBreakableCudaGraphRunner",
                side_effect=fake_runner,
            ),
            patch(
                "sglang.multimodal_gen.runtime.pipelines_core.stages.denoising."
                "get_local_torch_device",
                return_value=torch.device("cpu"),
            ),
        ):
            first = self.stage._maybe_get_bcg_runner(self.qwen_model)
            second = self.stage._maybe_get_bcg_runner(self.other_model)
            first_again = self.stage._maybe_get_bcg_runner(self.qwen_model)

        self.assertIs(first_again, first)
        self.assertIsNot(first, second)
        self.assertIs(first.model, self.qwen_model)
        self.assertIs(second.model, self.other_model)
        self.assertEqual(len(self.stage._bcg_runners), 2)

    def test_bcg_runner_rejects_too_many_segments(self):
        runner = object.__new__(DiffusionBreakableCudaGraphRunner)
        runner.max_segments = 2
        entry = _CaptureEntry(
            graph=SimpleNamespace(_break_fns=[], _segments=[object()] * 3),
            static_kwargs={},
            static_leaves=[],
            output=None,
            num_segments=3,
        )

        self.assertIn("captured 3 segments", runner._capture_limit_reason(entry))

    def test_bcg_runner_lazy_capture_only_during_warmup(self):
        runner = object.__new__(DiffusionBreakableCudaGraphRunner)

        with patch(
            "sglang.multimodal_gen.runtime.managers.forward_context.get_forward_context",
            return_value=SimpleNamespace(forward_batch=SimpleNamespace(is_warmup=True)),
        ):
            self.assertTrue(runner._should_capture_on_call(("sig",)))

        with patch(
            "sglang.multimodal_gen.runtime.managers.forward_context.get_forward_context",
            return_value=SimpleNamespace(
                forward_batch=SimpleNamespace(is_warmup=False)
            ),
        ):
            self.assertFalse(runner._should_capture_on_call(("sig",)))

    def test_bcg_runner_reset_drops_entries_and_marks_disabled(self):
        runner = object.__new__(DiffusionBreakableCudaGraphRunner)
        runner.device_module = SimpleNamespace(empty_cache=lambda: None)
        entry = _CaptureEntry(
            graph=SimpleNamespace(_break_fns=[lambda: None], _segments=[object()]),
            static_kwargs={"x": torch.zeros(1)},
            static_leaves=[torch.zeros(1)],
            output=torch.zeros(1),
            num_segments=1,
        )
        runner.entries = {("sig",): entry}
        runner._blocked = {("sig",)}

        runner.reset(disabled_reason="too much memory")

        self.assertEqual(runner.entries, {})
        self.assertEqual(runner._blocked, set())
        self.assertEqual(entry.graph._break_fns, [])
        self.assertEqual(entry.graph._segments, [])
        self.assertIsNone(entry.output)
        self.assertEqual(runner._disabled_reason, "too much memory")

    def test_bcg_runner_allows_unlimited_segments(self):
        runner = object.__new__(DiffusionBreakableCudaGraphRunner)
        runner.max_segments = 0
        entry = _CaptureEntry(
            graph=SimpleNamespace(_break_fns=[], _segments=[object()]),
            static_kwargs={},
            static_leaves=[],
            output=None,
            num_segments=1,
        )

        self.assertIsNone(runner._capture_limit_reason(entry))


class TestBCGWeightChangeAfterCapture(unittest.TestCase):
    """Graphs replay capture-time weights and LoRA branches, so a later change drops them."""

    def setUp(self):
        self.eager_calls = 0

        def eager(**kwargs):
            self.eager_calls += 1
            return "eager"

        self.runner = object.__new__(DiffusionBreakableCudaGraphRunner)
        self.runner.transformer = eager
        self.runner.device_module = SimpleNamespace(empty_cache=lambda: None)
        self.runner._blocked = set()
        self.runner._disabled_reason = None
        self.kwargs = {"hidden_states": torch.zeros(2)}
        self.runner.entries = {
            _signature_kwargs(self.kwargs): _CaptureEntry(
                graph=SimpleNamespace(_break_fns=[], _segments=[object()]),
                static_kwargs={},
                static_leaves=[],
                output=None,
                num_segments=1,
            )
        }
        stage = DenoisingStage.__new__(DenoisingStage)
        stage._bcg_runners = {(id(eager), "lossless"): self.runner}
        self.worker = GPUWorker.__new__(GPUWorker)
        self.worker.metrics = None
        self.worker.pipeline = MagicMock(spec=LoRAPipeline)
        self.worker.pipeline.stages = [stage]

    def _assert_runs_eager(self):
        self.assertEqual(self.runner.entries, {})
        self.assertEqual(self.runner(**self.kwargs), "eager")
        self.assertEqual(self.eager_calls, 1)

    def test_set_lora_drops_captured_graphs(self):
        self.worker.set_lora("style", "/loras/style.safetensors")
        self.worker.pipeline.set_lora.assert_called_once()
        self._assert_runs_eager()

    def test_merge_and_unmerge_drop_captured_graphs(self):
        changes = {
            "merge": lambda worker: worker.merge_lora_weights(),
            "unmerge": lambda worker: worker.unmerge_lora_weights(),
        }
        for name, change in changes.items():
            with self.subTest(name):
                self.setUp()
                change(self.worker)
                self._assert_runs_eager()

    def test_resume_memory_occupation_drops_captured_graphs(self):
        self.worker.memory_occupation = MagicMock()
        self.worker.resume_memory_occupation()
        self._assert_runs_eager()


if __name__ == "__main__":
    unittest.main()
