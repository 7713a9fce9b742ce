# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations


def minimax_h3_align_frame_count(frame_count: int) -> int:
    """Snap ``frame_count`` up to the MiniMax H3 17n+5 frame boundary."""
    if frame_count <= 0:
        return 1
    current = int(frame_count)
    return current + (5 - current) % 17


def minimax_h3_video_latent_t(frame_count: int) -> int:
    if frame_count <= 5:
        return 2
    return ((int(frame_count) - 5) // 17) * 5 + 2


def minimax_h3_frame_count_from_video_latent_t(out_t: int) -> int:
    if out_t == 1:
        return 1
    if out_t < 2 or (out_t - 2) % 5 != 0:
        raise ValueError("MiniMax H3 video latent T must be 1 or match 5n+2")
    return 17 * ((int(out_t) - 2) // 5) + 5


def minimax_h3_audio_latent_t(duration_seconds: float) -> int:
    # Rounding happens at the 40 Hz audio latent boundary.
    return int(round(float(duration_seconds) * 40.0))


def minimax_h3_time_shift_sigmas(
    *,
    num_steps: int = 50,
    shift_scale: float = 6.0,
    dmd_steps: tuple[int, ...] | None = None,
) -> list[float]:
    if shift_scale <= 0:
        raise ValueError("MiniMax H3 shift_scale must be > 0")
    if num_steps <= 0:
        raise ValueError("MiniMax H3 num_steps must be > 0")

    import torch

    if dmd_steps is not None:
        if int(num_steps) != len(dmd_steps):
            raise ValueError(
                f"this checkpoint is distilled for {len(dmd_steps)} DiT forwards "
                f"({len(dmd_steps) + 1} sigma grid points); got "
                f"num_inference_steps={num_steps}"
            )
        # trained rungs are unshifted timesteps over 1000; append the final step to sigma 0
        base = torch.tensor(
            [step / 1000.0 for step in dmd_steps] + [0.0], dtype=torch.float32
        )
    else:
        # The rectified-flow sigma range is fixed at [1.0, 0.0].
        base = torch.linspace(
            1.0,
            0.0,
            int(num_steps) + 1,
            device="cpu",
            dtype=torch.float32,
        )
    shifted = float(shift_scale) * base / (1 + (float(shift_scale) - 1) * base)
    shifted, _ = torch.unique_consecutive(shifted, return_counts=True)
    if shifted[-1].item() > 0.0:
        shifted = torch.cat([shifted, torch.tensor([0.0], dtype=shifted.dtype)])
    return [float(value) for value in shifted.tolist()]
