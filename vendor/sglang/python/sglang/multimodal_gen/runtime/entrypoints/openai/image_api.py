# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

import asyncio
import base64
import contextlib
import io
import os
import time
from typing import List, Optional

from fastapi import (
    APIRouter,
    File,
    Form,
    HTTPException,
    Path,
    Query,
    Request,
    UploadFile,
)
from fastapi.responses import FileResponse
from PIL import Image
from pydantic import Json

from sglang.multimodal_gen.configs.sample.glmimage import GlmImageSamplingParams
from sglang.multimodal_gen.configs.sample.sampling_params import (
    SamplingParams,
    generate_request_id,
)
from sglang.multimodal_gen.configs.task_type import DataType
from sglang.multimodal_gen.runtime.entrypoints.openai.prompt_enhancement import (
    maybe_enhance_prompt,
)
from sglang.multimodal_gen.runtime.entrypoints.openai.protocol import (
    ImageGenerationsRequest,
    ImageResponse,
    ImageResponseData,
)
from sglang.multimodal_gen.runtime.entrypoints.openai.storage import cloud_storage
from sglang.multimodal_gen.runtime.entrypoints.openai.stores import IMAGE_STORE
from sglang.multimodal_gen.runtime.entrypoints.openai.utils import (
    add_common_data_to_response,
    build_sampling_params,
    choose_output_image_ext,
    merge_image_input_list,
    process_generation_batch,
    request_extra_value,
    request_field_value,
    request_model_kwargs,
    resolve_sampling_params_cls,
    sanitize_upload_filename,
    save_image_to_path,
    temp_dir_if_disabled,
)
from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch
from sglang.multimodal_gen.runtime.scheduler_client import async_scheduler_client
from sglang.multimodal_gen.runtime.server_args import get_global_server_args
from sglang.srt.observability.trace import extract_trace_headers

router = APIRouter(prefix="/v1/images", tags=["images"])


def _runtime_sampling_quality(quality: str | None) -> str | None:
    """Keep OpenAI's automatic default out of SGLang's sampling contract."""
    return None if quality in (None, "auto") else quality


def _resolve_image_output_format(
    output_format: str | None, sampling_params_cls: type[SamplingParams]
) -> str | None:
    if output_format is not None:
        return output_format
    return sampling_params_cls.default_image_output_format()


def _b64_encode_images(images: list[bytes]) -> list[str]:
    return [base64.b64encode(image).decode("utf-8") for image in images]


async def _upload_and_cleanup_images(paths: list[str]) -> list[str | None]:
    results = await asyncio.gather(
        *(cloud_storage.upload_and_cleanup(path) for path in paths),
        return_exceptions=True,
    )
    # join every upload before a cancellation or failure permits directory cleanup
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _fallback_image_urls(
    request_id: str, num_outputs: int, is_persistent: bool
) -> list[str] | None:
    if not is_persistent:
        return None
    if num_outputs <= 1:
        return [f"/v1/images/{request_id}/content"]
    return [
        f"/v1/images/{request_id}/content?variant={idx}" for idx in range(num_outputs)
    ]


_SUPPORTED_RESPONSE_FORMATS = ("url", "b64_json")


def _raise_if_url_response_undeliverable(resp_format: str, is_persistent: bool) -> None:
    """Reject unusable response formats before generating."""
    if resp_format not in _SUPPORTED_RESPONSE_FORMATS:
        raise HTTPException(
            status_code=400, detail=f"response_format={resp_format} is not supported"
        )
    if resp_format == "url" and not is_persistent and not cloud_storage.is_enabled():
        raise HTTPException(
            status_code=400,
            detail="response_format='url' requires cloud storage to be configured.",
        )


def _select_image_variant_path(item: dict, variant: str | None) -> str | None:
    file_paths = item.get("file_paths")
    if file_paths:
        variant_idx = _image_variant_index(variant)
        if variant_idx is None:
            return None
        if variant_idx < 0 or variant_idx >= len(file_paths):
            return None
        return file_paths[variant_idx]

    if variant not in (None, "0", 0):
        return None
    return item.get("file_path")


def _image_variant_index(variant: str | None) -> int | None:
    try:
        return 0 if variant is None else int(variant)
    except (TypeError, ValueError):
        return None


