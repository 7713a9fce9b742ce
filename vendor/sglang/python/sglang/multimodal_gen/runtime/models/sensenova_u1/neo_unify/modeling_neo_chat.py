# Modified for SGLang; see this directory's README.md for upstream source.

import contextlib
import math
from typing import List, Optional, Tuple, Union

import torch.utils.checkpoint
import transformers
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .configuration_neo_chat import NEOChatConfig, NEOMoELLMConfig
from .conversation import get_conv_template
from .modeling_fm_modules import (
    ConvDecoder,
    FlowMatchingHead,
    TimestepEmbedder,
)
from .modeling_neo_vit import NEOVisionModel
from .modeling_qwen3 import (
    Qwen3ForCausalLM,
    create_block_causal_mask,
    npu_fia_available,
)
from .modeling_qwen3_moe import Qwen3MoeForCausalLM
from .utils import SYSTEM_MESSAGE_FOR_GEN

logger = logging.get_logger(__name__)


def version_cmp(v1, v2, op="eq"):
    import operator

    from packaging import version

    op_func = getattr(operator, op)
    return op_func(version.parse(v1), version.parse(v2))


def _copy_right_aligned_prefix_bnsd(destination, source, lengths):
    prefix_width = source.shape[2]
    for batch_index, length in enumerate(lengths):
        destination[batch_index, :, prefix_width - length : prefix_width].copy_(
            source[batch_index, :, :length]
        )


def prepare_flash_kv_cache(
    past_key_values,
    current_len: int,
    batch_size: int,
    prefix_lengths: Optional[torch.Tensor] = None,
):
    """
    Preallocate the full KV buffer for [prefix + current]. CUDA/SDPA use
    [B, S, H, D], while NPU FIA keeps the source [B, H, S, D] layout.

    This is done once before denoising loop.
    """
    if past_key_values is None:
        return

    lengths = None
    if prefix_lengths is not None:
        lengths = [int(length) for length in prefix_lengths.reshape(-1).tolist()]
        if len(lengths) == 1 and batch_size > 1:
            lengths *= batch_size
        if len(lengths) != batch_size:
            raise ValueError(
                f"Expected {batch_size} prefix lengths, got {len(lengths)}"
            )

    for layer in past_key_values.layers:
        past_k = layer.keys
        past_v = layer.values

        if past_k is None or past_v is None:
            layer.flash_prefix_len = 0
            layer.flash_total_len = current_len
            layer.flash_k_cache = None
            layer.flash_v_cache = None
            layer.flash_actual_seq_lengths_kv = None
            layer.flash_kv_padding_size = None
            layer.flash_cache_layout = None
            continue

        # original cache layout: [B, H, S, D]
        prefix_len = past_k.shape[2]
        total_len = prefix_len + current_len
        if lengths is not None and any(
            length < 0 or length > prefix_len for length in lengths
        ):
            raise ValueError(
                f"Prefix lengths must be between 0 and {prefix_len}, got {lengths}"
            )

        use_npu_fia = (
            past_k.device.type == "npu" and lengths is not None and npu_fia_available()
        )
        if use_npu_fia:
            k_cache = torch.empty(
                (batch_size, past_k.shape[1], total_len, past_k.shape[3]),
                device=past_k.device,
                dtype=past_k.dtype,
            )
            v_cache = torch.empty(
                (batch_size, past_v.shape[1], total_len, past_v.shape[3]),
                device=past_v.device,
                dtype=past_v.dtype,
            )
            _copy_right_aligned_prefix_bnsd(k_cache, past_k, lengths)
            _copy_right_aligned_prefix_bnsd(v_cache, past_v, lengths)
            layer.flash_actual_seq_lengths_kv = [
                length + current_len for length in lengths
            ]
            layer.flash_kv_padding_size = torch.zeros(
                1, dtype=torch.int64, device=past_k.device
            )
            layer.flash_cache_layout = "BNSD"
        else:
            past_k_flash = past_k.transpose(1, 2).contiguous()
            past_v_flash = past_v.transpose(1, 2).contiguous()
            k_cache = torch.empty(
                (batch_size, total_len, past_k_flash.shape[2], past_k_flash.shape[3]),
                device=past_k_flash.device,
                dtype=past_k_flash.dtype,
            )
            v_cache = torch.empty(
                (batch_size, total_len, past_v_flash.shape[2], past_v_flash.shape[3]),
                device=past_v_flash.device,
                dtype=past_v_flash.dtype,
            )
            k_cache[:, :prefix_len].copy_(past_k_flash)
            v_cache[:, :prefix_len].copy_(past_v_flash)
            layer.flash_actual_seq_lengths_kv = (
                None
                if lengths is None or past_k.device.type == "npu"
                else [length + current_len for length in lengths]
            )
            layer.flash_kv_padding_size = None
            layer.flash_cache_layout = "BSND"

        layer.flash_prefix_len = prefix_len
        layer.flash_total_len = total_len
        layer.flash_k_cache = k_cache
        layer.flash_v_cache = v_cache


