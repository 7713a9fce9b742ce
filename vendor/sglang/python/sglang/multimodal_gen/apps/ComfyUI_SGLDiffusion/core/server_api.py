"""
SGLang Diffusion Server API client.
Provides a low-level interface for interacting with SGLang Diffusion HTTP server.
"""

import contextlib
import json
import os
import re
import time
from typing import Any, Callable, Dict, Optional

import requests

# Server-supplied names used to build a local path for a downloaded video.
_SAFE_VIDEO_ID = re.compile(r"[A-Za-z0-9_-]+")
_VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")
_MAX_VIDEO_BYTES = 2 * 1024**3
_DOWNLOAD_DEADLINE_S = 600


class SGLDiffusionServerAPI:
    """Client for SGLang Diffusion HTTP server API."""

    def __init__(
        self,
        base_url: str,
        api_key: str = "sk-proj-1234567890",
        image_timeout: int = 300,
    ):
        """
        Initialize the API client.

        Args:
            base_url: Base URL of the SGLang Diffusion server (e.g., "http://localhost:30010/v1")
            api_key: API key for authentication (default: "sk-proj-1234567890")
            image_timeout: Seconds to wait for an image generate/edit request
                before timing out. A large job (big size, or a first request
                that triggers torch.compile/warmup) can need more than the
                previous hardcoded 300s.
        """
        self.image_timeout = image_timeout
        # Ensure base_url doesn't end with /v1 if it's already there
        if base_url.endswith("/v1"):
            self.base_url = base_url
        elif base_url.endswith("/v1/"):
            self.base_url = base_url.rstrip("/")
        else:
            self.base_url = f"{base_url.rstrip('/')}/v1"

        self.api_key = api_key
        self.headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {api_key}",
        }

    def get_model_info(self) -> Dict[str, Any]:
        """
        Get information about the model served by this server.

        Returns:
            Dictionary containing model information including:
            - model_path: Path to the model
            - task_type: Type of task (e.g., "T2V", "I2I")
            - pipeline_name: Name of the pipeline
            - num_gpus: Number of GPUs
            - dit_precision: DiT model precision
            - vae_precision: VAE model precision
        """
        try:
            response = requests.get(
                f"{self.base_url}/models", headers=self.headers, timeout=30
            )
            response.raise_for_status()
            data = response.json()
            return data["data"][0]
        except requests.exceptions.RequestException as e:
            raise RuntimeError(f"Failed to get model info: {str(e)}")
        except (KeyError, IndexError) as e:
            raise RuntimeError(f"Unexpected response shape from /models: {str(e)}")

    def generate_image(
        self,
        prompt: str,
        image_path: Optional[str] = None,
        mask_path: Optional[str] = None,
        size: Optional[str] = None,
        width: Optional[int] = None,
        height: Optional[int] = None,
        n: int = 1,
        negative_prompt: Optional[str] = None,
        guidance_scale: Optional[float] = None,
        num_inference_steps: Optional[int] = None,
        seed: Optional[int] = None,
        enable_teacache: bool = False,
        response_format: str = "b64_json",
        quality: Optional[str] = "auto",
        style: Optional[str] = "vivid",
        background: Optional[str] = "auto",
        output_format: Optional[str] = None,
        generator_device: Optional[str] = "cuda",
        enhance_prompt: bool = False,
    ) -> Dict[str, Any]:
        """
        Generate or edit an image using SGLang Diffusion API.
        If image_path is provided, calls the edit endpoint; otherwise calls the generation endpoint.

        Args:
            prompt: Text prompt for image generation/editing
            image_path: Optional path to input image file for editing. If provided, uses edit API.
            mask_path: Optional path to mask image file (only used when image_path is provided)
            size: Image size in format "WIDTHxHEIGHT" (e.g., "1024x1024")
            width: Image width (used if size is not provided)
            height: Image height (used if size is not provided)
            n: Number of images to generate (1-10)
            negative_prompt: Negative prompt to avoid certain elements
            guidance_scale: Classifier-free guidance scale
            num_inference_steps: Number of denoising steps
            seed: Random seed for reproducible generation
            enable_teacache: Enable TEA cache acceleration
            response_format: Response format ("b64_json" or "url")
            quality: Request optimization tier ("auto", "exact",
                "lossless", "high") - only for generation
            style: Image style ("vivid" or "natural") - only for generation
            background: Background type ("auto", "transparent", "opaque")
            output_format: Output format ("png", "jpeg", "webp")
            generator_device: Device for random generator ("cuda" or "cpu")
            enhance_prompt: Rewrite the prompt on the server first

        Returns:
            Dictionary containing the API response with generated/edited image data
        """
        if not prompt:
            raise ValueError("Prompt cannot be empty")

        # Determine size
        if size is None:
            if width is not None and height is not None:
                size = f"{width}x{height}"
            else:
                size = "1024x1024"

        # Build common parameters
        common_params = self._build_image_common_params(
            prompt=prompt,
            size=size,
            n=n,
            response_format=response_format,
            negative_prompt=negative_prompt,
            guidance_scale=guidance_scale,
            num_inference_steps=num_inference_steps,
            seed=seed,
            enable_teacache=enable_teacache,
            background=background,
            output_format=output_format,
            generator_device=generator_device,
            enhance_prompt=enhance_prompt,
        )

        # If image_path is provided, use edit endpoint
        if image_path:
            if not os.path.exists(image_path):
                raise FileNotFoundError(f"Image file not found: {image_path}")

            # Prepare multipart form data for edit
            files: Dict[str, Any] = {}
            data = common_params.copy()

            # Add image file
            files["image"] = (
                os.path.basename(image_path),
                open(image_path, "rb"),
                self._get_content_type(image_path),
            )

            # Add mask file if provided
            if mask_path:
                if not os.path.exists(mask_path):
                    raise FileNotFoundError(f"Mask file not found: {mask_path}")
                files["mask"] = (
                    os.path.basename(mask_path),
                    open(mask_path, "rb"),
                    self._get_content_type(mask_path),
                )

            # Prepare headers for multipart form data
            headers = {
                "Authorization": f"Bearer {self.api_key}",
            }

            try:
                response = requests.post(
                    f"{self.base_url}/images/edits",
                    files=files,
                    data=data,
                    headers=headers,
                    timeout=self.image_timeout,
                )
                response.raise_for_status()
                return response.json()
            except requests.exceptions.RequestException as e:
                raise RuntimeError(f"Failed to edit image: {str(e)}")
            finally:
                # Close file handles
                for file_tuple in files.values():
                    if isinstance(file_tuple, tuple) and len(file_tuple) > 1:
                        file_tuple[1].close()
        else:
            # Use generation endpoint - add generation-specific parameters
            payload = common_params.copy()
            if quality:
                payload["quality"] = quality
            if style:
                payload["style"] = style

            try:
                response = requests.post(
                    f"{self.base_url}/images/generations",
                    json=payload,
                    headers=self.headers,
                    timeout=self.image_timeout,
                )
                response.raise_for_status()
                return response.json()
            except requests.exceptions.RequestException as e:
                raise RuntimeError(f"Failed to generate image: {str(e)}")

    def generate_video(
        self,
        prompt: str,
        size: Optional[str] = None,
        width: Optional[int] = None,
        height: Optional[int] = None,
        seconds: Optional[int] = 4,
        fps: Optional[int] = None,
        num_frames: Optional[int] = None,
        negative_prompt: Optional[str] = None,
        guidance_scale: Optional[float] = None,
        num_inference_steps: Optional[int] = None,
        seed: Optional[int] = None,
        enable_teacache: bool = False,
        generator_device: Optional[str] = "cuda",
        input_reference: Optional[str] = None,
        video_path: Optional[str] = None,
        output_path: Optional[str] = None,
        extra_fields: Optional[Dict[str, Any]] = None,
        progress_callback: Optional[Callable[[int], None]] = None,
        check_interrupt: Optional[Callable[[], None]] = None,
    ) -> Dict[str, Any]:
        """
        Generate a video using SGLang Diffusion API and wait for completion.

        ``progress_callback`` gets the job's ``progress`` (0-100) on each poll.
        ``check_interrupt`` is called between polls and may raise to stop
        waiting; the server has no abort yet, so the job itself keeps running.

        Args:
            prompt: Text prompt for video generation
            size: Video size in format "WIDTHxHEIGHT" (e.g., "1280x720")
            width: Video width (used if size is not provided)
            height: Video height (used if size is not provided)
            seconds: Duration of the video in seconds
            fps: Frames per second
            num_frames: Number of frames (overrides seconds * fps if provided)
            negative_prompt: Negative prompt to avoid certain elements
            guidance_scale: Classifier-free guidance scale
            num_inference_steps: Number of denoising steps
            seed: Random seed for reproducible generation
            enable_teacache: Enable TEA cache acceleration
            generator_device: Device for random generator ("cuda" or "cpu")
            input_reference: Path to input reference image for image-to-video
            video_path: Source clip for video-to-video. A local file is
                uploaded; a URL or server-side path is sent as is
            extra_fields: Model-specific request fields merged into the payload
                last, so a caller can reach a model's own request surface
                (MiniMax-H3's `task`/`conditions`/`target`, per-model flow
                shifts) without this client growing a parameter per model

        Returns:
            Dictionary containing completed video job information with file_path
        """
        if not prompt:
            raise ValueError("Prompt cannot be empty")

        # Determine size
        if size is None:
            if width is not None and height is not None:
                size = f"{width}x{height}"
            else:
                size = "720x1280"

        # Prepare request fields shared by the JSON and multipart paths.
        # `output_path` is deliberately never sent: it used to be the
        # ComfyUI node's own temp directory, which only exists on this
        # machine and breaks as soon as the server runs elsewhere. Letting
        # the server pick its own output location and fetching the result
        # (see below) works for both the local and remote case.
        fields: Dict[str, Any] = {
            "prompt": prompt,
            "size": size,
        }
        if seconds is not None:
            fields["seconds"] = seconds
        if fps is not None:
            fields["fps"] = fps
        if num_frames is not None:
            fields["num_frames"] = num_frames
        if negative_prompt:
            fields["negative_prompt"] = negative_prompt
        if guidance_scale is not None:
            fields["guidance_scale"] = guidance_scale
        if num_inference_steps is not None:
            fields["num_inference_steps"] = num_inference_steps
        if seed is not None and seed >= 0:
            fields["seed"] = seed
        if enable_teacache:
            fields["enable_teacache"] = True
        if generator_device:
            fields["generator_device"] = generator_device
        # merged last so a model-specific field wins over a generic default of
        # the same name (H3 sizes its output from `target`, not `size`)
        if extra_fields:
            fields.update(extra_fields)

        # Upload local files instead of sending their paths: a server on
        # another machine cannot read this machine's filesystem (the images
        # endpoint already does this for image_path). The server takes an
        # uploaded source clip as `video_reference`.
        string_fields: Dict[str, Any] = {}
        uploads: Dict[str, str] = {}
        for form_key, json_key, path in (
            ("input_reference", "input_reference", input_reference),
            ("video_reference", "video_path", video_path),
        ):
            if not path:
                continue
            if self._is_local_file(path):
                uploads[form_key] = path
            else:
                string_fields[json_key] = path

        try:
            if uploads:
                # JSON, not repr: the server json-decodes form values, so a
                # nested dict or False must not arrive as Python's repr
                data = {
                    key: (
                        value if isinstance(value, (str, bytes)) else json.dumps(value)
                    )
                    for key, value in {**fields, **string_fields}.items()
                }
                with contextlib.ExitStack() as stack:
                    files = {
                        form_key: (
                            os.path.basename(path),
                            stack.enter_context(open(path, "rb")),
                            self._get_content_type(path),
                        )
                        for form_key, path in uploads.items()
                    }
                    response = requests.post(
                        f"{self.base_url}/videos",
                        files=files,
                        data=data,
                        headers={"Authorization": f"Bearer {self.api_key}"},
                        timeout=30,
                    )
            else:
                response = requests.post(
                    f"{self.base_url}/videos",
                    json={**fields, **string_fields},
                    headers=self.headers,
                    timeout=30,
                )
            response.raise_for_status()
            video_job = response.json()
            video_id = video_job.get("id")

            # Wait for completion with fixed polling
            poll_interval = 5  # 5 seconds
            max_wait_time = 3600  # 1 hour
            max_consecutive_errors = 5
            consecutive_errors = 0
            start_time = time.time()

            while time.time() - start_time < max_wait_time:
                if check_interrupt:
                    check_interrupt()
                try:
                    status_response = requests.get(
                        f"{self.base_url}/videos/{video_id}",
                        headers=self.headers,
                        timeout=30,
                    )
                    status_response.raise_for_status()
                    status = status_response.json()

                    # Reset error counter on successful request
                    consecutive_errors = 0

                    if progress_callback and status.get("progress") is not None:
                        progress_callback(int(status["progress"]))

                    if status.get("status") == "completed":
                        # Localize outside this try, so a failed download
                        # fails fast instead of being retried as a poll error.
                        break
                    elif status.get("status") == "failed":
                        error = status.get("error", {})
                        error_msg = (
                            error.get("message", "Unknown error")
                            if error
                            else "Unknown error"
                        )
                        raise RuntimeError(f"Video generation failed: {error_msg}")
                except requests.exceptions.ConnectionError as e:
                    # Connection errors - likely server is down
                    consecutive_errors += 1
                    if consecutive_errors >= max_consecutive_errors:
                        raise RuntimeError(
                            f"Lost connection to server after {consecutive_errors} consecutive errors. "
                            f"Server may be unavailable: {str(e)}"
                        )
                except requests.exceptions.RequestException as e:
                    # Other network errors - continue polling but track errors
                    consecutive_errors += 1
                    if consecutive_errors >= max_consecutive_errors:
                        raise RuntimeError(
                            f"Network error after {consecutive_errors} consecutive failures: {str(e)}"
                        )

                # Sleep in short slices so Cancel is honoured within ~1s.
                for _ in range(poll_interval):
                    if check_interrupt:
                        check_interrupt()
                    time.sleep(1)
            else:
                raise TimeoutError(
                    f"Video generation timed out after {max_wait_time} seconds"
                )
            return self._localize_video_result(status, video_id, output_path)
        except requests.exceptions.RequestException as e:
            raise RuntimeError(f"Failed to generate video: {str(e)}")

    def _localize_video_result(
        self, status: Dict[str, Any], video_id: str, output_path: Optional[str]
    ) -> Dict[str, Any]:
        """Make sure ``file_path`` in a completed job points at a local file.

        The server's own ``file_path`` is only readable when the server runs
        on this machine. When it isn't (no such local file), download the
        result through ``GET /videos/{id}/content`` instead of trusting a
        path that belongs to a different filesystem. A job uploaded to cloud
        storage has no file_path and a ``url`` instead; ``/content`` refuses
        those, so it is returned as is and the node fetches the url.
        """
        file_path = status.get("file_path")
        if file_path and os.path.exists(file_path):
            return status
        if not file_path and status.get("url"):
            return status
        if not isinstance(video_id, str) or not _SAFE_VIDEO_ID.fullmatch(video_id):
            raise RuntimeError(f"Refusing to save video with unsafe id {video_id!r}")
        ext = os.path.splitext(file_path or "")[1].lower() or ".mp4"
        if ext not in _VIDEO_EXTENSIONS:
            ext = ".mp4"
        target_dir = os.path.realpath(output_path or os.getcwd())
        os.makedirs(target_dir, exist_ok=True)
        local_path = os.path.realpath(os.path.join(target_dir, f"{video_id}{ext}"))
        if os.path.commonpath([target_dir, local_path]) != target_dir:
            raise RuntimeError(f"Refusing to save video outside {target_dir}")
        deadline = time.monotonic() + _DOWNLOAD_DEADLINE_S
        response = requests.get(
            f"{self.base_url}/videos/{video_id}/content",
            headers=self.headers,
            timeout=300,
            stream=True,
        )
        try:
            response.raise_for_status()
            written = 0
            with open(local_path, "wb") as fh:
                for chunk in response.iter_content(chunk_size=1024 * 1024):
                    written += len(chunk)
                    if written > _MAX_VIDEO_BYTES:
                        raise RuntimeError(
                            f"Video download exceeded {_MAX_VIDEO_BYTES} bytes"
                        )
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"Video download exceeded {_DOWNLOAD_DEADLINE_S}s"
                        )
                    fh.write(chunk)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(local_path)
            raise
        finally:
            close = getattr(response, "close", None)
            if close is not None:
                close()
        status = dict(status)
        status["file_path"] = local_path
        return status

    def _build_image_common_params(
        self,
        prompt: str,
        size: str,
        n: int,
        response_format: str,
        negative_prompt: Optional[str] = None,
        guidance_scale: Optional[float] = None,
        num_inference_steps: Optional[int] = None,
        seed: Optional[int] = None,
        enable_teacache: bool = False,
        background: Optional[str] = None,
        output_format: Optional[str] = None,
        generator_device: Optional[str] = None,
        enhance_prompt: bool = False,
    ) -> Dict[str, Any]:
        """
        Build common parameters for both image generation and editing.

        Returns:
            Dictionary containing common parameters
        """
        params: Dict[str, Any] = {
            "prompt": prompt,
            "size": size,
            "n": max(1, min(n, 10)),
            "response_format": response_format,
        }

        # Add optional parameters
        if negative_prompt:
            params["negative_prompt"] = negative_prompt
        if guidance_scale is not None:
            params["guidance_scale"] = guidance_scale
        if num_inference_steps is not None:
            params["num_inference_steps"] = num_inference_steps
        if seed is not None and seed >= 0:
            params["seed"] = seed
        if enable_teacache:
            params["enable_teacache"] = True
        if background:
            params["background"] = background
        if output_format:
            params["output_format"] = output_format
        if generator_device:
            params["generator_device"] = generator_device
        if enhance_prompt:
            params["enhance_prompt"] = True

        return params

    @staticmethod
    def _is_local_file(path: str) -> bool:
        return not path.startswith(("http://", "https://", "data:")) and os.path.isfile(
            path
        )

    def _get_content_type(self, file_path: str) -> str:
        """Get content type based on file extension."""
        ext = os.path.splitext(file_path)[1].lower()
        content_types = {
            ".png": "image/png",
            ".jpg": "image/jpeg",
            ".jpeg": "image/jpeg",
            ".webp": "image/webp",
            ".mp4": "video/mp4",
            ".webm": "video/webm",
            ".mov": "video/quicktime",
            ".mkv": "video/x-matroska",
        }
        return content_types.get(ext, "image/png")

    def set_lora(
        self,
        lora_nickname: str,
        lora_path: Optional[str] = None,
        target: str = "all",
        strength: Optional[float] = None,
    ) -> Dict[str, Any]:
        """
        Set a LoRA adapter for the specified transformer(s).

        Args:
            lora_nickname: The nickname of the adapter (required).
            lora_path: Path to the LoRA adapter (local path or HF repo id).
                      Required for the first load; optional if re-activating a cached nickname.
            target: Which transformer(s) to apply the LoRA to. One of:
                - "all": Apply to all transformers (default)
                - "transformer": Apply only to the primary transformer (high noise for Wan2.2)
                - "transformer_2": Apply only to transformer_2 (low noise for Wan2.2)
                - "critic": Apply only to the critic model
            strength: LoRA merge strength. The server defaults to 1.0 when
                not given; values < 1.0 reduce the effect.

        Returns:
            Dictionary containing the API response with status and message
        """
        if not lora_nickname:
            raise ValueError("lora_nickname cannot be empty")

        # Prepare request payload
        payload: Dict[str, Any] = {
            "lora_nickname": lora_nickname,
            "target": target,
        }

        # Add optional lora_path if provided
        if lora_path:
            payload["lora_path"] = lora_path
        if strength is not None:
            payload["strength"] = strength

        try:
            response = requests.post(
                f"{self.base_url}/set_lora",
                json=payload,
                headers=self.headers,
                timeout=30,
            )
            response.raise_for_status()
            return response.json()
        except requests.exceptions.RequestException as e:
            raise RuntimeError(f"Failed to set LoRA adapter: {str(e)}")

    def unset_lora(
        self,
        target: str = "all",
    ) -> Dict[str, Any]:
        """
        Unset (unmerge) LoRA weights from the base model.

        Args:
            target: same as set_lora

        Returns:
            Dictionary containing the API response with status and message
        """
        # Prepare request payload
        payload: Dict[str, Any] = {
            "target": target,
        }

        try:
            response = requests.post(
                f"{self.base_url}/unmerge_lora_weights",
                json=payload,
                headers=self.headers,
                timeout=30,
            )
            response.raise_for_status()
            return response.json()
        except requests.exceptions.RequestException as e:
            raise RuntimeError(f"Failed to unset LoRA adapter: {str(e)}")


if __name__ == "__main__":
    api = SGLDiffusionServerAPI(
        base_url="http://localhost:30010/v1", api_key="sk-proj-1234567890"
    )
    model_info = api.get_model_info()
    print(api.get_model_info())
    if model_info.get("task_type") == "T2V" or model_info.get("task_type") == "I2V":
        print(
            api.generate_video(
                prompt="A calico cat playing a piano on stage",
                num_inference_steps=1,
                size="480x480",
            )
        )
    else:
        print(
            api.generate_image(
                prompt="A calico cat playing a piano on stage", size="1024x1024"
            )
        )
