# SPDX-License-Identifier: Apache-2.0
"""Disaggregation support for diffusion pipelines."""
