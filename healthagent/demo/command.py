"""``healthagent demo``: write a demo host root (``--prepare``), or run one node's script, the
p5.48xlarge-shaped EFA node (``script.py``; with ``--dra``, one GPU quarantined alone:
``dra_script.py``) or the InfiniBand node (``--fabric ib``, ``ib_script.py``), on a host root in
a temporary directory."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from healthagent.demo.dra_script import run_dra_demo
from healthagent.demo.ib_node import build_ib_demo_root
from healthagent.demo.ib_script import run_ib_demo
from healthagent.demo.node import build_demo_root
from healthagent.demo.prepare import prepare
from healthagent.demo.script import check_command, run_efa_demo, say


def run_demo(args: argparse.Namespace) -> int:
    ib = args.fabric == "ib"
    if args.prepare:
        build = (lambda root: build_ib_demo_root(root).node) if ib else build_demo_root
        node = prepare(Path(args.prepare), args.fabric, args.replace, build)
        say(f"demo host root written to {node.root}")
        say(f"try: {check_command(node)}")
        return 0

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="  log: %(levelname)s %(name)s %(message)s")
    logging.getLogger("healthagent.effects").setLevel(logging.INFO)
    logging.getLogger("healthagent.dra").setLevel(logging.INFO)
    # The stub in NVML's place is what the demo is: its header says so, so the warning that keeps
    # a stub from passing for a real GPU elsewhere would only be a scary first line here.
    logging.getLogger("healthagent.demo.stub_setup").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="healthagent-demo-") as tmp:
        if ib:
            return run_ib_demo(args, Path(tmp))
        if getattr(args, "dra", False):
            return run_dra_demo(args, Path(tmp))
        return run_efa_demo(args, Path(tmp))
