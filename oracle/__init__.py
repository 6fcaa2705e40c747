"""ComfyUI oracle: record per-layer ground-truth traces by driving a real ComfyUI checkout in-process.

The trace vocabulary (file format, inputs files, metrics) belongs to the runtime, `h3direct.traces`; this package
only adds what touches ComfyUI, imported lazily by the subcommands (`python -m oracle record|record-vae|replay`).
"""
