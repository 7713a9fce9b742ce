# SPDX-License-Identifier: Apache-2.0
"""Build synthetic generation warmup requests.

Default server warmup should cover a representative serving path before the
first real request, without copying user traffic. It starts from the model's
sampling defaults, then keeps startup bounded by choosing common low-cost
resolution/frame buckets and trimming the denoising step count.

When warmup-calibrated auto residency is active, warmup uses the full default
serving shape but keeps the trimmed step count. Memory depends on the
activation shape rather than the number of repeated denoising steps, so this
directly measures placement headroom without running a full generation or an
extra stateful pipeline request.

Image models may run a tiny second step because first/last step paths often
initialize different kernels or scheduler state. Video models cap frames and
steps to keep startup bounded. Explicit warmup resolutions share this builder;
callers send them through the scheduler client so warmup exercises the same
request transport path as real generation.
"""

import json
from copy import copy
from dataclasses import fields, replace
from typing import Any

from sglang.multimodal_gen.configs.pipeline_configs.base import ModelTaskType
from sglang.multimodal_gen.configs.sample.sampling_params import (
    SamplingParams,
    align_num_frames_for_num_gpus,
    resolve_sequence_shard,
)
from sglang.multimodal_gen.registry import get_pipeline_config_classes
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req
from sglang.multimodal_gen.runtime.server_args import (
    ServerArgs,
    is_ltx2_two_stage_pipeline_name,
)
from sglang.multimodal_gen.runtime.server_args.auto_tune import (
    auto_residency_args_skip_reason,
)
from sglang.multimodal_gen.runtime.utils.common import parse_size
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)

DEFAULT_PLACEHOLDER_PROMPT = "warmup"
DEFAULT_DETAILED_PLACEHOLDER_PROMPT = "A detailed image."
TORCH_COMPILE_REAL_PATH_PREWARM_PROMPTS = (DEFAULT_DETAILED_PLACEHOLDER_PROMPT,)
DEFAULT_LIGHTWEIGHT_IMAGE_RESOLUTION = (64, 64)
SERVER_WARMUP_IMAGE_FALLBACK_RESOLUTION = (512, 512)
SERVER_WARMUP_VIDEO_FALLBACK_RESOLUTION = (832, 480)
SERVER_WARMUP_IMAGE_MAX_AREA = 768 * 768
SERVER_WARMUP_DIFFUSERS_IMAGE_MAX_AREA = 512 * 512
SERVER_WARMUP_VIDEO_MAX_AREA = 832 * 480
SERVER_WARMUP_MAX_VIDEO_FRAMES = 17
SERVER_WARMUP_LTX2_TWO_STAGE_MAX_VIDEO_FRAMES = 25
SERVER_WARMUP_IMAGE_STEPS = 2
SERVER_WARMUP_VIDEO_STEPS = 2
# Two-step schedulers can have one compile-heavy step and one lower-order
# boundary step, leaving no representative steady-state timing sample. Auto
# residency extrapolates this timing to the default request, so collect four
# steps while retaining the shorter warmup for every non-planning path.
AUTO_RESIDENCY_TIMING_STEPS = 4


def get_model_sampling_defaults(server_args: ServerArgs) -> SamplingParams:
    pipeline_class_name = server_args.pipeline_class_name
    if pipeline_class_name:
        config_classes = get_pipeline_config_classes(pipeline_class_name)
        if config_classes is not None:
            _, sampling_params_cls = config_classes
            defaults = sampling_params_cls()
            return _apply_warmup_sampling_overrides(server_args, defaults)

    defaults = SamplingParams.from_pretrained(
        server_args.model_path,
        backend=server_args.backend,
        model_id=server_args.model_id,
    )
    return _apply_warmup_sampling_overrides(server_args, defaults)


def _apply_warmup_sampling_overrides(
    server_args: ServerArgs, defaults: SamplingParams
) -> SamplingParams:
    value = server_args.warmup_sampling_params
    if value is None:
        return defaults
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(
                "--warmup-sampling-params must be a JSON object"
            ) from error
    if not isinstance(value, dict):
        raise ValueError("--warmup-sampling-params must be a JSON object")
    field_names = {item.name for item in fields(defaults)}
    unknown = value.keys() - field_names
    if unknown:
        raise ValueError(
            f"invalid --warmup-sampling-params fields: {', '.join(sorted(unknown))}"
        )
    updated = copy(defaults)
    for name, field_value in value.items():
        # Some model contracts intentionally expose fixed dataclass fields
        # with init=False; a warmup workload still needs to mirror the request.
        object.__setattr__(updated, name, field_value)
    return updated