def _select_image_variant_cloud_url(item: dict, variant: str | None) -> str | None:
    variant_idx = _image_variant_index(variant)
    if variant_idx is None:
        return None

    urls = item.get("urls")
    if urls and 0 <= variant_idx < len(urls):
        return urls[variant_idx]
    if variant_idx == 0:
        return item.get("url")
    return None


def _raise_if_image_variant_not_found(item: dict, variant: str | None) -> None:
    file_paths = item.get("file_paths")
    if not file_paths:
        return

    variant_idx = _image_variant_index(variant)
    if variant_idx is None or variant_idx < 0 or variant_idx >= len(file_paths):
        raise HTTPException(
            status_code=404,
            detail=f"Image variant {variant} not found",
        )


def _build_image_response_kwargs(
    save_file_path_list: list[str],
    resp_format: str,
    prompt: str,
    request_id: str,
    result: OutputBatch,
    *,
    b64_list: list[str] | None = None,
    cloud_url: str | None = None,
    cloud_urls: list[str | None] | None = None,
    fallback_url: str | None = None,
    fallback_urls: list[str] | None = None,
    is_persistent: bool = True,
    resize: str | None = None,
) -> dict:
    """Build ImageResponse data list.

    For b64_json: uses b64_list, the base64 of the returned image bytes.
    For url: uses cloud_url or fallback_url.
    file_path is omitted when is_persistent=False to avoid exposing stale temp paths.
    """
    ret = None
    if resp_format == "b64_json":
        if not b64_list:
            raise ValueError("b64_list required for b64_json response_format")
        data = [
            ImageResponseData(
                b64_json=b64,
                revised_prompt=prompt,
                file_path=os.path.abspath(path) if is_persistent else None,
                resize=resize,
            )
            for b64, path in zip(b64_list, save_file_path_list)
        ]
        ret = {"data": data}
    elif resp_format == "url":
        if cloud_urls is None and cloud_url is not None:
            cloud_urls = [cloud_url]
        if fallback_urls is None and fallback_url is not None:
            fallback_urls = [fallback_url]

        data = []
        for idx, path in enumerate(save_file_path_list):
            url = None
            if cloud_urls is not None and idx < len(cloud_urls):
                url = cloud_urls[idx]
            if not url and fallback_urls is not None and idx < len(fallback_urls):
                url = fallback_urls[idx]
            if not url:
                break
            data.append(
                ImageResponseData(
                    url=url,
                    revised_prompt=prompt,
                    file_path=os.path.abspath(path) if is_persistent else None,
                    resize=resize,
                )
            )

        if len(data) != len(save_file_path_list):
            if cloud_storage.is_enabled():
                raise HTTPException(
                    status_code=502, detail="Cloud storage upload failed."
                )
            raise HTTPException(
                status_code=400,
                detail="response_format='url' requires cloud storage to be configured.",
            )
        ret = {"data": data}
    else:
        raise HTTPException(
            status_code=400, detail=f"response_format={resp_format} is not supported"
        )

    ret = add_common_data_to_response(ret, request_id=request_id, result=result)
    if ret.get("usage") is not None:
        ret["usage"]["image_count"] = len(save_file_path_list)

    return ret


def _get_response_resize(
    sampling_params: SamplingParams, output_image_bytes: bytes | None = None
) -> str | None:
    """Return a generated GLM-Image output's actual size as WIDTHxHEIGHT."""
    if not isinstance(sampling_params, GlmImageSamplingParams):
        return None

    if output_image_bytes is not None:
        try:
            with Image.open(io.BytesIO(output_image_bytes)) as output_image:
                width, height = output_image.size
            return f"{width}x{height}"
        except (OSError, ValueError):
            # Fall back to request metadata if the output cannot be inspected
            # (for example, for a custom output transport).
            pass

    width = sampling_params.requested_width or sampling_params.width
    height = sampling_params.requested_height or sampling_params.height
    if width is None or height is None:
        return None
    return f"{width}x{height}"


def _build_request_sampling_params(request_id: str, **kwargs):
    # Request validation errors are client errors, as in the video API.
    try:
        return build_sampling_params(request_id, **kwargs)
    except (TypeError, ValueError) as e:
        raise HTTPException(status_code=400, detail=str(e)) from e


