# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to SGLang project

"""File storage backend helpers for SGLang HiCache."""

from .lru_file_evictor import LRUFileEvictor

__all__ = [
    "LRUFileEvictor",
]
