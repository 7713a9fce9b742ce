"""GEMMs with fused epilogues."""
