"""Block-scaled (MXFP8) activation quantizers with GEMM-ready scale layouts."""