def clear_flash_kv_cache(past_key_values):
    if past_key_values is None:
        return
    for layer in past_key_values.layers:
        if hasattr(layer, "flash_prefix_len"):
            delattr(layer, "flash_prefix_len")
        if hasattr(layer, "flash_total_len"):
            delattr(layer, "flash_total_len")
        if hasattr(layer, "flash_k_cache"):
            delattr(layer, "flash_k_cache")
        if hasattr(layer, "flash_v_cache"):
            delattr(layer, "flash_v_cache")
        if hasattr(layer, "flash_actual_seq_lengths_kv"):
            delattr(layer, "flash_actual_seq_lengths_kv")
        if hasattr(layer, "flash_kv_padding_size"):
            delattr(layer, "flash_kv_padding_size")
        if hasattr(layer, "flash_cache_layout"):
            delattr(layer, "flash_cache_layout")


def optimized_scale(positive_flat, negative_flat):
    # Force the divisor computation to float32 regardless of the surrounding
    # autocast (the squared-norm/division is what we don't want in fp16/bf16).
    # ``device_type`` is taken from the input so this runs equally on CUDA and
    # XPU; ``mps`` is rerouted to ``cpu`` because torch.autocast rejects it.
    device_type = positive_flat.device.type
    if device_type == "mps":
        device_type = "cpu"
    with torch.autocast(device_type=device_type, enabled=False):
        positive_flat = positive_flat.float()
        negative_flat = negative_flat.float()

        # Calculate dot production
        dot_product = torch.sum(positive_flat * negative_flat, dim=1, keepdim=True)

        # Squared norm of uncondition
        squared_norm = torch.sum(negative_flat**2, dim=1, keepdim=True) + 1e-8

        # st_star = v_cond^T * v_uncond / ||v_uncond||^2
        st_star = dot_product / squared_norm

    return st_star


def _randn_with_seed(shape, *, device, dtype, seed: int | list[int]) -> torch.Tensor:
    if isinstance(seed, list):
        if len(shape) == 0 or len(seed) != shape[0]:
            raise ValueError(
                f"expected one seed per batch item, got {len(seed)} seeds for shape {shape}"
            )
        return torch.cat(
            [
                _randn_with_seed(
                    (1, *shape[1:]), device=device, dtype=dtype, seed=item_seed
                )
                for item_seed in seed
            ],
            dim=0,
        )
    try:
        generator = torch.Generator(device)
    except (RuntimeError, TypeError):
        device = torch.device(device)
        if device.type == "cpu":
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)
                return torch.randn(shape, device=device, dtype=dtype)

        device_module = torch.get_device_module(device)
        with torch.random.fork_rng(devices=[device], device_type=device.type):
            device_context = (
                device_module.device(device)
                if hasattr(device_module, "device")
                else contextlib.nullcontext()
            )
            with device_context:
                device_module.manual_seed(seed)
            return torch.randn(shape, device=device, dtype=dtype)
    generator.manual_seed(seed)
    return torch.randn(shape, device=device, dtype=dtype, generator=generator)


