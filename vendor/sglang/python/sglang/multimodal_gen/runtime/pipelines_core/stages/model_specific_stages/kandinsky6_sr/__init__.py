# SPDX-License-Identifier: Apache-2.0
"""SR stages and helpers; import stages explicitly to keep config imports lightweight."""
