# TODO(aiter#5882): remove once ROCm/aiter#5882 is in the aiter pin
"""FlyDSL kernel bodies of the in-tree ROCm/aiter#5882 copy (see the package)."""
