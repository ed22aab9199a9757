"""ft_framework: fine-tune large pretrained language models with less forgetting.

RecAdam (Chen et al. 2020) and the baselines it is compared against, on one GPU, many GPUs
(DeepSpeed ZeRO / FSDP2) or a CPU (a fused C++ step for ZeRO-Offload and FSDP CPU offload).
"""

__version__ = "0.1.0"