class NEOChatModel(PreTrainedModel):
    config_class = NEOChatConfig
    main_input_name = "pixel_values"
    base_model_prefix = "language_model"
    _supports_flash_attn_2 = True
    supports_gradient_checkpointing = True
    _no_split_modules = [
        "NEOVisionModel",
        "Qwen3DecoderLayer",
        "Qwen3MoeDecoderLayer",
    ]
    _denoise_offload_module_paths = (
        "language_model.model.embed_tokens",
        "language_model.lm_head",
    )

    # support transformers 4.51.+
    _tp_plan = ""

    def __init__(
        self,
        config: NEOChatConfig,
        vision_model=None,
        language_model=None,
        use_flash_attn=True,
    ):
        super().__init__(config)

        assert version_cmp(transformers.__version__, "4.37.0", "ge")
        patch_size = config.vision_config.patch_size
        self.patch_size = patch_size
        self.template = config.template
        self.downsample_ratio = config.downsample_ratio
        config.llm_config._attn_implementation = "eager"

        if vision_model is not None:
            self.vision_model = vision_model
        else:
            self.vision_model = NEOVisionModel(config.vision_config)
            vision_model_mot_gen = NEOVisionModel(config.vision_config)
        if language_model is not None:
            self.language_model = language_model
        else:
            # Pick the right backbone class based on the LLM config: dense
            # Qwen3 (DANCE family) or Qwen3-MoE (A3B family). The two share
            # the same NEO-Unify two-branch attention/norm layout, so the
            # rest of this class works against either.
            if isinstance(config.llm_config, NEOMoELLMConfig):
                self.language_model = Qwen3MoeForCausalLM(config.llm_config)
            else:
                self.language_model = Qwen3ForCausalLM(config.llm_config)

        merge_size = int(1 / self.downsample_ratio)
        output_dim = 3 * (patch_size * merge_size) ** 2
        llm_hidden_size = self.config.llm_config.hidden_size
        self.use_deep_fm_head = self.config.fm_head_layers > 2
        self.use_pixel_head = self.config.use_pixel_head
        if self.use_deep_fm_head:
            fm_head = FlowMatchingHead(
                llm_hidden_size,
                output_dim,
                dim=self.config.fm_head_dim,
                layers=self.config.fm_head_layers,
                mlp_ratio=self.config.fm_head_mlp_ratio,
            )
        else:
            fm_head = nn.Sequential(
                nn.Linear(llm_hidden_size, 4096, bias=True),
                nn.GELU(),
                nn.Linear(4096, output_dim, bias=True),
            )

        timestep_embedder = TimestepEmbedder(llm_hidden_size)
        self.fm_modules = nn.ModuleDict(
            {
                "vision_model_mot_gen": vision_model_mot_gen,
                "timestep_embedder": timestep_embedder,
                "fm_head": fm_head,
            }
        )

        if self.use_pixel_head:
            self.fm_modules["fm_head"] = ConvDecoder(llm_hidden_size)

        self.concat_time_token_num = config.concat_time_token_num
        self.noise_scale = config.noise_scale
        self.noise_scale_mode = config.noise_scale_mode
        self.noise_scale_base_image_seq_len = config.noise_scale_base_image_seq_len
        self.add_noise_scale_embedding = config.add_noise_scale_embedding
        self.noise_scale_max_value = config.noise_scale_max_value
        self.time_schedule = config.time_schedule
        self.time_shift_type = config.time_shift_type
        self.base_shift = config.base_shift
        self.max_shift = config.max_shift
        self.base_image_seq_len = config.base_image_seq_len
        self.max_image_seq_len = config.max_image_seq_len

        if self.add_noise_scale_embedding:
            noise_scale_embedder = TimestepEmbedder(llm_hidden_size)
            self.fm_modules["noise_scale_embedder"] = noise_scale_embedder

        self.last_think_content = ""
        self.conv_template = get_conv_template(self.template)
        self.system_message = self.conv_template.system_message

        # Transformers 5 builds composite-model metadata (including
        # ``all_tied_weights_keys``) in ``post_init``.  Without this call a
        # real checkpoint reaches the final loading pass with that metadata
        # missing, even though the nested language model initialized it.
        self.post_init()

    def _notify_layer_offload_phase(self, phase: str) -> None:
        callback = getattr(self, "_layer_offload_phase_callback", None)
        if callback is not None:
            callback(phase)

    def forward(
        self,
        pixel_values: torch.FloatTensor,
        input_ids: torch.LongTensor = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        image_flags: Optional[torch.LongTensor] = None,
        past_key_values: Optional[List[torch.FloatTensor]] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
    ) -> Union[Tuple, CausalLMOutputWithPast]:
        raise NotImplementedError("forward")

    def extract_feature(self, pixel_values, grid_hw=None):
        return self.fm_modules["vision_model_mot_gen"](
            pixel_values=pixel_values,
            output_hidden_states=False,
            return_dict=True,
            grid_hw=grid_hw,
        ).last_hidden_state

    def patchify(self, images, patch_size, channel_first=False):
        """
        images: (N, 3, H, W)
        x: (N, L, patch_size**2 *3)
        """
        h, w = images.shape[2] // patch_size, images.shape[3] // patch_size
        x = images.reshape(shape=(images.shape[0], 3, h, patch_size, w, patch_size))

        if channel_first:
            x = torch.einsum("nchpwq->nhwcpq", x)
        else:
            x = torch.einsum("nchpwq->nhwpqc", x)

        x = x.reshape(shape=(images.shape[0], h * w, patch_size**2 * 3))
        return x

    def unpatchify(sle, x, patch_size, h=None, w=None):
        """
        x: (N, L, patch_size**2 *3)
        images: (N, 3, H, W)
        """
        if h is None or w is None:
            h = w = int(x.shape[1] ** 0.5)
        else:
            h = h // patch_size
            w = w // patch_size
        x = x.reshape(shape=(x.shape[0], h, w, patch_size, patch_size, 3))
        x = torch.einsum("nhwpqc->nchpwq", x)
        images = x.reshape(shape=(x.shape[0], 3, h * patch_size, w * patch_size))
        return images

    def _calculate_dynamic_mu(self, image_seq_len: int) -> float:
        denom = self.max_image_seq_len - self.base_image_seq_len
        if denom == 0:
            return float(self.base_shift)
        m = (self.max_shift - self.base_shift) / denom
        b = self.base_shift - m * self.base_image_seq_len
        return float(image_seq_len) * m + b

    def _apply_time_schedule(
        self, t: torch.Tensor, image_seq_len: int, timestep_shift: float
    ) -> torch.Tensor:
        self.time_schedule = "standard"
        sigma = 1 - t
        if timestep_shift != 1:
            self.time_schedule = "standard"
        if self.time_schedule == "standard":
            shift = timestep_shift
            sigma = shift * sigma / (1 + (shift - 1) * sigma)
        elif self.time_schedule == "dynamic":
            mu = self._calculate_dynamic_mu(image_seq_len)
            mu_t = t.new_tensor(mu)
            if self.time_shift_type == "exponential":
                shift = torch.exp(mu_t)
                sigma = shift * sigma / (1 + (shift - 1) * sigma)
            elif self.time_shift_type == "linear":
                sigma = mu_t / (mu_t + (1 / sigma - 1))
            else:
                raise ValueError(f"Unsupported time_shift_type: {self.time_shift_type}")
        else:
            raise ValueError(f"Unsupported time_schedule: {self.time_schedule}")
        return 1 - sigma

    def _build_t2i_query(self, prompt_text, system_message=None, append_text=None):
        template = get_conv_template(self.template)
        template.system_message = (
            self.system_message if system_message is None else system_message
        )
        template.append_message(template.roles[0], prompt_text)
        template.append_message(template.roles[1], None)
        if append_text is not None:
            return template.get_prompt() + append_text
        return template.get_prompt()

    def _build_t2i_text_inputs(self, tokenizer, query: str | list[str]):
        queries = [query] if isinstance(query, str) else query
        if not queries:
            raise ValueError("query batch must not be empty")
        encoded = [
            tokenizer(item, return_tensors="pt")["input_ids"][0] for item in queries
        ]
        lengths = [item.shape[0] for item in encoded]
        prefix_lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)
        max_length = max(lengths)
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "eos_token_id", None)
        if pad_token_id is None:
            pad_token_id = 0

        input_ids = torch.full(
            (len(encoded), max_length),
            int(pad_token_id),
            dtype=encoded[0].dtype,
            device=self.device,
        )
        key_valid_mask = torch.zeros(
            (len(encoded), max_length), dtype=torch.bool, device=self.device
        )
        for batch_index, item in enumerate(encoded):
            item = item.to(self.device)
            item_length = item.shape[0]
            input_ids[batch_index, :item_length] = item
            key_valid_mask[batch_index, :item_length] = True

        t_idx = torch.arange(
            max_length, dtype=torch.long, device=input_ids.device
        ).expand(len(encoded), -1)
        h_idx = torch.zeros_like(t_idx)
        w_idx = torch.zeros_like(t_idx)
        batched_indexes = torch.stack([t_idx, h_idx, w_idx], dim=1)
        indexes = batched_indexes[0] if len(encoded) == 1 else batched_indexes

        attention_mask = {
            "full_attention": create_block_causal_mask(t_idx, key_valid_mask)
        }
        return input_ids, indexes, attention_mask, key_valid_mask, prefix_lengths

    def _build_t2i_image_indexes(self, token_h, token_w, text_len, device):
        if isinstance(text_len, torch.Tensor):
            text_len = text_len.to(device=device, dtype=torch.long).reshape(-1)
            batch_size = text_len.shape[0]
            image_len = token_h * token_w
            t_image = text_len[:, None].expand(batch_size, image_len)
            idx = torch.arange(image_len, device=device, dtype=torch.long)
            h_image = (idx // token_w).expand(batch_size, -1)
            w_image = (idx % token_w).expand(batch_size, -1)
            return torch.stack([t_image, h_image, w_image], dim=1)

        t_image = torch.full(
            (token_h * token_w,), text_len, dtype=torch.long, device=device
        )
        idx = torch.arange(token_h * token_w, device=device, dtype=torch.long)
        h_image = idx // token_w
        w_image = idx % token_w
        return torch.stack([t_image, h_image, w_image], dim=0)

    def _t2i_prefix_forward(self, input_ids, indexes, attention_mask):
        out = self.language_model.model(
            input_ids=input_ids,
            indexes=indexes,
            attention_mask=attention_mask,
            use_cache=True,
        )
        return out.past_key_values, out.last_hidden_state

    def _think_prefix_forward(self, **kwargs):
        """Build the Think prefix cache without materialising per-token logits."""
        return self.language_model(use_cache=True, logits_to_keep=1, **kwargs)

    def _append_text_tokens_to_cache(self, cache, t_idx, input_ids):
        if input_ids.shape[1] == 0:
            return t_idx

        device = input_ids.device
        seq_len = input_ids.shape[1]
        inputs_embeds = self.language_model.get_input_embeddings()(input_ids)

        t_indexes = torch.arange(
            t_idx + 1, t_idx + 1 + seq_len, dtype=torch.long, device=device
        )
        h_indexes = torch.zeros(seq_len, dtype=torch.long, device=device)
        w_indexes = torch.zeros(seq_len, dtype=torch.long, device=device)
        indexes = torch.stack([t_indexes, h_indexes, w_indexes], dim=0)

        past_len = cache.get_seq_length()
        mask = torch.zeros(1, 1, seq_len, past_len + seq_len, device=device)
        causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=device))
        causal_mask = torch.where(causal_mask == 1, 0.0, float("-inf"))
        mask[:, :, :, past_len:] = causal_mask
        attention_mask_dict = {"full_attention": mask}

        self.language_model.model(
            inputs_embeds=inputs_embeds,
            indexes=indexes,
            attention_mask=attention_mask_dict,
            past_key_values=cache,
            use_cache=True,
        )
        return t_idx + seq_len

    def _generate_think(
        self,
        tokenizer,
        prefix_outputs,
        past_key_values,
        t_idx,
        IMG_START_TOKEN,
        max_think_tokens=1024,
    ):
        template = get_conv_template(self.template)
        eos_token_id = tokenizer.convert_tokens_to_ids(template.sep.strip())
        think_end_token_id = tokenizer.convert_tokens_to_ids("</think>")
        think_token_ids = []
        next_token = torch.argmax(prefix_outputs.logits[:, -1, :], dim=-1)

        for _ in range(max_think_tokens):
            token_item = next_token.item()
            if token_item == eos_token_id:
                break
            if token_item == think_end_token_id:
                self.language_model.model.current_index = t_idx
                outputs = self.language_model(
                    input_ids=next_token.unsqueeze(0),
                    past_key_values=past_key_values,
                    use_cache=True,
                )
                past_key_values = outputs.past_key_values
                t_idx += 1
                think_token_ids.append(token_item)
                break

            think_token_ids.append(token_item)

            self.language_model.model.current_index = t_idx
            outputs = self.language_model(
                input_ids=next_token.unsqueeze(0),
                past_key_values=past_key_values,
                use_cache=True,
            )
            past_key_values = outputs.past_key_values
            t_idx += 1

            next_token = torch.argmax(outputs.logits[:, -1, :], dim=-1)

        append_ids = tokenizer(
            "\n\n" + IMG_START_TOKEN,
            return_tensors="pt",
            add_special_tokens=False,
        )["input_ids"].to(self.device)
        t_idx = self._append_text_tokens_to_cache(past_key_values, t_idx, append_ids)

        think_text = tokenizer.decode(think_token_ids, skip_special_tokens=False)

        return past_key_values, t_idx, think_text

    def _t2i_predict_v(
        self,
        input_embeds,
        indexes_image,
        attn_mask,
        past_key_values,
        t,
        z,
        image_token_num,
        timestep_embeddings=None,
        image_size=None,
    ):
        B, L = z.shape[0], z.shape[1]

        outputs = self.language_model.model(
            inputs_embeds=input_embeds,
            image_gen_indicators=torch.ones(
                (input_embeds.shape[0], input_embeds.shape[1]),
                dtype=torch.bool,
                device=input_embeds.device,
            ),
            indexes=indexes_image,
            attention_mask=attn_mask,
            past_key_values=past_key_values,
            update_cache=False,
            use_cache=True,
        )

        if self.use_pixel_head:
            merge_size = int(1 / self.downsample_ratio)
            token_h = image_size[1] // (self.patch_size * merge_size)
            token_w = image_size[0] // (self.patch_size * merge_size)

            img_reshaped = outputs.last_hidden_state[:, -image_token_num:].view(
                B, token_h, token_w, -1
            )
            img_2d = torch.einsum("b h w c -> b c h w", img_reshaped)
            img_2d = img_2d.contiguous().view(B, -1, token_h, token_w)

            smoothed_img_2d = self.fm_modules["fm_head"](img_2d)

            smoothed_reshaped = smoothed_img_2d.view(
                B,
                3,
                token_h,
                self.patch_size * merge_size,
                token_w,
                self.patch_size * merge_size,
            )
            smoothed_reshaped = torch.einsum(
                "b c h p w q -> b h w p q c", smoothed_reshaped
            )
            out_1d = smoothed_reshaped.contiguous().view(
                B, L, self.patch_size * merge_size * self.patch_size * merge_size * 3
            )
            x_pred = out_1d
        else:
            if self.use_deep_fm_head:
                x_pred = self.fm_modules["fm_head"](
                    outputs.last_hidden_state[:, -image_token_num:].view(B * L, -1),
                    t.repeat(B * L),
                ).view(B, L, -1)
            else:
                x_pred = self.fm_modules["fm_head"](
                    outputs.last_hidden_state[:, -image_token_num:].view(B, L, -1)
                ).view(B, L, -1)

        v_pred = (x_pred - z) / (1 - t).clamp_min(self.config.t_eps)
        return v_pred

    @torch.no_grad()
    def t2i_generate(
        self,
        tokenizer,
        prompt,
        cfg_scale=1,
        timestep_shift=1,
        enable_timestep_shift=True,
        cfg_norm="none",
        image_size=(256, 256),
        num_steps=30,
        IMG_START_TOKEN="<img>",
        IMG_END_TOKEN="</img>",
        IMG_CONTEXT_TOKEN="<IMG_CONTEXT>",
        method="euler",
        cfg_interval=(0, 1),
        batch_size=1,
        t_eps=0.02,
        think_mode=False,
        seed=0,
    ):
        assert self.concat_time_token_num == 0
        assert cfg_norm in ["cfg_zero_star", "global", "none", "channel"]
        prompts = prompt if isinstance(prompt, list) else [prompt]
        if not prompts:
            raise ValueError("prompt batch must not be empty")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if isinstance(prompt, list) and len(prompts) != batch_size:
            raise ValueError(
                f"batch_size={batch_size} does not match {len(prompts)} prompts"
            )
        if len(prompts) > 1 and think_mode:
            raise ValueError(
                "batched SenseNova-U1 generation does not support think_mode"
            )
        self._notify_layer_offload_phase("prefix")
        merge_size = int(1 / self.downsample_ratio)

        self.config.t_eps = t_eps
        think_text = ""
        needs_cfg = cfg_scale > 1

        think_content = (
            "<think>\n" if think_mode else "<think>\n\n</think>\n\n" + IMG_START_TOKEN
        )
        query_conditions = [
            self._build_t2i_query(
                item,
                system_message=SYSTEM_MESSAGE_FOR_GEN,
                append_text=think_content,
            )
            for item in prompts
        ]
        query_condition = (
            query_conditions[0] if len(query_conditions) == 1 else query_conditions
        )
        query_uncondition = (
            self._build_t2i_query("", append_text=IMG_START_TOKEN)
            if needs_cfg
            else None
        )

        (
            input_ids_condition,
            indexes_condition,
            attention_mask_condition_prefix,
            condition_key_valid_mask,
            condition_prefix_lengths,
        ) = self._build_t2i_text_inputs(tokenizer, query_condition)
        if query_uncondition is not None:
            (
                input_ids_uncondition,
                indexes_uncondition,
                attention_mask_uncondition_prefix,
                _,
                uncondition_prefix_lengths,
            ) = self._build_t2i_text_inputs(tokenizer, query_uncondition)
        else:
            input_ids_uncondition = indexes_uncondition = (
                attention_mask_uncondition_prefix
            ) = None
            uncondition_prefix_lengths = None

        token_h = image_size[1] // (self.patch_size * merge_size)
        token_w = image_size[0] // (self.patch_size * merge_size)

        indexes_image_condition = self._build_t2i_image_indexes(
            token_h,
            token_w,
            (
                int(condition_prefix_lengths[0].item())
                if len(prompts) == 1
                else condition_prefix_lengths
            ),
            device=input_ids_condition.device,
        )
        indexes_image_uncondition = (
            self._build_t2i_image_indexes(
                token_h,
                token_w,
                int(uncondition_prefix_lengths[0].item()),
                device=input_ids_uncondition.device,
            )
            if indexes_uncondition is not None
            else None
        )

        if think_mode:
            outputs_condition = self._think_prefix_forward(
                input_ids=input_ids_condition,
                indexes=indexes_condition,
                attention_mask=attention_mask_condition_prefix,
            )
            past_key_values_condition = outputs_condition.past_key_values
            device = outputs_condition.logits.device
            dtype = outputs_condition.logits.dtype
            t_index_condition = indexes_condition[0].max().item()
            past_key_values_condition, t_index_condition, think_text = (
                self._generate_think(
                    tokenizer,
                    outputs_condition,
                    past_key_values_condition,
                    t_index_condition,
                    IMG_START_TOKEN,
                )
            )
            indexes_image_condition = self._build_t2i_image_indexes(
                token_h,
                token_w,
                t_index_condition + 1,
                device=input_ids_condition.device,
            )
            del outputs_condition
        else:
            past_key_values_condition, prefix_hidden_states = self._t2i_prefix_forward(
                input_ids_condition, indexes_condition, attention_mask_condition_prefix
            )
            device = prefix_hidden_states.device
            dtype = prefix_hidden_states.dtype
            del prefix_hidden_states
        past_key_values_uncondition = None
        if input_ids_uncondition is not None:
            past_key_values_uncondition, _ = self._t2i_prefix_forward(
                input_ids_uncondition,
                indexes_uncondition,
                attention_mask_uncondition_prefix,
            )

        del input_ids_condition, indexes_condition, attention_mask_condition_prefix
        if input_ids_uncondition is not None:
            del (
                input_ids_uncondition,
                indexes_uncondition,
                attention_mask_uncondition_prefix,
            )
        self._notify_layer_offload_phase("denoise")

        for layer_idx in range(len(past_key_values_condition.layers)):
            past_key_values_condition.layers[
                layer_idx
            ].keys = past_key_values_condition.layers[layer_idx].keys.expand(
                batch_size, *past_key_values_condition.layers[layer_idx].keys.shape[1:]
            )
            past_key_values_condition.layers[
                layer_idx
            ].values = past_key_values_condition.layers[layer_idx].values.expand(
                batch_size,
                *past_key_values_condition.layers[layer_idx].values.shape[1:],
            )
            if past_key_values_uncondition is not None:
                past_key_values_uncondition.layers[
                    layer_idx
                ].keys = past_key_values_uncondition.layers[layer_idx].keys.expand(
                    batch_size,
                    *past_key_values_uncondition.layers[layer_idx].keys.shape[1:],
                )
                past_key_values_uncondition.layers[
                    layer_idx
                ].values = past_key_values_uncondition.layers[layer_idx].values.expand(
                    batch_size,
                    *past_key_values_uncondition.layers[layer_idx].values.shape[1:],
                )

        # prepare flash cache once
        prepare_flash_kv_cache(
            past_key_values_condition,
            current_len=token_h * token_w,
            batch_size=batch_size,
            prefix_lengths=condition_prefix_lengths,
        )
        if past_key_values_uncondition is not None:
            prepare_flash_kv_cache(
                past_key_values_uncondition,
                current_len=token_h * token_w,
                batch_size=batch_size,
                prefix_lengths=uncondition_prefix_lengths,
            )

        # init noise image tokens
        grid_h = image_size[1] // self.patch_size
        grid_w = image_size[0] // self.patch_size
        grid_hw = torch.tensor([[grid_h, grid_w]] * batch_size, device=device)

        noise_scale = self.noise_scale
        if self.noise_scale_mode in ("resolution", "dynamic", "dynamic_sqrt"):
            base = float(self.noise_scale_base_image_seq_len)
            scale = math.sqrt((grid_h * grid_w) / (merge_size**2) / base)
            noise_scale = scale * float(self.noise_scale)
            if self.noise_scale_mode == "dynamic_sqrt":
                noise_scale = math.sqrt(noise_scale)
        noise_scale = min(noise_scale, self.noise_scale_max_value)
        image_prediction = noise_scale * _randn_with_seed(
            (batch_size, 3, image_size[1], image_size[0]),
            device=device,
            dtype=dtype,
            seed=seed,
        )

        attention_mask_condition = {"full_attention": None}
        if device.type == "npu" and batch_size > 1 and not npu_fia_available():
            condition_key_valid_mask = condition_key_valid_mask.expand(batch_size, -1)
            image_key_valid_mask = torch.ones(
                (batch_size, token_h * token_w),
                dtype=torch.bool,
                device=device,
            )
            denoise_key_valid_mask = torch.cat(
                [condition_key_valid_mask, image_key_valid_mask], dim=1
            )
            # Ascend SDPA requires an explicit query dimension.
            attention_mask_condition["full_attention"] = (
                denoise_key_valid_mask[:, None, None, :]
                .expand(-1, -1, token_h * token_w, -1)
                .contiguous()
            )
        attention_mask_uncondition = {"full_attention": None}

        timesteps = torch.linspace(0.0, 1.0, num_steps + 1, device=device)
        if enable_timestep_shift:
            timesteps = self._apply_time_schedule(
                timesteps, token_h * token_w, timestep_shift
            )
        denoise_embeddings = None
        if device.type == "npu":
            denoise_embeddings = self.fm_modules["timestep_embedder"](timesteps[:-1])
            if self.add_noise_scale_embedding:
                noise_level = timesteps.new_tensor(
                    [noise_scale / self.noise_scale_max_value]
                )
                denoise_embeddings = denoise_embeddings + self.fm_modules[
                    "noise_scale_embedder"
                ](noise_level)

        # the CFG window for every step, read to the host once
        cfg_window = (
            (timesteps >= cfg_interval[0]) & (timesteps <= cfg_interval[1])
        ).tolist()
        for step_i in range(num_steps):
            t = timesteps[step_i]
            t_next = timesteps[step_i + 1]

            z = self.patchify(image_prediction, self.patch_size * merge_size)
            image_input = self.patchify(
                image_prediction, self.patch_size, channel_first=True
            )
            image_embeds = self.extract_feature(
                image_input.view(batch_size * grid_h * grid_w, -1),
                grid_hw=grid_hw,
            ).view(batch_size, token_h * token_w, -1)
            if denoise_embeddings is not None:
                timestep_embeddings = denoise_embeddings[step_i].view(1, 1, -1)
            else:
                t_expanded = t.expand(batch_size * token_h * token_w)
                timestep_embeddings = self.fm_modules["timestep_embedder"](
                    t_expanded
                ).view(batch_size, token_h * token_w, -1)
                if self.add_noise_scale_embedding:
                    noise_scale_tensor = torch.full_like(
                        t_expanded, noise_scale / self.noise_scale_max_value
                    )
                    timestep_embeddings += self.fm_modules["noise_scale_embedder"](
                        noise_scale_tensor
                    ).view(batch_size, token_h * token_w, -1)
            image_embeds = image_embeds + timestep_embeddings

            v_pred_condition = self._t2i_predict_v(
                image_embeds,
                indexes_image_condition,
                attention_mask_condition,
                past_key_values_condition,
                t,
                z,
                image_token_num=token_h * token_w,
                timestep_embeddings=timestep_embeddings,
                image_size=image_size,
            )

            if cfg_window[step_i] and cfg_scale > 1:
                v_pred_uncondition = self._t2i_predict_v(
                    image_embeds,
                    indexes_image_uncondition,
                    attention_mask_uncondition,
                    past_key_values_uncondition,
                    t,
                    z,
                    image_token_num=token_h * token_w,
                    timestep_embeddings=timestep_embeddings,
                    image_size=image_size,
                )
                if cfg_norm == "cfg_zero_star":
                    positive_flat = v_pred_condition.view(batch_size, -1)
                    negative_flat = v_pred_uncondition.view(batch_size, -1)

                    alpha = optimized_scale(positive_flat, negative_flat)
                    alpha = alpha.view(
                        batch_size, *([1] * (len(v_pred_condition.shape) - 1))
                    )
                    alpha = alpha.to(positive_flat.dtype)

                    if step_i <= 0:
                        v_pred = v_pred_condition * 0.0
                    else:
                        v_pred = v_pred_uncondition * alpha + cfg_scale * (
                            v_pred_condition - v_pred_uncondition * alpha
                        )
                else:
                    v_pred = v_pred_uncondition + cfg_scale * (
                        v_pred_condition - v_pred_uncondition
                    )
                    if cfg_norm == "global":
                        norm_v_condition = torch.norm(
                            v_pred_condition, dim=(1, 2), keepdim=True
                        )
                        norm_v_cfg = torch.norm(v_pred, dim=(1, 2), keepdim=True)
                        scale = (norm_v_condition / (norm_v_cfg + 1e-8)).clamp(
                            min=0, max=1.0
                        )
                        v_pred = v_pred * scale
                    elif cfg_norm == "channel":
                        norm_v_condition = torch.norm(
                            v_pred_condition, dim=-1, keepdim=True
                        )
                        norm_v_cfg = torch.norm(v_pred, dim=-1, keepdim=True)
                        scale = (norm_v_condition / (norm_v_cfg + 1e-8)).clamp(
                            min=0, max=1.0
                        )
                        v_pred = v_pred * scale
            else:
                v_pred = v_pred_condition

            z = z + (t_next - t) * v_pred

            image_prediction = self.unpatchify(
                z, self.patch_size * merge_size, image_size[1], image_size[0]
            )

        clear_flash_kv_cache(past_key_values_condition)
        if past_key_values_uncondition is not None:
            clear_flash_kv_cache(past_key_values_uncondition)

        self.last_think_content = think_text
        if think_mode:
            return image_prediction, think_text
        return image_prediction

    @property
    def lm_head(self):
        return self.language_model.get_output_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        return self.language_model.set_input_embeddings(value)

    def set_output_embeddings(self, value):
        return self.language_model.set_output_embeddings(value)
