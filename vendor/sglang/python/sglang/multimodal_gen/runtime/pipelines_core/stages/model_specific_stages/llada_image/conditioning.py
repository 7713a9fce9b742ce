# SPDX-License-Identifier: Apache-2.0

from __future__ import annotations

import json
from array import array
from pathlib import Path

import torch

from sglang.multimodal_gen.runtime.distributed import (
    get_local_torch_device,
)
from sglang.multimodal_gen.runtime.managers.memory_managers.component_manager import (
    ComponentUse,
)
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req
from sglang.multimodal_gen.runtime.pipelines_core.stages.base import PipelineStage
from sglang.multimodal_gen.runtime.server_args import ServerArgs
from sglang.multimodal_gen.runtime.utils.hf_diffusers_utils import (
    prepare_diffusers_component_path_for_loading,
)

# srt group globals the diffusion runtime mirrors from its own TP group. srt's
# initialize_model_parallel refuses to run while any of them is set.
_MIRRORED_SRT_GROUPS = ("_TP", "_ATTN_TP", "_MOE_TP", "_MOE_EP")


def _resolve_llada_image_component_path(
    model_root: str,
    server_args: ServerArgs,
    component_name: str,
) -> str:
    override_path = server_args.component_paths.get(component_name)
    if override_path is not None:
        return prepare_diffusers_component_path_for_loading(override_path)
    return str(Path(model_root) / component_name)


def format_llada_image_prompt(prompt: str | None) -> str:
    if prompt is None:
        return "<role>HUMAN</role> Generate an image.\n<role>ASSISTANT</role>\n<IMAGE1>"
    return (
        f"<role>HUMAN</role> Generate an image: {prompt.strip()}\n"
        "<role>ASSISTANT</role>\n<IMAGE1>"
    )


