"""The InfiniBand/RoCE sysfs tree the tests write: ``healthagent.demo.rdma_tree``, where it lives
because ``healthagent demo --fabric ib`` builds the same node, re-exported for the tests that
import it from here."""

from healthagent.demo.rdma_tree import (ACTIVE, DISABLED, DOWN, HDR, HW_COUNTERS_IB, HW_COUNTERS_ROCE,
                                        IB_COUNTERS, LEGACY_COUNTERS, LINK_UP, NDR, POLLING, Port, RdmaTree,
                                        build_rdma_tree)

__all__ = ["ACTIVE", "DISABLED", "DOWN", "HDR", "HW_COUNTERS_IB", "HW_COUNTERS_ROCE", "IB_COUNTERS",
           "LEGACY_COUNTERS", "LINK_UP", "NDR", "POLLING", "Port", "RdmaTree", "build_rdma_tree"]
