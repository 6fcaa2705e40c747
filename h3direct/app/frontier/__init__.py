"""Choosing tiers: the speed / quality frontier of the candidate configurations on one machine, and the tiers chosen
from it (`app.tiers` reads them).

`grid.py` the candidates (attention × 8-bit block linears, less the pairs not measured, resolved on the machine),
`cases.py` a path's quality over cases (the result format the benchmark contract shares), `choice.py` the choice
from the measurements, `report.py` the plot and the report. The measurements themselves (speed at the benchmark
contract's workload beside ComfyUI's, quality against ComfyUI's recordings) need ComfyUI and the harness:
`python -m benchmarks.frontier` in a checkout makes them and chooses; `h3direct choose-tiers --frontier F` chooses
again from a frontier's measurements (README, "Choosing tiers on your GPU").
"""
