"""CuTe-DSL building blocks shared by the CUTLASS-backed norm fusions."""
