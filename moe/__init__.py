"""tilecomm.moe: router, experts, MoE layer, parallel folding, model and trainer. Not built
yet: see the project's MoE issue. Importing it is safe; it exports nothing so far."""
__all__: list = []
