# SPDX-License-Identifier: Apache-2.0
"""Responses built-in tool translation and model-specific implementations."""
