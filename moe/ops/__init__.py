"""Fused ops of the MoE model and its optimizer: a Triton kernel for GPUs, a torch reference for CPU
and torch.compile (see _common.py), each differentiable where the model needs it.

rms_norm.py (RMSNorm), rope.py (RoPE on the fused qkv), swiglu.py (SwiGLU), permute.py (EP = 1
token permutation with the routing weights), cross_entropy.py (LM head + cross-entropy in chunks),
adamw.py (one AdamW step with fp32 masters).
"""
from .adamw import adamw_step_
from .cross_entropy import linear_cross_entropy
from .permute import permute, unpermute
from .rms_norm import rms_norm
from .rope import rope_qkv
from .swiglu import swiglu

__all__ = ["adamw_step_", "linear_cross_entropy", "permute", "unpermute", "rms_norm", "rope_qkv", "swiglu"]