@router.post("/generations", response_model=ImageResponse)
async def generations(
    request: ImageGenerationsRequest,
    raw_request: Request,
):
    request_id = generate_request_id()
    server_args = get_global_server_args()
    sampling_params_cls = resolve_sampling_params_cls(server_args)
    model_kwargs = request_model_kwargs(request, sampling_params_cls, "image")
    output_format = _resolve_image_output_format(
        request.output_format, sampling_params_cls
    )
    response_format = request.response_format
    if "response_format" not in request.model_fields_set:
        response_format = (
            sampling_params_cls.default_image_response_format() or response_format
        )
    resp_format = (response_format or "b64_json").lower()
    _raise_if_url_response_undeliverable(
        resp_format, server_args.output_path is not None
    )
    ext = choose_output_image_ext(output_format, request.background)
    prompt = await maybe_enhance_prompt(
        raw_request, request.prompt, enabled=request.enhance_prompt, task="image"
    )

    # responses carry the encoded bytes; files are written only to persist or upload them
    write_output_files = (
        server_args.output_path is not None or cloud_storage.is_enabled()
    )
    with temp_dir_if_disabled(server_args.output_path) as output_dir:
        sampling = _build_request_sampling_params(
            request_id,
            prompt=prompt,
            task_type=request.task_type,
            request_data_type=DataType.IMAGE,
            size=request.size,
            width=request.width,
            height=request.height,
            num_outputs_per_prompt=max(1, min(int(request.n or 1), 10)),
            output_file_name=f"{request_id}.{ext}",
            output_path=output_dir,
            save_output=write_output_files,
            return_image_bytes=True,
            num_frames=1,
            seed=request.seed,
            generator_device=request.generator_device,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            true_cfg_scale=request.true_cfg_scale,
            negative_prompt=request.negative_prompt,
            max_sequence_length=request_field_value(request, "max_sequence_length"),
            flow_shift=request_field_value(request, "flow_shift"),
            enable_teacache=request.enable_teacache,
            enable_cache_dit=request_extra_value(request, "enable_cache_dit"),
            cache_dit_params=request_extra_value(request, "cache_dit_params"),
            cfg_gate_step=request_extra_value(request, "cfg_gate_step"),
            attention_backend_override=request_extra_value(
                request, "attention_backend_override"
            ),
            skip_softmax_params=request_extra_value(request, "skip_softmax_params"),
            quality=_runtime_sampling_quality(request.quality),
            output_compression=request.output_compression,
            output_quality=request.output_quality,
            diffusers_kwargs=request.diffusers_kwargs,
            enable_upscaling=request.enable_upscaling,
            upscaling_model_path=request.upscaling_model_path,
            upscaling_scale=request.upscaling_scale,
            perf_dump_path=request.perf_dump_path,
            profile=request.profile,
            num_profiled_timesteps=request.num_profiled_timesteps,
            profile_all_stages=request.profile_all_stages,
            progressive_mode=request_field_value(request, "progressive_mode"),
            progressive_levels=request_field_value(request, "progressive_levels"),
            progressive_delta=request_field_value(request, "progressive_delta"),
            **model_kwargs,
        )
        trace_headers = extract_trace_headers(raw_request.headers)
        batch = prepare_request(
            server_args=server_args,
            sampling_params=sampling,
            external_trace_header=trace_headers,
        )
        # Add diffusers_kwargs if provided
        if request.diffusers_kwargs:
            batch.extra["diffusers_kwargs"] = request.diffusers_kwargs

        save_file_path_list, result = await process_generation_batch(
            async_scheduler_client, batch
        )
        save_file_path = save_file_path_list[0]
        response_resize = _get_response_resize(sampling, result.output_image_bytes[0])

        b64_list = (
            _b64_encode_images(result.output_image_bytes)
            if resp_format == "b64_json"
            else None
        )

        is_persistent = server_args.output_path is not None
        cloud_urls = await _upload_and_cleanup_images(save_file_path_list)
        cloud_url = cloud_urls[0] if cloud_urls else None
        fallback_urls = _fallback_image_urls(
            request_id, len(save_file_path_list), is_persistent
        )
        await IMAGE_STORE.upsert(
            request_id,
            {
                "id": request_id,
                "created_at": int(time.time()),
                "file_path": None if cloud_url or not is_persistent else save_file_path,
                "file_paths": (
                    None
                    if not is_persistent
                    else [
                        None if url else path
                        for path, url in zip(save_file_path_list, cloud_urls)
                    ]
                ),
                "url": cloud_url,
                "urls": cloud_urls,
                "num_outputs": len(save_file_path_list),
            },
        )

        response_kwargs = _build_image_response_kwargs(
            save_file_path_list,
            resp_format,
            prompt,
            request_id,
            result,
            b64_list=b64_list,
            cloud_urls=cloud_urls,
            fallback_urls=fallback_urls,
            is_persistent=is_persistent,
            resize=response_resize,
        )

    return ImageResponse(**response_kwargs)


