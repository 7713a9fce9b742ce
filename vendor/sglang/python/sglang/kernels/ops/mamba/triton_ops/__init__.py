from .mamba_ssm import PAD_SLOT_ID
from .ssd_combined import mamba_chunk_scan_combined
from .ssu_dispatch import (
    initialize_mamba_selective_state_update_backend,
    selective_state_update,
)

__all__ = [
    "PAD_SLOT_ID",
    "selective_state_update",
    "mamba_chunk_scan_combined",
    "initialize_mamba_selective_state_update_backend",
]