def _resolve_default_warmup_resolution(
    server_args: ServerArgs,
    sampling_defaults: SamplingParams,
    *,
    server_based_warmup: bool,
) -> tuple[int, int]:
    """Return the default warmup resolution.

    Prefer the model's sampling-default resolution — the most likely real
    request shape — so warmup specializes kernels for it. Server-based image
    warmup used to shrink this to an area cap (``SERVER_WARMUP_IMAGE_MAX_AREA``,
    768x768) to bound startup, but that left a residual first-request
    cold-start when the real request is larger (e.g. 1024x1024 paid ~0.1s of
    first-shape kernel autotuning, measured on H100).
    """
    width = sampling_defaults.width
    height = sampling_defaults.height
    is_image_gen = server_args.pipeline_config.task_type.is_image_gen()
    # graphs replay only the captured shape, so BCG skips the video area cap
    if (
        width is not None
        and height is not None
        and (
            not server_based_warmup
            or is_image_gen
            or server_args.enable_breakable_cuda_graph is True
        )
    ):
        return width, height

    if server_based_warmup:
        return _resolve_representative_warmup_resolution(server_args, sampling_defaults)

    supported_resolutions = sampling_defaults.supported_resolutions
    if supported_resolutions:
        return min(supported_resolutions, key=lambda size: size[0] * size[1])

    if server_args.pipeline_config.task_type.is_image_gen():
        return DEFAULT_LIGHTWEIGHT_IMAGE_RESOLUTION

    return (
        width or DEFAULT_LIGHTWEIGHT_IMAGE_RESOLUTION[0],
        height or DEFAULT_LIGHTWEIGHT_IMAGE_RESOLUTION[1],
    )


def _resolve_representative_warmup_resolution(
    server_args: ServerArgs,
    sampling_defaults: SamplingParams,
) -> tuple[int, int]:
    target_area = _target_warmup_area(server_args)
    alignment = _warmup_resolution_alignment(server_args)

    supported_resolution = _select_supported_warmup_resolution(
        sampling_defaults.supported_resolutions, target_area, alignment
    )
    if supported_resolution is not None:
        return supported_resolution

    width = sampling_defaults.width
    height = sampling_defaults.height
    if width is not None and height is not None:
        return _fit_resolution_to_area(width, height, target_area, alignment)

    width, height = _fallback_warmup_resolution(server_args)
    return _fit_resolution_to_area(width, height, target_area, alignment)


def _target_warmup_area(server_args: ServerArgs) -> int:
    if server_args.pipeline_config.task_type.is_image_gen():
        if getattr(server_args, "backend", None) == "diffusers":
            return SERVER_WARMUP_DIFFUSERS_IMAGE_MAX_AREA
        return SERVER_WARMUP_IMAGE_MAX_AREA
    if _is_video_warmup_task(server_args):
        return SERVER_WARMUP_VIDEO_MAX_AREA
    return (
        DEFAULT_LIGHTWEIGHT_IMAGE_RESOLUTION[0]
        * DEFAULT_LIGHTWEIGHT_IMAGE_RESOLUTION[1]
    )


def _fallback_warmup_resolution(server_args: ServerArgs) -> tuple[int, int]:
    if server_args.pipeline_config.task_type.is_image_gen():
        return SERVER_WARMUP_IMAGE_FALLBACK_RESOLUTION
    if _is_video_warmup_task(server_args):
        return SERVER_WARMUP_VIDEO_FALLBACK_RESOLUTION
    return DEFAULT_LIGHTWEIGHT_IMAGE_RESOLUTION


def _is_video_warmup_task(server_args: ServerArgs) -> bool:
    return server_args.pipeline_config.task_type.is_video_gen()


def _warmup_resolution_alignment(server_args: ServerArgs) -> int:
    pipeline_config = server_args.pipeline_config
    alignment = 16

    vae_stride = getattr(pipeline_config, "vae_stride", None)
    if vae_stride is not None:
        spatial_stride = (
            vae_stride[-2:] if isinstance(vae_stride, (tuple, list)) else (vae_stride,)
        )
        for stride in spatial_stride:
            alignment = max(alignment, int(stride))

    vae_scale_factor = getattr(pipeline_config, "vae_scale_factor", None)
    if vae_scale_factor is not None:
        alignment = max(alignment, int(vae_scale_factor))

    arch_config = getattr(
        getattr(pipeline_config, "vae_config", None), "arch_config", None
    )
    for attr in ("vae_scale_factor", "spatial_compression_ratio"):
        value = getattr(arch_config, attr, None)
        if value is not None:
            alignment = max(alignment, int(value))

    if is_ltx2_two_stage_pipeline_name(server_args.pipeline_class_name):
        vae_scale_factor = pipeline_config.vae_scale_factor
        alignment = max(alignment, 64, int(vae_scale_factor) * 2)

    return alignment


