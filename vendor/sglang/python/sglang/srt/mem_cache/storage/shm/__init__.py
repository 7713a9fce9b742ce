# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to SGLang project

"""Shared memory storage backend for SGLang HiCache."""

from .hicache_shm import HiCacheShm

__all__ = ["HiCacheShm"]
