"""The PCIe AER source on real files under a host root: the GPUs' and adapters' functions are
found, what the kernel writes is read, and anything else (an unreadable file, garbage, a count no
kernel reaches, thousands of functions) is unobserved or ignored, never a count."""

from __future__ import annotations

import os

import pytest

from healthagent.sources import pcie_aer
from healthagent.sources.pcie_aer import MAX_FUNCTIONS, PcieAerSource
from healthagent.sources.sysfs_values import parse_aer_stats
from tests.support.pcie_tree import GPUS, write_gpu_function, write_node, set_aer

T = 1_700_000_000.0


def by_pci(result):
    return {s.pci_bus_id: s for s in result.aer}


def test_the_gpus_and_adapters_functions_are_read(tmp_path):
    functions = write_node(tmp_path)
    set_aer(functions["0000:3a:00.0"], correctable=7, nonfatal=2, fatal=1)
    result = PcieAerSource(str(tmp_path)).collect(T)
    samples = by_pci(result)
    assert set(samples) == {"0000:1a:00.0", "0000:3a:00.0", "0000:4b:00.0", "0000:4f:00.0"}
    assert [(s.role, s.device) for s in result.aer] == [("gpu", ""), ("gpu", ""), ("nic", "mlx5_0"),
                                                        ("nic", "rdmap79s0")]
    bad = samples["0000:3a:00.0"]
    assert (bad.correctable, bad.nonfatal, bad.fatal) == (7, 2, 1)
    assert dict(bad.errors) == {"correctable:RxErr": 7, "nonfatal:CmpltTO": 2, "fatal:CmpltTO": 1}
    assert (samples["0000:1a:00.0"].fatal, samples["0000:1a:00.0"].errors) == (0, {})
    assert result.health.up and result.health.unobserved == ()


def test_a_function_without_aer_files_is_absent_not_an_error(tmp_path):
    functions = write_node(tmp_path)
    for name in ("aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal"):
        (functions["0000:1a:00.0"] / name).unlink()
    result = PcieAerSource(str(tmp_path)).collect(T)
    sample = by_pci(result)["0000:1a:00.0"]
    assert (sample.correctable, sample.nonfatal, sample.fatal) == (None, None, None)
    assert result.health.up and result.health.errors == {}


def test_no_pci_tree_is_a_node_without_functions(tmp_path):
    result = PcieAerSource(str(tmp_path)).collect(T)
    assert result.aer == () and result.health.up


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_file_is_unobserved_and_the_rest_is_read(tmp_path):
    functions = write_node(tmp_path)
    set_aer(functions["0000:1a:00.0"], correctable=3)
    (functions["0000:1a:00.0"] / "aer_dev_fatal").chmod(0)
    result = PcieAerSource(str(tmp_path)).collect(T)
    sample = by_pci(result)["0000:1a:00.0"]
    assert (sample.correctable, sample.fatal) == (3, None)
    assert result.health.unobserved == ("0000:1a:00.0/aer_dev_fatal",)
    assert not result.health.up and result.health.errors == {"unreadable": 1}


def test_a_file_that_cannot_be_opened_is_unobserved(tmp_path):
    """A looping link (ELOOP, whoever reads it): unobserved, and the other files still count."""
    functions = write_node(tmp_path)
    set_aer(functions["0000:1a:00.0"], nonfatal=4)
    fatal = functions["0000:1a:00.0"] / "aer_dev_fatal"
    fatal.unlink()
    fatal.symlink_to("aer_dev_fatal")
    result = PcieAerSource(str(tmp_path)).collect(T)
    sample = by_pci(result)["0000:1a:00.0"]
    assert (sample.nonfatal, sample.fatal) == (4, None)
    assert result.health.unobserved == ("0000:1a:00.0/aer_dev_fatal",)
    assert not result.health.up and result.health.errors == {"unreadable": 1}


def test_a_directory_where_the_file_belongs_is_unobserved(tmp_path):
    functions = write_node(tmp_path)
    (functions["0000:4b:00.0"] / "aer_dev_nonfatal").unlink()
    (functions["0000:4b:00.0"] / "aer_dev_nonfatal").mkdir()
    result = PcieAerSource(str(tmp_path)).collect(T)
    assert by_pci(result)["0000:4b:00.0"].nonfatal is None
    assert result.health.unobserved == ("0000:4b:00.0/aer_dev_nonfatal",)


