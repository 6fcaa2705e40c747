#!/usr/bin/env bash
# Entrypoint of the DGX Spark image (Dockerfile.spark): say what this container can run, then exec the command.
#   GPU, compute capability, the attention backends that run here and the NVFP4 mode: docker/spark_doctor.py
#   (H3_DOCTOR=full|quick|off). A failing diagnosis is reported and never blocks the command: the shell must open
#   even on a broken install, that is when it is needed most.
#   If the command is `h3direct serve`, the image's HEALTHCHECK is armed to probe its GET /ready.
set -uo pipefail

H3_DOCKER_DIR="${H3_DOCKER_DIR:-/opt/h3direct-docker}"

if [ "$#" -eq 0 ]; then
    set -- bash
fi

# armed first: from here on the container is unhealthy until the service answers /ready
if ! python "${H3_DOCKER_DIR}/healthcheck.py" arm -- "$@"; then
    echo "h3-entrypoint: could not arm the /ready healthcheck; the container will report healthy" >&2
fi

python "${H3_DOCKER_DIR}/spark_doctor.py" >&2
status=$?
if [ "$status" -ne 0 ]; then
    echo "h3-entrypoint: the diagnosis failed (exit ${status}); running the command anyway" >&2
fi

exec "$@"
