"""Diffusion attention kernels: sparse linear attention and gated delta-net."""
