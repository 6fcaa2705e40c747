"""The parity gate: h3direct vs ComfyUI traces, per layer (teacher-forced) and free-running."""