@pytest.mark.parametrize("text", [
    "RxErr 1\n",  # no TOTAL line
    "RxErr 1\nTOTAL_ERR_FATAL 1\n",  # another severity's total
    "RxErr one\nTOTAL_ERR_COR 1\n",
    "garbage\x00\xff\nTOTAL_ERR_COR 1\n",
    f"RxErr 0\nTOTAL_ERR_COR {2**64 - 1}\n",  # a u64 at its limit: no kernel counts that far
    f"RxErr {2**64 - 1}\nTOTAL_ERR_COR 1\n",
    f"RxErr 0\nTOTAL_ERR_COR {2**64}\n",
    "RxErr 1\nRxErr 1\nTOTAL_ERR_COR 1\n",  # a name twice
    "TOTAL_ERR_COR 1\nTOTAL_ERR_COR 1\n",
    "dev_fatal_errs_bit[3] 1\nTOTAL_ERR_COR 1\n",  # another array's bit
    "RxErr -1\nTOTAL_ERR_COR 0\n",
    "",
    "RxErr 1\n" * 50 + "TOTAL_ERR_COR 1\n",
])
def test_garbage_is_ignored_and_counted_never_a_count(tmp_path, text):
    functions = write_node(tmp_path)
    (functions["0000:1a:00.0"] / "aer_dev_correctable").write_bytes(text.encode("latin-1"))
    result = PcieAerSource(str(tmp_path)).collect(T)
    assert by_pci(result)["0000:1a:00.0"].correctable is None
    assert result.health.errors == {"parse": 1}
    assert result.health.up  # what the kernel cannot write is ignored, not a blind spot


def test_what_the_kernel_writes_is_read():
    text = b"RxErr 0\nBadTLP 2\ndev_cor_errs_bit[12] 5\nTOTAL_ERR_COR 7\n"
    assert parse_aer_stats(text, "correctable") == (7, {"BadTLP": 2, "dev_cor_errs_bit[12]": 5})
    assert parse_aer_stats(b"CmpltTO 0\nTOTAL_ERR_FATAL 0\n", "fatal") == (0, {})
    assert parse_aer_stats(b"CmpltTO 0\nTOTAL_ERR_FATAL 0\n", "nonfatal") is None


def test_thousands_of_functions_are_bounded_and_the_rest_unobserved(tmp_path):
    # A PCI tree with 3000 NVIDIA display functions (garbage or a hostile root): at most
    # MAX_FUNCTIONS are read, the rest are named unobserved, never missing or healthy.
    for i in range(3000):
        write_gpu_function(tmp_path, f"0000:{i // 32:02x}:{i % 32:02x}.0")
    result = PcieAerSource(str(tmp_path)).collect(T)
    assert len(result.aer) == MAX_FUNCTIONS
    assert len(result.health.unobserved) == 3000 - MAX_FUNCTIONS
    assert result.health.errors == {"too_many": 3000 - MAX_FUNCTIONS}
    assert not result.health.up


def test_the_pci_tree_is_scanned_again_only_when_its_listing_changes(tmp_path, monkeypatch):
    write_node(tmp_path)
    scans = []
    real = pcie_aer.gpu_paths
    monkeypatch.setattr(pcie_aer, "gpu_paths", lambda root: scans.append(root) or real(root))
    source = PcieAerSource(str(tmp_path))
    source.collect(T)
    source.collect(T + 10)
    assert len(scans) == 1
    write_gpu_function(tmp_path, "0000:9a:00.0")  # a hot plug
    assert "0000:9a:00.0" in by_pci(source.collect(T + 20))
    assert len(scans) == 2
    assert GPUS[0] in by_pci(source.collect(T + 30))


def test_the_infiniband_demo_nodes_functions_read_healthy(tmp_path):
    """The tree `healthagent demo --fabric ib` runs on: 8 GPUs and 10 ConnectX functions, all read, none
    with an error."""
    from tests.support.rdma_tree import build_rdma_tree

    build_rdma_tree(tmp_path)
    result = PcieAerSource(str(tmp_path)).collect(T)
    roles = [s.role for s in result.aer]
    assert roles.count("gpu") == 8 and roles.count("nic") == 10
    assert all((s.correctable, s.nonfatal, s.fatal, dict(s.errors)) == (0, 0, 0, {}) for s in result.aer)
    assert result.health.up and result.health.errors == {}
