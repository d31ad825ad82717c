"""The expected inventory from the EC2 instance type the firmware names (DMI product_name), read
from real files under a tmp host root and the bundled table."""

from __future__ import annotations

import csv
import io
from importlib import resources

import pytest

from healthagent.sources.instance import (
    PRODUCT_NAME,
    instance_inventory,
    load_table,
    read_instance_type,
    resolve_expected,
)


def host(tmp_path, product_name: bytes | None) -> str:
    root = tmp_path / "host"
    root.mkdir()
    if product_name is not None:
        path = root / PRODUCT_NAME.lstrip("/")
        path.parent.mkdir(parents=True)
        path.write_bytes(product_name)
    return str(root)


@pytest.mark.parametrize("content, inventory", [
    (b"p5.48xlarge\n", ("p5.48xlarge", 8, 32)),
    (b"p4d.24xlarge\n", ("p4d.24xlarge", 8, 4)),
    (b"p3dn.24xlarge", ("p3dn.24xlarge", 8, 1)),
    (b"g4dn.12xlarge\n", ("g4dn.12xlarge", 4, 1)),
    (b"p5e.48xlarge\n", ("p5e.48xlarge", None, 32)),  # GPU count not confirmed: unknown
    (b"m5.large\n", None),                            # an instance type the table does not list
    (b"HVM domU\n", None),                            # a Xen instance: no instance type in DMI
    (b"OpenStack Nova\n", None),
    (b"", None),
    (b"\xff\xfe\x00garbage", None),
    (None, None),                                     # no DMI at all (a container, a laptop root)
])
def test_instance_inventory(tmp_path, content, inventory):
    assert instance_inventory(host(tmp_path, content)) == inventory


def test_an_unreadable_product_name_is_unknown(tmp_path):
    root = host(tmp_path, None)
    (tmp_path / "host" / PRODUCT_NAME.lstrip("/")).mkdir(parents=True)  # a directory, not a file
    assert read_instance_type(root) is None


def loop(path) -> None:
    """The file's path is a pair of links that name each other (ELOOP)."""
    path.parent.mkdir(parents=True)
    (path.parent / "other").symlink_to(path.name)
    path.symlink_to("other")


def file_on_the_way(path) -> None:
    """A file where a directory of the path belongs (ENOTDIR)."""
    path.parent.parent.mkdir(parents=True)
    path.parent.write_text("not a directory\n")


@pytest.mark.parametrize("breaks, errno_name", [(loop, "ELOOP"), (file_on_the_way, "ENOTDIR")])
def test_a_product_name_hidden_by_an_error_is_unknown_and_logged_with_its_errno(tmp_path, caplog, breaks,
                                                                                 errno_name):
    root = host(tmp_path, None)
    breaks(tmp_path / "host" / PRODUCT_NAME.lstrip("/"))
    with caplog.at_level("WARNING", logger="healthagent.sources.instance"):
        assert read_instance_type(root) is None
        assert resolve_expected(root, None, None, efa_from_table=True) == (None, None)
    assert any(errno_name in r.getMessage() for r in caplog.records)


def test_no_product_name_at_all_is_not_logged(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="healthagent.sources.instance"):
        assert read_instance_type(host(tmp_path, None)) is None
    assert caplog.records == []


@pytest.mark.parametrize("configured, resolved", [
    ((None, None), (8, 32)),   # nothing configured: the instance type's counts
    ((7, None), (7, 32)),      # explicit settings always win, each on its own
    ((None, 16), (8, 16)),
    ((0, 0), (0, 0)),          # 0 turns the count check off
    ((8, 32), (8, 32)),
])
def test_explicit_settings_win_field_by_field(tmp_path, configured, resolved):
    root = host(tmp_path, b"p5.48xlarge\n")
    assert resolve_expected(root, *configured, efa_from_table=True) == resolved


@pytest.mark.parametrize("configured, resolved", [
    ((None, None), (8, None)),  # GPUs are hardware; EFA interfaces are chosen at launch
    ((None, 16), (8, 16)),
    ((7, None), (7, None)),
])
def test_the_efa_count_is_expected_only_when_asked(tmp_path, configured, resolved):
    assert resolve_expected(host(tmp_path, b"p5.48xlarge\n"), *configured) == resolved


@pytest.mark.parametrize("content", [b"m5.large\n", None])
def test_unknown_instance_type_leaves_the_expectation_unknown(tmp_path, content):
    root = host(tmp_path, content)
    assert resolve_expected(root, None, None) == (None, None)
    assert resolve_expected(root, None, 4) == (None, 4)


def test_every_row_cites_its_source_and_counts_are_sane():
    text = resources.files("healthagent.policy").joinpath("instance_types.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len({r["instance_type"] for r in rows}) == len(rows)  # no type twice
    for row in rows:
        assert len(row["source"]) > 20, row["instance_type"]
        for key in ("gpus", "efa_devices"):
            assert row[key] == "" or 1 <= int(row[key]) <= 64, (row["instance_type"], key)
    table = load_table()
    assert table["p5.48xlarge"] == (8, 32) and table["p4d.24xlarge"] == (8, 4)
