"""tilecomm.overlap: tile-level fused compute + communication kernels (all-gather+GEMM,
GEMM+reduce-scatter). Not built yet: see the project's overlap issue. Importing it is safe;
it exports nothing so far."""
__all__: list = []
