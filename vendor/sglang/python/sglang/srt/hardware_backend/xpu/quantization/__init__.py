# SPDX-License-Identifier: Apache-2.0
"""XPU (Intel GPU) quantization kernels."""
