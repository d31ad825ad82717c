"""ResourceSlices as NVIDIA's DRA driver v0.4.1 publishes a node's GPUs, and findings on them.

Shape from kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1 cmd/gpu-kubelet-plugin: driver
``gpu.nvidia.com``, pool named after the node, device ``gpu-<minor>``, string attributes
``type``/``uuid``/``productName``/``brand``/``architecture``, version attributes, the standard
``resource.kubernetes.io/pciBusID``.
"""

from __future__ import annotations

from healthagent.model import Action, Finding

DRA_FLAGS = ("--feature-gates=DRADeviceTaints=true,DRADeviceTaintRules=true",
             "--runtime-config=resource.k8s.io/v1beta2=true")
BUSES = (0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb)


def pci(index: int) -> str:
    return f"0000:{BUSES[index]:02x}:00.0"


def uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-444444444444"


def device(index: int) -> dict:
    def text(value: str) -> dict:
        return {"string": value}

    return {"name": f"gpu-{index}", "attributes": {
        "type": text("gpu"), "uuid": text(uuid(index)), "productName": text("NVIDIA H100 80GB HBM3"),
        "brand": text("Nvidia"), "architecture": text("Hopper"),
        "cudaComputeCapability": {"version": "9.0.0"}, "driverVersion": {"version": "570.133.20"},
        "cudaDriverVersion": {"version": "12.8.0"},
        "resource.kubernetes.io/pciBusID": text(pci(index)),
        "resource.kubernetes.io/pcieRoot": text(f"pci0000:{BUSES[index] - 1:02x}")}}


def resource_slice(node: str, gpus: int, generation: int = 1) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-gpu.nvidia.com-abcde"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": [device(i) for i in range(gpus)]}}


def node_body(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "nvidia.com/gpu.present": "true"}}}


def gpu_finding(index: int, action: Action = Action.RESET_GPU, pci_bus_id: str = "", **kw) -> Finding:
    bus = kw.pop("pci", None) or pci_bus_id or pci(index)
    return Finding(code="GPU_XID", action=action, summary=f"XID 48 on GPU {index}", evidence="NVRM: Xid 48",
                   next_steps="reset the GPU", gpu_index=index, pci_bus_id=bus,
                   uuid=kw.pop("uuid", uuid(index)), xids=(48,), id=index + 1)