class LLaDAImageTextEncoderRunner:
    """One-shot LLaDA2 prefill runner used to produce diffusion cap features."""

    def __init__(
        self,
        model_root: str,
        queryformer,
        text_projection,
        tokenizer,
        server_args: ServerArgs,
    ) -> None:
        import sglang.srt.distributed.parallel_state as srt_parallel_state
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed.bootstrap import (
            init_layer_runtime,
            init_parallel_runtime,
        )
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import SpawnRanks, create_context, use_context
        from sglang.srt.server_args import ServerArgs as SRTServerArgs

        self.queryformer = queryformer
        self.text_projection = text_projection
        self.tokenizer = tokenizer
        text_encoder_path = _resolve_llada_image_component_path(
            model_root, server_args, "text_encoder"
        )
        text_encoder_config = json.loads(
            (Path(text_encoder_path) / "config.json").read_text()
        )
        if "quantization_config" in text_encoder_config or (
            text_encoder_config.get("llada_fp8_experts", {}).get("enabled")
        ):
            raise ValueError(
                "LLaDA-Image serves only the BF16 checkpoints, such as "
                "inclusionAI/LLaDA-Image, and this text encoder is quantized"
            )
        tokenizer_path = _resolve_llada_image_component_path(
            model_root, server_args, "tokenizer"
        )
        device = get_local_torch_device()
        gpu_id = device.index
        nccl_port = server_args.nccl_port or 29500
        srt_args = SRTServerArgs(
            model_path=text_encoder_path,
            tokenizer_path=tokenizer_path,
            trust_remote_code=server_args.trust_remote_code,
            revision=server_args.revision,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            tp_size=1,
            attention_backend="llada2_cfg_flashinfer",
            disable_cuda_graph=True,
            disable_radix_cache=True,
            chunked_prefill_size=-1,
            max_prefill_tokens=8192,
            max_total_tokens=8192,
            max_running_requests=2,
        )
        self.runtime_context = create_context(
            srt_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=0, gpu_id=gpu_id),
        )
        with use_context(self.runtime_context):
            # The diffusion runtime mirrors its TP group into the srt globals,
            # the MoE groups included. Detach the groups without clearing the
            # encoder context's ranks, then restore the mirror and keep the
            # encoder groups for forwards.
            saved_groups = {
                name: getattr(srt_parallel_state, name) for name in _MIRRORED_SRT_GROUPS
            }
            try:
                for name in _MIRRORED_SRT_GROUPS:
                    setattr(srt_parallel_state, name, None)
                init_parallel_runtime(
                    server_args=srt_args,
                    device=device.type,
                    dist_port=nccl_port,
                )
                init_layer_runtime(model_config=ModelConfig.from_server_args(srt_args))
                self.worker = TpModelWorker(
                    server_args=srt_args,
                    gpu_id=gpu_id,
                    nccl_port=nccl_port,
                )
                # Run the post-construction init phases the srt scheduler drives.
                self.worker.alloc_memory_pool()
                self.worker.init_attention_backends()
                self.worker.init_cuda_graphs()
                self.encoder_groups = {
                    name: getattr(srt_parallel_state, name)
                    for name in _MIRRORED_SRT_GROUPS
                }
            finally:
                for name, group in saved_groups.items():
                    setattr(srt_parallel_state, name, group)
            self.server_args = srt_args
            self.model_runner = self.worker.model_runner
            self.page_size = self.model_runner.page_size
            self.req_to_token_pool, self.token_to_kv_pool_allocator = (
                self.worker.get_memory_pool()
            )
            # The radix-disabled cache srt builds for a full-attention model.
            self.tree_cache = UnifiedRadixCache(
                CacheInitParams(
                    disable=True,
                    req_to_token_pool=self.req_to_token_pool,
                    token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                    page_size=self.page_size,
                    tree_components=(ComponentType.FULL,),
                )
            )

    def _prepare_input_embeds(
        self,
        input_ids: torch.Tensor,
        sequence_lengths: list[int],
        text_lengths: list[int],
        component_context,
    ) -> torch.Tensor:
        embeddings = self.model_runner.model.get_input_embeddings()
        inputs = []
        offset = 0
        with component_context(
            component_name="queryformer", module=self.queryformer
        ) as queryformer:
            assert queryformer is not None
            queryformer_dtype = queryformer.dtype
            for sequence_length, text_length in zip(
                sequence_lengths, text_lengths, strict=True
            ):
                text_ids = input_ids[offset : offset + text_length]
                text_embeds = embeddings(text_ids)
                text_mask = torch.ones(
                    (1, text_length), dtype=torch.bool, device=text_embeds.device
                )
                query_embeds = queryformer(
                    text_embeds.unsqueeze(0).to(dtype=queryformer_dtype),
                    text_mask,
                )
                inputs.append(
                    torch.cat(
                        [text_embeds, query_embeds.squeeze(0).to(text_embeds.dtype)],
                        dim=0,
                    )
                )
                offset += sequence_length
        return torch.cat(inputs, dim=0)

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int, component_context):
        import sglang.multimodal_gen.runtime.distributed.parallel_state as mm_parallel_state
        import sglang.srt.distributed.parallel_state as srt_parallel_state
        from sglang.srt.runtime_context import use_context

        # Restore the encoder context inside the diffusion TP scope.
        with (
            mm_parallel_state.use_tensor_parallel_group(self.encoder_groups["_TP"]),
            use_context(self.runtime_context),
        ):
            # The TP scope points _TP and _ATTN_TP at one group. Use every
            # encoder group the srt layers read during the forward.
            swapped = [name for name in _MIRRORED_SRT_GROUPS if name != "_TP"]
            saved_groups = {name: getattr(srt_parallel_state, name) for name in swapped}
            try:
                for name in swapped:
                    setattr(srt_parallel_state, name, self.encoder_groups[name])
                return self._encode_impl(
                    prompts, max_sequence_length, component_context=component_context
                )
            finally:
                for name, group in saved_groups.items():
                    setattr(srt_parallel_state, name, group)

    def _encode_impl(
        self, prompts: list[str], max_sequence_length: int, component_context
    ):
        from sglang.srt.managers.overlap_utils import resolve_forward_inputs
        from sglang.srt.managers.schedule_batch import Req as SRTReq
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.mem_cache.common import release_kv_cache
        from sglang.srt.model_executor.forward_batch_info import (
            ForwardBatch,
            ForwardMode,
        )
        from sglang.srt.sampling.sampling_params import (
            SamplingParams as SRTSamplingParams,
        )
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        tokenized = self.tokenizer(
            prompts,
            add_special_tokens=True,
            padding=False,
            truncation=True,
            max_length=max_sequence_length,
        ).input_ids
        query_count = int(self.queryformer.config.num_queries)
        reqs = []
        text_lengths = []
        sequence_lengths = []
        for index, text_input_ids in enumerate(tokenized):
            sampling_params = SRTSamplingParams(max_new_tokens=1, temperature=0.0)
            sampling_params.normalize(None)
            sequence_ids = list(text_input_ids) + [0] * query_count
            req = SRTReq(
                rid=f"llada-image-cap-{index}",
                origin_input_text="",
                origin_input_ids=array("q", sequence_ids),
                sampling_params=sampling_params,
                vocab_size=self.worker.model_config.vocab_size,
                eos_token_ids=set(),
                return_hidden_states=True,
                dllm_config=None,
            )
            req.skip_radix_cache_insert = True
            reqs.append(req)
            text_lengths.append(len(text_input_ids))
            sequence_lengths.append(len(sequence_ids))

        chunked_prefill_size = self.server_args.chunked_prefill_size
        if chunked_prefill_size <= 0:
            chunked_prefill_size = None

        adder = PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.token_to_kv_pool_allocator,
            None,
            0.5,
            self.server_args.max_prefill_tokens,
            chunked_prefill_size,
            prefill_max_requests=len(reqs),
            dllm_config=None,
        )
        for req in reqs:
            req.init_next_round_input(self.tree_cache)
            result = adder.add_one_req(
                req, has_chunked_req=False, truncation_align_size=None
            )
            if req not in adder.can_run_list:
                raise RuntimeError(
                    "Insufficient prefill capacity for LLaDA-Image conditioning"
                )
            if result != AddReqResult.CONTINUE:
                break

        if len(adder.can_run_list) != len(reqs):
            raise RuntimeError("Could not batch all LLaDA-Image conditioning prompts")

        batch = ScheduleBatch.init_new(
            reqs=adder.can_run_list,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            model_config=self.worker.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            dllm_config=None,
        )
        try:
            batch.prepare_for_extend()
            batch.forward_mode = ForwardMode.EXTEND
            # The FutureMap argument is only consulted on decode/spec paths.
            resolve_forward_inputs(batch, None)
            forward_batch = ForwardBatch.init_new(
                batch,
                self.model_runner,
                return_hidden_states_before_norm=False,
            )
            forward_batch.input_embeds = self._prepare_input_embeds(
                forward_batch.input_ids,
                sequence_lengths,
                text_lengths,
                component_context=component_context,
            )
            forward_batch.llada_image_conditioning_text_lens_cpu = text_lengths
            model_output = self.model_runner.forward(forward_batch=forward_batch)
            if not self.model_runner.attn_backend.conditioning_mask_active:
                raise RuntimeError(
                    "LLaDA-Image conditioning ran without its block attention mask "
                    "because the forward batch lost the conditioning text lengths"
                )
            hidden_states = model_output.logits_output.hidden_states

            projected = []
            offset = 0
            with component_context(
                component_name="text_projection", module=self.text_projection
            ) as text_projection:
                assert text_projection is not None
                projection_dtype = text_projection.dtype
                for sequence_length in sequence_lengths:
                    output = text_projection(
                        hidden_states[offset : offset + sequence_length]
                        .unsqueeze(0)
                        .to(dtype=projection_dtype)
                    )
                    projected.append(output.squeeze(0))
                    offset += sequence_length
            return projected
        finally:
            for req in reqs:
                if not req.kv.is_kv_released:
                    release_kv_cache(req, self.tree_cache, checkpoint=False)
                elif req.kv.holds_kv:
                    # KV alloc failed after the row grab. Freeing the bare row
                    # avoids the release_kv_cache lifecycle assert.
                    self.req_to_token_pool.free(req)


