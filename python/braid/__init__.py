"""braid: a C++/CUDA runtime for training GPT- and Llama-family models.

The heavy lifting lives in the C++ extension ``braid._C``; this package re-exports it.
Tensors cross the boundary through DLPack without copies on the CPU:
``np.from_dlpack(t)``, ``torch.from_dlpack(t)``, ``braid.from_dlpack(array)``.
"""

from braid._C import (  # noqa: F401
    AdamW,
    AdamWConfig,
    GPTModel,
    LRSchedule,
    StepStats,
    Tensor,
    Trainer,
    TransformerConfig,
    cuda_available,
    cuda_device_count,
    from_dlpack,
    memory_stats,
    reset_peak_memory,
    set_log_level,
)

__version__ = "0.1.0"
