# SPDX-License-Identifier: Apache-2.0

"""Shared VLA runtime contracts and execution infrastructure."""
