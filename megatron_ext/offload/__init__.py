"""Interleaved optimizer offload: fp32 state in host memory, each step's update split between the GPU and the CPU.

``subgroups`` cuts the flat state into subgroups, ``perf_model`` picks how many go to the GPU,
``lanes`` gives the copy lanes (CUDA streams) and a CPU stand-in that defers copies, ``interleaved`` runs the
step. Torch only: ``megatron_ext.megatron.interleaved_offload`` wires it into megatron-core.
"""
