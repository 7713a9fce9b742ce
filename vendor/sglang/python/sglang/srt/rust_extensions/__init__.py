"""Loading support for SGLang's optional Rust extension modules."""

from sglang.srt.rust_extensions.loader import RustBuildMode, load_rust_extension

__all__ = ["RustBuildMode", "load_rust_extension"]
