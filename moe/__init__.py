"""tilecomm.moe: a thin MoE training stack.

router.py (top-k routing, load-balancing losses, capacity), experts.py (grouped SwiGLU experts),
layer.py (MoELayer = router + swappable dispatcher + experts), parallel.py (MoE Parallel Folding rank
groups, identical to Megatron-Core's), model.py (a small transformer, model math only),
parallelize.py (context and tensor parallelism applied after the model is built; parameter roles),
tensor_parallel.py (the TP shards), ops/ (fused ops: RMSNorm, RoPE, SwiGLU, permute, LM head +
cross-entropy, AdamW; Triton on GPUs), optim.py (AdamW over fp32 masters), grads.py (bucketed
gradient reduction, clipping), data.py, trainer.py, profiling.py, checkpoint.py (DCP). The example
examples/pretrain_moe.py puts them together.
"""
from .data import MarkovSource, TokenFile
from .experts import GroupedSwiGLUExperts, SharedExpert
from .layer import LocalDispatcher, MoEConfig, MoELayer, dispatcher_heap_bytes, make_dispatcher, shard_expert_state
from .model import ModelConfig, Transformer, compile_blocks
from .optim import AdamW, cast_parameters
from .parallel import PIPELINE_UNSUPPORTED, ParallelLayout, ProcessGroups
from .parallelize import param_roles, parallelize
from .router import Router, RouterConfig, RouterOutput
from .trainer import TrainConfig, Trainer

__all__ = ["MarkovSource", "TokenFile", "GroupedSwiGLUExperts", "SharedExpert", "LocalDispatcher", "MoEConfig",
           "MoELayer", "dispatcher_heap_bytes", "make_dispatcher", "shard_expert_state", "ModelConfig", "Transformer",
           "compile_blocks", "AdamW",
           "cast_parameters", "PIPELINE_UNSUPPORTED", "ParallelLayout", "ProcessGroups", "param_roles", "parallelize",
           "Router", "RouterConfig", "RouterOutput", "TrainConfig", "Trainer"]