def _select_supported_warmup_resolution(
    supported_resolutions: list[tuple[int, int]] | None,
    target_area: int,
    alignment: int,
) -> tuple[int, int] | None:
    if not supported_resolutions:
        return None

    candidates = [
        resolution
        for resolution in supported_resolutions
        if resolution[0] * resolution[1] <= target_area
        and _is_resolution_aligned(resolution, alignment)
    ]
    if candidates:
        return max(candidates, key=lambda size: size[0] * size[1])

    aligned_resolutions = [
        resolution
        for resolution in supported_resolutions
        if _is_resolution_aligned(resolution, alignment)
    ]
    if aligned_resolutions:
        return min(aligned_resolutions, key=lambda size: size[0] * size[1])
    return None


def _fit_resolution_to_area(
    width: int, height: int, target_area: int, alignment: int
) -> tuple[int, int]:
    """adjust the warmup resolution to balance between warmup time and warmup effect"""
    area = width * height
    if area > target_area:
        scale = (target_area / area) ** 0.5
        width = int(width * scale)
        height = int(height * scale)

    return (
        max(alignment, width // alignment * alignment),
        max(alignment, height // alignment * alignment),
    )


def _halve_num_frames(server_args: ServerArgs, num_frames: int) -> int:
    """Halve the latent frame count, keeping the model's frame arithmetic."""
    if num_frames <= 1:
        return num_frames
    ratio = (
        server_args.pipeline_config.vae_config.arch_config.temporal_compression_ratio
    )
    if not ratio or ratio <= 1:
        return max(1, num_frames // 2)
    latent_frames = (num_frames - 1) // ratio + 1
    # round up: halving 5 latent frames should land on 3 (9 frames), not 2 (5)
    return ((latent_frames + 1) // 2 - 1) * ratio + 1


def _lighter_valid_num_frames(server_args: ServerArgs, num_frames: int) -> int:
    """Largest frame count at or below half that the model's frame contract accepts.

    ``adjust_num_frames`` rounds up (LongLive2 maps 17 frames to 29), so the
    halved count is walked down until it is a fixed point of the contract.
    """
    halved = _halve_num_frames(server_args, num_frames)
    adjust = server_args.pipeline_config.adjust_num_frames
    if halved < adjust(1, log_adjustment=False):
        return num_frames
    for candidate in range(halved, 0, -1):
        adjusted = adjust(candidate, log_adjustment=False)
        if adjusted == candidate:
            return candidate if candidate < num_frames else num_frames
    return num_frames


def lighten_warmup_req(server_args: ServerArgs, req: Req) -> Req | None:
    """Roughly halve a warmup probe, or None once it cannot shrink further.

    Warmup peak memory tracks width * height * num_frames, so a card that could
    not hold the full probe usually holds half of it while still walking the
    same code path. Frames go first: they drive video activation size, and
    cutting them leaves the spatial kernels at their serving shape.
    """
    params = req.sampling_params
    if params is None:
        return None

    num_frames = params.num_frames or 1
    lighter_frames = _lighter_valid_num_frames(server_args, num_frames)
    if lighter_frames < num_frames:
        return _replace_warmup_workload(req, num_frames=lighter_frames)

    width = params.width
    height = params.height
    if not width or not height:
        return None
    alignment = _warmup_resolution_alignment(server_args)
    lighter = _fit_resolution_to_area(width, height, width * height // 2, alignment)
    # below the alignment floor the fit rounds back up; only take a real cut
    if lighter[0] * lighter[1] >= width * height:
        return None
    return _replace_warmup_workload(req, width=lighter[0], height=lighter[1])


def _replace_warmup_workload(req: Req, **changes: int) -> Req:
    lighter = copy(req)
    lighter.sampling_params = replace(req.sampling_params, **changes)
    return lighter


def _is_resolution_aligned(resolution: tuple[int, int], alignment: int) -> bool:
    width, height = resolution
    return width % alignment == 0 and height % alignment == 0


def _resolve_warmup_num_frames(
    server_args: ServerArgs,
    sampling_defaults: SamplingParams,
    *,
    server_based_warmup: bool,
) -> int:
    default_num_frames = getattr(sampling_defaults, "num_frames", 1)
    if not _is_video_warmup_task(server_args):
        return default_num_frames

    # Most tests and a few lightweight integrations use MagicMock server args,
    # whose missing attributes resolve to another mock. Only accept a concrete
    # integer as an explicit override.
    explicit_num_frames = getattr(server_args, "warmup_num_frames", None)
    num_frames = (
        explicit_num_frames
        if isinstance(explicit_num_frames, int)
        else default_num_frames
    )
    if num_frames is None:
        return num_frames

    # explicit frame counts and breakable CUDA graphs must keep the requested
    # latent shape; only default server warmup applies the bounded frame cap
    if (
        not server_based_warmup
        or isinstance(explicit_num_frames, int)
        or getattr(server_args, "enable_breakable_cuda_graph", False) is True
    ):
        warmup_num_frames = num_frames
    else:
        # Multi-GPU LTX two-stage aligns a one-second request to 25 frames;
        # cover its latent shape during warmup
        frame_budget = (
            SERVER_WARMUP_LTX2_TWO_STAGE_MAX_VIDEO_FRAMES
            if is_ltx2_two_stage_pipeline_name(server_args.pipeline_class_name)
            and server_args.num_gpus > 1
            else SERVER_WARMUP_MAX_VIDEO_FRAMES
        )
        warmup_num_frames = min(num_frames, frame_budget)

    return _apply_warmup_frame_contract(
        server_args, sampling_defaults, num_frames=warmup_num_frames
    )


def _apply_warmup_frame_contract(
    server_args: ServerArgs, sampling_defaults: SamplingParams, *, num_frames: int
) -> int:
    """Re-apply the real-request frame contract to a capped warmup frame count.

    Warmup requests skip ``SamplingParams._adjust``, so the cap must run the
    model frame contract itself -- without this, e.g. LongLive2's capped 17
    frames map to 5 latent frames (not divisible by its 8-frame causal block)
    and every server warmup fails silently under fail-open. Pipelines that
    align frames to ``num_gpus`` (rather than sharding the sequence dim) get
    the same latent alignment real requests get.
    """
    num_frames = server_args.pipeline_config.adjust_num_frames(num_frames)
    if (
        sampling_defaults.adjust_frames
        and not resolve_sequence_shard(
            server_args.pipeline_config, sampling_defaults.enable_sequence_shard
        )
        and server_args.num_gpus > 1
    ):
        num_frames = align_num_frames_for_num_gpus(
            num_frames,
            num_gpus=server_args.num_gpus,
            vae_config=server_args.pipeline_config.vae_config,
            round_down=sampling_defaults.num_frames_round_down,
        )
    return num_frames


def resolve_default_workload_shape(
    server_args: ServerArgs,
    sampling_defaults: SamplingParams,
) -> tuple[int | None, int | None, int]:
    """Resolve the serving shape used by warmup-based memory planning."""
    width = sampling_defaults.width
    height = sampling_defaults.height
    if (width is None or height is None) and sampling_defaults.supported_resolutions:
        width, height = max(
            sampling_defaults.supported_resolutions,
            key=lambda size: size[0] * size[1],
        )
    num_frames = sampling_defaults.num_frames or 1
    if num_frames > 1:
        num_frames = _apply_warmup_frame_contract(
            server_args, sampling_defaults, num_frames=num_frames
        )
    return width, height, num_frames


def _resolve_auto_residency_warmup_shape(
    server_args: ServerArgs,
    sampling_defaults: SamplingParams,
    *,
    warmup_shape: tuple[int, int, int | None],
    server_based_warmup: bool,
) -> tuple[int, int, int] | None:
    """Return the full serving shape when bounded warmup is smaller.

    The probe still runs only the bounded warmup step count. Denoising steps
    repeat the same activation shape, so one full-shape forward measures the
    placement constraints directly without paying for a full generation or
    extrapolating a small-shape allocator peak.
    """
    if not server_based_warmup:
        return None
    if auto_residency_args_skip_reason(server_args) is not None:
        return None
    width, height, num_frames = resolve_default_workload_shape(
        server_args, sampling_defaults
    )
    if width is None or height is None:
        return None
    target = (width, height, num_frames)
    if target == warmup_shape:
        return None
    return target


def _effective_cfg_scale(sampling_defaults: SamplingParams) -> float | None:
    if getattr(sampling_defaults, "true_cfg_scale", None) is not None:
        return sampling_defaults.true_cfg_scale
    return getattr(sampling_defaults, "guidance_scale", None)


def _resolve_warmup_steps(
    server_args: ServerArgs,
    sampling_defaults: SamplingParams,
    *,
    server_based_warmup: bool,
) -> int:
    warmup_steps = server_args.warmup_steps
    default_steps = sampling_defaults.num_inference_steps

    # Breakable CUDA graph captures one graph per step-branch at warmup so that
    # serving never records a fresh graph. Run the model's full recommended
    # steps (uncapped) so every step-branch signature is captured up front.
    if (
        getattr(server_args, "enable_breakable_cuda_graph", False) is True
        and default_steps
    ):
        return max(int(default_steps), warmup_steps)

    if not server_based_warmup:
        return warmup_steps

    if server_args.enable_torch_compile and server_args.is_arg_explicitly_set(
        "warmup_steps"
    ):
        return warmup_steps

    default_steps = sampling_defaults.num_inference_steps
    if default_steps is None or default_steps <= warmup_steps:
        return warmup_steps

    if _is_video_warmup_task(server_args):
        return min(default_steps, max(warmup_steps, SERVER_WARMUP_VIDEO_STEPS))

    if server_args.pipeline_config.task_type.is_image_gen():
        return min(default_steps, max(warmup_steps, SERVER_WARMUP_IMAGE_STEPS))

    return warmup_steps


def should_include_warmup_image(
    server_args: ServerArgs, server_based_warmup: bool
) -> bool:
    task_type = server_args.pipeline_config.task_type
    if not supports_synthetic_warmup(server_args):
        return False
    if not task_type.accepts_image_input():
        return False
    if task_type.requires_image_input():
        return True
    if getattr(server_args, "enable_breakable_cuda_graph", False) is True:
        # BCG replays only exact input signatures. A synthetic warmup image
        # flips optional-TI2V pipelines (e.g. LTX-2) into image-conditioned
        # kwargs (denoise-mask -> per-token timestep) that pure T2V serving
        # never produces, so every T2V request would miss the captured
        # graphs and silently run eager. Capture the T2V signature instead;
        # image-conditioned requests fall back to eager.
        return False
    if type(server_args.pipeline_config).__name__ == "GlmImagePipelineConfig":
        return False
    if server_based_warmup:
        return task_type in (ModelTaskType.TI2I, ModelTaskType.TI2V)
    return True


def supports_synthetic_warmup(server_args: ServerArgs) -> bool:
    task_type = server_args.pipeline_config.task_type
    return task_type.is_visual_gen() or task_type.is_mesh_gen()


def build_warmup_reqs(
    server_args: ServerArgs,
    *,
    warmup_resolutions: list[str] | None,
    warmup_input_path: str | None = None,
    return_warmup_result: bool = False,
    server_based_warmup: bool = False,
) -> list[Req]:
    task_type = server_args.pipeline_config.task_type
    if not supports_synthetic_warmup(server_args):
        return []
    sampling_defaults = get_model_sampling_defaults(server_args)

    if warmup_resolutions is None:
        width, height = _resolve_default_warmup_resolution(
            server_args,
            sampling_defaults,
            server_based_warmup=server_based_warmup,
        )
        resolutions: list[tuple[int, int]] = [(width, height)]
    else:
        resolutions = [parse_size(resolution) for resolution in warmup_resolutions]

    negative_prompt: Any = getattr(sampling_defaults, "negative_prompt", None)
    cfg_scale = _effective_cfg_scale(sampling_defaults)
    warmup_steps = _resolve_warmup_steps(
        server_args,
        sampling_defaults,
        server_based_warmup=server_based_warmup,
    )
    warmup_num_frames = _resolve_warmup_num_frames(
        server_args,
        sampling_defaults,
        server_based_warmup=server_based_warmup,
    )
    auto_residency_warmup_shape = (
        _resolve_auto_residency_warmup_shape(
            server_args,
            sampling_defaults,
            warmup_shape=(width, height, warmup_num_frames),
            server_based_warmup=server_based_warmup,
        )
        if warmup_resolutions is None
        else None
    )
    collect_auto_residency_metrics = (
        warmup_resolutions is None
        and server_based_warmup
        and auto_residency_args_skip_reason(server_args) is None
    )
    if collect_auto_residency_metrics and sampling_defaults.num_inference_steps:
        warmup_steps = min(
            int(sampling_defaults.num_inference_steps),
            max(warmup_steps, AUTO_RESIDENCY_TIMING_STEPS),
        )
    shapes = [
        (width, height, warmup_num_frames, False) for width, height in resolutions
    ]
    if auto_residency_warmup_shape is not None:
        # The bounded warmup runs first: its measurement lets the worker size
        # the full-shape probe to the memory the card actually has left. The
        # bounded shape then runs once more so the allocator pool and kernel
        # caches serving starts from are shaped by a serving-sized request,
        # not by the probe (the worker drops the probe's pool before it).
        shapes.append((*auto_residency_warmup_shape, True))
        shapes.append(shapes[0])

    # build warmup reqs
    warmup_reqs = []
    include_warmup_image = should_include_warmup_image(server_args, server_based_warmup)
    for width, height, num_frames, is_probe in shapes:
        req_kwargs = dict(
            task_type=task_type,
            data_type=task_type.data_type(),
            width=width,
            height=height,
            prompt=DEFAULT_PLACEHOLDER_PROMPT,
        )
        req_kwargs["sampling_params"] = copy(sampling_defaults)
        req_kwargs.update(
            negative_prompt=negative_prompt,
            guidance_scale=sampling_defaults.guidance_scale,
            guidance_scale_2=sampling_defaults.guidance_scale_2,
            true_cfg_scale=sampling_defaults.true_cfg_scale,
            num_inference_steps=sampling_defaults.num_inference_steps,
            num_frames=num_frames,
        )
        if (
            server_args.enable_breakable_cuda_graph is True
            and sampling_defaults.image_path
        ):
            # Optional image conditioning changes the captured signature. Use
            # the configured references rather than capturing text-only inputs.
            req_kwargs["image_path"] = sampling_defaults.image_path
        elif include_warmup_image:
            if warmup_input_path is None:
                raise RuntimeError(
                    "Warmup image path is required for image-input model"
                )
            req_kwargs["prompt"] = DEFAULT_PLACEHOLDER_PROMPT
            default_image_path = sampling_defaults.image_path
            image_count = (
                len(default_image_path)
                if isinstance(default_image_path, (list, tuple))
                else 1
            )
            req_kwargs["image_path"] = [warmup_input_path] * max(1, image_count)
        if server_args.enable_cfg_parallel:
            if not req_kwargs.get("negative_prompt"):
                req_kwargs["negative_prompt"] = DEFAULT_PLACEHOLDER_PROMPT
            req_kwargs["do_classifier_free_guidance"] = True
        elif negative_prompt is not None and cfg_scale is not None and cfg_scale > 1.0:
            req_kwargs["do_classifier_free_guidance"] = True

        run_real_path_prewarm = server_based_warmup and server_args.enable_torch_compile
        prompts = (
            (DEFAULT_PLACEHOLDER_PROMPT,) + TORCH_COMPILE_REAL_PATH_PREWARM_PROMPTS
            if run_real_path_prewarm
            else (DEFAULT_PLACEHOLDER_PROMPT,)
        )
        for prompt_idx, prompt in enumerate(prompts):
            prompt_req_kwargs = req_kwargs.copy()
            prompt_req_kwargs["prompt"] = prompt
            prompt_req_kwargs["sampling_params"] = copy(req_kwargs["sampling_params"])
            req = Req(**prompt_req_kwargs)
            if not run_real_path_prewarm or prompt_idx == 0:
                req.set_as_warmup(warmup_steps)
            else:
                req.sampling_params.num_inference_steps = warmup_steps
                req.save_output = False
                req.suppress_logs = True
                req.metrics.suppress_stage_breakdown = True
                req.extra["server_internal_prewarm"] = True
            req.sampling_params.prepare_synthetic_warmup_request_for_queue(
                req, server_args
            )
            if return_warmup_result:
                req.extra["return_warmup_result"] = True
            if server_based_warmup:
                req.extra["server_based_warmup"] = True
            if collect_auto_residency_metrics:
                # Stage timers already synchronize around warmup stages. Keep
                # their values for residency planning instead of discarding
                # the measurements after paying that cost.
                req.metrics.suppress_stage_breakdown = False
            if is_probe:
                req.extra["auto_residency_full_shape_probe"] = True
            warmup_reqs.append(req)

    return warmup_reqs
