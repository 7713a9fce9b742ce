"""The in-tree Rust TreeCore backend; the factory lives in tree_core_registry."""
