"""Architecture-gate test harness: fake the GPU at the torch.cuda boundary, import
sglang fresh per architecture, and compare its decisions with expectations.toml.

Only ``child.py`` imports torch (in its own interpreter); the rest is stdlib."""
