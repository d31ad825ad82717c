"""The bundled demo node and the script ``healthagent demo`` runs on it."""

DEMO_GPUS = 8  # the bundled NVML scenario's GPUs (nvml-h100x8.json), a p5.48xlarge's count
