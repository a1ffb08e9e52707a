"""tilecomm.moe: a thin MoE training stack.

router.py (top-k routing, load-balancing losses, capacity), experts.py (grouped SwiGLU experts),
layer.py (MoELayer = router + swappable dispatcher + experts), parallel.py (MoE Parallel Folding rank
groups, identical to Megatron-Core's), model.py (a small transformer; tensor_parallel.py splits its
attention and dense MLPs over a TP group), data.py, trainer.py,
checkpoint.py (DCP). The example examples/pretrain_moe.py puts them together.
"""
from .data import MarkovSource, TokenFile
from .experts import GroupedSwiGLUExperts, SharedExpert
from .layer import LocalDispatcher, MoEConfig, MoELayer, make_dispatcher, shard_expert_state
from .model import ModelConfig, Transformer
from .parallel import PIPELINE_UNSUPPORTED, ParallelLayout, ProcessGroups
from .router import Router, RouterConfig, RouterOutput
from .trainer import TrainConfig, Trainer

__all__ = ["MarkovSource", "TokenFile", "GroupedSwiGLUExperts", "SharedExpert", "LocalDispatcher", "MoEConfig",
           "MoELayer", "make_dispatcher", "shard_expert_state", "ModelConfig", "Transformer", "PIPELINE_UNSUPPORTED", "ParallelLayout", "ProcessGroups",
           "Router", "RouterConfig", "RouterOutput", "TrainConfig", "Trainer"]