class LLaDAImageTextConditioningStage(PipelineStage):
    def __init__(self, runner: LLaDAImageTextEncoderRunner) -> None:
        super().__init__()
        self.runner = runner

    def component_uses(
        self, server_args: ServerArgs, stage_name: str | None = None
    ) -> list[ComponentUse]:
        del server_args
        stage_name = self._component_stage_name(stage_name)
        return [
            ComponentUse(stage_name, "queryformer"),
            ComponentUse(stage_name, "text_projection"),
        ]

    @torch.no_grad()
    def forward(self, batch: Req, server_args: ServerArgs) -> Req:
        if not isinstance(batch.prompt, str):
            raise TypeError("LLaDA-Image currently supports one prompt per request")
        do_cfg = batch.guidance_scale > 1.0
        prompts = [format_llada_image_prompt(batch.prompt)]
        if do_cfg:
            prompts.append(format_llada_image_prompt(batch.negative_prompt))

        outputs = self.runner.encode(
            prompts,
            max_sequence_length=batch.max_sequence_length or 2048,
            component_context=self.use_declared_component,
        )
        masks = [
            torch.ones(output.shape[0], dtype=torch.bool, device=output.device)
            for output in outputs
        ]
        output_count = batch.num_outputs_per_prompt
        batch.prompt_embeds = [outputs[0]] * output_count
        batch.prompt_attention_mask = [masks[0]] * output_count
        batch.do_classifier_free_guidance = do_cfg
        if do_cfg:
            batch.negative_prompt_embeds = [outputs[1]] * output_count
            batch.negative_attention_mask = [masks[1]] * output_count
        else:
            batch.negative_prompt_embeds = []
            batch.negative_attention_mask = []
        return batch
