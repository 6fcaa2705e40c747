"""ComfyUI oracle: record per-layer ground-truth traces by driving a real ComfyUI checkout in-process.

`oracle.traces` (trace and inputs file formats) and `oracle.metrics` import only torch/safetensors; everything
that touches ComfyUI is imported lazily by the subcommands (`python -m oracle record|record-vae|replay`).
"""

from oracle.traces import Inputs, Trace, load_inputs, load_trace, load_vae_inputs, save_trace

__all__ = ["Inputs", "Trace", "load_inputs", "load_trace", "load_vae_inputs", "save_trace"]
