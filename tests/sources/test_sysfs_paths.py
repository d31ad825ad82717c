"""``resolve_in_root`` and ``device_identity``: paths under a host root read as the host would,
never leading outside it, and what tells one registered device from the next."""

from __future__ import annotations

import errno

import pytest

from healthagent.sources.sysfs_paths import device_identity, errno_text, resolve_in_root


@pytest.mark.parametrize("target, expected", [
    ("b", "a/b"),                           # relative to the link's directory
    ("../a/b", "a/b"),
    ("/a/b", "a/b"),                        # absolute: from the host root
    ("../../../../../../a/b", "a/b"),       # .. stops at the host root
    ("./../a/b/../b", "a/b"),
])
def test_resolve_in_root(tmp_path, target, expected):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "link").symlink_to(target)
    assert resolve_in_root(str(tmp_path), "a/link") == str(tmp_path / expected)


def test_resolve_in_root_stops_link_loops(tmp_path):
    (tmp_path / "x").symlink_to("y")
    (tmp_path / "y").symlink_to("x")
    with pytest.raises(OSError) as info:
        resolve_in_root(str(tmp_path), "x")
    assert info.value.errno == errno.ELOOP


def test_a_file_on_the_way_is_enotdir(tmp_path):
    (tmp_path / "ports").write_text("not a directory\n")
    with pytest.raises(NotADirectoryError):
        resolve_in_root(str(tmp_path), "ports/1")


@pytest.mark.parametrize("exc, text", [
    (OSError(errno.ELOOP, "Too many levels of symbolic links"), "ELOOP: Too many levels of symbolic links"),
    (PermissionError(errno.EACCES, "Permission denied", "/x"), "EACCES: Permission denied"),
    (OSError("no errno at all"), "no errno at all"),
])
def test_errno_text_names_the_errno(exc, text):
    assert errno_text(exc) == text


def test_a_link_that_points_outside_is_read_inside_the_root(tmp_path):
    """However many ``..`` a hostile link holds, the answer stays under the host root."""
    (tmp_path / "sys").mkdir()
    (tmp_path / "etc").mkdir()
    (tmp_path / "sys" / "escape").symlink_to("../../../../../etc")
    assert resolve_in_root(str(tmp_path), "sys/escape") == str(tmp_path / "etc")


def test_device_identity_names_the_links_and_the_directory(tmp_path):
    device = tmp_path / "devices" / "efa0"
    device.mkdir(parents=True)
    (device / "device").symlink_to("../../pci/0000:4f:00.0")
    entry = tmp_path / "class_efa0"
    entry.symlink_to("devices/efa0")
    identity = device_identity(str(entry), str(device))
    assert identity[0] == "devices/efa0" and identity[1] == str(device)
    assert identity[-1] == "../../pci/0000:4f:00.0"
    assert device_identity(str(entry), str(device)) == identity


def test_device_identity_of_entries_that_are_no_links_has_no_targets(tmp_path):
    device = tmp_path / "efa0"
    (device / "device").mkdir(parents=True)
    assert device_identity(str(device), str(device))[0] == ""
    assert device_identity(str(device), str(device))[-1] == ""


def test_device_identity_raises_when_the_device_is_gone(tmp_path):
    with pytest.raises(OSError) as info:
        device_identity(str(tmp_path / "efa0"), str(tmp_path / "efa0"))
    assert info.value.errno == errno.ENOENT