@router.post("/edits", response_model=ImageResponse)
async def edits(
    raw_request: Request,
    image: Optional[List[UploadFile]] = File(None),
    image_array: Optional[List[UploadFile]] = File(None, alias="image[]"),
    url: Optional[List[str]] = Form(None),
    url_array: Optional[List[str]] = Form(None, alias="url[]"),
    prompt: str = Form(...),
    enhance_prompt: bool = Form(False),
    mask: Optional[UploadFile] = File(None),
    model: Optional[str] = Form(None),
    task_type: Optional[str] = Form(None),
    n: Optional[int] = Form(1),
    response_format: Optional[str] = Form(None),
    size: Optional[str] = Form(None),
    output_format: Optional[str] = Form(None),
    background: Optional[str] = Form("auto"),
    seed: Optional[int] = Form(None),
    generator_device: Optional[str] = Form("cuda"),
    user: Optional[str] = Form(None),
    negative_prompt: Optional[str] = Form(None),
    guidance_scale: Optional[float] = Form(None),
    true_cfg_scale: Optional[float] = Form(None),
    num_inference_steps: Optional[int] = Form(None),
    quality: Optional[str] = Form(None),
    output_quality: Optional[str] = Form("default"),
    output_compression: Optional[int] = Form(None),
    enable_teacache: Optional[bool] = Form(False),
    enable_cache_dit: Optional[bool] = Form(None),
    cache_dit_params: Optional[Json[dict]] = Form(None),
    enable_upscaling: Optional[bool] = Form(False),
    upscaling_model_path: Optional[str] = Form(None),
    upscaling_scale: Optional[int] = Form(4),
    perf_dump_path: Optional[str] = Form(None),
    profile: Optional[bool] = Form(False),
    num_profiled_timesteps: Optional[int] = Form(None),
    profile_all_stages: Optional[bool] = Form(False),
    num_frames: int = Form(1),
):
    request_id = generate_request_id()
    server_args = get_global_server_args()
    sampling_params_cls = resolve_sampling_params_cls(server_args)
    output_format = _resolve_image_output_format(output_format, sampling_params_cls)
    resp_format = (response_format or "b64_json").lower()
    _raise_if_url_response_undeliverable(
        resp_format, server_args.output_path is not None
    )
    # Resolve images from either `image` or `image[]` (OpenAI SDK sends `image[]` when list is provided)
    images = image or image_array
    urls = url or url_array

    if (not images or len(images) == 0) and (not urls or len(urls) == 0):
        raise HTTPException(
            status_code=422, detail="Field 'image' or 'url' is required"
        )

    image_list = merge_image_input_list(images, urls)

    with contextlib.ExitStack() as stack:
        uploads_dir = stack.enter_context(
            temp_dir_if_disabled(server_args.input_save_path)
        )
        output_dir = stack.enter_context(temp_dir_if_disabled(server_args.output_path))

        input_paths = []
        try:
            for idx, img in enumerate(image_list):
                filename = img.filename if hasattr(img, "filename") else f"image_{idx}"
                safe_name = sanitize_upload_filename(filename, f"image_{idx}")
                input_path = await save_image_to_path(
                    img,
                    os.path.join(uploads_dir, f"{request_id}_{idx}_{safe_name}"),
                    prefer_remote_source=server_args.input_save_path is None,
                    uploads_root=uploads_dir,
                )
                input_paths.append(input_path)
        except Exception as e:
            raise HTTPException(
                status_code=400,
                detail=f"Failed to process image source: {str(e)}",
            )

        ext = choose_output_image_ext(output_format, background)
        # responses carry the encoded bytes; files are written only to persist or upload them
        write_output_files = (
            server_args.output_path is not None or cloud_storage.is_enabled()
        )
        prompt = await maybe_enhance_prompt(
            raw_request,
            prompt,
            enabled=enhance_prompt,
            task="image_edit",
            image_paths=input_paths,
        )
        sampling = _build_request_sampling_params(
            request_id,
            prompt=prompt,
            task_type=task_type,
            request_data_type=DataType.IMAGE,
            size=size,
            num_outputs_per_prompt=max(1, min(int(n or 1), 10)),
            output_file_name=f"{request_id}.{ext}",
            output_path=output_dir,
            save_output=write_output_files,
            return_image_bytes=True,
            image_path=input_paths,
            seed=seed,
            generator_device=generator_device,
            negative_prompt=negative_prompt,
            guidance_scale=guidance_scale,
            true_cfg_scale=true_cfg_scale,
            num_inference_steps=num_inference_steps,
            enable_teacache=enable_teacache,
            enable_cache_dit=enable_cache_dit,
            cache_dit_params=cache_dit_params,
            num_frames=num_frames,
            quality=_runtime_sampling_quality(quality),
            output_compression=output_compression,
            output_quality=output_quality,
            enable_upscaling=enable_upscaling,
            upscaling_model_path=upscaling_model_path,
            upscaling_scale=upscaling_scale,
            perf_dump_path=perf_dump_path,
            profile=profile,
            num_profiled_timesteps=num_profiled_timesteps,
            profile_all_stages=profile_all_stages,
        )
        trace_headers = extract_trace_headers(raw_request.headers)
        batch = prepare_request(
            server_args=server_args,
            sampling_params=sampling,
            external_trace_header=trace_headers,
        )
        save_file_path_list, result = await process_generation_batch(
            async_scheduler_client, batch
        )
        save_file_path = save_file_path_list[0]
        response_resize = _get_response_resize(sampling, result.output_image_bytes[0])

        b64_list = (
            _b64_encode_images(result.output_image_bytes)
            if resp_format == "b64_json"
            else None
        )

        is_persistent = server_args.output_path is not None
        is_input_persistent = server_args.input_save_path is not None
        cloud_urls = await _upload_and_cleanup_images(save_file_path_list)
        cloud_url = cloud_urls[0] if cloud_urls else None
        fallback_urls = _fallback_image_urls(
            request_id, len(save_file_path_list), is_persistent
        )
        await IMAGE_STORE.upsert(
            request_id,
            {
                "id": request_id,
                "created_at": int(time.time()),
                "file_path": None if cloud_url or not is_persistent else save_file_path,
                "file_paths": (
                    None
                    if not is_persistent
                    else [
                        None if url else path
                        for path, url in zip(save_file_path_list, cloud_urls)
                    ]
                ),
                "url": cloud_url,
                "urls": cloud_urls,
                "input_image_paths": input_paths if is_input_persistent else None,
                "num_input_images": len(input_paths),
                "num_outputs": len(save_file_path_list),
            },
        )

        response_kwargs = _build_image_response_kwargs(
            save_file_path_list,
            resp_format,
            prompt,
            request_id,
            result,
            b64_list=b64_list,
            cloud_urls=cloud_urls,
            fallback_urls=fallback_urls,
            is_persistent=is_persistent,
            resize=response_resize,
        )

    return ImageResponse(**response_kwargs)


@router.get("/{image_id}/content")
async def download_image_content(
    image_id: str = Path(...), variant: Optional[str] = Query(None)
):
    item = await IMAGE_STORE.get(image_id)
    if not item:
        raise HTTPException(status_code=404, detail="Image not found")

    _raise_if_image_variant_not_found(item, variant)
    file_path = _select_image_variant_path(item, variant)
    if not file_path:
        cloud_url = _select_image_variant_cloud_url(item, variant)
    else:
        cloud_url = None
    if not file_path and cloud_url:
        raise HTTPException(
            status_code=400,
            detail=f"Image has been uploaded to cloud storage. Please use the cloud URL: {cloud_url}",
        )

    if not file_path:
        raise HTTPException(
            status_code=404,
            detail="Image was not persisted on disk (output_path is disabled). Use b64_json response_format or configure cloud storage.",
        )
    if not os.path.exists(file_path):
        raise HTTPException(status_code=404, detail="Image is still being generated")

    ext = os.path.splitext(file_path)[1].lower()
    media_type = "image/jpeg"
    if ext == ".png":
        media_type = "image/png"
    elif ext == ".webp":
        media_type = "image/webp"

    return FileResponse(
        path=file_path, media_type=media_type, filename=os.path.basename(file_path)
    )
