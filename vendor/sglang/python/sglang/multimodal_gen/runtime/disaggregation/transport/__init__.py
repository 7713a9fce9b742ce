# SPDX-License-Identifier: Apache-2.0
"""Transport layer for disaggregated diffusion pipelines."""
