# SPDX-License-Identifier: Apache-2.0
"""Pipeline lifecycle stages for the native MiniMax H3 implementation."""
